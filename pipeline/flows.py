"""Prefect flows around the DVC pipeline: DVC stays the only DAG, Prefect runs and shows it.

`reproduce` asks `dvc status` first and ends at once when nothing changed; otherwise it runs one
task per stage of dvc.yaml, in order, each `dvc repro --single-item <stage>` as a subprocess in its
own process group: its output streams to the Prefect log, a timeout applies to the subprocess
itself, and when the task ends early (timeout, cancellation, an error) the whole process tree is
killed, since a kill of `dvc` alone would leave the stage's command running. Only DVC's lock
contention is retried; a stage that fails on its own fails the flow with its output.

Run:    .venv/bin/python -m pipeline.flows [WORKDIR] [--if-busy wait|skip]
Serve:  .venv/bin/python -m pipeline.flows [WORKDIR] --serve --interval 3600   (or --cron '0 * * * *')
Watch:  .venv/bin/python -m pipeline.flows [WORKDIR] --watch [--deployment reproduce/scheduled]
"""

import argparse
import hashlib
import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import yaml
from prefect import flow, get_run_logger, serve, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency
from prefect.deployments import run_deployment

from visionflow.files import file_stats
from visionflow.runner import (
    STAGE_FAILED,
    dvc_command,
    environment,
    find_root,
    restore,
    run_group,
    workspace_lock,
)

LOCK_CONTENTION = "Unable to acquire lock"  # DVC's message when another dvc holds the repo
LOCK_RETRIES, LOCK_WAIT_S = 3, 5.0


class StageFailed(RuntimeError):
    """A stage exited non-zero; the message carries the end of its output."""


def dvc(workdir: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """A short dvc command (status, metrics) with the project's Python first on PATH."""
    return subprocess.run([*dvc_command(), *args], cwd=workdir, env=environment(), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def stages_in_order(workdir: Path) -> list[str]:
    """The stages of dvc.yaml as written (they are listed in dependency order)."""
    return list(yaml.safe_load((workdir / "dvc.yaml").read_text())["stages"])


def changed(workdir: Path) -> dict:
    """`dvc status --json`: empty when the pipeline is up to date."""
    result = dvc(workdir, "status", "--json")
    if result.returncode != 0:
        raise StageFailed(f"dvc status failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout or "{}")


@task(task_run_name="{stage}")
def run_stage(workdir: Path, stage: str, timeout_s: float) -> bool:
    """`dvc repro --single-item <stage>`; True when DVC ran it, False when it was up to date."""
    logger = get_run_logger()
    cmd = [*dvc_command(), "repro", "--single-item", stage]
    ran = []

    def log(line: str) -> None:
        logger.info(line)
        ran.append(line.startswith("Running stage"))

    for attempt in range(1, LOCK_RETRIES + 2):
        code, tail = run_group(cmd, workdir, timeout_s, log)
        if code == 0:
            return any(ran)
        if LOCK_CONTENTION not in tail or attempt > LOCK_RETRIES:
            if STAGE_FAILED in tail:  # the stage itself failed: its results, from DVC's cache
                restore(workdir, logger.warning)
            raise StageFailed(f"stage {stage} failed (exit {code}):\n{tail}")
        logger.warning(f"{stage}: DVC lock held by another run; retry {attempt} in {LOCK_WAIT_S} s")
        time.sleep(LOCK_WAIT_S)


def publish(workdir: Path) -> None:
    """Artifacts: the metrics table, the diff against the last commit, and export parity."""
    shown = json.loads(dvc(workdir, "metrics", "show", "--json").stdout or "{}")
    files = shown.get("", {}).get("data", {})
    rows = [  # one row per number: three columns, however many metrics (dvc.yaml keeps them few)
        {"file": path, "metric": name, "value": value}
        for path, content in files.items()
        for name, value in flatten(content.get("data", {})).items()
    ]
    create_table_artifact(rows, key="metrics", description="dvc metrics show")
    diff = dvc(workdir, "metrics", "diff", "--md").stdout or "no change against the last commit"
    create_markdown_artifact(f"## Metrics diff (workspace vs HEAD)\n\n{diff}", key="metrics-diff")
    parity_file = workdir / "results/export/parity.json"
    if parity_file.exists():
        parity = json.loads(parity_file.read_text())
        rows = [{"format": fmt, "batch": name, **result} for fmt in ("onnx", "pt2", "torchscript")
                for name, result in parity.get(fmt, {}).items()]  # fmt: skip
        create_table_artifact(
            rows, key="export-parity", description=f"exporter {parity['exporter']}"
        )


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}, as `dvc metrics show` names nested metrics."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def limit_name(workdir: Path) -> str:
    """The Prefect global concurrency limit of one workspace."""
    return "visionflow-" + hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:12]


def ensure_limit(workdir: Path) -> str:
    """Create the workspace's concurrency limit (1 slot) if missing; serving does this once."""
    name = limit_name(workdir)
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, 1)
    return name


