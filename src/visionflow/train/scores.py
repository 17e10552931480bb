"""Test-set scores from logits: accuracy, top-k, F1 (macro, weighted), per-class P/R/F1, and
the classes the test set lacks.

Computed from the confusion matrix with NumPy: the same numbers as scikit-learn's
`precision_recall_fscore_support(..., zero_division=0)` and `confusion_matrix` (tests/test_models_engine.py
holds them equal), without importing scikit-learn, which cost the evaluate stage a third of its
start (docs/benchmarks.md, "Numbers that were code comments").
"""

import numpy as np
import torch


def classification_scores(
    y: torch.Tensor, logits: torch.Tensor, classes: list[str], k: int
) -> dict:
    labels = list(range(len(classes)))
    predicted = logits.argmax(1).numpy()
    truth = y.numpy()
    top = logits.topk(min(k, len(classes)), dim=1).indices.numpy()
    counts = confusion_matrix(truth, predicted, len(labels))
    hits, support, said = np.diag(counts), counts.sum(axis=1), counts.sum(axis=0)
    p, r = share(hits, said), share(hits, support)
    f = share(2 * hits, support + said)  # 2PR / (P + R), as scikit-learn computes it
    return {
        "accuracy": float((predicted == truth).mean()),
        "top_k": k,
        "top_k_accuracy": float((top == truth[:, None]).any(axis=1).mean()),
        "macro_f1": float(f.mean()),
        "weighted_f1": float(np.average(f, weights=support) if support.sum() else 0.0),
        "per_class": {
            name: {
                "precision": float(p[i]),
                "recall": float(r[i]),
                "f1": float(f[i]),
                "support": int(support[i]),
            }
            for i, name in enumerate(classes)
        },
        # no image in `y`: accuracy says nothing of them, and macro F1 counts each as 0
        "classes_absent_from_test": [c for i, c in enumerate(classes) if not support[i]],
    }


def share(part: np.ndarray, whole: np.ndarray) -> np.ndarray:
    """part / whole, 0 where whole is 0 (scikit-learn's zero_division=0)."""
    return np.divide(part, whole, out=np.zeros(len(part)), where=whole != 0)


def confusion_matrix(truth: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts, rows = true class, columns = predicted class."""
    flat = np.bincount(truth * num_classes + predicted, minlength=num_classes**2)
    return flat.reshape(num_classes, num_classes)


def confusion(y: torch.Tensor, logits: torch.Tensor, num_classes: int) -> np.ndarray:
    return confusion_matrix(y.numpy(), logits.argmax(1).numpy(), num_classes)


def most_confident_mistakes(y: torch.Tensor, logits: torch.Tensor, n: int) -> np.ndarray:
    """Indices of up to n wrong predictions, the most confident first."""
    probs = torch.softmax(logits, dim=1)
    confidence, predicted = probs.max(dim=1)
    wrong = torch.nonzero(predicted != y).flatten()
    order = torch.argsort(confidence[wrong], descending=True, stable=True)
    return wrong[order][:n].numpy()


def top_losses(y: torch.Tensor, logits: torch.Tensor, n: int) -> tuple[np.ndarray, torch.Tensor]:
    """Indices of the n test images with the highest loss (right or wrong), the highest first,
    and every image's cross-entropy loss."""
    losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    order = torch.argsort(losses, descending=True, stable=True)
    return order[:n].numpy(), losses


def most_confused(counts: np.ndarray, classes: list[str]) -> list[dict]:
    """The (actual, predicted) class pairs the model confused, the most often first (ties in
    class order), as fastai's `most_confused`: one record per pair seen at least once."""
    pairs = [(int(counts[a, p]), a, p) for a, p in np.ndindex(counts.shape) if a != p]
    found = sorted((pair for pair in pairs if pair[0]), key=lambda pair: -pair[0])
    return [
        {"pair": f"{classes[a]} -> {classes[p]}", "actual": classes[a], "predicted": classes[p]}
        | {"count": n}
        for n, a, p in found
    ]
