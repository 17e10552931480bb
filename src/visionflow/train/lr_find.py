"""The learning-rate range test (Smith, "Cyclical learning rates", 2015; fastai's `lr_find`): a
short run whose rate rises exponentially, step by step, until the loss diverges; the suggested
rate lies in the loss's longest downhill stretch (fastai's `valley`), found as fastai finds it:
past the test's first tenth of steps (the smoothed loss is still settling) and before its last 5
(the blow-up that stopped it).

Takes values (a model, its optimizer, a split): `fit/lr_auto.py` builds them from
train.* as the train stage does, and runs this on a copy of the model.
"""

import math
from collections.abc import Iterator

import torch
from torch import nn

from visionflow.train.engine import Split, Step, forward

START, END = 1e-7, 10.0  # the rates tried, from .. to (the head's; other groups at their shares)
STEPS = 100  # optimizer steps at most
SMOOTHING = 0.98  # the loss's exponential moving average (bias-corrected), as fastai's
DIVERGED = 4.0  # stop once the smoothed loss is this many times its lowest
MIN_VALLEY = 5  # points in the longest downhill stretch below which there is no suggestion
SKIP_END = 5  # the last points, the blow-up, are neither searched nor plotted (fastai's)


def range_test(
    model: nn.Module, optimizer: torch.optim.Optimizer, split: Split, step: Step, steps: int = STEPS
) -> dict:
    """Train `model` (a copy: this changes it) for up to `steps` optimizer steps of `step`'s
    batches of `split`, at rates from START to END, exponentially, each of the optimizer's groups
    at its share of the first group's rate (rates per layer group keep their ratios). Stops
    when the smoothed loss diverges or a loss is not finite. Returns the rates, smoothed losses
    and `suggestion` (None when the loss never fell for long: no rate to suggest)."""
    shares = [group["lr"] / optimizer.param_groups[0]["lr"] for group in optimizer.param_groups]
    model.train()
    batches, rates, losses, average = endless(split, step.batch_size), [], [], 0.0
    for i in range(steps):
        rate = START * (END / START) ** (i / (steps - 1))
        for group, share in zip(optimizer.param_groups, shares, strict=True):
            group["lr"] = rate * share
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for _ in range(step.accumulate):  # one optimizer step: the training's effective batch
            x, y = next(batches)
            micro, _ = forward(model, split.inputs(x), y, step)
            (micro / step.accumulate).backward()
            loss += micro.item() / step.accumulate
        if not math.isfinite(loss):
            break
        optimizer.step()
        average = SMOOTHING * average + (1 - SMOOTHING) * loss
        rates.append(rate)
        losses.append(average / (1 - SMOOTHING ** (i + 1)))
        if losses[-1] > DIVERGED * min(losses):
            break
    return {"rates": rates, "losses": losses, "suggestion": suggest(rates, losses, steps)}


def suggest(rates: list[float], losses: list[float], steps: int = STEPS) -> float | None:
    """`valley` over the points fastai's `lr_find` searches: from the test's tenth step (the
    smoothed loss of its first steps is a few batches' noise) to the fifth point from its end
    (the rise that stopped the test)."""
    start, end = steps // 10, len(rates) - SKIP_END
    return valley(rates[start:end], losses[start:end])


def endless(split: Split, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The split's shuffled batches, epoch after epoch, as many as the test takes."""
    while True:
        yield from split.batches(batch_size)


def valley(rates: list[float], losses: list[float]) -> float | None:
    """fastai's suggestion: the longest stretch over which the loss keeps falling (the longest
    decreasing subsequence, O(n^2) over 100 points), and a rate about two thirds down it: past
    the flat start, before the steep end."""
    n = len(losses)
    if n < MIN_VALLEY:
        return None
    longest, start, end = [1] * n, 0, 0
    for i in range(1, n):
        for j in range(i):
            if losses[i] < losses[j] and longest[i] < longest[j] + 1:
                longest[i] = longest[j] + 1
        if longest[i] > longest[end]:
            end, start = i, i - longest[i]
    if longest[end] < MIN_VALLEY:
        return None
    third = (end - start) / 3
    return rates[start + int(third) + int(third / 2)]


def range_test_figure(result: dict, title: str):
    """Loss against rate (log x) without the blow-up that stopped the test (its last SKIP_END
    points, as fastai plots it; the y axis ends a little above the loss at the start), the
    suggestion marked: a matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    rates, losses = result["rates"], result["losses"]
    shown = max(len(rates) - SKIP_END, min(len(rates), MIN_VALLEY))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rates[:shown], losses[:shown])
    if shown:
        lowest = min(losses[:shown])
        top = max(losses[: losses.index(lowest) + 1])  # the start: what the test fell from
        ax.set_ylim(lowest - 0.1 * (top - lowest), top + 0.1 * (top - lowest) + 1e-6)
    suggestion = result["suggestion"]
    if suggestion is not None:
        at = losses[rates.index(suggestion)]
        ax.axvline(suggestion, color="C3", linewidth=0.8, linestyle="--")
        ax.plot([suggestion], [at], "o", color="C3", label=f"suggested {suggestion:.2e}")
        ax.legend()
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (the head's)")
    ax.set_ylabel("training loss (smoothed)")
    ax.set_title(title)
    fig.tight_layout()
    return fig
