"""Benchmark (#58): fine-tuning through visionflow's pipeline against fastai's `fine_tune`, the
peer, on the same split, weights file, input size and epochs.

Nothing is downloaded. The weights: torchvision's `resnet18` and `mobilenet_v3_small` pretrained
here in plain PyTorch on another task (finetune_bench.py's 22 classes of drawn shapes, 56 px crops
of 64 px images), saved in torchvision's layout (a 22-class head); `--weights-cache DIR` keeps
them between runs (pretraining is the slow part). The tasks, made here, photo-like, all mirror
symmetric (both sides train on mirrored images):
  - textures-2:  photos.py's camera-like photos (texture scale and colour cast per class),
                 2 classes, 100 per class (many per class)
  - letters-11:  the 11 mirror-symmetric capital letters (A H I M O T U V W X Y) at a random
                 size, place, rotation and colour over smooth-noise backgrounds, 24 per class
                 (few per class, 10+ classes)
  - textures-10: photos.py's photos in 10 classes, 24 per class (few per class, fine cues)
each a folder of JPEGs/PNGs that prepare caches at 64 px (RGB); the network sees 56 px crops.
Per task and seed, in a temporary copy of the project (`git clone` it at a commit to bench that
commit: the copy's own src/ is put first on PYTHONPATH), prepare makes the split (test 30%, val
20% of the rest); its cached uint8 pixels are written out as PNGs in train/valid/test folders, so
fastai reads the very pixels visionflow trains on. Then, per network family:
  - visionflow: `dvc repro evaluate` with `train.pretrained` the weights file, the model, the
    epochs, batch size, `train.augment.hflip: true` (the tasks are mirror symmetric; fastai flips
    by default) and `evaluate.tta: true`; everything else params.yaml's defaults (`recipe: auto`).
    `--variant NAME:key=value,...` adds a visionflow contender with these train.* keys changed
    (`augment.x=...` for the augment section).
  - fastai: `vision_learner(dls, arch, pretrained=False)`, its body loaded with the same state_dict,
    `fine_tune(epochs - 1, base_lr=2e-3, freeze_epochs=1)` (fastai's default base_lr, no lr_find),
    items RandomCrop(56) (random while training, the centre to validate and test), batch
    transforms `aug_transforms()` (its defaults: flips, rotation, zoom, warp, lighting) and
    ImageNet's mean/std; the last epoch's model, `get_preds` on the test folder, `tta()` (n=4).
Both keep their own default head, loss and model choice (visionflow: the best val epoch).
Reported: each run's test accuracy and TTA accuracy, the paired difference (visionflow - fastai)
per task x family x seed with a 95% t interval over the pairs, exact McNemar on the test images
pooled over all runs, and the ratios of wall time (visionflow's `dvc repro evaluate` after
prepare and sanity: check, train, evaluate and DVC; fastai's process: import, training, test and
TTA), of training time alone, and of peak RSS (the largest process). Each visionflow run also
scores every TTA scheme of `TTA` on its one model (`tta_schemes`: the library's tta.view_probs
and tta.blend; their gain over the single pass beside fastai's) and records what its train stage
said (metrics.json with `train.lr: auto`'s rate, the health report's findings, the val curves);
`--keep-models DIR` keeps each run's model and test split, and `--rescore DIR` scores more schemes
on them afterwards (`extra_views`).

fastai is not a dependency of the project: it runs in a venv of its own, in a child process
(`--fastai-python`):

    python3 -m venv /tmp/fastai-venv
    /tmp/fastai-venv/bin/pip install fastai==2.8.12 torch==2.14.1 torchvision==0.29.1
    git clone -q . /tmp/fb-snap && cd /tmp/fb-snap
    OMP_NUM_THREADS=1 nice -n 19 /work/main/.venv/bin/python bench/fastai_peer_bench.py \
        --fastai-python /tmp/fastai-venv/bin/python --weights-cache /tmp/fb-weights \
        [--seeds 3] [--tasks textures-2,letters-11,textures-10] [--families resnet18,...] \
        [--variant NAME:key=value,...] [--no-defaults] [--no-fastai] [--out results.json] \
        [--keep-models models/]
    .venv/bin/python bench/fastai_peer_bench.py --report a.json b.json [--out merged.json]
    PYTHONPATH=src .venv/bin/python bench/fastai_peer_bench.py --rescore models/ [--out s.json]

One process per task (`--tasks`) runs side by side; contenders run apart (`--no-fastai
--no-defaults --variant ...`) pair with the others cell by cell, a split being its task and
seed's; `--report` merges the files and prints the tables. Results: docs/benchmarks.md (#58).
"""

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZE, CROP = 64, 56  # the cache's side and the network's input, px (finetune_bench's)
SYMMETRIC = "AHIMOTUVWXY"  # capital letters a mirror leaves as they are
TASKS = {  # name: (kind, classes, images per class)
    "textures-2": ("textures", 2, 100),
    "letters-11": ("letters", 11, 24),
    "textures-10": ("textures", 10, 24),
}
# name: (pretraining epochs, shapes per class). mobilenet_v3_small's BatchNorm running statistics
# move with momentum 0.01: 15 epochs of 60 per class (315 steps) left it at chance in eval mode.
FAMILIES = {"resnet18": (10, 60), "mobilenet_v3_small": (30, 140)}
FASTAI_LR = 2e-3  # fine_tune's default base_lr
# TTA schemes scored on each visionflow run's one model (tta.views' order: 0 the centre crop,
# 1-4 the corners, 5-9 the same mirrored): name: (the views, beta, the weight moved to the centre)
TTA = {
    "mean10": (range(10), 0.0),  # evaluate.tta before: all ten views equally
    "lerp10": (range(10), 0.25),  # fastai's tta(beta=0.25) over the ten views
    "lerp10-half": (range(10), 0.5),
    "crops5": (range(5), 0.0),  # the five crops, not mirrored
    "flip2": ((0, 5), 0.0),  # the centre and its mirror
    "lerp-flip2": ((0, 5), 0.25),
}


