"""Prefect flows for sweeps: `dvc exp run -S ...` for each list of overrides, one table of them.

Three ways to run a sweep's experiments, each a `dvc exp run` in a temporary copy of a checkout
(the workspace stays as it was):
- in turn (`workers: 0`), in this checkout;
- queued (`workers: N`): DVC's queue runs N at a time in this checkout;
- spread (`spread: true`): each experiment is a flow run of the `experiment` deployment, so every
  worker of the work pool takes some, each in its own checkout (VISIONFLOW_WORKDIR, read when its
  run starts) at the sweep's commit; each one pushes its experiment (`dvc exp push`: git and DVC
  remotes) and the sweep pulls them all, so `dvc exp show` here, and on any clone after
  `dvc exp pull`, has the whole sweep.

Run:  .venv/bin/python -m pipeline.experiments [WORKDIR] -e "train.lr=1e-3" -e "train.lr=3e-3 train.epochs=30"
          [--workers N | --spread [DEPLOYMENT]]
"""

import argparse
import json
import math
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

from prefect import flow, get_run_logger, runtime, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound, TerminationSignal
from prefect.futures import wait
from prefect.states import Cancelled, Cancelling, Completed, Crashed, Failed, State

from pipeline.flows import claimed, stopped_run
from visionflow.ops import runner, sweeps
from visionflow.ops.project import preflight
from visionflow.ops.repo import StageFailed, dvc, readable
from visionflow.ops.runner import (
    STOPPED_EXIT,
    NotAProject,
    Timeout,
    dvc_command,
    find_root,
    run_group,
    workspace_lock,
)
from visionflow.ops.sweeps import (
    ENDED,
    Poll,
    exp_run_args,
    git,
    guarded,
    interrupt,
    main_metrics,
    metric_values,
    pull_experiments,
    push_experiment,
    spread_problem,
    start_workers,
    stop_idle_workers,
    stop_queue,
    sweep_table,
    uncommitted,
)

POLL_S = 5.0  # how often a sweep asks DVC how its experiments are doing
EXPERIMENT = "experiment/pool-experiment"  # prefect.yaml's deployment of one experiment
UNTAKEN_S = 60.0  # a spread experiment no worker took this long is said in the log
LOST_AFTER_S = 60.0  # a spread experiment whose heartbeat stopped this long is lost
BEATS = 6  # heartbeats per LOST_AFTER_S: a few late ones are not a loss
HEARTBEAT = "visionflow.heartbeat"  # labels of a spread experiment's flow run: a count that
RAN_ON = "visionflow.ran-on"  # goes up while it lives, and the worker's host:checkout


@flow(name="experiments")
def experiments(
    workdir: str = ".",
    overrides: list[list[str]] | None = None,
    workers: int = 0,
    timeout_s: float = 3600,
    spread: bool = False,
    deployment: str = EXPERIMENT,
    remote: str = "origin",
    lost_after_s: float = LOST_AFTER_S,
) -> list[dict] | State:
    """`dvc exp run -S ...` for each list of overrides; publishes a table of these experiments
    (the params that differ from the baseline, the main metrics) and returns its rows.

    `workers: 0` runs them one after another, `workers: N` queues them and lets DVC's queue run
    N at a time; either way each runs in its own temporary copy, so the workspace stays as it is,
    and each gets `timeout_s`. The workspace is held until every experiment of this sweep ended;
    a failed or cancelled sweep stops the DVC queue's workers. Each experiment is a task run
    named after it: Completed with its main metrics, or Failed. One failed experiment does not
    stop the others; the flow fails at the end, naming it (a Failed state: one line, no
    traceback).

    `spread: true` sends each experiment to the work pool instead, as a flow run of `deployment`
    (one `experiment` each, a child of this one), run by whichever worker takes it in its own
    checkout of this commit; each pushes to the git remote `remote` (and the default DVC remote),
    and this flow pulls them; the table says where each ran, and why one did not succeed. One
    whose heartbeat stops for `lost_after_s` lost its worker or machine: it is marked Crashed.
    This workspace is not held.
    Example overrides: [["train.lr=3e-4"], ["train.lr=1e-3", "train.epochs=30"]].
    """
    logger = get_run_logger()
    root = find_root(Path(workdir))
    prefix = f"sweep-{str(runtime.flow_run.id or 'local')[:8]}"
    if (runtime.flow_run.run_count or 1) > 1:  # a retry: the first try's names are taken
        prefix += f"-try{runtime.flow_run.run_count}"
    plan = {f"{prefix}-{i}": sets for i, sets in enumerate(overrides or [], start=1)}
    stopped = None  # a sweep that ended early: why
    try:
        problems = preflight(root)  # DVC stashes params.yaml before any stage could refuse it
        if problems:
            raise StageFailed("; ".join(problems))
        poll = Poll(root, logger.warning)  # one for the sweep: a slow DVC's longer timeout stays
        if spread:  # not held: a child may run in this very checkout, and takes its lock
            rows, stopped = run_spread(
                root, plan, deployment, timeout_s, remote, lost_after_s, poll
            )
        else:
            with workspace_lock(root, wait=True, say=logger.warning), claimed(root):
                if workers:
                    with guarded(root, plan):
                        run_queued(root, plan, workers, timeout_s, poll)
                else:
                    stopped, at = run_in_turn(root, plan, timeout_s)
                rows = sweep_table(poll, plan)
                if stopped:
                    rows = marked_stopped(rows, plan, at)
    except (KeyboardInterrupt, TerminationSignal):  # Ctrl-C, SIGTERM (Prefect's own handler
        # while a flow runs), SIGHUP: stopped, not crashed
        return stopped_run("the sweep's experiments that had not ended were stopped")
    except StageFailed as e:  # its `error:` line, with no traceback to read past
        return Failed(message=str(e))
    create_table_artifact(rows, key="experiments", description=f"{prefix}: dvc exp show")
    if stopped:
        return stopped_run(stopped)
    failed = [row["experiment"] for row in rows if row["state"] != "success"]
    if failed:
        return Failed(message=f"experiments {', '.join(failed)} did not succeed (see their logs)")
    return rows


