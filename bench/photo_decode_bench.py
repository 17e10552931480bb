"""Benchmark: camera-size JPEGs decoded at full size vs at the reduced scale (Image.draft, then
the two-step resize), side by side in one run, with what it changes in the pixels and in a
classifier's accuracy.

Generates a photo folder (default 300 JPEGs of 1024x768, 5 classes: each class its own colour
cast and texture scale, every photo its own noise, brightness and framing), warms the page cache,
then on the same files and in one process:
  - full:  visionflow.data.decode.to_pixels with jpeg_draft off and a one-step resize (before #26)
  - draft: the same with the cache's defaults, jpeg_draft on and reducing_gap 3 (what prepare,
           predict and the ONNX client do now)
and prints wall and CPU seconds of each, their ratio, the mean and max absolute pixel difference,
and the test accuracy of one logistic regression trained on each cache (the same split).

    .venv/bin/python bench/photo_decode_bench.py [--images 300] [--size 64]
"""

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from photos import generate
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split

from visionflow.data.decode import Decode, to_pixels


def decode_all(paths: list[Path], decode: Decode) -> tuple[np.ndarray, float, float]:
    """Pixels of every file, and the wall and CPU seconds it took."""
    wall, cpu = time.perf_counter(), time.process_time()
    pixels = np.stack([to_pixels(p, decode) for p in paths])
    return pixels, time.perf_counter() - wall, time.process_time() - cpu


def accuracy(pixels: np.ndarray, labels: np.ndarray) -> float:
    x = pixels.reshape(len(pixels), -1).astype(np.float32) / 255
    split = train_test_split(x, labels, test_size=0.3, random_state=0, stratify=labels)
    x_train, x_test, y_train, y_test = split
    model = LogisticRegression(max_iter=300, C=0.1).fit(x_train, y_train)
    return float(model.score(x_test, y_test))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--size", type=int, default=64, help="cache side, px")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths, labels = generate(Path(tmp), args.images)
        for path in paths:  # the page cache, for both
            path.read_bytes()
        draft = Decode(args.size, "rgb")  # the cache's defaults
        full = draft._replace(jpeg_draft=False, reducing_gap=None)
        decode_all(paths[:10], full)  # warm-up: imports, first allocations
        rows = {name: decode_all(paths, d) for name, d in (("full", full), ("draft", draft))}
    diff = np.abs(rows["full"][0].astype(int) - rows["draft"][0].astype(int))
    print(f"{args.images} JPEGs of 1024x768 -> {args.size}x{args.size} RGB, one process")
    print("| decode | wall s | CPU s | images/s | test accuracy (logistic regression) |")
    print("|---|---|---|---|---|")
    for name, (pixels, wall, cpu) in rows.items():
        score = accuracy(pixels, labels)
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {len(paths) / wall:.0f} | {score:.3f} |")
    print(f"draft / full: {rows['full'][1] / rows['draft'][1]:.2f}x faster (wall), ", end="")
    print(f"{rows['full'][2] / rows['draft'][2]:.2f}x less CPU")
    print(f"pixel difference: mean {diff.mean():.2f}, max {diff.max()} (0-255 scale)")


if __name__ == "__main__":
    main()
