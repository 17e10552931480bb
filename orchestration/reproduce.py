"""Prefect flows around the DVC pipeline: DVC stays the only DAG, Prefect runs and shows it.

`reproduce` asks `dvc status --json` first and ends at once when nothing changed; otherwise it
runs one task per stage, in the order of DVC's own graph: a stage DVC finds unchanged (asked in
this process) is skipped; the others run `dvc repro --single-item <stage>`, each in its own
process group: its output streams to the Prefect log, its timeout fires whether or not it prints.
Every stop (the timeout, a cancellation's SIGTERM, Ctrl-C, this process's death) is the runner's
one path: SIGINT, on which training checkpoints its epoch, then SIGKILL after the grace period,
so nothing of the stage's process tree is left. A task is retried only when another `dvc` holds
the repository's lock; a stage that fails on its own fails the flow with its output, and its
previous results come back from DVC's cache; the next run marks a flow run whose process died
Crashed (orchestration/record.py). Sweeps (`dvc exp run` for lists of overrides) are
orchestration/experiments.py's flow.

One run at a time per workspace, on every path (these functions called from Python, the CLI,
`--serve`, a work-pool worker): an OS file lock in the workspace's `.dvc/tmp`, which the kernel
releases when its holder dies and which every process sharing the folder sees. Nothing has to
be created on the Prefect server first, and an API outage during a run does not end it.

Run:    .venv/bin/python -m orchestration.reproduce [WORKDIR] [--if-busy wait|skip]  (exit 75: skipped)
Serve:  .venv/bin/python -m orchestration.reproduce [WORKDIR] --serve --interval 3600  (or --cron '0 * * * *')
Watch:  .venv/bin/python -m orchestration.reproduce [WORKDIR] --watch [--deployment reproduce/scheduled]
(`python -m pipeline.flows ...`, the older name, runs the same.)
"""

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger, serve, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.deployments import run_deployment
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, Completed, State

from orchestration.record import deployed, record_holder, stopped_run
from orchestration.server import patient_server
from orchestration.sweep import five_digits
from visionflow.data.files import flatten
from visionflow.ops import runner
from visionflow.ops.project import preflight
from visionflow.ops.repo import (
    DvcBusy,
    StageFailed,
    dvc,
    lock_refused,
    locked,
    readable,
    stages_in_order,
    unchanged,
)
from visionflow.ops.runner import (
    BUSY_EXIT,
    STOPPED_EXIT,
    NotAProject,
    Timeout,
    begin_restorable_run,
    drop_restore_note,
    dvc_busy,
    dvc_command,
    find_root,
    restore,
    run_group,
    stop_message,
    wait_until_free,
    workspace_lock,
)
from visionflow.ops.watching import settled_changes

LOCK_RETRIES, LOCK_WAIT_S = 3, 5.0


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
def run_stage(workdir: Path, stage: str, timeout_s: float) -> bool | State:
    """`dvc repro --single-item <stage>`; True when DVC brought it up to date, False when it was;
    a Cancelled state when this process was asked to stop (its previous results restored)."""
    logger = get_run_logger()
    if dvc_busy(workdir):
        raise DvcBusy.at(workdir, stage)
    if unchanged(workdir, stage):
        logger.info(f"Stage '{stage}' didn't change, skipping")
        return False
    before, stops, killed = locked(workdir, stage), len(runner.FORWARDED), len(runner.KILLED)
    cmd = [*dvc_command(), "repro", "--single-item", stage]
    try:  # a deployment's run: SIGTERM is Prefect's cancellation (record.deployed)
        code, tail = run_group(cmd, workdir, timeout_s, readable(logger.info), not deployed())
    except Timeout as error:
        restore(workdir, logger.warning, stage)
        raise StageFailed(f"stage {stage}: {error} (stage_timeout_s={timeout_s:g})") from None
    except TerminationSignal:  # that cancellation: the group was stopped as every stop is
        runner.FORWARDED.append(signal.SIGTERM)
        code = None
    if len(runner.FORWARDED) > stops and code != 0:  # asked to stop (a cancellation, say): the
        restore(workdir, logger.warning, stage)  # stage stopped at its safe point, or was killed
        message = stop_message(f"stage {stage}", killed)
        logger.warning(message)  # one line; the task (and the flow) end Cancelled
        return Cancelled(message=message)
    if code == 0:
        return locked(workdir, stage) != before
    if dvc_busy(workdir) or lock_refused(tail, stage):  # DVC could not take its lock back to
        wait_until_free(workdir)  # record the results: put them back as dvc.lock has them, retry
        restore(workdir, logger.warning, stage)
        raise DvcBusy.at(workdir, stage)
    restore(workdir, logger.warning, stage)  # its previous results, from DVC's cache
    raise StageFailed(f"stage {stage} failed (exit {code}):\n{tail}")


