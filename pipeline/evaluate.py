"""Stage evaluate: how good the model is on the test split, and where it fails.

Reads:  params.yaml (evaluate.*); the model from train; the cache from prepare
Writes: <out>/metrics.json (what `dvc metrics` compares: accuracy, macro F1, top-k accuracy,
        loss; with evaluate.tta, tta_acc beside them; absent_classes when the test split lacks
        a class), scores.json (all of it, with per-class P/R/F1/support, the classes the test
        split lacks, named in the log too, and the test-time augmented scores under `tta`),
        predictions.json (actual vs predicted class and the file, per image: `dvc plots`
        confusion template), confusion.png (row-normalised, class names), misclassified.png
        (the most confidently wrong images with true and predicted labels and their files),
        top_losses.png (the highest-loss images: predicted / actual / loss / probability /
        file), most_confused.json (class pairs confused, the most often first)
Run:    python -m pipeline.evaluate --model results/train/model.pt --data data/prepared --out results/evaluate
"""

import argparse
from pathlib import Path

import torch

from pipeline import GateError, run, staged
from visionflow.data import dataset
from visionflow.deploy import viz
from visionflow.params import load_params
from visionflow.train import loading, scores, tta
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
    if p.tta:
        metrics["tta"] = tta_scores(model, meta, x, y, mean, std, p.batch_size, classes, p.top_k)

    absent = metrics["classes_absent_from_test"]  # scored anyway, as scikit-learn does
    out = staged(args.out)  # moved to args.out when the stage succeeds
    dataset.write_json(out / "scores.json", metrics)
    summary = {  # short names, so that `dvc exp show` stays narrow
        "accuracy": metrics["accuracy"],
        "macro_f1": metrics["macro_f1"],
        "top_k_acc": metrics["top_k_accuracy"],
        "loss": metrics["loss"],
        **({"tta_acc": metrics["tta"]["accuracy"]} if p.tta else {}),
        **({"absent_classes": len(absent)} if absent else {}),  # said only when some are
    }
    dataset.write_json(out / "metrics.json", summary)
    predicted = logits.argmax(1).tolist()
    # each image's file (its path under the image folder; `#i` for a built-in source)
    files = dataset.read_names(args.data, "test") or [f"test#{i}" for i in range(len(y))]
    dataset.write_json(
        out / "predictions.json",
        [
            {"actual": classes[a], "predicted": classes[b], "file": name}
            for a, b, name in zip(y.tolist(), predicted, files, strict=True)
        ],
    )
    counts = scores.confusion(y, logits, len(classes))
    viz.confusion_figure(counts, classes).savefig(out / "confusion.png", dpi=100)
    dataset.write_json(out / "most_confused.json", scores.most_confused(counts, classes))
    failures(out, x, y, logits, classes, files, (mean, std), p)
    print(
        f"evaluate: test accuracy {metrics['accuracy']:.4f}, top-{p.top_k} "
        f"{metrics['top_k_accuracy']:.4f}, macro F1 {metrics['macro_f1']:.4f}, "
        f"loss {metrics['loss']:.4f} on {len(y)} images"
        + (
            f"; with TTA ({metrics['tta']['views']}) {metrics['tta']['accuracy']:.4f}"
            if p.tta
            else ""
        )
    )
    say_absent(absent)


def failures(out: Path, x, y, logits, classes: list[str], files: list[str], norm, p) -> None:
    """misclassified.png (the most confidently wrong test images) and top_losses.png (the
    highest-loss ones, right or wrong), each image titled with its classes and its file."""
    predicted = logits.argmax(1).tolist()
    wrong = scores.most_confident_mistakes(y, logits, p.misclassified)
    probability = torch.softmax(logits, 1).max(1).values
    viz.mistakes_grid(
        as_seen(x[wrong], *norm),
        [classes[i] for i in y[wrong].tolist()],
        [classes[predicted[i]] for i in wrong],
        probability[wrong].tolist(),
        [files[i] for i in wrong],
    ).savefig(out / "misclassified.png", dpi=100)
    worst, losses = scores.top_losses(y, logits, p.top_losses)
    viz.top_losses_grid(
        as_seen(x[worst], *norm),
        [classes[predicted[i]] for i in worst],
        [classes[i] for i in y[worst].tolist()],
        losses[worst].tolist(),
        probability[worst].tolist(),
        [files[i] for i in worst],
    ).savefig(out / "top_losses.png", dpi=100)


def say_absent(classes: list[str]) -> None:
    """One log line naming the classes the test split lacks, if any: scored, never silently."""
    if classes:
        named = f"class{'es' if len(classes) > 1 else ''} {', '.join(map(repr, classes))}"
        print(
            f"evaluate: warning: no test image of {named}: the accuracy says nothing of it, "
            "and macro F1 counts it as 0 (scores.json: classes_absent_from_test)"
        )


def as_seen(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor):
    """uint8 NHWC images through the model's normalisation and back, for pictures."""
    return loading.from_model_input(loading.to_model_input(x, mean, std), mean, std).numpy()


def tta_scores(model, meta: dict, x, y, mean, std, batch_size: int, classes, k: int) -> dict:
    """The scores of the prediction averaged over the views the model's input allows (tta.py),
    and which views they were."""
    size = meta.get("network", {}).get("input_size", meta["image_size"])
    flip = meta.get("train", {}).get("hflip", False)
    chosen = tta.views(meta["image_size"], size, flip)
    log_probs = tta.tta_log_probs(model, x, mean, std, batch_size, chosen, size)
    crops = "centre + 4 corner crops" if len(chosen) > 1 + flip else "whole image"
    return {
        "views": f"{len(chosen)} views: {crops}{', mirrored' if flip else ''}",
        **scores.classification_scores(y, log_probs, classes, k),
        "loss": torch.nn.functional.nll_loss(log_probs, y).item(),
    }


if __name__ == "__main__":
    run(main)
