"""Where images come from: a folder of class subfolders (`imagefolder_source`), scikit-learn's
digits (built in, offline), or a torchvision dataset; each a `Source` of images (arrays or file
paths) and int64 labels, class names NFC-normalised folder names. Torch-free (torchvision's
datasets are imported on use)."""

import os
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from visionflow.data.decode import IMAGE_SUFFIXES, LINK_SKIPPED, is_hidden
from visionflow.errors import DataError


class Source(NamedTuple):
    images: Sequence  # uint8 arrays (HxW or HxWxC) or image file paths (`Files`), decoded lazily
    labels: np.ndarray  # int64, one per image
    classes: list[str]  # class names in label order
    is_test: np.ndarray | None  # bool mask of an official test split, or None
    names: list[str]  # stable name per image for reports: path relative to the root, or "#i"
    skipped: dict[str, str] = {}  # files rejected while listing (name -> reason)


class Files(Sequence):
    """The paths (str) of the image files `names` under `root`, made as they are read: a list of
    them would hold every path's characters a second time (prepare's memory, per image)."""

    def __init__(self, root: Path, names: list[str]):
        self.root, self.names = str(root), names

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [os.path.join(self.root, name) for name in self.names[i]]
        return os.path.join(self.root, self.names[i])


def digits_source() -> Source:
    """scikit-learn's 1,797 real 8x8 handwritten digits (ships with the package, works offline)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255 / 16)).astype(np.uint8)  # ink levels 0..16 -> 0..255
    classes = [str(c) for c in digits.target_names]
    names = [f"#{i}" for i in range(len(images))]
    return Source(images, digits.target.astype(np.int64), classes, None, names)


def imagefolder_source(root: Path) -> Source:
    """One subfolder per class; files in nested folders count for their class.

    Hidden files and folders (`.git`, `.ipynb_checkpoints`) are neither classes nor samples. Links
    are not followed, files or folders, wherever they point: each is listed as skipped with the
    reason (rejects.json), so no image gets two labels through an alias (`zero_alias -> zero`), a
    loop (`loop -> .`) or a file linked into two classes, and what is read is what DVC hashes.
    Files that are not images by their suffix are skipped too.
    """
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist or is not a folder")
    names, labels, skipped, classes = [], [], {}, []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_symlink():
            skipped[entry.name] = f"{LINK_SKIPPED} (-> {os.readlink(entry)})"
        elif entry.is_dir():
            classes.append(entry.name)
    if not classes:
        raise DataError(f"{root} has no class subfolders (expected {root}/<class>/<image files>)")
    folders, classes = class_names(root, classes)
    for label, name in enumerate(folders):
        found = 0
        for path in sorted((root / name).rglob("*")):  # rglob does not descend into links
            relative = path.relative_to(root).as_posix()
            if is_hidden(path, root):
                continue
            if path.is_symlink():
                skipped[relative] = f"{LINK_SKIPPED} (-> {os.readlink(path)})"
            elif path.is_dir():
                continue
            elif path.suffix.lower() not in IMAGE_SUFFIXES:
                skipped[relative] = f"not an image file type ({path.suffix or 'no suffix'})"
            else:
                names.append(relative)
                labels.append(label)
                found += 1
        if not found:
            links = sum(
                1
                for k, reason in skipped.items()
                if k.startswith(f"{name}/") and reason.startswith(LINK_SKIPPED)
            )
            also = f" ({links} links skipped: links are not followed)" if links else ""
            raise DataError(f"class '{classes[label]}' ({root / name}) has no image files{also}")
    labels = np.array(labels, dtype=np.int64)
    return Source(Files(root, names), labels, classes, None, names, skipped)


def class_names(root: Path, folders: list[str]) -> tuple[list[str], list[str]]:
    """(the class folders, their class names), in the order of the names: NFC-normalised, so a
    folder made on macOS (NFD names) gives the same labels, in the same order, as one made
    elsewhere. Two folders whose names are equal once normalised are an error naming both,
    code points shown: they would be two classes of one name."""
    seen: dict[str, str] = {}
    for folder in folders:
        name = unicodedata.normalize("NFC", folder)
        if name in seen:
            raise DataError(
                f"class folders {ascii(seen[name])} and {ascii(folder)} in {root} have the same "
                f"name {name!r} in different Unicode forms (one was likely copied from macOS): "
                "merge them into one folder or rename one"
            )
        seen[name] = folder
    names = sorted(seen)
    return [seen[name] for name in names], names


# characters that show as nothing: a folder name holding one looks like another's
INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad"))


def look_alike_classes(classes: list[str]) -> list[str]:
    """Pairs of class names that differ only by letter case, surrounding spaces, invisible
    characters or compatibility forms (`Cat` and `cat`, `cat ` and `cat`): one sentence each.
    A warning, not an error: on Linux they are distinct folders and may be distinct classes."""
    first: dict[str, str] = {}
    found = []
    for name in classes:
        key = unicodedata.normalize("NFKC", name).translate(INVISIBLE).strip().casefold()
        if key in first:
            found.append(
                f"classes {ascii(first[key])} and {ascii(name)} differ only by letter case, "
                "spaces or invisible characters: they look alike in every report (and names "
                "differing by case are one folder on macOS and Windows); if they are one class, "
                "merge the folders, else rename one"
            )
        else:
            first[key] = name
    return found


TORCHVISION = {"cifar10": "CIFAR10", "mnist": "MNIST", "fashion_mnist": "FashionMNIST"}


def torchvision_source(name: str, root: Path, download: bool) -> Source:
    """A torchvision dataset read from `root` in its standard layout (downloaded there if asked)."""
    from torchvision import datasets  # imported on use: it costs seconds at every stage start

    dataset_class = getattr(datasets, TORCHVISION[name])
    parts = []
    for train in (True, False):
        try:
            parts.append(dataset_class(str(root), train=train, download=download))
        except RuntimeError as error:  # torchvision's "Dataset not found or corrupted"
            if download:
                raise DataError(f"{name} not usable under {root}: {error}") from None
            raise DataError(
                f"{name} not usable under {root}: {error}; downloading is off (turn it on to fetch "
                "it when online)",
                setting="download",
            ) from None
    images = np.concatenate([np.asarray(p.data, dtype=np.uint8) for p in parts])
    labels = np.concatenate([np.asarray(p.targets, dtype=np.int64) for p in parts])
    is_test = np.arange(len(labels)) >= len(parts[0].data)
    names = [f"{'test' if in_test else 'train'}#{i}" for i, in_test in enumerate(is_test)]
    return Source(images, labels, list(parts[0].classes), is_test, names)


def exclude(source: Source, names: Sequence[str], where: str) -> Source:
    """`source` without the images named in `names` (paths under the image folder, as the
    label-issue list names them; `#i` for a built-in source). A name the source does not have
    is a DataError naming it and `where` (the folder): a typo must not pass as excluded."""
    wanted = [unicodedata.normalize("NFC", n) for n in names]
    index = {unicodedata.normalize("NFC", n): i for i, n in enumerate(source.names)}
    missing = [n for n in wanted if n not in index]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise DataError(
            f"{shown}{more} not in {where} (names are paths under it, as label_issues.json "
            "lists them): remove the entry, or fix its path",
            setting="exclude",
        )
    keep = np.ones(len(source.names), dtype=bool)
    keep[[index[n] for n in wanted]] = False
    kept = np.flatnonzero(keep)
    names_kept = [source.names[i] for i in kept]
    if isinstance(source.images, Files):
        images = Files(Path(source.images.root), names_kept)
    else:
        images = np.asarray(source.images)[kept]
    is_test = source.is_test[kept] if source.is_test is not None else None
    return source._replace(
        images=images, labels=source.labels[kept], is_test=is_test, names=names_kept
    )


def load_source(name: str, path: Path, download: bool = False) -> Source:
    if name == "digits":
        return digits_source()
    if name == "imagefolder":
        return imagefolder_source(path)
    return torchvision_source(name, path, download)
