"""Training health: the checklist an experienced engineer runs when training goes wrong, run by
the train stage on itself, in plain words and with the numbers.

Each check reads numbers the loop already has (per-epoch records, the losses and labels of the
first steps, per-layer gradient norms, time spent waiting for data) and returns a Finding or
None. Causes are named in the order the checklist teaches: data and labels first, then
preprocessing, output shapes and loss, learning rate, optimiser, and the architecture last.
docs/troubleshooting.md says what to change for each. The data-bound check reads the clock: its
report goes with the run's timings (`Monitor.timings`), not into health.json, a DVC output that the
same code, data and params must give byte for byte.
"""

import math
from dataclasses import asdict, dataclass
from statistics import fmean

from visionflow.train.epoch_health import (
    Finding,
    Guess,
    at_chance,
    diverging,
    guess,
    overfitting,
    ruined_fine_tune,
)

CHECKS = (
    "loss_not_falling",
    "diverging",
    "at_chance",
    "gradients",
    "overfitting",
    "out_of_memory",
    "ruined_fine_tune",
)
# A check that reads the clock: its finding and numbers differ between two runs of the same code,
# data and params, so they go with the run's timings (Monitor.timings), never into health.json
TIMED = "data_bound"
LAYER_SCALE = "layer_scale"  # the per-channel scale of a block's branch (torchvision's ConvNeXt)


def data_bound(
    epoch: int, data_s: float, epoch_s: float, limit: float, mapped: bool
) -> Finding | None:
    share = data_s / epoch_s if epoch_s > 0 else 0.0
    if share <= limit:
        return None
    where = (
        "the split is memory-mapped and read by DataLoader workers: raise train.max_memory_gb so "
        "it is held on the device, or put the cache on faster storage"
        if mapped
        else "the split is already held on the device: look for a slow augmentation or a busy machine"
    )
    return Finding(
        "data_bound",
        epoch,
        f"data-bound: the loop waited for data {share:.0%} of epoch "
        f"{epoch} ({data_s:.1f} of {epoch_s:.1f} s, over train.health.data_bound "
        f"{limit:.0%}); {where}. Pinned memory and more loader workers help when the "
        "data comes from disk",
        {"data_wait_fraction": share},
    )


