"""The cache, as training reads it: splits on the device or memory-mapped, batches, and the one
normalisation every stage and export applies (uint8 NHWC -> float NCHW). The torch half of the
data; `visionflow.data` (sources, decoding, split, the cache itself) needs no torch."""

import atexit
import functools
import multiprocessing
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from visionflow.data.dataset import read_split
from visionflow.data.shards import Shards


class MemmapBatches(Dataset):
    """Batches of a memory-mapped split, read in DataLoader workers (item i = index batch i).
    `x` is the split's one file or its shards; it is pickled to each worker as paths alone."""

    def __init__(self, x: Shards, index_batches: list[np.ndarray]):
        self.x, self.index_batches = x, index_batches

    def __len__(self) -> int:
        return len(self.index_batches)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.x[self.index_batches[i]])


def load_for_training(
    cache: Path, split: str, device: torch.device, max_bytes: float
) -> tuple[torch.Tensor | np.ndarray | Shards, torch.Tensor]:
    """A split on the device when its images fit in `max_bytes`, else memory-mapped (see batches)."""
    x, y = read_split(cache, split, mmap=True)
    if x.nbytes > max_bytes:
        return x, torch.from_numpy(y)
    held = np.array(x)  # read into memory: writable, so torch takes it as it is (no warning)
    return torch.from_numpy(held).to(device), torch.from_numpy(y).to(device)


def batches(
    x: torch.Tensor | np.ndarray | Shards,
    y: torch.Tensor,
    batch_size: int,
    generator: torch.Generator | None = None,
    rank: int = 0,
    world: int = 1,
    device: torch.device | None = None,
    workers: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of a split; shuffled when a generator is given (the training split).

    In-memory tensors are sliced where they are. A memory-mapped split (larger than memory: one
    file, or its shards, streamed without joining them) is read batch by batch in DataLoader
    worker processes (`workers`, default `loader_workers()`), pinned when the device is a GPU,
    and sent to `device`: the same batches in the same order either way, whatever the shards.

    Under DDP each of `world` ranks takes every world-th item of the same permutation (the
    generators agree across ranks), so one step of all ranks sees `world * batch_size` items; the
    last `len(x) % world` items of the permutation are dropped so every rank takes as many steps.
    """
    order = (
        torch.randperm(len(x), generator=generator)
        if generator is not None
        else torch.arange(len(x))
    )
    order = order[: len(order) - len(order) % world][rank::world]  # equal shards: equal steps
    n = len(order)
    if not torch.is_tensor(x):
        device = device or torch.device("cpu")
        index_batches = [order[s : s + batch_size].numpy() for s in range(0, n, batch_size)]
        end_workers_at_exit()
        loader = DataLoader(
            MemmapBatches(x if isinstance(x, Shards) else Shards([x.filename]), index_batches),
            batch_size=None,
            num_workers=loader_workers() if workers is None else workers,
            pin_memory=device.type == "cuda",
            # its own generator: without one, every pass draws its workers' base seed from the
            # global generator, which dropout draws from too, so a memory-mapped split would
            # train differently from one held in memory. The workers draw nothing random, so a
            # fixed seed, fresh each pass, is enough (and a resume has no state to restore).
            generator=torch.Generator().manual_seed(0),
            worker_init_fn=leave_stops_to_the_main_process,
        )
        for index, xb in zip(index_batches, loader, strict=True):
            yield (
                xb.to(device, non_blocking=True),
                y[torch.from_numpy(index)].to(device, non_blocking=True),
            )
        return
    for start in range(0, n, batch_size):
        index = order[start : start + batch_size].to(x.device)
        yield x[index], y[index]


def leave_stops_to_the_main_process(worker_id: int) -> None:
    """A DataLoader worker ignores Ctrl-C and SIGTERM: forked, it had inherited the train stage's
    handler, so a terminal's Ctrl-C (sent to every process of the group) had each worker print
    "finishing this epoch", and a second one ended the workers on their own, leaving the main
    process to wait for them at exit. The main process decides; it ends its workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@functools.cache
def end_workers_at_exit() -> None:
    """Once, before the first loader starts its workers: at exit, kill them. Python's
    multiprocessing ends a process's daemonic children (the workers) with SIGTERM and then waits
    for them, and these ignore SIGTERM: a pass left open at exit (a stop at once, an error, a
    caller that keeps the stream) hung the process for good. atexit runs this first (it was
    registered after multiprocessing's own)."""
    atexit.register(kill_workers)


def kill_workers() -> None:
    """SIGKILL every daemonic child, as multiprocessing would SIGTERM them at exit; SIGCHLD back
    to its default first (the loader's handler would call the workers' deaths a crash)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


MAX_LOADER_WORKERS = 8  # one gathers ~9,000 224 px images/s from the page cache (benchmarks.md)


def loader_workers() -> int:
    """DataLoader workers per rank for a memory-mapped split: the cores this process may use,
    shared among the ranks on this machine (torchrun's LOCAL_WORLD_SIZE), 1 to
    MAX_LOADER_WORKERS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    given = os.environ.get("LOCAL_WORLD_SIZE", "")  # torchrun's; not ours to refuse: 1 if odd
    ranks_here = int(given) if given.isdigit() and int(given) > 0 else 1
    return max(1, min(MAX_LOADER_WORKERS, (cores or 1) // ranks_here))


def to_unit(x: torch.Tensor) -> torch.Tensor:
    """uint8 NHWC -> float NCHW in 0..1 (a channels_last view, no copy of the layout)."""
    return x.permute(0, 3, 1, 2).float().div_(255)


def normalise(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)


def to_model_input(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 NHWC -> normalised float NCHW: what every model in this project is fed."""
    return normalise(to_unit(x), mean, std)


def from_model_input(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Undo `to_model_input` to 0..1 NCHW, for pictures of what the model sees."""
    return (x * std.view(1, -1, 1, 1) + mean.view(1, -1, 1, 1)).clamp(0, 1)
