"""What the label-issue probe (`visionflow.data.label_issues`) reads of the images: the features
a network's linear layers take (a pretrained backbone's, frozen; or the network's at random
weights), the normalised pixels; and a network's multiply-adds per image (what a train epoch
costs, for `sanity.label_issues: auto`)."""

import math

import numpy as np
import torch
from torch import nn

from visionflow.train import loading


def last(model: nn.Module, kind: type) -> nn.Module:
    """The network's last layer of `kind`: its last nn.Linear is the classifier head of
    torchvision's classifiers and the project's own networks (`fc`, `classifier.3`,
    `heads.head`); its last nn.Conv2d gives the convolutional features."""
    layers = [m for m in model.modules() if isinstance(m, kind)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no {kind.__name__} layer")
    return layers[-1]


def head_input(args, out) -> torch.Tensor:
    """What a classifier head takes: a pretrained backbone's features."""
    return args[0].flatten(1)


def pooled(args, out) -> torch.Tensor:
    """A convolution's output, its mean and maximum over the image per channel: texture and
    colour statistics, whatever the image's size (a random network's, for the probe from
    scratch: bench/label_issues_bench.py measured it)."""
    return torch.cat([out.mean(dim=(2, 3)), out.amax(dim=(2, 3))], dim=1)


@torch.no_grad()
def taken_at(
    model: nn.Module, layer: nn.Module, take, x, mean, std, batch_size: int = 256
) -> np.ndarray:
    """(n, d) float32: `take(args, out)` of `layer` in `model` for uint8 NHWC images `x` (an
    array, memory-mapped or not), normalised with `mean`/`std` as train feeds them; eval mode,
    one forward pass a batch, nothing trained."""
    taken = []
    hook = layer.register_forward_hook(lambda m, args, out: taken.append(take(args, out)))
    model.eval()
    try:
        for start in range(0, len(x), batch_size):
            chunk = torch.from_numpy(np.array(x[start : start + batch_size]))  # a copy: writable
            model(loading.to_model_input(chunk, mean, std))
    finally:
        hook.remove()
    return torch.cat(taken).float().numpy()


def forward_macs(model: nn.Module, channels: int, size: int) -> int:
    """Multiply-adds of one image's forward pass through the network's convolutions and linear
    layers (the bulk of a CNN's; attention's own products are not counted), read from the
    shapes hooks see. torch's FlopCounterMode counts everything, but took 3.5 s here to start."""
    total = 0

    def count(module, args, out) -> None:
        nonlocal total
        if isinstance(module, nn.Conv2d):
            per_output = module.in_channels // module.groups * math.prod(module.kernel_size)
            total += out.numel() * per_output
        else:
            total += out.numel() * module.in_features

    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    hooks = [m.register_forward_hook(count) for m in layers]
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, channels, size, size))
    finally:
        for hook in hooks:
            hook.remove()
    return total


PIXEL_SIDE = 32  # pixel features: images larger than this are averaged down to it (area)


@torch.no_grad()
def pixels(x, mean: torch.Tensor, std: torch.Tensor, batch_size: int = 1024) -> np.ndarray:
    """(n, d) float32: uint8 NHWC images `x` normalised as train feeds them, averaged down to at
    most PIXEL_SIDE px a side (a probe on pixels gains nothing from more, and its cost grows
    with them), flattened."""
    taken = []
    for start in range(0, len(x), batch_size):
        batch = loading.to_model_input(
            torch.from_numpy(np.array(x[start : start + batch_size])),
            mean,
            std,  # writable
        )
        if batch.shape[-1] > PIXEL_SIDE:
            batch = nn.functional.adaptive_avg_pool2d(batch, PIXEL_SIDE)
        taken.append(batch.flatten(1))
    return torch.cat(taken).numpy()