def run_in_turn(
    root: Path, plan: dict[str, list[str]], timeout_s: float
) -> tuple[str | None, str | None]:
    """Each experiment in turn; a failed one is its task's state, and the next one runs. A stop
    (Ctrl-C, SIGTERM) or a cancellation during one ends the sweep there: returns why, and
    which one it stopped (None, None when all ran)."""
    stops = len(runner.FORWARDED)
    for name, sets in plan.items():
        state = run_experiment(root, name, sets, timeout_s, return_state=True)
        if len(runner.FORWARDED) > stops:
            signal_name = signal.Signals(runner.FORWARDED[-1]).name
            return f"sweep stopped by {signal_name} during {name}; the rest not run", name
        if state.is_cancelled():
            return f"sweep cancelled during {name}; the rest not run", name
    return None, None


def marked_stopped(rows: list[dict], plan: dict[str, list[str]], at: str) -> list[dict]:
    """The table of a sweep stopped during `at`: that one stopped, those after it not run (DVC
    has no record of them, so they read as failed)."""
    rest = list(plan)[list(plan).index(at) + 1 :]
    for row in rows:
        if row["experiment"] == at:
            row["state"] = "stopped"
        elif row["experiment"] in rest:
            row["state"] = "not run"
    return rows


@task(task_run_name="{name}")
def run_experiment(root: Path, name: str, sets: list[str], timeout_s: float) -> dict | State:
    """`dvc exp run --temp` of one experiment, its output in the log; its state and main
    metrics, or a Failed state."""
    logger = get_run_logger()
    logger.info(f"{name} ({' '.join(sets)}): running")
    cmd = [*dvc_command(), *exp_run_args(name, sets), "--temp"]
    deployed = bool(runtime.deployment.id)  # cancelled by its runner's SIGTERM handler (flows.py)
    try:
        code, tail = run_group(cmd, root, timeout_s, readable(logger.info), not deployed)
    except Timeout as e:
        return Failed(message=f"{name}: {e}")
    except TerminationSignal:  # that cancellation: the experiment was stopped as every stop is
        return Cancelled(message=f"{name}: stopped by its cancellation")
    if code != 0:
        return Failed(message=f"{name}: failed (exit {code}): {why(tail)}")
    return ended(name, Poll(root, logger.warning).results([name])[name])


def why(tail: str) -> str:
    """The line of a failed `dvc exp run` that says why: the stage's `error:` line, or DVC's
    `ERROR:`, not DVC's sign-off ("Having any troubles?")."""
    lines = [line.strip() for line in tail.strip().splitlines() if line.strip()]
    said = [line for line in lines if line.lower().startswith("error:")]
    return (said or lines or [""])[-1]


def ended(name: str, summary: dict, more: str = "") -> dict | State:
    """An ended experiment's task result: its state and main metrics (said in the log too), or
    a Failed state when it did not succeed (a task's message, with no traceback to read past)."""
    get_run_logger().info(f"{name}: {summary['state']} {main_metrics(summary)}".rstrip())
    if summary["state"] != "success":
        return Failed(message=f"{name}: {summary['state']}{more}")
    return {"experiment": name, "state": summary["state"], **metric_values(summary)}


