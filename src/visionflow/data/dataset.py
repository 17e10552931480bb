"""The uint8 cache that every later stage reads, written from the images `pool` decoded on all
cores (the sources are `sources`, the split `splits`).

The cache holds pixels decoded once: uint8 NHWC `<split>_x.npy`, int64 `<split>_y.npy`, and
`<split>_names.json`, each image's name in the same order (its path under the image folder, or
`#i` for a built-in source), so that a report can name the file (or, with `shard_images`, each
split in shards `<split>-<key>_{x,y}.npy` and `_names.json`: `visionflow.data.shards`), the class
list, train-only per-channel mean/std (on the 0..1 scale), a manifest with the sha256 of every
array and what the cache was made from (source, path, split fractions and seed), a rejects report
and a duplicates report. Class names are NFC-normalised folder names. Normalisation happens at
load time (`loading.to_model_input`), on whatever device trains. Torch-free: `visionflow.train.loading`
is the torch half (the splits on the device, batches, normalisation).

Prepare's memory does not grow with the folder: images are decoded into a scratch file and copied
into the split files with plain reads and writes, a bounded chunk at a time, never through memory
maps, whose pages count in the process's memory for as long as they stay mapped (with maps, 32,000
64 px images took 5x the memory of 2,000: bench/prepare_memory_bench.py).

Files users did not make themselves are decoded defensively (`decode`): broken, empty, non-image
and oversized files are rejected with a reason each (never silently used), and image modes are
normalised (alpha composited on a background, CMYK to RGB, 16-bit scaled, EXIF orientation
applied). The scratch file is written straight from the decoding processes, so a dataset larger
than RAM can be prepared.
"""

import json
import math
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np

from visionflow.data.decode import (  # noqa: F401  (data.Decode, data.to_pixels: one place to import from)
    IMAGE_SUFFIXES,
    LINK_SKIPPED,
    RESIZE,
    Decode,
    is_hidden,
    to_pixels,
)
from visionflow.data.files import file_hash, verify_cache  # noqa: F401  (data.verify_cache)
from visionflow.data.pool import decode_into
from visionflow.data.shards import cut, hash_split, image_keys, read_sharded
from visionflow.data.sources import Source
from visionflow.data.splits import find_duplicates, split_indices
from visionflow.errors import DataError, DiskFull

COPY_BYTES = 2**22  # pixels copied from the scratch file per read and write: 4 MB at any size
HISTOGRAM_PIXELS = 2**18  # counted per np.bincount call, which copies them as int64: 2 MB


def add_histogram(counts: np.ndarray, images: np.ndarray) -> None:
    """Add the pixels of uint8 NHWC `images` to `counts` (channels x 256, int64), a bounded
    number at a time: np.bincount counts a copy of them as int64, 8 bytes a pixel."""
    pixels = images.reshape(-1, counts.shape[0])
    for start in range(0, len(pixels), HISTOGRAM_PIXELS):
        for c, channel in enumerate(pixels[start : start + HISTOGRAM_PIXELS].T):
            counts[c] += np.bincount(channel, minlength=256)