@contextmanager
def one_run_at_a_time(workdir: Path, wait: bool, say=print) -> Iterator[bool]:
    """Hold the workspace: an OS file lock (released by the kernel if the holder dies) and the
    Prefect concurrency limit, strict, so a missing limit is an error rather than a silent pass.
    Yields False at once when busy and `wait` is off."""
    with workspace_lock(workdir, wait, say) as held:
        if not held:
            yield False
            return
        with concurrency(limit_name(workdir), occupy=1, strict=True):
            yield True


@flow(name="reproduce")
def reproduce(
    workdir: str = ".", if_busy: Literal["wait", "skip"] = "wait", stage_timeout_s: float = 3600
) -> list[str]:
    """Bring the pipeline up to date; returns the stages that ran (none when nothing changed).

    Never two runs at once in one workspace: a second run waits for the first, or with
    `if_busy="skip"` ends at once, and its log says which.
    """
    logger = get_run_logger()
    root = find_root(Path(workdir))
    with one_run_at_a_time(root, wait=if_busy == "wait", say=logger.warning) as held:
        if not held:
            logger.warning("another run holds this workspace: skipping (if_busy=skip)")
            return []
        return update(root, stage_timeout_s)


def update(root: Path, stage_timeout_s: float) -> list[str]:
    logger = get_run_logger()
    what = changed(root)
    if not what:
        logger.info("pipeline is up to date: nothing to run")
        return []
    logger.info(f"changed: {', '.join(what)}")
    ran = [stage for stage in stages_in_order(root) if run_stage(root, stage, stage_timeout_s)]
    logger.info(f"ran: {', '.join(ran)}")
    publish(root)
    return ran


@flow(name="experiments")
def experiments(workdir: str = ".", overrides: list[list[str]] | None = None, workers: int = 0,
                stage_timeout_s: float = 3600) -> str:  # fmt: skip
    """`dvc exp run -S ...` for each list of overrides; publishes `dvc exp show --only-changed`.

    `workers: 0` runs them in turn in the workspace; `workers: N` queues them all and lets DVC's
    queue run N at a time, each in its own temporary copy of the repository.
    Example overrides: [["train.lr=3e-4"], ["train.lr=1e-3", "train.epochs=30"]].
    """
    logger = get_run_logger()
    root = find_root(Path(workdir))
    queue = ["--queue"] if workers else []
    with one_run_at_a_time(root, wait=True, say=logger.warning):
        for sets in overrides or []:
            cmd = [*dvc_command(), "exp", "run", *queue, *(arg for s in sets for arg in ("-S", s))]
            code, tail = run_group(cmd, root, stage_timeout_s, logger.info)
            if code != 0:
                raise StageFailed(f"experiment {sets} failed (exit {code}):\n{tail}")
        if workers:
            run_queue(root, workers, stage_timeout_s * max(len(overrides or []), 1), logger)
        # what differs: metrics and params; not the changed deps' hashes (paths), nor Created
        drop = r"Created|params\.yaml|.*/.*"
        table = dvc(
            root, "exp", "show", "--md", "--no-pager", "--only-changed", "--drop", drop
        ).stdout
    create_markdown_artifact(f"## Experiments\n\n{table}", key="experiments")
    return table


