"""Resumable training state: one file per epoch, written atomically, read with weights_only=True.

A checkpoint is a plain dict (tensors, numbers, strings, lists): model, optimizer, scheduler and
scaler state, epoch, best metric, RNG states, the metric history (so curves survive a resume) and a
fingerprint of the params, data and code it was trained with. Each fingerprint has its own folder,
so a run never resumes, rotates or deletes another configuration's files; the newest KEEP_RUNS
folders are kept. An unreadable checkpoint (a killed write, a truncated file) falls back to the
one before. Each folder's run.json holds what its fingerprint was made of, so a run that cannot
resume another folder's checkpoint can say which key changed.

The best model so far is `best-<epoch>.pt`, written before the epoch's checkpoint, which names
the best epoch; older best files go only after that checkpoint is written. So a kill between the
two writes leaves the previous checkpoint with the best file it names, and a resumed run never
pairs a checkpoint with another epoch's model.
"""

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import torch

from visionflow.data.files import flatten
from visionflow.train.models import save_atomic

KEEP = 2  # newest checkpoints kept in a fingerprint's folder; older ones go after each save
KEEP_RUNS = 3  # fingerprint folders kept (the current one and the newest others)
RUN_FILE = "run.json"  # in a fingerprint's folder: what the fingerprint was made of


def fingerprint(run: dict) -> str:
    """A short hash of what a run depends on. `run` holds plain values: params under their keys
    (`{"seed": 0, "train": {...}}`) and content hashes under `hashes` (data, code, ...)."""
    return hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()[:16]


def write_run(folder: Path, run: dict) -> None:
    """Keep `run` (what the folder's fingerprint was made of) in the folder, made if needed."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{RUN_FILE}.tmp"
    try:
        tmp.write_text(json.dumps(run, indent=2, sort_keys=True) + "\n")
        tmp.replace(folder / RUN_FILE)
    finally:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written file


def changes(old: dict, new: dict) -> list[str]:
    """What differs between two runs' descriptions, one phrase each: `train.lr 0.001 -> 0.003`,
    `the data`. Keys only one of them has (a key left out of one's fingerprint) are not compared."""
    before, after = flatten(old), flatten(new)
    found = []
    for key in sorted(before.keys() & after.keys()):
        if before[key] == after[key]:
            continue
        if key.startswith("hashes."):
            found.append(f"the {key.removeprefix('hashes.')}")
        else:
            found.append(f"{key} {json.dumps(before[key])} -> {json.dumps(after[key])}")
    return found


def reason_not_resumed(root: Path, keep: Path, run: dict, notes: dict[str, str]) -> str | None:
    """Why `run`, which has no checkpoint of its own (in `keep`), starts fresh: what changed since
    the newest other folder under `root` with a checkpoint and a run.json, e.g. `train.lr 0.001 ->
    0.003 changed since the checkpoint in <folder>`, with `notes[key]` for the keys changed; None
    when there is no such folder."""
    others = [p for p in root.glob("*") if p.is_dir() and p != keep] if root.is_dir() else []
    for other in sorted(others, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            old = json.loads((other / RUN_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not any(other.glob("epoch-*.pt")):
            continue
        found = changes(old, run) or ["the params"]
        because = "".join(
            f" ({note})"
            for key, note in notes.items()
            if any(c.startswith(f"{key} ") for c in found)
        )
        return f"{', '.join(found)} changed since the checkpoint in {other}{because}"
    return None


def best_file(folder: Path, epoch: int) -> Path:
    return folder / f"best-{epoch:04d}.pt"


def save_checkpoint(folder: Path, state: dict) -> Path:
    """Write the epoch's checkpoint, then drop the checkpoints beyond the newest KEEP and the best
    files that none of those kept names: a fallback to an older checkpoint (the newest one
    unreadable) finds the best file it names (it was deleted, and the run started fresh)."""
    path = folder / f"epoch-{state['epoch']:04d}.pt"
    save_atomic(state, path, epoch=state["epoch"])  # makes the folder again if it was deleted
    for old in sorted(folder.glob("epoch-*.pt"))[:-KEEP]:
        old.unlink()
    if "best" in state:
        kept = [int(p.stem.removeprefix("epoch-")) for p in folder.glob("epoch-*.pt")]
        named = {best_as_of(state.get("history", []), epoch) for epoch in kept}
        wanted = {best_file(folder, e) for e in named | {state["best"]["epoch"]}}
        for old in folder.glob("best-*.pt"):
            if old not in wanted:
                old.unlink(missing_ok=True)
    return path


def best_as_of(history: list[dict], epoch: int) -> int:
    """The best epoch (by val accuracy, the first of equals: `Progress.update`) of the first
    `epoch` records: the best file that epoch's checkpoint names."""
    best, at = -1.0, 0
    for number, record in enumerate(history[:epoch], 1):
        if record["val/accuracy"] > best:
            best, at = record["val/accuracy"], number
    return at


def load_latest(folder: Path, expected: str, map_location) -> tuple[dict | None, str]:
    """The newest readable checkpoint with the expected fingerprint, and a line saying why (an
    unreadable newer one is a warning: a kill mid-write, a damaged disk)."""
    for stray in folder.glob(".*.tmp"):  # left by a write that was killed
        stray.unlink()
    for path in sorted(folder.glob("epoch-*.pt"), reverse=True):
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)
            if not (isinstance(state, dict) and {"epoch", "model", "fingerprint"} <= state.keys()):
                raise ValueError("not a visionflow checkpoint")
        except Exception as error:  # truncated or corrupt: any unpickling error
            reason = str(error).split(". ")[0]  # not torch's advice to load it unsafely
            warnings.warn(
                f"checkpoint {path} is unreadable ({type(error).__name__}: {reason}); "
                "falling back to the previous one",
                stacklevel=2,
            )
            continue
        if state.get("fingerprint") != expected:
            return None, (
                f"not resuming {path}: it was trained with other params or data "
                f"(fingerprint {state.get('fingerprint')} != {expected}); starting fresh"
            )
        return state, f"resuming from {path} (epoch {state['epoch']} done)"
    return None, "no checkpoint to resume for these params, data and code; starting fresh"


def prune(root: Path, keep: Path) -> list[Path]:
    """Remove the state folders of other fingerprints beyond the newest KEEP_RUNS - 1 (by mtime);
    `keep`, the current one, is never touched. Returns what was removed."""
    others = [p for p in root.glob("*") if p.is_dir() and p != keep] if root.is_dir() else []
    others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    removed = others[KEEP_RUNS - 1 :]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def readable(path: Path) -> bool:
    """Whether a saved model file (best-NNNN.pt) loads: a truncated one must never be published."""
    try:
        torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
        return True
    except Exception:
        return False
