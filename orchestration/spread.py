"""A sweep spread over a work pool (`spread: true`): each experiment a flow run of the
`experiment` deployment (prefect.yaml), taken by whichever worker is free, in that worker's own
checkout (VISIONFLOW_WORKDIR, read when its run starts) at the sweep's commit.

Each experiment runs `dvc exp run`, then pushes it (`dvc exp push`: the git remote and the
default DVC remote); the sweep waits for them all and pulls the ones that succeeded, so `dvc exp
show` here, and on any clone after `dvc exp pull`, has the whole sweep. This workspace is not
held: a worker may run an experiment in this very checkout, and takes its lock.

An experiment's liveness is Prefect's own: while its flow runs (waiting for its checkout's lock,
training, pushing) Prefect's engine sends a `prefect.flow-run.heartbeat` event every
`beat_s(lost_after_s)` from a thread of its own (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, set on each
run). The sweep gives up on one whose latest heartbeat has not changed for `lost_after_s` (its
worker or machine was lost), on one a worker took but did not start in STARTUP_S (that worker was
lost), and on one no worker took while none of the pool's was online for `lost_after_s`: each is
cancelled (a worker that comes back stops it), its row says why, and the sweep goes on. One that
had pushed its result anyway shows that result. With no sweep watching (it was killed, its
machine lost), the server itself marks a silent experiment Crashed: Prefect's documented
zombie-run automation (`crash_silent_runs`), which the sweep creates once.
"""

import re
import socket
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from prefect import flow, get_run_logger, runtime
from prefect.automations import Automation
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from prefect.events.actions import ChangeFlowRunState
from prefect.events.filters import (
    EventFilter,
    EventNameFilter,
    EventOccurredFilter,
    EventResourceFilter,
)
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError, TerminationSignal
from prefect.states import Cancelled, Cancelling, Completed, Crashed, State

from orchestration.record import record_holder, stopped_run
from orchestration.sweep import Outcomes, Plan, overrides, run_experiment, sweep_table
from visionflow.ops import runner
from visionflow.ops.repo import DvcBusy, StageFailed, dvc
from visionflow.ops.runner import find_root, workspace_lock

EXPERIMENT = "experiment/pool-experiment"  # prefect.yaml's deployment of one experiment
UNTAKEN_S = 60.0  # a spread experiment no worker took this long is said in the log
LOST_AFTER_S = 90.0  # a spread experiment whose heartbeats stopped this long is lost
NOTICE_S = 10.0  # a cancelled lost one's live worker starts stopping it within this (~1 s here)
STARTUP_S = 600.0  # one a worker took (Pending) and did not start this long: the worker was lost
# (a process worker's start, pull step and imports take about 8 s on idle 2 cores; a Docker or
# Kubernetes worker's first pull of a torch image, minutes)
BEATS = 3  # Prefect heartbeats per lost_after_s: one late beat is not a loss
LEAST_BEAT_S = 30  # Prefect's least PREFECT_FLOWS_HEARTBEAT_FREQUENCY (its settings refuse less)
LEAST_LOST_AFTER_S = 2 * LEAST_BEAT_S  # so at least two beats fall in a lost_after_s
HEARTBEAT = "prefect.flow-run.heartbeat"  # Prefect's event, sent while a flow run's body runs
BEAT_SETTING = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"  # seconds between them, read at the run's start
SILENT = "visionflow.silent-{}s"  # the tag of the runs crash_silent_runs watches, by seconds
FINAL_STATES = ("Completed", "Failed", "Cancelled", "Crashed")  # the ends' event names
LOST = "its worker or machine was lost"  # in the message of a lost one's Crashed state
# a label of a spread experiment's flow run: the host and checkout of the worker that runs it
RAN_ON = "visionflow.ran-on"


