"""`train.lr: auto`: the learning-rate range test on the prepared data and the configured model
(`range_test_of`; `visionflow lr-find` plots it), and the rate a run takes from it (`rate_for`).

The model is train.model with train.pretrained's weights, frozen as the first epochs will be
(train.freeze_epochs), its parameter groups at their shares of the head's rate; the test runs
on a copy of it, with generators of its own: the training that follows is the one a run with
`train.lr` set to the found rate makes. Under `train.lr: auto` the rate goes to the train log,
metrics.json (`lr`), model.pt's meta and the model card, and into the run's state folder
(lr_find.json): a resumed run takes it from there.

A test with the backbone frozen measures the new head alone: its rate is the head's. The
backbone, once unfrozen, takes fastai's `fine_tune` spread below it (`spread_for`): at the
head's rate it wrecked a run (#58: resnet18 on photos, 2.15e-2 from the frozen test, then val
loss 386333 and train accuracy at chance for five epochs after unfreezing).
"""

import copy
import json
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from visionflow import faults
from visionflow.data import dataset
from visionflow.errors import GateError
from visionflow.fit.setup import Data, trainer_for
from visionflow.params import Train
from visionflow.train.augment import augment
from visionflow.train.engine import Split
from visionflow.train.lr_find import START, range_test
from visionflow.train.training import patient_group
from visionflow.train.zoo import LR_GROUPS, FineTune

RECORD = "lr_find.json"  # in the run's state folder: the rate `train.lr: auto` found
# the backbone's groups after a test on the head alone: fastai's fine_tune trains them at
# slice(lr / 100, lr) once unfrozen; here its last group at a tenth of the head's rate, each
# earlier one at 0.32x the next (the first, of 3, at a hundredth)
SPREAD = {"backbone_lr_factor": 0.1, "group_lr_factor": 0.1**0.5}


def spread_for(train: Train, model) -> tuple[Train, dict]:
    """(train.* as a range test on the head alone is to be taken, what it changed): with the
    backbone frozen for the test (train.freeze_epochs), each of train.backbone_lr_factor and
    train.group_lr_factor left at 1 takes SPREAD's value, so that the head's rate never reaches
    the backbone unchanged. A factor set below 1 is the user's and stays."""
    if not (isinstance(model, FineTune) and train.freeze_epochs):
        return train, {}
    left = {key: share for key, share in SPREAD.items() if getattr(train, key) == 1.0}
    return train.model_copy(update=left), left


def spread_line(train: Train, rate: float) -> str:
    """What the backbone's groups learn at after unfreezing, for the log's line."""
    last = rate * train.backbone_lr_factor
    first = last * train.group_lr_factor ** (LR_GROUPS - 1)
    return (
        f"once unfrozen, the backbone's layer groups learn at {last:.2e} (the last) to "
        f"{first:.2e} (the first), fastai's fine_tune spread (train.backbone_lr_factor "
        f"{train.backbone_lr_factor:g}, train.group_lr_factor {train.group_lr_factor:.2g}; set "
        "them below 1 to choose)"
    )


def range_test_of(train: Train, model, data: Data, norm: tuple, seed: int) -> dict:
    """The range test on a copy of `model` (left as it is), frozen as train.freeze_epochs will
    freeze it, with train.*'s optimizer, batches and augmentation; the global generators (dropout's)
    are put back after it."""
    probe = copy.deepcopy(model)
    if isinstance(probe, FineTune) and train.freeze_epochs:
        probe.freeze(True)
    plain = train.model_copy(update={"lr": 1.0, "scheduler": "none", "compile": False})
    trainer = trainer_for(probe, plain, seed, 0, 1, data.image_size, len(data.y_train))
    draws = partial(augment, generator=trainer.augment_rng, **trainer.augment)
    split = Split(data.x_train, data.y_train, *norm, trainer.shuffle, draws)
    devices = [norm[0].device] if norm[0].device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return range_test(probe, trainer.optimizer, split, trainer.step)


def rate_for(
    train: Train,
    model,
    data: Data,
    norm: tuple,
    seed: int,
    folder: Path,
    rank: int,
    world: int,
    log,
):
    """(train.* with the rate the run uses, the range test's result or None). Under `train.lr:
    auto` the rate recorded in the run's state folder (a resumed run's), else the range test's
    suggestion (rank 0's, sent to every rank); no suggestion is a GateError in one line."""
    if train.lr != "auto":
        return train, None
    train, spread = spread_for(train, model)
    found, record = None, folder / RECORD
    if rank == 0:
        if faults.ACTIVE:
            faults.fault("train.lr_find", rank=rank)
        found = json.loads(record.read_text()) if record.exists() else None
        how = f"recorded in {record}"
        if found is None:
            found = range_test_of(train, model, data, norm, seed)
            how = f"{len(found['rates'])} steps; `visionflow lr-find` plots it"
        log(f"train: train.lr auto: {found['suggestion'] or 0:.2e}, the range test's ({how})")
        if spread and found["suggestion"] is not None:
            log(
                "train: train.lr auto was measured on the new head alone (train.freeze_epochs "
                f"{train.freeze_epochs}): {spread_line(train, found['suggestion'])}"
            )
    if world > 1:
        shared = [found]
        dist.broadcast_object_list(shared, src=0, group=patient_group())
        found = shared[0]
    if found["suggestion"] is None:
        raise GateError(no_rate(train, found))
    return train.model_copy(update={"lr": found["suggestion"]}), found


def no_rate(train: Train, found: dict) -> str:
    steps = len(found["rates"])
    reason = (
        f"the loss was not finite from its first steps ({steps} steps with a finite loss)"
        if steps < 5
        else f"the loss did not fall over {steps} steps of rates {START:g} to {found['rates'][-1]:.2g}"
    )
    return (
        f"train.lr: auto: the range test found no rate for {train.model} on this data: {reason}; "
        "set train.lr to a number (docs/training.md)"
    )


def record_rate(folder: Path, found: dict | None) -> None:
    """Keep the range test's result in the run's state folder (a resumed run reads it)."""
    if found is not None:
        dataset.write_json(folder / RECORD, found)
