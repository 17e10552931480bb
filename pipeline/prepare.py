"""Stage prepare: decode a source once into the uint8 cache that every later stage reads.

Reads:  params.yaml (seed, prepare.*); the source: built-in digits, an image folder, a torchvision root
Writes: <out>/{train,val,test}_{x,y}.npy, classes.json, stats.json (train-only), manifest.json
Run:    python -m pipeline.prepare --out data/prepared      (or: dvc repro prepare)
"""

import argparse
from pathlib import Path

from pipeline import run
from visionflow import data
from visionflow.params import load_params


def main() -> None:
    parser = argparse.ArgumentParser(description="Decode a source into the uint8 cache.")
    parser.add_argument("--out", type=Path, required=True, help="cache folder to write")
    args = parser.parse_args()
    params = load_params()
    p = params.prepare

    source = data.load_source(p.source, Path(p.path), p.download)
    print(f"prepare: {p.source}: {len(source.labels)} images, {len(source.classes)} classes")
    splits = data.split_indices(
        source.labels, p.val_fraction, p.test_fraction, params.seed, source.is_test
    )
    pixels = data.decode_all(source.images, p.image_size, p.color)
    manifest = data.write_cache(args.out, pixels, source, splits)
    sizes = ", ".join(f"{s} {sum(c.values())}" for s, c in manifest["counts"].items())
    print(f"prepare: wrote {args.out} ({sizes}; {p.image_size}x{p.image_size} {p.color})")


if __name__ == "__main__":
    run(main)