def run(plan: Plan, deployment: str, remote: str, lost_after_s: float) -> Outcomes:
    """Each experiment as a flow run of `deployment`; wait for them all (a stop, a cancellation
    of this run or an error here cancels those not ended), pull the ones that succeeded, and the
    sweep's table with where each ran and why one did not succeed. Stopped (Ctrl-C, SIGTERM,
    SIGHUP, a cancellation): the table so far, from what the server said (nothing pulled), and
    why it stopped."""
    logger = get_run_logger()
    root = plan.root
    if problem := spread_problem(root, remote):
        raise StageFailed(problem)
    commit = git(root, "rev-parse", "HEAD").strip()
    if changed := uncommitted(root):
        logger.warning(
            f"uncommitted changes here ({', '.join(changed[:3])}) are not part of the sweep: it "
            f"runs commit {commit[:8]}, and a worker in this checkout refuses until they are "
            "committed or stashed"
        )
    pool, env = require_deployment(deployment)
    env = env | {BEAT_SETTING: str(beat_s(lost_after_s))}  # Prefect's heartbeats, at this pace
    # the server's automation waits one beat longer than the sweep
    watched = crash_silent_runs(lost_after_s + beat_s(lost_after_s), logger.warning)
    runs, ends, lost, stopped = {}, {}, {}, None
    try:
        for name, sets in plan.experiments.items():
            parameters = dict(name=name, sets=sets, baseline=commit, timeout_s=plan.timeout_s)
            parameters |= dict(remote=remote)
            runs[name] = run_deployment(
                deployment,
                parameters=parameters,
                flow_run_name=name,
                timeout=0,
                tags=[watched],
                job_variables={"env": env},
            )
            logger.info(f"{name} ({' '.join(sets)}): sent to {deployment}")
        if not wait_for_children(runs, ends, lost, lost_after_s, pool):
            stopped = "cancelled: the experiments not ended were cancelled"
    except (KeyboardInterrupt, TerminationSignal):
        stopped = "the sweep's experiments that had not ended were stopped"
    finally:
        cancel_unended(runs, ends)
    if stopped:
        return Outcomes(stopped_rows(plan, ends, latest(runs, ends)), stopped)
    pushed = settle_lost(ends, lost, lambda names: on_remote(root, remote, commit, names))
    succeeded = [name for name, run in ends.items() if run.state.is_completed() or name in pushed]
    pull_experiments(root, succeeded, remote, plan.timeout_s)
    rows = sweep_table(plan)
    for row in rows:
        row |= where_and_why(ends[row["experiment"]], row["experiment"] in pushed)
    return Outcomes(rows)


def require_deployment(deployment: str) -> tuple[str, dict]:
    """The name of `deployment`'s work pool and the environment its runs get (its job variables'
    `env`: a run's own `env` replaces it); refused in one line when the server lacks it."""
    with get_client(sync_client=True) as client:
        try:
            found = client.read_deployment_by_name(deployment)
            return found.work_pool_name, dict((found.job_variables or {}).get("env") or {})
        except ObjectNotFound:
            raise StageFailed(
                f"no deployment {deployment} on the Prefect server: `prefect deploy --all` in "
                "the project (prefect.yaml), with a worker on its pool"
            ) from None


@flow(name="experiment", flow_run_name="{name}")
def experiment(
    name: str,
    sets: list[str],
    baseline: str,
    workdir: str = ".",
    timeout_s: float = 3600,
    remote: str = "origin",
) -> dict | State:
    """One experiment of a spread sweep, on the worker that took it: `dvc exp run` in this
    worker's checkout, then `dvc exp push` to the git remote `remote` and the default DVC
    remote. A checkout that is not at the sweep's `baseline` commit, has uncommitted changes or
    lacks a remote refuses first, in one line. Completed with where it ran in its message.
    Prefect's heartbeats tell the sweep it lives, whatever it waits on (this checkout's lock,
    training, the push); its RAN_ON label says where."""
    logger = get_run_logger()
    root = find_root(Path(workdir))
    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(
            runtime.flow_run.id, {RAN_ON: f"{socket.gethostname()}:{root}"}
        )
    with workspace_lock(root, wait=True, log=logger.warning), record_holder(root):
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


