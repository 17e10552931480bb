"""Benchmark: the train stage's loop vs a plain tutorial loop vs the bare compute ceiling.

Same data (scikit-learn digits at 32x32, the real 1,797 images), same model (SimpleCNN), same
batch size (64), same augmentation (random shift of 2 px and rotation of 10 degrees), same epochs,
side by side in one run:
  - plain:   a per-item Dataset returning PIL images with torchvision transforms, DataLoader with
             2 workers, fp32, NCHW: the way tutorials teach it
  - stage:   visionflow.train.engine.train_one_epoch: the uint8 cache held in memory, batches sliced,
             augmented and normalised as tensors, channels_last, the stage's fused Adam
  - ceiling: the same model and optimizer as the stage, stepping on one batch already in memory
             as a normalised tensor: no data handling at all
Every run is a fresh Python process, so no contender inherits another's allocator state, threads
or caches. Reports images/s, wall time to reach the target validation accuracy, and final accuracy.
Each loop runs with `--seeds` seeds, alternating. Images/s and final accuracy are medians; the
epochs and seconds to the target are means: which epoch first crosses the target moves with the
seed by a whole epoch or two, and a median of such whole numbers jumps by a whole epoch between
runs. The run takes time in proportion to `--seeds`: docs/benchmarks.md ("train: the training
loop") records how long 40 took, and what they measured.

    .venv/bin/python bench/train_bench.py [--epochs 8] [--target 0.9] [--seeds 10] [--device cuda]
"""

import argparse
import json
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from visionflow.data import dataset, sources, splits
from visionflow.train import loading
from visionflow.train.augment import augment
from visionflow.train.engine import Split, Step, evaluate, make_optimizer, train_one_epoch
from visionflow.train.models import build_model

SIZE, BATCH = 32, 64
DEVICE = torch.device("cpu")  # --device


class PilImages(Dataset):
    def __init__(self, x: np.ndarray, y: np.ndarray, transform):
        self.x, self.y, self.transform = x, y, transform

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.transform(Image.fromarray(self.x[i, ..., 0], "L")), int(self.y[i])


def plain(x, y, xv, yv, mean, std, epochs, target, seed):
    torch.manual_seed(seed)
    model = build_model("simple_cnn", 1, 10, SIZE).to(DEVICE)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_tf = transforms.Compose(
        [
            transforms.RandomRotation(10),
            transforms.RandomCrop(SIZE, padding=2),
            transforms.ToTensor(),
            transforms.Normalize(mean, std),
        ]
    )
    loader = DataLoader(
        PilImages(x, y, train_tf),
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        pin_memory=DEVICE.type == "cuda",
    )
    return run(
        model, epochs, target, xv, yv, mean, std, lambda: plain_epoch(model, optimizer, loader)
    )


def plain_epoch(model, optimizer, loader):
    model.train()
    for images, labels in loader:
        images, labels = images.to(DEVICE, non_blocking=True), labels.to(DEVICE, non_blocking=True)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()


def stage(x, y, xv, yv, mean, std, epochs, target, seed):
    torch.manual_seed(seed)
    model = build_model("simple_cnn", 1, 10, SIZE).to(DEVICE, memory_format=torch.channels_last)
    optimizer = make_optimizer("adam", model, 1e-3, 0, 0, False)
    g = torch.Generator().manual_seed(seed)
    xt, yt = torch.from_numpy(x).to(DEVICE), torch.from_numpy(y).to(DEVICE)
    m, s = torch.tensor(mean, device=DEVICE), torch.tensor(std, device=DEVICE)

    def aug(images):
        return augment(images, g, crop_padding=2, rotation=10)

    return run(
        model,
        epochs,
        target,
        xv,
        yv,
        mean,
        std,
        lambda: train_one_epoch(model, optimizer, Split(xt, yt, m, s, g, augment=aug), Step(BATCH)),
    )


def run(model, epochs, target, xv, yv, mean, std, one_epoch):
    """Train `epochs` epochs -> training seconds (validation excluded), the seconds and epochs to
    the first epoch ending at `target` validation accuracy or above (None if none), final accuracy."""
    trained, reached, accuracy = 0.0, None, 0.0
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        one_epoch()
        sync()
        trained += time.perf_counter() - start
        metrics, _ = evaluate(
            model,
            torch.from_numpy(xv).to(DEVICE),
            torch.from_numpy(yv).to(DEVICE),
            torch.tensor(mean, device=DEVICE),
            torch.tensor(std, device=DEVICE),
            512,
        )
        accuracy = metrics["accuracy"]
        if reached is None and accuracy >= target:
            reached = trained, epoch
    return trained, reached, accuracy


