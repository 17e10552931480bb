"""What a run builds before its loop, from train.* and the cache: the device, the data (verified
once), the model (a torchvision classifier with its weights' preprocessing, or a network of your
own with its checks), what model.pt says about it, and what steps it (`trainer_for`)."""

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from visionflow import faults
from visionflow.data import dataset
from visionflow.errors import DataError, GateError, Unavailable
from visionflow.params import Augment, Train, recipe_values
from visionflow.train import from_torchvision, health, loading
from visionflow.train.augment import mixing
from visionflow.train.engine import (
    Step,
    make_optimizer,
    make_scheduler,
    pick_device,
    speed_settings,
)
from visionflow.train.models import build_model
from visionflow.train.training import Trainer, patient_group, stepping
from visionflow.train.zoo import (
    FineTune,
    gradient_check,
    input_size,
    is_import_path,
    is_weights_name,
    preprocessing,
)


def device_for(train: Train) -> torch.device:
    try:
        return pick_device(train.device)
    except Unavailable as error:
        raise GateError(f"train.device is {train.device!r}, but {error}") from None


@dataclass
class Data:
    """The cached splits the loop reads, on the device (or memory-mapped), and their description."""

    x_train: torch.Tensor | np.ndarray
    y_train: torch.Tensor
    x_val: torch.Tensor | np.ndarray
    y_val: torch.Tensor
    meta: dataset.Cache  # classes, train-split mean/std, background

    @property
    def channels(self) -> int:
        return self.x_train.shape[3]

    @property
    def image_size(self) -> int:
        return self.x_train.shape[1]

    @property
    def mapped(self) -> bool:
        return not torch.is_tensor(self.x_train)


def verify_once(cache: Path, rank: int, world: int) -> None:
    """The first rank of each node re-hashes its node's cache (a flipped byte is an error here,
    not a silently worse model); under DDP every rank takes every node's verdict, so each cache
    is read once and every rank fails alike, naming the rank whose node has the bad file."""
    problem = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        if faults.ACTIVE:
            faults.fault("train.verify", rank=rank)
        try:
            dataset.verify_cache(cache)
        except DataError as error:
            problem = str(error) if rank == 0 else f"on rank {rank}'s node, {error}"
    if world > 1:
        verdicts = [None] * world
        dist.all_gather_object(verdicts, problem, group=patient_group())
        problem = next((verdict for verdict in verdicts if verdict), None)
    if problem:
        raise DataError(problem)


OVERFIT = {  # train.overfit_batches: each of these keeps the loss of a few batches off 0
    "dropout": 0.0,
    "label_smoothing": 0.0,
    "weight_decay": 0.0,
    "augment": Augment(
        crop_padding=0, hflip=False, rotation=0.0, color_jitter=0.0, mixup=0.0, cutmix=0.0
    ),
}


def overfit_settings(train: Train) -> Train:
    """With train.overfit_batches the run is to fit its few batches exactly (digits' 128 images
    stayed at train loss 1.2-1.4 for 20 epochs with augmentation and dropout on, and fell to 0.14
    without): no augmentation, dropout, label smoothing or weight decay then."""
    return train.model_copy(update=OVERFIT) if train.overfit_batches else train


def each_class_in_turn(labels: np.ndarray) -> np.ndarray:
    """The indices of `labels`, each class's first, then each class's second, and so on: the first
    N hold every class where N allows (a folder's cache is in class order, and its first images,
    all of one class, are fitted by a constant)."""
    rank = np.zeros(len(labels), dtype=np.int64)  # how many of its class come before it
    for c in np.unique(labels):
        at = np.flatnonzero(labels == c)
        rank[at] = np.arange(len(at))
    return np.lexsort((labels, rank))


def load_data(cache: Path, train: Train, device: torch.device) -> Data:
    max_bytes = (
        train.max_memory_gb * 2**30
    )  # larger splits: memory-mapped, read by DataLoader workers
    x_train, y_train = loading.load_for_training(cache, "train", device, max_bytes)
    x_val, y_val = loading.load_for_training(cache, "val", device, max_bytes)
    if train.overfit_batches:  # a fixed small subset, scored on itself: the loss must go to ~0
        every = torch.from_numpy(each_class_in_turn(y_train.cpu().numpy()))
        every = every[: train.overfit_batches * train.batch_size].sort().values
        x_train = x_train[every] if torch.is_tensor(x_train) else x_train[every.numpy()]
        y_train = y_train[every]
        x_val, y_val = x_train, y_train
    return Data(x_train, y_train, x_val, y_val, dataset.read_cache_meta(cache))