def beat_s(lost_after_s: float) -> int:
    """Seconds between Prefect's heartbeats of a spread experiment: BEATS in `lost_after_s`, and
    not under LEAST_BEAT_S."""
    return max(LEAST_BEAT_S, int(lost_after_s // BEATS))


def crash_silent_runs(within_s: float, log=print) -> str:
    """The tag of flow runs that the server marks Crashed when their heartbeats stop for
    `within_s`, even with no sweep watching: Prefect's documented zombie-run automation
    (docs.prefect.io/v3/advanced/detect-zombie-flows), kept to runs with the tag and made once per
    `within_s` (found again by its name; two sweeps started at once keep the one of least id). A
    run that heartbeats, or ends, within each `within_s` of its last heartbeat is left alone; so
    is one that never beat (Pending: `gave_up`). A paused one is `log`ged, and left paused."""
    seconds = round(within_s)
    tag = SILENT.format(seconds)
    name = f"visionflow {seconds} s silent: crash runs tagged {tag}"  # unforced since stop 57
    with get_client(sync_client=True) as client:
        found = client.read_automations_by_name(name)
        while not found:  # read again after making it: another sweep's twin, made at once, too
            silent_runs_automation(name, seconds, tag).create()
            found = client.read_automations_by_name(name)
        kept, *twins = sorted(found, key=lambda a: str(a.id))
        delete_automations(client, [twin.id for twin in twins])
    if not kept.enabled:
        log(
            f"the automation '{name}' is paused: a spread experiment lost while it is, its "
            "sweep gone too, stays Running, even after a resume (Prefect counts no heartbeat "
            f"while it is paused). `prefect automation resume '{name}'` when no spread "
            "experiment runs"
        )
    return tag


def delete_automations(client, ids: list) -> None:
    """The automations of `ids` deleted; one already gone (another sweep deleted the same twin)
    is no error."""
    for automation_id in ids:
        try:
            client.delete_automation(automation_id)
        except PrefectHTTPStatusError as error:
            if error.response.status_code != 404:
                raise


def silent_runs_automation(name: str, seconds: int, tag: str) -> Automation:
    return Automation(
        name=name,
        description="Prefect's zombie-run automation, for spread experiments (spread.py)",
        trigger=EventTrigger(
            after={HEARTBEAT},
            expect={HEARTBEAT} | {f"prefect.flow-run.{end}" for end in FINAL_STATES},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification(
                {"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{tag}"}
            ),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=seconds),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {seconds} s: {LOST}",
                # not forced: Prefect refuses a final state's change (a heartbeat that reached
                # the server after the run's end must not turn Completed into Crashed) and
                # Cancelling -> Crashed (the sweep's own give-up forces that; with no sweep,
                # Prefect's cancellation cleanup ends such a run Cancelled)
                force=False,
            )
        ],
    )


def last_beat(client, run_id) -> str | None:
    """The id of the latest heartbeat event of flow run `run_id` on the server (None: none)."""
    ahead = datetime.now(UTC) + timedelta(days=1)  # the worker's clock may run ahead
    found = client.read_events(
        EventFilter(
            event=EventNameFilter(name=[HEARTBEAT]),
            resource=EventResourceFilter(id=[f"prefect.flow-run.{run_id}"]),
            occurred=EventOccurredFilter(until=ahead),
        ),
        limit=1,  # the newest first
    )
    return str(found.events[0].id) if found.events else None


def wait_for_children(
    runs: dict, ends: dict, lost: dict, lost_after_s: float, pool: str | None = None
) -> bool:
    """Each child's ended flow run into `ends`, said in the log as it comes; False when this run
    is cancelled meanwhile (`prefect flow-run cancel` of a sweep started from a terminal: no
    runner stops it). One the sweep gives up on (`gave_up`: its worker or machine lost, or no
    worker of `pool` online to take it) is cancelled and ends here with a row that says why
    (`give_up`); those a worker had taken go into `lost` (name -> when). Said once: the ones no
    worker took in UNTAKEN_S."""
    logger = get_run_logger()
    start, warned_untaken, beats = time.monotonic(), False, {}  # name -> (mark, seen at)
    no_worker_since = None  # on this process's clock: since when none of the pool's is online
    with get_client(sync_client=True) as client:
        while len(ends) < len(runs):
            if runtime.flow_run.id:
                own_state = client.read_flow_run(runtime.flow_run.id).state
                if own_state and own_state.is_cancelling():
                    return False
            now = {
                name: client.read_flow_run(run.id) for name, run in runs.items() if name not in ends
            }
            untaken = [name for name, run in now.items() if run.state and run.state.is_scheduled()]
            if untaken and pool and not pool_online(client, pool):
                no_worker_since = no_worker_since or time.monotonic()
            else:
                no_worker_since = None
            no_worker_s = time.monotonic() - no_worker_since if no_worker_since else 0.0
            for name, run in now.items():
                watch = run.state and (run.state.is_running() or run.state.is_cancelling())
                beat = last_beat(client, run.id) if watch else None
                if why := gave_up(name, run, beat, beats, lost_after_s, no_worker_s, pool):
                    if give_up(client, run, why) and run.state.is_crashed():
                        lost[name] = time.monotonic()
                elif run.state and run.state.is_crashed() and LOST in (run.state.message or ""):
                    lost[name] = time.monotonic()  # the server's automation was first
                if run.state and run.state.is_final():
                    ends[name] = run
                    message = run.state.message or ""
                    logger.info(f"{name}: {run.state.name}: {message}".rstrip(": "))
            untaken = [name for name in untaken if name not in ends]  # not one given up on
            if untaken and not warned_untaken and time.monotonic() - start > UNTAKEN_S:
                logger.warning(
                    f"{', '.join(untaken)} not started after {UNTAKEN_S:.0f} s: every worker of "
                    "the deployment's pool busy, or none running (`prefect worker start --pool ...`)"
                )
                warned_untaken = True
            time.sleep(1.0)
    return True


