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
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline import GateError, Interrupted, run, staged, when_published
from pipeline.lifecycle import mark_published, resume, run_of, save_epoch
from pipeline.lr_find import rate_for, record_rate
from pipeline.train_setup import (
    Data,
    checked_network,
    cut_photos,
    degenerate_batches,
    device_for,
    load_data,
    model_for,
    model_metadata,
    monitor_for,
    overfit_settings,
    starting,
    trainer_for,
    verify_once,
)
from visionflow import faults
from visionflow.data import dataset
from visionflow.params import Train, load_params
from visionflow.train import checkpoint, health
from visionflow.train.engine import NonFiniteLoss, evaluate, step_scheduler, sync_buffers
from visionflow.train.models import input_words, save_atomic
from visionflow.train.training import (  # noqa: F401  (Trainer, seed_everything: for tests)
    Laps,
    OutOfMemory,
    Progress,
    StopRequest,
    Trainer,
    cpu_copy,
    end_distributed,
    epoch_line,
    epoch_record,
    live_curves,
    log_epoch,
    lost_rank,
    peak_memory_mb,
    seed_everything,
    start_distributed,
    time_line,
)
from visionflow.train.zoo import FineTune


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train on the cached train split.")
    parser.add_argument("--data", type=Path, required=True, help="cache folder from prepare")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    parser.add_argument("--checkpoints", type=Path, required=True, help="resumable state folder")
    return parser.parse_args()


def failed(args, train: Train, monitor: health.Monitor, rank: int, error, epoch: int) -> GateError:
    """The run stops (out of memory, or of finite losses): the health report goes beside the
    (untouched) previous results; the resumable state stays (the next run resumes from its last
    good epoch)."""
    message = str(error)
    if isinstance(error, NonFiniteLoss):
        hint = f"train.lr is {train.lr:g}: divide it by 10, or set train.grad_clip"
        finding = health.Finding(
            "diverging", epoch, f"diverging: {error}; {hint}", {"lr": train.lr}
        )
        monitor.add(finding)
        message = f"{error}; the last good checkpoint is kept in {args.checkpoints}"
    if rank == 0:
        report = args.out.with_name(args.out.name + ".health.json")
        dataset.write_json(report, monitor.report())
        print(monitor.summary(str(report)))
    return GateError(message)


