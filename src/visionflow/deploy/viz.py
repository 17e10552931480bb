"""Pictures people would rather look at than read: the label grid, the confusion matrix, the
misclassified and highest-loss test images, the class counts."""

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.font_manager import FontProperties  # noqa: E402
from matplotlib.textpath import TextToPath  # noqa: E402

CELL_IN = 1.5  # width of one image's cell in a titled grid, inches
TITLE_PT = 7  # font size of an image's title
LINE_PT = 0.9 * CELL_IN * 72  # the widest title line, points: a gap stays between neighbours


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
    images: np.ndarray,
    truth: list[str],
    predicted: list[str],
    confidence: list[float],
    files: list[str] | None = None,
):
    """Misclassified images (float NCHW in 0..1), each titled true / predicted / its probability
    / its file (the cache's name for it), when `files` are given."""
    titles = [
        [f"true {actual}", f"pred {guess}", f"p {prob:.2f}"]
        for actual, guess, prob in zip(truth, predicted, confidence, strict=True)
    ]
    titles = with_files(titles, files)
    title = "most confidently misclassified test images (p: the predicted class's probability)"
    return titled_grid(images, titles, title, "no mistakes")


def top_losses_grid(
    images: np.ndarray,
    predicted: list[str],
    truth: list[str],
    losses: list[float],
    probs: list[float],
    files: list[str] | None = None,
):
    """The highest-loss images (float NCHW in 0..1), each titled as fastai's `plot_top_losses`:
    predicted / actual / loss / the predicted class's probability, then its file when given."""
    titles = [
        [f"pred {guess}", f"true {actual}", f"loss {loss:.2f}, p {prob:.2f}"]
        for guess, actual, loss, prob in zip(predicted, truth, losses, probs, strict=True)
    ]
    titles = with_files(titles, files)
    title = "highest-loss test images, right or wrong (p: the predicted class's probability)"
    return titled_grid(images, titles, title, "no test images")


def with_files(titles: list[list[str]], files: list[str] | None) -> list[list[str]]:
    """Each image's title lines with its file name as the last (cut in the middle to fit)."""
    if files is None:
        return titles
    return [[*lines, name] for lines, name in zip(titles, files, strict=True)]


def suspects_grid(
    images: np.ndarray, files: list[str], given: list[str], suggested: list[str], title: str
):
    """The likeliest mislabelled images (float NCHW in 0..1), each titled with its file, the
    label it has and the label the probe suggests."""
    titles = [
        [name, f"given {label}", f"suggested {guess}"]
        for name, label, guess in zip(files, given, suggested, strict=True)
    ]
    return titled_grid(images, titles, title, "no suspects")


def titled_grid(images: np.ndarray, titles: list[list[str]], title: str, empty: str):
    """Images (float NCHW in 0..1) in rows of 8, each titled by its lines, each line cut to fit
    its cell (however long the class names); `empty` when none."""
    n = max(len(images), 1)
    cols = min(max(n, 4), 8)  # 4 at least: a few images leave room for the heading
    rows = (n + cols - 1) // cols
    heading = wrap(title, 0.95 * cols * CELL_IN * 72, 12)
    lines = max((len(words) for words in titles), default=0)
    # laid out in inches (tight_layout misjudged titles over images: they ran into the row above)
    side = CELL_IN - 0.15  # an image's square; the rest is the gap to the next
    above = (lines * TITLE_PT * 1.3 + 12) / 72  # its title, with matplotlib's 6 pt pad
    band = (heading.count("\n") + 1) * 12 * 1.3 / 72 + 0.15  # the heading
    width, height = cols * CELL_IN, band + rows * (above + side) + 0.1
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    fig.subplots_adjust(
        left=0.075 / width,
        right=1 - 0.075 / width,
        bottom=0.1 / height,
        top=1 - (band + above) / height,
        wspace=0.15 / side,
        hspace=above / side,
    )
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, words in zip(axes.flat, images, titles, strict=False):
        show(ax, image)
        shown = "\n".join(fit(line, LINE_PT, TITLE_PT) for line in words)
        ax.set_title(shown, fontsize=TITLE_PT, parse_math=False)  # a "$" in a name is text
    if not len(images):
        axes[0, 0].text(0.5, 0.5, empty, ha="center", va="center")
    fig.suptitle(heading, fontsize=12, y=1 - 0.05 / height, va="top")
    return fig


def text_width(text: str, size: float) -> float:
    """Points that one line of `text` takes at font size `size` in matplotlib's default font."""
    width, _, _ = TextToPath().get_text_width_height_descent(text, FontProperties(size=size), False)
    return width


def fit(text: str, width: float, size: float) -> str:
    """`text` whole when it fits in `width` points at `size`; else cut in the middle with an
    ellipsis, its start and end kept (class names often differ at one end only)."""
    low, high = 0, len(text)  # characters kept: the most that fit (widths grow with them)
    while low < high:
        keep = (low + high + 1) // 2
        if text_width(middle_cut(text, keep), size) <= width:
            low = keep
        else:
            high = keep - 1
    return middle_cut(text, low)


def middle_cut(text: str, keep: int) -> str:
    """`text` with all but `keep` of its characters, from the middle, replaced by an ellipsis."""
    if keep >= len(text):
        return text
    return text[: (keep + 1) // 2] + "…" + text[len(text) - keep // 2 :]


def wrap(text: str, width: float, size: float) -> str:
    """`text` broken between words into lines of at most `width` points at `size` (a word wider
    than that alone on its line)."""
    lines = [""]
    for word in text.split():
        longer = f"{lines[-1]} {word}".strip()
        if lines[-1] and text_width(longer, size) > width:
            lines.append(word)
        else:
            lines[-1] = longer
    return "\n".join(lines)


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
