"""The training loop, by hand: `train_one_epoch` and `evaluate` over in-memory uint8 tensors.

Batches are sliced from the cache held on the device, then augmented and normalised there. One AMP
path: `torch.autocast(..., enabled=...)` and a `GradScaler(enabled=...)` that is a no-op unless fp16.
"""

import math
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from visionflow import faults
from visionflow.errors import Unavailable
from visionflow.loading import batches, normalise, to_model_input, to_unit


class NonFiniteLoss(RuntimeError):
    """Too many non-finite losses in a row; the message names the epoch and step."""


def pick_device(name: str) -> torch.device:
    """`auto` takes CUDA when torch can use it, else the CPU; `cuda` without a GPU is Unavailable."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise Unavailable(
            f"torch sees no usable GPU (torch {torch.__version__}, {build}); `visionflow doctor` "
            "says why, or use auto (falls back to the CPU)"
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
        return torch.optim.SGD(
            params,
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            fused=True,
        )
    optimizers = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    return optimizers[name](params, lr=lr, weight_decay=weight_decay, fused=True)


def make_scheduler(
    name: str,
    optimizer: torch.optim.Optimizer,
    epochs: int,
    patience: int,
    factor: float,
    step_size: int,
):
    """Stepped once per epoch; `plateau` on the validation loss (see `step_scheduler`)."""
    if name == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=factor, patience=patience
        )
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


@dataclass(frozen=True)
class Step:
    """How one optimizer step is made (train.* in params.yaml): `accumulate` micro-batches of
    `batch_size`, autocast to `dtype` (None: fp32), gradients clipped to `grad_clip` (0: off)."""

    batch_size: int
    accumulate: int = 1
    grad_clip: float = 0.0
    label_smoothing: float = 0.0
    max_nonfinite: int = 5  # optimizer steps in a row with a non-finite loss before stopping
    dtype: torch.dtype | None = None


def steps_of(images: int, batch_size: int, accumulate: int) -> list[tuple[int, int]]:
    """(micro-batches, images) of each optimizer step of an epoch over `images` (a rank's
    shard): full groups of `accumulate`, the last one with what is left (44 images, batch 8,
    accumulate 2: [(2, 16), (2, 16), (2, 12)]: the last group's batches hold 8 and 4)."""
    full, rest = divmod(images, batch_size)
    sizes = [batch_size] * full + ([rest] if rest else [])
    groups = [sizes[i : i + accumulate] for i in range(0, len(sizes), accumulate)]
    return [(len(group), sum(group)) for group in groups]


def train_one_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    step: Step,
    generator: torch.Generator,
    *,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
    scaler: torch.amp.GradScaler | None = None,
    epoch: int = 0,
    rank: int = 0,
    world: int = 1,
    record_losses: int = 0,
) -> dict:
    """One shuffled pass; returns mean train loss and accuracy, gradient norms and counts.

    zero_grad -> (forward -> loss -> backward) per micro-batch -> step, once per group of
    `step.accumulate` micro-batches; each micro-batch's loss is weighted by its share of the
    group's images, so a step is the mean over its images as one big batch would take it (an
    epoch's last, short micro-batch weighs what its images weigh; under DDP every rank's shard is
    the same size, so DDP's mean over ranks is the mean over all the step's images), and under
    DDP the gradients are all-reduced on a step's last micro-batch only. Whether a group's
    losses were all finite is asked once per optimizer step (one host sync): a group with a
    non-finite loss is skipped whole, and `step.max_nonfinite` skipped steps in a row raise
    NonFiniteLoss. `augment` maps float NCHW images in 0..1 to augmented ones, before normalisation. The losses
    and label counts of the first `record_losses` micro-batches are returned for the health
    checks, and the seconds spent waiting for batches (`data_seconds`) beside the epoch's.
    """
    model.train()
    scaler = scaler or torch.amp.GradScaler(enabled=False)
    plan = steps_of(len(x) // world, step.batch_size, step.accumulate)  # as `batches` shards
    total, upcoming = sum(micro_batches for micro_batches, _ in plan), iter(plan)
    stats = torch.zeros(3, device=mean.device)  # loss sum, correct, images: summed without syncs
    steps, skipped, in_a_row, norms, layers = 0, 0, 0, [], {}
    first_losses: list[float] = []
    first_labels: Counter[int] = Counter()
    data_seconds, started = 0.0, time.perf_counter()
    progress = tqdm(
        batches(x, y, step.batch_size, generator, rank, world, mean.device),
        total=total,
        desc=f"epoch {epoch}",
        unit="batch",
        leave=False,
        disable=None,
    )
    source, i, left, finite = iter(progress), 0, 0, None
    optimizer.zero_grad(set_to_none=True)
    while True:
        wait = time.perf_counter()
        try:
            xb, yb = next(source)
        except StopIteration:
            break
        i += 1
        if faults.ACTIVE:  # `sleep` here stands for a slow loader
            faults.fault("train.batch", epoch=epoch, step=i)
        data_seconds += time.perf_counter() - wait
        if left == 0:
            left, images = next(upcoming)
            kept = [b.clone() for b in floating_buffers(model)]
        with sync_only_on_last(model, left == 1):  # DDP: one gradient all-reduce per step
            loss, logits = forward(model, xb, yb, mean, std, step, augment)
            if faults.ACTIVE:
                loss = faults.fault("train.loss", loss, epoch=epoch, step=i, batch=len(yb))
            if len(first_losses) < record_losses:  # a sync per micro-batch, the first ones only
                first_losses.append(loss.item())
                first_labels.update(yb.tolist())
            ok = torch.isfinite(loss.detach())
            finite = ok if finite is None else finite & ok
            # loss x its share of the group's images; as a division, so that a group of equal
            # micro-batches divides by their count exactly as before (bit for bit)
            scaler.scale(loss / (images / len(yb))).backward()
        loss_sum = loss.detach().nan_to_num(0.0, 0.0, 0.0) * len(yb)
        counts = (
            loss_sum,
            (logits.argmax(1) == yb).sum(),
            torch.full((), len(yb), device=yb.device),
        )
        stats += ok * torch.stack([c.to(stats) for c in counts])  # a non-finite batch counts 0
        left -= 1
        if left:
            continue
        if not all_ranks_finite(finite, world):  # the one sync of the step
            for buffer, saved in zip(floating_buffers(model), kept, strict=True):
                buffer.copy_(saved)  # BatchNorm saw the NaN in forward: as before the group
            skipped, in_a_row = skipped + 1, in_a_row + 1
            if in_a_row >= step.max_nonfinite:
                raise NonFiniteLoss(
                    f"loss was not finite in {in_a_row} optimizer steps in a row "
                    f"(epoch {epoch}, micro-batch {i}); stopping"
                )
        else:
            in_a_row = 0
            sample = steps % LAYER_NORM_EVERY == 0  # norms cost a pass over the gradients
            norm, sampled, overflowed = optimizer_step(model, optimizer, scaler, step, sample)
            layers = sampled or layers
            norms += [norm] if norm is not None else []
            skipped += overflowed
            steps += 1
        optimizer.zero_grad(set_to_none=True)
        finite = None
    if skipped and not steps:
        raise NonFiniteLoss(f"no optimizer step of epoch {epoch} had a finite loss; stopping")
    if world > 1:  # sums over all ranks' shards
        dist.all_reduce(stats)
    loss_sum, correct, seen = stats.tolist()
    return {
        "loss": loss_sum / max(seen, 1),
        "accuracy": correct / max(seen, 1),
        "grad_norm": sum(norms) / max(len(norms), 1),
        "steps": steps,
        "skipped_steps": skipped,
        "images": int(seen),
        "layer_grad_norms": layers,
        "first_losses": first_losses,
        "first_labels": dict(sorted(first_labels.items())),
        "data_seconds": data_seconds,
        "seconds": time.perf_counter() - started,
    }


LAYER_NORM_EVERY = 50  # optimizer steps between samples of the per-layer gradient norms


def forward(model, xb, yb, mean, std, step: Step, augment) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits) of one micro-batch: uint8 -> 0..1 -> augmented -> normalised -> model."""
    images = to_unit(xb)
    if augment is not None:
        images = augment(images)
    with torch.autocast(
        mean.device.type, dtype=step.dtype or torch.float32, enabled=step.dtype is not None
    ):
        logits = model(normalise(images, mean, std))
        loss = F.cross_entropy(logits.float(), yb, label_smoothing=step.label_smoothing)
    return loss, logits


def sync_only_on_last(model: nn.Module, last: bool):
    """DDP's `no_sync()` but on a step's last micro-batch: the gradients of the others add up
    on each rank, and the last backward all-reduces the sum once (not once per micro-batch)."""
    ddp = getattr(model, "_orig_mod", model)  # under torch.compile, the DDP module it wraps
    if last or not isinstance(ddp, DistributedDataParallel):
        return nullcontext()
    return ddp.no_sync()


def floating_buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b for b in model.buffers() if b.is_floating_point()]


def all_ranks_finite(finite: torch.Tensor, world: int) -> bool:
    """True when every rank's group was finite: ranks must skip together, or DDP's next gradient
    all-reduce would hang."""
    flag = finite.to(torch.int32)
    if world > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


def optimizer_step(
    model: nn.Module, optimizer, scaler, step: Step, sample: bool
) -> tuple[float | None, dict[str, float], bool]:
    """Unscale, clip, step, update the scaler. Returns the global gradient norm (when clipping
    or sampling), the per-layer norms (when sampling) and whether fp16 gradients overflowed (the
    scaler then skipped the step)."""
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    layers = grad_norms(model) if sample else {}
    norm = None
    if step.grad_clip or sample:
        clipped = nn.utils.clip_grad_norm_(model.parameters(), step.grad_clip or math.inf)
        norm = clipped.item()
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return norm, layers, scaler.is_enabled() and scaler.get_scale() < scale


def sync_buffers(model: nn.Module, world: int) -> None:
    """Under DDP, every rank takes rank 0's buffers (BatchNorm's running statistics, which each
    rank updated from its own shard), so all ranks evaluate the model rank 0 saves, get the same
    numbers and take the same plateau and early-stop decisions."""
    if world > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


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
