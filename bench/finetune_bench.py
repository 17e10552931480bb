"""Benchmark: fine-tuning works here, offline. A backbone pretrained on one task, fine-tuned through
the real train stage on another task with 15 images per class, against the same network from
random weights with the same epochs.

Nothing is downloaded; both tasks are drawn here, on smooth-noise backgrounds of random colours:
  - task A (pretraining): 22 classes of shapes (regular polygons of 3 to 8 sides, stars of 5 to 8
    points, ellipses of three aspect ratios, two crosses, two rings, a crescent, a half disc, an
    arrow, an L and a T), each at a random size, place, rotation and colour; 140 images per class.
    torchvision's `mobilenet_v3_small` (22-class head) learns it in plain PyTorch (40 epochs, Adam,
    one-cycle), fed as the train stage feeds a pretrained network: 56 px crops of the 64 px
    images, ImageNet's mean/std. Its state_dict (torchvision's key layout, its own 22-class head)
    goes to data/pretrained/; its accuracy on 40 held-out images per class is reported.
  - task B (the user's photos): 10 letters (PIL's bundled font), each at a random size, place,
    rotation (+-15 degrees) and colour; 50 PNGs per class in an image folder, split by prepare
    into 15 train, 10 val and 25 test images per class.
Task B runs through `dvc repro evaluate` in a temporary copy of the project (as
tests/test_finetune.py drives it), per seed, in an order that rotates:
  - fine-tuned:            `train.pretrained` the file, `train.freeze_epochs` 2,
                           `train.backbone_lr_factor` 0.1
  - fine-tuned, no freeze: the file, whole network from the first step at one learning rate
                           (scratch's optimizer: only what `train.pretrained` changes differs)
  - scratch:               the same `train.model` from random weights
with the same epochs, batch size and learning rate. The seed moves the split, the initialisation
and the draws. Reports each run's test accuracy (the evaluate stage's, on the model the train stage
kept by val accuracy), the last epoch's train accuracy (augmented, train mode) and, as a
diagnostic outside the pipeline, the test accuracy once the kept model's BatchNorm statistics are
recomputed over the train split (`recalibrated`). The pretrained file can be kept between runs
(`--weights-cache`): pretraining is most of the time.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python bench/finetune_bench.py [--seeds 3] [--weights-cache /tmp/w.pt]

One intra-op thread: on 2 cores shared with other work, torch's two threads spin against each
other and a step runs many times slower (docs/benchmarks.md, "fine-tuning at 224 px").
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from PIL import Image, ImageDraw, ImageFont
from project_files import FILES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZE, CROP = 64, 56  # the cache's side, px; the network's input (ImageNet's 224 of 256)
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # what the stage normalises with
ARCH = "mobilenet_v3_small"
DRAW = 4  # masks are drawn at 4x and reduced: anti-aliased edges
LETTERS = "ACEHKMRSXZ"


# --- the two tasks --------------------------------------------------------------------------------


def regular(n: int, inner: float = 1.0) -> list:
    """A polygon of n corners (a star when `inner` < 1: every other corner pulled in)."""
    k = n * (2 if inner < 1 else 1)
    radius = [1.0 if i % 2 == 0 or inner == 1 else inner for i in range(k)]
    return [[(r * math.cos(2 * math.pi * i / k), r * math.sin(2 * math.pi * i / k))
             for i, r in enumerate(radius)]]  # fmt: skip


def ellipse(aspect: float, shift: float = 0.0, scale: float = 1.0) -> list:
    return [[(shift + scale * math.cos(t), scale * aspect * math.sin(t))
             for t in np.linspace(0, 2 * math.pi, 48, endpoint=False)]]  # fmt: skip


def cross(w: float) -> list:
    return [[(-w, -1), (w, -1), (w, -w), (1, -w), (1, w), (w, w), (w, 1), (-w, 1), (-w, w),
             (-1, w), (-1, -w), (-w, -w)]]  # fmt: skip


# Each shape: polygons filled in, then polygons cut out (unit size, centred at 0).
SHAPES = {
    **{f"polygon{n}": (regular(n), []) for n in range(3, 9)},
    **{f"star{n}": (regular(n, 0.45), []) for n in range(5, 9)},
    **{f"ellipse{a}": (ellipse(a), []) for a in (1.0, 0.6, 0.35)},
    "cross_thin": (cross(0.22), []),
    "cross_thick": (cross(0.45), []),
    "ring_thin": (ellipse(1.0), ellipse(1.0, scale=0.75)),
    "ring_thick": (ellipse(1.0), ellipse(1.0, scale=0.45)),
    "crescent": (ellipse(1.0), ellipse(1.0, shift=0.5, scale=0.85)),
    "half_disc": ([[(math.cos(t), math.sin(t)) for t in np.linspace(0, math.pi, 24)]], []),
    "arrow": (
        [[(-1, -0.25), (0.2, -0.25), (0.2, -0.7), (1, 0), (0.2, 0.7), (0.2, 0.25), (-1, 0.25)]],
        [],
    ),  # fmt: skip
    "L": ([[(-0.7, -1), (-0.25, -1), (-0.25, 0.55), (0.7, 0.55), (0.7, 1), (-0.7, 1)]], []),
    "T": (
        [
            [
                (-1, -1),
                (1, -1),
                (1, -0.55),
                (0.22, -0.55),
                (0.22, 1),
                (-0.22, 1),
                (-0.22, -0.55),
                (-1, -0.55),
            ]
        ],
        [],
    ),  # fmt: skip
}


def shape_mask(name: str, rng: np.random.Generator) -> np.ndarray:
    """The shape at a random size, place and rotation: 0..1, SIZE x SIZE."""
    side = SIZE * DRAW
    angle, radius = rng.uniform(0, 2 * math.pi), rng.uniform(0.25, 0.4) * side
    cx, cy = side / 2 + rng.uniform(-0.12, 0.12, 2) * side
    cos, sin = math.cos(angle), math.sin(angle)
    mask = Image.new("L", (side, side), 0)
    draw = ImageDraw.Draw(mask)
    filled, holes = SHAPES[name]
    for polygons, value in ((filled, 255), (holes, 0)):
        for points in polygons:
            placed = [(cx + radius * (cos * x - sin * y), cy + radius * (sin * x + cos * y))
                      for x, y in points]  # fmt: skip
            draw.polygon(placed, fill=value)
    return np.asarray(mask.reduce(DRAW), np.float32) / 255


def letter_mask(letter: str, rng: np.random.Generator) -> np.ndarray:
    """The letter at a random size, place and rotation (+-15 degrees): 0..1, SIZE x SIZE."""
    side = SIZE * DRAW
    font = ImageFont.load_default(size=int(side * rng.uniform(0.5, 0.75)))
    mask = Image.new("L", (side, side), 0)
    draw = ImageDraw.Draw(mask)
    left, top, right, bottom = draw.textbbox((0, 0), letter, font=font)
    cx, cy = side / 2 + rng.uniform(-0.1, 0.1, 2) * side
    draw.text((cx - (left + right) / 2, cy - (top + bottom) / 2), letter, fill=255, font=font)
    mask = mask.rotate(rng.uniform(-15, 15), Image.Resampling.BILINEAR, center=(cx, cy))
    return np.asarray(mask.reduce(DRAW), np.float32) / 255


def picture(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A coloured figure over a smooth-noise background of other colours, with sensor noise."""
    cells = rng.integers(2, 6)
    low = Image.fromarray((rng.random((cells, cells, 3)) * 255).astype(np.uint8))
    background = np.asarray(low.resize((SIZE, SIZE), Image.Resampling.BICUBIC), np.float32)
    colour = rng.random(3) * 255
    if abs(colour.mean() - background.mean()) < 70:  # keep the figure visible
        colour = 255 - colour
    pixels = background * (1 - mask[..., None]) + colour * mask[..., None]
    pixels += rng.normal(0, 8, pixels.shape)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def shapes_task(per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Task A: uint8 NHWC images and int64 labels, the classes taking turns."""
    rng = np.random.default_rng(seed)
    names = list(SHAPES)
    labels = np.arange(per_class * len(names)) % len(names)
    images = np.stack([picture(shape_mask(names[c], rng), rng) for c in labels])
    return images, labels


def letters_folder(root: Path, per_class: int, seed: int) -> None:
    """Task B: an image folder of PNGs, one subfolder per letter."""
    rng = np.random.default_rng(seed)
    for letter in LETTERS:
        (root / letter).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(picture(letter_mask(letter, rng), rng)).save(root / letter / f"{i}.png")


# --- pretraining on task A, in plain PyTorch ------------------------------------------------------


def to_input(x: np.ndarray, train: bool, generator: torch.Generator) -> torch.Tensor:
    """uint8 NHWC -> the network's input: a CROP px window (random while training, else the
    centre), mirrored at random while training, normalised with ImageNet's statistics."""
    images = torch.from_numpy(x).permute(0, 3, 1, 2).float().div_(255)
    if train:
        top, left = torch.randint(0, SIZE - CROP + 1, (2,), generator=generator).tolist()
        if torch.rand(1, generator=generator).item() < 0.5:
            images = images.flip(3)
    else:
        top = left = (SIZE - CROP) // 2
    images = images[..., top : top + CROP, left : left + CROP]
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    return ((images - mean) / std).contiguous(memory_format=torch.channels_last)