def main() -> None:
    args = parse_args()
    params = load_params()
    train = overfit_settings(params.train)

    # --- params, data, model, and what steps it ---------------------------------------------
    rank, world = start_distributed(train.device)
    log = print if rank == 0 else (lambda *_, **__: None)  # rank 0 alone prints and writes
    seed_everything(params.seed, train.deterministic, train.compile)
    device = device_for(train)
    verify_once(args.data, rank, world)
    data = load_data(args.data, train, device)
    model, norm_mean, norm_std, network = model_for(train, data, device, log)
    norm = torch.tensor(norm_mean, device=device), torch.tensor(norm_std, device=device)
    run = run_of(params, args.data)  # the fingerprint: its folder holds the resumable state
    folder = args.checkpoints / checkpoint.fingerprint(run)
    train, found = rate_for(train, model, data, norm, params.seed, folder, rank, world, log)
    trainer = trainer_for(
        model, train, params.seed, rank, world, data.image_size, len(data.y_train)
    )
    model_meta = model_metadata(train, params.seed, data, norm_mean, norm_std, network)
    model_meta["train"]["lr_found"] = found is not None  # train.lr: auto

    # --- resume: the state of this fingerprint only, in its own folder ------------------------
    monitor = monitor_for(train, data, log)
    checked_network(train, model, data, monitor)
    progress = resume(trainer, monitor, folder, run, args.out, train.epochs, log)
    if rank == 0:
        record_rate(folder, found)  # the rate a resumed run takes
    log(starting(train, trainer, data, device))
    log(f"train: the network sees {input_words(model_meta)}")
    batches = degenerate_batches(len(data.y_train) // world, train.batch_size, train.accumulate)
    for warning in filter(None, [cut_photos(args.data, model_meta), *batches]):
        log(f"train: warning: {warning}")

    # --- the epoch loop: train, validate, record, keep the best, checkpoint -------------------
    out = staged(args.out) if rank == 0 else None  # moved to args.out when the run succeeds
    stop, best_state = StopRequest(), None  # best_state: the best epoch, in memory
    with live_curves(out, progress.history) as live, named_if_lost(rank, world, progress, folder):
        for epoch in range(progress.start, train.epochs + 1):
            if train.early_stop and progress.stale >= train.early_stop:
                log(f"train: early stop, no better val accuracy for {progress.stale} epochs")
                break
            if isinstance(model, FineTune) and train.freeze_epochs:
                trainer.freeze(epoch <= train.freeze_epochs)  # the new head alone, then all
            laps = Laps()  # where the epoch's time goes, said under its line
            try:
                train_metrics, record = train_and_validate(
                    trainer, data, norm, epoch, monitor, laps
                )
            except (OutOfMemory, NonFiniteLoss) as error:
                raise failed(args, train, monitor, rank, error, epoch) from None
            improved = progress.update(epoch, record)
            frozen = isinstance(model, FineTune) and model.frozen  # the head alone trained
            monitor.epoch(epoch, train_metrics, progress.history, trainer.lr, data.mapped, frozen)
            laps("health")
            rngs = trainer.rng_of_every_rank()  # every rank asked: each goes on with its own
            if live:
                log_epoch(live, epoch, record)
                laps("logging")
                if improved:  # kept in memory too: the best file is for a resumed run
                    meta = {**model_meta, "epoch": epoch, "val_accuracy": record["val/accuracy"]}
                    best_state = {"state_dict": cpu_copy(model.state_dict()), "meta": meta}
                    save_atomic(best_state, checkpoint.best_file(folder, epoch))
                save_epoch(trainer, progress, monitor, folder, epoch, train.epochs, rngs)
            laps("checkpoint")
            if faults.ACTIVE:
                faults.fault("train.epoch_end", epoch=epoch)
            best = "  (best)" if improved else ""
            phase = " (frozen: head only)" if frozen else ""
            log(f"epoch {epoch:3d}/{train.epochs}{phase}  {epoch_line(record)}{best}")
            log(time_line(train_metrics, laps.seconds, warmup=epoch == progress.start))
            if stop.agreed(world, device):  # any rank's, on every rank
                raise Interrupted(
                    f"train stopped after epoch {epoch}; its checkpoint is in "
                    f"{folder}, and `dvc repro` resumes from it"
                )
    end_distributed(world)
    if rank == 0:
        write_outputs(out, args.out, best_state, folder, progress, monitor, model_meta)


@contextmanager
def named_if_lost(rank: int, world: int, progress: Progress, folder: Path) -> Iterator[None]:
    """A collective that fails because another rank is gone (its node lost, killed or crashed)
    becomes one line naming that rank and what to do, not gloo's traceback."""
    try:
        yield
    except RuntimeError as error:
        gone = lost_rank(error, rank, world)
        if gone is None:
            raise
        raise GateError(
            f"train: {gone} stopped during epoch {len(progress.history) + 1}: rank {rank} "
            "cannot go on without it (that node's own log says why: a crash, a kill, a lost "
            "machine or network). Every rank stops; start torchrun again on every node and "
            f"training resumes from rank 0's last checkpoint in {folder}"
        ) from None


def train_and_validate(
    trainer: Trainer, data: Data, norm: tuple, epoch: int, monitor: health.Monitor, laps: Laps
) -> tuple[dict, dict]:
    """One epoch of training, then validation (every rank evaluates rank 0's model: the same
    answer) and the scheduler's step: (the training numbers, the epoch's record)."""
    mean, std = norm
    started = time.perf_counter()
    train_metrics = trainer.epoch(data.x_train, data.y_train, mean, std, epoch, monitor)
    seconds = time.perf_counter() - started
    laps("training")
    sync_buffers(trainer.model, trainer.world)
    val_metrics, _ = evaluate(trainer.model, data.x_val, data.y_val, mean, std, 1024)
    lr, backbone_lr = trainer.lr, trainer.backbone_lr
    step_scheduler(trainer.scheduler, val_metrics["loss"])
    record = epoch_record(train_metrics, val_metrics, lr, seconds, peak_memory_mb(mean.device))
    if backbone_lr is not None:  # fine-tuning: the backbone's own rate (train.backbone_lr_factor)
        record["lr_backbone"] = 0.0 if getattr(trainer.model, "frozen", False) else backbone_lr
    laps("validation")
    return train_metrics, record


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
    if model_meta["train"]["lr_found"]:  # train.lr: auto: the rate it found (`dvc exp show`)
        compared["lr"] = model_meta["train"]["lr"]
    compared |= {k: report[k] for k in ("healthy", "findings")}
    dataset.write_json(out / "metrics.json", compared)
    print(monitor.summary(str(final / "health.json")))
    # once the outputs are in place: a refused run (a dep changed while it ran) is not marked
    when_published(lambda: mark_published(folder, final))
    print(
        f"train: best val accuracy {best['accuracy']:.4f} at epoch {best['epoch']}; "
        f"model.pt goes to {final} when the stage succeeds"
    )


if __name__ == "__main__":
    run(main)
