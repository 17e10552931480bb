"""Training health over the per-epoch history: the train loss diverging or stuck at a guess's,
validation overfitting, a fine-tune wrecked after unfreezing; and what they judge by (a Finding,
a Guess of the class shares). `health.Monitor` runs them after each epoch."""

import math
from dataclasses import dataclass, field
from itertools import pairwise, takewhile


@dataclass
class Finding:
    check: str  # one of CHECKS
    epoch: int
    message: str
    evidence: dict = field(default_factory=dict)


def entropy(shares: list[float]) -> float:
    return sum(-p * math.log(p) for p in shares if p > 0)  # 0.0 for one class, not -0.0


@dataclass(frozen=True)
class Guess:
    """What a network that learned only the class shares scores, and the best loss there is."""

    loss: float  # its train loss: the entropy of the class shares, smoothed as the targets are
    accuracy: float  # its val accuracy: always the largest train class, as often as val has it
    floor: float  # a perfect network's train loss: 0, or the smoothed targets' own entropy

    @property
    def under(self) -> float:
        """A train loss under this is better than a guess's: 3% of the way down to the floor."""
        return self.loss - 0.03 * (self.loss - self.floor)

    @property
    def above(self) -> float:
        """A val accuracy above this is clearly a guess's beaten: a fifth of the way up to 1."""
        return self.accuracy + (1 - self.accuracy) / 5


def guess(shares: list[float], smoothing: float = 0.0, accuracy: float | None = None) -> Guess:
    """The Guess for training labels in these class shares, under train.label_smoothing; its val
    accuracy is `accuracy`, or the largest share where val's classes are spread as train's. With
    balanced classes and no smoothing: ln(classes), 1/classes and 0."""
    k, eps = len(shares), smoothing
    top = 1 - eps + eps / k  # a smoothed target: this on its class, eps/k on each other
    return Guess(
        loss=entropy([(1 - eps) * p + eps / k for p in shares]),
        accuracy=max(shares) if accuracy is None else accuracy,
        floor=entropy([top, *[eps / k] * (k - 1)]),
    )


def diverging(history: list[dict], chance: float) -> Finding | None:
    """The epoch's train loss far above chance level, or well above the best so far."""
    losses = [h["train/loss"] for h in history]
    epoch, loss = len(losses), losses[-1]
    if loss > 10 * chance or not math.isfinite(loss):
        reason = f"over 10x the chance level {chance:.3f}"
    elif len(losses) > 1 and loss > 2 * min(losses[:-1]):
        reason = f"more than twice its best {min(losses[:-1]):.3g}"
    else:
        return None
    return Finding(
        "diverging",
        epoch,
        f"diverging at epoch {epoch}: train loss {loss:.3g}, {reason}; "
        "the learning rate is likely too high: divide train.lr by 10, or set "
        "train.grad_clip",
        {"train_loss": loss, "chance_loss": chance},
    )


def at_chance(history: list[dict], chance: Guess, epochs: int = 3) -> Finding | None:
    """The train loss at a guess's in every epoch so far, `epochs` of them at least (not 3% of the
    way from it to a perfect network's): the network does no better than guessing the class shares,
    even where its first steps fell (a loss that starts far above chance falls to it and stays).
    A guess of imbalanced classes scores under ln(classes): 90/10 labels give 0.325, and 0.9
    accuracy. Not while the val accuracy is clearly above a guess's (plus a fifth of the way to
    1): 2 classes at train.lr 1e-4 kept the train loss at 0.687 for 3 epochs while val accuracy
    rose to 0.75 (0.93 at epoch 6). Nothing to judge where a guess is perfect (one class)."""
    losses = [h["train/loss"] for h in history]
    if len(losses) < epochs or min(losses) < chance.under or chance.loss - chance.floor < 1e-6:
        return None
    best = max(h.get("val/accuracy", 0.0) for h in history)
    if best > chance.above:
        return None  # learning: its train loss is still near a guess's, its predictions are not
    return Finding(
        "at_chance",
        len(losses),
        f"at chance level: train loss {min(losses):.3f} at best over {len(losses)} epochs, not 3% "
        f"of the way from a guess's {chance.loss:.3f} to a perfect network's {chance.floor:.3f} "
        f"(the guess knows only the class shares: val accuracy {chance.accuracy:.2f}, this "
        f"network's best {best:.2f}); the network learns nothing yet. Check, in this order: the "
        "labels (sanity's grid); train.lr (`visionflow lr-find`); a network this large from "
        "scratch on little data: train.pretrained or a smaller train.model",
        {
            "train_loss": losses,
            "chance_loss": chance.loss,
            "perfect_loss": chance.floor,
            "under": chance.under,
            "chance_accuracy": chance.accuracy,
        },
    )


