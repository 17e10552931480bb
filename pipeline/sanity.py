"""Stage sanity: look at the labels before training, and fail on a cache that cannot be right.

Reads:  params.yaml (sanity.per_class); the cache from prepare
Writes: <out>/labels.png (k train images per class, through the trainer's normalisation and back),
        <out>/scan.json (counts per split and class, label range, finiteness)
Run:    python -m pipeline.sanity --data data/prepared --out results/sanity
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from pipeline import GateError, run
from visionflow import data, viz
from visionflow.params import load_params


def scan(cache: Path, classes: list[str]) -> dict:
    """Counts per split and class; label range and image/label count mismatches are errors."""
    expected = json.loads((cache / "manifest.json").read_text())["counts"]
    report = {"num_classes": len(classes), "splits": {}}
    for split in data.SPLITS:
        x, y = data.read_split(cache, split)
        if len(x) != len(y):
            raise GateError(f"{split}: {len(x)} images but {len(y)} labels")
        if len(y) and (y.min() < 0 or y.max() >= len(classes)):
            raise GateError(
                f"{split}: labels span {y.min()}..{y.max()}, "
                f"outside 0..{len(classes) - 1} for {len(classes)} classes"
            )
        counts = dict(zip(classes, np.bincount(y, minlength=len(classes)).tolist(), strict=True))
        if counts != expected[split]:
            raise GateError(
                f"{split}: class counts {counts} differ from the manifest's {expected[split]}"
            )
        report["splits"][split] = {"images": len(y), "per_class": counts}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description="Label grid and a scan of the cache.")
    parser.add_argument("--data", type=Path, required=True, help="cache folder from prepare")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    args = parser.parse_args()
    params = load_params()

    meta = data.read_cache_meta(args.data)
    report = scan(args.data, meta.classes)
    x, y = data.read_split(args.data, "train")
    x, mean, std = torch.from_numpy(x), torch.tensor(meta.mean), torch.tensor(meta.std)
    for xb, _ in data.batches(x, torch.from_numpy(y), 1024):  # the trainer's loader, in chunks
        if not torch.isfinite(data.to_model_input(xb, mean, std)).all():
            raise GateError("normalised train images hold NaN or inf (check stats.json's std)")
    report["finite"] = True
    k = params.sanity.per_class
    pick = np.concatenate(viz.pick_per_class(y, len(meta.classes), k))
    shown = data.from_model_input(data.to_model_input(x[pick], mean, std), mean, std).numpy()

    args.out.mkdir(parents=True, exist_ok=True)
    fig = viz.label_grid(shown, y[pick], meta.classes, k)
    fig.savefig(args.out / "labels.png", dpi=100)
    data.write_json(args.out / "scan.json", report)
    print(
        f"sanity: {args.out / 'labels.png'}; "
        + ", ".join(f"{s} {r['images']}" for s, r in report["splits"].items())
    )


if __name__ == "__main__":
    run(main)