def ceiling(x, mean, std, epochs):
    """images/s of bare steps on one normalised batch, as many as `epochs` epochs take."""
    torch.manual_seed(0)
    model = build_model("simple_cnn", 1, 10, SIZE).to(DEVICE, memory_format=torch.channels_last)
    optimizer = make_optimizer("adam", model, 1e-3, 0, 0, False)
    batch = loading.to_model_input(
        torch.from_numpy(x[:BATCH]).to(DEVICE),
        torch.tensor(mean, device=DEVICE),
        torch.tensor(std, device=DEVICE),
    )
    labels = torch.zeros(BATCH, dtype=torch.long, device=DEVICE)
    steps = len(x) * epochs // BATCH
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(batch), labels).backward()
        optimizer.step()
    sync()
    return steps * BATCH / (time.perf_counter() - start)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def digits() -> tuple[np.ndarray, ...]:
    """Train and validation split of the digits at SIZE, and the train statistics."""
    source = sources.load_source("digits", None)
    decode = dataset.Decode(SIZE, "grayscale")
    pixels = np.stack([dataset.to_pixels(image, decode) for image in source.images])
    parts = splits.split_indices(source.labels, 0.15, 0.2, 0)
    x, y = pixels[parts["train"]], source.labels[parts["train"]]
    xv, yv = pixels[parts["val"]], source.labels[parts["val"]]
    return x, y, xv, yv, *dataset.channel_stats(x)


def one(name: str, seed: int, epochs: int, target: float) -> dict:
    """One contender, one seed, in this process (the parent starts a fresh one for each)."""
    x, y, xv, yv, mean, std = digits()
    if name in ("plain", "stage"):
        loop = plain if name == "plain" else stage
        seconds, reached, accuracy = loop(x, y, xv, yv, mean, std, epochs, target, seed)
        return {
            "rate": len(x) * epochs / seconds,
            "accuracy": accuracy,
            "images": len(x),
            "seconds_to_target": reached[0] if reached else None,
            "epochs_to_target": reached[1] if reached else None,
        }
    return {"rate": ceiling(x, mean, std, epochs)}


def in_fresh_process(args, name: str, seed: int) -> dict:
    command = [
        sys.executable,
        __file__,
        "--one",
        name,
        "--seed",
        str(seed),
        "--epochs",
        str(args.epochs),
        "--target",
        str(args.target),
        "--device",
        args.device,
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{name} (seed {seed}) failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.9, help="validation accuracy to reach")
    parser.add_argument("--seeds", type=int, default=10, help="runs of each loop")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one contender, print JSON
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.set_num_threads(2)
    if args.one:
        print(json.dumps(one(args.one, args.seed, args.epochs, args.target)))
        return

    names = {
        "plain": "plain tutorial loop",
        "stage": "train stage loop",
        "ceiling": "compute ceiling (one batch in memory)",
    }
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for seed in range(args.seeds):  # interleaved, so a noisy spell hits every contender
        for name in names:
            runs[name].append(in_fresh_process(args, name, seed))
            print(f"seed {seed} {name}: {runs[name][-1]}", file=sys.stderr)
    print(
        f"{runs['stage'][0]['images']} train images {SIZE}x{SIZE}, batch {BATCH}, {args.epochs} epochs, target val "
        f"accuracy {args.target}, {args.seeds} seeds, {torch.get_num_threads()} threads, "
        f"{DEVICE}, a fresh process per run"
    )
    print(
        "| loop | images/s (median) | epochs to target (mean) | seconds to target (mean) | "
        "final val accuracy (median) |\n|---|---|---|---|---|"
    )
    rate, to_target = {}, {}
    for name, results in runs.items():
        rate[name] = float(np.median([r["rate"] for r in results]))
        if name == "ceiling":
            print(f"| {names[name]} | {rate[name]:.0f} | | | |")
            continue
        accuracy = float(np.median([r["accuracy"] for r in results]))
        reached = [r for r in results if r["seconds_to_target"] is not None]
        if len(reached) < len(results):  # a mean over the lucky runs would flatter the loop
            print(
                f"| {names[name]} | {rate[name]:.0f} | {len(results) - len(reached)} of "
                f"{len(results)} runs never reached it | | {accuracy:.4f} |"
            )
            continue
        to_target[name] = float(np.mean([r["seconds_to_target"] for r in results]))
        epochs = float(np.mean([r["epochs_to_target"] for r in results]))
        print(
            f"| {names[name]} | {rate[name]:.0f} | {epochs:.1f} | {to_target[name]:.2f} | "
            f"{accuracy:.4f} |"
        )
    print(f"stage / plain images/s: {rate['stage'] / rate['plain']:.2f}x")
    if len(to_target) == 2:
        print(f"stage / plain time to target: {to_target['plain'] / to_target['stage']:.2f}x")
    else:
        print("stage / plain time to target: not every run reached the target; raise --epochs")
    print(f"stage / ceiling images/s: {rate['stage'] / rate['ceiling']:.2f}")
    print(f"ceiling / plain images/s: {rate['ceiling'] / rate['plain']:.2f}x")
    for name in ("plain", "stage"):
        counts = Counter(r["epochs_to_target"] or args.epochs + 1 for r in runs[name])
        shown = ", ".join(
            f"{'never' if epoch > args.epochs else f'epoch {epoch}'}: {n}"
            for epoch, n in sorted(counts.items())
        )
        print(f"{names[name]}: runs first reaching the target at {shown}")


if __name__ == "__main__":
    main()