# --- the fastai side: runs in the fastai venv, imports nothing of the project ----------------------


def fastai_run(spec: dict) -> dict:
    """One fastai fine-tune on the exported split; what it scored, per test image too."""
    started = time.perf_counter()
    import torch
    from fastai.vision.all import (
        CategoryBlock,
        DataBlock,
        GrandparentSplitter,
        ImageBlock,
        Normalize,
        RandomCrop,
        accuracy,
        aug_transforms,
        get_image_files,
        imagenet_stats,
        parent_label,
        set_seed,
        vision_learner,
    )
    from torchvision.models import get_model

    set_seed(spec["seed"], reproducible=True)
    root = Path(spec["root"])
    block = DataBlock(
        blocks=(ImageBlock, CategoryBlock),
        get_items=get_image_files,
        splitter=GrandparentSplitter(train_name="train", valid_name="valid"),
        get_y=parent_label,
        item_tfms=RandomCrop(spec["crop"]),
        batch_tfms=[*aug_transforms(), Normalize.from_stats(*imagenet_stats)],
    )
    dls = block.dataloaders(root, bs=spec["batch_size"], num_workers=0, device="cpu")
    learn = vision_learner(dls, getattr_arch(spec["arch"]), pretrained=False, metrics=accuracy)
    source = get_model(spec["arch"], num_classes=spec["weights_classes"])
    source.load_state_dict(torch.load(spec["weights"], weights_only=True))
    body = learn.model[0]  # the same children of the same network, cut where fastai cuts
    body.load_state_dict(torch.nn.Sequential(*list(source.children())[: len(body)]).state_dict())
    fit_started = time.perf_counter()
    with learn.no_bar(), learn.no_logging():
        learn.fine_tune(spec["epochs"] - 1, base_lr=spec["lr"], freeze_epochs=1)
    fit_seconds = time.perf_counter() - fit_started
    files = sorted(get_image_files(root / "test"), key=lambda p: int(p.stem))  # the cache's order
    test = dls.test_dl(files, with_labels=True)
    with learn.no_bar(), learn.no_logging():
        probs, targets = learn.get_preds(dl=test)
        tta_probs, _ = learn.tta(dl=test)
    correct = (probs.argmax(1) == targets).tolist()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "test_accuracy": sum(correct) / len(correct),
        "tta_accuracy": (tta_probs.argmax(1) == targets).float().mean().item(),
        "correct": correct,
        "train_seconds": fit_seconds,
        "seconds": time.perf_counter() - started,
        "peak_rss_mb": peak,
    }


