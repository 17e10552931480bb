"""Training health: each check fires on a case built to trigger it and stays silent on a healthy run."""

import json
import math
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from tests.helpers import ROOT, digits_cache, python_path, write_params
from visionflow.data import sources
from visionflow.params import Health
from visionflow.train import epoch_health, health
from visionflow.train.models import build_model

CLASSES = [str(i) for i in range(10)]


def limits(**changes) -> health.Limits:
    """The shipped train.health thresholds as the stage passes them, with `changes`."""
    return health.Limits(**{**Health().model_dump(), **changes})


STILL = {"crop_padding": 0, "rotation": 0.0}  # no augmentation: the runs below are about the data


# --- the checks, on numbers built for them ---------------------------------------------------


def test_a_flat_loss_names_the_checklist_and_the_label_evidence():
    spread = {c: 10 for c in range(10)}
    finding = health.first_steps([2.30, 2.31, 2.29, 2.30, 2.30] * 10, spread, CLASSES, 1e-3, 0.05)
    assert finding.check == "loss_not_falling"
    assert "chance level for 10 classes is 2.303" in finding.message
    assert finding.message.index("data and labels") < finding.message.index("learning rate")
    assert "train.lr 0.001" in finding.message
    skewed = health.first_steps([2.3] * 50, {3: 90, 4: 10}, CLASSES, 1e-3, 0.05)
    assert "90% of the first 100 labels are class '3': is the data shuffled" in skewed.message
    falling = [2.3 - 0.03 * i for i in range(50)]
    assert health.first_steps(falling, spread, CLASSES, 1e-3, 0.05) is None
    # a first step skipped for a NaN loss is no measure: it read "loss not falling: nan -> 0.002"
    skipped = health.first_steps([math.nan, *falling[1:]], spread, CLASSES, 1e-3, 0.05)
    assert skipped is None
    # label smoothing 0.9 on 2 classes: no loss goes under 0.688, so 0.693 -> 0.689 is most of
    # the way there, not a 0.6% fall
    smooth = epoch_health.guess([0.5, 0.5], smoothing=0.9)
    near = [0.693 - 0.0001 * i for i in range(50)]
    assert health.first_steps(near, {0: 50, 1: 50}, ["a", "b"], 1e-3, 0.05, smooth) is None
    flat = health.first_steps([0.693] * 50, {0: 50, 1: 50}, ["a", "b"], 1e-3, 0.05, smooth)
    assert "(+0.0% of the way to 0.688, label smoothing's least, under" in flat.message


def test_a_rising_or_non_finite_loss_is_divergence():
    rising = health.first_steps([2.3 + i for i in range(50)], {0: 5}, CLASSES, 3.0, 0.05)
    assert rising.check == "diverging" and "learning rate (3) is likely too high" in rising.message
    nan = health.first_steps([2.3] * 40 + [float("nan")] * 10, {0: 5}, CLASSES, 3.0, 0.05)
    assert nan.check == "diverging"
    history = [{"train/loss": v} for v in (1.0, 0.5, 1.4)]
    assert epoch_health.diverging(history, 2.3).message.startswith("diverging at epoch 3")
    assert epoch_health.diverging(history[:2], 2.3) is None
    exploded = epoch_health.diverging([{"train/loss": 2e13}], 2.3)
    assert "train loss 2e+13, over 10x the chance level 2.300" in exploded.message


def test_the_rate_a_divergence_quotes_is_the_one_set_not_one_cycles_warm_up():
    import torch

    from visionflow.train.training import Trainer

    weights = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weights], lr=0.02)
    torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.02, total_steps=100)
    trainer = SimpleNamespace(optimizer=optimizer)
    assert optimizer.param_groups[0]["lr"] < 0.001  # the first steps run at a 25th of the peak
    assert Trainer.set_lr.fget(trainer) == 0.02  # what "divide train.lr by 10" is about
    plain = SimpleNamespace(optimizer=torch.optim.SGD([weights], lr=0.003))
    assert Trainer.set_lr.fget(plain) == 0.003


