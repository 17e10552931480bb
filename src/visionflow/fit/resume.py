"""A run's lifecycle, and what decides whether training resumes, republishes or starts fresh.

        start ──> staged ──> checked ──> published ──> recorded ──> pruned
                    │           │            │
     Ctrl-C/SIGTERM │  a dep or │  DVC's     │  the next run of the same params, data and code
     (exit 130) or  │  a param  │  cache is  │  starts fresh; one that finds its run published
     SIGKILL: the   │  changed  │  full, or  │  but NOT recorded writes the outputs again,
     state is kept, │  mid-run: │  a kill    │  without training; a larger train.epochs
     the next run   │  refused  │  while DVC │  extends it
     resumes        │           │  hashes    │
                    └───────────┴────────────┴──> restored: DVC deleted the outputs before the
                         stage ran; `dvc checkout` (ops.runner.restore, which `visionflow repro`
                         and the flows call) brings back the recorded ones

Where each step lives:
- staged: every stage writes into `<out>.partial` (`pipeline.staged`); a killed run's is removed
  by the next.
- checked: the params and deps a stage started with (`pipeline.Snapshot`, a stat per file) are
  checked when it ends, and DVC's cache must have room for its outputs
  (`pipeline.check_cache_room`).
- published: the staging folders move into place (`pipeline.publish`), then the
  `when_published` actions run: train marks its state folder with the md5 of the model.pt it
  published (`Run.mark_published`, `mark_published` here, PUBLISHED_FILE).
- recorded: DVC hashed the outputs into dvc.lock and its cache; the next train run asks
  (`recorded`).
- pruned: other configurations' state folders beyond the newest few (`checkpoint.prune`, called
  by `resume`).

Training's resumable state lives in `<checkpoints>/<fingerprint>/`, the fingerprint a hash of
`run_of` (the seed, the train params, and the content of the data, the stage's code and the
pretrained weights); `state_to_resume` decides what a run starts from, `resume` applies it, and
`save_epoch` writes what it reads.

One trainer at a time: a run holds a lock on the state root (LOCK_FILE, `one_trainer`) from its
start to its end (the `Run` gone, or its process), so a `dvc repro` started beside the trainer of
a stopped one (a SIGTERM to DVC alone leaves its trainer running to its epochs' end) waits for
it, then resumes.
"""

import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch.distributed as dist

from visionflow.data.dataset import write_json
from visionflow.data.files import file_hash
from visionflow.errors import GateError
from visionflow.ops import project
from visionflow.train import checkpoint
from visionflow.train.training import Progress, patient_group
from visionflow.train.zoo import is_weights_name, weights_enum


def run_of(params, cache: Path, code: str) -> dict:
    """What a resumable checkpoint must match (its folder is named by the hash of this, and its
    run.json keeps it): the seed, train params, and the content of the data, the stage's code
    (`code`: a digest of it, `pipeline.code_digest`) and the pretrained file. train.epochs is left
    out but for the cosine and one-cycle schedules, whose learning rate depends on it: under the
    others a longer run's first epochs are a shorter run's, so a larger budget resumes a finished
    run. train.lr `auto` is kept as it is: the rate
    the range test found is recorded in the folder (fit/lr_auto.py) and reused on resume."""
    train = params.train
    budgeted = train.scheduler in ("cosine", "onecycle")
    train_values = train.model_dump(exclude=set() if budgeted else {"epochs"})
    hashes = {
        "data": file_hash(cache / "manifest.json"),
        "code": code,
        "pretrained weights": weights_content(train.model, train.pretrained),
    }
    return {"seed": params.seed, "train": train_values, "hashes": hashes}


def weights_content(model: str, pretrained: str) -> str | None:
    """What the pretrained weights are: a file's content hash, or for a weights name the file
    torchvision resolves it to (its name ends in the file's hash: `resnet50-11ad3fa6.pth`), so
    a torchvision release that points DEFAULT at other weights does not resume the old ones."""
    if not pretrained:
        return None
    if is_weights_name(pretrained):
        return weights_enum(model, pretrained).url.rsplit("/", 1)[-1]
    return file_hash(Path(pretrained))


# why a changed key starts training fresh, where that is not plain from its name
FRESH_BECAUSE = {"train.epochs": "the cosine and one-cycle schedules' rates depend on it"}


PUBLISHED_FILE = "published.json"  # in a state folder: the md5 of the model.pt its run published
LOCK_FILE = ".lock"  # in the state root: held (flock) by the trainer running, its pid inside
HELD: dict[Path, list[int]] = {}  # the state roots this process holds: [descriptor, runs]
SAY_EVERY = 60  # seconds between a waiting trainer's lines


