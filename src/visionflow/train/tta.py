"""Test-time augmentation: a prediction averaged over views of each image that the model was
trained to take, as fastai's `tta()` averages over its training transforms.

The views are the ones the weights' preprocessing allows. A pretrained torchvision model's input
is a centre crop of the cache (zoo.FineTune: 56 px of a 64 px cache, 224 of 256); it trained on
random regions of the cache resized to that size (train.augment's resized_crop), so the crop
shifted to the four corners is a view too. A model that takes
the whole cached image has no crop to shift. Mirrored copies join when the model trained on
mirrored images (train.augment.hflip); a flip changes what a digit means, so it is not assumed.

The views count equally. fastai's `tta()` moves the mean of its augmented passes a quarter of the
way to the plain prediction (`blend`'s beta 0.25); on the fastai peer benchmark (#58,
docs/benchmarks.md) that weighting, a half, fewer views, more (the whole image, a zoom, rotations)
and draws of the training augmentation gained no more than the equal mean over these ten.

Only the evaluate stage averages: the exported models and predict stay single-pass.
"""

from collections.abc import Iterator

import torch
from torch import nn

from visionflow.train.loading import batches, to_model_input

View = tuple[int, int, bool]  # (top, left, mirrored): the crop's corner in the cache, px


def views(image_size: int, input_size: int, flip: bool) -> list[View]:
    """The centre crop (the single-pass prediction) first, then the corners when the input is a
    crop of the cache, each mirrored too when `flip`."""
    centre, far = (image_size - input_size) // 2, image_size - input_size
    corners = [(0, 0), (0, far), (far, 0), (far, far)] if far > 0 else []
    places = [(centre, centre), *corners]
    return [(top, left, mirrored) for mirrored in (False, True)[: 1 + flip] for top, left in places]


def view(x: torch.Tensor, v: View, size: int) -> torch.Tensor:
    """One view of a normalised NCHW batch; a crop of exactly `size` passes FineTune uncut."""
    top, left, mirrored = v
    x = x[..., top : top + size, left : left + size]
    return x.flip(-1) if mirrored else x


@torch.no_grad()
def each_batch(
    model: nn.Module,
    x: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    batch_size: int,
    chosen: list[View],
    size: int,
) -> Iterator[torch.Tensor]:
    """The softmax of each of the `chosen` views of a batch of the uint8 NHWC images, batch by
    batch (on the CPU), each of shape (views, images, classes)."""
    model.eval()
    for xb, _ in batches(x, torch.zeros(len(x)), batch_size, device=mean.device):
        inputs = to_model_input(xb, mean, std)
        probs = [torch.softmax(model(view(inputs, v, size)).float(), 1) for v in chosen]
        yield torch.stack(probs).cpu()


def view_probs(*args) -> torch.Tensor:
    """`each_batch`'s softmaxes of every image at once, (views, images, classes): to blend them in
    several ways (bench/fastai_peer_bench.py)."""
    return torch.cat(list(each_batch(*args)), 1)


def blend(probs: torch.Tensor, beta: float) -> torch.Tensor:
    """The log of fastai's `tta()` blend of (views, images, classes) softmaxes: the mean over
    the views, moved `beta` of the way to the first (the centre, the single pass): a drop-in for
    logits (argmax, top-k), and `nll_loss` of it is the blended model's loss."""
    return torch.lerp(probs.mean(0), probs[0], beta).log()


def tta_log_probs(*args, beta: float = 0.0) -> torch.Tensor:
    """`blend` of `each_batch`'s softmaxes (the same arguments), their plain mean at `beta` 0,
    batch by batch: only a batch's views are held at once."""
    return torch.cat([blend(probs, beta) for probs in each_batch(*args)])
