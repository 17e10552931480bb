"""The `experiments` flow: `dvc exp run -S ...` for each list of overrides, one table of them.

It makes the plan (a name per experiment) and hands it to one mode, each a module of its own:
- in turn (`workers: 0`, orchestration/in_turn.py), in this checkout;
- queued (`workers: N`, orchestration/queued.py): DVC's queue runs N at a time in this checkout;
- spread (`spread: true`, orchestration/spread.py): each experiment is a flow run of the
  `experiment` deployment, so every worker of the work pool takes some, each in its own checkout
  at the sweep's commit, and the sweep pulls them all.
Then it publishes the table (an `experiments` artifact) and ends Completed, Failed (naming the
experiments that did not succeed) or Cancelled (stopped).

Run:  .venv/bin/python -m orchestration.experiments [WORKDIR] -e "train.lr=1e-3" -e "train.lr=3e-3 train.epochs=30"
          [--workers N | --spread [DEPLOYMENT]]
(`python -m pipeline.experiments ...`, the older name, runs the same.)
"""

import argparse
import json
import re
import signal
import sys
from pathlib import Path

from prefect import flow, get_run_logger, runtime
from prefect.artifacts import create_table_artifact
from prefect.client.orchestration import get_client
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, Failed, State

from orchestration import in_turn, queued
from orchestration import spread as spread_mode
from orchestration.record import stopped_run
from orchestration.server import patient_server
from orchestration.spread import EXPERIMENT, LEAST_LOST_AFTER_S, LOST_AFTER_S
from orchestration.sweep import Plan, Poll
from visionflow.ops.project import preflight
from visionflow.ops.repo import StageFailed
from visionflow.ops.runner import STOPPED_EXIT, NotAProject, find_root