def one_trainer(root: Path, rank: int, world: int, log) -> Callable[[], None]:
    """Wait while another trainer (the orphan of a stopped `dvc repro`, another `dvc repro`)
    holds `root`, every configuration's state root, then hold it until the returned function
    is called (the run's end): one trainer at a time writes the state folders and the outputs.
    Under DDP rank 0 holds it (it alone writes both); the other ranks wait for it in the patient
    group."""
    release = hold(root, log) if rank == 0 else (lambda: None)
    if world > 1:
        dist.barrier(group=patient_group())
    return release


def hold(root: Path, log) -> Callable[[], None]:
    """Take `root`'s lock, saying every SAY_EVERY seconds what it waits for while another
    process holds it; the function returned lets go of it. The kernel releases it when the
    holder ends, however (SIGKILL too). A process takes it once: a run built again in it while
    the first holds it goes on, and the lock is let go when both have."""
    key = root.resolve()
    if key in HELD:
        HELD[key][1] += 1
        return partial(let_go, key)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    said = None  # when the last line was said
    while not locked(fd):
        if said is None or time.monotonic() - said >= SAY_EVERY:
            pid = os.pread(fd, 32, 0).decode().strip() or "?"
            newest = f"its newest checkpoint: {newest_checkpoint(root)}"
            log(
                f"train: another trainer (pid {pid}) holds {root}; waiting for it to end (a "
                f"stopped `dvc repro` can leave its trainer running: `kill {pid}` stops it at its "
                f"epoch's end, then this run resumes from it); {newest}"
                if said is None
                else f"train: still waiting for pid {pid}; {newest}"
            )
            said = time.monotonic()
        time.sleep(0.5)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    HELD[key] = [fd, 1]
    return partial(let_go, key)


def let_go(key: Path) -> None:
    """One run holding `key` ended: the lock is released once none does (the file stays: a
    trainer waiting on it holds it open)."""
    held = HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del HELD[key]
        os.close(held[0])


