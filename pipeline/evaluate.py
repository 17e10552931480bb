"""Stage evaluate: score the trained model on the test split.

Reads:  the model from train; the cache from prepare
Writes: <out>/metrics.json (test accuracy, loss), <out>/predictions.json (actual vs predicted class
        per test image, drawn by `dvc plots` as a confusion matrix)
Run:    python -m pipeline.evaluate --model results/train/model.pt --data data/prepared --out results/evaluate
"""

import argparse
from pathlib import Path

import torch

from pipeline import GateError, run
from visionflow import data
from visionflow.engine import evaluate
from visionflow.models import load_model
from visionflow.params import load_params


def main() -> None:
    parser = argparse.ArgumentParser(description="Score the model on the test split.")
    parser.add_argument("--model", type=Path, required=True, help="model.pt from train")
    parser.add_argument("--data", type=Path, required=True, help="cache folder from prepare")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    args = parser.parse_args()
    params = load_params()

    model, meta = load_model(args.model, map_location="cpu")
    classes = data.read_cache_meta(args.data).classes
    if classes != meta["classes"]:
        raise GateError(
            f"the model knows {len(meta['classes'])} classes {meta['classes']}, "
            f"the cache's classes.json has {len(classes)}: {classes}"
        )
    x, y = (torch.from_numpy(a) for a in data.read_split(args.data, "test"))
    mean, std = torch.tensor(meta["mean"]), torch.tensor(meta["std"])
    metrics, predicted = evaluate(model, x, y, mean, std, params.evaluate.batch_size)

    args.out.mkdir(parents=True, exist_ok=True)
    data.write_json(args.out / "metrics.json", {**metrics, "images": len(y)})
    pairs = [
        {"actual": classes[a], "predicted": classes[p]}
        for a, p in zip(y.tolist(), predicted.tolist(), strict=True)
    ]
    data.write_json(args.out / "predictions.json", pairs)
    print(
        f"evaluate: test accuracy {metrics['accuracy']:.4f}, loss {metrics['loss']:.4f} "
        f"on {len(y)} images"
    )


if __name__ == "__main__":
    run(main)