def publish(workdir: Path) -> None:
    """Artifacts: the metrics table, the diff against the last commit (the params that changed
    beside the metrics), and export parity."""
    shown = json.loads(dvc(workdir, "metrics", "show", "--json", doing="publishing") or "{}")
    create_table_artifact(metric_rows(shown), key="metrics", description="dvc metrics show")
    metrics = json.loads(dvc(workdir, "metrics", "diff", "--json", doing="publishing") or "{}")
    params = json.loads(dvc(workdir, "params", "diff", "--json", doing="publishing") or "{}")
    create_markdown_artifact(diff_markdown(metrics, params), key="metrics-diff")
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


def metric_rows(shown: dict) -> list[dict]:
    """`dvc metrics show --json` as one row per number (file, metric, value): three columns
    however many metrics, each to 5 significant digits as the sweep's table has them."""
    files = shown.get("", {}).get("data", {})
    return [
        {"file": path, "metric": name, "value": five_digits(value)}
        for path, content in files.items()
        for name, value in flatten(content.get("data", {})).items()
    ]


def diff_markdown(metrics: dict, params: dict) -> str:
    """The metrics-diff artifact from `dvc metrics diff --json` and `dvc params diff --json`:
    the params that changed (old -> new), then the metrics that changed, rounded as the sweep's
    table rounds them."""
    changed = []
    for path, values in params.items():
        for key, v in values.items():
            name = key if path == "params.yaml" else f"{path}:{key}"
            changed.append(f"`{name}` {said(v.get('old'))} -> {said(v.get('new'))}")
    rows = [
        [path, name, said(v.get("old")), said(v.get("new")), said(v.get("diff"))]
        for path, values in metrics.items()
        for name, v in values.items()
    ]
    table = [["file", "metric", "HEAD", "workspace", "change"], ["---"] * 5, *rows]
    return "\n\n".join(
        [
            "## Metrics diff (workspace vs HEAD)",
            f"Params changed against the last commit: {', '.join(changed) or 'none'}",
            "\n".join(f"| {' | '.join(row)} |" for row in table)
            if rows
            else "no metric changed against the last commit",
        ]
    )


def said(value) -> str:
    """A value in the diff: numbers to 5 significant digits; "absent" where one side has none."""
    return "absent" if value is None else str(five_digits(value))


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
    with workspace_lock(root, wait=if_busy == "wait", log=logger.warning) as held:
        if not held:
            logger.warning("another run holds this workspace: skipped (if_busy=skip)")
            return Completed(name="Skipped", message="another run holds the workspace", data=[])
        return bring_up_to_date(root, stage_timeout_s)


def bring_up_to_date(root: Path, stage_timeout_s: float) -> list[str]:
    """The body of `reproduce`, under the workspace lock."""
    logger = get_run_logger()
    with record_holder(root):
        begin_restorable_run(root, logger.warning)  # first what a killed run left undone
        changes = changed(root)
        if not changes:
            drop_restore_note(root)
            logger.info("pipeline is up to date: nothing to run")
            return []
        logger.info(f"changed: {', '.join(changes)}")
        ran, stops = [], len(runner.FORWARDED)
        for stage in stages_in_order(root):
            state = run_stage(root, stage, stage_timeout_s, return_state=True)
            if state.is_cancelled():  # stopped: said in one line, no traceback
                return stopped_run(state.message)
            if state.result():  # a failed stage raises its error here
                ran.append(stage)
            if len(runner.FORWARDED) > stops:  # asked to stop as the stage ended: no more
                drop_restore_note(root)
                message = stop_message(f"the run, after stage {stage},", len(runner.KILLED))
                logger.warning(message)
                return stopped_run(message)
        drop_restore_note(root)
        logger.info(f"ran: {', '.join(ran)}")
        publish(root)
        return ran