def pool_online(client, pool: str) -> bool:
    """Whether any worker of `pool` is online (the server marks one offline after it missed
    heartbeats for 90 s)."""
    return any(
        worker.status and worker.status.value == "ONLINE"
        for worker in client.read_workers_for_work_pool(pool)
    )


def gave_up(
    name: str,
    run,
    beat: str | None,
    beats: dict,
    lost_after_s: float,
    no_worker_s: float,
    pool: str | None = None,
) -> str | None:
    """Why the sweep gives up on its child `run` now (None: it waits on), `beat` being its
    latest heartbeat (`last_beat`, read while it runs):
    - running (or Cancelling: stopped by hand), its heartbeat unchanged for `lost_after_s`:
      its worker or machine was lost;
    - Pending (a worker took it) and not started (no heartbeat) in max(`lost_after_s`,
      STARTUP_S): that worker was lost before it started the experiment;
    - Scheduled (no worker took it) while no worker of `pool` was online for `lost_after_s`
      (`no_worker_s`, on the sweep's clock).
    Silence is judged on this process's clock (`silent`), from the run's state and heartbeat
    (the machines' clocks need not agree)."""
    state = run.state
    if state is None or state.is_final():
        return None
    if state.is_scheduled():
        if no_worker_s > lost_after_s:
            return (
                f"no worker of pool {pool} online for {lost_after_s:.0f} s to take it "
                f"(`prefect worker start --pool {pool}`)"
            )
        return None
    if state.type == StateType.PENDING:
        limit = max(lost_after_s, STARTUP_S)
        if silent(beats, name, (state.type, beat), limit):
            worker = (run.labels or {}).get("prefect.worker.name", "its worker")
            return (
                f"left Pending for {limit:.0f} s: the worker that took it ({worker}) was lost "
                "before it started"
            )
        return None
    alive = state.is_running() or state.is_cancelling()  # cancelled by hand: its worker stops it
    if alive and silent(beats, name, (state.type, beat), lost_after_s):
        where = (run.labels or {}).get(RAN_ON, "a worker")
        if state.is_cancelling():
            return f"cancelled, and no heartbeat for {lost_after_s:.0f} s since ({where})"
        return f"no heartbeat for {lost_after_s:.0f} s: {LOST} ({where})"
    return None


def give_up(client, run, why: str) -> bool:
    """Cancel the child `run` the sweep gave up on, saying `why`, and end it in `run` for the
    table: one no worker took is Cancelled at once (it has no process to stop), its row `not
    started`; one a worker took goes Cancelling (that worker, if it comes back, stops it), its
    row `crashed`. False when the run ended meanwhile."""
    scheduled = run.state.is_scheduled()
    ending = Cancelled(message=why, name="Not started") if scheduled else Cancelling(message=why)
    if not run.state.is_cancelling():  # one cancelled already: no worker answered
        result = client.set_flow_run_state(run.id, ending)
        if result.status.value != "ACCEPT":  # ended or taken meanwhile: the next look reads how
            return False
    run.state = ending if scheduled else Crashed(message=why)
    return True