def test_a_train_loss_that_never_gets_under_chance_level_is_at_chance():
    # efficientnet_b0 from scratch on 600 photos: the first steps fell from far above chance,
    # then every epoch stayed at a guess's loss, and no other check fired
    ten, two = epoch_health.guess([0.1] * 10), epoch_health.guess([0.5, 0.5])
    assert (ten.loss, ten.accuracy, ten.floor) == (pytest.approx(math.log(10)), 0.1, 0.0)
    stuck = [{"train/loss": v, "val/accuracy": 0.1} for v in (2.41, 2.31, 2.305)]
    found = epoch_health.at_chance(stuck, ten)
    assert found.check == "at_chance" and found.epoch == 3
    assert (
        "train loss 2.305 at best over 3 epochs, not 3% of the way from a guess's 2.303 to a "
        "perfect network's 0.000" in found.message
    )
    assert epoch_health.at_chance(stuck[:2], ten) is None  # too early to judge
    learning = [{"train/loss": v} for v in (2.4, 2.1, 1.9)]
    assert epoch_health.at_chance(learning, ten) is None
    # 2 classes at train.lr 1e-4: the train loss a hair under ln 2 for 3 epochs, but val accuracy
    # far above a guess's 0.5 (0.93 by epoch 6): learning slowly, not at chance
    slow = [(0.698, 0.68), (0.692, 0.727), (0.687, 0.75)]
    slow = [{"train/loss": v, "val/accuracy": a} for v, a in slow]
    assert epoch_health.at_chance(slow, two) is None
    assert epoch_health.at_chance([{**h, "val/accuracy": 0.55} for h in slow], two).epoch == 3


def test_a_network_that_learned_only_the_class_shares_is_at_chance():
    # 90/10 labels: always saying the big class scores a loss of 0.325, far under ln 2, and 0.9
    # accuracy, far above 1/2: a network that learned nothing else was never flagged
    skewed = epoch_health.guess([0.9, 0.1])
    assert skewed.loss == pytest.approx(0.3251, abs=1e-4) and skewed.accuracy == 0.9
    prior_only = [{"train/loss": v, "val/accuracy": 0.9} for v in (0.36, 0.33, 0.326)]
    found = epoch_health.at_chance(prior_only, skewed)
    assert found.check == "at_chance" and "from a guess's 0.325 to a perfect" in found.message
    assert "val accuracy 0.90, this network's best 0.90" in found.message
    assert found.evidence["under"] == pytest.approx(0.97 * skewed.loss)
    learned = [{**h, "val/accuracy": 0.97} for h in prior_only]  # above 0.9 + 0.1 / 5
    assert epoch_health.at_chance(learned, skewed) is None
    # a val split with no image of the small class: the guess scores 1.0 there, so 1.0 is no escape
    assert epoch_health.at_chance([{**h, "val/accuracy": 1.0} for h in prior_only], skewed) is None
    all_big = epoch_health.guess([0.9, 0.1], accuracy=1.0)
    assert (
        epoch_health.at_chance([{**h, "val/accuracy": 1.0} for h in prior_only], all_big).epoch == 3
    )
    # one class in training (train.overfit_batches on a class-sorted cache): a guess is perfect,
    # nothing to judge; with smoothing too (the guess is then the smoothed target itself)
    for eps in (0.0, 0.1):
        one = epoch_health.guess([1.0, 0.0], smoothing=eps)
        assert epoch_health.at_chance([{"train/loss": 0.5, "val/accuracy": 1.0}] * 3, one) is None
    # heavy label smoothing: a perfect network's loss (1.876 at 0.6 for 10 classes) sits near a
    # guess's ln 10, so falling 3% of the way between them is what learning looks like
    smooth, ten = epoch_health.guess([0.1] * 10, smoothing=0.6), epoch_health.guess([0.1] * 10)
    assert smooth.loss == pytest.approx(math.log(10)) and smooth.floor == pytest.approx(1.876, 1e-3)
    near = [{"train/loss": v, "val/accuracy": 0.15} for v in (2.4, 2.3, 2.27)]
    assert epoch_health.at_chance(near, smooth) is None  # 2.27 is 7.7% of the way down
    assert epoch_health.at_chance(near, ten).epoch == 3  # without smoothing: 1.4% of the way to 0


