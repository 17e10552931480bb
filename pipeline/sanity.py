"""Stage sanity: look at the labels before training, and fail on a cache that cannot be right.

Reads:  params.yaml (sanity.per_class, sanity.label_issues, seed, train.augment.*, train.model,
        train.pretrained, train.epochs); the cache from prepare
Writes: <out>/labels.png (k train images per class, through the trainer's normalisation and back),
        <out>/augmented.png (the same images with the training augmentation), <out>/eval_view.png
        (the same images as the network sees them at evaluation: a pretrained model's centre crop
        of the cache), <out>/counts.png and
        <out>/counts/<split>.json (images per class and split), <out>/scan.json (counts, label
        range, per-channel mean/std, finiteness, rejected files, duplicates),
        <out>/label_issues.png and label_issues.json (the images most likely mislabelled, every
        split: file, split, given and suggested label, score; `label_issues`)
Run:    python -m pipeline.sanity --data data/prepared --out results/sanity
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline import GateError, run, staged
from visionflow.data import dataset, label_issues, splits
from visionflow.deploy import viz
from visionflow.errors import Unavailable
from visionflow.params import Params, load_params
from visionflow.train import features, from_torchvision, loading
from visionflow.train.augment import augment
from visionflow.train.models import build_model
from visionflow.train.zoo import input_size, preprocessing

SHOWN = 32  # suspects drawn in label_issues.png; label_issues.json lists every one
AUTO_SHARE = 0.2  # sanity.label_issues auto: runs when its estimated work is under this share of
# train's (both in multiply-adds: `work`); measured against the stages' seconds in benchmarks.md


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
    per_image = params.train.augment.model_dump(exclude={"mixup", "cutmix"})  # not batch mixing
    augmented = augment(loading.to_unit(chosen), generator, **per_image)
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
    print(find_label_issues(args.data, meta, params, out))
    print(
        f"sanity: {args.out}/labels.png, augmented.png, eval_view.png, counts.png; "
        + ", ".join(f"{s} {r['images']}" for s, r in report["splits"].items())
        + f"; {report['rejected_files']} rejected, {report['duplicates']['across_splits']} duplicates"
    )


def pool(cache: Path) -> tuple[list, np.ndarray, list[str], list[str]]:
    """Every split's images (memory-mapped, a list), and in one pool their labels, file names
    (`#<i>` of the split where the cache predates them) and splits."""
    xs, ys, names, where = [], [], [], []
    for split in splits.SPLITS:
        x, y = dataset.read_split(cache, split, mmap=True)
        xs.append(x)
        ys.append(y)
        names += dataset.read_names(cache, split) or [f"{split}#{i}" for i in range(len(y))]
        where += [split] * len(y)
    return xs, np.concatenate(ys), names, where


def network(params: Params, meta: dataset.Cache, channels: int, size: int):
    """The network train builds (with train.pretrained's weights, or at random weights drawn
    from the seed) and the mean/std it is fed with, as fit.setup makes them."""
    t, mean, std, net = params.train, meta.mean, meta.std, None
    if from_torchvision(t.model, t.pretrained):
        net = {
            "input_size": size,
            "mean": meta.mean * (3 // channels),
            "std": meta.std * (3 // channels),
        }
        if t.pretrained:
            pre = preprocessing(t.model, t.pretrained)
            net = {"input_size": input_size(t.model, size, t.pretrained), **pre}
        mean, std = net["mean"], net["std"]
        if channels == 1:  # FineTune spreads one channel over the network's three
            mean, std = [sum(mean) / 3], [sum(std) / 3]
    torch.manual_seed(params.seed)
    model = build_model(t.model, channels, len(meta.classes), size, 0.0, False, net, t.pretrained)
    return model, torch.tensor(mean), torch.tensor(std)


def probes(params: Params, model, xs: list, mean, std, pretrained: bool) -> dict:
    """The label-issue probes' features (`label_issues.find`), each name -> (features, linear):
    with train.pretrained, the backbone's (its head's input, one frozen forward pass); from
    scratch, the pixels and the train network's last convolution at random weights, pooled."""

    def at(kind, take) -> np.ndarray:
        layer = features.last(model, kind)
        return np.concatenate([features.taken_at(model, layer, take, x, mean, std) for x in xs])

    name = params.train.model
    if pretrained:
        return {
            f"{name}'s pretrained features, logistic regression": (
                at(nn.Linear, features.head_input),
                True,
            )
        }
    pixels = np.concatenate([features.pixels(x, mean, std) for x in xs])
    found = {"pixels, PCA + kNN": (pixels, False)}
    try:
        random = at(nn.Conv2d, features.pooled)
        found[f"{name} at random weights, its last conv pooled, logistic regression"] = (
            random,
            True,
        )
    except ValueError:  # a network without a convolution (a ViT): the pixels alone
        pass
    return found


