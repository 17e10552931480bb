"""The central promise of a training run, in-process and in seconds: stopped after any epoch and
resumed, a run ends with exactly the state of an uninterrupted one. Every piece of resumable
state is compared (weights, optimizer, scheduler, GradScaler, every generator, the epochs'
records, the best epoch, the early-stop count, the health monitor's findings and first losses),
and so are the outputs (model.pt, metrics.json, health.json), for every schedule and with
`train.lr: auto`, frozen epochs (a stop on each side of the boundary), accumulation, label
smoothing, early stop and batch mixing (MixUp, CutMix), pairwise.

Each run is the train stage's own `Run` (visionflow.fit.run), on a real digits cache; the stop
is the stage's own fault point after an epoch's checkpoint (`train.epoch_end`), as a kill there
would leave it. docs/tests.md lists which test fails when a restore is broken on purpose.
"""

import gc
import json
import math
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import ROOT, digits_cache, merge
from visionflow import faults
from visionflow.errors import GateError
from visionflow.fit import resume
from visionflow.fit.run import Run
from visionflow.params import parse_params
from visionflow.train import checkpoint

# what an epoch's wall clock decides: never compared
TIMINGS = {"train/images_per_s", "epoch_seconds", "peak_memory_mb", "data_wait_fraction"}
TIMINGS |= {"data_wait"}  # the health monitor's largest share of an epoch spent waiting

