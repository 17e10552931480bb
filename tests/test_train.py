"""The training engine and resumable checkpoints."""

import json
import math
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.helpers import ROOT, digits_cache, free_port, python_path, write_params
from visionflow import faults
from visionflow.data import dataset, sources
from visionflow.train import checkpoint, health, loading
from visionflow.train.augment import augment
from visionflow.train.engine import (
    NonFiniteLoss,
    Split,
    Step,
    amp_dtype,
    evaluate,
    make_optimizer,
    make_scheduler,
    speed_settings,
    step_scheduler,
    train_one_epoch,
)
from visionflow.train.loading import normalise, to_unit
from visionflow.train.models import build_model
from visionflow.train.training import time_line


def toy(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = (torch.rand(n, 8, 8, 1, generator=g) * 100 + y.view(-1, 1, 1, 1) * 150).to(torch.uint8)
    return x, y


MEAN, STD = torch.tensor([0.4]), torch.tensor([0.3])


def fresh_model(seed=0):
    torch.manual_seed(seed)
    return build_model("simple_cnn", 1, 2, 8)


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_each_optimiser_and_amp_mode_lowers_the_loss(name, amp):
    x, y = toy()
    model = fresh_model()
    optimizer = make_optimizer(name, model, 1e-2, 1e-4, 0.9, name == "sgd")
    dtype = amp_dtype(amp, torch.device("cpu"))
    before = batch_loss(model, x, y)
    for _ in range(3):  # three steps on one batch of 64
        metrics = train_one_epoch(
            model,
            optimizer,
            Split(x, y, MEAN, STD, torch.Generator()),
            Step(64, grad_clip=1.0, dtype=dtype),
        )
        assert metrics["steps"] == 1 and metrics["skipped_steps"] == 0
    assert batch_loss(model, x, y) < before  # the same batch, better predicted
    layers = metrics["layer_grad_norms"]
    assert set(layers) == {name for name, _ in model.named_parameters()}
    assert all(v > 0 for v in layers.values())  # every layer gets a gradient


def batch_loss(model, x, y) -> float:
    """The loss on (x, y) with the weights as they are (BatchNorm on batch statistics, as in
    training; no dropout in `fresh_model`)."""
    with torch.no_grad():
        inputs = ((x.float() / 255 - MEAN) / STD).permute(0, 3, 1, 2)
        return torch.nn.functional.cross_entropy(model.train()(inputs), y).item()


def test_fp16_steps_go_through_the_grad_scaler():
    x, y = toy()
    model = fresh_model()
    optimizer = make_optimizer("sgd", model, 1e-2, 0, 0.9, False)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    step = Step(16, dtype=torch.float16)
    metrics = train_one_epoch(
        model,
        optimizer,
        Split(x, y, MEAN, STD, torch.Generator().manual_seed(0)),
        step,
        scaler=scaler,
    )
    assert metrics["steps"] == 4 and metrics["skipped_steps"] == 0
    assert scaler.state_dict()["_growth_tracker"] == 4  # four steps went through the scaler


def overflowing_scaler() -> torch.amp.GradScaler:
    """fp16's scale calibrating, forced: 2**40 overflows the first step's fp16 gradients (the
    logits' pass 65504), and one back-off brings the scale to 1024, where none overflow."""
    return torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-30)


def sgd_after_an_early_overflow(make) -> tuple[list[torch.Tensor], dict]:
    x, y = toy()
    model = fresh_model()
    split = Split(x, y, MEAN, STD, torch.Generator().manual_seed(0))
    metrics = train_one_epoch(
        model, make(model), split, Step(16, dtype=torch.float16), scaler=overflowing_scaler()
    )
    return [p.detach() for p in model.parameters()], metrics


@pytest.mark.parametrize("fused", [None, True])
def test_sgd_after_an_fp16_overflow_on_its_first_step_ends_where_plain_sgd_does(fused):
    """Fused SGD allocates its momentum buffers uninitialised on its first step and kept them
    when the scaler skipped that step: the weights reached 1.5e36 (plain SGD: 0.33)."""
    project = partial(make_optimizer, "sgd", lr=1e-2, weight_decay=0, momentum=0.9, nesterov=False)
    makers = {
        None: lambda m: project(model=m),  # whatever make_optimizer chooses
        True: lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, fused=True),
    }
    weights, metrics = sgd_after_an_early_overflow(makers[fused])
    plain, _ = sgd_after_an_early_overflow(
        lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, foreach=False)
    )
    assert metrics["steps"] == 4 and metrics["skipped_steps"] == 1  # the overflow, skipped
    for w, p in zip(weights, plain, strict=True):
        assert torch.allclose(w, p, rtol=1e-5, atol=1e-7), (w.abs().max(), p.abs().max())


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_an_fp16_overflow_is_a_skipped_step_not_an_exploding_gradient(name):
    """The overflowed step measured no gradient norm (it was the scale's, and step 0 of each
    epoch is sampled): the epoch's norms are finite and the health check finds nothing."""
    x, y = toy()
    model = fresh_model()
    optimizer = make_optimizer(name, model, 1e-2, 0, 0.9, False)
    split = Split(x, y, MEAN, STD, torch.Generator().manual_seed(0))
    scaler = overflowing_scaler()
    for epoch in range(2):
        metrics = train_one_epoch(
            model, optimizer, split, Step(16, dtype=torch.float16), scaler=scaler, epoch=epoch
        )
        assert metrics["skipped_steps"] == (1 if epoch == 0 else 0)
        norms = metrics["layer_grad_norms"]
        assert set(norms) == {n for n, _ in model.named_parameters()}
        assert all(math.isfinite(v) for v in [metrics["grad_norm"], *norms.values()]), metrics
        limits = params_defaults()["train"]["health"]
        assert (
            health.gradients(epoch, norms, limits["max_grad_norm"], limits["min_grad_norm"]) is None
        )


def test_the_warm_up_counts_the_images_its_steps_had_and_the_line_never_goes_negative(
    monkeypatch,
):
    """272 images at batch 64: five steps, the last of 16 images, all of them the warm-up. The
    warm-up counted 5 x 64 = 320 images, and the line read "then -308819 img/s"."""
    from visionflow.train.stats import WARMUP_STEPS

    assert WARMUP_STEPS == 5  # the steps the cases below count on
    x, y = toy(272)
    model = fresh_model()
    optimizer = make_optimizer("sgd", model, 1e-2, 0, 0.9, False)
    g = torch.Generator().manual_seed(0)

    def epoch(n: int, step: Step) -> dict:
        return train_one_epoch(model, optimizer, Split(*toy(n), MEAN, STD, g), step)

    short = epoch(272, Step(64))
    assert short["warmup_images"] == short["fed_images"] == short["images"] == 272
    line = time_line(short, {"training": short["seconds"]}, warmup=True)
    assert "(its first 5 steps" in line and "warming up; the epoch had no others)" in line
    # the fifth step a short last one of accumulated micro-batches: still the warm-up's end
    accumulated = epoch(272, Step(16, accumulate=4))
    assert accumulated["warmup_images"] == 272 and "no others" in time_line(accumulated, {}, True)
    longer = epoch(400, Step(64))
    assert (longer["warmup_images"], longer["fed_images"]) == (320, 400)
    assert re.search(r"warming up; then \d+ img/s\)", time_line(longer, {}, warmup=True))
    # a step skipped in the warm-up (a NaN loss): its images are not trained on, but were fed
    monkeypatch.setattr(faults, "FAULTS", faults.parse("train.loss@step=1:nan"))
    monkeypatch.setattr(faults, "ACTIVE", True)
    skipped = epoch(340, Step(64))
    assert skipped["skipped_steps"] == 1 and skipped["images"] == 340 - 64
    assert (skipped["warmup_images"], skipped["fed_images"]) == (320, 340)
    assert re.search(r"warming up; then \d+ img/s\)", time_line(skipped, {}, warmup=True))


