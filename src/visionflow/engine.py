"""The training loop, by hand: `train_one_epoch` and `evaluate` over in-memory uint8 tensors.

Batches are sliced from the cache held on the device, then normalised there (`to_model_input`).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from visionflow.data import batches, normalise, to_model_input, to_unit


def pick_device(name: str) -> torch.device:
    """`auto` takes CUDA when torch can use it, else the CPU; `cuda` without a GPU is an error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "train.device is 'cuda' but torch sees no usable GPU "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"
        )
    return torch.device(name)


def train_one_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    batch_size: int,
    generator: torch.Generator,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """One shuffled pass; returns mean train loss and accuracy over the epoch.

    `augment` maps float NCHW images in 0..1 to augmented ones, before normalisation.
    """
    model.train()
    total_loss, correct = 0.0, 0
    for xb, yb in batches(x, y, batch_size, generator):
        optimizer.zero_grad(set_to_none=True)
        images = to_unit(xb)
        if augment is not None:
            images = augment(images)
        logits = model(normalise(images, mean, std))
        loss = F.cross_entropy(logits, yb)
        loss.backward()
        optimizer.step()
        total_loss += loss.item() * len(yb)
        correct += (logits.argmax(1) == yb).sum().item()
    return {"loss": total_loss / len(y), "accuracy": correct / len(y)}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    batch_size: int,
) -> tuple[dict[str, float], torch.Tensor]:
    """Mean loss and accuracy in eval mode, plus the logits of every image (on the CPU)."""
    model.eval()
    total_loss, outputs = 0.0, []
    for xb, yb in batches(x, y, batch_size):
        logits = model(to_model_input(xb, mean, std))
        total_loss += F.cross_entropy(logits, yb, reduction="sum").item()
        outputs.append(logits.float().cpu())
    logits = torch.cat(outputs)
    accuracy = (logits.argmax(1) == y.cpu()).float().mean().item()
    return {"loss": total_loss / len(y), "accuracy": accuracy}, logits
