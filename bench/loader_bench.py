"""Benchmark: the memory-mapped training loader (`loading.batches` over a split too large to hold)
with 0 (in the training process), 1, 2, ... DataLoader workers, side by side in one run.

Writes a synthetic uint8 split (default 4,000 images of 224x224x3, 600 MB) as one .npy, reads it
once so the page cache holds it (the steady state of a second epoch; a cold disk is slower and
needs more workers, not fewer), then times shuffled epochs of batch 256, in rounds that interleave
the worker counts so that a noisy spell hits all of them. Prints images/s and MB/s (medians).
The model's side is left out: this is how fast the loader alone can feed one.

    .venv/bin/python bench/loader_bench.py [--images 4000] [--size 224] [--batch 256] [--rounds 3]
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from visionflow.train.loading import batches, loader_workers


def epoch(x: np.ndarray, y: torch.Tensor, batch: int, workers: int) -> float:
    """Seconds for one shuffled epoch of the loader with `workers` workers."""
    start = time.perf_counter()
    seen = 0
    generator = torch.Generator().manual_seed(0)
    for xb, _ in batches(x, y, batch, generator, workers=workers):
        seen += len(xb)
    assert seen == len(x)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    counts = sorted({0, 1, 2, cores, loader_workers()})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train_x.npy"
        shape = (args.images, args.size, args.size, 3)
        x = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=shape)
        rng = np.random.default_rng(0)
        for start in range(0, args.images, 256):
            stop = min(start + 256, args.images)
            x[start:stop] = rng.integers(0, 256, (stop - start, *shape[1:]), dtype=np.uint8)
        x.flush()
        del x
        x = np.load(path, mmap_mode="r")
        y = torch.zeros(args.images, dtype=torch.long)
        path.read_bytes()  # into the page cache
        seconds = {w: [] for w in counts}
        for _ in range(args.rounds):
            for w in counts:
                seconds[w].append(epoch(x, y, args.batch, w))
        megabytes = x.nbytes / 2**20
        print(
            f"{args.images} images of {args.size}x{args.size}x3 uint8 ({megabytes:.0f} MB), "
            f"batch {args.batch}, {cores} cores, {args.rounds} rounds; default workers here: "
            f"{loader_workers()}"
        )
        print("| workers | images/s | MB/s | vs in-process |")
        print("|---|---|---|---|")
        base = statistics.median(seconds[0])
        for w in counts:
            s = statistics.median(seconds[w])
            print(
                f"| {w or 'none (in-process)'} | {args.images / s:.0f} | {megabytes / s:.0f} | "
                f"{base / s:.2f}x |"
            )


if __name__ == "__main__":
    main()
