"""Training-split augmentation on batched tensors, on the device, with a random draw per image.

torchvision's v2 transforms draw one set of random parameters per call, so on a batched tensor
every image gets the same crop and flip; calling them image by image costs more than the training
step on small images. Here one `affine_grid` + `grid_sample` does the random shift (a crop with zero
padding) and rotation of the whole batch, and flips and colour jitter are per-image masks and factors.
Batch mixing (`mixing`: MixUp, CutMix) is torchvision's own: it blends images in pairs and their
labels into soft targets, one draw per batch.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def augment(
    x: torch.Tensor,
    generator: torch.Generator,
    crop_padding: int = 0,
    hflip: bool = False,
    rotation: float = 0.0,
    color_jitter: float = 0.0,
    resized_crop: int = 0,
) -> torch.Tensor:
    """Float NCHW images in 0..1 -> augmented copies (same shape, still in 0..1).

    crop_padding: random shift of up to this many px each way (zeros come in at the edges);
    hflip: mirror half of the images; rotation: uniform in +-degrees; color_jitter: brightness and
    contrast factors uniform in 1 +- this. resized_crop: a random resized crop of this side in
    place of the shift, as torchvision's RandomResizedCrop draws it (8% to all of the area, an
    aspect ratio of 3/4 to 4/3): what fine-tuning feeds a pretrained network.
    """
    n, _, height, width = x.shape

    def uniform(low: float, high: float) -> torch.Tensor:
        return (torch.rand(n, generator=generator) * (high - low) + low).to(x.device)

    if resized_crop:
        x = random_resized_crop(x, resized_crop, uniform(-rotation, rotation), uniform)
    elif crop_padding or rotation:
        angle = uniform(-rotation, rotation) * (math.pi / 180)
        shift = torch.randint(-crop_padding, crop_padding + 1, (2, n), generator=generator).to(
            x.device
        )
        cos, sin = torch.cos(angle).view(n, 1, 1), torch.sin(angle).view(n, 1, 1)
        dx, dy = (2 * shift[0] / width).view(n, 1, 1), (2 * shift[1] / height).view(n, 1, 1)
        # Pixel centres in -1..1 (affine_grid's align_corners=False), written out: affine_grid's
        # batched matrix product with an inner size of 3 is slow on the CPU (docs/benchmarks.md).
        u = ((torch.arange(width, device=x.device) * 2 + 1) / width - 1).view(1, 1, width)
        v = ((torch.arange(height, device=x.device) * 2 + 1) / height - 1).view(1, height, 1)
        grid = torch.stack([cos * u - sin * v + dx, sin * u + cos * v + dy], dim=-1)
        x = F.grid_sample(
            x,
            grid,
            mode="bilinear" if rotation else "nearest",
            padding_mode="zeros",
            align_corners=False,
        )
    if hflip:
        flip = (uniform(0, 1) < 0.5).view(n, 1, 1, 1)
        x = torch.where(flip, x.flip(3), x)
    if color_jitter:
        brightness = uniform(1 - color_jitter, 1 + color_jitter).view(n, 1, 1, 1)
        contrast = uniform(1 - color_jitter, 1 + color_jitter).view(n, 1, 1, 1)
        x = x * brightness
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        x = ((x - mean) * contrast + mean).clamp(0, 1)
    return x


def random_resized_crop(x: torch.Tensor, size: int, degrees: torch.Tensor, uniform) -> torch.Tensor:
    """Each image's random region (area and aspect ratio as RandomResizedCrop draws them,
    clipped to the image), rotated by `degrees`, resampled to `size` x `size` by one
    `grid_sample` for the whole batch."""
    n = x.shape[0]
    area, ratio = uniform(0.08, 1.0), torch.exp(uniform(math.log(3 / 4), math.log(4 / 3)))
    sx = torch.sqrt(area * ratio).clamp(max=1.0).view(n, 1, 1)  # shares of the width, height
    sy = torch.sqrt(area / ratio).clamp(max=1.0).view(n, 1, 1)
    dx, dy = uniform(-1, 1).view(n, 1, 1) * (1 - sx), uniform(-1, 1).view(n, 1, 1) * (1 - sy)
    angle = degrees.view(n, 1, 1) * (math.pi / 180)
    cos, sin = torch.cos(angle), torch.sin(angle)
    u = ((torch.arange(size, device=x.device) * 2 + 1) / size - 1).view(1, 1, size)
    v = ((torch.arange(size, device=x.device) * 2 + 1) / size - 1).view(1, size, 1)
    grid = torch.stack([sx * (cos * u - sin * v) + dx, sy * (sin * u + cos * v) + dy], dim=-1)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def mixing(
    mixup: float, cutmix: float, classes: int | None
) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """torchvision's MixUp and/or CutMix (each its Beta(alpha, alpha) mixing weight; 0 = off),
    one picked per batch when both are on (as torchvision's references do), or None when both
    are off: (images, int64 labels) -> (images mixed in pairs, soft targets whose rows sum to 1).
    Their draws come from torch's global generator (the one a checkpoint saves as "torch")."""
    if not (mixup or cutmix):
        return None
    # here, not at the top: importing torchvision imports torch's compiler (seconds), which the
    # train and sanity stages do not import otherwise
    from torchvision.transforms import v2

    chosen = [v2.MixUp(alpha=mixup, num_classes=classes)] if mixup else []
    chosen += [v2.CutMix(alpha=cutmix, num_classes=classes)] if cutmix else []
    return chosen[0] if len(chosen) == 1 else v2.RandomChoice(chosen)
