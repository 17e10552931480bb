"""Sources, the stratified split, and the uint8 cache that every later stage reads.

The cache holds pixels decoded once: uint8 NHWC `<split>_x.npy`, int64 `<split>_y.npy`, the class
list, train-only per-channel mean/std (on the 0..1 scale) and a manifest with the sha256 of every
array. Normalisation happens at load time (`to_model_input`), on whatever device trains.
"""

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageOps
from sklearn.model_selection import train_test_split
from torchvision import datasets
from tqdm import tqdm

SPLITS = ("train", "val", "test")
RESIZE = "bilinear"  # PIL filter used to reach image_size; exported models record it
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


class Source(NamedTuple):
    images: Sequence  # uint8 arrays (HxW or HxWxC) or image file paths, decoded lazily
    labels: np.ndarray  # int64, one per image
    classes: list[str]  # class names in label order
    is_test: np.ndarray | None  # bool mask of an official test split, or None


class DataError(ValueError):
    """The source data cannot be used; the message names the file, folder or class."""


def digits_source() -> Source:
    """scikit-learn's 1,797 real 8x8 handwritten digits (ships with the package, works offline)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255 / 16)).astype(np.uint8)  # ink levels 0..16 -> 0..255
    classes = [str(c) for c in digits.target_names]
    return Source(images, digits.target.astype(np.int64), classes, None)


def imagefolder_source(root: Path) -> Source:
    """One subfolder per class (nested folders count for their class); hidden entries are skipped."""
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist or is not a folder")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"{root} has no class subfolders (expected {root}/<class>/<image files>)")
    paths, labels = [], []
    for label, name in enumerate(classes):
        files = sorted(
            p
            for p in (root / name).rglob("*")
            if p.is_file()
            and p.suffix.lower() in IMAGE_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
        if not files:
            raise DataError(f"class '{name}' ({root / name}) has no image files")
        paths += files
        labels += [label] * len(files)
    return Source(paths, np.array(labels, dtype=np.int64), classes, None)


TORCHVISION = {
    "cifar10": datasets.CIFAR10,
    "mnist": datasets.MNIST,
    "fashion_mnist": datasets.FashionMNIST,
}


def torchvision_source(name: str, root: Path, download: bool) -> Source:
    """A torchvision dataset read from `root` in its standard layout (downloaded there if asked)."""
    dataset_class = TORCHVISION[name]
    parts = []
    for train in (True, False):
        try:
            parts.append(dataset_class(str(root), train=train, download=download))
        except RuntimeError as e:  # torchvision's "Dataset not found or corrupted"
            hint = "" if download else " (set prepare.download: true to fetch it when online)"
            raise DataError(f"{name} not usable under {root}: {e}{hint}") from None
    images = np.concatenate([np.asarray(p.data, dtype=np.uint8) for p in parts])
    labels = np.concatenate([np.asarray(p.targets, dtype=np.int64) for p in parts])
    is_test = np.arange(len(labels)) >= len(parts[0].data)
    return Source(images, labels, list(parts[0].classes), is_test)


def load_source(name: str, path: Path, download: bool = False) -> Source:
    if name == "digits":
        return digits_source()
    if name == "imagefolder":
        return imagefolder_source(path)
    return torchvision_source(name, path, download)


def to_pixels(item, size: int, color: str) -> np.ndarray:
    """Decode (for a path), convert to the colour mode and resize: one uint8 HxWxC image."""
    if isinstance(item, np.ndarray):
        image = Image.fromarray(item)
    else:
        try:
            with Image.open(item) as opened:
                image = ImageOps.exif_transpose(opened)  # upright, as the camera held it
                image.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise DataError(f"cannot decode {item}: {e}") from None
    image = image.convert("L" if color == "grayscale" else "RGB")
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling[RESIZE.upper()])
    pixels = np.asarray(image, dtype=np.uint8)
    return pixels[..., None] if pixels.ndim == 2 else pixels


def decode_all(images: Sequence, size: int, color: str) -> np.ndarray:
    channels = 1 if color == "grayscale" else 3
    out = np.empty((len(images), size, size, channels), dtype=np.uint8)
    for i, item in enumerate(tqdm(images, desc="decode", unit="img", mininterval=1.0)):
        out[i] = to_pixels(item, size, color)
    return out


def split_indices(
    labels: np.ndarray,
    val_fraction: float,
    test_fraction: float,
    seed: int,
    is_test: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Stratified train/val/test indices; an official test split is kept as the test split."""
    index = np.arange(len(labels))
    try:
        if is_test is None:
            pool, test = train_test_split(
                index, test_size=test_fraction, stratify=labels, random_state=seed
            )
        else:
            pool, test = index[~is_test], index[is_test]
        train, val = train_test_split(
            pool, test_size=val_fraction, stratify=labels[pool], random_state=seed
        )
    except ValueError as e:  # too few images in a class to stratify
        counts = np.bincount(labels)
        raise DataError(
            f"cannot split {len(labels)} images, per-class counts {counts}: {e}"
        ) from None
    return {"train": np.sort(train), "val": np.sort(val), "test": np.sort(test)}


