"""What the train stage keeps between epochs: the Trainer (what a step changes, saved and restored
whole), the Progress of the run, the stop a signal asks for, and the per-epoch record.

Takes values, never the params models: the run (fit/run.py, fit/setup.py) builds these from
`train.*` and owns the folders. The step itself is `engine.train_one_epoch`.
"""

import functools
import io
import os
import random
import re
import resource
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from dvclive import Live
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from visionflow import faults
from visionflow.errors import OutOfMemory
from visionflow.train import health
from visionflow.train.augment import augment
from visionflow.train.engine import Split, Step, per_step, train_one_epoch
from visionflow.train.stats import WARMUP_STEPS


def seed_everything(seed: int, deterministic: bool, compiled: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    if compiled:  # also tells torch.compile's kernels
        torch.use_deterministic_algorithms(deterministic)
    else:  # the same switch, without importing the compiler for it (seconds at every start)
        torch._C._set_deterministic_algorithms(deterministic)
    torch.backends.cudnn.benchmark = not deterministic  # autotuning picks kernels by timing


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if device.type == "mps":  # Apple's GPU: what its driver holds now (it keeps no peak)
        return torch.mps.driver_allocated_memory() / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # macOS: bytes; Linux: KB


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


# Ranks that wait while one rank works alone (each node's first rank hashing its cache, rank 0's
# range test) wait in this group: the default group under NCCL gives up after 10 minutes, which
# hashing a large cache or a range test on a large model can take. Lost ranks are found later.
ONE_RANK_WORK = timedelta(hours=2)


@functools.cache
def patient_group():
    """A gloo group of every rank with ONE_RANK_WORK's timeout, made on first use (every rank
    reaches the same calls in the same order) for the collectives that wait on one rank."""
    return dist.new_group(backend="gloo", timeout=ONE_RANK_WORK)


def end_distributed(world: int) -> None:
    """Wait for every rank, then leave the group `start_distributed` joined (alone: nothing)."""
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


# what a collective raises when the rank at the other end is gone: gloo's words, then NCCL's
LOST = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|remote process exited"
)


def lost_rank(error: BaseException, rank: int, world: int) -> str | None:
    """The rank `error` says is gone, as "rank 1 on node 1 (Connection reset by peer)", when a
    collective failed because the rank at its other end is (gloo: "Read error [10.0.0.2]:41235:
    Connection reset by peer", under some 40 lines of traceback); else None."""
    said = LOST.search(str(error))
    if world == 1 or said is None:
        return None
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))  # torchrun's --nnodes and --node_rank
    node = int(os.environ.get("GROUP_RANK", "0"))
    if world == 2:  # the other rank
        where = f"node {1 - node}" if nodes == 2 else "this node"
        return f"rank {1 - rank} on {where} ({said[0]})"
    peer = re.search(r"\[([^\]]+)\]:\d+", str(error))  # gloo names the peer's address
    return f"a rank at {peer[1]} ({said[0]})" if peer else f"a rank ({said[0]})"