def channel_stats(x: np.ndarray, chunk: int = 256) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of uint8 NHWC images on the 0..1 scale, exact, from histograms."""
    counts = np.zeros((x.shape[-1], 256), dtype=np.int64)
    for start in range(0, len(x), chunk):
        add_histogram(counts, np.asarray(x[start : start + chunk]))
    return stats_of(counts)


def stats_of(counts: np.ndarray) -> tuple[list[float], list[float]]:
    """Per-channel mean and std on the 0..1 scale from histograms of uint8 pixels."""
    levels = np.arange(256) / 255
    total = counts.sum(axis=1)
    mean = counts @ levels / total
    std = np.sqrt(np.maximum(counts @ levels**2 / total - mean**2, 0))
    std = np.maximum(std, 1 / 255)  # a constant channel must not divide by zero
    return mean.tolist(), std.tolist()


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def reserve(path: Path) -> None:
    """Allocate every block of a file now. The file is sparse: a write into a hole on a disk that
    has filled since (another writer, a check made before) fails midway, in a decoding process,
    or kills the process with SIGBUS through a memory map, which nothing can catch; here it is
    ENOSPC, named as a full disk. Where the system has no posix_fallocate (macOS), the free
    space is checked instead: a disk that fills after it can still fail a later write."""
    with open(path, "r+b") as handle:
        size = os.fstat(handle.fileno()).st_size
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(handle.fileno(), 0, size)
        elif shutil.disk_usage(path.parent).free < size:
            raise DiskFull.at(path.parent, size)


def read_into(source, row: np.ndarray, offset: int) -> None:
    """`row.nbytes` bytes of the open file `source` at `offset` into `row`: one preadv where the
    system has it (Linux), a seek and a read elsewhere (macOS, Windows)."""
    if hasattr(os, "preadv"):
        os.preadv(source.fileno(), [row], offset)
    else:
        source.seek(offset)
        source.readinto(row.data.cast("B"))


def write_split(
    path: Path, decoded: Path, shape: tuple[int, ...], index: np.ndarray, counts=None
) -> None:
    """Images `index` of the raw file `decoded` (each a uint8 array of `shape`) into a new .npy
    file, COPY_BYTES at a time, with plain reads and writes (never the split in memory, nor
    mapped); their pixels are added to the histograms `counts` when given (`add_histogram`)."""
    header = {"descr": "|u1", "fortran_order": False, "shape": (len(index), *shape)}
    chunk = np.empty((max(1, COPY_BYTES // math.prod(shape)), *shape), dtype=np.uint8)
    with open(decoded, "rb") as source, open(path, "wb") as out:
        np.lib.format.write_array_header_1_0(out, header)
        out.truncate(out.tell() + len(index) * chunk[0].nbytes)
        reserve(path)
        for start in range(0, len(index), len(chunk)):
            part = chunk[: len(index[start : start + len(chunk)])]
            for row, i in zip(part, index[start : start + len(chunk)], strict=True):
                read_into(source, row, int(i) * row.nbytes)
            out.write(part.data)
            if counts is not None:
                add_histogram(counts, part)


def write_cache(
    out: Path,
    decoded: Path,
    shape: tuple[int, ...],
    source: Source,
    splits: dict[str, np.ndarray],
    made_from: dict,
    shard_images: int = 0,
    keys: np.ndarray | None = None,
) -> dict:
    """Write arrays (from the raw file `decoded`, images of `shape`, in source order), classes,
    train-only stats and the manifest (with `made_from`: the source and the split, which the
    model card states); returns the manifest. With `shard_images` each split goes into shards of
    at most that many images, cut by `keys` (`shards.cut`), listed in order under the manifest's
    "shards". The train split's histograms are counted as it is written (one pass, no re-read)."""
    out.mkdir(parents=True, exist_ok=True)
    files, counts, listed = {}, {}, {}
    histograms = np.zeros((shape[-1], 256), dtype=np.int64)  # train's pixels, per channel
    for split, index in splits.items():
        y = source.labels[index]
        parts = cut(index, keys, split, shard_images) if shard_images else {split: index}
        listed[split] = list(parts)
        for shard, part in parts.items():
            train = histograms if split == "train" else None
            write_split(out / f"{shard}_x.npy", decoded, shape, part, train)
            np.save(out / f"{shard}_y.npy", source.labels[part])
            write_json(out / f"{shard}_names.json", [source.names[i] for i in part])
            for kind, dims in {"x": [len(part), *shape], "y": [len(part)]}.items():
                name = f"{shard}_{kind}.npy"
                files[name] = {"sha256": file_hash(out / name), "shape": dims}
            files[f"{shard}_names.json"] = {"sha256": file_hash(out / f"{shard}_names.json")}
        per_class = np.bincount(y, minlength=len(source.classes))
        counts[split] = {c: int(n) for c, n in zip(source.classes, per_class, strict=True)}
    mean, std = stats_of(histograms)
    write_json(out / "classes.json", source.classes)
    write_json(out / "stats.json", {"mean": mean, "std": std, "computed_on": "train"})
    for name in ("classes.json", "stats.json", "decode.json"):  # class names, preprocessing
        if (out / name).exists():
            files[name] = {"sha256": file_hash(out / name)}
    manifest = {"files": files, "counts": counts, "made_from": made_from}
    if shard_images:
        manifest["shards"] = listed
    write_json(out / "manifest.json", manifest)
    return manifest


