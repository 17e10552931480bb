import torch

from visionflow.train.augment import augment


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
    theta = torch.stack(
        [
            torch.stack([cos, -sin, 2 * shift[0] / 14], 1),
            torch.stack([sin, cos, 2 * shift[1] / 9], 1),
        ],
        1,
    )
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    expected = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    assert torch.allclose(out, expected, atol=1e-5)


def test_draws_the_same_distribution_as_torchvision_rotation_and_padded_crop():
    """What the bench's plain loop does per PIL image, augment does per batch: the same spread of
    shifts and angles (2 px and 12 degrees instead of 2 and 10 fail the checks below)."""
    import math

    import numpy as np
    from PIL import Image
    from torchvision import transforms

    image = np.zeros((32, 32), np.uint8)
    image[14:18, 6:26], image[10:14, 6:10] = 255, 200  # a bar with a knob: it has an orientation
    n = 2000
    torch.manual_seed(0)
    reference = transforms.Compose(
        [transforms.RandomRotation(10), transforms.RandomCrop(32, padding=2), transforms.ToTensor()]
    )
    theirs = torch.stack([reference(Image.fromarray(image)) for _ in range(n)])
    batch = torch.from_numpy(image).float().div(255).expand(n, 1, 32, 32)
    ours = augment(batch, torch.Generator().manual_seed(0), crop_padding=2, rotation=10)

    def moments(x):
        """Per image: mass, centre of mass (y, x) and orientation in degrees."""
        w = x[:, 0]
        ys, xs = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
        mass = w.sum((1, 2))
        cy, cx = (w * ys).sum((1, 2)) / mass, (w * xs).sum((1, 2)) / mass
        dy, dx = ys - cy.view(-1, 1, 1), xs - cx.view(-1, 1, 1)
        mu20, mu02, mu11 = ((w * a * b).sum((1, 2)) for a, b in ((dx, dx), (dy, dy), (dx, dy)))
        return mass, cy, cx, torch.atan2(2 * mu11, mu20 - mu02) * 90 / math.pi

    (mass, cy, cx, angle), (mass_t, cy_t, cx_t, angle_t) = moments(ours), moments(theirs)
    assert abs(mass.mean() / mass_t.mean() - 1) < 0.02  # zero fill keeps as much of the shape
    assert abs(cy.mean() - cy_t.mean()) < 0.1 and abs(cx.mean() - cx_t.mean()) < 0.1
    assert abs(angle.mean() - angle_t.mean()) < 0.5
    for spread, expected in (
        (cy.std(), cy_t.std()),
        (cx.std(), cx_t.std()),
        (angle.std(), angle_t.std()),
    ):
        assert abs(spread / expected - 1) < 0.08