def test_overfit_batches_takes_every_class_in_turn_from_a_folders_class_ordered_cache(
    image_folder, tmp_path
):
    """A folder's cache is in class order: the first 6 images were all 'blue', which a constant
    fits, so overfitting them proved nothing. The subset takes each class's images in turn."""
    from visionflow.fit.setup import each_class_in_turn, load_data, overfit_settings, starting
    from visionflow.params import load_params

    for note in image_folder.rglob("notes.txt"):
        note.unlink()  # the fixture's stray file, which the cache's build rejects
    cache = digits_cache(tmp_path / "cache", sources.load_source("imagefolder", image_folder))
    train = load_params(ROOT / "params.yaml").train
    whole = load_data(cache, train, torch.device("cpu"))
    assert whole.y_train.tolist() == sorted(whole.y_train.tolist())  # in class order
    change = {"overfit_batches": 1, "batch_size": 6}
    data = load_data(cache, train.model_copy(update=change), torch.device("cpu"))
    assert data.y_train.tolist() == [0, 0, 1, 1, 2, 2]  # each class's first two
    assert torch.equal(data.x_val, data.x_train) and torch.equal(data.y_val, data.y_train)
    starts = [whole.y_train.tolist().index(c) for c in (0, 1, 2)]
    firsts = torch.tensor(sorted([*starts, *(i + 1 for i in starts)]))
    assert torch.equal(data.x_train, whole.x_train[firsts])  # the same images on every run
    # and nothing that keeps the loss of a few batches off 0 (digits' 128 stayed at 1.2-1.4)
    fitting = overfit_settings(train.model_copy(update=change))
    assert (fitting.dropout, fitting.label_smoothing, fitting.weight_decay) == (0, 0, 0)
    assert fitting.augment.crop_padding == 0 and fitting.augment.rotation == 0
    assert overfit_settings(train) is train  # a normal run keeps its settings
    more = overfit_settings(train.model_copy(update={"overfit_batches": 100, "batch_size": 6}))
    trainer = SimpleNamespace(model=nn.Linear(1, 1), world=1)
    line = starting(more, trainer, load_data(cache, more, torch.device("cpu")), torch.device("cpu"))
    n = len(whole.y_train)
    assert f"overfit_batches 100: {n} images (all there are, not the 600 asked), each" in line
    # a class under 1/N of the split still gets its turn: 217 of one class and 27 of another
    labels = np.array([0] * 217 + [1] * 27)
    assert sorted(labels[each_class_in_turn(labels)[:8]].tolist()) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_overfitting_a_small_batch_drives_the_loss_to_zero():
    x, y = toy(32)
    model = fresh_model()
    optimizer = make_optimizer("adam", model, 3e-3, 0, 0, False)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        metrics = train_one_epoch(model, optimizer, Split(x, y, MEAN, STD, g), Step(32))
    assert metrics["loss"] < 0.01 and metrics["accuracy"] == 1.0


def test_accumulation_equals_one_big_batch():
    x, y = toy(32)
    small, big = fresh_model(), fresh_model()
    big.load_state_dict(small.state_dict())
    for model, batch, accumulate in ((small, 8, 4), (big, 32, 1)):
        optimizer = make_optimizer("sgd", model, 0.1, 0, 0, False)
        train_one_epoch(
            model.eval(),
            optimizer,
            Split(x, y, MEAN, STD, torch.Generator().manual_seed(3)),
            Step(batch, accumulate),
        )
    for a, b in zip(small.parameters(), big.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_plateau_scheduler_lowers_the_rate_after_a_plateau():
    model = fresh_model()
    optimizer = make_optimizer("adam", model, 1e-3, 0, 0, False)
    scheduler = make_scheduler("plateau", optimizer, 10, patience=1, factor=0.5, step_size=1)
    for loss in (1.0, 0.9, 0.9, 0.9):  # improves once, then flat for two epochs
        step_scheduler(scheduler, loss)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)


class SometimesNaN(nn.Module):
    def __init__(self, inner, bad_calls):
        super().__init__()
        self.inner, self.bad_calls, self.calls = inner, bad_calls, 0

    def forward(self, x):
        self.calls += 1
        out = self.inner(x)
        return out * float("nan") if self.calls in self.bad_calls else out


def test_nan_loss_is_skipped_and_a_run_of_them_stops():
    x, y = toy(64)
    model = SometimesNaN(fresh_model(), bad_calls={2})
    optimizer = make_optimizer("adam", model, 1e-3, 0, 0, False)
    metrics = train_one_epoch(
        model, optimizer, Split(x, y, MEAN, STD, torch.Generator().manual_seed(0)), Step(16)
    )
    assert metrics["skipped_steps"] == 1 and metrics["steps"] == 3
    assert metrics["images"] == 48  # the NaN batch is not counted in the epoch's loss
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the bad step changed nothing
    model = SometimesNaN(fresh_model(), bad_calls={2, 3, 4})
    with pytest.raises(
        NonFiniteLoss, match=r"3 optimizer steps in a row \(epoch 7, micro-batch 4\)"
    ):
        train_one_epoch(
            model,
            optimizer,
            Split(x, y, MEAN, STD, torch.Generator().manual_seed(0)),
            Step(16, max_nonfinite=3),
            epoch=7,
        )


def test_a_nan_in_a_group_skips_that_optimizer_step_whole_and_counts_one():
    """accumulate 2 over 4 micro-batches; a NaN in the first micro-batch of the second group: that
    step is skipped whole (before, the good micro-batch after the NaN was stepped alone, at half
    weight), and `skipped_steps` counts optimizer steps, as `steps` does."""
    x, y = toy(64)
    model = SometimesNaN(fresh_model(), bad_calls={3})
    optimizer = make_optimizer("sgd", model, 0.1, 0, 0, False)
    metrics = train_one_epoch(
        model.eval(),
        optimizer,
        Split(x, y, MEAN, STD, torch.Generator().manual_seed(0)),
        Step(16, 2),
    )
    assert metrics["steps"] == 1 and metrics["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


class NaNInput(nn.Module):
    """NaN images on chosen calls, before the model's BatchNorm sees them."""

    def __init__(self, inner, bad_calls):
        super().__init__()
        self.inner, self.bad_calls, self.calls = inner, bad_calls, 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x * float("nan") if self.calls in self.bad_calls else x)


def test_a_skipped_step_leaves_batchnorm_statistics_as_they_were():
    """NaN reaching BatchNorm in forward updated its running statistics before the step was
    skipped; evaluation was NaN for the rest of the run."""
    x, y = toy(64)
    torch.manual_seed(0)
    model = NaNInput(build_model("small_resnet", 1, 2, 8), bad_calls={2})
    optimizer = make_optimizer("sgd", model, 0.05, 0, 0, False)
    metrics = train_one_epoch(
        model, optimizer, Split(x, y, MEAN, STD, torch.Generator().manual_seed(0)), Step(16)
    )
    assert metrics["skipped_steps"] == 1 and metrics["steps"] == 3
    assert all(torch.isfinite(b).all() for b in model.buffers())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_epoch_without_one_finite_step_stops_the_run():
    """Every step skipped (a few steps per epoch, fewer than max_nonfinite): before, the epoch
    reported loss 0.0 and training went on."""
    x, y = toy(32)
    model = SometimesNaN(fresh_model(), bad_calls=set(range(1, 100)))
    optimizer = make_optimizer("sgd", model, 0.1, 0, 0, False)
    with pytest.raises(NonFiniteLoss, match=r"no optimizer step of epoch 3 had a finite loss"):
        train_one_epoch(
            model,
            optimizer,
            Split(x, y, MEAN, STD, torch.Generator().manual_seed(0)),
            Step(16, max_nonfinite=5),
            epoch=3,
        )


def test_accumulation_weighs_each_micro_batch_by_its_images():
    """44 images, batch 8, accumulate 2: steps over 16, 16 and 12 images, the last of batches of
    8 and 4. Each step equals one plain step on all its images at once (the mean over them); the
    old loop took the mean of the two batch means, weighing the 4 images' loss as the 8's."""
    x, y = toy(44)
    model = fresh_model()
    optimizer = make_optimizer("sgd", model, 0.1, 0, 0, False)
    metrics = train_one_epoch(
        model.eval(),
        optimizer,
        Split(x, y, MEAN, STD, torch.Generator().manual_seed(0)),
        Step(8, 2),
    )
    assert metrics["steps"] == 3 and metrics["images"] == 44
    # the same epoch by hand: each step one batch of all its images
    reference = fresh_model()
    sgd = make_optimizer("sgd", reference, 0.1, 0, 0, False)
    order = torch.randperm(44, generator=torch.Generator().manual_seed(0))
    for start, end in ((0, 16), (16, 32), (32, 44)):
        sgd.zero_grad()
        idx = order[start:end]
        logits = reference.eval()(normalise(to_unit(x[idx]), MEAN, STD))
        F.cross_entropy(logits, y[idx]).backward()
        sgd.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


# recorded with the loop before its rewrite as two nested loops (#28): three epochs of each
# configuration, all of whose steps have micro-batches of one size
RECORDED = ROOT / "tests/data/steps_before_28.pt"
RECORDED_CASES = {  # name: (optimizer, Step, augmentation)
    "adam_b16": ("adam", Step(16), False),
    "sgd_b8_acc2_augment": ("sgd", Step(8, 2, grad_clip=1.0), True),
    "adamw_b16_acc2_bf16": ("adamw", Step(16, 2, label_smoothing=0.1, dtype=torch.bfloat16), False),
}


