"""Benchmark: the train stage's loop vs a plain tutorial loop vs the bare compute ceiling.

Same data (scikit-learn digits at 32x32, the real 1,797 images), same model (SimpleCNN), same
batch size (64), same augmentation (random shift of 2 px and rotation of 10 degrees), same epochs,
side by side in one run:
  - plain:   a per-item Dataset returning PIL images with torchvision transforms, DataLoader with
             2 workers, fp32, NCHW: the way tutorials teach it
  - stage:   visionflow.engine.train_one_epoch: the uint8 cache held in memory, batches sliced,
             augmented and normalised as tensors, channels_last
  - ceiling: the same model stepping on one batch already in memory as a normalised tensor
Reports images/s, wall time to reach the target validation accuracy, and final accuracy. Each
loop runs with `--seeds` seeds, alternating, and the medians are reported: which epoch first
crosses the target moves with the seed, and one epoch more or less halves or doubles that time.

    .venv/bin/python bench/train_bench.py [--epochs 8] [--target 0.9] [--seeds 3] [--device cuda]
"""

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from visionflow import data
from visionflow.augment import augment
from visionflow.engine import evaluate, make_optimizer, train_one_epoch
from visionflow.models import build_model

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
    train_tf = transforms.Compose([
        transforms.RandomRotation(10), transforms.RandomCrop(SIZE, padding=2), transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])  # fmt: skip
    loader = DataLoader(PilImages(x, y, train_tf), batch_size=BATCH, shuffle=True, num_workers=2,
                        persistent_workers=True, pin_memory=DEVICE.type == "cuda")  # fmt: skip
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

    return run(model, epochs, target, xv, yv, mean, std,
               lambda: train_one_epoch(model, optimizer, xt, yt, m, s, BATCH, g, aug))  # fmt: skip


def run(model, epochs, target, xv, yv, mean, std, one_epoch):
    """Train `epochs` epochs; wall time of training only (validation excluded)."""
    trained, reached, accuracy = 0.0, None, 0.0
    for _ in range(epochs):
        start = time.perf_counter()
        one_epoch()
        sync()
        trained += time.perf_counter() - start
        metrics, _ = evaluate(model, torch.from_numpy(xv).to(DEVICE), torch.from_numpy(yv).to(DEVICE),
                              torch.tensor(mean, device=DEVICE), torch.tensor(std, device=DEVICE),
                              512)  # fmt: skip
        accuracy = metrics["accuracy"]
        if reached is None and accuracy >= target:
            reached = trained
    return trained, reached, accuracy


def ceiling(x, mean, std, steps):
    torch.manual_seed(0)
    model = build_model("simple_cnn", 1, 10, SIZE).to(DEVICE, memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = data.to_model_input(torch.from_numpy(x[:BATCH]).to(DEVICE),
                                torch.tensor(mean, device=DEVICE), torch.tensor(std, device=DEVICE))  # fmt: skip
    labels = torch.zeros(BATCH, dtype=torch.long, device=DEVICE)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.9, help="validation accuracy to reach")
    parser.add_argument("--seeds", type=int, default=3, help="runs of each loop (medians reported)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.set_num_threads(2)
    source = data.load_source("digits", None)
    decode = data.Decode(SIZE, "grayscale")
    pixels = np.stack([data.to_pixels(image, decode) for image in source.images])
    splits = data.split_indices(source.labels, 0.15, 0.2, 0)
    x, y = pixels[splits["train"]], source.labels[splits["train"]]
    xv, yv = pixels[splits["val"]], source.labels[splits["val"]]
    mean, std = data.channel_stats(x)

    loops = {"plain tutorial loop": plain, "train stage loop": stage}
    runs, tops, images = {name: [] for name in loops}, [], len(x) * args.epochs
    for seed in range(args.seeds):  # interleaved, so a noisy spell hits every contender
        for name, loop in loops.items():
            runs[name].append(loop(x, y, xv, yv, mean, std, args.epochs, args.target, seed))
        tops.append(ceiling(x, mean, std, steps=images // BATCH))
    print(f"{len(x)} train images {SIZE}x{SIZE}, batch {BATCH}, {args.epochs} epochs, target val "
          f"accuracy {args.target}, {args.seeds} seeds (medians), {torch.get_num_threads()} threads, "
          f"{DEVICE}")  # fmt: skip
    print("| loop | images/s | seconds to target | final val accuracy |\n|---|---|---|---|")
    rate, to_target = {}, {}
    for name, results in runs.items():
        rate[name] = float(np.median([images / seconds for seconds, _, _ in results]))
        to_target[name] = float(np.median([r if r is not None else np.inf for _, r, _ in results]))
        accuracy = float(np.median([a for _, _, a in results]))
        shown = f"{to_target[name]:.2f}" if np.isfinite(to_target[name]) else "not reached"
        print(f"| {name} | {rate[name]:.0f} | {shown} | {accuracy:.4f} |")
    top = float(np.median(tops))
    print(f"| compute ceiling (one batch in memory) | {top:.0f} | | |")
    stage_rate, plain_rate = rate["train stage loop"], rate["plain tutorial loop"]
    print(f"stage / plain images/s: {stage_rate / plain_rate:.2f}x")
    print(f"stage / plain time to target: "
          f"{to_target['plain tutorial loop'] / to_target['train stage loop']:.2f}x")  # fmt: skip
    print(f"stage / ceiling images/s: {stage_rate / top:.2f}")
    print(f"ceiling / plain images/s: {top / plain_rate:.2f}x")


if __name__ == "__main__":
    main()
