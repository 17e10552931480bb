"""Stage train: fit the model on the cached train split, keep the best by validation accuracy.

Reads:  params.yaml (seed, train.*); the cache from prepare; sanity's scan (train runs after the check)
Writes: <out>/model.pt (state_dict + meta, loads with weights_only=True), <out>/live/ (DVCLive curves)
Run:    python -m pipeline.train --data data/prepared --out results/train
"""

import argparse
import time
from functools import partial
from pathlib import Path

import torch
from dvclive import Live

from pipeline import run
from visionflow import data
from visionflow.augment import augment
from visionflow.engine import evaluate, pick_device, train_one_epoch
from visionflow.models import build_model, save_model
from visionflow.params import load_params


def main() -> None:
    parser = argparse.ArgumentParser(description="Train on the cached train split.")
    parser.add_argument("--data", type=Path, required=True, help="cache folder from prepare")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    args = parser.parse_args()
    params = load_params()
    t = params.train

    torch.manual_seed(params.seed)
    device = pick_device(t.device)
    meta = data.read_cache_meta(args.data)
    x_train, y_train = (torch.from_numpy(a).to(device) for a in data.read_split(args.data, "train"))
    x_val, y_val = (torch.from_numpy(a).to(device) for a in data.read_split(args.data, "val"))
    mean, std = torch.tensor(meta.mean, device=device), torch.tensor(meta.std, device=device)
    channels, image_size = x_train.shape[3], x_train.shape[1]

    model = build_model(t.model, channels, len(meta.classes), image_size, t.dropout).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    shuffle = torch.Generator().manual_seed(params.seed)  # CPU generator: same order on any device
    augmentation = partial(augment, generator=shuffle, **t.augment.model_dump())
    model_meta = {  # plain values only, so the file loads with weights_only=True
        "model": t.model,
        "in_channels": channels,
        "image_size": image_size,
        "dropout": t.dropout,
        "classes": meta.classes,
        "mean": meta.mean,
        "std": meta.std,
        "background": meta.background,
    }
    print(
        f"train: {t.model} on {device}, {len(y_train)} train / {len(y_val)} val images, "
        f"{sum(p.numel() for p in model.parameters())} parameters"
    )

    best_accuracy = -1.0
    with Live(str(args.out / "live"), dvcyaml=False, save_dvc_exp=False, report=None) as live:
        for epoch in range(1, t.epochs + 1):
            start = time.perf_counter()
            train_metrics = train_one_epoch(
                model, optimizer, x_train, y_train, mean, std, t.batch_size, shuffle, augmentation
            )
            seconds = time.perf_counter() - start
            val_metrics, _ = evaluate(model, x_val, y_val, mean, std, t.batch_size)
            for name, value in train_metrics.items():
                live.log_metric(f"train/{name}", value)
            for name, value in val_metrics.items():
                live.log_metric(f"val/{name}", value)
            live.log_metric("lr", optimizer.param_groups[0]["lr"])
            live.log_metric("train/images_per_s", len(y_train) / seconds)
            live.log_metric("epoch_seconds", seconds)
            improved = val_metrics["accuracy"] > best_accuracy
            if improved:
                best_accuracy = val_metrics["accuracy"]
                save_model(
                    model,
                    {**model_meta, "epoch": epoch, "val_accuracy": best_accuracy},
                    args.out / "model.pt",
                )
            print(
                f"epoch {epoch:3d}/{t.epochs}  train loss {train_metrics['loss']:.4f} "
                f"acc {train_metrics['accuracy']:.4f}  val loss {val_metrics['loss']:.4f} "
                f"acc {val_metrics['accuracy']:.4f}  {len(y_train) / seconds:7.0f} img/s"
                + ("  (best, saved)" if improved else "")
            )
            live.next_step()
    print(f"train: best val accuracy {best_accuracy:.4f}; model in {args.out / 'model.pt'}")


if __name__ == "__main__":
    run(main)