def getattr_arch(name: str):
    """The torchvision constructor fastai's vision_learner calls (fastai re-exports these two)."""
    from torchvision.models import mobilenet_v3_small, resnet18

    return {"resnet18": resnet18, "mobilenet_v3_small": mobilenet_v3_small}[name]


# --- the tasks ------------------------------------------------------------------------------------


def make_task(root: Path, name: str, seed: int = 1234) -> None:
    """The task's image folder: one subfolder per class."""
    from finetune_bench import letter_mask, picture
    from photos import photo
    from PIL import Image

    kind, classes, per_class = TASKS[name]
    rng = np.random.default_rng(seed)
    for i in range(classes * per_class):
        label = i % classes
        folder = root / f"class{label:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        if kind == "textures":
            photo(rng, label, size=(256, 192)).save(folder / f"{i:04d}.jpg", quality=90)
        else:
            pixels = picture(letter_mask(SYMMETRIC[label], rng), rng)
            Image.fromarray(pixels).save(folder / f"{i:04d}.png")


def export_split(project: Path, dest: Path) -> int:
    """The prepared cache's pixels as PNGs in dest/{train,valid,test}/<class>/<index>.png; the
    number of classes. Test files are numbered in the cache's order (predictions.json's)."""
    from PIL import Image

    from visionflow.data.dataset import read_cache_meta, read_split

    cache = project / "data/prepared"
    classes = read_cache_meta(cache).classes
    shutil.rmtree(dest, ignore_errors=True)
    for split, folder in (("train", "train"), ("val", "valid"), ("test", "test")):
        x, y = read_split(cache, split)
        for i, (image, label) in enumerate(zip(x, y, strict=True)):
            path = dest / folder / classes[label] / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(path)
    return len(classes)


# --- the visionflow side ------------------------------------------------------------------------


def weights_file(cache: Path | None, arch: str) -> Path:
    """`arch` pretrained on the shapes (finetune_bench.pretrain): from the cache folder when it
    holds it, else trained now (and kept there)."""
    import torch
    from finetune_bench import pretrain

    path = (cache or Path(tempfile.mkdtemp(prefix="fb-weights-"))) / f"{arch}.pt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        weights, report = pretrain(FAMILIES[arch][0], 0, arch, FAMILIES[arch][1])
        torch.save({"state_dict": weights, "report": report | {"arch": arch}}, path)
    return path


def set_params(project: Path, task: str, seed: int, train: dict) -> None:
    import yaml

    params = yaml.safe_load((project / "params.yaml.base").read_text())  # each run from the same
    params["seed"] = seed
    params["prepare"] |= {"source": "imagefolder", "path": f"data/{task}", "image_size": SIZE}
    params["prepare"] |= {"color": "rgb", "test_fraction": 0.3, "val_fraction": 0.2}
    augment = {k.split(".", 1)[1]: v for k, v in train.items() if k.startswith("augment.")}
    params["train"] |= {k: v for k, v in train.items() if not k.startswith("augment.")}
    params["train"]["augment"] |= {"hflip": True} | augment
    params["evaluate"] |= {"tta": True}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def measured(project: Path, *cmd: str) -> tuple[float, float, str]:
    """Run `cmd` as finetune_bench.sh does, in a child that reports the peak RSS of the largest
    process under it (MB); (seconds, peak, its output)."""
    from finetune_bench import sh

    probe = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)"
    )
    started = time.perf_counter()
    result = sh(project, sys.executable, "-c", probe, *cmd)
    peak = float(result.stdout.strip().splitlines()[-1])
    return time.perf_counter() - started, peak, result.stdout + result.stderr