def build_cache(
    source: Source,
    out: Path,
    decode: Decode,
    *,
    val_fraction: float,
    test_fraction: float,
    seed: int,
    workers: int = 1,
    max_bad_fraction: float = 0.0,
    min_per_class: int = 1,
    dedupe: bool = True,
    origin: dict | None = None,
    shard_images: int = 0,
    refused_report: Path | None = None,
) -> dict:
    """Decode, reject, split, de-duplicate and write the cache; returns the manifest.

    `shard_images` 0: one file per split, split by a seeded stratified permutation; N > 0: each
    image's split and shard from a hash of its name, shards of at most N images (`shards`).

    Fails (DataError) when the rejected share is over `max_bad_fraction`, listing the files (the
    full list in `refused_report`, a path that outlives `out`, when given), when
    a class keeps fewer than `min_per_class` good images, or when `dedupe` leaves a class no val
    or no test image (all of them copies of an earlier split's images), naming the class.
    `origin` (the source's name and path, as the user gave them) goes into the manifest with the
    split's fractions and seed.
    """
    if len(source.classes) < 2:  # before decoding anything
        raise DataError(
            f"{len(source.classes)} class ({', '.join(source.classes)}): a classifier needs at "
            "least two; add a folder per class"
        )
    out.mkdir(parents=True, exist_ok=True)
    channels = 1 if decode.color == "grayscale" else 3
    scratch = out / ".decoded"  # all images, raw, in source order; removed when done
    shape = (decode.size, decode.size, channels)  # of one image
    # the decoded scratch, then the split arrays beside it, then labels: check before writing
    needed = 2 * len(source.images) * math.prod(shape) + 8 * len(source.images) + 2**20
    if shutil.disk_usage(out).free < needed:
        raise DiskFull.at(out, needed)
    with open(scratch, "wb") as handle:
        handle.truncate(len(source.images) * math.prod(shape))
    reserve(scratch)  # the decoding processes write into it
    try:
        ok, rejected, digests = decode_into(
            scratch, source.images, decode, workers or os.cpu_count()
        )
        rejects = check_rejects(out, source, rejected, max_bad_fraction, refused_report)
        good = np.flatnonzero(ok)
        check_class_sizes(source, good, min_per_class)
        if not shard_images:  # a stratified split needs each class in two splits at least
            check_class_sizes(source, good, 2, "a class needs 2 images for a stratified split")
        is_test = source.is_test[good] if source.is_test is not None else None
        labels = source.labels[good]
        keys = image_keys(source.names, seed) if shard_images else None
        local = (
            hash_split(labels, keys[good], val_fraction, test_fraction, is_test)
            if shard_images
            else split_indices(labels, val_fraction, test_fraction, seed, is_test, source.classes)
        )
        check_training_images(source.classes, labels[local["train"]])
        placed = {s: good[i] for s, i in local.items()}
        splits, duplicates = find_duplicates(placed, digests, source.names, remove=dedupe)
        check_deduped_classes(source, placed, splits)
        write_json(out / "duplicates.json", duplicates)
        write_json(out / "decode.json", decode_record(decode))
        split = {"val_fraction": val_fraction, "test_fraction": test_fraction, "seed": seed}
        if shard_images:  # one file per split keeps its bytes: a permutation, as before
            split["placed_by"] = "name hash"
        made_from = {**(origin or {}), **split}
        manifest = write_cache(out, scratch, shape, source, splits, made_from, shard_images, keys)
    finally:
        scratch.unlink(missing_ok=True)
    return {**manifest, "rejected": len(rejects), "duplicates": duplicates["across_splits"]}


SHOWN_REJECTS = 50  # files an error lists; the report has them all


def check_rejects(
    out: Path, source: Source, rejected: dict, max_bad_fraction: float, refused: Path | None = None
) -> dict:
    """Every rejected file and why (`out`/rejects.json); DataError when their share is over
    `max_bad_fraction`, listing the first SHOWN_REJECTS and naming the report with them all:
    `refused` when given (beside the output: a refused stage discards `out`; a passing run
    removes a refused run's stale one), else `out`/rejects.json."""
    rejects = {**source.skipped, **{source.names[i]: r for i, r in sorted(rejected.items())}}
    total = len(source.images) + len(source.skipped)
    report = {
        "total_files": total,
        "rejected": len(rejects),
        "fraction": len(rejects) / max(total, 1),
        "files": rejects,
    }
    write_json(out / "rejects.json", report)
    if refused is not None:
        refused.unlink(missing_ok=True)
    if report["fraction"] <= max_bad_fraction:
        return rejects
    full = refused or out / "rejects.json"
    write_json(full, report)
    shown = list(rejects.items())[:SHOWN_REJECTS]
    listing = "".join(f"\n  {name}: {reason}" for name, reason in shown)
    if len(shown) < len(rejects):
        listing += f"\n  ({len(shown)} of {len(rejects)} shown; the full list: {full})"
    raise DataError(
        f"{len(rejects)} of {total} files rejected ({report['fraction']:.1%}), over the limit of "
        f"{max_bad_fraction:.1%} (all of them, each with its reason: {full}):{listing}",
        setting="max_bad_fraction",
    )