def test_the_stage_judges_chance_by_its_own_labels_and_clears_it_once_the_network_learns():
    """The train stage's monitor guesses from its training labels (90/10), scored on its val
    labels (all of the big class: a guess gets 1.0 there). A network that learned only the shares
    is at chance; when it learns later, the finding goes and the log says so."""
    import torch

    from visionflow.fit.setup import Data, monitor_for
    from visionflow.params import load_params

    said, shipped = [], load_params(ROOT / "params.yaml").train
    labels, val = torch.tensor([0] * 90 + [1] * 10), torch.zeros(20, dtype=torch.long)
    data = Data(None, labels, None, val, SimpleNamespace(classes=["big", "small"]))
    monitor = monitor_for(shipped.model_copy(update={"label_smoothing": 0.0}), data, said.append)
    assert monitor.chance.accuracy == 1.0 and monitor.chance.loss == pytest.approx(0.3251, 1e-3)
    metrics = {"data_seconds": 0.0, "seconds": 1.0, "first_losses": [], "first_labels": {}}
    metrics["layer_grad_norms"] = {"w": 1.0}
    history = [{"train/loss": 0.33, "val/loss": 0.33, "val/accuracy": 1.0}] * 3
    for n in (1, 2, 3):
        monitor.epoch(n, metrics, history[:n], 1e-3, mapped=False)
    assert [f.check for f in monitor.findings] == ["at_chance"]
    assert any("from a guess's 0.325 to a perfect network's 0.000" in line for line in said)
    history.append({"train/loss": 0.05, "val/loss": 0.05, "val/accuracy": 1.0})
    monitor.epoch(4, metrics, history, 1e-3, mapped=False)
    assert monitor.findings == [] and monitor.report()["healthy"] is True
    assert said[-1].startswith("health: no longer at chance level at epoch 4: train loss 0.050")
    balanced = Data(None, torch.tensor([0, 1] * 50), None, torch.tensor([0, 1] * 10), data.meta)
    learning = monitor_for(shipped, balanced, said.append)  # ln 2 and 0.5: 0.9 is learning
    for n in (1, 2, 3):
        learning.epoch(n, metrics, [{**history[0], "val/accuracy": 0.9}] * n, 1e-3, mapped=False)
    assert learning.findings == []


def test_gradients_out_of_range_are_named_by_layer():
    finding = health.gradients(
        2, {"conv1.weight": 5e3, "fc.weight": 1.0, "fc.bias": 0.0}, 1e3, 1e-7
    )
    assert "exploding in conv1.weight (5e+03)" in finding.message
    assert "vanishing in fc.bias (0)" in finding.message
    assert finding.evidence["exploding"] == {"conv1.weight": 5e3}
    dead = health.gradients(2, {"a": 0.0, "b": 0.0}, 1e3, 1e-7)
    assert "every weight" in dead.message
    assert health.gradients(2, {"a": 1.0}, 1e3, 1e-7) is None


def test_a_frozen_backbone_is_judged_by_the_head_that_trains_not_as_dead_relus():
    """Fine-tuning's frozen epochs: only the new head has gradients. Before, a head whose weight
    gradient vanished (weights that do not suit the images) read as "every weight: the network
    has stopped learning ... dead ReLUs ... lower train.lr", of a backbone that did not train."""
    import torch
    from torchvision.models import get_model

    from visionflow.train.engine import grad_norms
    from visionflow.train.zoo import FineTune, head_keys

    torch.manual_seed(1)  # "pretrained" weights that do not suit the images, as a user's may not
    net = get_model("mobilenet_v3_small", num_classes=3)
    model = FineTune(net, 56, head_keys("mobilenet_v3_small", 3, net, 56))
    model.train_bn = False  # train.train_bn: false, as before it: BatchNorm frozen too
    model.freeze(True)
    x, y = torch.randn(8, 3, 64, 64), torch.arange(8) % 3
    torch.nn.functional.cross_entropy(model(x), y).backward()
    norms = grad_norms(model)
    assert norms.keys() == {"net.classifier.3.weight", "net.classifier.3.bias"}  # the head's
    assert norms["net.classifier.3.weight"] < 1e-7  # vanishing, as measured

    said = []
    monitor = health.Monitor(limits(), CLASSES, said.append)
    metrics = {"data_seconds": 0.0, "seconds": 1.0, "first_losses": [], "first_labels": {}}
    history = [{"train/loss": 1.0, "val/loss": 1.0}]
    monitor.epoch(1, {**metrics, "layer_grad_norms": norms}, history, 1e-3, False, frozen=True)
    (message,) = said
    assert "vanishing in net.classifier.3.weight" in message
    assert "while the backbone is frozen (train.freeze_epochs), only the new head" in message
    assert "dead ReLUs" not in message and "lower train.lr" not in message
    assert "try a ResNet" not in message
    whole = health.gradients(2, norms, 1e3, 1e-7)  # the whole network trained: the old verdict
    assert "every weight: the network has stopped learning" in whole.message


