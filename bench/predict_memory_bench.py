"""Benchmark: peak memory of `visionflow predict FOLDER` over a short and a long photo folder,
side by side in one run (the #26 bound: 18,000 photos at most 1.5x the peak over 60; #45: the
same with a 64 px RGB model, and 600 between).

Generates `--unique` camera-size JPEGs (1024x768, bench/photos.py) and fills two folders with
hard links to them (memory depends on the count, not on the bytes being new): `--short` and
`--long` files. Runs `visionflow predict --json FOLDER > /dev/null` with each model runtime the
pipeline exported (the ONNX file, and model.pt through torch), each as a fresh process, and
reads its peak resident memory (the kernel's ru_maxrss of that child alone).

    .venv/bin/python bench/predict_memory_bench.py [--counts 60 600 18000] [--unique 300]
        [--model NAME=PATH ...]   # other model files (default: the pipeline's ONNX and model.pt)

Run it in a project where `make repro` (or `dvc repro`) has made results/export.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from photos import generate

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"onnx": "results/export/model.onnx", "torch": "results/train/model.pt"}


def fill(folder: Path, photos: list[Path], count: int) -> Path:
    folder.mkdir()
    for i in range(count):
        os.link(photos[i % len(photos)], folder / f"{i:06d}.jpg")
    return folder


def peak(command: list[str]) -> tuple[float, float]:
    """(peak resident MB, wall s) of one fresh process."""
    start = time.perf_counter()
    with open(os.devnull, "w") as null:
        process = subprocess.Popen(command, cwd=ROOT, stdout=null, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"failed: {' '.join(command)}")
    return usage.ru_maxrss / 1024, time.perf_counter() - start  # Linux: KB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[60, 600, 18000])
    parser.add_argument("--unique", type=int, default=300, help="distinct photos generated")
    parser.add_argument("--model", action="append", help="NAME=PATH: a model file to run")
    args = parser.parse_args()
    models = dict(m.split("=", 1) for m in args.model) if args.model else MODELS
    visionflow = str(Path(sys.executable).parent / "visionflow")
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        photos, _ = generate(Path(tmp) / "photos", args.unique)
        folders = {n: fill(Path(tmp) / str(n), photos, n) for n in args.counts}
        rows = []
        for runtime, model in models.items():
            for count, folder in folders.items():
                command = [visionflow, "predict", "--json", "--model", model, str(folder)]
                rows.append((runtime, count, *peak(command)))
    print(f"visionflow predict over 1024x768 JPEGs ({args.unique} distinct, hard-linked)")
    print("| runtime | photos | peak MB | wall s | photos/s |")
    print("|---|---|---|---|---|")
    for runtime, count, mb, wall in rows:
        print(f"| {runtime} | {count} | {mb:.0f} | {wall:.1f} | {count / wall:.0f} |")
    for runtime in models:
        peaks = [mb for r, _, mb, _ in rows if r == runtime]
        print(
            f"{runtime}: {args.counts[-1]} photos peak at {peaks[-1] / peaks[0]:.2f}x the peak "
            f"over {args.counts[0]}"
        )


if __name__ == "__main__":
    main()
