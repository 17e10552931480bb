"""Fault injection for tests: make a named point in the code kill, raise, turn NaN or pause.

    VISIONFLOW_FAULT="<point>[@<key>=<value>,...]:<action>[=<arg>]"    (several joined by ";")

    train.epoch_end@epoch=3:kill          SIGKILL the process after epoch 3's checkpoint
    checkpoint.write@epoch=2:kill         SIGKILL it halfway through writing epoch 2's checkpoint
    train.loss@epoch=2:nan                every loss of epoch 2 becomes NaN
    stage.start@stage=evaluate:raise      the evaluate stage fails at once (FaultInjected)
    train.loss@epoch=2,step=1:pause=go    wait there until the file `go` exists
    train.batch:sleep=0.05                every batch arrives 50 ms late (a slow loader)
    train.loss:oom=64                     torch.OutOfMemoryError for batches over 64 images, as
                                          on a GPU too small for more (no number: every batch)
    export.int8:nan                       the INT8 model's logits become NaN (its accuracy falls)
    export.quantize:raise                 ONNX Runtime's quantizer fails (as on swin_v2_t)
    train.stop:touch=stopping             create the file `stopping` (an event a test waits on)
    sweep.poll:sleep=130                  every `dvc exp show` of a sweep's poll answers 130 s late

The points: stage.import (stage: its modules are being imported), stage.start (stage), stage.snapshot (stage, rank: the mid-run guard's start stat was
taken), stage.published (stage: its outputs are in place), train.verify (rank: the cache is
re-hashed), train.lr_find (rank: rank 0 finds train.lr: auto's rate), train.batch
(epoch, step), train.loss (epoch, step, batch), train.epoch_end (epoch), train.stop (a stop was
asked), checkpoint.write (epoch), export.int8 (the INT8 model's logits as the gate scores them),
export.quantize (before the INT8 file is made),
prepare.decode (index, in the decoding workers), runner.timer
(before a timeout starts counting), sweep.poll (in the `dvc exp show` process a sweep polls, so
that the poll's timeout applies). Unset, the normal case, a point costs one test of `ACTIVE`.
"""

import math
import os
import signal
import time
from pathlib import Path

ACTIONS = ("kill", "raise", "nan", "pause", "sleep", "oom", "touch")


class FaultInjected(RuntimeError):
    """Raised by a `raise` fault."""


def parse(spec: str) -> list[tuple[str, dict[str, str], str, str]]:
    """`spec` as (point, where, action, argument) tuples; a malformed one is a ValueError."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        target, sep, action = item.partition(":")
        point, _, where = target.partition("@")
        action, _, argument = action.partition("=")
        if not sep or action not in ACTIONS:
            raise ValueError(
                f"VISIONFLOW_FAULT: {item!r} is not <point>[@k=v,...]:{'|'.join(ACTIONS)}"
            )
        pairs = dict(pair.split("=", 1) for pair in filter(None, where.split(",")))
        faults.append((point, pairs, action, argument))
    return faults


FAULTS = parse(os.environ.get("VISIONFLOW_FAULT", ""))
ACTIVE = bool(FAULTS)


def fault(point: str, value=None, **where):
    """Apply the faults aimed at `point` where every given key matches; returns `value`
    (NaN for a `nan` fault). Call it as `if faults.ACTIVE: x = faults.fault(...)`."""
    for name, pairs, action, argument in FAULTS:
        if name != point or any(str(where.get(k)) != v for k, v in pairs.items()):
            continue
        if action == "oom" and argument and where["batch"] <= int(argument):
            continue  # this batch fits
        # os.write, not print: a fault point may be reached in a signal handler (train.stop),
        # where a print landing on the loop's own print re-enters stderr's buffer
        os.write(2, f"fault: {action} at {point} {where}\n".encode())
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "raise":
            raise FaultInjected(f"injected fault at {point} {where}")
        elif action == "nan":
            value = value * math.nan
        elif action == "pause":
            while not Path(argument).exists():
                time.sleep(0.05)
        elif action == "touch":
            Path(argument).touch()
        elif action == "sleep":
            time.sleep(float(argument))
        elif action == "oom":
            import torch

            raise torch.OutOfMemoryError(f"CUDA out of memory (injected at {point} {where})")
    return value