def test_convnext_blocks_behind_their_tiny_layer_scale_are_not_vanishing():
    """ConvNeXt from scratch: each block's branch is multiplied by its layer scale, 1e-6 per
    channel at the start by design, so the gradients of the parameters inside are about 1e-6 of
    what they would be. Before, the first step of torchvision's convnext_tiny read as "vanishing
    in features.1.0.block.0.bias ... try a ResNet"; the scale's own gradient, not small, is the
    one that says whether the block learns. A block whose scale's gradient vanishes is told."""
    import torch
    from torchvision.models import get_model

    from visionflow.train.engine import grad_norms

    torch.manual_seed(0)
    net = get_model("convnext_tiny", num_classes=10)
    x, y = torch.randn(8, 3, 32, 32), torch.arange(8)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    norms = {k: v.item() for k, v in grad_norms(net).items()}
    tiny = {k for k, v in norms.items() if v < 1e-7}
    assert tiny and all(".block." in k for k in tiny)  # inside the blocks, as measured
    assert min(v for k, v in norms.items() if k.endswith("layer_scale")) > 1e-4
    assert health.gradients(1, norms, 1e3, 1e-7) is None

    stalled = {**norms, "features.1.0.layer_scale": 0.0}  # that block's scale learns nothing
    finding = health.gradients(1, stalled, 1e3, 1e-7)
    block = {k for k in tiny if k.startswith("features.1.0.")}
    assert block and finding.evidence["vanishing"].keys() == {"features.1.0.layer_scale", *block}


def test_gradient_norms_leave_out_batchnorm_biases_that_a_following_batchnorm_cancels():
    import torch
    from torch import nn

    from visionflow.train.engine import grad_norms

    torch.manual_seed(0)  # as in MobileNet's blocks: BatchNorm -> conv -> BatchNorm
    net = nn.Sequential(
        nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
    )
    net(torch.randn(8, 3, 5, 5)).square().mean().backward()
    assert net[1].bias.grad.abs().max() < 1e-6  # cancelled by the second BatchNorm
    norms = grad_norms(net)
    assert "1.bias" not in norms and "3.bias" not in norms  # no false "vanishing" alarm
    assert {"0.weight", "0.bias", "1.weight", "2.weight", "3.weight"} <= norms.keys()


def test_overfitting_names_the_epoch_where_it_began():
    val = [1.0, 0.6, 0.5, 0.55, 0.6, 0.7]
    train = [1.0, 0.5, 0.3, 0.2, 0.1, 0.05]
    history = [{"val/loss": v, "train/loss": t} for v, t in zip(val, train, strict=True)]
    finding = epoch_health.overfitting(history, 3)
    assert finding.epoch == 3 and finding.message.startswith("overfitting from epoch 3")
    assert epoch_health.overfitting(history[:5], 3) is None  # rising for only 2 epochs
    both_rising = [{"val/loss": v, "train/loss": v} for v in val]
    assert epoch_health.overfitting(both_rising, 3) is None


def fine_tune(frozen: list[tuple], unfrozen: list[tuple]) -> list[dict]:
    """Epoch records of a fine-tuning run: (train accuracy, val loss) per epoch, the backbone
    frozen (lr_backbone 0) for the first ones."""
    return [
        {"train/loss": 1.0, "train/accuracy": a, "val/loss": v, "lr": 1e-3, "lr_backbone": b}
        for (a, v), b in [(e, 0.0) for e in frozen] + [(e, 1e-4) for e in unfrozen]
    ]