def loss_drop(losses: list[float], floor: float = 0.0) -> tuple[float, float, float]:
    """Mean loss of the first and last fifth of `losses`, and the share of the way it fell
    between them towards `floor` (the least loss there is: 0, or more under label smoothing).
    A step skipped for a NaN loss is no measure: only finite losses count, but a last fifth
    with none is NaN (diverging)."""
    k = max(1, len(losses) // 5)
    head = [v for v in losses[:k] if math.isfinite(v)]
    tail = [v for v in losses[-k:] if math.isfinite(v)]
    first, last = (fmean(part) if part else math.nan for part in (head, tail))
    return first, last, (first - last) / (first - floor) if first > floor else 0.0


def first_steps(
    losses: list[float],
    labels: dict,
    classes: list[str],
    lr: float,
    min_drop: float,
    guessed: Guess | None = None,  # the stage's (Monitor.chance); else balanced classes
) -> Finding | None:
    """The loss over the first steps: rising (diverging) or not falling (with the checklist)."""
    guessed = guessed or guess([1 / len(classes)] * len(classes))
    first, last, drop = loss_drop(losses, guessed.floor)
    chance = guessed.loss
    total = sum(labels.values()) or 1
    top_label, top_count = max(labels.items(), key=lambda item: item[1], default=(0, 0))
    evidence = {
        "steps": len(losses),
        "first_loss": first,
        "last_loss": last,
        "loss_drop": drop,
        "chance_loss": chance,
        "lr": lr,
        "first_labels": {classes[int(c)]: n for c, n in sorted(labels.items())},
    }
    if not math.isfinite(last) or last > first * 1.5:
        return Finding(
            "diverging",
            1,
            f"diverging: the loss rose from {first:.3g} to {last:.3g} over "
            f"the first {len(losses)} steps; the learning rate ({lr:g}) is likely too high: "
            "divide train.lr by 10, or set train.grad_clip",
            evidence,
        )
    if drop >= min_drop:
        return None
    share = top_count / total
    towards = (
        f" of the way to {guessed.floor:.3f}, label smoothing's least" if guessed.floor else ""
    )
    labels_line = (
        f"{share:.0%} of the first {total} labels are class '{classes[int(top_label)]}': is the "
        "data shuffled, are the classes balanced?"
        if share > max(0.5, 2 / len(classes))
        else f"the first {total} labels spread over {len(labels)} classes"
    )
    return Finding(
        "loss_not_falling",
        1,
        (
            f"loss not falling: {first:.3f} -> {last:.3f} over the first {len(losses)} steps "
            f"({drop:+.1%}{towards}, under train.health.min_loss_drop {min_drop:.0%}); chance "
            f"level for {len(classes)} classes is {chance:.3f}. Check, in this order: (1) data and "
            "labels: do the images in results/sanity/labels.png match their labels? "
            f"{labels_line}; (2) preprocessing: mean/std in results/sanity/scan.json; (3) output "
            f"shapes and loss: one logit per class ({len(classes)}); (4) learning rate: train.lr "
            f"{lr:g}, try 10x up and down; (5) optimiser: train.optimizer; (6) the architecture, "
            "last"
        ),
        evidence,
    )


def gradients(
    epoch: int, layer_norms: dict[str, float], high: float, low: float, frozen: bool = False
) -> Finding | None:
    """`layer_norms` are the parameters that trained (a frozen one has no gradient); `frozen`:
    the backbone was frozen (fine-tuning's first epochs), so they are the new head's (and
    BatchNorm's, with train.train_bn): no advice about the backbone's layers or ReLUs then."""
    exploding = {k: v for k, v in layer_norms.items() if not math.isfinite(v) or v > high}
    scaled = behind_a_layer_scale(layer_norms, low)
    vanishing = {k: v for k, v in layer_norms.items() if v < low and k not in scaled}
    if not (exploding or vanishing):
        return None
    parts = []
    if exploding:
        parts.append(
            "exploding in "
            + ", ".join(f"{k} ({v:.3g})" for k, v in exploding.items())
            + f" (over train.health.max_grad_norm {high:g}): lower train.lr or set "
            "train.grad_clip"
        )
    if vanishing:
        dead = all(k in vanishing for k in layer_norms if k.endswith("weight"))
        parts.append(
            "vanishing in "
            + ", ".join(f"{k} ({v:.3g})" for k, v in vanishing.items())
            + f" (under train.health.min_grad_norm {low:g}): "
            + (
                "while the backbone is frozen (train.freeze_epochs), only the new head (and "
                "BatchNorm's scales, train.train_bn) trains: the frozen backbone gives it next "
                "to nothing to learn from, so its weights or their preprocessing do not suit "
                "these images; check train.pretrained, or set train.freeze_epochs to 0 to train "
                "the backbone too"
                if frozen
                else "every weight: the network has stopped learning, typically dead ReLUs "
                "after a learning rate far too high; lower train.lr"
                if dead
                else "these layers barely learn; try a ResNet (skip connections) or a higher "
                "train.lr"
            )
        )
    return Finding(
        "gradients",
        epoch,
        f"gradients at epoch {epoch}: " + "; ".join(parts),
        {"exploding": exploding, "vanishing": vanishing},
    )


def behind_a_layer_scale(layer_norms: dict[str, float], low: float) -> set[str]:
    """The parameters of blocks whose branch a layer scale multiplies (ConvNeXt's, torchvision's
    `<block>.layer_scale`: 1e-6 per channel at the start, by design), while that scale's own
    gradient does not vanish: theirs are the scale times what they would be, tiny until it
    grows, and the scale's gradient is the one that says whether the block learns (a block
    whose scale's gradient vanishes too is judged as any other)."""
    blocks = tuple(
        k.removesuffix(LAYER_SCALE)
        for k, v in layer_norms.items()
        if k.endswith(f".{LAYER_SCALE}") and v >= low
    )
    return {k for k in layer_norms if k.startswith(blocks) and not k.endswith(LAYER_SCALE)}


def out_of_memory(
    epoch: int, batch: int, accumulate: int, parameters: int, peak_mb: float, retry: bool
) -> Finding:
    options = (
        f"train.batch_size {batch // 2} with train.accumulate {accumulate * 2} (the same "
        "effective batch), train.amp: bf16 or fp16, train.checkpointing: true (ResNets), "
        "or train.auto_batch: true to retry so automatically"
    )
    then = (
        f"retrying once with batch_size {batch // 2} and accumulate {accumulate * 2}"
        if retry
        else f"options: {options}"
    )
    return Finding(
        "out_of_memory",
        epoch,
        f"out of memory on the GPU at epoch {epoch} with "
        f"batch_size {batch} (accumulate {accumulate}), {parameters:,} parameters, peak "
        f"{peak_mb:.0f} MB; {then}",
        {
            "batch_size": batch,
            "accumulate": accumulate,
            "parameters": parameters,
            "peak_memory_mb": peak_mb,
            "retried": retry,
        },
    )


@dataclass(frozen=True)
class Limits:
    """What the checks judge by: plain values (train.health in params.yaml; the stage passes them)."""

    first_steps: int  # the losses of this many first optimizer steps are judged
    min_loss_drop: float  # share the loss must fall by over those steps
    data_bound: float  # share of an epoch spent waiting for data that is a finding
    max_grad_norm: float  # a layer's gradient L2 norm above this is exploding
    min_grad_norm: float  # and below this vanishing
    overfit_epochs: int  # epochs in a row of rising val loss, train loss falling, that are one


class Monitor:
    """Runs the checks as training goes; reports each finding once, as it is found."""

    def __init__(self, config: Limits, classes: list[str], log=print, chance: Guess | None = None):
        self.config, self.classes, self.log = config, classes, log
        self.chance = chance or guess([1 / len(classes)] * len(classes))  # the stage's: labels
        self.findings: list[Finding] = []
        self.losses: list[float] = []
        self.labels: dict[int, int] = {}
        self.data_wait = 0.0
        self.data_bound: Finding | None = None  # TIMED's finding, apart from the others
        self.model_check: dict = {}  # a network of your own: its gradient check (fit/setup.py)

    def steps_wanted(self) -> int:
        return max(0, self.config.first_steps - len(self.losses))

    def add(self, finding: Finding | None) -> None:
        if finding and finding.check not in {f.check for f in self.findings}:
            self.findings.append(finding)
            self.log(f"health: {finding.message}")

    def epoch(
        self,
        epoch: int,
        metrics: dict,
        history: list[dict],
        lr: float,
        mapped: bool,
        frozen: bool = False,  # the backbone is frozen: the new head alone trains
    ) -> None:
        c = self.config
        self.data_wait = max(
            self.data_wait, metrics["data_seconds"] / max(metrics["seconds"], 1e-9)
        )
        if self.data_bound is None:
            found = data_bound(
                epoch, metrics["data_seconds"], metrics["seconds"], c.data_bound, mapped
            )
            self.data_bound = found
            if found:
                self.log(f"health: {found.message}")
        wanted = self.steps_wanted()
        self.losses += metrics["first_losses"][:wanted]
        for label, n in metrics["first_labels"].items():
            self.labels[label] = self.labels.get(label, 0) + n
        if wanted and not self.steps_wanted():  # a run shorter than first_steps is not judged
            found = first_steps(
                self.losses, self.labels, self.classes, lr, c.min_loss_drop, self.chance
            )
            self.add(found)
        norms = metrics["layer_grad_norms"]
        self.add(gradients(epoch, norms, c.max_grad_norm, c.min_grad_norm, frozen))
        self.add(diverging(history, math.log(len(self.classes))))
        if "loss_not_falling" not in {f.check for f in self.findings}:  # that one says it
            stuck = at_chance(history, self.chance)
            self.add(stuck)
            if stuck is None and "at_chance" in {f.check for f in self.findings}:  # it learns now
                self.findings = [f for f in self.findings if f.check != "at_chance"]
                loss = min(h["train/loss"] for h in history)
                best = max(h.get("val/accuracy", 0.0) for h in history)
                memorising = "" if best > self.chance.above else ": memorising the training images?"
                self.log(
                    f"health: no longer at chance level at epoch {epoch}: train loss {loss:.3f} "
                    f"(a guess's {self.chance.loss:.3f}), val accuracy {best:.2f} (a guess's "
                    f"{self.chance.accuracy:.2f}){memorising}"
                )
        self.add(overfitting(history, c.overfit_epochs))
        self.add(ruined_fine_tune(history, self.chance))

    def report(self) -> dict:
        """health.json: flat numbers first; `healthy` and `findings` also go to the train metrics."""
        found = {f.check for f in self.findings}
        drop = loss_drop(self.losses, self.chance.floor)[2] if len(self.losses) >= 4 else 0.0
        overfit = next((f.epoch for f in self.findings if f.check == "overfitting"), 0)
        return {
            "healthy": not self.findings,
            "findings": len(self.findings),
            **{check: check in found for check in CHECKS},
            "loss_drop_first_steps": drop if math.isfinite(drop) else -1.0,
            "first_steps_seen": len(self.losses),
            "overfit_from_epoch": overfit,
            "messages": [f.message for f in self.findings],
            "details": [asdict(f) for f in self.findings],
            **self.model_check,
        }

    def timings(self) -> dict:
        """The TIMED check's report: the largest share of an epoch spent waiting for data, and
        whether it was over train.health.data_bound (not in `report`, whose bytes it would
        change from run to run)."""
        found = [asdict(self.data_bound)] if self.data_bound else []
        return {TIMED: bool(found), "data_wait_fraction": self.data_wait, "details": found}

    def summary(self, where: str, timed: str) -> str:
        """One line for the log; `where` is the health report's path, `timed` the TIMED one's."""
        seen, wanted = len(self.losses), self.config.first_steps
        checks = len(CHECKS) + 1  # and TIMED
        bound = f"; and {TIMED} ({timed})" if self.data_bound else ""
        if self.findings:
            found = "; ".join(f.check for f in self.findings)
            return (
                f"health: {len(self.findings)} finding(s): {found} ({where}; "
                f"docs/troubleshooting.md){bound}"
            )
        if self.data_bound:
            return f"health: 1 finding: {TIMED} ({timed}; docs/troubleshooting.md)"
        if seen < wanted:  # a run shorter than first_steps: that check did not run, and says so
            return (
                f"health: no finding in {checks - 1} checks; the loss over the first steps was "
                f"not judged: the run took {seen} steps (train.health.first_steps is {wanted}; "
                "more images, more epochs or a smaller train.batch_size give it more)"
            )
        drop = self.report()["loss_drop_first_steps"]
        return (
            f"health: healthy: no finding in {checks} checks (data wait {self.data_wait:.0%} at "
            f"most; loss fell {drop:.0%} over the first {seen} steps)"
        )

    def state_dict(self) -> dict:
        return {
            "findings": [asdict(f) for f in self.findings],
            "losses": self.losses,
            "labels": self.labels,
            "data_wait": self.data_wait,
            "data_bound": asdict(self.data_bound) if self.data_bound else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.findings = [Finding(**f) for f in state["findings"]]
        self.losses, self.labels, self.data_wait = (
            state["losses"],
            state["labels"],
            state["data_wait"],
        )
        self.data_bound = Finding(**state["data_bound"]) if state["data_bound"] else None
