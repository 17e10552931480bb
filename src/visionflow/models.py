"""Models, and saving/loading them as plain dicts that `torch.load(weights_only=True)` accepts."""

import os
import tempfile
from pathlib import Path

import torch
from torch import nn


class SimpleCNN(nn.Module):
    """The classic small CNN: conv 16 -> conv 32 -> fc 128 -> classes (logits)."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int, dropout: float = 0.25):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = image_size // 4  # two 2x2 poolings
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * side * side, 128),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


MODELS = {"simple_cnn": SimpleCNN}


def build_model(
    name: str, in_channels: int, num_classes: int, image_size: int, dropout: float = 0.0
) -> nn.Module:
    """Build a model and prove with one dummy forward that the shapes fit."""
    model = MODELS[name](in_channels, num_classes, image_size, dropout)
    dummy = torch.zeros(2, in_channels, image_size, image_size)
    try:
        with torch.no_grad():
            logits = model.eval()(dummy)
    except RuntimeError as e:
        raise ValueError(f"{name} does not fit input {tuple(dummy.shape)}: {e}") from None
    if logits.shape != (2, num_classes):
        raise ValueError(
            f"{name} gives {tuple(logits.shape)} for input {tuple(dummy.shape)}, "
            f"expected (2, {num_classes})"
        )
    return model.train()


def save_atomic(obj: dict, path: Path) -> None:
    """torch.save to a temp file in the same folder, fsync, then rename: never a half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_model(model: nn.Module, meta: dict, path: Path) -> None:
    """`meta` holds plain Python values only: what is needed to rebuild and feed the model."""
    save_atomic({"state_dict": model.state_dict(), "meta": meta}, path)


def load_model(path: Path, map_location: str | torch.device = "cpu") -> tuple[nn.Module, dict]:
    """Rebuild the model saved by `save_model`, in eval mode, with its meta."""
    saved = torch.load(path, map_location=map_location, weights_only=True)
    meta = saved["meta"]
    model = build_model(
        meta["model"],
        meta["in_channels"],
        len(meta["classes"]),
        meta["image_size"],
        meta["dropout"],
    )
    model.load_state_dict(saved["state_dict"])
    return model.eval(), meta