def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    model.eval()
    with torch.no_grad():
        hits = sum(
            (
                model(to_input(x[i : i + 256], False, None)).argmax(1)
                == torch.from_numpy(y[i : i + 256])
            )
            .sum()
            .item()
            for i in range(0, len(x), 256)
        )
    return hits / len(x)


def pretrain(epochs: int, seed: int, arch: str = ARCH, per_class: int = 140) -> tuple[dict, dict]:
    """`arch` on task A, `per_class` images per class: its state_dict (22-class head) and what
    it reached."""
    from torchvision.models import get_model

    started = time.perf_counter()
    x, y = shapes_task(per_class, seed)
    xt, yt = shapes_task(40, seed + 1)  # held out
    drawn = time.perf_counter() - started
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = get_model(arch, num_classes=len(SHAPES)).to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    steps = epochs * math.ceil(len(x) / 64)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 3e-3, total_steps=steps)
    for epoch in range(1, epochs + 1):
        model.train()
        order = torch.randperm(len(x), generator=generator).numpy()
        for start in range(0, len(x), 64):
            index = order[start : start + 64]
            loss = F.cross_entropy(
                model(to_input(x[index], True, generator)), torch.from_numpy(y[index])
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        print(f"pretrain epoch {epoch}/{epochs}: loss {loss.item():.3f}", flush=True)
    report = {
        "classes": len(SHAPES),
        "train_images": len(x),
        "epochs": epochs,
        "held_out_accuracy": accuracy(model, xt, yt),
        "seconds": time.perf_counter() - started,
        "drawing_seconds": drawn,
    }
    return model.state_dict(), report


# --- task B through the pipeline --------------------------------------------------------------------


def sh(project: Path, *cmd: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(project / "src"),
        "DVC_NO_ANALYTICS": "1",
    }
    result = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
    return result


def make_project(dest: Path) -> None:
    """A committed git + DVC copy of the project (DVCLive needs a first commit)."""
    for name in FILES:
        src, target = ROOT / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, target)
    sh(dest, "git", "init", "-q", "-b", "main")
    sh(dest, "git", "add", "-A")
    sh(dest, "git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "init")


def set_params(project: Path, seed: int, train: dict) -> None:
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["seed"] = seed
    params["prepare"] |= {
        "source": "imagefolder",
        "path": "data/photos",
        "image_size": SIZE,
        "color": "rgb",
        "test_fraction": 0.5,  # of 50 per class: 25 test
        "val_fraction": 0.4,  # of the other 25: 10 val, 15 train
    }
    params["train"] = {**params["train"], "pretrained": "", "freeze_epochs": 0} | train
    params["train"]["backbone_lr_factor"] = train.get("backbone_lr_factor", 1.0)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def last_value(project: Path, curve: str) -> float:
    """The last epoch's value of one of the train stage's DVCLive curves."""
    rows = (project / f"results/train/live/plots/metrics/{curve}.tsv").read_text().splitlines()
    return float(rows[-1].split("\t")[-1])


def recalibrated(project: Path) -> float:
    """A diagnostic, not the pipeline: the kept model's test accuracy once its BatchNorm running
    statistics are recomputed over the train split (as evaluation feeds it). torchvision's
    mobilenet_v3_small updates them with momentum 0.01: after the ~150 steps of a small run they
    still hold much of their start, and a model that fits its train split can score at chance."""
    from visionflow.data.dataset import read_cache_meta, read_split
    from visionflow.train.engine import evaluate
    from visionflow.train.loading import to_model_input
    from visionflow.train.models import load_model

    model, meta = load_model(project / "results/train/model.pt")
    mean, std = torch.tensor(meta["mean"]), torch.tensor(meta["std"])
    for norm in model.modules():
        if isinstance(norm, torch.nn.modules.batchnorm._BatchNorm):
            norm.reset_running_stats()
            norm.momentum = None  # a cumulative average over every batch below
    x, y = read_split(project / "data/prepared", "train")
    assert read_cache_meta(project / "data/prepared").classes == meta["classes"]
    model.train()
    with torch.no_grad():
        for start in range(0, len(x), 64):
            model(to_model_input(torch.from_numpy(x[start : start + 64]), mean, std))
    x, y = read_split(project / "data/prepared", "test")
    scores, _ = evaluate(model, torch.from_numpy(x), torch.from_numpy(y), mean, std, 256)
    return scores["accuracy"]


def run_pipeline(project: Path) -> dict:
    """`dvc repro evaluate`: the test accuracy, the kept epoch and its val accuracy, the last
    epoch's train accuracy, the time; and the diagnostic `recalibrated`."""
    started = time.perf_counter()
    sh(project, "dvc", "repro", "evaluate")
    seconds = time.perf_counter() - started
    test = json.loads((project / "results/evaluate/metrics.json").read_text())
    kept = json.loads((project / "results/train/metrics.json").read_text())
    return {
        "test_accuracy": test["accuracy"],
        "best_epoch": kept["best_epoch"],
        "val_accuracy": kept["val_acc"],
        "last_train_accuracy": last_value(project, "train/accuracy"),
        "seconds": seconds,
        "test_accuracy_bn_recalibrated": recalibrated(project),
    }


def pretrained_weights(args) -> tuple[dict, dict]:
    """The pretrained state_dict and its report: from `--weights-cache` when it holds them."""
    cache = args.weights_cache
    if cache and cache.exists():
        saved = torch.load(cache, weights_only=True)
        return saved["state_dict"], saved["report"]
    weights, pretrained = pretrain(args.pretrain_epochs, seed=0)
    if cache:
        torch.save({"state_dict": weights, "report": pretrained}, cache)
    return weights, pretrained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=15, help="fine-tuning and scratch epochs")
    parser.add_argument("--pretrain-epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--freeze-epochs", type=int, default=2)
    parser.add_argument("--backbone-lr-factor", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument(
        "--weights-cache",
        type=Path,
        default=None,
        help="keep the pretrained file here, or reuse it",
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="finetune-bench-"))
    try:
        project = tmp / "project"
        make_project(project)
        letters_folder(project / "data/photos", 50, seed=1234)
        weights, pretrained = pretrained_weights(args)
        torch.save(weights, project / "data/pretrained/shapes_mnv3.pth")
        print(f"pretrained: {pretrained}", flush=True)
        common = {"model": ARCH, "epochs": args.epochs, "batch_size": args.batch_size}
        common |= {"lr": args.lr, "device": "cpu"}
        contenders = {
            "fine-tuned": {
                "pretrained": "data/pretrained/shapes_mnv3.pth",
                "freeze_epochs": args.freeze_epochs,
                "backbone_lr_factor": args.backbone_lr_factor,
            },
            "fine-tuned, no freeze": {  # the pretrained weights alone: scratch's optimizer
                "pretrained": "data/pretrained/shapes_mnv3.pth",
                "freeze_epochs": 0,
                "backbone_lr_factor": 1.0,
            },
            "scratch": {},
        }
        runs = {name: [] for name in contenders}
        for seed in range(args.seeds):
            names = list(contenders)
            order = names[seed % len(names) :] + names[: seed % len(names)]  # rotated
            for name in order:
                set_params(project, seed, common | contenders[name])
                result = run_pipeline(project)
                runs[name].append({"seed": seed, **result})
                print(f"seed {seed} {name:10s} {result}", flush=True)
        report(runs, pretrained, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(runs: dict, pretrained: dict, args) -> None:
    print(
        f"\npretraining (task A, {pretrained['classes']} classes, {pretrained['train_images']} "
        f"images, {pretrained['epochs']} epochs): held-out accuracy "
        f"{pretrained['held_out_accuracy']:.4f} in {pretrained['seconds']:.0f} s"
    )
    keys = ("test_accuracy", "last_train_accuracy", "test_accuracy_bn_recalibrated")
    print("\n| seed | " + " | ".join(f"{n}: {k}" for n in runs for k in keys) + " |")
    print("|---" * (len(runs) * len(keys) + 1) + "|")
    for i in range(args.seeds):
        cells = [f"{runs[n][i][k]:.4f}" for n in runs for k in keys]
        print(f"| {i} | " + " | ".join(cells) + " |")
    for name, results in runs.items():
        accs = [r["test_accuracy"] for r in results]
        secs = [r["seconds"] for r in results]
        print(
            f"{name}: test accuracy mean {statistics.mean(accs):.4f} "
            f"(min {min(accs):.4f}, max {max(accs):.4f}); median seconds {statistics.median(secs):.0f}"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {"pretrained": pretrained, "runs": runs, "args": vars(args)}, default=str, indent=1
            )
        )


if __name__ == "__main__":
    main()
