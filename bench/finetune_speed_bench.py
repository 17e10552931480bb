"""Benchmark: fine-tuning at 224 px, the train stage against the tutorial loop, side by side.

Generates `--images` camera-like JPEGs of 640x480 in 5 classes (bench/photos.py: smooth blocks at a
class's scale and colour cast, per-photo brightness and noise), and a "pretrained" file in
torchvision's layout (`mobilenet_v3_small`, 1000-class head, random weights: this measures speed,
not accuracy). Then, in a temporary copy of the project, `dvc repro sanity` prepares the cache at
256 px (`prepare.image_size` 256: the network gets ImageNet's 224 px centre crop), once, timed.
Each round runs both contenders as fresh processes, in an order that rotates:
  - stage: `python -m pipeline.train` as `dvc repro` runs it (its resumable state removed first,
           so it trains): `train.model: mobilenet_v3_small`, `train.pretrained` the file,
           `train.freeze_epochs: 0` (the whole network trains, as in the tutorial), random resized
           crops of 224 and flips on the device from the uint8 cache in memory, channels_last,
           fused Adam; validation each epoch on the centre crop
  - plain: the tutorial way, on the same photos and the same number of train and val images:
           `ImageFolder` + `transforms` (RandomResizedCrop 224, RandomHorizontalFlip, ToTensor,
           Normalize; val: Resize 256, CenterCrop 224) + `DataLoader` (2 workers), the same file
           loaded into `mobilenet_v3_small` with a new 5-class head, Adam, fp32, NCHW;
           validation each epoch
Same batch size, learning rate and epochs. Reports each epoch's training images/s (the stage's from
its own curves, `train/images_per_s`; the plain loop's timed the same way, the data wait included)
and each process's wall and CPU time (its children included: the plain loop's workers).

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python bench/finetune_speed_bench.py [--images 300] [--epochs 2] [--rounds 3]

Both contenders run under the caller's environment: with OMP_NUM_THREADS=1 each computes on one
thread (on 2 cores shared with other work, torch's two threads spin against each other).
"""

import argparse
import csv
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from photos import generate  # bench/ is on sys.path: these run as scripts
from project_files import FILES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARCH, CLASSES = "mobilenet_v3_small", 5
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def env_for(project: Path) -> dict:
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(project / "src"),
        "DVC_NO_ANALYTICS": "1",
    }


