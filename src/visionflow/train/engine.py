"""The training loop, by hand: `train_one_epoch` and `evaluate` over uint8 splits (held on the
device, or memory-mapped).

Batches are sliced from the cache held on the device, then augmented and normalised there. One AMP
path: `torch.autocast(..., enabled=...)` and a `GradScaler(enabled=...)` that is a no-op unless fp16.
A step reads one value on the host (whether its losses were finite, to skip it if not); fp16 reads
one more (the scaler's overflow). Every other number stays on the device until the epoch's end.
"""

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from visionflow.errors import NonFiniteLoss, Unavailable
from visionflow.train.loading import batches, normalise, to_model_input, to_unit
from visionflow.train.stats import EpochStats


def pick_device(name: str) -> torch.device:
    """`auto` takes CUDA when torch can use it, else Apple's GPU (`mps`) where torch has it, else
    the CPU; `cuda` or `mps` without it is Unavailable."""
    mps = torch.backends.mps.is_available()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"
    if name == "mps" and not mps:
        raise Unavailable(
            f"torch sees no Apple GPU (torch {torch.__version__}: MPS needs macOS 12.3+ on Apple "
            "silicon, and a build with it); use auto (falls back to the CPU)"
        )
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


# What `auto` picks per model on a GPU, from measurements on an H200 (bench/gpu_bench.py, 32 px,
# batch 512; docs/benchmarks.md, "GPU"): simple_cnn trained fastest in fp32 with the default
# memory format, bf16 and channels_last slower: its two small convolutions gain nothing from tensor
# cores and pay for the casts and the layout. small_resnet gained with bf16 + channels_last
# (cuDNN's tensor-core convolutions want NHWC); torchvision's networks are fine-tuned that way.
FP32_ON_A_GPU = {"simple_cnn"}


def speed_settings(
    amp: str, channels_last: bool | str, model: str, device: torch.device
) -> tuple[torch.dtype | None, bool, str]:
    """(autocast dtype or None, channels_last, why) for `train.amp` and `train.channels_last`.

    `auto` picks what was measured faster for this model on this device: on the CPU no autocast
    and channels_last (NHWC was the faster layout for convolutions on 2 cores); on a GPU fp32
    and the default layout for FP32_ON_A_GPU, else bf16 (fp16 on GPUs without it) and
    channels_last. A value set in params.yaml is taken as it is."""
    fp32 = device.type == "cuda" and model in FP32_ON_A_GPU
    dtype = None if amp == "auto" and fp32 else amp_dtype(amp, device)
    nhwc = not fp32 if channels_last == "auto" else channels_last
    if "auto" not in (amp, channels_last):
        reason = "as params.yaml sets them"
    elif fp32:
        reason = f"auto: {model} trained fastest in fp32 with the default layout on a GPU"
    elif device.type == "cuda":
        reason = "auto: bf16 with channels_last trained residual networks faster on a GPU"
    else:
        reason = "auto: on the CPU autocast rarely pays, and channels_last was measured faster"
    return dtype, nhwc, reason


def make_optimizer(
    name: str,
    model: nn.Module,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    groups: list[dict] | None = None,
) -> torch.optim.Optimizer:
    """`groups`: parameter groups with their own `lr` (fine-tuning: the head's, the backbone's),
    else one group of all the model's parameters."""
    # fused: one kernel for the whole update instead of a loop of small ones per parameter (a
    # third of the time for SimpleCNN's Adam step: docs/benchmarks.md); the same update rule
    params = groups or model.parameters()
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
    steps_per_epoch: int = 1,
):
    """Stepped once per epoch; `plateau` on the validation loss (see `step_scheduler`); but
    `onecycle`, stepped after each optimizer step (`per_step`): warm-up to each parameter group's
    rate, then cosine annealing, over the whole run (fastai's fit_one_cycle)."""
    if name == "onecycle":
        rates = [group["lr"] for group in optimizer.param_groups]  # each group's own peak
        total = epochs * steps_per_epoch
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, rates, total_steps=total)
    if name == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=factor, patience=patience
        )
    if name == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    if name == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=factor)
    return None


def per_step(scheduler) -> bool:
    """Whether `scheduler` steps after each optimizer step (in `train_one_epoch`), not per epoch."""
    return isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR)


def step_scheduler(scheduler, val_loss: float) -> None:
    """The epoch's step of the schedule (none for a per-step one)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(val_loss)
    elif scheduler is not None and not per_step(scheduler):
        scheduler.step()


def step_within(scheduler) -> None:
    """A per-step schedule's step; at its last rate (the run's last step, or a step more than
    the budget counted: an out-of-memory retry with half the batch) it stays there."""
    if scheduler is not None and scheduler.last_epoch < scheduler.total_steps - 1:
        scheduler.step()


def grad_norms(model: nn.Module) -> dict[str, torch.Tensor]:
    """L2 norm of each parameter's gradient, by name (an exploding or vanishing layer shows), as
    0-d tensors on the device: read at the epoch's end, not in the step.
    BatchNorm biases are left out: one whose output reaches the loss through a convolution and
    another BatchNorm (MobileNet's and EfficientNet's blocks) has no gradient by construction."""
    shifts = {
        f"{name}.bias"
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._NormBase)
    }
    return {
        name: p.grad.detach().norm()
        for name, p in model.named_parameters()
        if p.grad is not None and name not in shifts
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
    # DDP with train.auto_batch: every backward under no_sync(), the gradients all-reduced by
    # hand once every rank has said it had the memory, and an out-of-memory anywhere in a step
    # (forward, backward, the step) said to every rank at the next sync, so that all retry
    # together (a rank that raised it alone would leave the others waiting in a collective).
    # The price: the all-reduce no longer overlaps the backward.
    agree_on_memory: bool = False


@dataclass(frozen=True)
class Split:
    """A rank's shard of the training split as the loop reads it: uint8 NHWC images and labels
    (on the device, or memory-mapped), the normalisation, the shuffle (the same generator state on
    every rank), the augmentation (float NCHW in 0..1 -> augmented, before normalisation), the
    batch mixing (`augment.mixing`: images and labels -> mixed images and soft targets) and the
    shard (`batches` says how ranks share a split)."""

    x: torch.Tensor | np.ndarray
    y: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    shuffle: torch.Generator
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None
    rank: int = 0
    world: int = 1
    mix: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        device = self.mean.device
        return batches(self.x, self.y, batch_size, self.shuffle, self.rank, self.world, device)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 NHWC -> 0..1 -> augmented -> normalised: what the model is fed."""
        images = to_unit(x)
        if self.augment is not None:
            images = self.augment(images)
        return normalise(images, self.mean, self.std)

    def mixed(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the model is fed, the loss's targets): `inputs(x)` and the labels `y`, or with
        `mix` the images blended in pairs and soft targets (each row sums to 1). Mixing after
        normalising equals mixing before: a blend or a pasted box commutes with it."""
        if self.mix is None:
            return self.inputs(x), y
        return self.mix(self.inputs(x), y)


def train_one_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    split: Split,
    step: Step,
    *,
    scaler: torch.amp.GradScaler | None = None,
    epoch: int = 0,
    record_losses: int = 0,
    scheduler=None,
) -> dict:
    """One shuffled pass: for each optimizer step, for each of its micro-batches, forward, loss,
    backward; then unscale, clip, step, zero. Returns the epoch's numbers (`EpochStats.totals`).

    Each micro-batch's loss is weighted by its share of the step's images: a step is the mean
    over its images, as one big batch (equal shards per rank: DDP's mean is too). Under DDP the
    gradients are all-reduced once per step, on its last micro-batch (by hand with
    `step.agree_on_memory`: see Step). A step is not taken three ways, each its own branch: a
    non-finite loss on any rank, an fp16 overflow, out of memory (raised on every rank). The
    first `record_losses` losses and labels go to the health checks; `scheduler` (one-cycle)
    steps after each step taken."""
    model.train()
    scaler = scaler or torch.amp.GradScaler(enabled=False)
    stats, memory = EpochStats(step, split, epoch, record_losses), MemoryFlag(step.agree_on_memory)
    kept = [b.clone() for b in floating_buffers(model)]  # BatchNorm's, as each step found them
    optimizer.zero_grad(set_to_none=True)
    for group in stats.groups(split.batches(step.batch_size), step.accumulate):  # a step each
        if kept:  # one multi-tensor copy, not a kernel per buffer (ResNet-50 has 106)
            torch._foreach_copy_(kept, floating_buffers(model))
        images = sum(len(y) for _, y in group)  # this rank's; every rank has as many
        with memory.said():
            for i, (x, y) in enumerate(group):
                with sync_only_on_last(model, i == len(group) - 1 and not step.agree_on_memory):
                    inputs, targets = split.mixed(x, y)  # soft targets when batches are mixed
                    loss, logits = forward(model, inputs, targets, step)
                    loss = stats.micro_batch(loss, logits, targets)  # divided: equal ones by count
                    scaler.scale(loss / (images / len(y))).backward()
            flat = flat_gradients(model) if step.agree_on_memory else None  # it allocates
        # the step's one sync, which skipping a non-finite step needs (train.max_nonfinite_steps)
        if not all_ranks_finite(stats.take_finite(), memory, split, stats.where):
            skip_nonfinite(model, kept, stats, step.max_nonfinite)
        else:
            with memory.said():  # said at the next step's sync, or the epoch's end
                if flat is not None:
                    all_reduce_gradients(model, flat, split.world)  # what no_sync held back
                scaler.unscale_(optimizer)  # the true gradients: checked, clipped, measured
                if overflowed(optimizer, scaler):  # fp16: skipped before the optimizer sees it
                    stats.overflowed()
                else:
                    stats.stepped(*optimizer_step(model, optimizer, scaler, step, stats.sample))
                    step_within(scheduler)
                scaler.update()  # fp16: a lower scale after an overflow, higher after a good run
        optimizer.zero_grad(set_to_none=True)
    # the epoch's one sync (a last step's out-of-memory with it) before any rank raises: one that
    totals = stats.totals(memory.raised)  # raised first would leave the others in the all-reduce
    if totals.pop("out_of_memory"):
        raise torch.OutOfMemoryError(f"out of memory in epoch {epoch}'s last step")
    if stats.skipped and not stats.steps:
        raise NonFiniteLoss(f"no optimizer step of epoch {epoch} had a finite loss; stopping")
    return totals


class MemoryFlag:
    """Under `step.agree_on_memory`, an out-of-memory in a `said()` block is not raised there but
    kept, and said to every rank at the next sync (`all_ranks_finite`, or the epoch's totals),
    where all raise it together: a rank that raised it alone would retry while the others wait
    in a collective. Otherwise it is raised as it is."""

    def __init__(self, agree: bool):
        self.agree, self.raised = agree, False

    @contextmanager
    def said(self):
        try:
            yield
        except torch.OutOfMemoryError:
            if not self.agree:
                raise
            self.raised = True


def all_ranks_finite(
    finite: torch.Tensor | None, memory: MemoryFlag, split: Split, where: str
) -> bool:
    """Whether every rank's step was finite: one all-reduce of the finite and out-of-memory
    flags, so all ranks decide alike (DDP's next all-reduce would hang if one stepped and one did
    not). Out of memory on any rank raises torch.OutOfMemoryError on every rank."""
    device = split.mean.device  # made there: the all-reduce's .tolist() is the one sync
    finite = finite if finite is not None else torch.ones((), dtype=torch.bool)
    out_of_memory = torch.full((), (split.rank + 1) * memory.raised, device=device)
    flags = torch.stack([~finite.to(device), out_of_memory]).to(torch.int32)
    if split.world > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    nonfinite, rank_out_of_memory = flags.tolist()
    if rank_out_of_memory:
        raise torch.OutOfMemoryError(f"out of memory on rank {rank_out_of_memory - 1} at {where}")
    return not nonfinite


def skip_nonfinite(model: nn.Module, kept: list, stats: EpochStats, most: int) -> None:
    """A step whose loss was not finite on some rank is skipped on every rank: BatchNorm's
    statistics, which saw it in forward, are put back as the step found them (`kept`); `most`
    such steps in a row (train.max_nonfinite_steps) raise NonFiniteLoss."""
    for buffer, saved in zip(floating_buffers(model), kept, strict=True):
        buffer.copy_(saved)
    if stats.nonfinite() >= most:
        raise NonFiniteLoss(
            f"loss was not finite in {most} optimizer steps in a row ({stats.where}); stopping"
        )


def forward(model, inputs, y, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits) of one micro-batch, under the step's autocast; `y` class indices or soft
    targets (mixed batches), label smoothing applied to either."""
    with torch.autocast(
        inputs.device.type, dtype=step.dtype or torch.float32, enabled=step.dtype is not None
    ):
        logits = model(inputs)
        loss = F.cross_entropy(logits.float(), y, label_smoothing=step.label_smoothing)
    return loss, logits


def sync_only_on_last(model: nn.Module, last: bool):
    """DDP's `no_sync()` but on a step's last micro-batch: the gradients of the others add up
    on each rank, and the last backward all-reduces the sum once (not once per micro-batch)."""
    ddp = getattr(model, "_orig_mod", model)  # under torch.compile, the DDP module it wraps
    if last or not isinstance(ddp, DistributedDataParallel):
        return nullcontext()
    return ddp.no_sync()


def flat_gradients(model: nn.Module) -> torch.Tensor:
    """Every gradient in one flat tensor, for `all_reduce_gradients`."""
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def all_reduce_gradients(model: nn.Module, flat: torch.Tensor, world: int) -> None:
    """DDP's mean of the gradients over the ranks, by hand: one all-reduce of `flat`, copied
    back into the gradients."""
    dist.all_reduce(flat.div_(world))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(part.view_as(grad))


def floating_buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b for b in model.buffers() if b.is_floating_point()]


def overflowed(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> bool:
    """After `scaler.unscale_`: whether fp16 overflowed the optimizer's gradients (an inf or NaN
    in them, the scaler's own test). Such a step must not reach the optimizer: fused SGD (torch
    2.14) allocates its momentum buffers uninitialised on its first step and keeps them when the
    scaler skips it (weights reached 1.5e36), and its norms are the overflow's, not the model's.
    Under DDP the gradients are all-reduced first, so every rank decides alike."""
    if not scaler.is_enabled():
        return False
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    # fp16's one more sync per step: the decision is the host's (and GradScaler.step's own)
    return not torch.isfinite(nn.utils.get_total_norm(grads)).item()


def optimizer_step(
    model: nn.Module, optimizer, scaler, step: Step, sample: bool
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Clip and step the unscaled, finite gradients. Returns the global gradient norm (when
    clipping or sampling) and the per-layer norms (when sampling), on the device."""
    layers = grad_norms(model) if sample else {}
    norm = None
    if step.grad_clip or sample:
        norm = nn.utils.clip_grad_norm_(model.parameters(), step.grad_clip or math.inf)
    scaler.step(optimizer)
    return norm, layers


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
