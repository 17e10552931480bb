"""Test-time augmentation: a prediction averaged over views of each image that the model was
trained to take, as fastai's `tta()` averages over its training transforms.

The views are the ones the weights' preprocessing allows. A pretrained torchvision model's input
is a centre crop of the cache (zoo.FineTune: 56 px of a 64 px cache, 224 of 256); it trained on
random crops of that size, so the crop shifted to the four corners is a view too. A model that takes
the whole cached image has no crop to shift. Mirrored copies join when the model trained on
mirrored images (train.augment.hflip); a flip changes what a digit means, so it is not assumed.

Only the evaluate stage averages: the exported models and predict stay single-pass.
"""

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
def tta_log_probs(
    model: nn.Module,
    x: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    batch_size: int,
    chosen: list[View],
    size: int,
) -> torch.Tensor:
    """The log of the mean softmax over the `chosen` views of every uint8 NHWC image (on the
    CPU): a drop-in for logits (argmax, top-k), and `nll_loss` of it is the averaged model's loss."""
    model.eval()
    outputs = []
    for xb, _ in batches(x, torch.zeros(len(x)), batch_size, device=mean.device):
        inputs = to_model_input(xb, mean, std)
        probs = sum(torch.softmax(model(view(inputs, v, size)).float(), 1) for v in chosen)
        outputs.append((probs / len(chosen)).log().cpu())
    return torch.cat(outputs)