def silent(beats: dict, name: str, count, lost_after_s: float) -> bool:
    """Whether `name`'s mark `count` (its state and latest heartbeat) has not moved for
    `lost_after_s`, on this process's clock; notes the mark in `beats` (name -> (mark, when
    this process saw it change))."""
    if name not in beats or beats[name][0] != count:
        beats[name] = (count, time.monotonic())
        return False
    return time.monotonic() - beats[name][1] > lost_after_s


def settle_lost(ends: dict, lost: dict, on_remote, notice_s: float = NOTICE_S) -> set[str]:
    """The lost experiments' ends (`lost`: name -> when it was cancelled), once the others have
    ended: one whose run has come back and completed takes that end; one still not ended after
    `notice_s` (no worker began to stop it: it is dead) is marked Crashed, so it does not stay
    Cancelling on the server for good. Returns the lost ones whose result is on the git remote
    anyway (`on_remote(names)`): they succeeded."""
    if not lost:
        return set()
    time.sleep(max(0.0, notice_s - (time.monotonic() - max(lost.values()))))
    with get_client(sync_client=True) as client:
        for name in sorted(lost):
            run = client.read_flow_run(ends[name].id)
            if run.state and run.state.is_completed():
                ends[name] = run
            elif run.state is None or not run.state.is_final():
                client.set_flow_run_state(run.id, ends[name].state, force=True)
    return set(on_remote(sorted(name for name in lost if not ends[name].state.is_completed())))


def on_remote(root: Path, remote: str, commit: str, names: list[str]) -> list[str]:
    """Those of `names` that the git `remote` has as experiments of `commit` (`dvc exp list`)."""
    if not names:
        return []
    listed = dvc_waiting(
        root,
        *("exp", "list", remote, "--rev", commit, "--name-only"),
        doing=f"listing the experiments on {remote}",
        timeout_s=300,
    )
    found = set(listed.split())
    return [name for name in names if name in found]


def cancel_unended(runs: dict, ends: dict) -> None:
    """Cancel the child runs not ended (the sweep stopped or failed): their workers stop them."""
    with get_client(sync_client=True) as client:
        for name, run in runs.items():
            if name not in ends:
                client.set_flow_run_state(run.id, Cancelling(message="its sweep ended first"))


def latest(runs: dict, ends: dict) -> dict:
    """The flow runs not ended, as the server has them now (their labels say where they ran);
    as they were sent when the server does not answer (a stop must still print its table)."""
    try:
        with get_client(sync_client=True) as client:
            return {
                name: client.read_flow_run(run.id) for name, run in runs.items() if name not in ends
            }
    except Exception as error:  # the API away: say so, and use what the sweep had
        get_run_logger().warning(f"where the stopped experiments ran is unknown: {error}")
        return {name: run for name, run in runs.items() if name not in ends}


def where_and_why(run, pushed: bool = False) -> dict:
    """A spread experiment's own columns, from its flow run: `ran on` (its worker's host and
    checkout), and for one that did not succeed its state and `why` (the line it failed with).
    `pushed`: one the sweep gave up on whose result reached the remote anyway succeeded."""
    found = {"ran on": (run.labels or {}).get(RAN_ON)}
    state = run.state
    if state.is_completed():
        return found | {"state": "success", "why": None}
    reason = re.sub(r"^Flow run encountered an exception: \w+: ", "", state.message or "")
    if pushed:
        return found | {"state": "success", "why": f"{reason}; it pushed its result anyway"}
    return found | {"state": state.name.lower(), "why": reason or None}


def stopped_rows(plan: Plan, ends: dict, running: dict | None = None) -> list[dict]:
    """The table of a stopped spread sweep, from the server alone: those ended as they ended
    (the ones that succeeded were pushed: `dvc exp pull` fetches them), the rest `stopped`,
    with where each ran as `running` (the runs not ended, read at the stop) has it, or why it
    ran nowhere."""
    keys = sorted({key for sets in plan.experiments.values() for key in overrides(sets)})
    rows = []
    for name, sets in plan.experiments.items():
        row = {"experiment": name, "state": "stopped"}
        row |= {key: overrides(sets).get(key) for key in keys}
        if name in ends:
            row |= where_and_why(ends[name])
        else:
            row |= stopped_where((running or {}).get(name))
        rows.append(row)
    return rows


