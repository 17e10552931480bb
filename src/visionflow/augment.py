"""Training-split augmentation on batched tensors, on the device, with a random draw per image.

torchvision's v2 transforms draw one set of random parameters per call, so on a batched tensor
every image gets the same crop and flip; calling them image by image costs more than the training
step on small images. Here one `affine_grid` + `grid_sample` does the random shift (a crop with zero
padding) and rotation of the whole batch, and flips and colour jitter are per-image masks and factors.
"""

import math

import torch
import torch.nn.functional as F


def augment(
    x: torch.Tensor,
    generator: torch.Generator,
    crop_padding: int = 0,
    hflip: bool = False,
    rotation: float = 0.0,
    color_jitter: float = 0.0,
) -> torch.Tensor:
    """Float NCHW images in 0..1 -> augmented copies (same shape, still in 0..1).

    crop_padding: random shift of up to this many px each way (zeros come in at the edges);
    hflip: mirror half of the images; rotation: uniform in +-degrees; color_jitter: brightness and
    contrast factors uniform in 1 +- this.
    """
    n, _, height, width = x.shape

    def uniform(low: float, high: float) -> torch.Tensor:
        return (torch.rand(n, generator=generator) * (high - low) + low).to(x.device)

    if crop_padding or rotation:
        angle = uniform(-rotation, rotation) * (math.pi / 180)
        shift = torch.randint(-crop_padding, crop_padding + 1, (2, n), generator=generator).to(
            x.device
        )
        cos, sin = torch.cos(angle).view(n, 1, 1), torch.sin(angle).view(n, 1, 1)
        dx, dy = (2 * shift[0] / width).view(n, 1, 1), (2 * shift[1] / height).view(n, 1, 1)
        # Pixel centres in -1..1 (affine_grid's align_corners=False), written out: affine_grid's
        # batched matrix product with an inner size of 3 cost 4% of a training step on the CPU.
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