def run_queued(
    root: Path, plan: dict[str, list[str]], workers: int, timeout_s: float, poll: Poll
) -> None:
    """Queue the plan, start `workers` DVC queue workers, follow the experiments until all have
    ended (one running past `timeout_s` is killed); on any early end, stop the queue. Each
    experiment is a task, from when it leaves the queue to its end. A slow or failing poll
    never stops the sweep (`Poll`): only a stop, or `timeout_s` with no answer from DVC, does."""
    logger = get_run_logger()
    for name, sets in plan.items():
        dvc(root, *exp_run_args(name, sets), "--queue", doing=f"queueing {name}")
        logger.info(f"{name} ({' '.join(sets)}): queued")
    ends = {name: Future() for name in plan}  # set as this flow's one poll sees each end
    followers, started, known = {}, {}, None
    try:
        start_workers(root, workers)
        while True:
            known = poll.results(plan, patience_s=timeout_s)
            for name, summary in known.items():
                state = summary["state"]
                if state != "queued" and name not in followers:
                    logger.info(f"{name}: left the queue ({state})")
                    followers[name] = follow.submit(name, ends[name])
                if state in ENDED and not ends[name].done():
                    ends[name].set_result(summary)
                if state == "running":
                    started.setdefault(name, time.monotonic())
                    if time.monotonic() - started[name] > timeout_s:
                        logger.error(f"{name}: ran past {timeout_s:.0f} s; stopping it")
                        interrupt(root, {name: summary["pid"]}, logger.warning)
                        started[name] = math.inf  # asked once
            if all(end.done() for end in ends.values()):
                break
            time.sleep(max(POLL_S, poll.took))  # a slow DVC is asked less often
    finally:
        early = [end for end in ends.values() if not end.done()]
        for end in early:  # its task ends now, Failed
            end.set_result({"state": "stopped (the sweep ended first)"})
        if early:  # failed or cancelled: nothing of this sweep keeps running
            stop_queue(root, plan, logger.warning, known)
        stop_idle_workers(root, logger.warning)  # DVC's workers outlive the queue
    wait(list(followers.values()))


@task(task_run_name="{name}", cache_policy=NONE)  # `end` is no input to cache on
def follow(name: str, end: Future) -> dict | State:
    """A queued experiment from when it left the queue to its end, both seen by the flow's
    poll: its state and main metrics, or a Failed state."""
    return ended(name, end.result(), f" (`dvc queue logs {name}` has its output)")


@flow(name="experiment", flow_run_name="{name}")
def experiment(
    name: str,
    sets: list[str],
    baseline: str,
    workdir: str = ".",
    timeout_s: float = 3600,
    remote: str = "origin",
    heartbeat_s: float = LOST_AFTER_S / BEATS,
) -> dict | State:
    """One experiment of a spread sweep, on the worker that took it: `dvc exp run` in this
    worker's checkout, then `dvc exp push` to the git remote `remote` and the default DVC
    remote. A checkout that is not at the sweep's `baseline` commit, has uncommitted changes or
    lacks a remote refuses first, in one line. Completed with where it ran in its message.
    A heartbeat every `heartbeat_s` tells the sweep it lives, whatever it waits on (this
    checkout's lock, training, the push)."""
    logger = get_run_logger()
    root = find_root(Path(workdir))
    with (
        heartbeat(f"{socket.gethostname()}:{root}", heartbeat_s),
        workspace_lock(root, wait=True, say=logger.warning),
        claimed(root),
    ):
        if problem := spread_problem(root, remote, baseline):
            raise StageFailed(problem)
        state = run_experiment(root, name, sets, timeout_s, return_state=True)
        if state.is_cancelled():  # as a deployment's run ends when cancelled: quietly
            return stopped_run(state.message)
        if not state.is_completed():
            raise StageFailed(state.message)
        push_experiment(root, name, remote, timeout_s)
    logger.info(f"{name}: pushed to {remote}")
    return Completed(message=f"{name} ran on {socket.gethostname()}:{root}", data=state.result())


