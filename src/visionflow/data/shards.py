"""The prepared cache in shards (`prepare.shard_images` > 0): where each image goes, and a split's
shards read back as one array. Torch-free.

Placement hashes each image's name (its path under the source folder, NFC, with the seed), not a
permutation of the whole folder, so adding images moves no other image. The name, not the pixels:
it costs no read, an `image_size` or `color` experiment keeps the same test set, and an edited
image stays in its split; exact copies under two names are `dedupe`'s to catch, as before. One
blake2b digest gives each image three 64-bit numbers: `u` places it (test below
`test_fraction`, then val below `val_fraction` of the rest, as a per-class uniform draw would;
a class left with no train image takes back its highest-`u` one, and a class left with no val or
test image gives its lowest-`u` train image), `order` orders its split, and `cut` ends a shard
after it when `cut % N < 2` (chance 2/N), with a forced end at N images.
So shards are cut where the content says, as rsync and restic chunk files: one more image changes
its own shard (two, when it is itself a cut; a few more when it shifts a forced end, up to the next
content cut), and a shard is named by its last image, so the others keep their names and bytes.
DVC then uploads and deduplicates shard by shard.
"""

import hashlib
import json
import resource
import unicodedata
from pathlib import Path

import numpy as np

from visionflow.errors import DataError


def map_limit() -> int:
    """Memory maps a `Shards` keeps open at once: each holds a file descriptor, so a quarter of
    this process's limit (256 of Linux's usual 1,024), at most 8,192. Reopening a map costs about
    as much as reading a small image, so a split of more shards than this reads slower."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 8192 if soft == resource.RLIM_INFINITY else max(16, min(soft // 4, 8192))


def image_keys(names: list[str], seed: int) -> np.ndarray:
    """(n, 3) uint64 per image: placement, order within its split, shard cut."""
    digests = bytearray()  # appended to: no list of 32,000 small objects first
    for n in names:
        name = f"{seed}\0{unicodedata.normalize('NFC', n)}".encode()
        digests += hashlib.blake2b(name, digest_size=24).digest()
    return np.frombuffer(digests, dtype="<u8").reshape(len(names), 3)


def hash_split(
    labels: np.ndarray,
    keys: np.ndarray,
    val_fraction: float,
    test_fraction: float,
    is_test: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Train/val/test indices from each image's own hash, each split in `order` key order; an
    official test split is kept as the test split."""
    u = keys[:, 0] / 2.0**64  # uniform in [0, 1), independent of every other image
    if is_test is None:
        test, u = u < test_fraction, (u - test_fraction) / (1 - test_fraction)
    else:
        test = is_test.astype(bool)
    split = np.where(test, 2, np.where(u < val_fraction, 1, 0))  # 0 train, 1 val, 2 test
    classes = int(labels.max()) + 1 if len(labels) else 0
    # a class the hashes placed wholly in val and test (a class of 5: about 1 in 300 at the
    # default fractions) trains on its highest-`u` image, the nearest to the train range
    trains = np.bincount(labels[split == 0], minlength=classes)
    movable = split > 0 if is_test is None else split == 1  # an official test split stays
    for c in np.flatnonzero(trains == 0):
        held = np.flatnonzero((labels == c) & movable)
        if len(held):
            split[held[np.argmax(keys[held, 0])]] = 0
    for s in (1, 2) if is_test is None else (1,):  # stratified as closely as hashing allows:
        has = np.bincount(labels[split == s], minlength=classes)  # no class left out of a split
        spare = np.bincount(labels[split == 0], minlength=classes) > 1
        for c in np.flatnonzero((has == 0) & spare):
            train = np.flatnonzero((labels == c) & (split == 0))
            split[train[np.argmin(keys[train, 0])]] = s
    parts = {}
    for s, name in enumerate(("train", "val", "test")):
        index = np.flatnonzero(split == s)
        if not len(index):
            raise DataError(
                f"no {name} images: the hashes of {len(labels)} images' names placed none "
                "there; add images, or raise the fraction",
                setting=f"{name}_fraction" if name != "train" else None,
            )
        parts[name] = index[np.argsort(keys[index, 1], kind="stable")]
    return parts


