"""Stage train: fit the model on the cached train split, keep the best by validation accuracy.

Reads:  params.yaml (seed, train.*); the cache from prepare; sanity's scan (train runs after the check)
Writes: <out>/model.pt (best epoch: state_dict + meta, loads with weights_only=True),
        <out>/metrics.json (what `dvc metrics` compares: the kept epoch and its val accuracy,
        healthy and the count of findings), <out>/health.json (every check),
        <out>/live/ (DVCLive: per-epoch curves, x = epoch), <checkpoints>/<fingerprint>/ (resumable
        state: a checkpoint per epoch and best-<epoch>.pt, for this run's params, data and code
        only; not a DVC output, so DVC neither deletes nor tracks it; kept until DVC has recorded
        the outputs it gave, then the next run of the same configuration starts fresh)
Run:    python -m pipeline.train --data data/prepared --out results/train --checkpoints checkpoints/train

A killed run resumes from its last checkpoint on the next `dvc repro` and ends with the same
weights and metrics as an uninterrupted one (CPU, train.deterministic: true). So does a finished
run given a larger train.epochs (plateau, step or no schedule: the cosine schedule's rate depends
on the budget); a run that cannot resume says which key changed since the newest checkpoint.
"""

import argparse
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pipeline import GateError, Interrupted, code_digest, run, staged, when_published
from visionflow import faults
from visionflow.data import dataset
from visionflow.errors import DataError, Unavailable
from visionflow.ops import project
from visionflow.params import Train, load_params
from visionflow.train import checkpoint, from_torchvision, health, loading
from visionflow.train.engine import (
    NonFiniteLoss,
    Step,
    amp_dtype,
    evaluate,
    make_optimizer,
    make_scheduler,
    pick_device,
    step_scheduler,
    sync_buffers,
)
from visionflow.train.models import build_model, save_atomic
from visionflow.train.training import (
    OutOfMemory,
    Progress,
    StopRequest,
    Trainer,
    cpu_copy,
    epoch_line,
    epoch_record,
    live_curves,
    log_epoch,
    peak_memory_mb,
    seed_everything,
    start_distributed,
    stepping,
)
from visionflow.train.zoo import (
    FineTune,
    gradient_check,
    input_size,
    is_import_path,
    is_weights_name,
    preprocessing,
)


def run_of(params, cache: Path) -> dict:
    """What a resumable checkpoint must match (its folder is named by the hash of this, and its
    run.json keeps it): the seed, train params, and the content of the data, the stage's code and
    the pretrained file. train.epochs is left out but for the cosine schedule, whose learning rate
    depends on it: under the others a longer run's first epochs are a shorter run's, so a larger
    budget resumes a finished run."""
    t = params.train
    weights = None if not t.pretrained or is_weights_name(t.pretrained) else Path(t.pretrained)
    train = t.model_dump(exclude=set() if t.scheduler == "cosine" else {"epochs"})
    hashes = {
        "data": dataset.file_hash(cache / "manifest.json"),
        "code": code_digest("train"),
        "pretrained weights": dataset.file_hash(weights) if weights else None,
    }
    return {"seed": params.seed, "train": train, "hashes": hashes}