@contextmanager
def heartbeat(where: str, every_s: float) -> Iterator[None]:
    """While the block runs, a thread counts up this flow run's HEARTBEAT label every
    `every_s` (and sets RAN_ON to `where`). The sweep judges the count moving on its own clock:
    the machines' clocks need not agree. A beat the server missed is made up by the next."""
    run_id, logger = runtime.flow_run.id, get_run_logger()
    stop = threading.Event()

    def beat() -> None:
        with get_client(sync_client=True) as client:
            beats = 0
            while not stop.is_set():
                beats += 1
                try:
                    client.update_flow_run_labels(run_id, {RAN_ON: where, HEARTBEAT: beats})
                except Exception as e:  # the API away a while: the sweep waits lost_after_s
                    logger.debug(f"heartbeat not sent: {e}")
                stop.wait(every_s)

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=every_s)  # not for a beat the API is slow to take


def run_spread(
    root: Path,
    plan: dict[str, list[str]],
    deployment: str,
    timeout_s: float,
    remote: str,
    lost_after_s: float,
    poll: Poll,
) -> tuple[list[dict], str | None]:
    """Each experiment as a flow run of `deployment`; wait for them all (a stop, a cancellation
    of this run or an error here cancels those not ended), pull the ones that succeeded, and the
    sweep's table with where each ran and why one did not succeed. Stopped (Ctrl-C, SIGTERM,
    SIGHUP, a cancellation): the table so far, from what the server said (nothing pulled), and
    why it stopped."""
    logger = get_run_logger()
    if problem := spread_problem(root, remote):
        raise StageFailed(problem)
    commit = git(root, "rev-parse", "HEAD").strip()
    if changed := uncommitted(root):
        logger.warning(
            f"uncommitted changes here ({', '.join(changed[:3])}) are not part of the sweep: it "
            f"runs commit {commit[:8]}, and a worker in this checkout refuses until they are "
            "committed or stashed"
        )
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise StageFailed(
                f"no deployment {deployment} on the Prefect server: `prefect deploy --all` in "
                "the project (prefect.yaml), with a worker on its pool"
            ) from None
    runs, ends, stopped = {}, {}, None
    try:
        for name, sets in plan.items():
            parameters = dict(name=name, sets=sets, baseline=commit, timeout_s=timeout_s)
            parameters |= dict(remote=remote, heartbeat_s=lost_after_s / BEATS)
            runs[name] = run_deployment(
                deployment, parameters=parameters, flow_run_name=name, timeout=0
            )
            logger.info(f"{name} ({' '.join(sets)}): sent to {deployment}")
        if not wait_for_children(runs, ends, lost_after_s):
            stopped = "cancelled: the experiments not ended were cancelled"
    except (KeyboardInterrupt, TerminationSignal):
        stopped = "the sweep's experiments that had not ended were stopped"
    finally:
        cancel_unended(runs, ends)
    if stopped:
        return spread_rows(plan, ends), stopped
    succeeded = [n for n, run in ends.items() if run.state.is_completed()]
    pull_experiments(root, succeeded, remote, timeout_s)
    rows = sweep_table(poll, plan)
    for row in rows:
        row |= where_and_why(ends[row["experiment"]])
    return rows, None


def where_and_why(run) -> dict:
    """A spread experiment's columns from its flow run: where it ran (its worker's host and
    checkout), and for one that did not succeed its state and why (the line it failed with)."""
    found = {"ran on": (run.labels or {}).get(RAN_ON)}
    state = run.state
    if state.is_completed():
        return found | {"state": "success", "why": None}
    why = re.sub(r"^Flow run encountered an exception: \w+: ", "", state.message or "")
    return found | {"state": state.name.lower(), "why": why or None}


def spread_rows(plan: dict[str, list[str]], ends: dict) -> list[dict]:
    """The table of a stopped spread sweep, from the server alone: those ended as they ended
    (the ones that succeeded were pushed: `dvc exp pull` fetches them), the rest `stopped`."""
    keys = sorted({key for sets in plan.values() for key in sweeps.overrides(sets)})
    rows = []
    for name, sets in plan.items():
        row = {"experiment": name, "state": "stopped"}
        row |= {key: sweeps.overrides(sets).get(key) for key in keys}
        row |= where_and_why(ends[name]) if name in ends else {"ran on": None, "why": None}
        rows.append(row)
    return rows


