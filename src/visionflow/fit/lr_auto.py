"""`train.lr: auto`: the learning-rate range test on the prepared data and the configured model
(`range_test_of`; `visionflow lr-find` plots it), and the rate a run takes from it (`rate_for`).

The model is train.model with train.pretrained's weights, frozen as the first epochs will be
(train.freeze_epochs), its parameter groups at their shares of the head's rate; the test runs
on a copy of it, with generators of its own: the training that follows is the one a run with
`train.lr` set to the found rate makes. Under `train.lr: auto` the rate goes to the train log,
metrics.json (`lr`), model.pt's meta and the model card, and into the run's state folder
(lr_find.json): a resumed run takes it from there.
"""

import copy
import json
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from visionflow.data import dataset
from visionflow.errors import GateError
from visionflow.fit.setup import Data, trainer_for
from visionflow.params import Train
from visionflow.train.augment import augment
from visionflow.train.engine import Split
from visionflow.train.lr_find import START, range_test
from visionflow.train.training import patient_group
from visionflow.train.zoo import FineTune

RECORD = "lr_find.json"  # in the run's state folder: the rate `train.lr: auto` found


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
    found, record = None, folder / RECORD
    if rank == 0:
        found = json.loads(record.read_text()) if record.exists() else None
        how = f"recorded in {record}"
        if found is None:
            found = range_test_of(train, model, data, norm, seed)
            how = f"{len(found['rates'])} steps; `visionflow lr-find` plots it"
        log(f"train: train.lr auto: {found['suggestion'] or 0:.2e}, the range test's ({how})")
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
