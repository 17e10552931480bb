"""Benchmark: the prepare stage on a folder of camera-size JPEGs against the decode ceiling,
side by side in one run, wall and CPU seconds of each.

Generates a photo folder (default 2,000 JPEGs of 1024x768 in 5 classes, bench/photos.py), warms
the page cache, then runs each contender as a fresh process on the same files, to the same
64x64 RGB output, in rounds whose order rotates (paired runs on shared, noisy cores):
  - prepare:   `python -m pipeline.prepare` as `dvc repro` runs it (params.yaml and dvc.yaml
               beside it, so the mid-run guard runs too), prepare.workers 0 (every core)
  - prepare/1: the same with prepare.workers 1 (how the pool scales: 1 vs N)
  - loop:      a one-process Pillow loop, full decode: open, convert, resize, into one array
  - ceiling:   the reduced-scale decode (Image.draft, then the resize) on every core, a
               multiprocessing.Pool over the files, pixels sent back into one array
CPU seconds are the process's and its children's (getrusage). Prints a table per round and the
median ratios prepare / ceiling (the #26 bound: 1.25x in wall and in CPU).

    .venv/bin/python bench/photo_prepare_bench.py [--images 2000] [--rounds 3] [--size 64]
"""

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import yaml
from photos import generate
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def loop(folder: Path, size: int) -> None:
    """What a user writes first: one process, every pixel decoded."""
    paths = sorted(folder.rglob("*.jpg"))
    out = np.zeros((len(paths), size, size, 3), np.uint8)
    for i, path in enumerate(paths):
        with Image.open(path) as image:
            out[i] = np.asarray(image.convert("RGB").resize((size, size), Image.BILINEAR))


def reduced(job: tuple[Path, int]) -> np.ndarray:
    path, size = job
    with Image.open(path) as image:
        image.draft("RGB", (size, size))  # libjpeg decodes at 1/2, 1/4 or 1/8 scale
        return np.asarray(image.convert("RGB").resize((size, size), Image.BILINEAR))


def ceiling(folder: Path, size: int) -> None:
    """The cheap bound: the reduced-scale decode on every core, nothing else."""
    paths = sorted(folder.rglob("*.jpg"))
    out = np.zeros((len(paths), size, size, 3), np.uint8)
    with Pool(len(os.sched_getaffinity(0))) as pool:
        jobs = [(p, size) for p in paths]
        for i, pixels in enumerate(pool.imap(reduced, jobs, chunksize=32)):
            out[i] = pixels


def project(work: Path, folder: Path, size: int, workers: int) -> Path:
    """A folder laid out as the pipeline's root: params.yaml pointing at the photos, dvc.yaml."""
    where = work / f"project-{workers}"
    where.mkdir(exist_ok=True)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["prepare"] |= {
        "source": "imagefolder",
        "path": str(folder),
        "image_size": size,
        "color": "rgb",
        "workers": workers,
    }
    (where / "params.yaml").write_text(yaml.safe_dump(params))
    shutil.copy(ROOT / "dvc.yaml", where / "dvc.yaml")
    return where


def timed(command: list[str], cwd: Path) -> tuple[float, float]:
    """(wall s, CPU s) of a fresh process and everything it started."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(command, cwd=cwd, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=64, help="cache side, px")
    parser.add_argument("--run", choices=("loop", "ceiling"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:  # one contender, in this fresh process
        {"loop": loop, "ceiling": ceiling}[args.run](args.folder, args.size)
        return
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:  # on the project's disk, like data/
        work = Path(tmp)
        folder = work / "photos"
        generate(folder, args.images)
        for path in folder.rglob("*.jpg"):  # the page cache, for all
            path.read_bytes()
        me = [sys.executable, __file__, "--folder", str(folder), "--size", str(args.size)]
        stage = [sys.executable, "-m", "pipeline.prepare", "--out", "prepared"]
        contenders = {
            "prepare": (stage, project(work, folder, args.size, 0)),
            "prepare/1": (stage, project(work, folder, args.size, 1)),
            "loop": ([*me, "--run", "loop"], work),
            "ceiling": ([*me, "--run", "ceiling"], work),
        }
        names = list(contenders)
        rows = {name: [] for name in names}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                rows[name].append(timed(*contenders[name]))
    cores = len(os.sched_getaffinity(0))
    print(f"{args.images} JPEGs of 1024x768 -> {args.size}x{args.size} RGB, {cores} cores")
    print("| contender | wall s (median) | CPU s (median) | images/s |")
    print("|---|---|---|---|")
    for name in names:
        wall = statistics.median(w for w, _ in rows[name])
        cpu = statistics.median(c for _, c in rows[name])
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {args.images / wall:.0f} |")
    for other in ("ceiling", "loop", "prepare/1"):
        walls = [p[0] / o[0] for p, o in zip(rows["prepare"], rows[other], strict=True)]
        cpus = [p[1] / o[1] for p, o in zip(rows["prepare"], rows[other], strict=True)]
        print(
            f"prepare / {other}: wall {statistics.median(walls):.2f}x "
            f"(rounds {', '.join(f'{w:.2f}' for w in walls)}), CPU {statistics.median(cpus):.2f}x "
            f"(rounds {', '.join(f'{c:.2f}' for c in cpus)})"
        )


if __name__ == "__main__":
    main()
