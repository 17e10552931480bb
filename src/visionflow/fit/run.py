"""One training run: `Run` builds it from the params and the cache, resumes it from its state
folder, runs its epochs, stops at a safe point when asked, and writes its outputs.

    run = Run(params, cache, out, checkpoints, code)   # setup: data, model, rate, trainer, health
    run.resume()                                        # this configuration's state, if any
    run.fit(staging)                                    # the epoch loop: train, validate, keep
    run.write_outputs(staging)                          # model.pt, metrics.json, health.json

What the clock and the machine decide (images/s, epoch seconds, peak memory, the data wait and the
data-bound check) goes to `<out>.timings/`, not a DVC output: a rerun of the same code, data and
params reproduces the outputs, and dvc.lock, byte for byte.

What it holds, each a collaborator with its own state: the `Trainer` (model, optimizer, schedule,
scaler, generators: what a step changes, saved and restored whole), the `Progress` (the epochs'
records, the best one), the health `Monitor`, the `StopRequest` (a signal's safe stop), and under
`torchrun` the rank and world size. One epoch reads top to bottom in `train_and_validate`, whose
steps are `engine.train_one_epoch`'s.

A killed run resumes from its last checkpoint and ends with the same weights, optimizer,
schedule, generators, health findings and metrics as an uninterrupted one (CPU,
train.deterministic: true): tests/test_run.py checks each piece of that state.
"""