def wait_for_children(runs: dict, ends: dict, lost_after_s: float) -> bool:
    """Each child's ended flow run into `ends`, said in the log as it comes; False when this run
    is cancelled meanwhile (`prefect flow-run cancel` of a sweep started from a terminal: no
    runner stops it). A running one whose heartbeat did not move for `lost_after_s` has lost its
    worker or machine: marked Crashed, saying so. Said once: the ones no worker took in
    UNTAKEN_S."""
    logger = get_run_logger()
    start, said, beats = time.monotonic(), False, {}  # beats: name -> (count, seen at)
    with get_client(sync_client=True) as client:
        while len(ends) < len(runs):
            if runtime.flow_run.id:
                mine = client.read_flow_run(runtime.flow_run.id).state
                if mine and mine.is_cancelling():
                    return False
            now = {n: client.read_flow_run(r.id) for n, r in runs.items() if n not in ends}
            for name, run in now.items():
                if run.state and run.state.is_running():
                    count = (run.labels or {}).get(HEARTBEAT)
                    if beats.get(name, (None,))[0] != count or name not in beats:
                        beats[name] = (count, time.monotonic())
                    elif time.monotonic() - beats[name][1] > lost_after_s:
                        where = (run.labels or {}).get(RAN_ON, "a worker")
                        message = (
                            f"no heartbeat for {lost_after_s:.0f} s: its worker or machine "
                            f"was lost ({where})"
                        )
                        crashed = Crashed(message=message)
                        client.set_flow_run_state(run.id, crashed, force=True)
                        run.state = crashed
                if run.state and run.state.is_final():
                    ends[name] = run
                    message = run.state.message or ""
                    logger.info(f"{name}: {run.state.name}: {message}".rstrip(": "))
            untaken = [n for n, run in now.items() if run.state and run.state.is_scheduled()]
            if untaken and not said and time.monotonic() - start > UNTAKEN_S:
                logger.warning(
                    f"{', '.join(untaken)} not started after {UNTAKEN_S:.0f} s: every worker of "
                    "the deployment's pool busy, or none running (`prefect worker start --pool ...`)"
                )
                said = True
            time.sleep(1.0)
    return True


def cancel_unended(runs: dict, ends: dict) -> None:
    """Cancel the child runs not ended (the sweep stopped or failed): their workers stop them."""
    with get_client(sync_client=True) as client:
        for name, run in runs.items():
            if name not in ends:
                client.set_flow_run_state(run.id, Cancelling(message="its sweep ended first"))


def interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a sweep of experiments, one table of them.")
    parser.add_argument("workdir", nargs="?", default=".", help="the DVC project (default: here)")
    parser.add_argument(
        "-e",
        "--experiment",
        action="append",
        required=True,
        help='one experiment\'s overrides: -e "train.lr=1e-3 train.epochs=3"',
    )
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--workers", type=int, default=0, help="queued, N at a time (DVC's queue)")
    how.add_argument(
        "--spread",
        nargs="?",
        const=EXPERIMENT,
        help=f"send each to the work pool, as runs of this deployment ({EXPERIMENT})",
    )
    parser.add_argument("--remote", default="origin", help="with --spread: the git remote")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per experiment")
    parser.add_argument(
        "--lost-after",
        type=float,
        default=LOST_AFTER_S,
        help="with --spread: seconds without a heartbeat before an experiment's worker counts "
        f"as lost and the experiment is marked Crashed ({LOST_AFTER_S:.0f})",
    )
    args = parser.parse_args()
    try:
        root = find_root(Path(args.workdir))
    except NotAProject as e:
        sys.exit(f"error: {e}")
    # one override per `key=`: a value may hold spaces ("prepare.formats=[PNG, JPEG]")
    overrides = [re.split(r"\s+(?=[\w.-]+=)", e.strip()) for e in args.experiment]
    for stop in (signal.SIGTERM, signal.SIGHUP):  # as Ctrl-C: what has not ended is stopped
        signal.signal(stop, interrupted)
    try:
        state = experiments(
            str(root),
            overrides,
            workers=args.workers,
            timeout_s=args.timeout,
            spread=bool(args.spread),
            deployment=args.spread or EXPERIMENT,
            remote=args.remote,
            lost_after_s=args.lost_after,
            return_state=True,
        )
    except KeyboardInterrupt:
        state = Cancelled()
    for row in table_of(state):  # the rows that succeeded too, when some did not
        print(json.dumps(row))
    if state.is_cancelled():
        why = state.message or "the sweep's experiments that had not ended were stopped"
        print(f"stopped: {why}", file=sys.stderr)
        sys.exit(STOPPED_EXIT)
    try:
        state.result()
    except Exception as e:
        sys.exit(f"error: {e}")


def table_of(state: State) -> list[dict]:
    """The `experiments` table the sweep's run published (none when it failed before, or was
    stopped before its run began)."""
    if state.state_details.flow_run_id is None:
        return []
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["experiments"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]),
            )
        )
    return json.loads(found[-1].data) if found else []


if __name__ == "__main__":
    main()
