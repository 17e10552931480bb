"""Stage train: fit the model on the cached train split, keep the best by validation accuracy.

Reads:  params.yaml (seed, train.*); the cache from prepare; sanity's scan (train runs after the check)
Writes: <out>/model.pt (best epoch: state_dict + meta, loads with weights_only=True),
        <out>/metrics.json (what `dvc metrics` compares: the kept epoch and its val accuracy,
        healthy and the count of findings), <out>/health.json (every check),
        <out>/live/ (DVCLive: per-epoch curves, x = epoch), <checkpoints>/<fingerprint>/ (resumable
        state: a checkpoint per epoch and best.pt, for this run's params, data and code only;
        not a DVC output, so DVC neither deletes nor tracks it; removed once the stage succeeds)
Run:    python -m pipeline.train --data data/prepared --out results/train --checkpoints checkpoints/train

A killed run resumes from its last checkpoint on the next `dvc repro` and ends with the same
weights and metrics as an uninterrupted one (CPU, train.deterministic: true).
"""

import argparse
import io
import math
import os
import random
import resource
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from dvclive import Live
from torch.nn.parallel import DistributedDataParallel

from pipeline import GateError, Interrupted, code_digest, run, staged, when_published
from visionflow import checkpoint, data, faults, health
from visionflow.augment import augment
from visionflow.engine import (
    NonFiniteLoss,
    Step,
    amp_dtype,
    evaluate,
    make_optimizer,
    make_scheduler,
    pick_device,
    step_scheduler,
    sync_buffers,
    train_one_epoch,
)
from visionflow.errors import Unavailable
from visionflow.models import IMAGENET_MEAN, IMAGENET_STD, build_model, load_pretrained, save_atomic
from visionflow.params import load_params


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.benchmark = not deterministic  # autotuning picks kernels by timing


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KB


def start_distributed(device_name: str) -> tuple[int, int]:
    """(rank, world size): under `torchrun` one process per rank joins the group, else (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    cuda = torch.cuda.is_available() and device_name != "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), world


def fingerprint(params, cache: Path) -> str:
    """What a resumable checkpoint must match: the seed, train params, pretrained file, data and
    the content of the stage's code."""
    t = params.train
    weights = Path(t.pretrained) if t.pretrained not in ("", "imagenet") else None
    pretrained = data.file_hash(weights) if weights else None
    run = {"seed": params.seed, "train": t.model_dump(), "pretrained": pretrained}
    run["code"] = code_digest("train")
    return checkpoint.fingerprint(run, (cache / "manifest.json").read_text())


def cpu_copy(state_dict: dict) -> dict:
    """A snapshot of the weights off the device (state_dict() holds live references)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}


def epoch_record(train: dict, val: dict, lr: float, seconds: float, peak_mb: float) -> dict:
    """One epoch's numbers, as DVCLive logs them and the checkpoint keeps them."""
    return {
        "train/loss": train["loss"],
        "train/accuracy": train["accuracy"],
        "val/loss": val["loss"],
        "val/accuracy": val["accuracy"],
        "lr": lr,
        "grad_norm": train["grad_norm"],
        "skipped_steps": train["skipped_steps"],
        "train/images_per_s": train["images"] / seconds,
        "epoch_seconds": seconds,
        "peak_memory_mb": peak_mb,
        "data_wait_fraction": train["data_seconds"] / train["seconds"],
        # "classifier.1.bias" -> "classifier_1_bias": Vega reads a dot in a field name as nesting
        **{
            f"grad_norm_layer/{k.replace('.', '_')}": v
            for k, v in train["layer_grad_norms"].items()
        },
    }


def epoch_line(r: dict) -> str:
    """The log line's numbers for one epoch's record `r`."""
    return (
        f"train loss {r['train/loss']:.4f} acc {r['train/accuracy']:.4f}  "
        f"val loss {r['val/loss']:.4f} acc {r['val/accuracy']:.4f}  lr {r['lr']:.2e}  "
        f"{r['train/images_per_s']:7.0f} img/s"
        + (f"  {r['skipped_steps']} skipped" if r["skipped_steps"] else "")
    )