def timed(command: list[str], cwd: Path, env: dict) -> tuple[float, float, str]:
    """(wall s, CPU s, stdout) of a fresh process and everything it started."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}\n{result.stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, result.stdout


def make_project(dest: Path, photos: Path, args) -> None:
    """A committed git + DVC copy of the project, its params pointing at the photos."""
    for name in FILES:
        src, target = ROOT / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, target)
    params = yaml.safe_load((dest / "params.yaml").read_text())
    params["prepare"] |= {
        "source": "imagefolder",
        "path": str(photos),
        "image_size": 256,
        "color": "rgb",
    }
    params["train"] |= {
        "model": ARCH,
        "pretrained": "data/pretrained/mnv3.pth",
        "device": "cpu",
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": 1e-3,
        "augment": {"crop_padding": 0, "hflip": True, "rotation": 0.0, "color_jitter": 0.0},
    }
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    torch.manual_seed(0)  # "pretrained": any weights in torchvision's layout, 1000 classes
    from torchvision.models import get_model

    torch.save(get_model(ARCH).state_dict(), dest / "data/pretrained/mnv3.pth")
    env = env_for(dest)
    for cmd in (
        ["git", "init", "-q", "-b", "main"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "init"],
    ):
        subprocess.run(cmd, cwd=dest, env=env, check=True, capture_output=True)


def stage_run(project: Path) -> dict:
    shutil.rmtree(project / "checkpoints/train", ignore_errors=True)  # train, do not resume
    shutil.rmtree(project / "results/train", ignore_errors=True)
    command = [sys.executable, "-m", "pipeline.train", "--data", "data/prepared"]
    command += ["--out", "results/train", "--checkpoints", "checkpoints/train"]
    wall, cpu, _ = timed(command, project, env_for(project))
    curve = project / "results/train.timings/plots/metrics/train/images_per_s.tsv"
    with open(curve) as f:
        per_epoch = [float(row["images_per_s"]) for row in csv.DictReader(f, delimiter="\t")]
    return {"wall_s": wall, "cpu_s": cpu, "images_per_s": per_epoch}


def plain_run(project: Path, photos: Path, args) -> dict:
    counts = json.loads((project / "data/prepared/manifest.json").read_text())["counts"]
    n_train, n_val = sum(counts["train"].values()), sum(counts["val"].values())
    command = [sys.executable, __file__, "--child", str(photos), str(n_train), str(n_val)]
    command += [str(project / "data/pretrained/mnv3.pth")]
    command += ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
    wall, cpu, out = timed(command, project, env_for(project))
    return {"wall_s": wall, "cpu_s": cpu, "images_per_s": json.loads(out.splitlines()[-1])}


def plain(photos: Path, n_train: int, n_val: int, weights: Path, epochs: int, batch: int) -> None:
    """The tutorial loop (a child process); prints each epoch's training images/s as JSON."""
    from torch import nn
    from torch.utils.data import DataLoader, Subset
    from torchvision import datasets, transforms
    from torchvision.models import get_model

    torch.manual_seed(0)
    train_tf = transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )
    val_tf = transforms.Compose(
        [
            transforms.Resize(256),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )
    order = torch.randperm(len(datasets.ImageFolder(photos))).tolist()
    train_set = Subset(datasets.ImageFolder(photos, train_tf), order[:n_train])
    val_set = Subset(datasets.ImageFolder(photos, val_tf), order[n_train : n_train + n_val])
    loaders = {
        "train": DataLoader(train_set, batch_size=batch, shuffle=True, num_workers=2),
        "val": DataLoader(val_set, batch_size=batch, num_workers=2),
    }
    model = get_model(ARCH)
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.classifier[3] = nn.Linear(model.classifier[3].in_features, CLASSES)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    rates = []
    for _ in range(epochs):
        model.train()
        started, seen = time.perf_counter(), 0
        for x, y in loaders["train"]:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            seen += len(y)
        rates.append(seen / (time.perf_counter() - started))
        model.eval()
        with torch.no_grad():
            correct = sum((model(x).argmax(1) == y).sum().item() for x, y in loaders["val"])
        print(f"val accuracy {correct / n_val:.3f}", file=sys.stderr)
    print(json.dumps(rates))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        photos, n_train, n_val, weights = args.child
        plain(Path(photos), int(n_train), int(n_val), Path(weights), args.epochs, args.batch_size)
        return
    tmp = Path(tempfile.mkdtemp(prefix="finetune-speed-bench-"))
    try:
        photos = tmp / "photos"
        started = time.perf_counter()
        generate(photos, args.images, CLASSES, size=(640, 480))
        print(
            f"{args.images} photos generated in {time.perf_counter() - started:.0f} s", flush=True
        )
        project = tmp / "project"
        make_project(project, photos, args)
        env = env_for(project)
        subprocess.run(["cat", *photos.rglob("*.jpg")], stdout=subprocess.DEVNULL, check=True)
        prepare = timed([sys.executable, "-m", "dvc", "repro", "sanity"], project, env)[:2]
        counts = json.loads((project / "data/prepared/manifest.json").read_text())["counts"]
        print(f"dvc repro sanity (prepare at 256 px, then sanity): {prepare[0]:.1f} s; {counts}")
        contenders = {
            "stage": lambda: stage_run(project),
            "plain": lambda: plain_run(project, photos, args),
        }
        runs = {name: [] for name in contenders}
        for r in range(args.rounds):
            names = list(contenders)
            names = names[r % len(names) :] + names[: r % len(names)]
            for name in names:
                result = contenders[name]()
                runs[name].append(result)
                rates = ", ".join(f"{v:.1f}" for v in result["images_per_s"])
                print(
                    f"round {r + 1} {name:5s}: wall {result['wall_s']:.1f} s, CPU "
                    f"{result['cpu_s']:.1f} s, images/s per epoch {rates}",
                    flush=True,
                )
        report(runs, counts, prepare, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(runs: dict, counts: dict, prepare: tuple, args) -> None:
    print("\n| contender | images/s, epoch 1 | images/s, later epochs | wall s | CPU s |")
    print("|---|---|---|---|---|")
    medians = {}
    for name, results in runs.items():
        first = statistics.median(r["images_per_s"][0] for r in results)
        later = [v for r in results for v in r["images_per_s"][1:]]
        later = statistics.median(later) if later else math.nan
        wall = statistics.median(r["wall_s"] for r in results)
        cpu = statistics.median(r["cpu_s"] for r in results)
        medians[name] = {"first": first, "later": later, "wall": wall, "cpu": cpu}
        print(f"| {name} | {first:.1f} | {later:.1f} | {wall:.1f} | {cpu:.1f} |")
    per_round = [
        (
            statistics.mean(s["images_per_s"]) / statistics.mean(p["images_per_s"]),
            p["wall_s"] / s["wall_s"],
        )
        for s, p in zip(runs["stage"], runs["plain"], strict=True)
    ]
    print(
        "stage / plain, images/s (mean of epochs) per round: "
        + ", ".join(f"{a:.2f}x" for a, _ in per_round)
        + "; wall time plain / stage per round: "
        + ", ".join(f"{b:.2f}x" for _, b in per_round)
    )
    if args.out:
        args.out.write_text(
            json.dumps(
                {"runs": runs, "counts": counts, "prepare_s": prepare, "args": vars(args)},
                default=str,
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