def serve_deployments(workdir: Path, interval_s: float | None, cron: str | None) -> None:
    """Serve `reproduce` on a schedule (and on demand), plus `experiments` on demand.

    Schedules stay active when this process stops (pause_on_shutdown=False), so a restart picks
    them up again. Trigger a run: `prefect deployment run reproduce/scheduled`.
    """
    parameters = {"workdir": str(workdir.resolve()), "if_busy": "skip"}
    scheduled = reproduce.to_deployment(
        "scheduled", interval=interval_s, cron=cron, parameters=parameters
    )
    from orchestration.experiments import experiments  # on use: a run never loads the sweep

    sweep = experiments.to_deployment("on-demand", parameters={"workdir": str(workdir.resolve())})
    serve(scheduled, sweep, pause_on_shutdown=False)


def watch(root: Path, settle_s: float = 2.0, deployment: str | None = None) -> None:
    """Start a run when anything the pipeline depends on (every dep in dvc.yaml, params.yaml,
    dvc.yaml) changes, once the changes settle (`watching.settled_changes`: filesystem events, no
    polling of files). With `deployment` the run is a flow run of that served deployment
    (`prefect deployment run` semantics); otherwise `reproduce` runs here. The flow itself asks
    `dvc status`, so a change DVC does not track runs no stage.
    """
    root = root.resolve()
    for paths in settled_changes(root, settle_s):
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        print(f"change settled ({shown}): starting a run", flush=True)
        if deployment:
            run_deployment(deployment, parameters={"workdir": str(root)}, timeout=0)
        else:  # a failed run is in its log; the watcher goes on
            state = reproduce(str(root), return_state=True)
            if runner.FORWARDED:  # stopped during the run: the run has ended, so do we
                print("stopped: the run in progress was ended first", flush=True)
                raise SystemExit(STOPPED_EXIT)
            print(f"run ended: {state.name}", flush=True)


def schedule_problems(interval: float | None, cron: str | None, settle: float) -> list[str]:
    """What is wrong with --interval, --cron or --settle, one line each: Prefect refused the
    first two with a validation traceback once serving began; a negative settle was taken."""
    from prefect.client.schemas.schedules import CronSchedule

    problems = []
    if interval is not None and not interval > 0:
        problems.append(f"--interval {interval:g}: seconds between runs, above 0")
    if cron is not None:
        try:
            CronSchedule(cron=cron)
        except ValueError:
            problems.append(f"--cron {cron!r} is not a cron schedule (e.g. '0 * * * *')")
    if not settle >= 0:
        problems.append(f"--settle {settle:g}: quiet seconds, 0 or more")
    return problems


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
    args = parser.parse_args()
    bad = schedule_problems(args.interval, args.cron, args.settle)
    if bad:  # one line, not Prefect's schedule models' validation traceback
        parser.error("; ".join(bad))
    if (args.interval is not None or args.cron is not None) and not args.serve:
        parser.error("--interval and --cron schedule the served deployments: add --serve")
    if args.deployment is not None and not args.watch:
        parser.error("--deployment names what --watch starts: add --watch")
    try:
        root = find_root(Path(args.workdir))
    except NotAProject as error:
        sys.exit(f"error: {error}")
    with patient_server():  # time for Prefect's temporary server (no PREFECT_API_URL)
        if args.watch:
            watch(root, args.settle, deployment=args.deployment)
        elif args.serve:
            serve_deployments(root, args.interval, args.cron)
        else:
            state = reproduce(str(root), args.if_busy, return_state=True)
            if state.is_cancelled():  # Ctrl-C or SIGTERM: the line is in the log already
                sys.exit(STOPPED_EXIT)
            if state.is_failed() or state.is_crashed():
                sys.exit(f"error: {state.message}")
            print(json.dumps({"ran": state.result(), "skipped": state.name == "Skipped"}))
            sys.exit(BUSY_EXIT if state.name == "Skipped" else 0)


if __name__ == "__main__":
    main()