BASE = {
    "train": {
        "epochs": 4,
        "batch_size": 128,  # 8 steps an epoch on digits' 1,000-odd training images
        "lr_patience": 0,  # plateau: a rate that moves within 4 epochs
        "lr_step": 1,
        "amp": "off",
        "health": {"first_steps": 12, "data_bound": 1.0},  # first losses span epochs 1 and 2
    }
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return digits_cache(tmp_path_factory.mktemp("run") / "prepared")


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """Pretrained weights in torchvision's layout (any weights: the resume is what is tested)."""
    from torchvision.models import get_model

    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("weights") / "mnv3.pth"
    torch.save(get_model("mobilenet_v3_small").state_dict(), path)
    return path


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> tuple[Path, Path]:
    """bench/photos.py's photo-like JPEGs (5 classes, 10 each) cached at 32 px RGB, and resnet18
    weights in torchvision's layout (#58's network; any weights: what is tested is the rates)."""
    from torchvision.models import get_model

    from bench.photos import generate
    from visionflow.data import dataset, sources

    root = tmp_path_factory.mktemp("photos")
    generate(root / "photos", 50, classes=5, size=(48, 36))
    source = sources.load_source("imagefolder", root / "photos")
    decode = dataset.Decode(32, "rgb")
    dataset.build_cache(
        source, root / "prepared", decode, val_fraction=0.2, test_fraction=0.2, seed=0
    )
    torch.manual_seed(1)
    torch.save(get_model("resnet18").state_dict(), root / "resnet18.pth")
    return root / "prepared", root / "resnet18.pth"


@pytest.fixture(autouse=True)
def handlers():
    """A run's StopRequest takes SIGINT and SIGTERM, and Python's wakeup fd; the test's process
    gets them back."""
    kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    yield
    signal.set_wakeup_fd(wakeup)
    for s, handler in kept.items():
        signal.signal(s, handler)


def params(**train):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    return parse_params(merge(raw, merge(BASE, {"train": train})))


def train(p, cache: Path, root: Path, stop_after: int | None = None) -> Run:
    """The train stage's run in this process, its outputs in root/out and state in root/state;
    with `stop_after`, killed after that epoch's checkpoint (a FaultInjected), then run again."""
    plan = f"train.epoch_end@epoch={stop_after}:raise" if stop_after else ""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(faults, "FAULTS", faults.parse(plan))
        patch.setattr(faults, "ACTIVE", bool(plan))
        run = Run(p, cache, root / "out", root / "state", code="tests")
        run.resume()
        (root / "out").mkdir(parents=True, exist_ok=True)
        if stop_after:
            with pytest.raises(faults.FaultInjected):
                run.fit(root / "out")
            return train(p, cache, root)
        run.fit(root / "out")
    run.write_outputs(root / "out")
    return run


def state(run: Run) -> dict:
    """The last checkpoint of the run's state folder: every piece of resumable state."""
    found, _ = checkpoint.load_latest(run.folder, run.folder.name, "cpu")
    assert found is not None
    return found


def differences(a, b, where: str = "") -> list[str]:
    """Where `a` and `b` differ (tensors bit for bit, floats exactly; timings skipped)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = (a.keys() | b.keys()) - TIMINGS
        return [
            d
            for k in sorted(keys, key=str)
            for d in differences(a.get(k), b.get(k), f"{where}/{k}")
        ]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{where}[{i}]")
        ]
    if torch.is_tensor(a) and torch.is_tensor(b):
        same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def outputs(run: Run) -> dict:
    out = run.out
    return {
        "model.pt": torch.load(out / "model.pt", weights_only=True),
        "metrics.json": json.loads((out / "metrics.json").read_text()),
        "health.json": json.loads((out / "health.json").read_text()),
    }


def assert_resumes_exactly(p, cache: Path, tmp_path: Path, stop_after: int) -> Run:
    whole = train(p, cache, tmp_path / "whole")
    resumed = train(p, cache, tmp_path / "resumed", stop_after=stop_after)
    assert resumed.progress.start == stop_after + 1  # it did resume, from the stop's epoch
    kept = state(whole)
    assert sorted(kept) == sorted(state(resumed))
    found = differences(kept, state(resumed)) + differences(outputs(whole), outputs(resumed))
    assert not found, found
    return whole


CASES = {  # train.* beyond BASE, and the epoch after which the run is killed
    "plateau-accumulate-smoothing": ({"accumulate": 2, "label_smoothing": 0.1}, 1),
    "cosine-early_stop": ({"scheduler": "cosine", "early_stop": 1, "epochs": 5}, 2),
    "step-lr_auto-accumulate": ({"scheduler": "step", "lr": "auto", "accumulate": 3}, 2),
    "onecycle-lr_auto-smoothing": (
        {"scheduler": "onecycle", "lr": "auto", "label_smoothing": 0.2},
        3,
    ),
    "none-early_stop-smoothing": (
        {"scheduler": "none", "early_stop": 2, "label_smoothing": 0.1},
        1,
    ),
    # MixUp and CutMix, one per batch: their draws come from torch's generator, which is saved
    "plateau-mixup-cutmix-smoothing": (
        {"augment": {"mixup": 0.2, "cutmix": 1.0}, "label_smoothing": 0.1},
        2,
    ),
    "step-fp16_scaler-accumulate": (
        # fp16 on the CPU is slow: two batches of the cache (overfit_batches) are enough for
        # the GradScaler's state to move
        {"scheduler": "step", "amp": "fp16", "accumulate": 2, "epochs": 3, "overfit_batches": 2},
        2,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_run_stopped_after_an_epoch_resumes_to_exactly_the_uninterrupted_state(
    case, cache, tmp_path
):
    change, stop_after = CASES[case]
    whole = assert_resumes_exactly(params(**change), cache, tmp_path, stop_after)
    history = state(whole)["history"]
    if change.get("early_stop") == 1:  # the case reaches its early stop, or tests nothing of it
        assert len(history) < 5, history
    if change.get("lr") == "auto":
        assert whole.found is not None and whole.train.lr == whole.found["suggestion"]


# a trainer that holds the state root's lock, as one a stopped `dvc repro` left running does
HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, b"%d\\n" % os.getpid())
print("held", flush=True)
sys.stdin.read()
"""


def test_a_second_trainer_waits_for_the_one_holding_the_state_then_resumes_from_it(
    cache, tmp_path, capsys
):
    """A `dvc repro` started beside the trainer of a stopped one (SIGTERM to DVC alone leaves
    it running) does not train beside it: it says which pid it waits for, and once that process
    is gone (SIGKILL too: the kernel drops its lock) it resumes from the checkpoint it left."""
    train(params(epochs=1), cache, tmp_path / "first")  # the orphan's state: epoch 1 done
    root = tmp_path / "state"
    shutil.copytree(tmp_path / "first" / "state", root)
    orphan = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root / resume.LOCK_FILE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert orphan.stdout.readline() == "held\n"
        capsys.readouterr()
        built = []
        p = params(epochs=2)
        second = threading.Thread(
            target=lambda: built.append(Run(p, cache, tmp_path / "out", root, code="tests"))
        )
        second.start()
        said = ""
        while f"another trainer (pid {orphan.pid}) holds {root}; waiting" not in said:
            assert second.is_alive(), f"a second trainer went on beside pid {orphan.pid}: {said}"
            time.sleep(0.05)
            said += capsys.readouterr().out
        assert "epoch-0001.pt" in said, said  # where the orphan is
    finally:
        orphan.kill()
        orphan.wait()
    second.join()
    run = built[0]
    run.resume()
    assert run.progress.start == 2  # resumed from the orphan's checkpoint
    run.fit(tmp_path / "out")
    assert len(state(run)["history"]) == 2


TAKER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: another process holds it
"""


def test_a_run_in_a_library_lets_go_of_the_state_once_it_is_gone(cache, tmp_path):
    """A run holds its state root until its end: in a library, until the object is gone (a
    process building runs one after another keeps no lock, nor a descriptor, per run). A run
    built beside it in the same process goes on; the lock stays until both are gone."""
    root, out = tmp_path / "state", tmp_path / "out"

    def free() -> bool:  # another process can take the lock
        taker = [sys.executable, "-c", TAKER, str(root / resume.LOCK_FILE)]
        return subprocess.run(taker, capture_output=True).returncode == 0

    first = Run(params(epochs=1), cache, out, root, code="tests")
    second = Run(params(epochs=1), cache, out, root, code="tests")  # this process: it goes on
    assert not free()
    del first
    gc.collect()
    assert not free()  # the second holds it still
    del second
    gc.collect()
    assert free()


# the last frozen epoch, the first unfrozen one (under one-cycle, and under plateau)
@pytest.mark.parametrize("stop_after,scheduler", [(2, "onecycle"), (3, "onecycle"), (3, "plateau")])
def test_a_fine_tuning_run_resumes_exactly_on_either_side_of_its_frozen_epochs(
    stop_after, scheduler, cache, weights, tmp_path
):
    change = {
        "model": "mobilenet_v3_small",
        "pretrained": str(weights),
        "freeze_epochs": 2,
        "scheduler": scheduler,
        "backbone_lr_factor": 0.5,
        "group_lr_factor": 0.5,
        "batch_size": 32,
        "overfit_batches": 4,  # 128 images: a fine-tuned network's epoch costs seconds here
    }
    whole = assert_resumes_exactly(params(**change), cache, tmp_path, stop_after)
    records = state(whole)["history"]
    assert [r["lr_backbone"] == 0 for r in records] == [True, True, False, False]


def test_a_raised_epoch_budget_extends_a_finished_run_where_the_schedule_allows(
    cache, tmp_path, capsys
):
    """plateau: the first 3 epochs of a 5-epoch run are a 3-epoch run's, so the finished run
    goes on to the uninterrupted 5-epoch state; cosine's rate follows the budget: it starts
    again, and says why."""
    shorter = train(params(epochs=3), cache, tmp_path / "extended")
    shorter.mark_published()
    extended = train(params(epochs=5), cache, tmp_path / "extended")
    assert "extending the finished 3-epoch run to 5 epochs" in capsys.readouterr().out
    whole = train(params(epochs=5), cache, tmp_path / "whole")
    found = differences(state(whole), state(extended)) + differences(
        outputs(whole), outputs(extended)
    )
    assert not found, found

    train(params(epochs=3, scheduler="cosine"), cache, tmp_path / "cosine").mark_published()
    capsys.readouterr()
    longer = train(params(epochs=5, scheduler="cosine"), cache, tmp_path / "cosine")
    said = capsys.readouterr().out
    assert "starting fresh" in said and "train.epochs" in said, said
    assert "the cosine and one-cycle schedules' rates depend on it" in said, said
    assert [r["lr"] for r in state(longer)["history"]][0] == 1e-3  # a fresh schedule


@pytest.mark.parametrize("overfit_batches", [0, 2])
def test_lr_find_plots_the_range_test_whose_rate_lr_auto_trains_with(
    overfit_batches, cache, tmp_path, monkeypatch
):
    """`visionflow lr-find` (python -m pipeline.lr_find) and `train.lr: auto` run the same range
    test: the rate it suggests is the rate the run trains with, and the plot is written; with
    train.overfit_batches too (lr-find tested the whole split: 7.56e-4 against auto's 5.21e-4)."""
    import pipeline.lr_find

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    change = merge(BASE, {"train": {"overfit_batches": overfit_batches}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(merge(raw, change)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lr_find", "--data", str(cache), "--out", "found"])
    pipeline.lr_find.main()
    suggested = json.loads((tmp_path / "found/lr_find.json").read_text())["suggestion"]
    assert (tmp_path / "found/lr_find.png").stat().st_size > 0
    auto = Run(
        params(lr="auto", overfit_batches=overfit_batches),
        cache,
        tmp_path / "out",
        tmp_path / "state",
        code="tests",
    )
    assert auto.train.lr == suggested and auto.found["suggestion"] == suggested


def test_lr_find_without_a_cache_is_one_line(tmp_path, monkeypatch):
    import pipeline.lr_find

    monkeypatch.setattr("sys.argv", ["lr_find", "--data", str(tmp_path / "nope"), "--out", "x"])
    with pytest.raises(GateError, match=r"--data .*nope holds no prepared cache: `dvc repro"):
        pipeline.lr_find.main()


def test_overfit_batches_says_whether_the_loss_got_near_0(cache, tmp_path, capsys):
    """The run promised "the loss should reach about 0" and said nothing at its end: at 1.71
    after 16 steps, health said "no finding" (adversarial pass)."""
    short = train(params(overfit_batches=2, epochs=1, lr=1e-4), cache, tmp_path / "short")
    said = capsys.readouterr().out
    loss = short.progress.history[-1]["train/loss"]
    assert f"train: overfit_batches: train loss {loss:.3f} after 1 epoch, not yet under" in said
    fitted = train(params(overfit_batches=1, epochs=30, lr=3e-3), cache, tmp_path / "fitted")
    assert fitted.progress.history[-1]["train/loss"] <= fitted.monitor.chance.loss / 10
    assert "the loop, model and data can fit these batches" in capsys.readouterr().out


def test_lr_auto_on_the_frozen_head_spreads_the_backbones_rates_and_trains_on(
    photos, tmp_path, capsys
):
    """#58: `train.lr: auto` with `train.freeze_epochs` measured the new head alone, and that
    rate then reached the whole backbone once unfrozen (the group factors at 1): resnet18 on
    photos, 2.15e-2, val loss 386333 and train accuracy at chance after unfreezing. Now the
    backbone's groups learn at fastai's spread below the head's rate (measured so, its BatchNorm
    layers included), and one-cycle with a frozen first epoch on made photos trains on."""
    cache, weights = photos
    change = {"model": "resnet18", "pretrained": str(weights), "lr": "auto", "freeze_epochs": 1}
    change |= {"scheduler": "onecycle", "epochs": 2, "batch_size": 10}
    run = train(params(**change), cache, tmp_path)
    said = capsys.readouterr().out
    rate = run.found["suggestion"]
    assert run.train.lr == rate and run.train.backbone_lr_factor == 0.1
    peaks = [group["max_lr"] for group in run.trainer.optimizer.param_groups]  # one-cycle's
    assert peaks == pytest.approx([rate, rate / 10, rate / 10**1.5, rate / 100])
    first, *unfrozen = run.progress.history
    assert first["lr_backbone"] == 0 and all(
        r["lr_backbone"] == pytest.approx(r["lr"] / 10) for r in unfrozen
    )
    assert (
        "train: train.lr auto was measured on the new head alone (train.freeze_epochs 1): once "
        f"unfrozen, the backbone's layer groups learn at {rate / 10:.2e} (the last) to "
        f"{rate / 100:.2e} (the first)"
    ) in said
    report = json.loads((run.out / "health.json").read_text())
    assert not report["diverging"] and not report["ruined_fine_tune"], report["messages"]
    assert max(r["val/loss"] for r in unfrozen) < 2 * max(first["val/loss"], math.log(5))