def locked(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def newest_checkpoint(root: Path) -> str:
    found = []
    for path in root.glob("*/epoch-*.pt"):
        try:
            found.append((path.stat().st_mtime, str(path)))
        except OSError:  # removed since (a folder keeps its newest two)
            pass
    return max(found)[1] if found else "none yet"


def resume(trainer, monitor, folder: Path, run: dict, out: Path, epochs: int, log):
    """The state of this fingerprint only, from its own folder (`state_to_resume`); a fresh
    start otherwise (other configurations' folders beyond the newest few are pruned).

    Under DDP rank 0 alone reads the folder, the one it writes (on several nodes the others
    have their own, stale or empty), and sends what it found to every rank, each of which takes
    its own generators from it; first, every rank's run must be rank 0's (`same_run_everywhere`)."""
    world, rank = trainer.world, trainer.rank
    if world > 1:
        same_run_everywhere(run, rank, world)
    device = next(trainer.model.parameters()).device
    state, reason, extending, best = None, "", False, None
    if rank == 0:
        on = "cpu" if world > 1 else device  # sent to the others, each moves it to its device
        state, reason, extending = state_to_resume(folder, run, out, epochs, on)
        best = checkpoint.best_file(folder, state["best"]["epoch"]) if state else None
        if state and not checkpoint.readable(best):  # half-deleted or corrupt
            state, extending = None, False
            reason = f"not resuming from {folder}: its {best.name} is missing or unreadable; "
            reason += "starting fresh"
    if world > 1:
        decided = [state]
        dist.broadcast_object_list(decided, src=0)
        state = decided[0]
    log(f"train: {reason}")
    if rank == 0:
        if state is None:
            shutil.rmtree(folder, ignore_errors=True)  # a fresh run starts a fresh folder
        if extending:  # no longer the run that published: a kill now leaves a run to resume
            (folder / PUBLISHED_FILE).unlink()
        checkpoint.write_run(folder, run)
        for stray in folder.glob("best-*.pt"):  # written just before a checkpoint that did not
            if stray != best:
                stray.unlink()
        for old in checkpoint.prune(folder.parent, keep=folder):
            log(f"train: removed the resumable state of another configuration: {old}")
    if state is None:
        return Progress()
    saved_by = len(state.get("rng_of_ranks") or [None])
    if saved_by != world:  # the steps and draws differ from an uninterrupted run's
        log(
            f"train: warning: resuming a {saved_by}-rank run on {world} rank(s): it goes on, but "
            "will not end as an uninterrupted run would (the batch per step and the random "
            "draws follow the number of ranks)"
        )
    trainer.restore(state)  # the scheduler's state with it
    monitor.load_state_dict(state["health"])
    return Progress(state["history"], state["best"], state["epoch"] + 1, state["stale"])


def same_run_everywhere(run: dict, rank: int, world: int) -> None:
    """Every rank's run (`run_of`: the seed, the train params, the content of its data, code and
    pretrained file) is rank 0's, or every rank stops here in one line. On several nodes each
    rank reads its own checkout and cache: one that differs would train on other data, or wait
    forever for collectives the others never make."""
    runs = [None] * world
    dist.all_gather_object(runs, run)
    differ = {
        other_rank: checkpoint.changes(runs[0], other)
        for other_rank, other in enumerate(runs)
        if other != runs[0]
    }
    if differ:
        differences = "; ".join(
            f"rank {other_rank}: {', '.join(found) or 'the run'}"
            for other_rank, found in differ.items()
        )
        raise GateError(
            f"train: the ranks' runs differ from rank 0's ({differences}): every node needs the same "
            "commit, params.yaml and data (`git pull` and `dvc pull` on each)"
        )


def state_to_resume(
    folder: Path, run: dict, out: Path, epochs: int, device
) -> tuple[dict | None, str, bool]:
    """(the state to resume or None, a line saying why, whether it extends a finished run).

    A run that finished (published its outputs) is extended when train.epochs grew: only
    schedules whose first epochs do not depend on the budget share a fingerprint across budgets
    (`run_of`). Else it is kept until DVC has recorded its outputs: then it is done with, and a
    new run (`dvc repro -f`) starts fresh; if DVC did not (a full cache, a stop while DVC hashed
    them), its outputs are written again from it, without training. Without a checkpoint of its
    own, the line names what changed since the newest other configuration's."""
    had_state = any(folder.glob("epoch-*.pt"))
    state, reason = checkpoint.load_latest(folder, checkpoint.fingerprint(run), device)
    if state is None:
        changed = None
        if not had_state:  # not some unreadable files (load_latest said so): another config's?
            changed = checkpoint.reason_not_resumed(folder.parent, folder, run, FRESH_BECAUSE)
        return None, f"starting fresh: {changed}" if changed else reason, False
    if state["epoch"] > epochs:  # a longer run's state, and train.epochs was lowered
        reason = f"not resuming {folder}: its epoch {state['epoch']} is past train.epochs {epochs}"
        return None, f"{reason}; starting fresh", False
    if not (folder / PUBLISHED_FILE).exists():  # a run that stopped before its end
        return state, reason, False
    done = recorded(folder, out)
    budget = state.get("epochs", state["epoch"])  # an early-stopped run did fewer epochs
    if epochs > budget:
        kind = "recorded" if done else "finished"
        return state, f"extending the {kind} {budget}-epoch run to {epochs} epochs: {reason}", True
    if done:
        reason = "the last run of these params, data and code is recorded by DVC; starting fresh"
        return None, reason, False
    reason = (
        "the last run of these params finished but DVC did not record its outputs (a full "
        f"cache, a stop while DVC hashed them): {reason}; writing them again, without training"
    )
    return state, reason, False


def recorded(folder: Path, out: Path) -> bool:
    """Whether DVC recorded the model.pt this state folder's run published: dvc.lock names it
    and DVC's cache holds it."""
    try:
        md5 = json.loads((folder / PUBLISHED_FILE).read_text())["model.pt"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return project.recorded(out / "model.pt", md5)


def mark_published(folder: Path, out: Path) -> None:
    write_json(folder / PUBLISHED_FILE, {"model.pt": file_hash(out / "model.pt", "md5")})


def save_epoch(trainer, progress, monitor, folder: Path, epoch: int, epochs: int, rngs):
    """Rank 0's checkpoint of `epoch`, with every rank's generators under DDP (`rngs`)."""
    checkpoint.save_checkpoint(
        folder,
        {
            **trainer.state(),
            "rng_of_ranks": rngs,
            "epoch": epoch,
            "fingerprint": folder.name,  # the folder is named by it (`Run`)
            "epochs": epochs,  # the budget: a larger one extends this run
            "best": progress.best,
            "stale": progress.stale,
            "history": progress.history,
            "health": monitor.state_dict(),
        },
    )
