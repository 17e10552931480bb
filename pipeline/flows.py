"""Prefect flows around the DVC pipeline: DVC stays the only DAG, Prefect runs and shows it.

`reproduce` asks `dvc status --json` first and ends at once when nothing changed; otherwise it
runs one task per stage, in the order of DVC's own graph: a stage DVC finds unchanged (asked in
this process) is skipped; the others run `dvc repro --single-item <stage>`, each in its own
process group: its output streams to the Prefect log, its timeout fires whether or not it prints.
Every stop (the timeout, a cancellation's SIGTERM, Ctrl-C, this process's death) is the runner's
one path: SIGINT, on which training checkpoints its epoch, then SIGKILL after the grace period,
so nothing of the stage's process tree is left. A task is retried only when another `dvc` holds
the repository's lock; a stage that fails on its own fails the flow with its output, and its
previous results come back from DVC's cache. A queued sweep has a guard process that stops its
experiments if this process dies; the next run marks such a dead flow run Crashed.

One run at a time per workspace, on every path (these functions called from Python, the CLI,
`--serve`, a work-pool worker): an OS file lock in the workspace's `.dvc/tmp`, which the kernel
releases when its holder dies and which every process sharing the folder sees. Nothing has to
be created on the Prefect server first, and an API outage during a run does not end it.

Run:    .venv/bin/python -m pipeline.flows [WORKDIR] [--if-busy wait|skip]   (exit 75: skipped)
Serve:  .venv/bin/python -m pipeline.flows [WORKDIR] --serve --interval 3600   (or --cron '0 * * * *')
Watch:  .venv/bin/python -m pipeline.flows [WORKDIR] --watch [--deployment reproduce/scheduled]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Literal
from uuid import UUID

from prefect import flow, get_run_logger, runtime, serve, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE
from prefect.deployments import run_deployment
from prefect.futures import wait
from prefect.states import Completed, Failed, State

from visionflow import runner
from visionflow.files import flatten
from visionflow.params import read_yaml
from visionflow.project import all_deps, preflight, special_files
from visionflow.runner import (
    BUSY_EXIT,
    NotAProject,
    Timeout,
    dvc_busy,
    dvc_command,
    environment,
    find_root,
    restore,
    run_group,
    stop_grace_s,
    wait_until_free,
    workspace_lock,
)

LOCK_RETRIES, LOCK_WAIT_S = 3, 5.0
DVC_TIMEOUT_S = (
    120.0  # a helper `dvc` call (status, metrics, exp show, queue) that takes longer hangs
)
POLL_S = 5.0  # how often a sweep asks DVC how its experiments are doing
MAIN_METRICS = {"results/evaluate/metrics.json": ("accuracy", "macro_f1")}


class StageFailed(RuntimeError):
    """A stage or a dvc command failed; the message carries the end of its output."""


class DvcHung(StageFailed):
    """A helper dvc command ran past DVC_TIMEOUT_S."""


class DvcBusy(RuntimeError):
    """Another `dvc` process holds the repository's lock (a user's own `dvc` command, say)."""

    @classmethod
    def at(cls, workdir: Path, what: str) -> "DvcBusy":
        return cls(f"{what}: another dvc process holds {workdir}/.dvc/tmp/lock")


def dvc(workdir: Path, *args: str, doing: str) -> str:
    """A short dvc command's output; a failure or a hang raises, naming what it was `doing`;
    DvcBusy when another dvc holds the repository's lock (before, or when the command failed)."""
    command = f"`dvc {' '.join(args)}` ({doing})"
    if dvc_busy(workdir):
        raise DvcBusy.at(workdir, command)
    try:
        result = subprocess.run(
            [*dvc_command(), *args],
            cwd=workdir,
            env=environment(),
            capture_output=True,
            text=True,
            timeout=DVC_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise DvcHung(f"{command} did not finish in {DVC_TIMEOUT_S:.0f} s") from None
    if result.returncode != 0:
        if dvc_busy(workdir):
            raise DvcBusy.at(workdir, command)
        raise StageFailed(f"{command} failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return result.stdout


def stages_in_order(workdir: Path) -> list[str]:
    """Every stage with a command, in the order of DVC's own graph (what `dvc repro` walks:
    any order in dvc.yaml, foreach groups, templated stages, other dvc.yaml files), as DVC
    addresses them (`train`, `sub/dvc.yaml:fit`, `many@x`); ties in a stable order."""
    import networkx as nx
    from dvc.repo import Repo

    def address(stage) -> str:  # as `dvc repro` in the project's root takes it
        path = stage.path_in_repo
        return stage.name if path == "dvc.yaml" else f"{path}:{stage.name}"

    with Repo(str(workdir)) as repo:
        graph = repo.index.graph.reverse()  # DVC's edges go from a stage to what it depends on
        order = nx.lexicographical_topological_sort(graph, key=address)
        return [address(stage) for stage in order if stage.cmd]  # not `dvc add`ed data


def dvcfile_and_name(workdir: Path, stage: str) -> tuple[Path, str]:
    """`sub/dvc.yaml:fit` -> (workdir/sub/dvc.yaml, fit); `train` -> (workdir/dvc.yaml, train)."""
    path, sep, name = stage.rpartition(":")
    return workdir / (path if sep else "dvc.yaml"), name


def locked(workdir: Path, stage: str) -> dict | None:
    """The stage's entry in its dvc.lock: it changes exactly when DVC brings the stage up to date."""
    dvcfile, name = dvcfile_and_name(workdir, stage)
    lock = dvcfile.with_suffix(".lock")
    return (read_yaml(lock).get("stages") or {}).get(name) if lock.exists() else None


def only_when_busy(task, task_run, state) -> bool:
    """Prefect's retry condition: retry a stage only when another dvc held the repository."""
    try:
        state.result()
    except DvcBusy:
        return True
    except BaseException:
        return False
    return False


@task(retries=LOCK_RETRIES, retry_delay_seconds=LOCK_WAIT_S, retry_condition_fn=only_when_busy)
def changed(workdir: Path) -> dict:
    """`dvc status --json`: empty when the pipeline is up to date. What would make DVC hang (a
    FIFO among the deps) or answer in words that name nothing (an unreadable params.yaml, a link
    to nothing, an empty dvc.lock) is refused first, by name (`project.preflight`)."""
    problems = preflight(workdir)
    if problems:
        raise StageFailed("; ".join(problems))
    return json.loads(dvc(workdir, "status", "--json", doing="what changed") or "{}")


@task(
    task_run_name="{stage}",
    retries=LOCK_RETRIES,
    retry_delay_seconds=LOCK_WAIT_S,
    retry_condition_fn=only_when_busy,
)
def run_stage(workdir: Path, stage: str, timeout_s: float) -> bool:
    """`dvc repro --single-item <stage>`; True when DVC brought it up to date, False when it was."""
    logger = get_run_logger()
    if dvc_busy(workdir):
        raise DvcBusy.at(workdir, stage)
    if unchanged(workdir, stage):
        logger.info(f"Stage '{stage}' didn't change, skipping")
        return False
    before, stops = locked(workdir, stage), len(runner.FORWARDED)
    cmd = [*dvc_command(), "repro", "--single-item", stage]
    try:
        code, tail = run_group(cmd, workdir, timeout_s, readable(logger.info))
    except Timeout as e:
        restore(workdir, logger.warning, stage)
        raise StageFailed(f"stage {stage}: {e} (stage_timeout_s={timeout_s:g})") from None
    if len(runner.FORWARDED) > stops:  # this process was asked to stop (a cancellation, say):
        if code != 0:  # the stage stopped at its safe point; Prefect's runner, which sent the
            restore(workdir, logger.warning, stage)  # SIGTERM, marks the run Cancelled
        name = signal.Signals(runner.FORWARDED[-1]).name
        raise StageFailed(f"stage {stage}: stopped by {name} (exit {code}):\n{tail}")
    if code == 0:
        return locked(workdir, stage) != before
    if dvc_busy(workdir) or lock_refused(tail, stage):  # DVC could not take its lock back to
        wait_until_free(workdir)  # record the results: put them back as dvc.lock has them, retry
        restore(workdir, logger.warning, stage)
        raise DvcBusy.at(workdir, stage)
    restore(workdir, logger.warning, stage)  # its previous results, from DVC's cache
    raise StageFailed(f"stage {stage} failed (exit {code}):\n{tail}")


# DVC's advice after a stage or an experiment records its results, each followed by a blank
# line and the command, indented with a tab: noise in a flow's log (the flow commits nothing).
DVC_HINTS = ("To track the changes with git, run:", "To enable auto staging, run:")


def readable(log: Callable[[str], None]) -> Callable[[str], None]:
    """`log` for DVC's output, less what a person does not read there: blank lines and DVC's
    git hints with their commands (`git add ...`, `dvc config core.autostage true`)."""
    in_hint = False

    def say(line: str) -> None:
        nonlocal in_hint
        if line.startswith(DVC_HINTS):
            in_hint = True
        elif line.strip() and not (in_hint and line.startswith("\t")):
            in_hint = False
            log(line)

    return say


def lock_refused(output: str, stage: str) -> bool:
    """DVC's own line for a lock it could not take (the other `dvc` may have let go of it by
    the time this process looks at the lock itself); not the stage command's own words."""
    from dvc.lock import FAILED_TO_LOCK_MESSAGE

    dvc_says = f"ERROR: failed to reproduce '{stage}': {FAILED_TO_LOCK_MESSAGE.split('.')[0]}"
    return any(line.startswith(dvc_says) for line in output.splitlines())


def unchanged(workdir: Path, stage: str) -> bool:
    """Whether `dvc repro --single-item <stage>` would skip the stage, asked of DVC in this
    process (`Stage.changed()`, the test `dvc repro` makes): a `dvc` process spends 0.4 s of CPU
    to say so. False when unsure (DVC's lock taken, an output in use, no such single stage, a
    FIFO among the deps or outputs, made during the run, which would block hashing here with no
    timeout): the stage's own `dvc repro` then decides, under the stage timeout."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    dvcfile, name = dvcfile_and_name(workdir, stage)
    try:
        with Repo(str(workdir)) as repo, repo.lock:
            found = repo.stage.load_one(path=str(dvcfile), name=name)
            files = [*found.deps, *found.outs]  # DVC hashes both
            local = [Path(f.fs_path) for f in files if f.fs.protocol == "local"]
            return not special_files(local) and not found.changed()
    except DvcException:
        return False


def publish(workdir: Path) -> None:
    """Artifacts: the metrics table, the diff against the last commit, and export parity."""
    shown = json.loads(dvc(workdir, "metrics", "show", "--json", doing="publishing") or "{}")
    files = shown.get("", {}).get("data", {})
    rows = [  # one row per number: three columns, however many metrics (dvc.yaml keeps them few)
        {"file": path, "metric": name, "value": value}
        for path, content in files.items()
        for name, value in flatten(content.get("data", {})).items()
    ]
    create_table_artifact(rows, key="metrics", description="dvc metrics show")
    diff = dvc(workdir, "metrics", "diff", "--md", doing="publishing")
    diff = diff or "no change against the last commit"
    create_markdown_artifact(f"## Metrics diff (workspace vs HEAD)\n\n{diff}", key="metrics-diff")
    parity_file = workdir / "results/export/parity.json"
    if parity_file.exists():
        parity = json.loads(parity_file.read_text())
        rows = [
            {"format": fmt, "batch": name, **result}
            for fmt in ("onnx", "pt2", "torchscript")
            for name, result in parity.get(fmt, {}).items()
        ]
        description = f"exporter {parity['exporter']}"
        create_table_artifact(rows, key="export-parity", description=description)


@flow(name="reproduce")
def reproduce(
    workdir: str = ".", if_busy: Literal["wait", "skip"] = "wait", stage_timeout_s: float = 3600
) -> list[str]:
    """Bring the pipeline up to date; returns the stages that ran (none when nothing changed).

    Never two runs at once in one workspace: a second run waits for the first, or with
    `if_busy="skip"` ends at once in a Completed state named "Skipped".
    """
    logger = get_run_logger()
    root = find_root(Path(workdir))
    with workspace_lock(root, wait=if_busy == "wait", say=logger.warning) as held:
        if not held:
            logger.warning("another run holds this workspace: skipped (if_busy=skip)")
            return Completed(name="Skipped", message="another run holds the workspace", data=[])
        return bring_up_to_date(root, stage_timeout_s)


def bring_up_to_date(root: Path, stage_timeout_s: float) -> list[str]:
    """The body of `reproduce`, under the workspace lock."""
    logger = get_run_logger()
    with claimed(root):
        what = changed(root)
        if not what:
            logger.info("pipeline is up to date: nothing to run")
            return []
        logger.info(f"changed: {', '.join(what)}")
        ran = [stage for stage in stages_in_order(root) if run_stage(root, stage, stage_timeout_s)]
        logger.info(f"ran: {', '.join(ran)}")
        publish(root)
        return ran


@contextmanager
def claimed(root: Path) -> Iterator[None]:
    """Record this flow run as the one holding the workspace (the lock is held already). A
    record another run left means its process died holding it (kill -9, a lost machine): that
    run is marked Crashed, so it does not show as Running for good."""
    record = root / ".dvc" / "tmp" / "visionflow-flow-run.json"
    mine = str(runtime.flow_run.id or "")
    try:
        left = json.loads(record.read_text()).get("flow_run_id")
    except (OSError, ValueError, AttributeError):
        left = None
    if left and left != mine:
        crash_orphan(root, left, mine)
    record.write_text(json.dumps({"flow_run_id": mine, "pid": os.getpid()}))
    try:
        yield
    finally:
        record.unlink(missing_ok=True)


def crash_orphan(root: Path, orphan: str, mine: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    logger = get_run_logger()
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(UUID(orphan))
            if run.state is None or run.state.is_final():
                return
            message = f"its process died while it held {root} (found by flow run {mine})"
            client.set_flow_run_state(run.id, Crashed(message=message), force=True)
        logger.warning(f"flow run {run.name} ({orphan}) {message}: marked Crashed")
    except Exception as e:  # another server's run, say: report it, never fail this run for it
        logger.warning(f"flow run {orphan} held {root} when its process died ({e})")


@flow(name="experiments")
def experiments(
    workdir: str = ".",
    overrides: list[list[str]] | None = None,
    workers: int = 0,
    timeout_s: float = 3600,
) -> list[dict]:
    """`dvc exp run -S ...` for each list of overrides; publishes a table of these experiments
    (the params that differ from the baseline, the main metrics) and returns its rows.

    `workers: 0` runs them one after another, `workers: N` queues them and lets DVC's queue run
    N at a time; either way each runs in its own temporary copy, so the workspace stays as it is,
    and each gets `timeout_s`. The workspace is held until every experiment of this sweep ended;
    a failed or cancelled sweep stops the DVC queue's workers. Each experiment is a task run
    named after it: Completed with its main metrics, or Failed. One failed experiment does not
    stop the others; the flow fails at the end, naming it.
    Example overrides: [["train.lr=3e-4"], ["train.lr=1e-3", "train.epochs=30"]].
    """
    logger = get_run_logger()
    root = find_root(Path(workdir))
    prefix = f"sweep-{str(runtime.flow_run.id or 'local')[:8]}"
    plan = {f"{prefix}-{i}": sets for i, sets in enumerate(overrides or [], start=1)}
    problems = preflight(root)  # DVC stashes params.yaml before any stage could refuse it
    if problems:
        raise StageFailed("; ".join(problems))
    with workspace_lock(root, wait=True, say=logger.warning), claimed(root):
        if workers:
            with guarded(root, plan):
                run_queued(root, plan, workers, timeout_s)
        else:
            run_in_turn(root, plan, timeout_s)
        rows = sweep_table(root, plan)
    create_table_artifact(rows, key="experiments", description=f"{prefix}: dvc exp show")
    failed = [row["experiment"] for row in rows if row["state"] != "success"]
    if failed:
        raise StageFailed(f"experiments {', '.join(failed)} did not succeed (see their logs)")
    return rows


def exp_run_args(name: str, sets: list[str]) -> list[str]:
    return ["exp", "run", "--name", name, *(arg for s in sets for arg in ("--set-param", s))]


def run_in_turn(root: Path, plan: dict[str, list[str]], timeout_s: float) -> None:
    stops = len(runner.FORWARDED)
    for name, sets in plan.items():  # a failed one is its task's state: the next one runs
        run_experiment(root, name, sets, timeout_s, return_state=True)
        if len(runner.FORWARDED) > stops:  # a cancellation or Ctrl-C stopped that one: no more
            signal_name = signal.Signals(runner.FORWARDED[-1]).name
            raise StageFailed(f"sweep stopped by {signal_name} during {name}; the rest not run")


@task(task_run_name="{name}")
def run_experiment(root: Path, name: str, sets: list[str], timeout_s: float) -> dict | State:
    """`dvc exp run --temp` of one experiment, its output in the log; its state and main
    metrics, or a Failed state."""
    logger = get_run_logger()
    logger.info(f"{name} ({' '.join(sets)}): running")
    cmd = [*dvc_command(), *exp_run_args(name, sets), "--temp"]
    try:
        code, tail = run_group(cmd, root, timeout_s, readable(logger.info))
    except Timeout as e:
        return Failed(message=f"{name}: {e}")
    if code != 0:
        last = tail.strip().splitlines()[-1:]  # DVC's own line for why
        return Failed(message=f"{name}: failed (exit {code}): {''.join(last)}")
    return ended(name, results(root, [name])[name])


def ended(name: str, summary: dict, more: str = "") -> dict | State:
    """An ended experiment's task result: its state and main metrics (said in the log too), or
    a Failed state when it did not succeed (a task's message, with no traceback to read past)."""
    get_run_logger().info(f"{name}: {summary['state']} {main_metrics(summary)}".rstrip())
    if summary["state"] != "success":
        return Failed(message=f"{name}: {summary['state']}{more}")
    return {"experiment": name, "state": summary["state"], **metric_values(summary)}


def run_queued(root: Path, plan: dict[str, list[str]], workers: int, timeout_s: float) -> None:
    """Queue the plan, start `workers` DVC queue workers, follow the experiments until all have
    ended (one running past `timeout_s` is killed); on any early end, stop the queue. Each
    experiment is a task, from when it leaves the queue to its end."""
    logger = get_run_logger()
    for name, sets in plan.items():
        dvc(root, *exp_run_args(name, sets), "--queue", doing=f"queueing {name}")
        logger.info(f"{name} ({' '.join(sets)}): queued")
    ends = {name: Future() for name in plan}  # set as this flow's one poll sees each end
    followers, started = {}, {}
    try:
        start_workers(root, workers)
        while True:
            for name, summary in results(root, plan).items():
                state = summary["state"]
                if state != "queued" and name not in followers:
                    logger.info(f"{name}: left the queue ({state})")
                    followers[name] = follow.submit(name, ends[name])
                if state in ENDED and not ends[name].done():
                    ends[name].set_result(summary)
                if state == "running":
                    started.setdefault(name, time.monotonic())
                    if time.monotonic() - started[name] > timeout_s:
                        logger.error(f"{name}: ran past {timeout_s:.0f} s; killing it")
                        dvc(root, "queue", "kill", name, doing=f"stopping {name}")
            if all(end.done() for end in ends.values()):
                break
            time.sleep(POLL_S)
    finally:
        early = [end for end in ends.values() if not end.done()]
        for end in early:  # its task ends now, Failed
            end.set_result({"state": "stopped (the sweep ended first)"})
        if early:  # failed or cancelled: nothing of this sweep keeps running
            stop_queue(root, plan)
    wait(list(followers.values()))


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
        timeout=DVC_TIMEOUT_S,
        check=True,
    )


@task(task_run_name="{name}", cache_policy=NONE)  # `end` is no input to cache on
def follow(name: str, end: Future) -> dict | State:
    """A queued experiment from when it left the queue to its end, both seen by the flow's
    poll: its state and main metrics, or a Failed state."""
    return ended(name, end.result(), f" (`dvc queue logs {name}` has its output)")


ENDED = ("success", "failed")

# A sweep's guard waits for EOF on stdin. Without "done" first, the flow process died (kill -9):
# the guard becomes `python -m pipeline.flows ROOT --stop-sweep NAME...`, which stops this
# sweep's experiments, holding the workspace lock it inherited until they are gone.
SWEEP_GUARD = """
import os, sys
if b"done" not in sys.stdin.buffer.read():
    os.execv(sys.executable, [sys.executable, "-m", "pipeline.flows", sys.argv[1], "--stop-sweep",
                              *sys.argv[2:]])
"""


@contextmanager
def guarded(root: Path, names) -> Iterator[None]:
    """While a queued sweep runs, a guard process that stops it if this process dies (DVC's
    queue worker is a daemon: nothing else would)."""
    log = open(root / ".dvc" / "tmp" / "visionflow-sweep-guard.log", "a")  # not our stdout:
    guard = subprocess.Popen(  # it may be a pipe that dies with this process
        [sys.executable, "-c", SWEEP_GUARD, str(root), *names],
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
        guard.communicate(b"done")  # ended here, stopped here if need be: the guard goes


def stop_queue(root: Path, plan, say: Callable[[str], None] | None = None) -> None:
    """Drop this sweep's queued experiments and stop its running ones: `dvc queue kill` (SIGINT to
    the worker's process group, so training stops at a safe point), then, the grace period
    (`stop_grace_s()`) later, SIGKILL to what is left of that group (DVC's forced kill would
    orphan the stage's own process)."""
    now = results(root, plan)
    queued = [name for name, summary in now.items() if summary["state"] == "queued"]
    running = {
        name: summary["pid"] for name, summary in now.items() if summary["state"] == "running"
    }
    try:  # best effort: what DVC cannot stop, the SIGKILL below does
        if queued:
            dvc(root, "queue", "remove", *queued, doing="dropping the sweep's queued experiments")
        if running:
            dvc(root, "queue", "kill", *running, doing="stopping the sweep's experiments")
    except (StageFailed, DvcBusy) as e:
        (say or get_run_logger().warning)(str(e))
    groups = set()
    for pid in filter(None, running.values()):
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:  # ended meanwhile
            pass
    deadline = time.monotonic() + stop_grace_s()
    while groups and time.monotonic() < deadline:
        groups = {group for group in groups if alive(group)}
        time.sleep(0.2)
    for group in groups:
        os.killpg(group, signal.SIGKILL)


def alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False


EXP_SHOW_RETRY_S = 60.0  # how long a failing `dvc exp show` is asked again


def exp_show(root: Path) -> str:
    """`dvc exp show --json`, asked again (every 2 s, for up to EXP_SHOW_RETRY_S) when it fails:
    DVC's queue can list an experiment as active after its executor file is gone ("No such file
    or directory: .dvc/tmp/exps/run/..."; seen to last more than a few seconds for an experiment
    that failed while another ran), and a sweep must not be stopped for that. A hang is not
    asked again."""
    deadline = time.monotonic() + EXP_SHOW_RETRY_S
    while True:
        try:
            return dvc(root, "exp", "show", "--json", doing="following experiments")
        except DvcHung:
            raise
        except StageFailed:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def results(root: Path, names) -> dict[str, dict]:
    """For each experiment name: its state (queued, running, success, failed), params and
    metrics, and the baseline's params, from `dvc exp show --json`."""
    shown = json.loads(exp_show(root) or "[]")
    found = {}
    for baseline in shown:
        for exp in baseline.get("experiments") or []:
            if exp.get("name") in names:
                data = exp["revs"][0].get("data") or {}
                state = (exp.get("executor") or {}).get("state")
                state = state or ("success" if data.get("metrics") else "failed")
                found[exp["name"]] = {  # metrics of one not done are its baseline's: none
                    "state": state,
                    "pid": ((exp.get("executor") or {}).get("local") or {}).get("pid"),
                    "params": data.get("params", {}),
                    "metrics": data.get("metrics", {}) if state == "success" else {},
                    "baseline": (baseline.get("data") or {}).get("params", {}),
                }
    return {name: found.get(name, {"state": "failed"}) for name in names}  # no record: failed


def metric_values(summary: dict) -> dict:
    """The main metrics of one experiment (None where it has none)."""
    metrics = summary.get("metrics", {})
    return {
        name: (metrics.get(path) or {}).get("data", {}).get(name)
        for path, names in MAIN_METRICS.items()
        for name in names
    }


def main_metrics(summary: dict) -> str:
    values = metric_values(summary)
    return " ".join(f"{name}={value:.4f}" for name, value in values.items() if value is not None)


def sweep_table(root: Path, plan: dict[str, list[str]]) -> list[dict]:
    """One row per experiment of the sweep: name, state, the params that differ from its
    baseline (the union over the sweep, so every row has the same columns), the main metrics."""
    summaries = results(root, plan)
    diffs = {}
    for name, summary in summaries.items():
        params = flatten((summary.get("params") or {}).get("params.yaml", {}).get("data", {}))
        base = flatten((summary.get("baseline") or {}).get("params.yaml", {}).get("data", {}))
        diffs[name] = {k: v for k, v in params.items() if base.get(k) != v}
    keys = sorted({key for diff in diffs.values() for key in diff})
    rows = []
    for name, summary in summaries.items():
        row = {"experiment": name, "state": summary["state"]}
        row |= {key: diffs[name].get(key) for key in keys}
        rows.append(row | metric_values(summary))
    return rows


def serve_deployments(workdir: Path, interval_s: float | None, cron: str | None) -> None:
    """Serve `reproduce` on a schedule (and on demand), plus `experiments` on demand.

    Schedules stay active when this process stops (pause_on_shutdown=False), so a restart picks
    them up again. Trigger a run: `prefect deployment run reproduce/scheduled`.
    """
    parameters = {"workdir": str(workdir.resolve()), "if_busy": "skip"}
    scheduled = reproduce.to_deployment(
        "scheduled", interval=interval_s, cron=cron, parameters=parameters
    )
    sweep = experiments.to_deployment("on-demand", parameters={"workdir": str(workdir.resolve())})
    serve(scheduled, sweep, pause_on_shutdown=False)


def watch(root: Path, settle_s: float = 2.0, deployment: str | None = None) -> None:
    """Start a run when anything the pipeline depends on (every dep in dvc.yaml, params.yaml,
    dvc.yaml) changes, once the changes settle; filesystem events (inotify), no polling of files.

    A burst of edits (an editor's save, a copy of many images) becomes one run: the run starts
    after `settle_s` seconds without further change. With `deployment` the run is a flow run of
    that served deployment (`prefect deployment run` semantics); otherwise `reproduce` runs here.
    The flow itself asks `dvc status`, so a change DVC does not track runs no stage.
    """
    from watchdog.events import FileSystemEventHandler
    from watchdog.observers import Observer

    root = root.resolve()
    deps = all_deps(root)
    changed_at: list[float] = []
    rewatch = threading.Event()

    class Changes(FileSystemEventHandler):
        def on_any_event(self, event) -> None:
            if event.event_type in ("opened", "closed_no_write"):
                return
            paths = [Path(p) for p in (event.src_path, getattr(event, "dest_path", "")) if p]
            if any(path == dep or path.is_relative_to(dep) for path in paths for dep in deps):
                changed_at[:] = [time.monotonic()]
            if event.event_type in ("created", "deleted", "moved") and any(
                dep.is_relative_to(path) for path in paths for dep in deps
            ):  # a dep folder, or one above a dep, came or went: its watch is gone or due
                changed_at[:] = [time.monotonic()]
                rewatch.set()

    observer, handler = Observer(), Changes()

    def schedule() -> None:
        observer.unschedule_all()
        for folder, recursive in sorted(watch_points(root, deps)):
            observer.schedule(handler, str(folder), recursive=recursive)

    schedule()
    observer.start()
    print(f"watching {len(deps)} deps of {root} (settle {settle_s} s)", flush=True)
    try:
        while True:
            if rewatch.wait(0.2):
                rewatch.clear()
                schedule()
            if changed_at and time.monotonic() - changed_at[0] >= settle_s:
                changed_at.clear()
                print("change settled: starting a run", flush=True)
                if deployment:
                    run_deployment(deployment, parameters={"workdir": str(root)}, timeout=0)
                else:  # a failed run is in its log; the watcher goes on
                    reproduce(str(root), return_state=True)
                    if runner.FORWARDED:  # stopped during the run: the run has ended, so do we
                        print("stopped: the run in progress was ended first", flush=True)
                        raise SystemExit(128 + runner.FORWARDED[-1])
    finally:
        observer.stop()


def watch_points(root: Path, deps: list[Path]) -> set[tuple[Path, bool]]:
    """(folder, recursive) to watch: a folder dep whole, plus its parent (to see it go and come
    back); a file dep, or a dep not there yet, through its nearest existing folder."""
    points = set()
    for dep in deps:
        if dep.is_dir():
            points.add((dep, True))
        parent = next(p for p in dep.parents if p.is_dir())
        points.add((parent, False))
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the reproduce flow once, or serve it.")
    parser.add_argument("workdir", nargs="?", default=".", help="the DVC project (default: here)")
    parser.add_argument(
        "--if-busy",
        choices=["wait", "skip"],
        default="wait",
        help=f"when another run holds the workspace; skip exits {BUSY_EXIT}",
    )
    parser.add_argument("--serve", action="store_true", help="serve the deployments instead")
    parser.add_argument("--interval", type=float, help="with --serve: seconds between runs")
    parser.add_argument("--cron", help="with --serve: a cron schedule, e.g. '0 * * * *'")
    parser.add_argument("--watch", action="store_true", help="run whenever the inputs change")
    parser.add_argument("--settle", type=float, default=2.0, help="with --watch: quiet seconds")
    parser.add_argument("--deployment", help="with --watch: start this deployment instead")
    parser.add_argument("--stop-sweep", nargs="+", help=argparse.SUPPRESS)  # the sweep guard's
    args = parser.parse_args()
    try:
        root = find_root(Path(args.workdir))
    except NotAProject as e:
        sys.exit(f"error: {e}")
    if args.stop_sweep:
        print(f"the flow running {', '.join(args.stop_sweep)} died: stopping them", flush=True)
        stop_queue(root, args.stop_sweep, say=print)
    elif args.watch:
        watch(root, args.settle, deployment=args.deployment)
    elif args.serve:
        serve_deployments(root, args.interval, args.cron)
    else:
        state = reproduce(str(root), args.if_busy, return_state=True)
        if state.is_failed() or state.is_crashed():
            sys.exit(f"error: {state.message}")
        print(json.dumps({"ran": state.result(), "skipped": state.name == "Skipped"}))
        sys.exit(BUSY_EXIT if state.name == "Skipped" else 0)


if __name__ == "__main__":
    main()