import shutil
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from visionflow import faults
from visionflow.data import dataset
from visionflow.errors import GateError, Interrupted, NonFiniteLoss, OutOfMemory
from visionflow.fit import resume, setup
from visionflow.fit.lr_auto import rate_for, record_rate
from visionflow.train import checkpoint, health
from visionflow.train.engine import evaluate, step_scheduler, sync_buffers
from visionflow.train.models import input_words, save_atomic
from visionflow.train.training import (
    Laps,
    Progress,
    StopRequest,
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


class Run:
    """A training run of `params` (seed, train.*) on the cache `cache`: its outputs go to `out`
    (through a staging folder), its resumable state to `checkpoints/<fingerprint>/`, the
    fingerprint a hash of the params, the data and `code` (a digest of the stage's code)."""

    def __init__(self, params, cache: Path, out: Path, checkpoints: Path, code: str):
        self.out, self.cache = out, cache
        self.timings = out.with_name(out.name + ".timings")  # this run's, as far as it went
        self.train = train = setup.overfit_settings(params.train)
        self.rank, self.world = start_distributed(train.device)
        self.log = print if self.rank == 0 else (lambda *_, **__: None)  # rank 0 alone speaks
        # a trainer left running by a stopped `dvc repro` writes the same folders: it ends first;
        # this one holds them until it is gone (in a library, a run's end; in the stage, the
        # process's)
        release = resume.one_trainer(checkpoints, self.rank, self.world, self.log)
        weakref.finalize(self, release)
        seed_everything(params.seed, train.deterministic, train.compile)
        self.device = device = setup.device_for(train)
        setup.verify_once(cache, self.rank, self.world)
        self.data = data = setup.load_data(cache, train, device)
        self.model, mean, std, network = setup.model_for(train, data, device, self.log)
        self.norm = torch.tensor(mean, device=device), torch.tensor(std, device=device)
        self.run_key = resume.run_of(params, cache, code)  # the folder's name is its hash
        self.folder = checkpoints / checkpoint.fingerprint(self.run_key)
        self.train, self.found = rate_for(
            train,
            self.model,
            data,
            self.norm,
            params.seed,
            self.folder,
            self.rank,
            self.world,
            self.log,
        )
        train = self.train
        self.trainer = setup.trainer_for(
            self.model,
            train,
            params.seed,
            self.rank,
            self.world,
            data.image_size,
            len(data.y_train),
            len(data.meta.classes),
        )
        self.meta = setup.model_metadata(train, params.seed, data, mean, std, network)
        self.meta["train"]["lr_found"] = self.found is not None  # train.lr: auto
        self.monitor = setup.monitor_for(train, data, self.log)
        setup.checked_network(train, self.model, data, self.monitor)
        self.progress = Progress()
        self.best_state = None  # the best epoch's model.pt, in memory when it ran here

    def resume(self) -> None:
        """This configuration's state only, from its own folder (resume.resume); then the lines
        that say what trains where, and on what."""
        self.progress = resume.resume(
            self.trainer,
            self.monitor,
            self.folder,
            self.run_key,
            self.out,
            self.train.epochs,
            self.log,
        )
        if self.rank == 0:
            record_rate(self.folder, self.found)  # the rate a resumed run takes
        self.log(setup.starting(self.train, self.trainer, self.data, self.device))
        self.log(f"train: the network sees {input_words(self.meta)}")
        images = len(self.data.y_train) // self.world
        batches = setup.degenerate_batches(images, self.train.batch_size, self.train.accumulate)
        for warning in filter(None, [setup.cut_photos(self.cache, self.meta), *batches]):
            self.log(f"train: warning: {warning}")

    def fit(self, staging: Path | None) -> None:
        """The epoch loop: train and validate, record, keep the best, checkpoint; stop early when
        asked (train.early_stop), or at a safe point after a signal (Interrupted). DVCLive's
        curves go to `staging` (rank 0's; None on the others), a resumed run's earlier epochs
        first."""
        self.stop = StopRequest()  # from now on a signal finishes the epoch
        train, progress = self.train, self.progress
        with live_curves(staging, self.timings, progress.history) as live, self.named_if_lost():
            for epoch in range(progress.start, train.epochs + 1):
                if train.early_stop and progress.stale >= train.early_stop:
                    self.log(
                        f"train: early stop, no better val accuracy for {progress.stale} epochs"
                    )
                    break
                self.trainer.begin_epoch(epoch)  # fine-tuning: the new head alone, then all
                laps = Laps()  # where the epoch's time goes, said under its line
                try:
                    train_metrics, record = self.train_and_validate(epoch, laps)
                except (OutOfMemory, NonFiniteLoss) as error:
                    raise self.failed(error, epoch) from None
                improved = progress.update(epoch, record)
                trainer, data = self.trainer, self.data
                self.monitor.epoch(
                    epoch,
                    train_metrics,
                    progress.history,
                    trainer.set_lr,
                    data.mapped,
                    trainer.frozen,
                )
                laps("health")
                self.keep(epoch, record, improved, live, laps)
                self.say_epoch(epoch, record, train_metrics, laps, improved)
                self.stop_if_asked(epoch)
        end_distributed(self.world)

    def train_and_validate(self, epoch: int, laps: Laps) -> tuple[dict, dict]:
        """One epoch of training, then validation (every rank evaluates rank 0's model: the same
        answer) and the scheduler's step: (the training numbers, the epoch's record)."""
        trainer, data, (mean, std) = self.trainer, self.data, self.norm
        started = time.perf_counter()
        train_metrics = trainer.epoch(data.x_train, data.y_train, mean, std, epoch, self.monitor)
        seconds = time.perf_counter() - started
        laps("training")
        sync_buffers(trainer.model, trainer.world)
        val_metrics, _ = evaluate(trainer.model, data.x_val, data.y_val, mean, std, 1024)
        lr, backbone_lr = trainer.lr, trainer.backbone_lr
        step_scheduler(trainer.scheduler, val_metrics["loss"])
        record = epoch_record(train_metrics, val_metrics, lr, seconds, peak_memory_mb(mean.device))
        if backbone_lr is not None:  # fine-tuning: the backbone's own rate (backbone_lr_factor)
            record["lr_backbone"] = 0.0 if trainer.frozen else backbone_lr
        laps("validation")
        return train_metrics, record

    def keep(self, epoch: int, record: dict, improved: bool, live, laps: Laps) -> None:
        """Rank 0 logs the epoch's curves, keeps the best model (in memory, and in its file for
        a resumed run) and checkpoints the epoch with every rank's generators (a collective)."""
        rngs = self.trainer.rng_of_every_rank()  # every rank asked: each goes on with its own
        if live:
            log_epoch(live, epoch, record)
            laps("logging")
            if improved:
                meta = {**self.meta, "epoch": epoch, "val_accuracy": record["val/accuracy"]}
                self.best_state = {"state_dict": cpu_copy(self.model.state_dict()), "meta": meta}
                save_atomic(self.best_state, checkpoint.best_file(self.folder, epoch))
            resume.save_epoch(
                self.trainer,
                self.progress,
                self.monitor,
                self.folder,
                epoch,
                self.train.epochs,
                rngs,
            )
        laps("checkpoint")
        if faults.ACTIVE:
            faults.fault("train.epoch_end", epoch=epoch)

    def say_epoch(self, epoch: int, record: dict, metrics: dict, laps: Laps, improved: bool):
        """The epoch's line, and under it where its time went."""
        best = "  (best)" if improved else ""
        phase = " (frozen: head only)" if self.trainer.frozen else ""
        self.log(f"epoch {epoch:3d}/{self.train.epochs}{phase}  {epoch_line(record)}{best}")
        warmup = epoch == self.progress.start  # this process's first epoch
        self.log(time_line(metrics, laps.seconds, warmup=warmup))

    def stop_if_asked(self, epoch: int) -> None:
        """Interrupted when any rank was asked to stop (every rank agrees at each epoch's end),
        the last epoch's end too: the stage ends there, and DVC runs no later stage (the next
        `dvc repro` writes the outputs from the checkpoint, without training)."""
        if self.stop.agreed(self.world, self.device):
            raise Interrupted(
                f"train stopped after epoch {epoch}; its checkpoint is in "
                f"{self.folder}, and `dvc repro` resumes from it"
            )

    @contextmanager
    def named_if_lost(self) -> Iterator[None]:
        """A collective that fails because another rank is gone (its node lost, killed or
        crashed) becomes one line naming that rank and what to do, not gloo's traceback."""
        try:
            yield
        except RuntimeError as error:
            gone = lost_rank(error, self.rank, self.world)
            if gone is None:
                raise
            raise GateError(
                f"train: {gone} stopped during epoch {len(self.progress.history) + 1}: rank "
                f"{self.rank} cannot go on without it (that node's own log says why: a crash, a "
                "kill, a lost machine or network). Every rank stops; start torchrun again on "
                f"every node and training resumes from rank 0's last checkpoint in {self.folder}"
            ) from None

    def failed(self, error: Exception, epoch: int) -> GateError:
        """The run stops (out of memory, or of finite losses): the health report goes beside the
        (untouched) previous results; the resumable state stays (the next run resumes from its
        last good epoch)."""
        message = str(error)
        if isinstance(error, NonFiniteLoss):
            lr = self.train.lr
            hint = f"train.lr is {lr:g}: divide it by 10, or set train.grad_clip"
            self.monitor.add(
                health.Finding("diverging", epoch, f"diverging: {error}; {hint}", {"lr": lr})
            )
            message = f"{error}; the last good checkpoint is kept in {self.folder.parent}"
        if self.rank == 0:
            report = self.out.with_name(self.out.name + ".health.json")
            dataset.write_json(report, self.monitor.report())
            print(self.monitor.summary(str(report), self.write_timings()))
        return GateError(message)

    def write_outputs(self, staging: Path) -> None:
        """model.pt (the kept epoch: from memory when it ran in this process, else its best file,
        with this run's meta: an extended run's budget, not the shorter run's), health.json and
        metrics.json into the staging folder (rank 0). The state stays until DVC has recorded
        them (the next run's start checks): a failure after this stage (a full DVC cache, a kill
        while DVC hashes) then costs no training."""
        best_path = checkpoint.best_file(self.folder, self.progress.best["epoch"])
        if self.best_state is not None:
            save_atomic(self.best_state, staging / "model.pt")
        elif best_path.exists():  # its meta made as above: the bytes of an uninterrupted run's
            saved = torch.load(best_path, map_location="cpu", weights_only=True)
            kept = {k: saved["meta"][k] for k in ("epoch", "val_accuracy")}
            best = {"state_dict": saved["state_dict"], "meta": {**self.meta, **kept}}
            save_atomic(best, staging / "model.pt")
        else:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise GateError(f"{best_path} was deleted during the run; run again to start fresh")
        report = self.monitor.report()
        dataset.write_json(staging / "health.json", report)
        best = self.progress.best
        compared = {"best_epoch": best["epoch"], "val_acc": best["accuracy"]}  # the kept model's
        if self.found is not None:  # train.lr: auto: the rate it found (`dvc exp show`)
            compared["lr"] = self.train.lr
        compared |= {k: report[k] for k in ("healthy", "findings")}
        dataset.write_json(staging / "metrics.json", compared)
        print(self.monitor.summary(str(self.out / "health.json"), self.write_timings()))
        if self.train.overfit_batches:
            print(self.overfit_verdict())
        print(
            f"train: best val accuracy {best['accuracy']:.4f} at epoch {best['epoch']}; "
            f"model.pt goes to {self.out} when the stage succeeds"
        )

    def overfit_verdict(self) -> str:
        """train.overfit_batches promises a loss near 0: whether the last epoch's got there (a
        tenth of a guess's loss, the class shares' entropy), and what to do when it did not."""
        loss, guess = self.progress.history[-1]["train/loss"], self.monitor.chance.loss
        n = len(self.progress.history)
        epochs = f"{n} epoch{'s' if n > 1 else ''}"
        if loss <= guess / 10:
            return (
                f"train: overfit_batches: train loss {loss:.3f} after {epochs}, under a "
                f"tenth of a guess's {guess:.3f}: the loop, model and data can fit these batches"
            )
        return (
            f"train: overfit_batches: train loss {loss:.3f} after {epochs}, not yet under "
            f"a tenth of a guess's {guess:.3f}: give it more train.epochs or a higher train.lr; "
            "if it never gets there, the loop, the model or the data is wrong"
        )

    def write_timings(self) -> str:
        """The data-bound check's report (Monitor.timings) beside the timing curves; its path."""
        path = self.timings / "health.json"
        self.timings.mkdir(parents=True, exist_ok=True)  # a run that failed before its first epoch
        dataset.write_json(path, self.monitor.timings())
        return str(path)

    def mark_published(self) -> None:
        """Once the outputs are in place: the state folder knows the model.pt its run published
        (a refused run, a dep changed while it ran, is not marked)."""
        resume.mark_published(self.folder, self.out)
