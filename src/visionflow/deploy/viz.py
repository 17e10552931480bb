"""Pictures people would rather look at than read: the label grid, the confusion matrix, the
misclassified and highest-loss test images, the class counts."""

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def show(ax, image: np.ndarray) -> None:
    """One float CHW image in 0..1, pixels as they are (no smoothing), gray when 1 channel."""
    image = image.transpose(1, 2, 0)
    pixels = image.squeeze(-1) if image.shape[-1] == 1 else image
    ax.imshow(pixels, cmap="gray", vmin=0, vmax=1, interpolation="nearest")


def pick_per_class(labels: np.ndarray, num_classes: int, k: int) -> list[np.ndarray]:
    """The first `k` indices of each class (fewer when a class has fewer)."""
    return [np.flatnonzero(labels == c)[:k] for c in range(num_classes)]


def label_grid(images: np.ndarray, labels: np.ndarray, classes: list[str], k: int):
    """One row per class of `k` images (float NCHW in 0..1), each row named by its class: one
    mosaic in one axes (an axes per image made drawing most of the sanity stage's time)."""
    rows = pick_per_class(labels, len(classes), k)
    channels, height, width = images.shape[1:]
    gap = max(1, height // 8)  # white between the images
    mosaic = np.ones((len(classes) * (height + gap), k * (width + gap), channels))
    for row, index in enumerate(rows):
        for col, i in enumerate(index[:k]):
            top, left = row * (height + gap), col * (width + gap)
            mosaic[top : top + height, left : left + width] = images[i].transpose(1, 2, 0)
    fig, ax = plt.subplots(figsize=(k * 0.9 + 1.2, len(classes) * 0.9))
    pixels = mosaic[:-gap, :-gap]
    ax.imshow(pixels.squeeze(-1) if channels == 1 else pixels, cmap="gray", vmin=0, vmax=1,
              interpolation="nearest")  # fmt: skip
    centres = [row * (height + gap) + (height - 1) / 2 for row in range(len(classes))]
    ax.set_yticks(centres, classes, fontsize=9)
    ax.set_xticks([])
    ax.tick_params(left=False)
    for spine in ax.spines.values():
        spine.set_visible(False)
    fig.suptitle("train split as the model sees it (de-normalised), one row per class")
    fig.tight_layout()
    return fig


def confusion_figure(counts: np.ndarray, classes: list[str]):
    """Row-normalised confusion matrix (each row sums to 1: the recall of that class)."""
    rows = counts.sum(axis=1, keepdims=True)
    share = np.divide(counts, rows, out=np.zeros(counts.shape), where=rows > 0)
    size = max(4.0, 0.45 * len(classes) + 2)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    image = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(len(classes)), classes, rotation=90 if len(classes) > 10 else 0)
    ax.set_yticks(range(len(classes)), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if len(classes) <= 20:
        for i, j in np.ndindex(share.shape):
            if counts[i, j]:
                ax.text(
                    j,
                    i,
                    f"{share[i, j]:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if share[i, j] > 0.5 else "black",
                )
    fig.colorbar(image, ax=ax, fraction=0.046, label="share of the true class")
    ax.set_title("test confusion matrix (row-normalised)")
    fig.tight_layout()
    return fig


def mistakes_grid(
    images: np.ndarray, truth: list[str], predicted: list[str], confidence: list[float]
):
    """Misclassified images (float NCHW in 0..1), each titled true / predicted (confidence)."""
    titles = [
        f"true {actual}\npred {guess} ({prob:.2f})"
        for actual, guess, prob in zip(truth, predicted, confidence, strict=True)
    ]
    return titled_grid(images, titles, "most confidently misclassified test images", "no mistakes")


def top_losses_grid(
    images: np.ndarray,
    predicted: list[str],
    truth: list[str],
    losses: list[float],
    probs: list[float],
):
    """The highest-loss images (float NCHW in 0..1), each titled as fastai's `plot_top_losses`:
    predicted / actual / loss / the predicted class's probability."""
    titles = [
        f"{guess} / {actual}\n{loss:.2f} / {prob:.2f}"
        for guess, actual, loss, prob in zip(predicted, truth, losses, probs, strict=True)
    ]
    title = "highest-loss test images: predicted / actual, loss / probability"
    return titled_grid(images, titles, title, "no test images")


def titled_grid(images: np.ndarray, titles: list[str], title: str, empty: str):
    """Images (float NCHW in 0..1) in rows of 8, each with its title; `empty` when none."""
    n = max(len(images), 1)
    cols = min(n, 8)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 1.5, rows * 2.0), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, words in zip(axes.flat, images, titles, strict=False):
        show(ax, image)
        ax.set_title(words, fontsize=7)
    if not len(images):
        axes[0, 0].text(0.5, 0.5, empty, ha="center", va="center")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def counts_figure(counts: dict[str, dict[str, int]]):
    """Images per class, one group of bars per class, one colour per split."""
    classes = list(next(iter(counts.values())))
    width = 0.8 / len(counts)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.5 * len(classes) + 2), 4.0))
    for i, (split, per_class) in enumerate(counts.items()):
        positions = np.arange(len(classes)) + (i - (len(counts) - 1) / 2) * width
        ax.bar(
            positions,
            [per_class[c] for c in classes],
            width,
            label=f"{split} ({sum(per_class.values())})",
        )
    ax.set_xticks(range(len(classes)), classes, rotation=90 if len(classes) > 12 else 0)
    ax.set_ylabel("images")
    ax.set_title("images per class and split")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(counts), frameon=False)
    fig.tight_layout()
    return fig