def work(params: Params, model, xs: list, classes: int, pretrained: bool) -> dict:
    """The probes' and the train stage's estimated multiply-adds: train's 3 passes (forward,
    backward) of the network per train image and epoch; each probe's features (a forward pass
    of the network per image) and fits (`label_issues.probe_macs`)."""
    size, channels = xs[0].shape[1], xs[0].shape[3]
    macs, images = features.forward_macs(model, channels, size), sum(len(x) for x in xs)
    train = 3 * macs * len(xs[0]) * params.train.epochs
    side = min(size, features.PIXEL_SIDE)
    pixels = label_issues.probe_macs(images, channels * side * side, classes, False)
    try:
        layer = features.last(model, nn.Linear if pretrained else nn.Conv2d)
        dims = layer.in_features if pretrained else 2 * layer.out_channels
        linear = macs * images + label_issues.probe_macs(images, dims, classes, True)
    except ValueError:  # no such layer: the pixels' probe alone
        linear = 0
    probe = linear + (0 if pretrained else pixels)
    return {"probe_macs": probe, "train_macs": train, "share": round(probe / train, 4)}


def find_label_issues(cache: Path, meta: dataset.Cache, params: Params, out: Path) -> str:
    """label_issues.json and label_issues.png (sanity.label_issues); the log line."""
    setting, t, classes = params.sanity.label_issues, params.train, meta.classes
    xs, labels, names, where = pool(cache)
    pretrained = bool(t.pretrained) and from_torchvision(t.model, t.pretrained)
    report = {"setting": setting, "ran": False, "images": len(labels), "issues": []}
    if setting is False:
        return write_issues(out, report, "off (sanity.label_issues: false)", xs)
    try:
        model, mean, std = network(params, meta, xs[0].shape[3], xs[0].shape[1])
    except (Unavailable, ValueError) as error:  # train names these itself, with its key
        reason = f"skipped: no network to estimate its cost with ({error})"
        return write_issues(out, report, reason, xs)
    report["work"] = work(params, model, xs, len(classes), pretrained)
    if setting == "auto" and report["work"]["share"] > AUTO_SHARE:
        reason = (
            f"skipped: its estimated work is {report['work']['share']:.0%} of train's, over "
            f"auto's {AUTO_SHARE:.0%} (sanity.label_issues: true runs it)"
        )
        return write_issues(out, report, reason, xs)
    try:
        found = label_issues.find(
            probes(params, model, xs, mean, std, pretrained), labels, classes, params.seed
        )
    except ValueError as error:  # one class, a class of one image
        return write_issues(out, report, f"skipped: {error}", xs)
    report |= {
        "ran": True,
        "probe": found.probe,
        "probe_accuracy": found.accuracy,  # out of sample, against the given labels
        "folds": found.folds,
        "suspects": len(found.index),
        "per_class": label_issues.class_shares(labels, found, classes),
        "issues": [
            {
                "file": names[i],
                "split": where[i],
                "given": classes[labels[i]],
                "suggested": classes[s],
                "score": round(float(p), 4),
            }
            for i, s, p in zip(found.index, found.suggested, found.score, strict=True)
        ],
    }
    return write_issues(out, report, "", xs, found.index)


def image_at(xs: list, i: int) -> np.ndarray:
    """Image `i` of the pool: of the split its position falls in."""
    for x in xs:
        if i < len(x):
            return np.asarray(x[i])
        i -= len(x)
    raise IndexError(i)


def write_issues(out: Path, report: dict, reason: str, xs: list, index=()) -> str:
    """label_issues.json and .png from `report` (`index`: the suspects' places in the pool;
    `reason`: why none were looked for); the log line."""
    if reason:
        report["reason"] = reason
    dataset.write_json(out / "label_issues.json", report)
    issues, n = report["issues"], report["images"]
    shown = issues[:SHOWN]
    images = [image_at(xs, int(i)) for i in index[:SHOWN]]
    pixels = loading.to_unit(torch.from_numpy(np.stack(images))).numpy() if images else []
    capped = (
        f", the {SHOWN} likeliest shown (all in label_issues.json)" if len(issues) > SHOWN else ""
    )
    title = (
        f"label issues: {reason}"
        if reason
        else f"{len(issues)} likely mislabelled of {n} images{capped} "
        "(file, given label, the probe's suggestion)"
    )
    rows = {key: [r[key] for r in shown] for key in ("file", "given", "suggested")}
    fig = viz.suspects_grid(pixels, rows["file"], rows["given"], rows["suggested"], title)
    fig.savefig(out / "label_issues.png", dpi=100)
    return f"sanity: label issues {reason}" if reason else label_issues.summary(report, SHOWN)


if __name__ == "__main__":
    run(main)
