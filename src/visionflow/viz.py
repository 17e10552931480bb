"""Pictures people would rather look at than read: the label grid."""

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def pick_per_class(labels: np.ndarray, num_classes: int, k: int) -> list[np.ndarray]:
    """The first `k` indices of each class (fewer when a class has fewer)."""
    return [np.flatnonzero(labels == c)[:k] for c in range(num_classes)]


def label_grid(images: np.ndarray, labels: np.ndarray, classes: list[str], k: int):
    """One row per class of `k` images (float NCHW in 0..1), each row titled with its class name."""
    rows = pick_per_class(labels, len(classes), k)
    fig, axes = plt.subplots(
        len(classes), k, figsize=(k * 0.9 + 1.2, len(classes) * 0.9), squeeze=False
    )
    for row, (name, index) in enumerate(zip(classes, rows, strict=True)):
        for col in range(k):
            ax = axes[row, col]
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_visible(False)
            if col < len(index):
                image = images[index[col]].transpose(1, 2, 0)
                ax.imshow(
                    image.squeeze(-1) if image.shape[-1] == 1 else image,
                    cmap="gray",
                    vmin=0,
                    vmax=1,
                    interpolation="nearest",
                )
        axes[row, 0].set_ylabel(name, rotation=0, ha="right", va="center", fontsize=9)
    fig.suptitle("train split as the model sees it (de-normalised), one row per class")
    fig.tight_layout()
    return fig