@pytest.mark.parametrize("name", RECORDED_CASES)
def test_the_loop_takes_the_steps_it_took_before_its_rewrite(name):
    """Where every micro-batch of a step has the same size, the two-loop step gives the weights
    the old countdown loop gave (bit for bit on the machine that recorded them; 1e-6 allows
    another CPU's kernels to round differently, while the old weighting of a short micro-batch
    was 1e-4 away)."""
    optimizer_name, step, augmented = RECORDED_CASES[name]
    x, y = toy(64)
    model = fresh_model()
    optimizer = make_optimizer(optimizer_name, model, 1e-2, 1e-4, 0.9, optimizer_name == "sgd")
    shuffle, draws = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    augmentation = partial(augment, generator=draws, crop_padding=1, rotation=10.0)
    split = Split(x, y, MEAN, STD, shuffle, augmentation if augmented else None)
    for epoch in range(3):
        train_one_epoch(model, optimizer, split, step, epoch=epoch)
    recorded = torch.load(RECORDED, weights_only=True)[name]
    for key, value in model.state_dict().items():
        assert torch.allclose(value.float(), recorded[key].float(), rtol=0, atol=1e-6), key


def test_accumulation_beyond_the_batches_still_steps_once_per_epoch():
    x, y = toy(40)
    model, start = fresh_model(), fresh_model()
    optimizer = make_optimizer("sgd", model, 0.1, 0, 0, False)
    metrics = train_one_epoch(
        model, optimizer, Split(x, y, MEAN, STD, torch.Generator().manual_seed(0)), Step(8, 16)
    )
    assert metrics["steps"] == 1  # not zero: the weights moved off the initialisation
    assert any(
        not torch.equal(a, b) for a, b in zip(model.parameters(), start.parameters(), strict=True)
    )


def state(epoch, fp="abc"):
    return {"epoch": epoch, "fingerprint": fp, "model": fresh_model().state_dict(), "history": []}


def test_checkpoints_fall_back_refuse_pickles_and_check_the_fingerprint(tmp_path):
    checkpoint.save_checkpoint(tmp_path, state(1))
    checkpoint.save_checkpoint(tmp_path, state(2))
    checkpoint.save_checkpoint(tmp_path, state(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-0002.pt", "epoch-0003.pt"]
    loaded, why = checkpoint.load_latest(tmp_path, "abc", "cpu")
    assert loaded["epoch"] == 3 and "resuming" in why

    newest = tmp_path / "epoch-0003.pt"
    newest.write_bytes(newest.read_bytes()[:200])  # truncated, as by a kill mid-write
    with pytest.warns(UserWarning, match="epoch-0003.pt is unreadable"):
        loaded, _ = checkpoint.load_latest(tmp_path, "abc", "cpu")
    assert loaded["epoch"] == 2

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / "epoch-0009.pt").write_bytes(pickle.dumps(Evil()))
    with pytest.warns(UserWarning, match="epoch-0009.pt is unreadable"):
        loaded, _ = checkpoint.load_latest(tmp_path, "abc", "cpu")
    assert not marker.exists() and loaded["epoch"] == 2  # refused without running

    with pytest.warns(UserWarning, match="unreadable"):  # the two broken files, again
        loaded, why = checkpoint.load_latest(tmp_path, "other", "cpu")
    assert loaded is None and "other params or data" in why and "starting fresh" in why


def test_fingerprint_follows_the_run_and_a_fresh_start_names_what_changed(tmp_path):
    run = {"seed": 0, "train": {"lr": 1e-3, "epochs": 3}, "hashes": {"data": "d1", "code": "c1"}}
    a = checkpoint.fingerprint(run)
    assert a == checkpoint.fingerprint(json.loads(json.dumps(run)))
    assert a != checkpoint.fingerprint({**run, "train": {"lr": 2e-3, "epochs": 3}})
    assert a != checkpoint.fingerprint({**run, "hashes": {"data": "d2", "code": "c1"}})
    old, empty, new = tmp_path / a, tmp_path / "empty", tmp_path / "new"
    checkpoint.save_checkpoint(old, state(3, a))
    checkpoint.write_run(old, run)
    checkpoint.write_run(empty, run)  # newer, but without a checkpoint: nothing to compare with
    assert json.loads((old / "run.json").read_text()) == run
    changed = {
        "seed": 0,
        "train": {"lr": 3e-3, "epochs": 5},
        "hashes": {"data": "d1", "code": "c2"},
    }
    notes = {"train.epochs": "the cosine schedule's learning rate depends on it"}
    assert checkpoint.reason_not_resumed(tmp_path, new, changed, notes) == (
        f"the code, train.epochs 3 -> 5, train.lr 0.001 -> 0.003 changed since the checkpoint in "
        f"{old} (the cosine schedule's learning rate depends on it)"
    )
    assert checkpoint.reason_not_resumed(tmp_path / "none", new, changed, notes) is None


# --- the stage: DDP (kill and resume: test_reliability, test_nothing_lost) ---------------------------------------------------------------


@pytest.fixture
def workdir(tmp_path):
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    write_params(tmp_path, {"train": {"epochs": 5, "batch_size": 32}})
    source = sources.load_source("digits", None)
    dataset.build_cache(
        source,
        tmp_path / "prepared",
        dataset.Decode(8, "grayscale"),
        val_fraction=0.15,
        test_fraction=0.2,
        seed=0,
    )
    return tmp_path


def train_cmd(cwd, out):
    return [
        sys.executable,
        "-m",
        "pipeline.train",
        "--data",
        "prepared",
        "--out",
        out,
        "--checkpoints",
        f"{out}-ckpt",
    ]


def run_train(cwd, out):
    env = {**os.environ, "PYTHONPATH": python_path(ROOT / "src", ROOT)}
    return subprocess.run(train_cmd(cwd, out), cwd=cwd, env=env, capture_output=True, text=True)


# train params under which 2 ranks and 1 process must end with the same weights: plain SGD, no
# augmentation or dropout (their draws differ per rank)
PLAIN_SGD = {
    "epochs": 2,
    "optimizer": "sgd",
    "momentum": 0.0,
    "lr": 0.05,
    "dropout": 0.0,
    "augment": {"crop_padding": 0, "rotation": 0.0},
}


def torchrun(cwd: Path, launch: list[str], out: str, state: str, fault: str = ""):
    """`torchrun LAUNCH -m pipeline.train` in `cwd`, in its own session (a hung rank goes with
    the rest: nothing outlives the test)."""
    env = {
        **os.environ,
        "PYTHONPATH": python_path(ROOT / "src", ROOT),  # this checkout's library too
        "OMP_NUM_THREADS": "1",
        "VISIONFLOW_FAULT": fault,
    }
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that aborts shows where it was
    stage = ["-m", "pipeline.train", "--data", "prepared", "--out", out, "--checkpoints", state]
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launch, *stage],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def ended(processes: list) -> list[subprocess.CompletedProcess]:
    """Each process's end, a hang (past 300 s) failing the test with every group killed."""
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=300)
            results.append(
                subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
            )
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    return results


ABORTED = "terminate called without an active exception"  # from C++, not from our code


