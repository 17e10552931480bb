"""Test-set scores from logits: accuracy, top-k, F1 (macro, weighted), per-class P/R/F1."""

import numpy as np
import torch
from sklearn.metrics import confusion_matrix, precision_recall_fscore_support


def classification_scores(
    y: torch.Tensor, logits: torch.Tensor, classes: list[str], k: int
) -> dict:
    labels = list(range(len(classes)))
    predicted = logits.argmax(1).numpy()
    truth = y.numpy()
    top = logits.topk(min(k, len(classes)), dim=1).indices.numpy()
    p, r, f, support = precision_recall_fscore_support(
        truth, predicted, labels=labels, zero_division=0
    )
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
    }


def confusion(y: torch.Tensor, logits: torch.Tensor, num_classes: int) -> np.ndarray:
    """Counts, rows = true class, columns = predicted class."""
    return confusion_matrix(y.numpy(), logits.argmax(1).numpy(), labels=list(range(num_classes)))


def most_confident_mistakes(y: torch.Tensor, logits: torch.Tensor, n: int) -> np.ndarray:
    """Indices of up to n wrong predictions, the most confident first."""
    probs = torch.softmax(logits, dim=1)
    confidence, predicted = probs.max(dim=1)
    wrong = torch.nonzero(predicted != y).flatten()
    order = torch.argsort(confidence[wrong], descending=True, stable=True)
    return wrong[order][:n].numpy()