def test_a_fine_tune_ruined_after_unfreezing_is_a_finding_and_unhealthy():
    """#58: `lr: auto` measured on the head alone, that rate then on the whole backbone: val loss
    386333 and train accuracy at chance (0.2, 5 classes) for five epochs after the frozen one,
    and health said `no finding in 6 checks`. Fed through the monitor epoch by epoch, as the
    train stage feeds it."""
    five = [str(i) for i in range(5)]
    metrics = {
        "data_seconds": 0.0,
        "seconds": 1.0,
        "first_losses": [],
        "first_labels": {},
        "layer_grad_norms": {"w": 1.0},
    }
    ruined = fine_tune([(0.62, 0.95)], [(0.21, 386333.2222)] + [(0.2, 1.7)] * 4)
    said = []
    monitor = health.Monitor(limits(first_steps=4), five, said.append)
    for epoch in range(1, len(ruined) + 1):
        monitor.epoch(epoch, metrics, ruined[:epoch], 1e-3, False, frozen=epoch == 1)
    report = monitor.report()
    assert report["healthy"] is False and report["ruined_fine_tune"] is True
    assert [d["epoch"] for d in report["details"] if d["check"] == "ruined_fine_tune"] == [2]
    assert said[0].startswith(
        "health: ruined fine-tune: after unfreezing the backbone at epoch 2, the val loss jumped "
        "from 0.95 (the last frozen epoch's) to 3.86e+05"
    )
    assert "train.backbone_lr_factor 0.1" in said[0]

    chance = epoch_health.guess([0.2] * 5)  # 5 balanced classes: loss 1.609, accuracy 0.2
    stuck = [(0.22, 1.8), (0.2, 1.7), (0.19, 1.7)]
    at_chance = fine_tune([(0.4, 1.5), (0.62, 1.2)], stuck)
    finding = epoch_health.ruined_fine_tune(at_chance, chance)
    assert (
        "the train accuracy fell from 0.62 with the backbone frozen to 0.22 at best over the "
        "last 3 epochs, a guess's (0.20)"
    ) in finding.message
    assert (
        epoch_health.ruined_fine_tune(at_chance[:-1], chance) is None
    )  # 2 epochs: not yet several
    # a frozen phase that learned nothing either: at_chance's, not this check's
    assert epoch_health.ruined_fine_tune(fine_tune([(0.2, 1.6)], stuck), chance) is None
    healthy = fine_tune([(0.6, 1.1)], [(0.7, 0.9), (0.8, 0.7), (0.85, 0.6), (0.9, 0.65)])
    assert all(epoch_health.ruined_fine_tune(healthy[:i], chance) is None for i in range(6))
    small = fine_tune([(0.9, 0.02)], [(0.95, 0.3)])  # 15x a tiny loss: still far under a guess's
    assert epoch_health.ruined_fine_tune(small, chance) is None
    assert (
        epoch_health.ruined_fine_tune(fine_tune([], [(0.2, 1e6)]), chance) is None
    )  # nothing frozen
    annealed = fine_tune([(0.6, 1.0)], [(0.2, 1e5), (0.3, 2.0)])
    annealed[-1]["lr_backbone"] = 0.0  # a schedule's last rate, 0: not a frozen epoch
    assert epoch_health.ruined_fine_tune(annealed, chance).evidence["unfrozen_epoch"] == 2
    assert epoch_health.ruined_fine_tune(fine_tune([(0.6, 1.0)], [(0.2, math.nan)]), chance)


def test_data_wait_over_the_limit_is_data_bound():
    assert health.data_bound(1, 1.0, 10.0, 0.5, mapped=False) is None
    finding = health.data_bound(1, 6.0, 10.0, 0.5, mapped=True)
    assert (
        "waited for data 60% of epoch 1" in finding.message and "max_memory_gb" in finding.message
    )


