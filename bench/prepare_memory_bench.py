"""Benchmark: the prepare stage's peak memory as the image folder grows.

Generates image folders of each size (default 2,000 and 32,000 files, half PNG and half JPEG,
64x64 RGB, 10 classes), then runs `python -m pipeline.prepare --out data/prepared` in a project
folder as `dvc repro` does (params.yaml and dvc.yaml beside it, so the mid-run guard's snapshot of
every file is measured too), one fresh process per run, and prints the peak resident memory (the
largest of the stage's process and its decoding processes, as `/usr/bin/time -v` reports it), the
decoded bytes, and the ratio of each peak to the first one's.

    .venv/bin/python bench/prepare_memory_bench.py [--images 2000 32000] [--size 64]
        [--shard-images 0 256] [--workers 0]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def generate(root: Path, count: int, side: int, classes: int = 10) -> None:
    """`count` files in `classes` folders, smooth photo-like content (small files)."""
    rng = np.random.default_rng(0)
    for i in range(count):
        folder = root / f"class{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        base = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        image = Image.fromarray(base).resize((side, side), Image.Resampling.BICUBIC)
        image.save(folder / f"{i}.jpg", quality=90) if i % 2 else image.save(folder / f"{i}.png")


# runs ARGV and prints its peak RSS (KiB) from a fresh, small process: a child started from
# this one would be charged this one's size by exec (Linux's maxrss)
PEAK_RSS = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
    "stdout=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def peak_rss_mb(project: Path, env: dict) -> float:
    """Run the stage; the peak RSS (MB) of its largest process."""
    stage = [sys.executable, "-m", "pipeline.prepare", "--out", "data/prepared"]
    run = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, *stage], cwd=project, env=env, capture_output=True
    )
    if run.returncode:
        sys.exit(f"prepare failed ({run.returncode}):\n{run.stderr.decode()[-3000:]}")
    return int(run.stdout.split()[-1]) / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, nargs="+", default=[2_000, 32_000])
    parser.add_argument("--size", type=int, default=64, help="cache side, px")
    parser.add_argument("--source-size", type=int, default=64, help="generated image side, px")
    parser.add_argument("--shard-images", type=int, nargs="+", default=[0, 256])
    parser.add_argument("--workers", type=int, default=0, help="prepare.workers (0: all cores)")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    first = None
    print(f"{'images':>7} {'shards':>7} {'decoded MB':>10} {'peak RSS MB':>11} {'ratio':>6}")
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:  # beside the repo: a real disk
        for count in args.images:
            project = Path(tmp) / f"p{count}"
            generate(project / "images", count, args.source_size)
            shutil.copy(ROOT / "dvc.yaml", project / "dvc.yaml")  # the stage's guard reads it
            params = yaml.safe_load((ROOT / "params.yaml").read_text())
            for shard_images in args.shard_images:
                params["prepare"].update(
                    source="imagefolder",
                    path="images",
                    image_size=args.size,
                    color="rgb",
                    workers=args.workers,
                    shard_images=shard_images,
                )
                (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
                shutil.rmtree(project / "data", ignore_errors=True)
                peak = peak_rss_mb(project, env)
                first = first or peak
                decoded = count * args.size**2 * 3 / 2**20
                print(
                    f"{count:>7} {shard_images:>7} {decoded:>10.0f} {peak:>11.0f} "
                    f"{peak / first:>6.2f}",
                    flush=True,
                )
            shutil.rmtree(project)


if __name__ == "__main__":
    main()