def torchrun_train(cwd: Path, out: str, fault: str = "") -> subprocess.CompletedProcess:
    """The train stage under `torchrun` with 2 gloo processes, as the manual runs it. A run in
    which a rank aborted in torch's C++ (SIGABRT: seen once in CI on a loaded machine, never in
    348 runs here, three at once) is run once more from nothing, with a warning in the summary."""
    launch = ["--standalone", "--nproc_per_node", "2"]
    result = ended([torchrun(cwd, launch, out, f"{out}-ckpt", fault)])[0]
    if result.returncode != 0 and ABORTED in result.stderr:
        tail = result.stderr[-4000:]
        warnings.warn(f"a torchrun rank aborted; running again:\n{tail}", stacklevel=2)
        shutil.rmtree(cwd / out, ignore_errors=True)
        shutil.rmtree(cwd / f"{out}-ckpt", ignore_errors=True)
        result = ended([torchrun(cwd, launch, out, f"{out}-ckpt", fault)])[0]
    return result


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_with_the_global_batch(workdir):
    """2 ranks x batch 16 (gloo, CPU) take the same steps as 1 process x batch 32.

    Both train on the same 640 images (overfit_batches x batch_size), a multiple of 32 (the next
    test has a ragged last step).
    """
    plain = PLAIN_SGD
    write_params(workdir, {"train": {**plain, "batch_size": 32, "overfit_batches": 20}})
    single = run_train(workdir, "single")
    assert single.returncode == 0, single.stderr
    write_params(workdir, {"train": {**plain, "batch_size": 16, "overfit_batches": 40}})
    # the stage's mid-run guard and the cache's verification run once, on rank 0: a fault aimed
    # at rank 1 would fail the run, the ones at rank 0 leave a file each
    stage = {"cmd": "python -m pipeline.train", "deps": ["prepared"], "params": ["train"]}
    (workdir / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": stage}}))
    once = ";".join(
        f"{point}@rank=0:touch={point}.0;{point}@rank=1:raise"
        for point in ("stage.snapshot", "train.verify")
    )
    ddp = torchrun_train(workdir, "ddp", fault=once)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert ddp.stdout.count("train: best val accuracy") == 1  # rank 0 alone reports and writes
    for log in (single.stdout, ddp.stdout):  # the speed settings picked, and where time went
        assert "train: amp off, channels_last true (auto: on the CPU autocast rarely pays" in log
        first, second = re.findall(r"^ +seconds: training .*$", log, re.MULTILINE)
        parts = r"besides training: validation [\d.]+, health [\d.]+, logging [\d.]+, checkpoint"
        assert re.search(
            rf"\(its first 5 steps [\d.]+, warming up; then \d+ img/s\); {parts}", first
        )
        assert re.search(rf"^ +seconds: training [\d.]+; {parts} [\d.]+$", second), second
    assert (workdir / "stage.snapshot.0").exists() and (workdir / "train.verify.0").exists()
    a = torch.load(workdir / "single/model.pt", weights_only=True)
    b = torch.load(workdir / "ddp/model.pt", weights_only=True)
    for k in a["state_dict"]:
        assert torch.allclose(a["state_dict"][k], b["state_dict"][k], atol=1e-5), k
    metrics = [
        json.loads((workdir / out / "live/metrics.json").read_text()) for out in ("single", "ddp")
    ]
    assert metrics[0]["val"]["accuracy"] == metrics[1]["val"]["accuracy"]
    assert metrics[0]["train"]["loss"] == pytest.approx(metrics[1]["train"]["loss"], rel=1e-4)


@pytest.mark.slow
def test_ddp_with_accumulation_and_a_short_last_micro_batch_matches_one_big_batch(workdir):
    """2 ranks x batch 16 x accumulate 2 take the steps of 1 process x batch 64, on 560 images:
    each epoch's last step holds 48 images, 16 + 8 per rank in two micro-batches, and weighs
    them as one batch of 48 (SGD, no augmentation, no dropout)."""
    cache = workdir / "prepared"
    for part in ("x", "y"):  # 560 of the train split: 280 per rank = 17 x 16 + 8
        array = np.load(cache / f"train_{part}.npy")[:560]
        np.save(cache / f"train_{part}.npy", array)
    manifest = json.loads((cache / "manifest.json").read_text())
    for part in ("x", "y"):
        manifest["files"][f"train_{part}.npy"]["sha256"] = dataset.file_hash(
            cache / f"train_{part}.npy"
        )
    (cache / "manifest.json").write_text(json.dumps(manifest))
    plain = PLAIN_SGD
    write_params(workdir, {"train": {**plain, "batch_size": 64, "accumulate": 1}})
    single = run_train(workdir, "single")
    assert single.returncode == 0, single.stderr
    write_params(workdir, {"train": {**plain, "batch_size": 16, "accumulate": 2}})
    ddp = torchrun_train(workdir, "ddp")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    a = torch.load(workdir / "single/model.pt", weights_only=True)["state_dict"]
    b = torch.load(workdir / "ddp/model.pt", weights_only=True)["state_dict"]
    worst = max((a[k] - b[k]).abs().max().item() for k in a if a[k].is_floating_point())
    assert worst < 1e-5, worst  # the mean of micro-batch means was 1e-3 away here


@pytest.mark.slow
@pytest.mark.longest
def test_an_out_of_memory_on_one_rank_makes_every_rank_retry_with_half_the_batch(workdir):
    """train.auto_batch under DDP: rank 1 alone runs out of memory (batches over 8 images do not
    fit there). Every rank learns it at the step's one all-reduce, so both retry the epoch at
    batch 8 x accumulate 2 and end with the weights of one process at batch 32. (Before, rank 1
    retried alone while rank 0 went on: their collectives no longer paired, and the run hung.)"""
    write_params(workdir, {"train": {**PLAIN_SGD, "batch_size": 32, "overfit_batches": 20}})
    single = run_train(workdir, "single")
    assert single.returncode == 0, single.stderr
    change = {**PLAIN_SGD, "batch_size": 16, "overfit_batches": 40, "auto_batch": True}
    write_params(workdir, {"train": change})
    ddp = torchrun_train(workdir, "ddp", fault="train.loss@rank=1:oom=8")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "fault: oom at train.loss {'epoch': 1, 'step': 1, 'batch': 16, 'rank': 1}" in ddp.stderr
    assert "'rank': 0}" not in ddp.stderr  # rank 0 had the memory: it retried on rank 1's word
    assert "retrying once with batch_size 8 and accumulate 2" in ddp.stdout  # rank 0's log
    report = json.loads((workdir / "ddp/health.json").read_text())
    assert report["details"][0]["evidence"]["retried"] is True, report
    a = torch.load(workdir / "single/model.pt", weights_only=True)["state_dict"]
    b = torch.load(workdir / "ddp/model.pt", weights_only=True)["state_dict"]
    worst = max((a[k] - b[k]).abs().max().item() for k in a if a[k].is_floating_point())
    assert worst < 1e-5, worst
    # no memory for any batch on rank 1: after the one retry, every rank fails, none waits
    failed = torchrun_train(workdir, "ddp-again", fault="train.loss@rank=1:oom")
    assert failed.returncode != 0 and "out of memory at epoch 1" in failed.stderr
    assert not (workdir / "ddp-again").exists()


class OutOfMemoryOnRank1(nn.Module):
    """Rank 1 runs out of memory inside the model's forward for batches over 8 images (DDP's
    own forward has begun: its collectives there would be left unpaired)."""

    def __init__(self, inner, rank):
        super().__init__()
        self.inner, self.rank = inner, rank

    def forward(self, x):
        if self.rank == 1 and len(x) > 8:
            raise torch.OutOfMemoryError("CUDA out of memory (injected in forward)")
        return self.inner(x)


def retry_on_rank(rank: int, port: int, out: Path) -> None:
    """On 2 gloo ranks, one epoch of the stage's Trainer (auto_batch, a BatchNorm model) with
    rank 1 out of memory in its first forward, then one with rank 1 out of memory in its first
    optimizer step; writes what each rank ended with to out/<where>-<rank>.json."""
    import datetime

    from visionflow.train import engine, health
    from visionflow.train.training import Trainer, stepping

    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    timeout = datetime.timedelta(seconds=60)  # a hang fails the test, not the suite
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
    real, calls = engine.optimizer_step, []

    def optimizer_step(*args):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected in the step)")
        return real(*args)

    limits = health.Limits(**{**params_defaults()["train"]["health"]})
    x, y = toy(128)
    for where in ("forward", "step"):
        torch.manual_seed(0)
        inner = build_model("small_resnet", 1, 2, 8)
        model = OutOfMemoryOnRank1(inner, rank) if where == "forward" else inner
        if where == "step" and rank == 1:
            engine.optimizer_step = optimizer_step
        optimizer = make_optimizer("sgd", model, 0.05, 0, 0, False)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        shuffle, draws = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2 + rank)
        step = Step(16, agree_on_memory=True)
        trainer = Trainer(
            model, stepping(model, 2, False), optimizer, None, scaler, shuffle, draws, step,
            {"crop_padding": 0}, auto_batch=True, rank=rank, world=2,
        )  # fmt: skip
        monitor = health.Monitor(limits, ["a", "b"], lambda _: None)
        metrics = trainer.epoch(x, y, MEAN, STD, 1, monitor)
        weights = sum(p.double().sum().item() for p in inner.parameters())
        (out / f"{where}-{rank}.json").write_text(
            json.dumps([trainer.step.batch_size, metrics["steps"], weights])
        )
    torch.distributed.destroy_process_group()


def params_defaults() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


@pytest.mark.slow
def test_every_rank_retries_whatever_part_of_the_step_ran_out_of_memory(tmp_path):
    """Rank 1 of 2 runs out of memory inside DDP's first forward of a model with BatchNorm, or in
    its first optimizer step (after the ranks agreed on the step): both ranks retry the epoch
    at batch 8 x 2 and end with the same weights. (DDP's buffer broadcast in forward, or a
    retry of rank 1 alone after the agreement, left the ranks' collectives unpaired: a hang.)
    Both cases in one process group: a spawn costs two processes' imports."""
    import torch.multiprocessing as mp

    mp.spawn(retry_on_rank, args=(free_port(), tmp_path), nprocs=2)
    for where in ("forward", "step"):
        ends = [json.loads((tmp_path / f"{where}-{r}.json").read_text()) for r in (0, 1)]
        assert ends[0][:2] == ends[1][:2] == [8, 4], (where, ends)  # 64 images a rank: 4 x 8 x 2
        assert ends[0][2] == pytest.approx(ends[1][2], abs=1e-9), (where, ends)