def cpu_copy(state_dict: dict) -> dict:
    """A snapshot of the weights off the device (state_dict() holds live references)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}


def stepping(model: nn.Module, world: int, compiled: bool) -> nn.Module:
    """What takes the steps: the model, in DDP under `torchrun`, compiled if asked. DDP does not
    broadcast buffers in forward: every rank takes rank 0's after each epoch (`sync_buffers`),
    and a collective inside forward is one that an out-of-memory there would leave unpaired."""
    net = DistributedDataParallel(model, broadcast_buffers=False) if world > 1 else model
    return torch.compile(net) if compiled else net


@dataclass
class Trainer:
    """What an optimizer step changes (the model, the optimizer, the scaler, the generators) and
    the epoch of steps; `state()` is what a checkpoint saves and `restore()` puts back."""

    model: nn.Module
    net: nn.Module  # what steps: the model, wrapped in DDP and/or compiled
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: torch.amp.GradScaler
    shuffle: torch.Generator  # the batch order (CPU: the same on any device)
    augment_rng: torch.Generator  # each rank its own draws
    step: Step
    augment: dict  # the keywords of `augment.augment` (train.augment)
    auto_batch: bool = False  # retry an out-of-memory epoch once, with half the batch
    rank: int = 0
    world: int = 1
    retried: bool = False  # auto_batch retries once per run
    compiled: bool = False  # train.compile: `net` is compiled
    freeze_epochs: int = 0  # fine-tuning (zoo.FineTune): the new head alone for these epochs
    mix: object = None  # `augment.mixing`'s MixUp/CutMix (train.augment.mixup, cutmix), or None

    @property
    def lr(self) -> float:
        """The learning rate (the head's, when fine-tuning: `backbone_lr` is the backbone's)."""
        return self.optimizer.param_groups[0]["lr"]

    @property
    def set_lr(self) -> float:
        """The rate train.lr set (the head's): one-cycle's peak, not where its warm-up is now."""
        group = self.optimizer.param_groups[0]
        return group.get("max_lr", group.get("initial_lr", group["lr"]))

    @property
    def backbone_lr(self) -> float | None:
        groups = self.optimizer.param_groups
        return groups[1]["lr"] if len(groups) > 1 else None

    @property
    def frozen(self) -> bool:
        """Whether the backbone is frozen (the new head alone trains)."""
        return getattr(self.model, "frozen", False)

    def begin_epoch(self, epoch: int) -> None:
        """The epoch's phase: with `freeze_epochs`, the new head alone, then the whole network."""
        if self.freeze_epochs:
            self.freeze(epoch <= self.freeze_epochs)

    def freeze(self, frozen: bool) -> None:
        """Fine-tuning (zoo.FineTune): train the new head alone (the backbone's weights kept; its
        BatchNorm layers train with train.train_bn), or the whole network. DDP takes the parameters that need
        gradients when it is made: it is made again for the new set."""
        if self.model.frozen == frozen:
            return
        self.model.freeze(frozen)
        if self.world > 1:
            self.net = stepping(self.model, self.world, self.compiled)

    def state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": self.rng(),
        }

    def rng(self) -> dict:
        return {
            "torch": torch.get_rng_state(),
            "shuffle": self.shuffle.get_state(),
            "augment": self.augment_rng.get_state(),
            # dropout on a GPU draws from each device's generator
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "mps": torch.mps.get_rng_state() if torch.backends.mps.is_available() else None,
        }

    def rng_of_every_rank(self) -> list[dict] | None:
        """Under DDP, every rank's generators, gathered on rank 0 (None on the others): a
        collective that every rank calls. Each rank draws its own augmentations (its generator
        is seeded with the seed + its rank): a resumed rank goes on with its own draws. None in
        a single process, whose state's own `rng` is all there is."""
        if self.world == 1:
            return None
        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object(self.rng(), gathered, dst=0)
        return gathered

    def restore(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        # a fresh scaler: a step stopped after unscale_() (an out-of-memory) leaves the old one
        # refusing the next unscale_(), and load_state_dict() does not clear that
        device = next(self.model.parameters()).device.type
        self.scaler = torch.amp.GradScaler(device, enabled=self.scaler.is_enabled())
        self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None:  # a per-step schedule moved within the epoch
            self.scheduler.load_state_dict(state["scheduler"])
        ranks = state.get("rng_of_ranks") or []  # a checkpoint's: this rank's own, if it has it
        rng = ranks[self.rank] if self.rank < len(ranks) else state["rng"]
        torch.set_rng_state(rng["torch"].cpu())
        self.shuffle.set_state(rng["shuffle"].cpu())
        self.augment_rng.set_state(rng["augment"].cpu())
        cuda = rng.get("cuda") or []
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda])
        if rng.get("mps") is not None and torch.backends.mps.is_available():
            torch.mps.set_rng_state(rng["mps"].cpu())

    def epoch(self, x, y, mean, std, epoch: int, monitor: health.Monitor) -> dict:
        """One epoch of `train_one_epoch` over the split `x`, `y`. On a GPU out-of-memory the
        health report gets the numbers; with auto_batch the epoch is retried once from its start
        with half the batch and twice the accumulation (the same effective batch), else
        OutOfMemory. Under DDP every rank learns of an out-of-memory in any rank's step
        (`Step.agree_on_memory`), so all retry, or all fail, together."""
        saved = None
        if self.auto_batch and not self.retried:
            saved = io.BytesIO()  # a copy off the device: state_dict() holds references
            torch.save(self.state(), saved)
        while True:
            draws = partial(augment, generator=self.augment_rng, **self.augment)
            split = Split(x, y, mean, std, self.shuffle, draws, self.rank, self.world, self.mix)
            try:
                return train_one_epoch(
                    self.net,
                    self.optimizer,
                    split,
                    self.step,
                    scaler=self.scaler,
                    epoch=epoch,
                    record_losses=monitor.steps_wanted(),
                    scheduler=self.scheduler if per_step(self.scheduler) else None,
                )
            except torch.OutOfMemoryError:
                self.out_of_memory(epoch, monitor, retry=saved is not None)
            saved.seek(0)
            self.restore(torch.load(saved, weights_only=True))
            self.retried, saved = True, None

    def out_of_memory(self, epoch: int, monitor: health.Monitor, retry: bool) -> None:
        """Report it; raise OutOfMemory without a retry, else halve the batch for the retry."""
        retry = retry and self.step.batch_size > 1
        device = next(self.model.parameters()).device
        parameters = sum(p.numel() for p in self.model.parameters())
        batch, accumulate, peak = self.step.batch_size, self.step.accumulate, peak_memory_mb(device)
        monitor.add(health.out_of_memory(epoch, batch, accumulate, parameters, peak, retry))
        if not retry:
            raise OutOfMemory(
                f"out of memory at epoch {epoch}; see the health line above"
            ) from None
        self.step = replace(self.step, batch_size=batch // 2, accumulate=accumulate * 2)
        if device.type == "cuda":
            torch.cuda.empty_cache()


@dataclass
class Progress:
    """Where the run is: the epochs done (their records), the best one, epochs since it."""

    history: list[dict] = field(default_factory=list)
    best: dict = field(default_factory=lambda: {"accuracy": -1.0, "epoch": 0})
    start: int = 1
    stale: int = 0

    def update(self, epoch: int, record: dict) -> bool:
        """Add the epoch's record; True when its val accuracy is the best so far."""
        self.history.append(record)
        improved = record["val/accuracy"] > self.best["accuracy"]
        self.stale = 0 if improved else self.stale + 1
        if improved:
            self.best = {"accuracy": record["val/accuracy"], "epoch": epoch}
        return improved


@functools.cache
def signal_pipe() -> tuple[int, int]:
    """(read, write): a pipe, one per process, for Python's wakeup fd, into which it writes a
    byte per signal that arrives. Python runs a handler once for signals that arrive during one
    long operation (a forward on the CPU takes seconds): two Ctrl-Cs a tenth of a second apart
    were one, and the stage went on to the epoch's end (130 s on photos)."""
    ends = os.pipe()
    for end in ends:
        os.set_blocking(end, False)
    return ends


class StopRequest:
    """The first Ctrl-C or SIGTERM (a scheduler's stop, a cancelled flow run, a timeout, each
    reaching the stage as SIGINT through the runner) asks the run to finish its epoch,
    checkpoint it and stop; a second Ctrl-C after a first one stops at once (the previous
    epoch's checkpoint is kept), also when both came before Python ran the handler. Further
    SIGTERMs change nothing: a stop is under way."""

    def __init__(self):
        self.requested: int | None = None  # the signal that asked
        self.arrived, write = signal_pipe()
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self.ctrl_cs()  # from now on: an earlier run's in this process are not this one's
        signal.signal(signal.SIGINT, self.handle)
        signal.signal(signal.SIGTERM, self.handle)

    def ctrl_cs(self) -> int:
        """The SIGINTs that arrived since the last look (this handler's call included)."""
        try:
            return os.read(self.arrived, 4096).count(signal.SIGINT)
        except BlockingIOError:  # none (a call by hand, or asyncio took the wakeup fd)
            return 0

    def handle(self, signum, frame):
        pressed = self.ctrl_cs()
        if self.requested is not None:
            if signum == signal.SIGINT == self.requested:
                raise KeyboardInterrupt
            return
        self.requested = signum
        if signum == signal.SIGINT and pressed > 1:  # Ctrl-C twice, Python's handler once
            raise KeyboardInterrupt
        # a SIGTERM's stop is not cut short by a SIGINT after it: a container's stop sends
        # SIGTERM to every process, then the runner's SIGINT reaches the stage too
        again = " (a second Ctrl-C stops at once)" if signum == signal.SIGINT else ""
        line = (  # os.write: a print while the loop prints to stderr re-entered its buffer
            f"\ntrain: {signal.Signals(signum).name}: finishing this epoch to checkpoint it{again}\n"
        )
        os.write(2, line.encode())
        if faults.ACTIVE:
            faults.fault("train.stop")

    def agreed(self, world: int, device: torch.device) -> bool:
        """Whether any rank was asked to stop: one all-reduce under DDP, at each epoch's end, so
        that a stop reaching one machine alone stops every node's ranks together (the others
        went on into the next epoch, and their collectives failed or hung)."""
        if world == 1:
            return self.requested is not None
        flag = torch.tensor([int(self.requested is not None)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


# What the clock and the machine decide: different on every run of the same code, data and
# params, so these curves go to a folder of their own that is no DVC output (live_curves)
TIMINGS = ("train/images_per_s", "epoch_seconds", "peak_memory_mb", "data_wait_fraction")


def epoch_record(train: dict, val: dict, lr: float, seconds: float, peak_mb: float) -> dict:
    """One epoch's numbers, as DVCLive logs them and the checkpoint keeps them (TIMINGS too)."""
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
    rates = f"lr {r['lr']:.2e}"
    if "lr_backbone" in r:  # fine-tuning's second group: 0 while it is frozen
        rates += f" backbone {r['lr_backbone']:.2e}" if r["lr_backbone"] else " backbone frozen"
    return (
        f"train loss {r['train/loss']:.4f} acc {r['train/accuracy']:.4f}  "
        f"val loss {r['val/loss']:.4f} acc {r['val/accuracy']:.4f}  {rates}  "
        f"{r['train/images_per_s']:7.0f} img/s"
        + (f"  {r['skipped_steps']} skipped" if r["skipped_steps"] else "")
    )


class Laps:
    """Where an epoch's time goes: each call ends a part (training, validation, health,
    checkpoint, logging) and adds the seconds since the previous call to it."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def __call__(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self.last
        self.last = now


def time_line(train: dict, laps: dict[str, float], warmup: bool) -> str:
    """The log line under an epoch's: its seconds by part, and with `warmup` (a process's first
    epoch: loading kernels, autotuning, growing the memory pool) its first steps apart and the
    rate of the steps after them."""
    trained = f"training {laps.get('training', train['seconds']):.2f}"
    warm_s, warm_images = train["warmup_seconds"], train["warmup_images"]
    rest = train["fed_images"] - warm_images  # those of the steps after the first ones
    if warmup and warm_images:
        seconds = max(train["seconds"] - warm_s, 1e-9)
        then = f"then {rest / seconds:.0f} img/s" if rest > 0 else "the epoch had no others"
        trained += f" (its first {WARMUP_STEPS} steps {warm_s:.2f}, warming up; {then})"
    besides = ", ".join(f"{part} {s:.2f}" for part, s in laps.items() if part != "training")
    return f"           seconds: {trained}; besides training: {besides}"


@contextmanager
def live_curves(out: Path | None, timings: Path, history: list[dict]) -> Iterator[tuple | None]:
    """(DVCLive in `out`/live, DVCLive in `timings`) on rank 0, None elsewhere. The TIMINGS go
    to `timings`, a folder DVC neither hashes nor stores: a rerun of the same code, data and
    params then reproduces `out` and dvc.lock byte for byte. With the curves of the epochs a
    resumed run already did (the checkpoint kept them)."""
    if out is None:
        yield None
        return
    quiet = {"dvcyaml": False, "save_dvc_exp": False, "report": None}
    with Live(str(out / "live"), **quiet) as live, Live(str(timings), **quiet) as timed:
        for epoch, record in enumerate(history, 1):
            log_epoch((live, timed), epoch, record)
        yield live, timed


def log_epoch(lives: tuple[Live, Live], epoch: int, record: dict) -> None:
    """One epoch's record: the TIMINGS into the second Live, the rest into the first."""
    live, timed = lives
    for each in lives:
        each.step = epoch  # the curves' x is the epoch
    for name, value in record.items():
        (timed if name in TIMINGS else live).log_metric(name, value)
    for each in lives:
        each.next_step()