def channel_stats(x: np.ndarray, chunk: int = 4096) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of uint8 NHWC images on the 0..1 scale, in float64 chunks."""
    channels = x.shape[-1]
    total, squares = np.zeros(channels), np.zeros(channels)
    for start in range(0, len(x), chunk):
        part = x[start : start + chunk].reshape(-1, channels).astype(np.float64) / 255
        total += part.sum(axis=0)
        squares += np.square(part).sum(axis=0)
    count = x.size // channels
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean**2, 0))
    std = np.maximum(std, 1 / 255)  # a constant channel must not divide by zero
    return mean.tolist(), std.tolist()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_cache(
    out: Path, pixels: np.ndarray, source: Source, splits: dict[str, np.ndarray]
) -> dict:
    """Write arrays, classes, train-only stats and the manifest; returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    files, counts = {}, {}
    for split, index in splits.items():
        x, y = pixels[index], source.labels[index]
        for suffix, array in (("x", x), ("y", y)):
            name = f"{split}_{suffix}.npy"
            np.save(out / name, array)
            files[name] = {"sha256": sha256(out / name), "shape": list(array.shape)}
        counts[split] = {
            c: int(n)
            for c, n in zip(
                source.classes, np.bincount(y, minlength=len(source.classes)), strict=True
            )
        }
    mean, std = channel_stats(pixels[splits["train"]])
    write_json(out / "classes.json", source.classes)
    write_json(out / "stats.json", {"mean": mean, "std": std, "computed_on": "train"})
    manifest = {"files": files, "counts": counts}
    write_json(out / "manifest.json", manifest)
    return manifest


class Cache(NamedTuple):
    classes: list[str]
    mean: list[float]
    std: list[float]


def read_cache_meta(cache: Path) -> Cache:
    stats = json.loads((cache / "stats.json").read_text())
    return Cache(json.loads((cache / "classes.json").read_text()), stats["mean"], stats["std"])


def read_split(cache: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """uint8 NHWC images and int64 labels of one split."""
    return np.load(cache / f"{split}_x.npy"), np.load(cache / f"{split}_y.npy")


def batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, generator: torch.Generator | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Slices of in-memory tensors; shuffled when a generator is given (the training split)."""
    n = len(x)
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    for start in range(0, n, batch_size):
        index = order[start : start + batch_size].to(x.device)
        yield x[index], y[index]


def to_model_input(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 NHWC -> normalised float NCHW (a channels_last view, no copy of the layout)."""
    x = x.permute(0, 3, 1, 2).float().div_(255)
    return (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)


def from_model_input(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Undo `to_model_input` to 0..1 NCHW, for pictures of what the model sees."""
    return (x * std.view(1, -1, 1, 1) + mean.view(1, -1, 1, 1)).clamp(0, 1)
