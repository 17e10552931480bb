"""Stage evaluate: how good the model is on the test split, and where it fails.

Reads:  params.yaml (evaluate.*); the model from train; the cache from prepare
Writes: <out>/metrics.json (what `dvc metrics` compares: accuracy, macro F1, top-k accuracy,
        loss), scores.json (all of it, with per-class P/R/F1/support), predictions.json (actual
        vs predicted class per image: `dvc plots` confusion template), confusion.png (row-normalised, class names), misclassified.png (the most
        confidently wrong images with true and predicted labels)
Run:    python -m pipeline.evaluate --model results/train/model.pt --data data/prepared --out results/evaluate
"""

import argparse
from pathlib import Path

import torch

from pipeline import GateError, run, staged
from visionflow.data import dataset
from visionflow.deploy import viz
from visionflow.params import load_params
from visionflow.train import loading, scores
from visionflow.train.engine import evaluate
from visionflow.train.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description="Score the model on the test split.")
    parser.add_argument("--model", type=Path, required=True, help="model.pt from train")
    parser.add_argument("--data", type=Path, required=True, help="cache folder from prepare")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    args = parser.parse_args()
    p = load_params().evaluate

    model, meta = load_model(args.model, map_location="cpu")
    dataset.verify_cache(args.data)
    classes = dataset.read_cache_meta(args.data).classes
    if len(classes) != len(meta["classes"]) or classes != meta["classes"]:
        raise GateError(
            f"the model has {len(meta['classes'])} classes {meta['classes']}, but the "
            f"cache's classes.json has {len(classes)}: {classes}"
        )
    x, y = (torch.from_numpy(a) for a in dataset.read_split(args.data, "test"))
    mean, std = torch.tensor(meta["mean"]), torch.tensor(meta["std"])
    loss_accuracy, logits = evaluate(model, x, y, mean, std, p.batch_size)
    metrics = {
        **scores.classification_scores(y, logits, classes, p.top_k),
        "loss": loss_accuracy["loss"],
        "images": len(y),
    }

    out = staged(args.out)  # moved to args.out when the stage succeeds
    dataset.write_json(out / "scores.json", metrics)
    summary = {  # short names, so that `dvc exp show` stays narrow
        "accuracy": metrics["accuracy"],
        "macro_f1": metrics["macro_f1"],
        "top_k_acc": metrics["top_k_accuracy"],
        "loss": metrics["loss"],
    }
    dataset.write_json(out / "metrics.json", summary)
    predicted = logits.argmax(1).tolist()
    dataset.write_json(
        out / "predictions.json",
        [
            {"actual": classes[a], "predicted": classes[b]}
            for a, b in zip(y.tolist(), predicted, strict=True)
        ],
    )
    viz.confusion_figure(scores.confusion(y, logits, len(classes)), classes).savefig(
        out / "confusion.png", dpi=100
    )
    wrong = scores.most_confident_mistakes(y, logits, p.misclassified)
    confidence = torch.softmax(logits, 1).max(1).values
    shown = loading.from_model_input(loading.to_model_input(x[wrong], mean, std), mean, std).numpy()
    viz.mistakes_grid(
        shown,
        [classes[i] for i in y[wrong].tolist()],
        [classes[predicted[i]] for i in wrong],
        confidence[wrong].tolist(),
    ).savefig(out / "misclassified.png", dpi=100)
    print(
        f"evaluate: test accuracy {metrics['accuracy']:.4f}, top-{p.top_k} "
        f"{metrics['top_k_accuracy']:.4f}, macro F1 {metrics['macro_f1']:.4f}, "
        f"loss {metrics['loss']:.4f} on {len(y)} images"
    )


if __name__ == "__main__":
    run(main)