def count_gradient_all_reduces(rank: int, port: int, out: Path) -> None:
    """One epoch on a DDP rank of two (gloo) at accumulate 1, then one at accumulate 4, each
    model's gradient all-reduces counted by a communication hook; writes (all-reduces,
    optimizer steps) to out/<accumulate>-<rank>.json."""
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    for accumulate in (1, 4):
        model = DistributedDataParallel(fresh_model())
        calls = []

        def counted(state, bucket, calls=calls):
            calls.append(1)
            done = torch.distributed.all_reduce(bucket.buffer().div_(2), async_op=True)
            return done.get_future().then(lambda future: future.value()[0])

        model.register_comm_hook(None, counted)
        optimizer = make_optimizer("sgd", model, 0.1, 0, 0, False)
        x, y = toy(128)
        metrics = train_one_epoch(model, optimizer, Split(x, y, MEAN, STD, torch.Generator().manual_seed(0), rank=rank, world=2), Step(8, accumulate))  # fmt: skip
        (out / f"{accumulate}-{rank}.json").write_text(json.dumps([len(calls), metrics["steps"]]))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ddp_all_reduces_the_gradients_once_per_optimizer_step(tmp_path):
    """64 images per rank, batch 8: 8 micro-batches. With accumulate 4 the gradients are
    all-reduced on the last micro-batch of each step only (no_sync on the others): a quarter of
    the all-reduces of accumulate 1, not as many."""
    import torch.multiprocessing as mp

    mp.spawn(count_gradient_all_reduces, args=(free_port(), tmp_path), nprocs=2)
    counts = {
        accumulate: [json.loads((tmp_path / f"{accumulate}-{r}.json").read_text()) for r in (0, 1)]
        for accumulate in (1, 4)
    }
    (plain, plain_steps), (accumulated, steps) = counts[1][0], counts[4][0]
    assert (plain_steps, steps) == (8, 2) and counts[1][1] == counts[1][0]
    per_step = plain // plain_steps  # all-reduces of one backward: one per gradient bucket
    assert per_step >= 1 and accumulated == steps * per_step, counts


def wait_on_rank_0(rank: int, port: int, folder: Path) -> None:
    """Two gloo ranks whose default group gives up after 2 s (NCCL's gives up after 10 minutes)
    run the two waits on rank 0's work alone: the cache's hash (`verify_once`) and train.lr:
    auto's rate (`rate_for`). Rank 0 pauses in each until rank 1 has outlived a canary: a
    collective of 6 s's timeout that rank 0 never joins, started as rank 1 starts to wait.
    Each rank writes the rate it took to folder/rate-<rank>.json."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from visionflow.fit.lr_auto import RECORD, rate_for
    from visionflow.fit.setup import verify_once
    from visionflow.params import load_params

    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_RANK": str(rank)}
    short = timedelta(seconds=2)  # the default group's timeout, as NCCL's 10 minutes
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=short)
    faults.FAULTS = faults.parse(
        f"train.verify@rank=0:pause={folder}/hashed;train.lr_find@rank=0:pause={folder}/found"
    )
    faults.ACTIVE = True

    def outlive(canary, done: Path) -> None:
        try:
            dist.barrier(group=canary)  # rank 0 never comes: this gives up after 3 x short
        except RuntimeError:
            done.touch()

    train = load_params(ROOT / "params.yaml").train.model_copy(update={"lr": "auto"})
    (folder / RECORD).write_text(json.dumps({"suggestion": 3e-3, "rates": [1e-4, 3e-3]}))
    waits = {
        "hashed": lambda: verify_once(folder, rank, 2),
        "found": lambda: rate_for(train, nn.Linear(1, 1), None, None, 0, folder, rank, 2, print),
    }
    for done, wait in waits.items():
        canary = dist.new_group(backend="gloo", timeout=3 * short)  # every rank makes a group
        if rank == 1:
            threading.Thread(target=outlive, args=(canary, folder / done), daemon=True).start()
        result = wait()
    (folder / f"rate-{rank}.json").write_text(json.dumps(result[0].lr))
    os._exit(0)  # the canary's broken group would hold destroy_process_group


@pytest.mark.slow
def test_ranks_wait_on_rank_0s_hash_and_range_test_longer_than_the_default_timeout(tmp_path):
    """Rank 0 alone hashes the cache and runs the range test while the others wait; under NCCL
    the default group gives up after 10 minutes, which a large cache or model can take. The
    waiting rank must outlive its default group's timeout in both waits and take rank 0's rate."""
    import torch.multiprocessing as mp

    (tmp_path / "manifest.json").write_text(json.dumps({"files": {}}))  # a cache of no files
    mp.spawn(wait_on_rank_0, args=(free_port(), tmp_path), nprocs=2)
    assert (tmp_path / "hashed").exists() and (tmp_path / "found").exists()  # the canaries
    rates = [json.loads((tmp_path / f"rate-{rank}.json").read_text()) for rank in (0, 1)]
    assert rates == [3e-3, 3e-3]


def start_two_nodes(nodes: list[Path], out: str, state: str, fault: str = "") -> list:
    """The train stage on two "machines": a `torchrun --nnodes 2 --node_rank K` per folder (its
    own params, data and checkpoints), one process each, joined by a static rendezvous on
    127.0.0.1 as the manual's multi-node recipe joins them on the first node's address."""
    rendezvous = ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    return [
        torchrun(
            node,
            ["--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1", *rendezvous],
            out,
            state,
            fault,
        )
        for rank, node in enumerate(nodes)
    ]


def on_two_nodes(nodes: list[Path], out: str, state: str) -> list[subprocess.CompletedProcess]:
    return ended(start_two_nodes(nodes, out, state))


@pytest.mark.slow
@pytest.mark.longest
def test_two_nodes_resume_from_rank_0s_checkpoint_and_end_as_an_uninterrupted_run(
    workdir, tmp_path
):
    """Rank 0 alone writes checkpoints, so the second node has none: rank 0 decides the resume
    and sends the state to every rank, each going on with its own augmentation draws. A run
    stopped in epoch 1 and started again ends with the weights of an uninterrupted 2-epoch run
    (with augmentation and dropout on). Before, rank 1 started fresh while rank 0 resumed, and their collectives hung.
    A SIGTERM that reaches the first machine alone stops every rank at the epoch's end. A node
    whose cache is corrupted, or whose data differs, stops every rank in one line."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    digits = sources.load_source("digits", None)  # 200 of them: not overfit_batches, which
    few = digits._replace(  # turns augmentation and dropout off
        images=digits.images[:200], labels=digits.labels[:200], names=digits.names[:200]
    )
    split = {"val_fraction": 0.15, "test_fraction": 0.2, "seed": 0}
    dataset.build_cache(few, tmp_path / "small", dataset.Decode(8, "grayscale"), **split)
    for node in nodes:
        shutil.copytree(workdir, node, ignore=shutil.ignore_patterns("prepared"))
        shutil.copytree(tmp_path / "small", node / "prepared")
    tiny = {"batch_size": 16}  # 200 digits, 136 to train: 5 steps of up to 16 per rank

    def every_node(epochs: int) -> None:
        for node in nodes:
            write_params(node, {"train": {**tiny, "epochs": epochs}})

    every_node(2)
    whole = on_two_nodes(nodes, "whole", "whole-state")
    assert [r.returncode for r in whole] == [0, 0], (
        whole[0].stderr[-3000:] + whole[1].stderr[-3000:]
    )
    (a,) = (nodes[0] / "whole-state").glob("*/epoch-0002.pt")
    a = torch.load(a, weights_only=True)["model"]  # epoch 2's end

    # SIGTERM to the first machine's torchrun alone, in epoch 1: every rank finishes the epoch and
    # stops (before, the second node's rank went on into epoch 2 and failed there), and the
    # next run resumes from rank 0's checkpoint to the uninterrupted run's weights
    at, go = tmp_path / "at", tmp_path / "go"
    pause = f"train.loss@epoch=1,step=2:touch={at};train.loss@epoch=1,step=2:pause={go}"
    stopping = start_two_nodes(nodes, "stopped", "state-stop", f"{pause};train.stop:touch={go}")
    deadline = time.monotonic() + 120
    while not at.exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in stopping)
        time.sleep(0.2)
    stopping[0].send_signal(signal.SIGTERM)
    stopped = ended(stopping)
    for result in stopped:
        assert result.returncode != 0 and "Connection closed" not in result.stderr, result.stderr
        assert "interrupted: train stopped after epoch 1" in result.stderr, result.stderr[-3000:]
    assert not (nodes[1] / "state-stop").exists()  # rank 1 wrote nothing
    resumed = on_two_nodes(nodes, "stopped", "state-stop")
    assert [r.returncode for r in resumed] == [0, 0], resumed[0].stderr[-3000:]
    assert "(epoch 1 done)" in resumed[0].stdout, resumed[0].stdout[-3000:]
    (c,) = (nodes[0] / "state-stop").glob("*/epoch-0002.pt")
    c = torch.load(c, weights_only=True)["model"]
    assert all(torch.equal(a[k], c[k]) for k in a)

    x = nodes[1] / "prepared/train_x.npy"  # a flipped byte in the second node's cache
    good = x.read_bytes()
    x.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    corrupted = on_two_nodes(nodes, "corrupted", "state")
    said = "error: on rank 1's node, the prepared cache is corrupted: prepared/train_x.npy: sha256"
    for result in corrupted:  # each node hashes its own cache: every rank stops, naming it
        assert result.returncode != 0 and result.stderr.count(said) == 1, result.stderr[-3000:]
    x.write_bytes(good)

    cache = nodes[1] / "prepared"  # the second node prepared other data
    np.save(cache / "train_y.npy", np.roll(np.load(cache / "train_y.npy"), 1))
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["files"]["train_y.npy"]["sha256"] = dataset.file_hash(cache / "train_y.npy")
    (cache / "manifest.json").write_text(json.dumps(manifest))
    refused = on_two_nodes(nodes, "refused", "state")
    line = "error: train: the ranks' runs differ from rank 0's (rank 1: the data): every node"
    for result in refused:  # each rank says it once, then its torchrun reports the failure
        assert result.returncode != 0 and result.stderr.count(line) == 1, result.stderr[-3000:]