def check_class_sizes(source: Source, good: np.ndarray, least: int, reason: str = "") -> None:
    """DataError naming the classes with fewer than `least` good images (and their counts)."""
    good_counts = np.bincount(source.labels[good], minlength=len(source.classes))
    small = {c: int(n) for c, n in zip(source.classes, good_counts, strict=True) if n < least}
    if small:
        reason = f" ({reason})" if reason else ""
        raise DataError(
            f"classes below the minimum of {least} images{reason}: {small}", setting="min_per_class"
        )


def check_training_images(classes: list[str], train_labels: np.ndarray) -> None:
    """DataError naming the classes the split left without a training image (all of them in a
    source's own test split, or a class too small for the fractions): a model cannot learn them."""
    counts = np.bincount(train_labels, minlength=len(classes))
    none = [c for c, n in zip(classes, counts, strict=True) if n == 0]
    if none:
        raise DataError(
            f"no training images for classes {none}: the split put all of their images in val "
            "or test (or the source's own test split holds them all); add images to them"
        )


def check_deduped_classes(
    source: Source, placed: dict[str, np.ndarray], kept: dict[str, np.ndarray]
) -> None:
    """DataError naming each class that de-duplication left with no val or no test image (every
    one was a pixel copy of an earlier split's image: burst photos), which would otherwise be
    validated or tested on nothing, in silence."""
    lost, example = {}, None  # class name -> {split: its images there}; one image removed
    for split in ("val", "test"):
        had, has = (
            np.bincount(source.labels[index[split]], minlength=len(source.classes))
            for index in (placed, kept)
        )
        for c in np.flatnonzero((had > 0) & (has == 0)):
            lost.setdefault(source.classes[c], {})[split] = int(had[c])
            example = example or source.names[placed[split][source.labels[placed[split]] == c][0]]
    if lost:
        which = "; ".join(
            f"class {name!r} lost every {' and '.join(had)} image "
            f"({', '.join(f'{n} {split}' for split, n in had.items())})"
            for name, had in lost.items()
        )
        raise DataError(
            f"{which}: each was a pixel copy of an image in an earlier split ({example} is "
            "one), so the class would be scored on no image; give it distinct images, or set "
            "this false to keep the copies (they leak)",
            setting="dedupe",
        )


def decode_record(decode: Decode) -> dict:
    """decode.json: how every image of the cache was decoded; predict and the exports follow it."""
    return {
        "image_size": decode.size,
        "color": decode.color,
        "resize": decode.resize,
        "background": list(decode.background),
        "exif_transpose": decode.exif_transpose,
        "jpeg_draft": decode.jpeg_draft,
        "reducing_gap": decode.reducing_gap,
        "fit": decode.fit,
    }


class Cache(NamedTuple):
    classes: list[str]
    mean: list[float]
    std: list[float]
    background: list[int]  # what transparent pixels were composited on
    jpeg_draft: bool  # JPEGs decoded at a reduced DCT scale first (decode.Decode)
    reducing_gap: float | None  # the two-step resize's gap; None: one step (decode.Decode)
    resize: str  # the resize filter (decode.Decode)
    fit: str  # crop or squash to the square (decode.Decode)


def read_cache_meta(cache: Path) -> Cache:
    stats = json.loads((cache / "stats.json").read_text())
    decode = json.loads((cache / "decode.json").read_text())
    classes = json.loads((cache / "classes.json").read_text())
    draft = decode.get("jpeg_draft", False)  # a cache made before the draft decode
    gap = decode.get("reducing_gap")  # a cache made before the two-step resize: None
    fit = decode.get("fit", "squash")  # a cache made before `prepare.fit`
    meta = stats["mean"], stats["std"], decode["background"], draft, gap, decode["resize"], fit
    return Cache(classes, *meta)


def read_names(cache: Path, split: str) -> list[str] | None:
    """Each image's name in one split, in the split's order (shards in the manifest's order);
    None for a cache made before prepare wrote them."""
    shards = json.loads((cache / "manifest.json").read_text()).get("shards", {}).get(split)
    names = []
    for part in shards or [split]:
        path = cache / f"{part}_names.json"
        if not path.exists():
            return None
        names += json.loads(path.read_text())
    return names


def read_split(cache: Path, split: str, mmap: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """uint8 NHWC images and int64 labels of one split (images memory-mapped when asked). A
    sharded split's images are a `shards.Shards` when memory-mapped, else read into one array."""
    if not (cache / f"{split}_x.npy").exists() and (cache / "manifest.json").exists():
        x, y = read_sharded(cache, split)
        return (x if mmap else np.asarray(x)), y
    x = np.load(cache / f"{split}_x.npy", mmap_mode="r" if mmap else None)
    return x, np.load(cache / f"{split}_y.npy")
