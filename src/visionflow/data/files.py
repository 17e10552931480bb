"""File hashes and stats, torch-free: the cache manifest, `visionflow verify`, the mid-run guard."""

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import NamedTuple

import numpy as np

from visionflow.errors import DataError


def file_hash(path: Path, algorithm: str = "sha256") -> str:
    """A file's hash (hex), read a block at a time (the standard library's loop)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algorithm).hexdigest()


class Stat(NamedTuple):
    """What a file's stat says of its content: any write changes it (ctime even when mtime is
    set back). `mtime` is the float DVC's state keys its hashes by."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    mtime: float


def walk(folder: str):
    """Every file name under `folder`, __pycache__ skipped, links to folders not followed."""
    for parent, subfolders, names in os.walk(folder):
        subfolders[:] = [name for name in subfolders if name != "__pycache__"]
        yield from (os.path.join(parent, name) for name in names)


def iter_stats(paths):
    """(name, Stat) of every file at or under `paths`, hidden files and Python's bytecode
    (`__pycache__`, `.pyc`) skipped as .dvcignore skips them: no file is read, one stat call each,
    so it is cheap enough to take before and after a run (20,000 files: docs/benchmarks.md)."""
    for path in (str(Path(p)) for p in paths):
        for f in walk(path) if os.path.isdir(path) else [path]:
            name = os.path.basename(f)
            bytecode = name.endswith((".pyc", ".pyo")) or "__pycache__" in f.split(os.sep)
            if name.startswith(".") or bytecode:
                continue
            try:
                s = os.stat(f)
            except OSError:  # gone, or a link to nothing
                continue
            if stat.S_ISREG(s.st_mode):
                yield f, Stat(s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino, s.st_mtime)


def file_stats(paths) -> dict[str, Stat]:
    """The stat of every file at or under `paths` (`iter_stats`), by name."""
    return dict(iter_stats(paths))


STAT_ROW = np.dtype(
    [("size", "i8"), ("mtime_ns", "i8"), ("ctime_ns", "i8"), ("inode", "u8"), ("mtime", "f8")]
)


class StatTable:
    """`file_stats` held as two arrays, the names (bytes) sorted and a row of numbers each: about
    the name's length plus 40 bytes a file, where the dict takes about 500 (a string, a tuple and
    five numbers, each an object). The mid-run guard keeps one for the whole run, and an image
    folder's files are most of it: prepare's memory then grows with the folder by little more
    than the names (bench/prepare_memory_bench.py)."""

    def __init__(self, paths):
        names, numbers, mtimes = [], [], []  # no tuple a file, even for a moment
        for f, s in iter_stats(paths):
            names.append(os.fsencode(f))
            numbers.extend(s[:4])
            mtimes.append(s.mtime)
        self.names = np.array(names, dtype=bytes)
        self.rows = np.zeros(len(names), dtype=STAT_ROW)
        for i, field in enumerate(STAT_ROW.names[:4]):
            self.rows[field] = numbers[i::4]
        self.rows["mtime"] = mtimes
        order = np.argsort(self.names)
        self.names, self.rows = self.names[order], self.rows[order]

    def __len__(self) -> int:
        return len(self.names)

    def find(self, name: str) -> int | None:
        """The row of file `name`, or None."""
        key = os.fsencode(name)
        i = int(np.searchsorted(self.names, key))
        return i if i < len(self.names) and self.names[i] == key else None

    def stat(self, i: int) -> Stat:
        return Stat(*self.rows[i].tolist())

    def name(self, i: int) -> str:
        return os.fsdecode(self.names[i])


def verify_cache(cache: Path) -> list[str]:
    """Re-hash every file the manifest written by prepare lists (arrays, classes, statistics,
    preprocessing); raises DataError naming each file that differs, with both hashes, or a
    manifest that is missing or not one prepare wrote. Returns the files checked."""
    manifest_path = cache / "manifest.json"
    if not manifest_path.exists():
        raise DataError(f"{manifest_path} is missing: run `dvc repro prepare`")
    try:
        listed = json.loads(manifest_path.read_text())["files"]
        expected = {name: entry["sha256"] for name, entry in listed.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise DataError(
            f"{manifest_path} is not a manifest prepare wrote ({type(error).__name__}: {error}); "
            f"`dvc checkout {cache}` or `dvc repro --force prepare`"
        ) from None
    bad = []
    for name, sha256 in expected.items():
        path = cache / name
        actual = file_hash(path) if path.exists() else "missing"
        if actual != sha256:
            bad.append(f"{path}: sha256 {actual}, manifest says {sha256}")
    if bad:
        raise DataError(
            "the prepared cache is corrupted: " + "; ".join(bad) + ". Restore it with "
            f"`dvc checkout {cache}` or rebuild it with `dvc repro --force prepare`"
        )
    return [str(cache / name) for name in expected]


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: keys as params.yaml and `dvc metrics show` name them."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat
