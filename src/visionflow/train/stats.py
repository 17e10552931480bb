"""What an epoch of `engine.train_one_epoch` measures, and nothing it decides: `EpochStats` keeps
the loss, accuracy and image sums, the first losses and labels, gradient norms and the step's
finiteness on the device, read once at the epoch's end, beside the seconds waiting for batches
and those of the first steps."""

import math
import time
from collections import Counter
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from tqdm import tqdm

from visionflow import faults

LAYER_NORM_EVERY = 50  # optimizer steps between samples of the per-layer gradient norms


WARMUP_STEPS = 5  # optimizer steps timed apart at an epoch's start: on a GPU the first ones load
# kernels, autotune cuDNN and grow the allocator's pool (epoch 1's rate was a tenth of the next)


class EpochStats:
    """What the loop measures, and nothing it decides: loss, accuracy and image sums, the first
    losses and labels, gradient norms (all on the device, read once at the epoch's end), the
    step's finiteness so far, steps taken and skipped, the seconds waiting for batches (with their
    progress bar) and those of the first WARMUP_STEPS steps."""

    def __init__(self, step, split, epoch: int, record: int):
        """`step`: the engine's Step (batch size, accumulation); `split`: its Split (labels, rank)."""
        self.step, self.epoch, self.record = step, epoch, record
        self.rank, self.world = split.rank, split.world
        self.images = len(split.y) // split.world  # this rank's shard (`batches`)
        self.sums = torch.zeros(3, device=split.mean.device)  # loss sum, correct, images
        self.steps = self.skipped = self.in_a_row = self.micro_batches = 0
        self.norms: list[torch.Tensor] = []
        self.layers: dict[str, torch.Tensor] = {}
        self.first_losses: list[torch.Tensor] = []
        self.first_labels: list[torch.Tensor] = []
        self.finite: torch.Tensor | None = None  # the step's losses so far, all finite
        self.data_seconds, self.started = 0.0, time.perf_counter()
        self.warmup = (0.0, 0)  # seconds and this rank's images of the first WARMUP_STEPS steps
        self.fed_steps = self.fed_images = 0  # steps and this rank's images so far, skipped too

    @property
    def where(self) -> str:
        return f"epoch {self.epoch}, micro-batch {self.micro_batches}"

    def groups(self, batches: Iterable, accumulate: int) -> Iterator[list]:
        """The micro-batches of each optimizer step: `accumulate` of them, the last step's what
        is left. The wait for each counts as data time, shown as progress in a terminal. (An
        out-of-memory while a batch is sliced, a small share of a step's memory, is raised.)"""
        group = []
        for batch in self.timed(batches):
            group.append(batch)
            if len(group) == accumulate:
                yield group
                self.fed(group)
                group = []
        if group:
            yield group
            self.fed(group)

    def fed(self, group: list) -> None:
        """After each step, taken or skipped: its images (as they came: a last step may be
        short); the WARMUP_STEPS-th ends the warm-up."""
        self.fed_steps += 1
        self.fed_images += sum(len(y) for _, y in group)
        if self.fed_steps == WARMUP_STEPS:
            self.warmed_up(group[-1][1].device)

    def warmed_up(self, device: torch.device) -> None:
        """The time of the first steps: the epoch's one sync besides its end's, so that the
        clock reads the GPU's work, not how far ahead the host has queued it."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "mps":
            torch.mps.synchronize()
        self.warmup = (time.perf_counter() - self.started, self.fed_images)

    def timed(self, batches: Iterable) -> Iterator:
        total = math.ceil(self.images / self.step.batch_size)  # micro-batches in the epoch
        progress = tqdm(
            batches,
            total=total,
            desc=f"epoch {self.epoch}",
            unit="batch",
            leave=False,
            disable=None,
        )
        source, fetched = iter(progress), 0
        while True:
            wait = time.perf_counter()
            batch = next(source, None)
            if batch is None:
                return
            fetched += 1
            if faults.ACTIVE:  # `sleep` here stands for a slow loader
                faults.fault("train.batch", epoch=self.epoch, step=fetched)
            self.data_seconds += time.perf_counter() - wait
            yield batch

    def micro_batch(self, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor):
        """Counts one micro-batch's loss and correct answers (a non-finite one counts 0). `y`:
        class indices, or a mixed batch's soft targets: then each image's label is its larger
        share (`augment.mixing`), for the accuracy and the health checks."""
        y = y if y.ndim == 1 else y.argmax(1)
        self.micro_batches += 1
        if faults.ACTIVE:
            where = {"epoch": self.epoch, "step": self.micro_batches, "batch": len(y)}
            loss = faults.fault("train.loss", loss, **where, rank=self.rank)
        if len(self.first_losses) < self.record:  # kept on the device, read at the epoch's end
            self.first_losses.append(loss.detach().float())
            self.first_labels.append(y)
        ok = torch.isfinite(loss.detach())
        self.finite = ok if self.finite is None else self.finite & ok
        counts = (
            loss.detach().nan_to_num(0.0, 0.0, 0.0) * len(y),
            (logits.argmax(1) == y).sum(),
            torch.full((), len(y), device=y.device),
        )
        self.sums += ok * torch.stack([c.to(self.sums) for c in counts])
        return loss

    def take_finite(self) -> torch.Tensor | None:
        """Whether the step's losses were all finite (on the device); a new step begins."""
        finite, self.finite = self.finite, None
        return finite

    @property
    def sample(self) -> bool:
        """Whether this step measures the per-layer norms: they cost a pass over the gradients;
        the first step that went through (an fp16 overflow at step 0 measures nothing) always."""
        return not self.layers or self.steps % LAYER_NORM_EVERY == 0

    def stepped(self, norm: torch.Tensor | None, layers: dict[str, torch.Tensor]) -> None:
        self.layers = layers or self.layers
        self.norms += [norm] if norm is not None else []
        self.steps, self.in_a_row = self.steps + 1, 0

    def overflowed(self) -> None:
        """An fp16 overflow (the scaler calibrating its scale, not the model's gradients):
        counted as a step and a skipped one, and never measured as a gradient norm."""
        self.skipped, self.steps, self.in_a_row = self.skipped + 1, self.steps + 1, 0

    def nonfinite(self) -> int:
        """Counts a step skipped for a non-finite loss; returns how many in a row."""
        self.skipped, self.in_a_row = self.skipped + 1, self.in_a_row + 1
        return self.in_a_row

    def totals(self, out_of_memory: bool) -> dict:
        """Mean train loss and accuracy over every rank's images, gradient norms, counts, the
        first losses and labels, the seconds waiting for data (`data_seconds`) beside the
        epoch's, and those of the first steps (`warmup_seconds`, over `warmup_images` of this
        rank's); `out_of_memory`, whether any rank's was, goes with the sums' one all-reduce.
        The epoch's one read of what stayed on the device."""
        device = self.sums.device
        memory = torch.full((1,), float(out_of_memory), device=device)
        totals = torch.cat([self.sums, memory])
        if self.world > 1:  # sums over all ranks' shards
            dist.all_reduce(totals)
        measured = [*self.norms, *self.layers.values(), *self.first_losses]
        values = (
            torch.cat([totals, torch.stack(measured).float().to(device)]) if measured else totals
        )
        loss_sum, correct, seen, out_of_memory, *rest = values.tolist()
        norms, rest = rest[: len(self.norms)], rest[len(self.norms) :]
        layers = dict(zip(self.layers, rest[: len(self.layers)], strict=True))
        labels = torch.cat(self.first_labels).tolist() if self.first_labels else []
        return {
            "loss": loss_sum / max(seen, 1),
            "accuracy": correct / max(seen, 1),
            "grad_norm": sum(norms) / max(len(norms), 1),
            "steps": self.steps,
            "skipped_steps": self.skipped,
            "images": int(seen),
            "layer_grad_norms": layers,
            "first_losses": rest[len(self.layers) :],
            "first_labels": dict(sorted(Counter(labels).items())),
            "data_seconds": self.data_seconds,
            "seconds": time.perf_counter() - self.started,
            "warmup_seconds": self.warmup[0],
            "warmup_images": self.warmup[1] * self.world,  # every rank's
            "fed_images": self.fed_images * self.world,  # the steps' images, skipped ones too
            "out_of_memory": bool(out_of_memory),
        }
