"""Stage sanity: look at the labels before training, and fail on a cache that cannot be right.

Reads:  params.yaml (sanity.per_class, seed, train.augment.*, train.model, train.pretrained); the
        cache from prepare
Writes: <out>/labels.png (k train images per class, through the trainer's normalisation and back),
        <out>/augmented.png (the same images with the training augmentation), <out>/eval_view.png
        (the same images as the network sees them at evaluation: a pretrained model's centre crop
        of the cache), <out>/counts.png and
        <out>/counts/<split>.json (images per class and split), <out>/scan.json (counts, label
        range, per-channel mean/std, finiteness, rejected files, duplicates)
Run:    python -m pipeline.sanity --data data/prepared --out results/sanity
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from pipeline import GateError, run, staged
from visionflow.data import dataset, splits
from visionflow.deploy import viz
from visionflow.params import load_params
from visionflow.train import from_torchvision, loading
from visionflow.train.augment import augment
from visionflow.train.zoo import input_size


def scan(cache: Path, classes: list[str]) -> dict:
    """Counts per split and class; label range and image/label count mismatches are errors."""
    expected = json.loads((cache / "manifest.json").read_text())["counts"]
    report = {"num_classes": len(classes), "splits": {}}
    for split in splits.SPLITS:
        x, y = dataset.read_split(cache, split, mmap=True)
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
        report["splits"][split] = {
            "images": len(y),
            "per_class": counts,
            "label_range": [int(y.min()), int(y.max())] if len(y) else None,
        }
    return report


def check_finite(x: torch.Tensor, y: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> dict:
    """Normalised train images through the trainer's loader, in chunks: finite, and their stats."""
    total = squares = 0.0
    count = 0
    for xb, _ in loading.batches(x, y, 1024):
        batch = loading.to_model_input(xb, mean, std)
        if not torch.isfinite(batch).all():
            raise GateError("normalised train images hold NaN or inf (check stats.json's std)")
        total = total + batch.sum(dim=(0, 2, 3)).double()
        squares = squares + batch.double().square().sum(dim=(0, 2, 3))
        count += batch.numel() // batch.shape[1]
    m = total / count
    return {
        "finite": True,
        "normalised_mean": m.tolist(),
        "normalised_std": (squares / count - m.square()).clamp(min=0).sqrt().tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Label grids and a scan of the cache.")
    parser.add_argument("--data", type=Path, required=True, help="cache folder from prepare")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    args = parser.parse_args()
    params = load_params()

    meta = dataset.read_cache_meta(args.data)
    report = scan(args.data, meta.classes)
    # the trainer's loader: the split memory-mapped, read a batch at a time (any size fits)
    x, y = loading.load_for_training(args.data, "train", torch.device("cpu"), max_bytes=0)
    mean, std = torch.tensor(meta.mean), torch.tensor(meta.std)
    report.update(check_finite(x, y, mean, std))
    report["stats"] = {"mean": meta.mean, "std": meta.std}
    rejects = json.loads((args.data / "rejects.json").read_text())
    duplicates = json.loads((args.data / "duplicates.json").read_text())
    report["rejected_files"] = rejects["rejected"]
    report["duplicates"] = {k: duplicates[k] for k in ("across_splits", "removed", "within_split")}

    out = staged(args.out)  # moved to args.out when the stage succeeds
    k = params.sanity.per_class
    pick = np.concatenate(viz.pick_per_class(y.numpy(), len(meta.classes), k))
    chosen = torch.from_numpy(np.asarray(x[pick]))
    model_input = loading.to_model_input(chosen, mean, std)  # exactly what train feeds
    shown = loading.from_model_input(model_input, mean, std)
    viz.label_grid(shown.numpy(), y[pick].numpy(), meta.classes, k).savefig(
        out / "labels.png", dpi=100
    )
    generator = torch.Generator().manual_seed(params.seed)
    augmented = augment(loading.to_unit(chosen), generator, **params.train.augment.model_dump())
    shown = loading.from_model_input(loading.normalise(augmented, mean, std), mean, std)
    fig = viz.label_grid(shown.numpy(), y[pick].numpy(), meta.classes, k)
    fig.suptitle("train split with the training augmentation (train.augment)")
    fig.savefig(out / "augmented.png", dpi=100)
    t, side = params.train, chosen.shape[1]
    size = (
        input_size(t.model, side, t.pretrained) if from_torchvision(t.model, t.pretrained) else side
    )
    top = (side - size) // 2  # zoo.FineTune's centre crop, as evaluate, export and predict feed it
    seen = loading.to_model_input(chosen, mean, std)[..., top : top + size, top : top + size]
    fig = viz.label_grid(
        loading.from_model_input(seen, mean, std).numpy(), y[pick].numpy(), meta.classes, k
    )
    cut = f"the {size} px centre crop of the {side} px cache" if size < side else "the whole image"
    fig.suptitle(f"what the network sees at evaluation: {cut}")
    fig.savefig(out / "eval_view.png", dpi=100)
    counts = {split: r["per_class"] for split, r in report["splits"].items()}
    viz.counts_figure(counts).savefig(out / "counts.png", dpi=100)
    (out / "counts").mkdir(exist_ok=True)
    for split, per_class in counts.items():
        dataset.write_json(
            out / "counts" / f"{split}.json",
            [{"class": c, "images": n} for c, n in per_class.items()],
        )
    dataset.write_json(out / "scan.json", report)
    print(
        f"sanity: {args.out}/labels.png, augmented.png, eval_view.png, counts.png; "
        + ", ".join(f"{s} {r['images']}" for s, r in report["splits"].items())
        + f"; {report['rejected_files']} rejected, {report['duplicates']['across_splits']} duplicates"
    )


if __name__ == "__main__":
    run(main)