def visionflow_run(project: Path, keep: Path | None = None, tag: str = "") -> dict:
    """`dvc repro evaluate` in the project; what it scored. `keep`: a folder that gets the
    model (tag.pt) and the test split (tag.test.npz), for scoring TTA schemes later (--rescore)."""
    from visionflow.data.dataset import read_split

    seconds, peak, out = measured(project, "dvc", "repro", "evaluate")
    x, y = read_split(project / "data/prepared", "test")
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy2(project / "results/train/model.pt", keep / f"{tag}.pt")
        np.savez(keep / f"{tag}.test.npz", x=x, y=y)
    test = json.loads((project / "results/evaluate/metrics.json").read_text())
    rows = json.loads((project / "results/evaluate/predictions.json").read_text())
    epochs = (project / "results/train/live/plots/metrics/train/loss.tsv").exists()
    return {
        "test_accuracy": test["accuracy"],
        "tta_accuracy": test["tta_acc"],
        "correct": [r["actual"] == r["predicted"] for r in rows],
        "train_seconds": train_seconds(project) if epochs else None,
        "seconds": seconds,
        "peak_rss_mb": peak,
        "train": train_record(project, out),
        "tta_schemes": tta_schemes(project / "results/train/model.pt", x, y),
    }


def train_record(project: Path, out: str) -> dict:
    """What the train stage said of itself: metrics.json (with `lr` under train.lr: auto), the
    health report's findings, the val curves per epoch and the rate lines of its log."""
    live = project / "results/train/live/plots/metrics"

    def curve(name: str) -> list[float]:  # a DVCLive tsv's values, one per epoch
        return [float(r.split("\t")[-1]) for r in (live / name).read_text().splitlines()[1:]]

    health = json.loads((project / "results/train/health.json").read_text())
    # train.lr: auto's, this run's: the newest (a task's project keeps earlier runs' folders)
    found = sorted((project / "checkpoints/train").glob("*/lr_find.json"), key=os.path.getmtime)
    return {
        "range_test": json.loads(found[-1].read_text()) if found else None,
        "metrics": json.loads((project / "results/train/metrics.json").read_text()),
        "health_messages": health["messages"],
        "val_loss": curve("val/loss.tsv"),
        "val_accuracy": curve("val/accuracy.tsv"),
        "train_accuracy": curve("train/accuracy.tsv"),
        "lr_lines": [line for line in out.splitlines() if "train.lr auto" in line],
    }


def tta_schemes(model_file: Path, x: np.ndarray, y: np.ndarray) -> dict:
    """Each TTA scheme's test accuracy and per-image outcomes, from the run's one model (the
    library's tta.view_probs and tta.blend, as the evaluate stage calls them)."""
    import torch

    from visionflow.train import tta
    from visionflow.train.models import load_model

    model, meta = load_model(model_file)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    size, flip = meta["network"]["input_size"], meta["train"]["hflip"]
    chosen = tta.views(meta["image_size"], size, flip)
    assert len(chosen) == 10, chosen  # centre + 4 corners, each mirrored
    norm = torch.tensor(meta["mean"]), torch.tensor(meta["std"])
    probs = tta.view_probs(model, x, *norm, 64, chosen, size)
    schemes = {}
    for name, (which, beta) in TTA.items():
        correct = (tta.blend(probs[list(which)], beta).argmax(1) == y).tolist()
        schemes[name] = {"accuracy": sum(correct) / len(correct), "correct": correct}
    return schemes


