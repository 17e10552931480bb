import torch

from visionflow.augment import augment


def images(n=64, size=12):
    x = torch.zeros(n, 1, size, size)
    x[:, :, 4:8, 2:5] = 1.0  # a bright block left of centre
    return x


def test_off_is_identity():
    x = images()
    assert torch.equal(augment(x, torch.Generator().manual_seed(0)), x)


def test_shift_is_per_image_integer_and_keeps_range():
    x = images()
    out = augment(x, torch.Generator().manual_seed(0), crop_padding=2)
    assert out.shape == x.shape and out.min() >= 0 and out.max() <= 1
    assert set(out.unique().tolist()) <= {0.0, 1.0}  # whole-pixel shifts: no blur
    positions = {tuple(torch.nonzero(o[0])[0].tolist()) for o in out}
    assert len(positions) > 5  # each image drew its own shift
    assert all(o.sum() == 12 for o in out)  # the block never leaves a 2 px margin's reach


def test_hflip_mirrors_about_half_the_batch():
    x = images(200)
    out = augment(x, torch.Generator().manual_seed(0), hflip=True)
    flipped = sum(torch.equal(o, x[0].flip(2)) for o in out)
    assert 70 < flipped < 130 and flipped + sum(torch.equal(o, x[0]) for o in out) == 200


def test_rotation_and_jitter_are_seeded_and_bounded():
    x = torch.rand(16, 3, 10, 10)
    a = augment(x, torch.Generator().manual_seed(1), rotation=15, color_jitter=0.3)
    b = augment(x, torch.Generator().manual_seed(1), rotation=15, color_jitter=0.3)
    c = augment(x, torch.Generator().manual_seed(2), rotation=15, color_jitter=0.3)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.min() >= 0 and a.max() <= 1 and not torch.equal(a, x)


def test_shift_and_rotation_sample_where_affine_grid_would():
    import math

    import torch.nn.functional as F

    x = torch.rand(6, 3, 9, 14)
    out = augment(x, torch.Generator().manual_seed(3), crop_padding=2, rotation=20)
    g = torch.Generator().manual_seed(3)  # the same draws, in augment's order
    angle = (torch.rand(6, generator=g) * 40 - 20) * (math.pi / 180)
    shift = torch.randint(-2, 3, (2, 6), generator=g)
    cos, sin = torch.cos(angle), torch.sin(angle)
    theta = torch.stack([torch.stack([cos, -sin, 2 * shift[0] / 14], 1),
                         torch.stack([sin, cos, 2 * shift[1] / 9], 1)], 1)  # fmt: skip
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    expected = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    assert torch.allclose(out, expected, atol=1e-5)