def stopped_where(run) -> dict:
    """`ran on` and `why` of an experiment stopped before it ended: where it ran, or why it
    ran nowhere (no worker had taken it; the worker that took it had not started it)."""
    labels = (run.labels or {}) if run else {}
    if where := labels.get(RAN_ON):
        return {"ran on": where, "why": "stopped while it ran"}
    if worker := labels.get("prefect.worker.name"):
        return {"ran on": None, "why": f"stopped before it started on {worker}, which took it"}
    return {"ran on": None, "why": "stopped before any worker took it"}


# --- the checkouts and the remotes: each experiment runs in the checkout of the worker that
# took it, then travels through the git and DVC remotes (`dvc exp push`/`pull`).


def git(root: Path, *args: str) -> str:
    result = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if result.returncode != 0:
        raise StageFailed(f"`git {' '.join(args)}` in {root} failed: {result.stderr.strip()}")
    return result.stdout


def uncommitted(root: Path) -> list[str]:
    """Tracked files changed and not committed: a spread sweep's experiments run the commit."""
    lines = git(root, "status", "--porcelain", "--untracked-files=no").splitlines()
    return [line[3:] for line in lines]


def spread_problem(root: Path, remote: str, commit: str | None = None) -> str | None:
    """Why this checkout cannot take part in a spread sweep from `commit` (this one's HEAD when
    None): no git `remote`, no default DVC remote (the experiments' metrics and models travel
    through it), the commit not on `remote`, or, for a worker, another commit or uncommitted
    changes (`dvc exp run` would take them into the experiment)."""
    if subprocess.run(
        ["git", "remote", "get-url", remote], cwd=root, capture_output=True
    ).returncode:
        return f"{root} has no git remote {remote!r}: `git remote add {remote} URL` (the experiments travel through it)"
    try:
        default = dvc_waiting(
            root, "remote", "default", doing="finding the DVC remote", timeout_s=300
        )
    except StageFailed:  # none set: DVC 3 says so on stdout and exits 1
        default = ""
    if not default.strip():
        return f"{root} has no default DVC remote: `dvc remote add -d NAME URL` (the experiments' metrics and models travel through it)"
    head = git(root, "rev-parse", "HEAD").strip()
    if commit is None:
        git(root, "fetch", "-q", remote)  # only its branches: another remote's do not count
        if not git(root, "branch", "-r", "--contains", head, "--list", f"{remote}/*").strip():
            return f"commit {head[:8]} is not on {remote}: `git push {remote}` first (every worker needs it)"
        return None
    if head != commit:
        return (
            f"{root} is at commit {head[:8]}, the sweep's is {commit[:8]}: every worker's "
            "checkout needs the sweep's commit (`git pull` there)"
        )
    if changed := uncommitted(root):
        return (
            f"{root} has uncommitted changes ({', '.join(changed[:3])}): a sweep's experiment runs "
            "the commit alone (commit or `git stash` them there)"
        )
    return None


def dvc_waiting(root: Path, *args: str, doing: str, timeout_s: float) -> str:
    """`dvc ARGS`, waiting out (up to `timeout_s`) another dvc that holds the repository (a
    `dvc status` takes its lock too) instead of failing on it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return dvc(root, *args, doing=doing, timeout_s=timeout_s)
        except DvcBusy:
            if time.monotonic() > deadline:
                raise
            runner.wait_until_free(root, timeout_s=max(deadline - time.monotonic(), 1))


def push_experiment(root: Path, name: str, remote: str, timeout_s: float) -> None:
    """`dvc exp push`: the experiment's commit to the git remote, its outputs to the DVC remote;
    an experiment already there under the name, other than this one, fails it."""
    out = dvc_waiting(
        root, "exp", "push", remote, name, doing=f"pushing {name} to {remote}", timeout_s=timeout_s
    )
    if "diverged" in out:  # DVC says so and exits 0
        raise StageFailed(
            f"{remote} has another experiment named {name}: not pushed ({out.strip()})"
        )


def pull_experiments(root: Path, names: list[str], remote: str, timeout_s: float) -> None:
    if names:
        doing = f"pulling the sweep from {remote}"
        dvc_waiting(root, "exp", "pull", remote, *names, doing=doing, timeout_s=timeout_s)