def model_for(
    train: Train, data: Data, device: torch.device, log
) -> tuple[nn.Module, list, list, dict]:
    """The model on the device, the mean/std its inputs are normalised with (the train split's,
    or those the pretrained weights were trained with) and, for a torchvision classifier, what
    model.pt records of its network (`network_for`)."""
    mean, std, network = data.meta.mean, data.meta.std, None
    if from_torchvision(train.model, train.pretrained):
        network = network_for(train, data, log)
        mean, std = network["mean"], network["std"]
        if data.channels == 1:  # FineTune gives each of the network's channels its own
            mean, std = [sum(mean) / 3], [sum(std) / 3]
    try:
        model = build_model(
            train.model,
            data.channels,
            len(data.meta.classes),
            data.image_size,
            train.dropout,
            train.checkpointing,
            network,
            train.pretrained,
        )
    except Unavailable as error:
        raise GateError(f"train.pretrained: {error}") from None
    except ValueError as error:  # a network of your own that does not build or fit
        raise GateError(str(error)) from None
    if train.pretrained and not is_weights_name(train.pretrained):
        if not Path(train.pretrained).resolve().is_relative_to(Path("data/pretrained").resolve()):
            log(
                f"train: warning: {train.pretrained} is outside data/pretrained/, which dvc.yaml "
                "tracks: DVC will not rerun train when that file changes"
            )
    if isinstance(model, FineTune):
        model.train_bn = train.train_bn  # BatchNorm trains in the frozen epochs (fastai's train_bn)
    model = model.to(device)
    if speed_settings(train.amp, train.channels_last, train.model, device)[1]:
        model = model.to(memory_format=torch.channels_last)
    return model, mean, std, network


