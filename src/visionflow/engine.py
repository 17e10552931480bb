"""The training loop, by hand: `train_one_epoch` and `evaluate` over in-memory uint8 tensors.

Batches are sliced from the cache held on the device, then augmented and normalised there. One AMP
path: `torch.autocast(..., enabled=...)` and a `GradScaler(enabled=...)` that is a no-op unless fp16.
"""

import math
import time
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from visionflow import faults
from visionflow.data import batches, normalise, to_model_input, to_unit


class NonFiniteLoss(RuntimeError):
    """Too many non-finite losses in a row; the message names the epoch and step."""


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


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `train.amp`, or None for full precision.

    `auto` is bf16 on a GPU that supports it (fp16 on older ones) and off on the CPU, where
    autocast rarely pays for small convolutions; `bf16` on the CPU runs the same code path in CI.
    """
    if amp == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[amp]


def make_optimizer(
    name: str, model: nn.Module, lr: float, weight_decay: float, momentum: float, nesterov: bool
) -> torch.optim.Optimizer:
    # fused: one kernel for the whole update instead of a loop of small ones per parameter (on 2
    # CPU cores Adam's step took 0.25 ms instead of 0.75 ms for SimpleCNN); the same update rule
    params = model.parameters()
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov,
                               weight_decay=weight_decay, fused=True)  # fmt: skip
    optimizers = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    return optimizers[name](params, lr=lr, weight_decay=weight_decay, fused=True)


def make_scheduler(
    name: str, optimizer: torch.optim.Optimizer, epochs: int, patience: int, factor: float,
    step_size: int,
):  # fmt: skip
    """Stepped once per epoch; `plateau` on the validation loss (see `step_scheduler`)."""
    if name == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=factor,
                                                          patience=patience)  # fmt: skip
    if name == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    if name == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=factor)
    return None


def step_scheduler(scheduler, val_loss: float) -> None:
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(val_loss)
    elif scheduler is not None:
        scheduler.step()


def grad_norms(model: nn.Module) -> dict[str, float]:
    """L2 norm of each parameter's gradient, by name (an exploding or vanishing layer shows)."""
    return {
        name: p.grad.norm().item() for name, p in model.named_parameters() if p.grad is not None
    }


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
    *,
    scaler: torch.amp.GradScaler | None = None,
    dtype: torch.dtype | None = None,
    accumulate: int = 1,
    grad_clip: float = 0.0,
    label_smoothing: float = 0.0,
    max_nonfinite: int = 5,
    epoch: int = 0,
    layer_norm_every: int = 50,
    rank: int = 0,
    world: int = 1,
    record_losses: int = 0,
) -> dict:
    """One shuffled pass; returns mean train loss and accuracy, gradient norms and counts.

    `augment` maps float NCHW images in 0..1 to augmented ones, before normalisation. The loss of
    each micro-batch is divided by `accumulate`, so `accumulate` steps of batch b equal one of
    batch `accumulate * b`. A non-finite loss skips its optimizer step; `max_nonfinite` in a row
    raise NonFiniteLoss. The global gradient norm (every step when clipping) and per-layer norms
    are sampled every `layer_norm_every` optimizer steps. The losses and label counts of the first
    `record_losses` batches are returned for the health checks, and the seconds spent waiting for
    batches (`data_seconds`) beside the epoch's.
    """
    model.train()
    scaler = scaler or torch.amp.GradScaler(enabled=False)
    total_loss, correct, seen, steps, skipped, in_a_row = 0.0, 0, 0, 0, 0, 0
    norms: list[float] = []
    layers: dict[str, float] = {}
    first_losses: list[float] = []
    first_labels: Counter[int] = Counter()
    data_seconds, started = 0.0, time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    progress = tqdm(batches(x, y, batch_size, generator, rank, world, mean.device),
                    total=math.ceil(len(x) / world / batch_size),
                    desc=f"epoch {epoch}", unit="batch", leave=False, disable=None)  # fmt: skip
    source, i = iter(progress), -1
    while True:
        wait = time.perf_counter()
        try:
            xb, yb = next(source)
        except StopIteration:
            break
        i += 1
        if faults.ACTIVE:  # `sleep` here stands for a slow loader
            faults.fault("train.batch", epoch=epoch, step=i + 1)
        data_seconds += time.perf_counter() - wait
        images = to_unit(xb)
        if augment is not None:
            images = augment(images)
        with torch.autocast(
            mean.device.type, dtype=dtype or torch.float32, enabled=dtype is not None
        ):
            logits = model(normalise(images, mean, std))
            loss = F.cross_entropy(logits.float(), yb, label_smoothing=label_smoothing)
        if faults.ACTIVE:
            loss = faults.fault("train.loss", loss, epoch=epoch, step=i + 1, batch=len(yb))
        if i < record_losses:  # a sync per step, for the first steps only
            first_losses.append(loss.item())
            first_labels.update(yb.tolist())
        finite = torch.isfinite(loss.detach()).to(torch.int32)
        if world > 1:  # every rank must skip together, or DDP's gradient all-reduce would hang
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite:
            skipped, in_a_row = skipped + 1, in_a_row + 1
            optimizer.zero_grad(set_to_none=True)
            if in_a_row >= max_nonfinite:
                raise NonFiniteLoss(f"loss was not finite for {in_a_row} steps in a row "
                                    f"(epoch {epoch}, step {i + 1}); stopping")  # fmt: skip
            continue
        in_a_row = 0
        scaler.scale(loss / accumulate).backward()
        total_loss += loss.detach() * len(yb)  # tensors: no device sync per step
        correct += (logits.argmax(1) == yb).sum()
        seen += len(yb)
        if (i + 1) % accumulate == 0:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            if steps % layer_norm_every == 0:  # sampled: norms cost a pass over the gradients
                layers = grad_norms(model)
            if grad_clip or steps % layer_norm_every == 0:
                norm = nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf)
                norms.append(norm.item())
            scale = scaler.get_scale()
            scaler.step(optimizer)  # skipped by the scaler when fp16 gradients overflowed
            scaler.update()
            skipped += int(scaler.is_enabled() and scaler.get_scale() < scale)
            optimizer.zero_grad(set_to_none=True)
            steps += 1
    if world > 1:  # sums over all ranks' shards
        totals = torch.tensor([float(total_loss), float(correct), seen], device=mean.device)
        dist.all_reduce(totals)
        total_loss, correct, seen = totals[0], totals[1], int(totals[2])
    return {
        "loss": float(total_loss) / max(seen, 1),
        "accuracy": int(correct) / max(seen, 1),
        "grad_norm": sum(norms) / max(len(norms), 1),
        "steps": steps,
        "skipped_steps": skipped,
        "images": seen,
        "layer_grad_norms": layers,
        "first_losses": first_losses,
        "first_labels": dict(sorted(first_labels.items())),
        "data_seconds": data_seconds,
        "seconds": time.perf_counter() - started,
    }


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
    for xb, yb in batches(x, y, batch_size, device=mean.device):
        logits = model(to_model_input(xb, mean, std))
        total_loss += F.cross_entropy(logits, yb, reduction="sum").item()
        outputs.append(logits.float().cpu())
    logits = torch.cat(outputs)
    accuracy = (logits.argmax(1) == y.cpu()).float().mean().item()
    return {"loss": total_loss / len(y), "accuracy": accuracy}, logits