JUMP = 10.0  # a val loss this many times the frozen phase's last, and the chance level's: ruined
AT_CHANCE_EPOCHS = 3  # unfrozen epochs in a row at chance's train accuracy, after the frozen phase


def ruined_fine_tune(history: list[dict], chance: Guess) -> Finding | None:
    """Fine-tuning (the first epochs, whose `lr_backbone` is 0, had the backbone frozen; a
    schedule that anneals to 0 at the end freezes nothing): after unfreezing,
    the val loss an order of magnitude over the last frozen epoch's and over 10x a guess's (or
    not finite), or the train accuracy back at a guess's (plus a fifth of the way to 1) for
    AT_CHANCE_EPOCHS epochs in a row after the frozen phase beat it. The backbone took a rate
    that wrecked its pretrained features (#58: 2.15e-2 from a range test on the head alone, then
    val loss 386333 and train accuracy at chance for five epochs), which neither the train loss
    (near a guess's, not above it) nor the val accuracy kept by the best epoch shows."""
    frozen = sum(1 for _ in takewhile(lambda h: h.get("lr_backbone") == 0.0, history))
    if frozen in (0, len(history)):
        return None
    before, after = history[frozen - 1], history[frozen:]
    worst = max((h["val/loss"] for h in after), key=lambda v: v if math.isfinite(v) else math.inf)
    limit = JUMP * max(before["val/loss"], chance.loss)
    learned = max(h["train/accuracy"] for h in history[:frozen])
    stuck = [h["train/accuracy"] for h in after[-AT_CHANCE_EPOCHS:]]
    if not math.isfinite(worst) or worst > limit:
        what = (
            f"the val loss jumped from {before['val/loss']:.3g} (the last frozen epoch's) to "
            f"{worst:.3g} (over {JUMP:g}x that and a guess's {chance.loss:.3f})"
        )
    elif learned > chance.above and len(stuck) == AT_CHANCE_EPOCHS and max(stuck) <= chance.above:
        what = (
            f"the train accuracy fell from {learned:.2f} with the backbone frozen to "
            f"{max(stuck):.2f} at best over the last {AT_CHANCE_EPOCHS} epochs, a guess's "
            f"({chance.accuracy:.2f})"
        )
    else:
        return None
    return Finding(
        "ruined_fine_tune",
        len(history),
        f"ruined fine-tune: after unfreezing the backbone at epoch {frozen + 1}, {what}: the "
        "backbone's rate wrecked its pretrained features. Lower the backbone's rates: "
        "train.backbone_lr_factor 0.1 and train.group_lr_factor 0.3 (what `train.lr: auto` "
        "sets after a range test on the head alone), or a lower train.lr, or train.grad_clip",
        {
            "unfrozen_epoch": frozen + 1,
            "frozen_val_loss": before["val/loss"],
            "val_loss": [h["val/loss"] for h in after],
            "frozen_train_accuracy": learned,
            "train_accuracy": [h["train/accuracy"] for h in after],
            "chance_loss": chance.loss,
            "chance_accuracy": chance.accuracy,
        },
    )


def overfitting(history: list[dict], epochs: int) -> Finding | None:
    """Validation loss rising `epochs` epochs in a row while the train loss falls."""
    if len(history) < epochs + 1:
        return None
    window = history[-(epochs + 1) :]
    val = [h["val/loss"] for h in window]
    train = [h["train/loss"] for h in window]
    if not (all(b > a for a, b in pairwise(val)) and train[-1] < train[0]):
        return None
    losses = [h["val/loss"] for h in history]
    began = 1 + losses.index(min(losses))  # where validation loss turned
    return Finding(
        "overfitting",
        began,
        (
            f"overfitting from epoch {began} (lowest val loss, {min(losses):.3f}): val loss rose "
            f"{val[0]:.3f} -> {val[-1]:.3f} over the last {epochs} epochs while train loss fell "
            f"{train[0]:.3f} -> {train[-1]:.3f}. The best epoch "
            "by val accuracy is the one kept; to generalise better: more data or augmentation "
            "(train.augment), train.dropout, train.weight_decay, train.early_stop or fewer epochs"
        ),
        {"began_epoch": began, "val_loss": val, "train_loss": train},
    )