def cut(index: np.ndarray, keys: np.ndarray, split: str, size: int) -> dict[str, np.ndarray]:
    """A split's indices (in order) cut into shards of at most `size` images at the images whose
    `cut` key says so; each shard named `<split>-<its last image's order key, hex>`."""
    ends = keys[index, 2] % np.uint64(size) < 2
    shards, start = {}, 0
    for i in range(len(index)):
        if ends[i] or i + 1 - start == size or i + 1 == len(index):
            shards[f"{split}-{int(keys[index[i], 1]):016x}"] = index[start : i + 1]
            start = i + 1
    return shards


class Shards:
    """A split's images in several .npy files, read as one array: len, shape, dtype, nbytes, an
    int, a slice (a view, as a memmap's), an array of indices (those rows, read into memory),
    and np.asarray (all of it). Each file is memory-mapped when first read (at most `map_limit()`
    at once); pickled, it is its paths alone, so each DataLoader worker maps its own."""

    def __init__(self, paths: list):
        self.paths, self.maps, self.limit = [str(p) for p in paths], {}, map_limit()
        lengths = [self.mapped(i).shape[0] for i in range(len(self.paths))]
        self.starts = np.cumsum([0, *lengths])  # the first row of each file
        first = self.mapped(0)
        self.offset, self.length, self.dtype = 0, int(self.starts[-1]), first.dtype
        self.shape = (self.length, *first.shape[1:])

    def mapped(self, i: int) -> np.ndarray:
        if i not in self.maps:
            while len(self.maps) >= self.limit:
                self.maps.pop(next(iter(self.maps)))  # the oldest
            self.maps[i] = np.load(self.paths[i], mmap_mode="r")
        return self.maps[i]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "maps": {}}

    def __len__(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self.length)
            if step != 1:
                return self.take(np.arange(start, stop, step))
            view = object.__new__(Shards)
            view.__dict__.update(self.__dict__, offset=self.offset + start)
            view.length = max(stop - start, 0)
            view.shape = (view.length, *self.shape[1:])
            return view
        if isinstance(key, int | np.integer):
            return self.take(np.array([key]))[0]
        return self.take(np.asarray(key))

    def take(self, index: np.ndarray) -> np.ndarray:
        index = index.astype(np.int64, copy=False)
        if index.size and (index.min() < -self.length or index.max() >= self.length):
            raise IndexError(f"index out of range for {self.length} images")
        index = np.where(index < 0, index + self.length, index) + self.offset
        shard = np.searchsorted(self.starts, index, side="right") - 1
        out = np.empty((len(index), *self.shape[1:]), self.dtype)
        for s in np.unique(shard):
            at = shard == s
            out[at] = self.mapped(s)[index[at] - self.starts[s]]
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        x = self.take(np.arange(self.length))
        return x if dtype is None else x.astype(dtype)


def read_sharded(cache: Path, split: str) -> tuple[Shards, np.ndarray]:
    """A sharded split's images (memory-mapped) and labels, in the order manifest.json lists
    its shards; DataError naming a shard the manifest lists that is not there."""
    try:
        names = json.loads((cache / "manifest.json").read_text())["shards"][split]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(
            f"{cache} has no {split}_x.npy and its manifest.json lists no {split} shards "
            f"({type(error).__name__}: {error}); `dvc checkout {cache}` or `dvc repro --force prepare`"
        ) from None
    for name in names:
        for part in ("x", "y"):
            if not (cache / f"{name}_{part}.npy").exists():
                raise DataError(
                    f"{cache}/manifest.json lists shard {name}_{part}.npy of the {split} split, "
                    f"which is missing; `dvc checkout {cache}` (or `dvc pull`) restores it"
                )
    x = Shards([cache / f"{name}_x.npy" for name in names])
    return x, np.concatenate([np.load(cache / f"{name}_y.npy") for name in names])