@pytest.mark.slow
def test_a_lost_node_is_named_in_one_line_by_the_node_that_goes_on(workdir, tmp_path):
    """The second machine's only rank dies in epoch 1 (as when its machine is lost). Before,
    rank 0 failed with some 40 lines of gloo traceback ("Read error [127.0.0.1]:22417: Connection
    reset by peer") and no line of the project's own."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        shutil.copytree(workdir, node)
        write_params(node, {"train": {"epochs": 2, "batch_size": 16, "overfit_batches": 8}})
    first, _ = ended(start_two_nodes(nodes, "out", "state", "train.loss@rank=1,step=2:kill"))
    line = r"error: train: rank 1 on node 1 \(Connection (reset|closed) by peer\) stopped during"
    said = re.findall(line + " epoch 1: rank 0 cannot go on without it", first.stderr)
    assert first.returncode != 0 and len(said) == 1, first.stderr[-3000:]  # either, as gloo says
    assert "start torchrun again on every node and training resumes from rank 0's" in first.stderr
    assert "[rank0]: Traceback" not in first.stderr  # the rank's; torchrun's own follows


def test_memory_mapped_split_trains_exactly_like_the_in_memory_one(tmp_path):
    """With dropout, over two epochs and a validation pass. Before, the memory-mapped path's
    DataLoader drew a seed from the global generator, which dropout draws from, at every epoch
    and validation: the same batches, different weights (val 0.9769 vs 0.9815)."""
    source = sources.load_source("digits", None)
    dataset.build_cache(
        source,
        tmp_path,
        dataset.Decode(8, "grayscale"),
        val_fraction=0.15,
        test_fraction=0.2,
        seed=0,
    )
    cpu = torch.device("cpu")
    mapped, held = (
        [loading.load_for_training(tmp_path, s, cpu, max_bytes) for s in ("train", "val")]
        for max_bytes in (0, 2**30)
    )
    assert not torch.is_tensor(mapped[0][0]) and torch.is_tensor(held[0][0])
    models, logits = [], []
    for (x, y), (x_val, y_val) in (mapped, held):
        torch.manual_seed(0)
        model = build_model("simple_cnn", 1, 10, 8, dropout=0.25)  # same seed: same weights
        optimizer = make_optimizer("adam", model, 1e-3, 0, 0, False)
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            split = Split(x, y, MEAN, STD, g, augment=lambda im: im)
            metrics = train_one_epoch(model, optimizer, split, Step(64))
            assert metrics["images"] == len(y)
            logits.append(evaluate(model, x_val, y_val, MEAN, STD, 100)[1])
        models.append(model)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(logits[1], logits[3])


def test_a_split_held_in_memory_loads_without_numpys_not_writable_warning(tmp_path):
    """Every train run printed PyTorch's "The given NumPy array is not writable" (a fresh process:
    PyTorch prints it once per process)."""
    np.save(tmp_path / "train_x.npy", np.zeros((16, 8, 8, 1), np.uint8))  # as the cache writes it
    np.save(tmp_path / "train_y.npy", np.zeros(16, np.int64))
    code = (
        "import sys, torch; from pathlib import Path; from visionflow.train import loading; "
        "loading.load_for_training(Path(sys.argv[1]), 'train', torch.device('cpu'), 2**30)"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code, str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 0 and "not writable" not in result.stderr, result.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_on_the_gpu_scales_and_steps():
    x, y = (t.cuda() for t in toy())
    model = fresh_model().cuda()
    optimizer = make_optimizer("adam", model, 1e-3, 0, 0, False)
    scaler = torch.amp.GradScaler("cuda")
    metrics = train_one_epoch(
        model,
        optimizer,
        Split(x, y, MEAN.cuda(), STD.cuda(), torch.Generator().manual_seed(0)),
        Step(16, dtype=torch.float16),
        scaler=scaler,
    )
    assert (
        metrics["steps"] == 4 and scaler.get_scale() > 0 and amp_dtype("auto", torch.device("cuda"))
    )


# the host reads that make it wait for a GPU: a value taken off the device
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextmanager
def host_reads() -> Iterator[list[str]]:
    """Every read of a tensor's value on the host while it is open, named by where it was made."""
    calls, originals = [], {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name, original):
        def read(self, *args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            calls.append(f"{name} at {Path(caller.filename).name}:{caller.lineno}")
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


SYNC_CASES = {  # name: (Step, fp16 scaler, health's first losses, host reads a step may make)
    "defaults": (Step(8), False, 0, 1),  # whether the step's losses were finite: skip it if not
    "bf16, clipped, accumulated": (Step(4, 2, grad_clip=1.0, dtype=torch.bfloat16), False, 0, 1),
    "health's first losses": (Step(8), False, 50, 1),
    "fp16": (Step(8, dtype=torch.float16), True, 0, 2),  # and whether the scaler overflowed
}
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SYNC_CASES)
def test_a_training_step_reads_nothing_on_the_host_but_what_a_feature_needs(case, device):
    """A read on the host (`.item()`, `.tolist()`, `bool(tensor)`, ...) makes the host wait for
    the GPU to finish everything queued: the loss, accuracy, gradient norms and health's first
    losses stay on the device and are read once at the epoch's end. Counted per step as the
    difference between an epoch of 16 steps and one of 8 (each also reads once at its end, and
    syncs once after its warm-up). On a GPU, CUDA's own sync check counts alike."""
    step, fp16, record, allowed = SYNC_CASES[case]
    counts = {}
    for steps in (8, 16):
        x, y = (t.to(device) for t in toy(steps * 8))
        model = fresh_model().to(device)
        optimizer = make_optimizer("adam", model, 1e-3, 0, 0.9, False)
        scaler = torch.amp.GradScaler(device, enabled=fp16)
        split = Split(x, y, MEAN.to(device), STD.to(device), torch.Generator().manual_seed(0))
        with host_reads() as reads, cuda_syncs(device) as syncs:
            metrics = train_one_epoch(
                model, optimizer, split, step, scaler=scaler, record_losses=record
            )
        assert metrics["steps"] == steps and len(metrics["first_losses"]) == min(record, steps)
        counts[steps] = (reads, syncs)
    (reads_8, syncs_8), (reads_16, syncs_16) = counts[8], counts[16]
    per_step = (len(reads_16) - len(reads_8)) / 8
    assert per_step <= allowed, f"{per_step} host reads a step: {reads_16}"
    assert (len(syncs_16) - len(syncs_8)) / 8 <= allowed, syncs_16


@contextmanager
def cuda_syncs(device: str) -> Iterator[list[str]]:
    """CUDA's own count of the calls that synchronised with the device (none on the CPU)."""
    if device != "cuda":
        yield []
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield (found := [])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    found += [str(w.message)[:200] for w in caught if "synchroniz" in str(w.message)]