MOST_LOST_AFTER_S = 7 * 24 * 3600.0  # a week: Prefect's automation takes a timedelta of it


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
    whose heartbeats (Prefect's) stop for `lost_after_s` lost its worker or machine: it is
    cancelled (the server's automation marks it Crashed even with no sweep watching), its row
    `crashed`; so is one left Pending, and one no worker took while none of the pool's was
    online for `lost_after_s` (`not started`).
    This workspace is not held.
    Example overrides: [["train.lr=3e-4"], ["train.lr=1e-3", "train.epochs=30"]].
    """
    logger = get_run_logger()
    bad = input_problems(overrides or [], workers, timeout_s, lost_after_s)
    if bad:  # a deployment's run too: no experiment queued that could never start or succeed
        return Failed(message="; ".join(bad))
    root = find_root(Path(workdir))
    prefix = f"sweep-{str(runtime.flow_run.id or 'local')[:8]}"
    if (runtime.flow_run.run_count or 1) > 1:  # a retry: the first try's names are taken
        prefix += f"-try{runtime.flow_run.run_count}"
    names = {f"{prefix}-{number}": sets for number, sets in enumerate(overrides or [], start=1)}
    try:
        problems = preflight(root)  # DVC stashes params.yaml before any stage could refuse it
        if problems:
            raise StageFailed("; ".join(problems))
        plan = Plan(root, names, timeout_s, Poll(root, logger.warning))
        if spread:
            outcomes = spread_mode.run(plan, deployment, remote, lost_after_s)
        elif workers:
            outcomes = queued.run(plan, workers)
        else:
            outcomes = in_turn.run(plan)
    except (KeyboardInterrupt, TerminationSignal):  # Ctrl-C, SIGTERM (Prefect's own handler
        # while a flow runs), SIGHUP: stopped, not crashed
        return stopped_run("the sweep's experiments that had not ended were stopped")
    except StageFailed as error:  # its `error:` line, with no traceback to read past
        return Failed(message=str(error))
    rows = outcomes.rows
    create_table_artifact(rows, key="experiments", description=f"{prefix}: dvc exp show")
    if outcomes.stopped:
        return stopped_run(outcomes.stopped)
    failed = [row for row in rows if row["state"] != "success"]
    if failed:  # why each failed where the mode knows it (spread), else where to look
        why = "; ".join(f"{row['experiment']}: {row['why']}" for row in failed if row.get("why"))
        names = ", ".join(row["experiment"] for row in failed)
        return Failed(message=f"experiments {names} did not succeed ({why or 'see their logs'})")
    return rows


def input_problems(
    overrides: list[list[str]], workers: int, timeout_s: float, lost_after_s: float
) -> list[str]:
    """What is wrong with a sweep's inputs, one line each: `workers` below 0 queued the
    experiments and started no DVC worker (`dvc queue start --jobs -1` starts none), so the sweep
    waited out the whole timeout; an override without `key=` ran an experiment bound to fail (DVC's `-S` also takes
    `file:key=value`, `+key=value`, `~key`)."""
    problems = [
        f"override {item!r} is not key=value (train.lr=1e-3)"
        for sets in overrides
        for item in sets
        if not re.fullmatch(r"~[^=]+(=.*)?|\+{0,2}[^=\s]+=.*", item, re.DOTALL)  # DVC's -S forms
    ]
    problems += [  # an experiment bound to fail in DVC's parser, after the others had run
        f"override {item!r} has a quote that is not closed"
        for sets in overrides
        for item in sets
        if item.count("'") % 2 or item.count('"') % 2
    ]
    if workers < 0:
        problems.append(f"workers is {workers}: 0 runs them in turn, N > 0 N at a time")
    if not timeout_s > 0:
        problems.append(f"timeout is {timeout_s} s: it must be above 0")
    if not lost_after_s >= LEAST_LOST_AFTER_S:  # Prefect's heartbeats are 30 s apart at least
        problems.append(
            f"--lost-after is {lost_after_s} s: it must be {LEAST_LOST_AFTER_S} or more (two of "
            "Prefect's flow-run heartbeats, which come 30 s apart at the least)"
        )
    elif not lost_after_s <= MOST_LOST_AFTER_S:  # inf and 1e300 ended in a traceback
        problems.append(
            f"--lost-after is {lost_after_s} s: it must be at most {MOST_LOST_AFTER_S:.0f} (a week)"
        )
    return problems


# Where one of DVC's `-S` forms begins: key=value, +key=value (a new key), ++key=value (added or
# overridden), ~key (deleted), each of them maybe after `file.yaml:` (another params file)
OVERRIDE_START = re.compile(r"([\w./-]+:)?(~\w|\+{0,2}[\w.@-]+=)")


def split_overrides(text: str) -> list[str]:
    """One `-e` string as the overrides `dvc exp run -S` reads, each as it was written: a new one
    begins at each word that begins as one of DVC's forms, so a value may hold spaces
    ("prepare.formats=[PNG, JPEG]"), and quotes keep a value whole ("train.note='a b=c'"), kept
    for Hydra (DVC's parser) to read. Text with no word stays as it is, for `input_problems`."""
    spans: list[list[int]] = []  # [start, end] of each override in `text`
    for word in re.finditer(r"""(?:'[^']*'|"[^"]*"|[^\s'"])+""", text):
        if spans and not OVERRIDE_START.match(word.group()):
            spans[-1][1] = word.end()  # more of the value before it
        else:
            spans.append([word.start(), word.end()])
    return [text[start:end] for start, end in spans] or [text]


def raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a sweep of experiments, one table of them.")
    parser.add_argument("workdir", nargs="?", default=".", help="the DVC project (default: here)")
    parser.add_argument(
        "-e",
        "--experiment",
        action="append",
        required=True,
        help="one experiment's overrides, any of `dvc exp run -S`'s forms: "
        '-e "train.lr=1e-3 ++train.epochs=3 ~train.note"',
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
        "as lost and the experiment is cancelled, and without any worker of the pool online "
        f"before those no worker took are ({LOST_AFTER_S:.0f}; {LEAST_LOST_AFTER_S} or more)",
    )
    args = parser.parse_args()
    overrides = [split_overrides(text) for text in args.experiment]
    bad = input_problems(overrides, args.workers, args.timeout, args.lost_after)
    if bad:
        parser.error("; ".join(bad))
    try:
        root = find_root(Path(args.workdir))
    except NotAProject as error:
        sys.exit(f"error: {error}")
    for stop in (signal.SIGTERM, signal.SIGHUP):  # as Ctrl-C: what has not ended is stopped
        signal.signal(stop, raise_keyboard_interrupt)
    with patient_server():  # time for Prefect's temporary server (no PREFECT_API_URL)
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
        rows = table_of(state)
    for row in rows:  # the rows that succeeded too, when some did not
        print(json.dumps(row))
    if state.is_cancelled():
        reason = state.message or "the sweep's experiments that had not ended were stopped"
        print(f"stopped: {reason}", file=sys.stderr)
        sys.exit(STOPPED_EXIT)
    try:
        state.result()
    except Exception as error:
        sys.exit(f"error: {error}")


def table_of(state: State) -> list[dict]:
    """The `experiments` table the sweep's run published (none when it failed before, or was
    stopped before its run began)."""
    if state.state_details.flow_run_id is None:
        return []
    found = published("experiments", state.state_details.flow_run_id)
    return json.loads(found[-1].data) if found else []


def published(key: str, flow_run_id) -> list:
    """The artifacts `key` that one flow run published, oldest first (a server holds every
    run's: the key alone finds other sweeps' tables)."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
            )
        )
    return sorted(found, key=lambda artifact: artifact.created)


if __name__ == "__main__":
    main()