def test_the_monitor_reports_each_finding_once_and_a_healthy_run_says_so():
    said = []
    monitor = health.Monitor(limits(first_steps=4), CLASSES, said.append)
    metrics = {
        "data_seconds": 0.1,
        "seconds": 1.0,
        "first_losses": [2.3, 2.0, 1.5, 1.0],
        "first_labels": {0: 4},
        "layer_grad_norms": {"w": 1.0},
    }
    monitor.epoch(1, metrics, [{"train/loss": 1.0, "val/loss": 1.0}], 1e-3, False)
    assert said == [] and monitor.report()["healthy"] is True
    summary = monitor.summary("health.json", "timings/health.json")
    assert summary.startswith("health: healthy: no finding in 8 checks (data wait 10% at most")
    slow = {**metrics, "data_seconds": 0.9, "first_losses": []}
    monitor.epoch(2, slow, [{"train/loss": 1.0, "val/loss": 1.0}] * 2, 1e-3, False)
    monitor.epoch(3, slow, [{"train/loss": 1.0, "val/loss": 1.0}] * 3, 1e-3, False)
    timings = monitor.timings()
    assert len(said) == 1 and timings["data_bound"] is True and timings["data_wait_fraction"] == 0.9
    assert [d["epoch"] for d in timings["details"]] == [2]
    assert monitor.summary("health.json", "timings/health.json") == (
        "health: 1 finding: data_bound (timings/health.json; docs/troubleshooting.md)"
    )
    restored = health.Monitor(limits(first_steps=4), CLASSES)
    restored.load_state_dict(monitor.state_dict())
    assert restored.report() == monitor.report() and restored.timings() == timings


def test_what_the_clock_says_changes_no_byte_of_the_health_report():
    """A run where data waited 90% of each epoch, and one where it waited 10%: health.json (a DVC
    output) is the same; only the timings' report differs. Before, data_wait_fraction and the
    data-bound finding (and with it `healthy`, in metrics.json) were in health.json, and every run
    of the same code, data and params gave train a new hash."""
    metrics = {
        "seconds": 1.0,
        "first_losses": [2.3, 2.0, 1.5, 1.0],
        "first_labels": {0: 4},
        "layer_grad_norms": {"w": 1.0},
    }
    history = [{"train/loss": 1.0, "val/loss": 1.0}]
    said = []
    fast, slow = (health.Monitor(limits(first_steps=4), CLASSES, said.append) for _ in range(2))
    fast.epoch(1, {**metrics, "data_seconds": 0.1}, history, 1e-3, False)
    slow.epoch(1, {**metrics, "data_seconds": 0.9}, history, 1e-3, False)
    assert fast.report() == slow.report() and slow.report()["healthy"] is True
    assert (fast.timings()["data_bound"], slow.timings()["data_bound"]) == (False, True)
    assert len(said) == 1 and said[0].startswith("health: data-bound: the loop waited for data 90%")


def test_a_run_shorter_than_first_steps_says_its_loss_was_not_judged():
    """A batch larger than the split: 3 steps of 50. Before, the summary said "healthy: no finding
    in 6 checks" without having looked at the loss."""
    metrics = {
        "data_seconds": 0.0,
        "seconds": 1.0,
        "first_labels": {0: 2},
        "layer_grad_norms": {"w": 1.0},
    }
    history = [{"train/loss": 2.3, "val/loss": 2.3}]
    few = health.Monitor(limits(first_steps=50), CLASSES)
    few.epoch(1, {**metrics, "first_losses": [2.3, 2.3, 2.3]}, history, 1e-3, False)
    summary = few.summary("h", "t")
    assert "not judged: the run took 3 steps (train.health.first_steps is 50" in summary
    assert "healthy" not in summary and few.report()["first_steps_seen"] == 3


def test_degenerate_batches_are_told_with_their_numbers():
    from visionflow.fit.setup import degenerate_batches

    assert degenerate_batches(1221, 128, 1) == []
    (big,) = degenerate_batches(40, 64, 1)
    assert "train.batch_size 64 is more than the 40 training images" in big
    (many,) = degenerate_batches(40, 8, 16)
    assert "train.accumulate 16 is more than the 5 batches of an epoch" in many


# --- the train stage, on data built to trigger each check ------------------------------------


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """Digits at 8x8: as they are, with shuffled labels, and a tiny subset."""
    root = tmp_path_factory.mktemp("health")
    source = sources.load_source("digits", None)
    rng = np.random.default_rng(0)
    digits_cache(root / "digits", source)
    digits_cache(root / "shuffled", source._replace(labels=rng.permutation(source.labels)))
    few = rng.choice(len(source.labels), 150, replace=False)
    tiny = source._replace(
        images=source.images[few], labels=source.labels[few], names=[source.names[i] for i in few]
    )
    digits_cache(root / "tiny", tiny, val_fraction=0.3)
    return root