def test_auto_picks_per_model_and_device_the_speed_settings_measured_faster(monkeypatch):
    """`train.amp: auto` and `train.channels_last: auto`: simple_cnn on a GPU trains in fp32
    with the default layout (bf16 with channels_last was 0.87x on an H200); the residual
    networks in bf16 with channels_last (1.46x); the CPU keeps what it had. Decided without a GPU."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    picked = {
        (model, device.type): speed_settings("auto", "auto", model, device)[:2]
        for model in ("simple_cnn", "small_resnet", "resnet50")
        for device in (cuda, cpu)
    }
    assert picked == {
        ("simple_cnn", "cuda"): (None, False),
        ("small_resnet", "cuda"): (torch.bfloat16, True),
        ("resnet50", "cuda"): (torch.bfloat16, True),
        ("simple_cnn", "cpu"): (None, True),
        ("small_resnet", "cpu"): (None, True),
        ("resnet50", "cpu"): (None, True),
    }
    assert (
        "simple_cnn trained fastest in fp32"
        in speed_settings("auto", "auto", "simple_cnn", cuda)[2]
    )
    # a value set in params.yaml is taken as it is, auto or not for the other key
    assert speed_settings("bf16", True, "simple_cnn", cuda) == (
        torch.bfloat16,
        True,
        "as params.yaml sets them",
    )
    assert speed_settings("bf16", "auto", "simple_cnn", cuda)[:2] == (torch.bfloat16, False)
    assert speed_settings("auto", True, "simple_cnn", cuda)[:2] == (None, True)


@pytest.mark.slow
def test_a_compiled_model_trains_like_the_eager_one():
    """`train.compile: true` wraps the model in torch.compile (inductor, C++ on the CPU)."""
    x, y = toy()
    losses = []
    for compiled in (False, True):
        model = fresh_model()
        net = torch.compile(model) if compiled else model
        optimizer = make_optimizer("sgd", model, 0.05, 0, 0.9, False)
        metrics = train_one_epoch(
            net, optimizer, Split(x, y, MEAN, STD, torch.Generator().manual_seed(0)), Step(16)
        )
        losses.append(metrics["loss"])
        assert metrics["steps"] == 4 and metrics["skipped_steps"] == 0
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_gpu_out_of_memory_is_the_error_the_stage_catches():
    """The stage's retry path catches torch.OutOfMemoryError: prove a real CUDA OOM is one."""
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(int(free * 2), dtype=torch.uint8, device="cuda")
    torch.cuda.empty_cache()


def test_each_configuration_keeps_its_own_state_and_old_ones_are_pruned(tmp_path):
    folders = []
    for i, fp in enumerate(["a", "b", "c", "d"]):
        folders.append(tmp_path / fp)
        checkpoint.save_checkpoint(folders[-1], state(1, fp))
        os.utime(folders[-1], (i, i))  # a is the oldest
    removed = checkpoint.prune(tmp_path, keep=folders[0])
    assert removed == [folders[1]]  # the current one (a) stays, with the newest others (d, c)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "c", "d"]
    loaded, why = checkpoint.load_latest(tmp_path / "c", "c", "cpu")
    assert loaded["epoch"] == 1 and "resuming" in why


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_known_setup_failures_are_one_line_naming_the_key(reproduced_base, tmp_path):
    """`train.device: cuda` without a GPU, or `train.pretrained` that is not there: before, tracebacks."""
    from tests.helpers import copy_project, sh

    project = copy_project(reproduced_base, tmp_path / "project")
    stage = [
        sys.executable,
        "-m",
        "pipeline.train",
        "--data",
        "data/prepared",
        "--out",
        "out",
        "--checkpoints",
        "state",
    ]
    for change, message in (
        ({"device": "cuda"}, "error: train.device is 'cuda', but torch sees no usable GPU"),
        (
            {"model": "resnet18", "pretrained": "data/pretrained/none.pt"},
            "error: train.pretrained: data/pretrained/none.pt is not a file",
        ),
    ):
        write_params(project, {"train": change})
        result = sh(project, *stage, check=False)
        assert result.returncode == 1 and message in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr
        sh(project, "git", "checkout", "HEAD", "--", "params.yaml")


def test_a_checkpointed_model_trains_and_evaluates_exactly_like_the_plain_one():
    """Activation checkpointing recomputes the forward in backward; BatchNorm's running statistics
    must be updated once per step, not twice (pytorch/pytorch#96136), so the two evaluate alike."""
    x, y = toy(64)
    models = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_model("small_resnet", 1, 2, 8, checkpointing=checkpointing)
        optimizer = make_optimizer("sgd", model, 0.05, 0, 0, False)
        train_one_epoch(
            model, optimizer, Split(x, y, MEAN, STD, torch.Generator().manual_seed(0)), Step(16)
        )
        models.append(model)
    plain, checkpointed = (m.state_dict() for m in models)
    for key, value in plain.items():
        other = checkpointed.get(key, checkpointed.get(key.replace(".", ".inner.", 1)))
        assert torch.allclose(value.float(), other.float(), atol=1e-6), key