# why a changed key starts training fresh, where that is not plain from its name
FRESH_BECAUSE = {"train.epochs": "the cosine schedule's learning rate depends on it"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train on the cached train split.")
    parser.add_argument("--data", type=Path, required=True, help="cache folder from prepare")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    parser.add_argument("--checkpoints", type=Path, required=True, help="resumable state folder")
    return parser.parse_args()


def device_for(t: Train) -> torch.device:
    try:
        return pick_device(t.device)
    except Unavailable as e:
        raise GateError(f"train.device is {t.device!r}, but {e}") from None


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
    """Rank 0 re-hashes the cache (a flipped byte is an error here, not a silently worse model);
    under DDP the others take its verdict, so the data is read once and every rank fails alike."""
    problem = None
    if rank == 0:
        if faults.ACTIVE:
            faults.fault("train.verify", rank=rank)
        try:
            dataset.verify_cache(cache)
        except DataError as e:
            problem = str(e)
    if world > 1:
        verdict = [problem]
        dist.broadcast_object_list(verdict, src=0)
        problem = verdict[0]
    if problem:
        raise DataError(problem)


def load_data(cache: Path, t: Train, device: torch.device) -> Data:
    max_bytes = t.max_memory_gb * 2**30  # larger splits: memory-mapped, read by DataLoader workers
    x_train, y_train = loading.load_for_training(cache, "train", device, max_bytes)
    x_val, y_val = loading.load_for_training(cache, "val", device, max_bytes)
    if t.overfit_batches:  # a fixed small subset, scored on itself: the loss must go to ~0
        subset = t.overfit_batches * t.batch_size
        x_train, y_train = x_train[:subset], y_train[:subset]
        x_val, y_val = x_train, y_train
    return Data(x_train, y_train, x_val, y_val, dataset.read_cache_meta(cache))


def model_for(t: Train, d: Data, device: torch.device, say) -> tuple[nn.Module, list, list, dict]:
    """The model on the device, the mean/std its inputs are normalised with (the train split's,
    or those the pretrained weights were trained with) and, for a torchvision classifier, what
    model.pt records of its network (`network_for`)."""
    mean, std, network = d.meta.mean, d.meta.std, None
    if from_torchvision(t.model, t.pretrained):
        network = network_for(t, d, say)
        mean, std = network["mean"], network["std"]
        if d.channels == 1:  # FineTune gives each of the network's channels its own
            mean, std = [sum(mean) / 3], [sum(std) / 3]
    try:
        model = build_model(
            t.model,
            d.channels,
            len(d.meta.classes),
            d.image_size,
            t.dropout,
            t.checkpointing,
            network,
            t.pretrained,
        )
    except Unavailable as e:
        raise GateError(f"train.pretrained: {e}") from None
    except ValueError as e:  # a network of your own that does not build or fit
        raise GateError(str(e)) from None
    if t.pretrained and not is_weights_name(t.pretrained):
        if not Path(t.pretrained).resolve().is_relative_to(Path("data/pretrained").resolve()):
            say(
                f"train: warning: {t.pretrained} is outside data/pretrained/, which dvc.yaml "
                "tracks: DVC will not rerun train when that file changes"
            )
    model = model.to(device)
    if t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, mean, std, network


def network_for(t: Train, d: Data, say) -> dict:
    """A torchvision classifier's input size (the weights' centre crop of the cache's side) and
    the 3-channel mean/std it is fed with: its weights', or the train split's from scratch."""
    if not t.pretrained:
        return {
            "input_size": d.image_size,
            "mean": d.meta.mean * (3 // d.channels),
            "std": d.meta.std * (3 // d.channels),
            "weights": None,
        }
    try:
        pre = preprocessing(t.model, t.pretrained)
    except Unavailable as e:
        raise GateError(f"train.pretrained: {e}") from None
    if is_weights_name(t.pretrained) and pre["interpolation"] != d.meta.resize:
        say(
            f"train: note: {t.model}'s weights saw {pre['interpolation']} resizes, the cache "
            f"{d.meta.resize}: set prepare.interpolation: {pre['interpolation']} to match them"
        )
    size = input_size(t.model, d.image_size, t.pretrained)
    return {"input_size": size, "mean": pre["mean"], "std": pre["std"], "weights": pre["weights"]}


def checked_network(t: Train, model: nn.Module, d: Data, monitor: health.Monitor) -> None:
    """A network of your own gets the checks a new model needs: its output shape (build_model's
    dummy forward) and its gradients against finite differences, which go into health.json."""
    if not is_import_path(t.model):
        return
    result = gradient_check(model, d.channels, d.image_size, len(d.meta.classes))
    if not result["passed"]:
        raise GateError(
            f"train.model: {t.model} fails the gradient check: autograd and finite differences "
            f"differ by {result['max_relative_error']:.2e} (relative, float64; at most 1e-4)"
        )
    monitor.model_check = {"gradient_check": result}


def model_metadata(
    t: Train, seed: int, d: "Data", mean: list, std: list, network: dict | None
) -> dict:
    """What model.pt says about itself: plain values only, so it loads with weights_only=True.
    The export stage's model card states only what this (and the cache) say."""
    return {
        "model": t.model,
        "in_channels": d.channels,
        "image_size": d.image_size,
        "dropout": t.dropout,
        "classes": d.meta.classes,
        "mean": mean,
        "std": std,
        "background": d.meta.background,
        "jpeg_draft": d.meta.jpeg_draft,  # how the cache decoded JPEGs: predict does the same
        "reducing_gap": d.meta.reducing_gap,  # and resized every image
        "resize": d.meta.resize,
        "fit": d.meta.fit,
        "checkpointing": t.checkpointing,
        **({"network": network} if network else {}),  # a torchvision classifier's (`network_for`)
        # where mean/std come from (`model_for`)
        "norm": "ImageNet (the pretrained weights' statistics)" if t.pretrained else "train split",
        "train": {
            "epochs": t.epochs,
            "batch_size": t.batch_size,
            "lr": t.lr,
            "weight_decay": t.weight_decay,
            "dropout": t.dropout,
            "seed": seed,
        },
    }


PUBLISHED = "published.json"  # in a state folder: the md5 of the model.pt its run published


def resume(
    trainer: Trainer, monitor: health.Monitor, folder: Path, run: dict, out: Path, epochs: int, say
) -> Progress:
    """The state of this fingerprint only, from its own folder (`state_to_resume`); a fresh
    start otherwise (other configurations' folders beyond the newest few are pruned)."""
    device = next(trainer.model.parameters()).device
    state, why, extending = state_to_resume(folder, run, out, epochs, device)
    best = checkpoint.best_file(folder, state["best"]["epoch"]) if state else None
    if state and not checkpoint.readable(best):  # half-deleted or corrupt
        state, extending = None, False
        why = (
            f"not resuming from {folder}: its {best.name} is missing or unreadable; starting fresh"
        )
    say(f"train: {why}")
    if trainer.world > 1:
        dist.barrier()  # every rank has read the folder before rank 0 changes it
    if trainer.rank == 0:
        if state is None:
            shutil.rmtree(folder, ignore_errors=True)  # a fresh run starts a fresh folder
        if extending:  # no longer the run that published: a kill now leaves a run to resume
            (folder / PUBLISHED).unlink()
        checkpoint.write_run(folder, run)
        for stray in folder.glob("best-*.pt"):  # written just before a checkpoint that did not
            if stray != best:
                stray.unlink()
        for old in checkpoint.prune(folder.parent, keep=folder):
            say(f"train: removed the resumable state of another configuration: {old}")
    if state is None:
        return Progress()
    trainer.restore(state)
    if trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(state["scheduler"])
    monitor.load_state_dict(state["health"])
    return Progress(state["history"], state["best"], state["epoch"] + 1, state["stale"])


def state_to_resume(
    folder: Path, run: dict, out: Path, epochs: int, device: torch.device
) -> tuple[dict | None, str, bool]:
    """(the state to resume or None, a line saying why, whether it extends a finished run).

    A run that finished (published its outputs) is extended when train.epochs grew: only
    schedules whose first epochs do not depend on the budget share a fingerprint across budgets
    (`run_of`). Else it is kept until DVC has recorded its outputs: then it is done with, and a
    new run (`dvc repro -f`) starts fresh; if DVC did not (a full cache, a stop while DVC hashed
    them), its outputs are written again from it, without training. Without a checkpoint of its
    own, the line names what changed since the newest other configuration's."""
    had_state = any(folder.glob("epoch-*.pt"))
    state, why = checkpoint.load_latest(folder, checkpoint.fingerprint(run), device)
    if state is None:
        changed = None
        if not had_state:  # not some unreadable files (load_latest said so): another config's?
            changed = checkpoint.why_not_resumed(folder.parent, folder, run, FRESH_BECAUSE)
        return None, f"starting fresh: {changed}" if changed else why, False
    if state["epoch"] > epochs:  # a longer run's state, and train.epochs was lowered
        why = f"not resuming {folder}: its epoch {state['epoch']} is past train.epochs {epochs}"
        return None, f"{why}; starting fresh", False
    if not (folder / PUBLISHED).exists():  # a run that stopped before its end
        return state, why, False
    done = recorded(folder, out)
    budget = state.get("epochs", state["epoch"])  # an early-stopped run did fewer epochs
    if epochs > budget:
        kind = "recorded" if done else "finished"
        return state, f"extending the {kind} {budget}-epoch run to {epochs} epochs: {why}", True
    if done:
        why = "the last run of these params, data and code is recorded by DVC; starting fresh"
        return None, why, False
    why = (
        "the last run of these params finished but DVC did not record its outputs (a full "
        f"cache, a stop while DVC hashed them): {why}; writing them again, without training"
    )
    return state, why, False


def recorded(folder: Path, out: Path) -> bool:
    """Whether DVC recorded the model.pt this state folder's run published: dvc.lock names it
    and DVC's cache holds it."""
    try:
        md5 = json.loads((folder / PUBLISHED).read_text())["model.pt"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return project.recorded(out / "model.pt", md5)


def mark_published(folder: Path, out: Path) -> None:
    dataset.write_json(folder / PUBLISHED, {"model.pt": dataset.file_hash(out / "model.pt", "md5")})


def failed(args, t: Train, monitor: health.Monitor, rank: int, error, epoch: int) -> GateError:
    """The run stops (out of memory, or of finite losses): the health report goes beside the
    (untouched) previous results; the resumable state stays (the next run resumes from its last
    good epoch)."""
    message = str(error)
    if isinstance(error, NonFiniteLoss):
        hint = f"train.lr is {t.lr:g}: divide it by 10, or set train.grad_clip"
        finding = health.Finding("diverging", epoch, f"diverging: {error}; {hint}", {"lr": t.lr})
        monitor.add(finding)
        message = f"{error}; the last good checkpoint is kept in {args.checkpoints}"
    if rank == 0:
        report = args.out.with_name(args.out.name + ".health.json")
        dataset.write_json(report, monitor.report())
        print(monitor.summary(str(report)))
    return GateError(message)


def trainer_for(
    model: nn.Module, t: Train, seed: int, rank: int, world: int, image_size: int
) -> Trainer:
    """The model, what steps it (DDP and/or compiled), its optimizer, schedule and scaler, and
    the generators of the batch order and the augmentation, as train.* says."""
    device = next(model.parameters()).device
    net = stepping(model, world, t.compile)
    groups = None
    if isinstance(model, FineTune) and t.pretrained:  # the new head, then the backbone
        backbone_lr = t.lr * t.backbone_lr_factor
        groups = [{"params": model.head_parameters(), "lr": t.lr}]
        groups += [{"params": model.backbone(), "lr": backbone_lr}]
    optimizer = make_optimizer(
        t.optimizer, model, t.lr, t.weight_decay, t.momentum, t.nesterov, groups
    )
    scheduler = make_scheduler(
        t.scheduler, optimizer, t.epochs, t.lr_patience, t.lr_factor, t.lr_step
    )
    dtype = amp_dtype(t.amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    step = Step(
        t.batch_size,
        t.accumulate,
        t.grad_clip,
        t.label_smoothing,
        t.max_nonfinite_steps,
        dtype,
        agree_on_memory=t.auto_batch and world > 1,  # every rank retries, or none
    )
    shuffle = torch.Generator().manual_seed(seed)
    augment_rng = torch.Generator().manual_seed(seed + rank)
    augment = t.augment.model_dump()
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
        t.auto_batch,
        rank,
        world,
        compiled=t.compile,
    )


def main() -> None:
    args = parse_args()
    params = load_params()
    t = params.train

    # --- params, data, model, and what steps it ---------------------------------------------
    rank, world = start_distributed(t.device)
    say = print if rank == 0 else (lambda *_, **__: None)  # rank 0 alone prints and writes
    seed_everything(params.seed, t.deterministic, t.compile)
    device = device_for(t)
    verify_once(args.data, rank, world)
    d = load_data(args.data, t, device)
    model, norm_mean, norm_std, network = model_for(t, d, device, say)
    norm = torch.tensor(norm_mean, device=device), torch.tensor(norm_std, device=device)
    trainer = trainer_for(model, t, params.seed, rank, world, d.image_size)
    model_meta = model_metadata(t, params.seed, d, norm_mean, norm_std, network)

    # --- resume: the state of this fingerprint only, in its own folder ------------------------
    run = run_of(params, args.data)
    folder = args.checkpoints / checkpoint.fingerprint(run)
    monitor = health.Monitor(health.Limits(**t.health.model_dump()), d.meta.classes, say)
    checked_network(t, model, d, monitor)
    progress = resume(trainer, monitor, folder, run, args.out, t.epochs, say)
    say(starting(t, trainer, d, device))
    for warning in degenerate_batches(len(d.y_train) // world, t.batch_size, t.accumulate):
        say(f"train: warning: {warning}")

    # --- the epoch loop: train, validate, record, keep the best, checkpoint -------------------
    out = staged(args.out) if rank == 0 else None  # moved to args.out when the run succeeds
    stop, best_state = StopRequest(), None  # best_state: the best epoch, in memory
    with live_curves(out, progress.history) as live:
        for epoch in range(progress.start, t.epochs + 1):
            if t.early_stop and progress.stale >= t.early_stop:
                say(f"train: early stop, no better val accuracy for {progress.stale} epochs")
                break
            if isinstance(model, FineTune) and t.freeze_epochs:
                trainer.freeze(epoch <= t.freeze_epochs)  # the new head alone, then all
            try:
                train_metrics, record = train_and_validate(trainer, d, norm, epoch, monitor)
            except (OutOfMemory, NonFiniteLoss) as e:
                raise failed(args, t, monitor, rank, e, epoch) from None
            improved = progress.update(epoch, record)
            monitor.epoch(epoch, train_metrics, progress.history, trainer.lr, d.mapped)
            if live:
                log_epoch(live, epoch, record)
                if improved:  # kept in memory too: the best file is for a resumed run
                    meta = {**model_meta, "epoch": epoch, "val_accuracy": record["val/accuracy"]}
                    best_state = {"state_dict": cpu_copy(model.state_dict()), "meta": meta}
                    save_atomic(best_state, checkpoint.best_file(folder, epoch))
                save_epoch(trainer, progress, monitor, folder, epoch, t.epochs)
            if faults.ACTIVE:
                faults.fault("train.epoch_end", epoch=epoch)
            best = "  (best)" if improved else ""
            say(f"epoch {epoch:3d}/{t.epochs}  {epoch_line(record)}{best}")
            if stop.requested:
                raise Interrupted(
                    f"train stopped after epoch {epoch}; its checkpoint is in "
                    f"{folder}, and `dvc repro` resumes from it"
                )

    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        write_outputs(out, args.out, best_state, folder, progress, monitor, model_meta)


def starting(t: Train, trainer: Trainer, d: Data, device: torch.device) -> str:
    parameters = sum(p.numel() for p in trainer.model.parameters())
    return (
        f"train: {t.model} on {device} x {trainer.world} (amp {trainer.step.dtype or 'off'}), "
        f"{len(d.y_train)} train ({'memory-mapped' if d.mapped else 'on the device'}) / "
        f"{len(d.y_val)} val images, {parameters} parameters"
    )


def train_and_validate(
    trainer: Trainer, d: Data, norm: tuple, epoch: int, monitor: health.Monitor
) -> tuple[dict, dict]:
    """One epoch of training, then validation (every rank evaluates rank 0's model: the same
    answer) and the scheduler's step: (the training numbers, the epoch's record)."""
    mean, std = norm
    started = time.perf_counter()
    train_metrics = trainer.epoch(d.x_train, d.y_train, mean, std, epoch, monitor)
    seconds = time.perf_counter() - started
    sync_buffers(trainer.model, trainer.world)
    val_metrics, _ = evaluate(trainer.model, d.x_val, d.y_val, mean, std, 1024)
    lr, backbone_lr = trainer.lr, trainer.backbone_lr
    step_scheduler(trainer.scheduler, val_metrics["loss"])
    record = epoch_record(train_metrics, val_metrics, lr, seconds, peak_memory_mb(mean.device))
    if backbone_lr is not None:  # fine-tuning: the backbone's own rate (train.backbone_lr_factor)
        record["lr_backbone"] = backbone_lr
    return train_metrics, record


def save_epoch(
    trainer: Trainer, progress: Progress, monitor, folder: Path, epoch: int, epochs: int
):
    checkpoint.save_checkpoint(
        folder,
        {
            **trainer.state(),
            "epoch": epoch,
            "fingerprint": folder.name,  # the folder is named by it (`main`)
            "epochs": epochs,  # the budget: a larger one extends this run
            "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
            "best": progress.best,
            "stale": progress.stale,
            "history": progress.history,
            "health": monitor.state_dict(),
        },
    )


def write_outputs(
    out: Path,
    final: Path,
    best_state,
    folder: Path,
    progress: Progress,
    monitor: health.Monitor,
    model_meta: dict,
) -> None:
    """model.pt (the kept epoch: from memory when it ran in this process, else its best file,
    with this run's meta: an extended run's budget, not the shorter run's), health.json and
    metrics.json into the staging folder. The state stays until DVC has recorded
    them (the next run's start checks): a failure after this stage (a full DVC cache, a kill
    while DVC hashes) then costs no training."""
    best_path = checkpoint.best_file(folder, progress.best["epoch"])
    if best_state is not None:
        save_atomic(best_state, out / "model.pt")
    elif best_path.exists():  # its meta made as above: the same bytes as an uninterrupted run's
        saved = torch.load(best_path, map_location="cpu", weights_only=True)
        kept = {k: saved["meta"][k] for k in ("epoch", "val_accuracy")}
        best = {"state_dict": saved["state_dict"], "meta": {**model_meta, **kept}}
        save_atomic(best, out / "model.pt")
    else:
        shutil.rmtree(folder, ignore_errors=True)
        raise GateError(f"{best_path} was deleted during the run; run again to start fresh")
    report = monitor.report()
    dataset.write_json(out / "health.json", report)
    best = progress.best
    compared = {"best_epoch": best["epoch"], "val_acc": best["accuracy"]}  # the kept model's
    compared |= {k: report[k] for k in ("healthy", "findings")}
    dataset.write_json(out / "metrics.json", compared)
    print(monitor.summary(str(final / "health.json")))
    # once the outputs are in place: a refused run (a dep changed while it ran) is not marked
    when_published(lambda: mark_published(folder, final))
    print(
        f"train: best val accuracy {best['accuracy']:.4f} at epoch {best['epoch']}; "
        f"model.pt goes to {final} when the stage succeeds"
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


if __name__ == "__main__":
    run(main)