def extra_views(model_file: Path, npz: Path) -> dict:
    """The schemes scored afterwards on a kept model (--rescore): TTA's and views visionflow's
    evaluate does not take (the whole image, a zoom, rotations: one grid_sample each, as
    augment.py samples) and draws of the training augmentation itself (augment.augment with the
    bench's keys: resized_crop, rotation 10, flips; a generator seeded 0); name: test accuracy."""
    import torch
    import torch.nn.functional as F

    from visionflow.train import tta
    from visionflow.train.augment import augment
    from visionflow.train.loading import normalise, to_unit
    from visionflow.train.models import load_model

    model, meta = load_model(model_file)
    data = np.load(npz)
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    mean, std, size = torch.tensor(meta["mean"]), torch.tensor(meta["std"]), CROP
    probs = lambda images: torch.softmax(model(normalise(images, mean, std)).float(), 1)  # noqa: E731
    ten = tta.view_probs(model, x, mean, std, 256, tta.views(SIZE, size, True), size)
    unit = to_unit(x)
    u = ((torch.arange(size) * 2 + 1) / size - 1).view(1, size)
    v = ((torch.arange(size) * 2 + 1) / size - 1).view(size, 1)
    extra = {}
    with torch.no_grad():
        for name, scale, degrees in (("whole", 1.0, 0), ("zoom", 0.75, 0), ("rot+", CROP / SIZE, 10), ("rot-", CROP / SIZE, -10)):  # fmt: skip
            cos, sin = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
            grid = torch.stack([scale * (cos * u - sin * v), scale * (sin * u + cos * v)], -1)
            seen = F.grid_sample(unit, grid.expand(len(x), -1, -1, -1), align_corners=False)
            extra[name], extra[name + " mirrored"] = probs(seen), probs(seen.flip(3))
        rng = torch.Generator().manual_seed(0)
        draws = torch.stack([probs(augment(unit, rng, hflip=True, rotation=10.0, resized_crop=size))
                             for _ in range(16)])  # fmt: skip
    pick = lambda *names: torch.stack([extra[n] for k in names for n in (k, k + " mirrored")])  # noqa: E731
    blends = {name: (ten[list(which)], beta) for name, (which, beta) in TTA.items()}
    blends |= {
        "ext12-lerp": (torch.cat([ten, pick("whole")]), 0.25),
        "ext14-lerp": (torch.cat([ten, pick("whole", "zoom")]), 0.25),
        "ext18-lerp": (torch.cat([ten, pick("whole", "zoom", "rot+", "rot-")]), 0.25),
        "ext18-mean": (torch.cat([ten, pick("whole", "zoom", "rot+", "rot-")]), 0.0),
        "rot6-lerp": (torch.cat([ten[[0, 5]], pick("rot+", "rot-")]), 0.25),
        "scale6-lerp": (torch.cat([ten[[0, 5]], pick("whole", "zoom")]), 0.25),
    }
    for n in (4, 8, 16):  # fastai's tta(): the draws' mean moved a quarter toward the centre
        blends[f"aug{n}-lerp"] = (draws[:n], 0.25)
    blends["aug16-mean"] = (draws, 0.0)
    out = {"single": (ten[0].argmax(1) == y).float().mean().item()}
    for name, (views, beta) in blends.items():  # tta.blend's lerp, toward the centre crop
        out[name] = (torch.lerp(views.mean(0), ten[0], beta).argmax(1) == y).float().mean().item()
    return out


def train_seconds(project: Path) -> float | None:
    """The train stage's epoch seconds, summed (results/train.timings/, the curve of them)."""
    for path in (project / "results/train.timings").rglob("*.tsv"):
        if "seconds" in path.stem or "epoch_time" in path.stem:
            rows = path.read_text().splitlines()[1:]
            return sum(float(r.split("\t")[-1]) for r in rows)
    return None