class StopRequest:
    """The first Ctrl-C or SIGTERM asks the run to finish its epoch, checkpoint it and stop; a
    second Ctrl-C stops at once (the previous epoch's checkpoint is kept)."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGINT, self.handle)
        signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            f"\ntrain: {signal.Signals(signum).name}: finishing this epoch to checkpoint it "
            "(Ctrl-C again stops at once)",
            file=sys.stderr,
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="Train on the cached train split.")
    parser.add_argument("--data", type=Path, required=True, help="cache folder from prepare")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    parser.add_argument("--checkpoints", type=Path, required=True, help="resumable state folder")
    args = parser.parse_args()
    params = load_params()
    t = params.train

    # --- data, model and the things that step it ---------------------------------------------
    rank, world = start_distributed(t.device)
    say = print if rank == 0 else (lambda *_, **__: None)  # rank 0 alone prints and writes
    seed_everything(params.seed, t.deterministic)
    try:
        device = pick_device(t.device)
    except Unavailable as e:
        raise GateError(f"train.device is {t.device!r}, but {e}") from None
    data.verify_cache(args.data)  # a flipped byte is an error here, not a silently worse model
    meta = data.read_cache_meta(args.data)
    max_bytes = t.max_memory_gb * 2**30  # larger splits: memory-mapped, read by DataLoader workers
    x_train, y_train = data.load_for_training(args.data, "train", device, max_bytes)
    x_val, y_val = data.load_for_training(args.data, "val", device, max_bytes)
    channels, image_size = x_train.shape[3], x_train.shape[1]
    if t.overfit_batches:  # a fixed small subset, scored on itself: the loss must go to ~0
        subset = t.overfit_batches * t.batch_size
        x_train, y_train = x_train[:subset], y_train[:subset]
        x_val, y_val = x_train, y_train

    model = build_model(
        t.model, channels, len(meta.classes), image_size, t.dropout, t.checkpointing
    )
    norm_mean, norm_std = meta.mean, meta.std  # train-split statistics
    if t.pretrained:  # pretrained weights bring the normalisation they were trained with
        if t.model != "resnet18":
            raise GateError(f"train.pretrained is for resnet18, not {t.model}")
        try:
            load_pretrained(model, t.pretrained)
        except Unavailable as e:
            raise GateError(f"train.pretrained: {e}") from None
        tracked = Path("data/pretrained").resolve()
        if t.pretrained != "imagenet" and not Path(t.pretrained).resolve().is_relative_to(tracked):
            say(
                f"train: warning: {t.pretrained} is outside data/pretrained/, which dvc.yaml "
                "tracks: DVC will not rerun train when that file changes"
            )
        norm_mean, norm_std = IMAGENET_MEAN[:channels], IMAGENET_STD[:channels]
        if channels == 1:
            norm_mean, norm_std = [sum(IMAGENET_MEAN) / 3], [sum(IMAGENET_STD) / 3]
    mean, std = torch.tensor(norm_mean, device=device), torch.tensor(norm_std, device=device)
    model = model.to(device)
    if t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    net = DistributedDataParallel(model) if world > 1 else model
    net = torch.compile(net) if t.compile else net
    optimizer = make_optimizer(t.optimizer, model, t.lr, t.weight_decay, t.momentum, t.nesterov)
    scheduler = make_scheduler(
        t.scheduler, optimizer, t.epochs, t.lr_patience, t.lr_factor, t.lr_step
    )
    dtype = amp_dtype(t.amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    shuffle = torch.Generator().manual_seed(params.seed)  # CPU generator: same order on any device
    augment_rng = torch.Generator().manual_seed(params.seed + rank)  # each rank its own draws
    augmentation = partial(augment, generator=augment_rng, **t.augment.model_dump())
    model_meta = {  # plain values only, so the file loads with weights_only=True
        "model": t.model,
        "in_channels": channels,
        "image_size": image_size,
        "dropout": t.dropout,
        "classes": meta.classes,
        "mean": norm_mean,
        "std": norm_std,
        "background": meta.background,
        "checkpointing": t.checkpointing,
    }

    def training_state() -> dict:
        """What stepping changes: saved in each checkpoint, restored on resume and OOM retry."""
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "shuffle": shuffle.get_state(),
                "augment": augment_rng.get_state(),
            },
        }

    def restore(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"]["torch"].cpu())
        shuffle.set_state(state["rng"]["shuffle"].cpu())
        augment_rng.set_state(state["rng"]["augment"].cpu())

    # --- resume: the state of this fingerprint only, in its own folder -------------------------
    run_fingerprint = fingerprint(params, args.data)
    state_dir = args.checkpoints / run_fingerprint
    best_path, best_state = state_dir / "best.pt", None  # best_state: the best epoch, in memory
    state, why = checkpoint.load_latest(state_dir, run_fingerprint, device)
    if state and not checkpoint.readable(best_path):  # half-deleted or corrupt: no kept model
        state, why = (
            None,
            f"not resuming from {state_dir}: its best.pt is missing or unreadable; starting fresh",
        )
    say(f"train: {why}")
    if rank == 0:
        if state is None:
            shutil.rmtree(state_dir, ignore_errors=True)  # a fresh run starts a fresh folder
        for old in checkpoint.prune(args.checkpoints, keep=state_dir):
            say(f"train: removed the resumable state of another configuration: {old}")
    history, best, start, stale = [], {"accuracy": -1.0, "epoch": 0}, 1, 0
    monitor = health.Monitor(t.health, meta.classes, say)
    if state:
        restore(state)
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        history, best, stale = state["history"], state["best"], state["stale"]
        monitor.load_state_dict(state["health"])
        start = state["epoch"] + 1
    parameters, mapped = sum(p.numel() for p in model.parameters()), not torch.is_tensor(x_train)
    say(
        f"train: {t.model} on {device} x {world} (amp {dtype or 'off'}), {len(y_train)} train "
        f"({'memory-mapped' if mapped else 'on the device'}) / {len(y_val)} val images, "
        f"{parameters} parameters"
    )
    for warning in degenerate_batches(len(y_train) // world, t.batch_size, t.accumulate):
        say(f"train: warning: {warning}")

    def fail(message: str) -> GateError:
        """The run stops: the health report goes beside the (untouched) previous results."""
        if rank == 0:
            report_path = args.out.with_name(args.out.name + ".health.json")
            data.write_json(report_path, monitor.report())
            say(monitor.summary(str(report_path)))
        # nothing left to resume once the outputs are in place; until then the state stays, so a
        # run refused at the end (a dep changed while it ran) resumes from its last epoch
        when_published(lambda: shutil.rmtree(state_dir, ignore_errors=True))
        return GateError(message)

    sizes = {"batch": t.batch_size, "accumulate": t.accumulate, "retried": False}

    def one_epoch(epoch: int) -> dict:
        """`train_one_epoch`; on a GPU out-of-memory, report it with the numbers and, with
        train.auto_batch, retry the epoch once from its start with half the batch and twice the
        accumulation (the same effective batch)."""
        saved = None
        if t.auto_batch and not sizes["retried"]:
            saved = io.BytesIO()  # a copy off the device: state_dict() holds references
            torch.save(training_state(), saved)
        while True:
            try:
                step = Step(
                    sizes["batch"],
                    sizes["accumulate"],
                    t.grad_clip,
                    t.label_smoothing,
                    t.max_nonfinite_steps,
                    dtype,
                )
                return train_one_epoch(
                    net,
                    optimizer,
                    x_train,
                    y_train,
                    mean,
                    std,
                    step,
                    shuffle,
                    augment=augmentation,
                    scaler=scaler,
                    epoch=epoch,
                    rank=rank,
                    world=world,
                    record_losses=monitor.steps_wanted(),
                )
            except torch.OutOfMemoryError:
                retry = saved is not None and sizes["batch"] > 1
                monitor.add(
                    health.out_of_memory(
                        epoch,
                        sizes["batch"],
                        sizes["accumulate"],
                        parameters,
                        peak_memory_mb(device),
                        retry,
                    )
                )
                if not retry:
                    raise fail(
                        f"out of memory at epoch {epoch}; see the health line above"
                    ) from None
                saved.seek(0)
                restore(torch.load(saved, weights_only=True))
                sizes.update(
                    batch=sizes["batch"] // 2, accumulate=sizes["accumulate"] * 2, retried=True
                )
                saved = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    # --- the epoch loop ------------------------------------------------------------------------
    out = staged(args.out) if rank == 0 else None  # moved to args.out when the run succeeds
    stop = StopRequest()
    live_dir = str(out / "live") if rank == 0 else ""
    with (
        Live(live_dir, dvcyaml=False, save_dvc_exp=False, report=None)
        if rank == 0
        else nullcontext() as live
    ):
        for epoch, past in enumerate(history if live else [], 1):  # a fresh staging folder: the
            live.step = epoch  # checkpoint kept the curves so far
            for name, value in past.items():
                live.log_metric(name, value)
            live.next_step()
        for epoch in range(start, t.epochs + 1):
            if t.early_stop and stale >= t.early_stop:
                say(f"train: early stop, no better val accuracy for {stale} epochs")
                break
            start_time = time.perf_counter()
            try:
                train_metrics = one_epoch(epoch)
            except NonFiniteLoss as e:
                monitor.add(
                    health.Finding(
                        "diverging",
                        epoch,
                        f"diverging: {e}; train.lr is "
                        f"{t.lr:g}: divide it by 10, or set train.grad_clip",
                        {"lr": t.lr},
                    )
                )
                raise fail(f"{e}; the last good checkpoint is kept in {args.checkpoints}") from None
            seconds = time.perf_counter() - start_time
            sync_buffers(model, world)  # every rank evaluates rank 0's model: the same answer
            val_metrics, _ = evaluate(model, x_val, y_val, mean, std, 1024)
            lr = optimizer.param_groups[0]["lr"]
            step_scheduler(scheduler, val_metrics["loss"])
            record = epoch_record(train_metrics, val_metrics, lr, seconds, peak_memory_mb(device))
            history.append(record)
            monitor.epoch(epoch, train_metrics, history, lr, mapped)
            improved = val_metrics["accuracy"] > best["accuracy"]
            stale = 0 if improved else stale + 1
            if improved:
                best = {"accuracy": val_metrics["accuracy"], "epoch": epoch}
            if live:
                live.step = epoch  # the curves' x is the epoch
                for name, value in record.items():
                    live.log_metric(name, value)
                live.next_step()
                if improved:
                    best_meta = {**model_meta, "epoch": epoch, "val_accuracy": best["accuracy"]}
                    best_state = {"state_dict": cpu_copy(model.state_dict()), "meta": best_meta}
                    save_atomic(best_state, best_path)
                checkpoint.save_checkpoint(
                    state_dir,
                    {
                        **training_state(),
                        "epoch": epoch,
                        "fingerprint": run_fingerprint,
                        "scheduler": scheduler.state_dict() if scheduler is not None else None,
                        "best": best,
                        "stale": stale,
                        "history": history,
                        "health": monitor.state_dict(),
                    },
                )
            if faults.ACTIVE:
                faults.fault("train.epoch_end", epoch=epoch)
            say(
                f"epoch {epoch:3d}/{t.epochs}  "
                + epoch_line(record)
                + ("  (best)" if improved else "")
            )
            if stop.requested:
                raise Interrupted(
                    f"train stopped after epoch {epoch}; its checkpoint is in "
                    f"{state_dir}, and `dvc repro` resumes from it"
                )

    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        # the kept model: from memory when its epoch ran in this process, else from best.pt
        if best_state is not None:
            save_atomic(best_state, out / "model.pt")
        elif best_path.exists():
            shutil.copy2(best_path, out / "model.pt")
        else:
            shutil.rmtree(state_dir, ignore_errors=True)
            raise GateError(f"{best_path} was deleted during the run; run again to start fresh")
        monitor.finish(optimizer.param_groups[0]["lr"])
        report = monitor.report()
        data.write_json(out / "health.json", report)
        compared = {"best_epoch": best["epoch"], "val_acc": best["accuracy"]}  # the kept model's
        compared |= {k: report[k] for k in ("healthy", "findings")}
        data.write_json(out / "metrics.json", compared)
        say(monitor.summary(str(args.out / "health.json")))
        # nothing left to resume once the outputs are in place; until then the state stays, so a
        # run refused at the end (a dep changed while it ran) resumes from its last epoch
        when_published(lambda: shutil.rmtree(state_dir, ignore_errors=True))
        say(
            f"train: best val accuracy {best['accuracy']:.4f} at epoch {best['epoch']}; "
            f"model.pt goes to {args.out} when the stage succeeds"
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
