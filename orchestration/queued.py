"""A sweep through DVC's queue (`workers: N`): N experiments at a time, in this checkout.

The plan is queued (`dvc exp run --queue`), DVC's queue workers are started (`dvc queue start
--jobs N`), and this flow follows the experiments with one poll of `dvc exp show` (sweep.Poll):
each is a task run from when it leaves the queue to its end, and one running past the timeout
is stopped. The workspace is held until every experiment of this sweep has ended. A failed or
cancelled sweep stops its experiments: SIGINT to each one's own processes (training reaches its
safe point), SIGKILL after the grace period. DVC's queue workers are daemons, so beside the flow
runs a small process that does the same if the flow's process dies (kill -9, say):

    python -m orchestration.queued ROOT NAME...    (what that process becomes; not for users)
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import psutil
from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.futures import wait
from prefect.states import State

from orchestration.record import record_holder
from orchestration.sweep import (
    FINAL_STATES,
    Outcomes,
    Plan,
    Poll,
    exp_run_args,
    experiment_result,
    sweep_table,
)
from visionflow.ops import repo, runner
from visionflow.ops.reaper import family, kill_family
from visionflow.ops.repo import DvcBusy, StageFailed, dvc
from visionflow.ops.runner import (
    dvc_command,
    environment,
    find_root,
    stop_grace_s,
    workspace_lock,
)

POLL_S = 5.0  # how often a sweep asks DVC how its experiments are doing


def run(plan: Plan, workers: int) -> Outcomes:
    """Queue `plan` and let `workers` of DVC's queue workers run it, under the workspace lock,
    with a process that stops the sweep if this one dies; the table once all have ended."""
    logger = get_run_logger()
    with workspace_lock(plan.root, wait=True, log=logger.warning), record_holder(plan.root):
        with stopped_if_this_process_dies(plan.root, plan.experiments):
            run_queue(plan, workers)
        return Outcomes(sweep_table(plan))


def run_queue(plan: Plan, workers: int) -> None:
    """Queue the plan, start `workers` DVC queue workers, wait on the experiments until all have
    ended (one running past the plan's timeout is stopped); on any early end, stop the queue.
    Each experiment is a task, from when it leaves the queue to its end. A slow or failing poll
    never stops the sweep (`Poll`): only a stop, or the timeout with no answer from DVC, does."""
    logger = get_run_logger()
    root, timeout_s = plan.root, plan.timeout_s
    for name, sets in plan.experiments.items():
        dvc(root, *exp_run_args(name, sets), "--queue", doing=f"queueing {name}")
        logger.info(f"{name} ({' '.join(sets)}): queued")
    ends = {name: Future() for name in plan.experiments}  # set as the flow's one poll sees each end
    tasks, started, last_seen = {}, {}, None
    try:
        start_workers(root, workers)
        while True:
            last_seen = plan.poll.results(plan.experiments, patience_s=timeout_s)
            for name, summary in last_seen.items():
                state = summary["state"]
                if state != "queued" and name not in tasks:
                    logger.info(f"{name}: left the queue ({state})")
                    tasks[name] = queued_experiment.submit(name, ends[name])
                if state in FINAL_STATES and not ends[name].done():
                    ends[name].set_result(summary)
                if state == "running":
                    started.setdefault(name, time.monotonic())
                    if time.monotonic() - started[name] > timeout_s:
                        logger.error(f"{name}: ran past {timeout_s:.0f} s; stopping it")
                        interrupt(root, {name: summary["pid"]}, logger.warning)
                        started[name] = math.inf  # asked once
            if all(end.done() for end in ends.values()):
                break
            time.sleep(max(POLL_S, plan.poll.took))  # a slow DVC is asked less often
    finally:
        unended = [end for end in ends.values() if not end.done()]
        for end in unended:  # its task ends now, Failed
            end.set_result({"state": "stopped (the sweep ended first)"})
        if unended:  # failed or cancelled: nothing of this sweep keeps running
            stop_queue(root, plan.experiments, logger.warning, last_seen)
        stop_idle_workers(root, logger.warning)  # DVC's workers outlive the queue
    wait(list(tasks.values()))


@task(task_run_name="{name}", cache_policy=NONE)  # `end` is no input to cache on
def queued_experiment(name: str, end: Future) -> dict | State:
    """A queued experiment from when it left the queue to its end, both seen by the flow's
    poll: its state and main metrics, or a Failed state."""
    return experiment_result(name, end.result(), f" (`dvc queue logs {name}` has its output)")


def start_workers(root: Path, workers: int) -> None:
    """`dvc queue start --jobs N`. The worker is a daemon: with our pipes it would hold them
    until the queue is empty."""
    subprocess.run(
        [*dvc_command(), "queue", "start", "--jobs", str(workers)],
        cwd=root,
        env=environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=repo.DVC_TIMEOUT_S,
        check=True,
    )


# What the process beside a queued sweep runs: it waits for EOF on stdin. Without "done" first,
# the flow's process died (kill -9): it becomes `python -m orchestration.queued ROOT NAME...`,
# which stops this sweep's experiments, holding the workspace lock it inherited until they are gone.
STOP_ON_DEATH = """
import os, sys
if b"done" not in sys.stdin.buffer.read():
    os.execv(sys.executable, [sys.executable, "-m", "orchestration.queued", *sys.argv[1:]])
"""


@contextmanager
def stopped_if_this_process_dies(root: Path, names) -> Iterator[None]:
    """While a queued sweep runs, a process that stops it if this process dies (DVC's queue
    worker is a daemon: nothing else would)."""
    log = open(root / ".dvc" / "tmp" / "visionflow-sweep-guard.log", "a")  # not our stdout:
    watcher = subprocess.Popen(  # it may be a pipe that dies with this process
        [sys.executable, "-c", STOP_ON_DEATH, str(root), *names],
        cwd=root,
        env=environment(),
        stdin=subprocess.PIPE,
        stdout=log,
        stderr=subprocess.STDOUT,
        pass_fds=tuple(runner.HELD),  # the workspace stays held until the sweep is stopped
        start_new_session=True,
    )
    log.close()
    try:
        yield
    finally:
        watcher.communicate(b"done")  # ended here, stopped here if need be: the watcher goes


def stop_queue(
    root: Path, names, log: Callable[[str], None], last_seen: dict[str, dict] | None = None
) -> None:
    """Drop this sweep's queued experiments and stop its running ones: SIGINT to each one's own
    processes (`interrupt`), then, the grace period (`stop_grace_s()`) later, SIGKILL to what is
    left of them. When DVC does not answer in time, what the sweep saw `last_seen` is stopped."""
    try:
        now = Poll(root, log).results(names, patience_s=30.0)
    except StageFailed as error:
        if last_seen is None:
            raise
        log(f"{error}: stopping what the sweep saw last")
        now = last_seen
    queued = [name for name, summary in now.items() if summary["state"] == "queued"]
    running = {
        name: summary["pid"] for name, summary in now.items() if summary["state"] == "running"
    }
    if queued:
        try:  # best effort: a queued one that started meanwhile is stopped below next time
            dvc(root, "queue", "remove", *queued, doing="dropping the sweep's queued experiments")
        except (StageFailed, DvcBusy) as error:
            log(str(error))
    asked = interrupt(root, running, log)
    pids = set(asked)
    while pids:
        pids = {pid for pid in pids if alive(pid)}
        for pid in [pid for pid in pids if time.time() > asked[pid] + stop_grace_s()]:
            kill_family(pid, group=False)
            pids.discard(pid)
        time.sleep(0.2)


def interrupt(root: Path, running: dict[str, int | None], log) -> dict[int, float]:
    """SIGINT to each running experiment's own processes: the stage stops at its safe point and
    DVC records the failure. Not `dvc queue kill`: an experiment runs in DVC's queue worker's
    process group, and DVC signals the whole group; the worker, interrupted, died without
    recording the end (`dvc queue status`: Running with no worker, the copy left in
    .dvc/tmp/exps). Each is asked once: a second SIGINT stops training at once, losing the epoch,
    so the process that takes over from a killed flow keeps the first ask's time (kept in
    .dvc/tmp). Returns each asked process and when it was asked."""
    record = root / ".dvc" / "tmp" / "visionflow-sweep-stop.json"
    try:
        asked = {int(pid): at for pid, at in json.loads(record.read_text()).items()}
    except (OSError, ValueError):
        asked = {}
    asked = {pid: at for pid, at in asked.items() if alive(pid)}
    for name, pid in running.items():
        if pid is None:  # DVC did not say its process: DVC stops it
            try:
                dvc(root, "queue", "kill", name, doing=f"stopping {name}")
            except (StageFailed, DvcBusy) as error:
                log(str(error))
        elif pid not in asked:
            asked[pid] = time.time()
            for member in family(pid, group=False):
                try:
                    os.kill(member, signal.SIGINT)
                except ProcessLookupError:
                    pass
    record.write_text(json.dumps(asked))
    return {pid: at for pid, at in asked.items() if pid in running.values()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def stop_idle_workers(root: Path, log: Callable[[str], None]) -> None:
    """`dvc queue stop` once a sweep has ended, then wait (up to the grace period) for DVC's queue
    workers in this workspace to go: left alone they outlive the sweep."""
    try:
        dvc(root, "queue", "stop", doing="stopping DVC's idle queue workers")
    except (StageFailed, DvcBusy) as error:
        log(str(error))
        return
    deadline = time.monotonic() + stop_grace_s()
    while queue_workers(root) and time.monotonic() < deadline:
        time.sleep(0.2)


def queue_workers(root: Path) -> list[int]:
    """DVC's queue worker processes working in `root`."""
    found = []
    for process in psutil.process_iter(["cmdline", "cwd"]):  # None where it cannot be read
        cmdline, cwd = process.info["cmdline"] or [], process.info["cwd"]
        if "queue-worker" in cmdline and cwd is not None and Path(cwd) == root:
            found.append(process.pid)
    return found


def main() -> None:
    """The flow running a queued sweep died: stop its experiments (argv: ROOT NAME...)."""
    root, names = find_root(Path(sys.argv[1])), sys.argv[2:]
    print(f"the flow running {', '.join(names)} died: stopping them", flush=True)
    stop_queue(root, names, log=print)


if __name__ == "__main__":
    main()