def fastai_cell(args, split: Path, arch: str, weights: Path, classes: int, seed: int) -> dict:
    spec = {"root": str(split), "arch": arch, "weights": str(weights), "seed": seed}
    spec |= {"epochs": args.epochs, "batch_size": args.batch_size, "lr": FASTAI_LR, "crop": CROP}
    spec |= {"weights_classes": classes}
    result = subprocess.run(
        [str(args.fastai_python), __file__, "--fastai-spec", json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ""},
    )
    if result.returncode != 0:
        raise RuntimeError(f"fastai run failed\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- the statistics -------------------------------------------------------------------------------


def t_interval(diffs: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t interval of paired differences."""
    from scipy import stats

    n, mean = len(diffs), float(np.mean(diffs))
    if n < 2:
        return mean, math.nan, math.nan
    half = stats.t.ppf(0.975, n - 1) * float(np.std(diffs, ddof=1)) / math.sqrt(n)
    return mean, mean - half, mean + half


def mcnemar(a: list[bool], b: list[bool]) -> dict:
    """Exact McNemar on paired per-image outcomes: only a right, only b right, two-sided p."""
    from scipy import stats

    only_a = sum(x and not y for x, y in zip(a, b, strict=True))
    only_b = sum(y and not x for x, y in zip(a, b, strict=True))
    n = only_a + only_b
    p = 1.0 if n == 0 else min(1.0, 2 * stats.binom.cdf(min(only_a, only_b), n, 0.5))
    return {"only_first": only_a, "only_second": only_b, "p": p}


def summary(runs: list[dict], name: str) -> dict:
    """One visionflow contender against fastai over every cell both ran."""
    pairs = [(r[name], r["fastai"]) for r in runs if name in r and "fastai" in r]
    diffs = [v["test_accuracy"] - f["test_accuracy"] for v, f in pairs]
    tta_diffs = [v["tta_accuracy"] - f["tta_accuracy"] for v, f in pairs]
    mean, low, high = t_interval(diffs)
    pooled = mcnemar(
        [c for v, _ in pairs for c in v["correct"]], [c for _, f in pairs for c in f["correct"]]
    )
    gain = [(v["tta_accuracy"] - v["test_accuracy"], f["tta_accuracy"] - f["test_accuracy"])
            for v, f in pairs]  # fmt: skip
    ratio = lambda key: float(np.median([v[key] / f[key] for v, f in pairs if v[key] and f[key]]))  # noqa: E731
    return {
        "tta_schemes": tta_summary(pairs),
        "pairs": len(pairs),
        "mean_accuracy": float(np.mean([v["test_accuracy"] for v, _ in pairs])),
        "fastai_mean_accuracy": float(np.mean([f["test_accuracy"] for _, f in pairs])),
        "mean_difference": mean,
        "ci95": [low, high],
        "tta_mean_difference": float(np.mean(tta_diffs)),
        "tta_gain": float(np.mean([g for g, _ in gain])),
        "fastai_tta_gain": float(np.mean([g for _, g in gain])),
        "mcnemar_pooled": pooled,
        "median_wall_ratio": ratio("seconds"),
        "median_train_ratio": ratio("train_seconds"),
        "median_peak_rss_ratio": ratio("peak_rss_mb"),
    }


def tta_summary(pairs: list[tuple[dict, dict]]) -> dict:
    """Per TTA scheme: its mean gain over the single pass, and minus fastai's gain, paired."""
    pairs = [(v, f) for v, f in pairs if "tta_schemes" in v]
    out = {}
    for name in TTA if pairs else []:
        gains = [v["tta_schemes"][name]["accuracy"] - v["test_accuracy"] for v, _ in pairs]
        fastai = [f["tta_accuracy"] - f["test_accuracy"] for _, f in pairs]
        mean, low, high = t_interval([g - h for g, h in zip(gains, fastai, strict=True)])
        out[name] = {"gain": float(np.mean(gains)), "fastai_gain": float(np.mean(fastai))}
        out[name] |= {"gain_minus_fastai": mean, "ci95": [low, high], "pairs": len(pairs)}
        out[name] |= {
            "runs_gained": sum(g > 0 for g in gains),
            "runs_lost": sum(g < 0 for g in gains),
        }
    return out


def print_tables(runs: list[dict], names: list[str]) -> None:
    head = " | ".join(f"{n} | {n} TTA" for n in names)
    print(f"\n| task | family | seed | {head} |")
    print("|---" * (3 + 2 * len(names)) + "|")
    for r in runs:
        cells = " | ".join(
            f"{r[n]['test_accuracy']:.3f} | {r[n]['tta_accuracy']:.3f}" if n in r else "- | -"
            for n in names
        )
        print(f"| {r['task']} | {r['family']} | {r['seed']} | {cells} |")
    groups = sorted({(r["task"], r["family"]) for r in runs})
    print("\n| task | family | " + " | ".join(names) + " |\n" + "|---" * (2 + len(names)) + "|")
    for task, family in groups:
        cells = [r for r in runs if (r["task"], r["family"]) == (task, family)]
        means = [
            np.mean([r[n]["test_accuracy"] for r in cells if n in r] or [np.nan]) for n in names
        ]
        print(f"| {task} | {family} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    if not any("fastai" in r for r in runs):
        return  # nothing to pair with
    print("\n| contender | pairs | mean acc | fastai | mean diff [95% CI] | McNemar pooled "
          "(only vf / only fastai, p) | TTA gain (fastai's) | wall / train / peak RSS ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        if name == "fastai":
            continue
        s = summary(runs, name)
        m = s["mcnemar_pooled"]
        print(
            f"| {name} | {s['pairs']} | {s['mean_accuracy']:.3f} | {s['fastai_mean_accuracy']:.3f} "
            f"| {s['mean_difference']:+.3f} [{s['ci95'][0]:+.3f}, {s['ci95'][1]:+.3f}] "
            f"| {m['only_first']} / {m['only_second']}, p {m['p']:.3g} "
            f"| {s['tta_gain']:+.3f} ({s['fastai_tta_gain']:+.3f}) "
            f"| {s['median_wall_ratio']:.2f} / {s['median_train_ratio']:.2f} "
            f"/ {s['median_peak_rss_ratio']:.2f} |",
            flush=True,
        )
    print("\n| contender | TTA scheme | gain | fastai's gain | minus fastai's, paired [95% CI] "
          "| runs gained / lost |\n|---|---|---|---|---|---|")  # fmt: skip
    for name in names:
        for scheme, t in (summary(runs, name)["tta_schemes"] if name != "fastai" else {}).items():
            print(
                f"| {name} | {scheme} | {t['gain']:+.3f} | {t['fastai_gain']:+.3f} "
                f"| {t['gain_minus_fastai']:+.3f} [{t['ci95'][0]:+.3f}, {t['ci95'][1]:+.3f}] "
                f"| {t['runs_gained']} / {t['runs_lost']} |"
            )


# --- the loop -----------------------------------------------------------------------------------


def variant(spec: str) -> tuple[str, dict]:
    """`NAME:key=value,key=value` -> (NAME, train.* keys); values read as YAML."""
    import yaml

    name, _, pairs = spec.partition(":")
    return name, {k: yaml.safe_load(v) for k, v in (p.split("=", 1) for p in pairs.split(",") if p)}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fastai-python", type=Path, help="the fastai venv's python")
    parser.add_argument("--fastai-spec", help=argparse.SUPPRESS)  # the child's side
    parser.add_argument("--seeds", default="3", help="N: seeds 0 .. N-1; or a list: 1,2")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--epochs", type=int, default=6, help="fastai: 1 frozen + epochs - 1")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--weights-cache", type=Path, default=None, help="a folder")
    parser.add_argument("--variant", action="append", default=[], type=variant)
    parser.add_argument("--no-defaults", action="store_true", help="skip visionflow's defaults")
    parser.add_argument("--no-fastai", action="store_true", help="skip fastai (screening)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--keep-models", type=Path, help="a folder: each run's model, test split")
    parser.add_argument("--rescore", type=Path, help="a --keep-models folder: score extra_views")
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        help="only print the tables of these --out files together (runs split by --tasks, or "
        "contenders run apart: a cell's split is its task and seed's)",
    )
    return parser.parse_args()


def seeds(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s] if "," in text else list(range(int(text)))


def main() -> None:
    args = arguments()
    if args.fastai_spec:  # the child, in the fastai venv
        print(json.dumps(fastai_run(json.loads(args.fastai_spec))))
        return
    if args.rescore:  # every kept model's schemes, as JSON (to --out, else printed)
        models = sorted(args.rescore.glob("*.pt"))
        scores = {m.stem: extra_views(m, m.with_suffix(".test.npz")) for m in models}
        text = json.dumps(scores, indent=1)
        args.out.write_text(text) if args.out else print(text)
        return
    if args.report:
        cells = {}  # the same task, family and seed from several files: one cell (one split)
        for path in args.report:
            for r in json.loads(path.read_text())["runs"]:
                cells.setdefault((r["task"], r["family"], r["seed"]), {}).update(r)
        runs = list(cells.values())
        names = list(dict.fromkeys(n for r in runs for n in r if isinstance(r[n], dict)))
        names = [n for n in names if n != "fastai"] + ["fastai"] * ("fastai" in names)
        print_tables(runs, names)
        if args.out:
            summaries = {n: summary(runs, n) for n in names if n != "fastai"}
            args.out.write_text(json.dumps({"summary": summaries, "runs": runs}, indent=1))
        return
    import torch
    from finetune_bench import ROOT, make_project, sh

    contenders = ({} if args.no_defaults else {"visionflow": {}}) | dict(args.variant)
    families = args.families.split(",")
    weights = {arch: weights_file(args.weights_cache, arch) for arch in families}
    tmp = Path(tempfile.mkdtemp(prefix="fastai-peer-bench-"))
    runs = []
    try:
        project = tmp / "project"
        make_project(project)
        shutil.copy2(project / "params.yaml", project / "params.yaml.base")
        saved = {arch: torch.load(path, weights_only=True) for arch, path in weights.items()}
        for arch, data in saved.items():
            torch.save(data["state_dict"], project / f"data/pretrained/{arch}.pth")
            print(f"pretrained {arch}: {data['report']}", flush=True)
        for task in args.tasks.split(","):
            make_task(project / "data" / task, task)
        sh(project, "git", "add", "-A")
        sh(project, "git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "tasks")
        for task in args.tasks.split(","):
            for seed in seeds(args.seeds):
                for arch in families:
                    common = {"model": arch, "pretrained": f"data/pretrained/{arch}.pth"}
                    common |= {"epochs": args.epochs, "batch_size": args.batch_size}
                    common |= {"device": "cpu"}
                    set_params(project, task, seed, common)
                    sh(project, "dvc", "repro", "sanity")  # prepare: the split, outside timings
                    split = tmp / "split"
                    classes = export_split(project, split)
                    cell = {"task": task, "family": arch, "seed": seed, "classes": classes}
                    names = list(contenders) + ([] if args.no_fastai else ["fastai"])
                    names = names[seed % len(names) :] + names[: seed % len(names)]  # rotated
                    for name in names:
                        if name == "fastai":
                            classes_w = saved[arch]["report"]["classes"]
                            cell[name] = fastai_cell(
                                args, split, arch, project / f"data/pretrained/{arch}.pth",
                                classes_w, seed,
                            )  # fmt: skip
                        else:
                            set_params(project, task, seed, common | contenders[name])
                            tag = f"{task}-{arch}-{seed}-{name}"
                            cell[name] = visionflow_run(project, args.keep_models, tag)
                        short = {k: v for k, v in cell[name].items() if k != "correct"}
                        print(f"{task} {arch} seed {seed} {name}: {short}", flush=True)
                    runs.append(cell)
                    if args.out:
                        write(args, runs, saved, ROOT)
        print_tables(runs, [*contenders, *([] if args.no_fastai else ["fastai"])])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write(args, runs: list[dict], saved: dict, root: Path) -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    names = {n for r in runs for n in r if isinstance(r[n], dict)} - {"fastai"}
    data = {
        "commit": commit,
        "args": {k: str(v) for k, v in vars(args).items()},
        "pretrained": {arch: d["report"] for arch, d in saved.items()},
        "summary": {n: summary(runs, n) for n in names} if any("fastai" in r for r in runs) else {},
        "runs": runs,
    }
    args.out.write_text(json.dumps(data, indent=1, default=str))


if __name__ == "__main__":
    main()
