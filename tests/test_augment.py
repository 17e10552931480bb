import pytest
import torch

from tests.helpers import ROOT
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


def mixed_epoch(mix, labels, logits_bias, label_smoothing=0.0):
    """One epoch of the training loop over 32 images of `labels` with `mix`, on a linear model
    whose prediction is its bias (`logits_bias`: its weights 0, and nothing moves at lr 0)."""
    import torch.nn as nn

    from visionflow.train.engine import Split, Step, train_one_epoch

    x = torch.randint(0, 256, (32, 4, 4, 3), dtype=torch.uint8, generator=torch.Generator())
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, len(logits_bias)))
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].bias.copy_(torch.tensor(logits_bias))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    split = Split(x, labels, torch.zeros(3), torch.ones(3), torch.Generator(), mix=mix)
    return train_one_epoch(model, optimizer, split, Step(8, label_smoothing=label_smoothing))


def test_mixing_is_off_unless_asked_and_mixes_pairs_into_targets_that_sum_to_1():
    from visionflow.train.augment import mixing

    assert mixing(0.0, 0.0, 5) is None  # params.yaml's default: the loop's own path
    torch.manual_seed(0)
    x, y = torch.rand(15, 3, 10, 10), torch.arange(15) % 5  # y[-1] is not y[0]
    for mix in (mixing(0.4, 0.0, 5), mixing(0.0, 1.0, 5), mixing(0.4, 1.0, 5)):
        images, targets = mix(x, y)
        assert images.shape == x.shape and not torch.equal(images, x)
        assert targets.shape == (15, 5) and torch.allclose(targets.sum(1), torch.ones(15))
        # each image a blend of itself and the one before it, labels in the same shares
        lam = targets[0, y[0]]
        assert torch.allclose(targets[0, y[-1]], 1 - lam) and 0 < lam < 1
    # the draws are torch's global generator's, which a checkpoint saves ("torch")
    both = mixing(0.4, 1.0, 5)
    torch.manual_seed(3)
    first = [both(x, y)[1] for _ in range(6)]
    torch.manual_seed(3)
    assert all(torch.equal(a, both(x, y)[1]) for a in first)


def test_training_accuracy_counts_each_mixed_image_as_its_larger_share():
    """A model that always says class 0, on images labelled 1: without mixing its train accuracy
    is 0; with a mix that gives every image 0.7 of class 0, it is 1 (the larger share), and the
    loss is the soft targets' cross-entropy with label smoothing applied on top."""
    y = torch.ones(32, dtype=torch.int64)

    def mostly_zero(images, labels):  # a stand-in mix with known targets
        soft = torch.nn.functional.one_hot(labels, 3).float() * 0.3
        soft[:, 0] += 0.7
        return images, soft

    plain = mixed_epoch(None, y, [5.0, 0.0, 0.0])
    mixed = mixed_epoch(mostly_zero, y, [5.0, 0.0, 0.0], label_smoothing=0.1)
    assert plain["accuracy"] == 0.0 and mixed["accuracy"] == 1.0
    log_p = torch.log_softmax(torch.tensor([5.0, 0.0, 0.0]), 0)
    smoothed = torch.tensor([0.7, 0.3, 0.0]) * 0.9 + 0.1 / 3
    assert mixed["loss"] == pytest.approx(-(smoothed * log_p).sum().item(), rel=1e-5)


def test_the_trainer_mixes_its_batches_only_when_params_yaml_asks():
    """The stage's trainer (`trainer_for`, from params.yaml): no mixing by default; with
    train.augment.mixup its training batches are mixed (`Trainer.epoch`'s Split), and the
    per-image augmentation, which the sanity grid and the range test share, takes no mixing
    keys. Evaluation reads the splits as they are (`engine.evaluate` has no augmentation)."""
    from visionflow.fit.setup import trainer_for
    from visionflow.params import load_params

    t = load_params(ROOT / "params.yaml").train
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 4))
    trainer = trainer_for(model, t, seed=0, rank=0, world=1, image_size=4, images=32, classes=4)
    assert trainer.mix is None
    on = t.model_copy(update={"augment": t.augment.model_copy(update={"mixup": 0.2})})
    trainer = trainer_for(model, on, seed=0, rank=0, world=1, image_size=4, images=32, classes=4)
    assert trainer.mix is not None and not {"mixup", "cutmix"} & set(trainer.augment)
