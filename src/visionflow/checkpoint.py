"""Resumable training state: one file per epoch, written atomically, read with weights_only=True.

A checkpoint is a plain dict (tensors, numbers, strings, lists): model, optimizer, scheduler and
scaler state, epoch, best metric, RNG states, the metric history (so curves survive a resume) and a
fingerprint of the params and data it was trained on. A checkpoint with another fingerprint is not
resumed; an unreadable one (a killed write, a truncated file) falls back to the one before.
"""

import hashlib
import json
import warnings
from pathlib import Path

import torch

from visionflow.models import save_atomic

KEEP = 2  # newest checkpoints kept; older ones are removed after each save


def fingerprint(params: dict, data_manifest: str) -> str:
    """What a run depends on: its params (as a sorted JSON) and the cache's manifest text."""
    text = json.dumps(params, sort_keys=True) + "\n" + data_manifest
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def save_checkpoint(folder: Path, state: dict) -> Path:
    path = folder / f"epoch-{state['epoch']:04d}.pt"
    save_atomic(state, path, epoch=state["epoch"])
    for old in sorted(folder.glob("epoch-*.pt"))[:-KEEP]:
        old.unlink()
    return path


def load_latest(folder: Path, expected: str, map_location) -> tuple[dict | None, str]:
    """The newest readable checkpoint with the expected fingerprint, and a line saying why."""
    for stray in folder.glob(".epoch-*.tmp"):  # left by a write that was killed
        stray.unlink()
    for path in sorted(folder.glob("epoch-*.pt"), reverse=True):
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)
        except Exception as e:  # truncated or corrupt: any unpickling error
            warnings.warn(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); "
                          "falling back to the previous one", stacklevel=2)  # fmt: skip
            continue
        if state.get("fingerprint") != expected:
            return None, (f"not resuming {path}: it was trained with other params or data "
                          f"(fingerprint {state.get('fingerprint')} != {expected}); starting fresh")  # fmt: skip
        return state, f"resuming from {path} (epoch {state['epoch']} done)"
    return None, "no checkpoint to resume; starting fresh"


def clear(folder: Path, summary: dict) -> None:
    """After a completed run: nothing left to resume; `last_run.json` says how it ended."""
    for path in folder.glob("epoch-*.pt"):
        path.unlink()
    (folder / "last_run.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
