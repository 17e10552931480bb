"""Benchmark: the prepare stage's decoding vs a plain single-process PIL loop, side by side.

Generates an image folder (default 10,000 files, half JPEG and half PNG, 128x128 RGB, 10 classes),
warms the page cache, then times on the same files in one run:
  - plain:   for each file: Image.open -> convert("RGB") -> resize -> np.asarray (one process)
  - prepare: visionflow.data.build_cache (decode into memory-mapped arrays with mode normalisation,
             EXIF and size checks, rejects and duplicate checks, split, train-only stats, manifest
             hashes), once in one process and once on all cores (the default)
and prints images/s for both and their ratio.

    .venv/bin/python bench/prepare_bench.py [--images 10000] [--size 32] [--source-size 128]
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from visionflow.data import dataset, sources


def generate(root: Path, count: int, side: int = 128, classes: int = 10) -> None:
    rng = np.random.default_rng(0)
    for i in range(count):
        folder = root / f"class{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        base = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)  # smooth-ish photo-like content
        image = Image.fromarray(base).resize((side, side), Image.Resampling.BICUBIC)
        image.save(folder / f"{i}.jpg", quality=90) if i % 2 else image.save(folder / f"{i}.png")


def plain_loop(paths: list[Path], size: int) -> np.ndarray:
    out = []
    for path in paths:
        with Image.open(path) as image:
            out.append(
                np.asarray(image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR))
            )
    return np.stack(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=32, help="output side, px")
    parser.add_argument("--source-size", type=int, default=128, help="generated image side, px")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "images"
        start = time.perf_counter()
        generate(root, args.images, args.source_size)
        print(f"generated {args.images} files in {time.perf_counter() - start:.1f} s")
        source = sources.load_source("imagefolder", root)
        for path in source.images:  # warm the page cache for both contenders
            Path(path).read_bytes()

        start = time.perf_counter()
        plain = plain_loop(list(source.images), args.size)
        plain_s = time.perf_counter() - start

        seconds = {}
        for workers in (1, 0):  # one process, then one per core (the default)
            start = time.perf_counter()
            dataset.build_cache(
                source,
                Path(tmp) / f"prepared{workers}",
                dataset.Decode(args.size, "rgb"),
                val_fraction=0.1,
                test_fraction=0.1,
                seed=0,
                workers=workers,
            )
            seconds[workers] = time.perf_counter() - start
        stage_s = seconds[0]
    assert plain.shape[0] == args.images
    print(
        f"cores: {os.cpu_count()}, images: {args.images} of {args.source_size}x{args.source_size}, "
        f"output {args.size}x{args.size} RGB"
    )
    print("| contender | seconds | images/s |\n|---|---|---|")
    print(f"| plain PIL loop, 1 process | {plain_s:.2f} | {args.images / plain_s:.0f} |")
    print(f"| prepare stage, workers=1 | {seconds[1]:.2f} | {args.images / seconds[1]:.0f} |")
    print(f"| prepare stage, workers=0 (all cores) | {stage_s:.2f} | {args.images / stage_s:.0f} |")
    print(f"ratio prepare / plain: {plain_s / stage_s:.2f}x")


if __name__ == "__main__":
    main()