def run_queue(root: Path, workers: int, timeout_s: float, logger) -> None:
    """Start DVC's queue with `workers` and wait until nothing is queued or running."""
    dvc(root, "queue", "start", "--jobs", str(workers))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = dvc(root, "queue", "status").stdout
        if not any(word in status for word in ("Queued", "Running")):
            if "Failed" in status:
                raise StageFailed(f"queued experiments failed:\n{status}")
            return
        logger.info(status.strip().splitlines()[-1] if status.strip() else "queue: waiting")
        time.sleep(5)
    dvc(root, "queue", "kill", "--all")
    raise TimeoutError(f"queued experiments ran past {timeout_s:.0f} s; killed")


def serve_deployments(workdir: Path, interval_s: float | None, cron: str | None) -> None:
    """Serve `reproduce` on a schedule (and on demand), plus `experiments` on demand.

    Schedules stay active when this process stops (pause_on_shutdown=False), so a restart picks
    them up again. Trigger a run: `prefect deployment run reproduce/scheduled`.
    """
    ensure_limit(workdir)
    scheduled = reproduce.to_deployment(
        "scheduled", interval=interval_s, cron=cron,
        parameters={"workdir": str(workdir.resolve()), "if_busy": "skip"},
    )  # fmt: skip
    sweep = experiments.to_deployment("on-demand", parameters={"workdir": str(workdir.resolve())})
    serve(scheduled, sweep, pause_on_shutdown=False)


def watched_files(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of what a run depends on: params, dvc.yaml, the code, the data source."""
    source = (
        yaml.safe_load((root / "params.yaml").read_text())
        .get("prepare", {})
        .get("path", "data/raw")
    )
    return file_stats(root / top for top in ("params.yaml", "dvc.yaml", "pipeline", "src", source))


def watch(
    workdir: Path, settle_s: float = 2.0, poll_s: float = 0.5, deployment: str | None = None
) -> None:
    """Start a run when what the pipeline depends on changes, once the changes settle.

    A burst of edits (an editor's save, a copy of many images) becomes one run: the run starts
    after `settle_s` seconds without further change. With `deployment` the run is a flow run of
    that served deployment (`prefect deployment run` semantics); otherwise `reproduce` runs here.
    The flow itself asks `dvc status`, so a change DVC does not track runs no stage.
    """
    root = workdir.resolve()
    last, changed_at = watched_files(root), None
    print(f"watching {root} (settle {settle_s} s)", flush=True)
    while True:
        time.sleep(poll_s)
        current = watched_files(root)
        if current != last:
            last, changed_at = current, time.monotonic()
            continue
        if changed_at is not None and time.monotonic() - changed_at >= settle_s:
            changed_at = None
            print("change settled: starting a run", flush=True)
            if deployment:
                run_deployment(deployment, parameters={"workdir": str(root)}, timeout=0)
            else:
                reproduce(str(root))


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the reproduce flow once, or serve it.")
    parser.add_argument("workdir", nargs="?", default=".", help="the DVC project (default: here)")
    parser.add_argument("--if-busy", choices=["wait", "skip"], default="wait")
    parser.add_argument("--serve", action="store_true", help="serve the deployments instead")
    parser.add_argument("--interval", type=float, help="with --serve: seconds between runs")
    parser.add_argument("--cron", help="with --serve: a cron schedule, e.g. '0 * * * *'")
    parser.add_argument("--watch", action="store_true", help="run whenever the inputs change")
    parser.add_argument("--settle", type=float, default=2.0, help="with --watch: quiet seconds")
    parser.add_argument("--deployment", help="with --watch: start this deployment instead")
    args = parser.parse_args()
    if args.watch:
        ensure_limit(Path(args.workdir))
        watch(Path(args.workdir), args.settle, deployment=args.deployment)
        return
    if args.serve:
        serve_deployments(Path(args.workdir), args.interval, args.cron)
        return
    ensure_limit(Path(args.workdir))
    print(json.dumps({"ran": reproduce(args.workdir, args.if_busy)}))


if __name__ == "__main__":
    main()