def network_for(train: Train, data: Data, log) -> dict:
    """A torchvision classifier's input size (the weights' centre crop of the cache's side) and
    the 3-channel mean/std it is fed with: its weights', or the train split's from scratch."""
    if not train.pretrained:
        return {
            "input_size": data.image_size,
            "mean": data.meta.mean * (3 // data.channels),
            "std": data.meta.std * (3 // data.channels),
            "weights": None,
        }
    try:
        pre = preprocessing(train.model, train.pretrained)
    except Unavailable as error:
        raise GateError(f"train.pretrained: {error}") from None
    if is_weights_name(train.pretrained) and pre["interpolation"] != data.meta.resize:
        log(
            f"train: note: {train.model}'s weights saw {pre['interpolation']} resizes, the cache "
            f"{data.meta.resize}: set prepare.interpolation: {pre['interpolation']} to match them"
        )
    if filled := recipe_values(train.model_dump()):  # what train.recipe changed from params.yaml's
        values = ", ".join(f"train.{key} {value}" for key, value in filled.items())
        log(
            f"train: the fine-tuning recipe sets {values} (train.recipe: scratch keeps the defaults)"
        )
    size = input_size(train.model, data.image_size, train.pretrained)
    return {"input_size": size, "mean": pre["mean"], "std": pre["std"], "weights": pre["weights"]}


def monitor_for(train: Train, data: Data, log) -> health.Monitor:
    """The health checks, judging chance by a guess of the training labels' class shares."""
    counts = torch.bincount(data.y_train.cpu(), minlength=len(data.meta.classes)).tolist()
    top = counts.index(max(counts))  # the guess says this class, on val as on train
    right = (data.y_val.cpu() == top).float().mean().item() if len(data.y_val) else None
    shares = [n / (sum(counts) or 1) for n in counts]
    chance = health.guess(shares, train.label_smoothing, right)
    limits = health.Limits(**train.health.model_dump())
    return health.Monitor(limits, data.meta.classes, log, chance)


def checked_network(train: Train, model: nn.Module, data: Data, monitor: health.Monitor) -> None:
    """A network of your own gets the checks a new model needs: its output shape (build_model's
    dummy forward) and its gradients against finite differences, which go into health.json."""
    if not is_import_path(train.model):
        return
    result = gradient_check(model, data.channels, data.image_size, len(data.meta.classes))
    if not result["passed"]:
        raise GateError(
            f"train.model: {train.model} fails the gradient check: autograd and finite differences "
            f"differ by {result['max_relative_error']:.2e} (relative, float64; at most 1e-4)"
        )
    monitor.model_check = {"gradient_check": result}


def model_metadata(
    train: Train, seed: int, data: "Data", mean: list, std: list, network: dict | None
) -> dict:
    """What model.pt says about itself: plain values only, so it loads with weights_only=True.
    The export stage's model card states only what this (and the cache) say."""
    return {
        "model": train.model,
        "in_channels": data.channels,
        "image_size": data.image_size,
        "dropout": train.dropout,
        "classes": data.meta.classes,
        "mean": mean,
        "std": std,
        "background": data.meta.background,
        "jpeg_draft": data.meta.jpeg_draft,  # how the cache decoded JPEGs: predict does the same
        "reducing_gap": data.meta.reducing_gap,  # and resized every image
        "resize": data.meta.resize,
        "fit": data.meta.fit,
        "checkpointing": train.checkpointing,
        **({"network": network} if network else {}),  # a torchvision classifier's (`network_for`)
        # where mean/std come from (`model_for`)
        "norm": "ImageNet (the pretrained weights' statistics)"
        if train.pretrained
        else "train split",
        "train": {
            "epochs": train.epochs,
            "batch_size": train.batch_size,
            "lr": train.lr,
            "weight_decay": train.weight_decay,
            "dropout": train.dropout,
            "seed": seed,
            "hflip": train.augment.hflip,  # trained on mirrored images: evaluate.tta mirrors too
            "augment": train.augment.model_dump(),  # the model card says what it trained on
            "label_smoothing": train.label_smoothing,
            "optimizer": train.optimizer,
            "scheduler": train.scheduler,
            "recipe": recipe_values(train.model_dump()),  # the keys the fine-tuning recipe set
            # fine-tuning: as trained (`train.lr: auto` may have spread the factors left at 1)
            **(
                {
                    "freeze_epochs": train.freeze_epochs,
                    "backbone_lr_factor": train.backbone_lr_factor,
                    "group_lr_factor": train.group_lr_factor,
                }
                if isinstance(network, dict) and train.pretrained
                else {}
            ),
        },
    }


def parameter_groups(model: nn.Module, train: Train) -> list[dict] | None:
    """Fine-tuning: the new head at train.lr, then the backbone's layer groups from the last
    (train.lr x train.backbone_lr_factor) down, each at the next one's rate x
    train.group_lr_factor (fastai's `slice(lr / 100, lr)`: early layers move least)."""
    if not (isinstance(model, FineTune) and train.pretrained):
        return None
    groups, rate = (
        [{"params": model.head_parameters(), "lr": train.lr}],
        train.lr * train.backbone_lr_factor,
    )
    for layers in reversed(model.layer_groups()):
        groups.append({"params": layers, "lr": rate})
        rate *= train.group_lr_factor
    return groups


def steps_per_epoch(images: int, train: Train, world: int) -> int:
    """Optimizer steps in an epoch of `images` training images (`loading.batches`)."""
    return math.ceil(math.ceil(images // world / train.batch_size) / train.accumulate)


def trainer_for(
    model: nn.Module,
    train: Train,
    seed: int,
    rank: int,
    world: int,
    image_size: int,
    images: int,
    classes: int | None = None,
) -> Trainer:
    """The model, what steps it (DDP and/or compiled), its optimizer, schedule and scaler, and
    the generators of the batch order and the augmentation, as train.* says (`images`: the
    training images, for a per-step schedule's length; `classes`: the soft targets' width
    when train.augment mixes batches)."""
    device = next(model.parameters()).device
    net = stepping(model, world, train.compile)
    optimizer = make_optimizer(
        train.optimizer,
        model,
        train.lr,
        train.weight_decay,
        train.momentum,
        train.nesterov,
        parameter_groups(model, train),
    )
    steps = steps_per_epoch(images, train, world)
    scheduler = make_scheduler(
        train.scheduler,
        optimizer,
        train.epochs,
        train.lr_patience,
        train.lr_factor,
        train.lr_step,
        steps,
    )
    dtype, _, _ = speed_settings(train.amp, train.channels_last, train.model, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    step = Step(
        train.batch_size,
        train.accumulate,
        train.grad_clip,
        train.label_smoothing,
        train.max_nonfinite_steps,
        dtype,
        agree_on_memory=train.auto_batch and world > 1,  # every rank retries, or none
    )
    shuffle = torch.Generator().manual_seed(seed)
    augment_rng = torch.Generator().manual_seed(seed + rank)
    augment = train.augment.model_dump(exclude={"mixup", "cutmix"})  # `augment.augment`'s
    if isinstance(model, FineTune) and model.size < image_size:
        augment["resized_crop"] = model.size  # the weights' crop: random while training
    return Trainer(
        model,
        net,
        optimizer,
        scheduler,
        scaler,
        shuffle,
        augment_rng,
        step,
        augment,
        train.auto_batch,
        rank,
        world,
        compiled=train.compile,
        freeze_epochs=train.freeze_epochs if isinstance(model, FineTune) else 0,
        mix=mixing(train.augment.mixup, train.augment.cutmix, classes),
    )


def starting(train: Train, trainer: Trainer, data: Data, device: torch.device) -> str:
    """The run's first lines: what trains where, on what, and the speed settings picked."""
    parameters = sum(p.numel() for p in trainer.model.parameters())
    dtype, channels_last, reason = speed_settings(
        train.amp, train.channels_last, train.model, device
    )
    asked = train.overfit_batches * train.batch_size
    short = f" (all there are, not the {asked} asked)" if len(data.y_train) < asked else ""
    overfit = (
        f"\ntrain: overfit_batches {train.overfit_batches}: {len(data.y_train)} images{short}, "
        "each class in turn, scored on themselves, with no augmentation, dropout, label smoothing "
        "or weight decay: the loss should reach about 0"
    )
    return (
        f"train: {train.model} on {device} x {trainer.world}, "
        f"{len(data.y_train)} train ({'memory-mapped' if data.mapped else 'on the device'}) / "
        f"{len(data.y_val)} val images, {parameters} parameters\n"
        f"train: amp {str(dtype).removeprefix('torch.') if dtype else 'off'}, channels_last "
        f"{str(channels_last).lower()} ({reason}){overfit if train.overfit_batches else ''}"
    )


def degenerate_batches(images: int, batch_size: int, accumulate: int) -> list[str]:
    """What to tell about batches that make an epoch a single optimizer step, with the numbers."""
    per_epoch = math.ceil(images / batch_size)
    found = []
    if batch_size > images:
        found.append(
            f"train.batch_size {batch_size} is more than the {images} training images "
            "(per process): one batch, one optimizer step per epoch"
        )
    if accumulate > per_epoch:
        found.append(
            f"train.accumulate {accumulate} is more than the {per_epoch} batches of an "
            f"epoch: one optimizer step per epoch, over {per_epoch} batches"
        )
    return found


SEEN_AT_LEAST = 0.7  # warn when the network sees less of each photo than this share, at evaluation


def cut_photos(cache: Path, meta: dict) -> str | None:
    """The warning when evaluation sees under SEEN_AT_LEAST of each photo: the centre square that
    prepare.fit: crop kept (the manifest's fit_kept), then the weights' centre crop of the cache."""
    made_from = json.loads((cache / "manifest.json").read_text())["made_from"]
    fit = made_from.get("fit_kept", 1.0)  # a cache made before it was recorded: unknown, 1
    side = meta["image_size"]
    size = meta.get("network", {}).get("input_size", side)
    seen = fit * size**2 / side**2
    if seen >= SEEN_AT_LEAST:
        return None
    parts = [f"prepare.fit: crop keeps {fit:.0%} of each photo"] if fit < 1 else []
    if size < side:
        parts.append(f"the {size} px centre crop {size**2 / side**2:.0%} of the {side} px cache")
    return (
        f"at evaluation the network sees {seen:.0%} of each photo on average ({', then '.join(parts)}"
        "): what lies near the edges is lost (results/sanity/eval_view.png shows what it sees)"
        + ("; prepare.fit: squash keeps the whole photo in the cache" if fit < 1 else "")
    )