def train(caches, tmp_path, cache: str, change: dict, fault: str = ""):
    """The train stage on one of the caches; returns (exit code, log, health report)."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    write_params(tmp_path, {"train": {"epochs": 3, "batch_size": 32, "augment": STILL, **change}})
    env = {**os.environ, "PYTHONPATH": python_path(ROOT / "src", ROOT), "VISIONFLOW_FAULT": fault}
    cmd = [
        sys.executable,
        "-m",
        "pipeline.train",
        "--data",
        str(caches / cache),
        "--out",
        "out",
        "--checkpoints",
        "ckpt",
    ]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    report = tmp_path / ("out/health.json" if result.returncode == 0 else "out.health.json")
    log = result.stdout + result.stderr
    assert report.exists(), log
    return result.returncode, log, json.loads(report.read_text())


def only(report: dict) -> list[str]:
    return [d["check"] for d in report["details"]]


@pytest.mark.slow
def test_a_healthy_run_says_it_is_healthy(caches, tmp_path):
    code, log, report = train(caches, tmp_path, "digits", {})
    assert code == 0 and report["healthy"] is True and report["findings"] == 0, log
    assert "health: healthy: no finding in 8 checks" in log
    assert report["loss_drop_first_steps"] > 0.05


@pytest.mark.slow
def test_shuffled_labels_give_a_flat_loss_warning(caches, tmp_path):
    code, log, report = train(caches, tmp_path, "shuffled", {})
    assert code == 0 and only(report) == ["loss_not_falling"], log
    y = np.load(caches / "shuffled" / "train_y.npy")  # a guess of its shares: 2.302, not ln 10
    chance = epoch_health.guess(list(np.bincount(y, minlength=10) / len(y))).loss
    assert "health: loss not falling" in log and f"for 10 classes is {chance:.3f}" in log


@pytest.mark.slow
def test_a_learning_rate_far_too_high_is_reported_as_divergence(caches, tmp_path):
    code, log, report = train(caches, tmp_path, "digits", {"optimizer": "sgd", "lr": 10.0})
    assert only(report)[0] == "diverging", log
    assert "health: diverging at epoch 1: train loss" in log and "divide train.lr by 10" in log


@pytest.mark.slow
def test_a_tiny_dataset_trained_long_overfits(caches, tmp_path):
    change = {"epochs": 40, "batch_size": 16, "lr": 3e-3, "dropout": 0.0, "scheduler": "none"}
    code, log, report = train(caches, tmp_path, "tiny", change)
    assert code == 0 and "overfitting" in only(report), log
    assert report["overfit_from_epoch"] > 1 and "health: overfitting from epoch" in log


@pytest.mark.slow
def test_out_of_memory_is_reported_and_auto_batch_retries_once(caches, tmp_path):
    small_gpu = "train.loss:oom=16"  # batches over 16 images do not fit
    code, log, report = train(caches, tmp_path, "digits", {"epochs": 1}, small_gpu)
    assert code == 1 and only(report) == ["out_of_memory"], log
    message = report["messages"][0]
    size = sum(p.numel() for p in build_model("simple_cnn", 1, 10, 8).parameters())  # 8x8 digits
    assert f"batch_size 32 (accumulate 1), {size:,} parameters, peak" in message
    assert "train.batch_size 16 with train.accumulate 2" in message and "train.amp" in message
    code, log, report = train(
        caches, tmp_path, "digits", {"epochs": 1, "auto_batch": True}, small_gpu
    )
    assert code == 0 and only(report) == ["out_of_memory"], log
    assert "retrying once with batch_size 16 and accumulate 2" in log
    assert report["details"][0]["evidence"]["retried"] is True


@pytest.mark.slow
def test_a_slow_loader_is_reported_as_data_bound(caches, tmp_path):
    # 0.1 s per batch: at 0.05 a machine slowed 15x by other work (39 steps took 3 s of compute)
    # waited only 40% of the epoch; the sleep is idle time, not CPU the suite pays for
    code, log, report = train(caches, tmp_path, "digits", {"epochs": 1}, "train.batch:sleep=0.1")
    assert code == 0 and report["healthy"] is True, log  # the run's health: its numbers
    timed = json.loads((tmp_path / "out.timings/health.json").read_text())  # the clock's
    assert only(timed) == ["data_bound"] and timed["data_wait_fraction"] > 0.5
    assert "health: data-bound" in log and "health: 1 finding: data_bound (out.timings" in log