def _ranks_evaluate(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from visionflow.train.engine import evaluate, sync_buffers

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(0)
    model = build_model("small_resnet", 1, 2, 8)
    x, y = toy(64)
    model.train()
    model(normalise(to_unit(x[rank::2]), MEAN, STD))  # each rank's shard: its own BN statistics
    losses = []
    for synced in (False, True):
        if synced:
            sync_buffers(model, world)
        loss = torch.tensor(evaluate(model, x, y, MEAN, STD, 64)[0]["loss"])
        gathered = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(gathered, loss)
        losses.append([float(g) for g in gathered])
    if rank == 0:
        Path(out).write_text(json.dumps(losses))
    dist.destroy_process_group()


def test_every_rank_evaluates_the_same_model_so_they_decide_together(tmp_path):
    """Under DDP, BatchNorm's running statistics differ per rank; evaluated as they are, plateau
    and early-stop decisions could differ and hang the group. sync_buffers gives every rank rank 0's."""
    import torch.multiprocessing as mp

    out = tmp_path / "losses.json"
    mp.spawn(_ranks_evaluate, args=(2, free_port(), str(out)), nprocs=2)
    unsynced, synced = json.loads(out.read_text())
    assert unsynced[0] != unsynced[1]  # the problem is real
    assert synced[0] == synced[1]


def test_deterministic_kernels_are_on_without_importing_the_compiler():
    """`train.deterministic` switches torch to deterministic kernels; without `train.compile`
    the switch does not import torch's compiler (1.5 s of every train start, before)."""
    probe = (
        "import sys, torch\nfrom visionflow.train.training import seed_everything\n"
        "seed_everything(0, True, compiled=False)\n"
        "print(torch.are_deterministic_algorithms_enabled(), 'torch._inductor' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": python_path(ROOT / "src", ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["True", "False"]


@pytest.mark.parametrize("device", DEVICES)
def test_a_resumed_run_draws_the_dropout_an_uninterrupted_one_draws(device):
    """Dropout draws from the device's generator (on a GPU, CUDA's): the checkpoint carries it.
    The trainer is the stage's own (`trainer_for`, from params.yaml)."""
    from visionflow.fit.setup import trainer_for
    from visionflow.params import load_params

    t = load_params(ROOT / "params.yaml").train
    model = fresh_model().to(device)
    trainer = trainer_for(model, t, seed=0, rank=0, world=1, image_size=8, images=64)
    saved = trainer.state()
    ones = torch.ones(10_000, device=device)
    uninterrupted = F.dropout(ones, 0.5)
    torch.manual_seed(123)  # a fresh process: other draws
    if device == "cuda":
        torch.cuda.manual_seed_all(123)
    assert not torch.equal(F.dropout(ones, 0.5), uninterrupted)  # the draws do differ
    trainer.restore(saved)
    assert torch.equal(F.dropout(ones, 0.5), uninterrupted)


def umask() -> int:
    """This process's umask, read without setting it (os.umask would change it for every thread,
    the reproduced project's builder included)."""
    status = Path("/proc/self/status").read_text()
    return int(
        next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8
    )


@pytest.mark.slow
def test_the_model_and_every_checkpoint_follow_the_umask_like_the_other_outputs(reproduced_base):
    """`dvc repro` wrote model.pt and the checkpoints 0600 (mkstemp): no other user or serving
    container could read the trained model, while every other output was 0644."""
    train = reproduced_base / "results/train"
    written = [train / "model.pt", *sorted((reproduced_base / "checkpoints/train").rglob("*.pt"))]
    assert len(written) > 2  # the model, an epoch's checkpoint, the best one
    modes = {str(p.relative_to(reproduced_base)): oct(p.stat().st_mode & 0o777) for p in written}
    assert set(modes.values()) == {oct(0o666 & ~umask())}, modes
    assert (train / "health.json").stat().st_mode & 0o777 == 0o666 & ~umask()  # as the others


def test_a_run_keeps_its_best_epoch_and_a_lost_rank_is_named(monkeypatch):
    from visionflow.train.training import Progress, epoch_line, lost_rank

    progress = Progress()
    accuracies = [0.5, 0.7, 0.7, 0.6]
    improved = [progress.update(e, {"val/accuracy": a}) for e, a in enumerate(accuracies, 1)]
    assert improved == [True, True, False, False]  # a tie is not better
    assert progress.best == {"accuracy": 0.7, "epoch": 2} and progress.stale == 2
    gloo = (
        "[../gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:41235: Connection reset by peer"
    )
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "0")
    assert lost_rank(RuntimeError(gloo), 0, 2) == "rank 1 on node 1 (Connection reset by peer)"
    assert lost_rank(RuntimeError(gloo), 3, 4) == "a rank at 10.0.0.2 (Connection reset by peer)"
    assert lost_rank(RuntimeError(gloo), 0, 1) is None
    assert lost_rank(RuntimeError("CUDA out of memory"), 0, 2) is None
    record = {"train/loss": 0.5, "train/accuracy": 0.8, "val/loss": 0.25, "val/accuracy": 0.9,
              "lr": 1e-3, "lr_backbone": 0.0, "train/images_per_s": 1234.4, "skipped_steps": 2}  # fmt: skip
    assert epoch_line(record) == (
        "train loss 0.5000 acc 0.8000  val loss 0.2500 acc 0.9000  lr 1.00e-03 backbone frozen"
        "     1234 img/s  2 skipped"
    )


def test_the_curves_are_the_same_bytes_whatever_the_clock_said(tmp_path, monkeypatch):
    """Two runs of the same epochs at different speeds: their curves (a DVC output) are the same
    bytes, and the timings go to a folder of their own. Before, images/s, epoch seconds, peak
    memory and the data wait were curves in the output: every run gave train a new hash."""
    from visionflow.train.training import live_curves, log_epoch

    monkeypatch.chdir(tmp_path)

    def files(folder: Path) -> dict[str, str]:
        return {str(f.relative_to(folder)): f.read_text() for f in folder.rglob("*") if f.is_file()}

    def run(name: str, rate: float) -> tuple[dict, dict]:
        record = {"train/loss": 0.5, "val/accuracy": 0.9, "lr": 1e-3, "skipped_steps": 0,
                  "train/images_per_s": rate, "epoch_seconds": 1e3 / rate,
                  "peak_memory_mb": rate, "data_wait_fraction": 1 / rate}  # fmt: skip
        with live_curves(tmp_path / name, tmp_path / f"{name}.timings", [record]) as lives:
            log_epoch(lives, 2, record)  # epoch 1 came from a checkpoint (a resumed run)
        return files(tmp_path / name), files(tmp_path / f"{name}.timings")

    (fast, fast_timings), (slow, slow_timings) = run("fast", 1000.0), run("slow", 10.0)
    assert fast == slow and "live/plots/metrics/val/accuracy.tsv" in fast
    assert not any("images_per_s" in text or "seconds" in text for text in fast.values())
    assert set(slow_timings) == {
        "metrics.json",
        "plots/metrics/train/images_per_s.tsv",
        "plots/metrics/epoch_seconds.tsv",
        "plots/metrics/peak_memory_mb.tsv",
        "plots/metrics/data_wait_fraction.tsv",
    }
    assert slow_timings["plots/metrics/train/images_per_s.tsv"].splitlines() == [
        "step\timages_per_s", "1\t10.0", "2\t10.0"
    ]  # fmt: skip
    assert fast_timings != slow_timings
    with live_curves(None, tmp_path / "none", []) as lives:  # another rank: nothing written
        assert lives is None and not (tmp_path / "none").exists()


def test_the_first_stop_finishes_the_epoch_and_a_second_ctrl_c_stops_at_once(capfd):
    from visionflow.train.training import StopRequest

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = StopRequest()
        assert signal.getsignal(signal.SIGTERM) == stop.handle
        assert not stop.agreed(1, torch.device("cpu"))
        stop.handle(signal.SIGTERM, None)
        stop.handle(signal.SIGTERM, None)  # a stop is under way: nothing more
        stop.handle(signal.SIGINT, None)  # nor after a SIGTERM
        assert stop.requested == signal.SIGTERM and stop.agreed(1, torch.device("cpu"))
        said = capfd.readouterr().err
        assert said.count("train: SIGTERM: finishing this epoch to checkpoint it\n") == 1
        assert "Ctrl-C" not in said  # a SIGINT after a SIGTERM does not cut it short
        ctrl_c = StopRequest()
        ctrl_c.handle(signal.SIGINT, None)
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.handle(signal.SIGINT, None)
    finally:
        signal.set_wakeup_fd(-1)  # StopRequest's
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_two_ctrl_cs_during_one_long_operation_stop_at_once(capfd):
    """A forward on the CPU takes seconds, and Python runs a signal's handler only after it,
    once for all the signals that came meanwhile: Ctrl-C twice 0.1 s apart was one, and the stage
    finished the epoch (130 s on photos). SIGINT blocked here while another thread presses
    Ctrl-C twice stands for that operation: both arrive, the handler runs once."""
    from visionflow.train.training import StopRequest

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = StopRequest()
        go = threading.Event()

        def press_twice():  # made before the block; each to itself: taken before the next
            go.wait()
            for _ in range(2):
                signal.pthread_kill(threading.get_ident(), signal.SIGINT)

        press = threading.Thread(target=press_twice)
        press.start()
        with pytest.raises(KeyboardInterrupt):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                go.set()
                press.join()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            for _ in range(1000):  # the handler runs between two of these steps
                pass
        assert stop.requested == signal.SIGINT
        assert "finishing this epoch" not in capfd.readouterr().err  # it stopped at once
    finally:
        signal.set_wakeup_fd(-1)
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_a_ctrl_c_to_every_process_is_the_main_processes_alone_to_answer(tmp_path, capfd):
    """A terminal's Ctrl-C reaches every process of the group, the DataLoader workers of a
    memory-mapped split too: they had inherited the stage's handler, each said "finishing this
    epoch", and a second Ctrl-C ended them on their own, leaving the main process to wait for
    them at exit. Now a worker ignores it, and the batches go on to the epoch's end."""
    from visionflow.train.training import StopRequest

    x, y = toy(96)
    np.save(tmp_path / "x.npy", x.permute(0, 2, 3, 1).mul(255).to(torch.uint8).numpy())
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = StopRequest()
        stream = loading.batches(mapped, y, 8, torch.Generator().manual_seed(0), workers=2)
        seen = [next(stream), next(stream)]  # one from each worker: both have started
        workers = multiprocessing.active_children()
        assert workers  # the loader's
        for worker in workers:
            os.kill(worker.pid, signal.SIGINT)
            os.kill(worker.pid, signal.SIGINT)  # a second Ctrl-C: still the main process's
        seen += list(stream)
        assert len(seen) == 12 and stop.requested is None
        assert "finishing this epoch" not in capfd.readouterr().err
    finally:
        signal.set_wakeup_fd(-1)  # StopRequest's
        for s, handler in handlers.items():
            signal.signal(s, handler)


# a process that ends with a memory-mapped pass still open, as a stop at once leaves it
OPEN_PASS = """
import numpy as np, torch
from visionflow.train import loading
np.save("x.npy", np.zeros((400, 8, 8, 1), np.uint8))
stream = loading.batches(np.load("x.npy", mmap_mode="r"), torch.zeros(400), 8, workers=2)
next(stream)
print("ending", flush=True)
"""


def test_a_process_ends_with_a_memory_mapped_pass_still_open(tmp_path):
    """The loader's workers ignore SIGTERM (a stop finishes the epoch), and Python's
    multiprocessing ends a process's workers at exit with SIGTERM and then waits for them: a
    pass still open at exit (a second Ctrl-C's stop at once, an error) hung the process for
    good. Now they are killed first, with no word of a crashed worker."""
    ended = subprocess.run(
        [sys.executable, "-c", OPEN_PASS],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": python_path(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=300,  # a hang fails the test, not the suite; the exit is what it waits on
    )
    assert ended.returncode == 0 and ended.stdout == "ending\n", ended.stderr
    assert "Traceback" not in ended.stderr and "killed by signal" not in ended.stderr, ended.stderr


def test_a_fallback_to_the_older_checkpoint_finds_the_best_file_it_names(tmp_path):
    """Epoch 3 improved on epoch 2: its checkpoint names best-0003.pt, epoch 2's best-0002.pt.
    With epoch 3's checkpoint unreadable, the run falls back to epoch 2's, whose best file had
    been deleted when epoch 3 was saved: the fallback then started fresh (adversarial pass)."""
    history = [{"val/accuracy": a} for a in (0.5, 0.7, 0.9)]
    for epoch in (1, 2, 3):
        best = checkpoint.best_as_of(history, epoch)
        checkpoint.save_atomic({"state_dict": {}}, checkpoint.best_file(tmp_path, best))
        kept = {**state(epoch), "history": history[:epoch], "best": {"epoch": best}}
        checkpoint.save_checkpoint(tmp_path, kept)
    assert sorted(p.name for p in tmp_path.glob("best-*.pt")) == ["best-0002.pt", "best-0003.pt"]
    newest = tmp_path / "epoch-0003.pt"
    newest.write_bytes(newest.read_bytes()[:200])
    with pytest.warns(UserWarning, match="epoch-0003.pt is unreadable"):
        loaded, _ = checkpoint.load_latest(tmp_path, "abc", "cpu")
    assert loaded["epoch"] == 2 and checkpoint.best_file(tmp_path, 2).exists()
    assert checkpoint.best_as_of([{"val/accuracy": 0.5}] * 3, 3) == 1  # the first of equals
