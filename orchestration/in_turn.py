"""A sweep's experiments one after another (`workers: 0`, the default), in this checkout.

The workspace is held for the whole sweep (one run at a time per workspace, as `reproduce`
holds it). Each experiment is `dvc exp run --temp` in a temporary copy, a task run named after
it: Completed with its main metrics, or Failed; a failed one does not stop the next. A stop
(Ctrl-C, SIGTERM) or a cancellation during one ends the sweep there: that one reads `stopped`
in the table, those after it `not run`.
"""

import signal

from prefect import get_run_logger

from orchestration.record import record_holder
from orchestration.sweep import Outcomes, Plan, run_experiment, sweep_table
from visionflow.ops import runner
from visionflow.ops.runner import workspace_lock


def run(plan: Plan) -> Outcomes:
    """Each experiment of `plan` in turn, under the workspace lock; the table, and why the sweep
    stopped early (None when every experiment ran)."""
    logger = get_run_logger()
    with workspace_lock(plan.root, wait=True, log=logger.warning), record_holder(plan.root):
        stopped, at = run_each(plan)
        rows = sweep_table(plan)
    if stopped:
        rows = marked_stopped(rows, plan, at)
    return Outcomes(rows, stopped)


def run_each(plan: Plan) -> tuple[str | None, str | None]:
    """Each experiment in turn; a failed one is its task's state, and the next one runs. A stop
    (Ctrl-C, SIGTERM) or a cancellation during one ends the sweep there: returns why, and
    which one it stopped (None, None when all ran)."""
    stops = len(runner.FORWARDED)
    for name, sets in plan.experiments.items():
        state = run_experiment(plan.root, name, sets, plan.timeout_s, return_state=True)
        if len(runner.FORWARDED) > stops:
            signal_name = signal.Signals(runner.FORWARDED[-1]).name
            return f"sweep stopped by {signal_name} during {name}; the rest not run", name
        if state.is_cancelled():
            return f"sweep cancelled during {name}; the rest not run", name
    return None, None


def marked_stopped(rows: list[dict], plan: Plan, at: str) -> list[dict]:
    """The table of a sweep stopped during `at`: that one stopped, those after it not run (DVC
    has no record of them, so they read as failed)."""
    names = list(plan.experiments)
    rest = names[names.index(at) + 1 :]
    for row in rows:
        if row["experiment"] == at:
            row["state"] = "stopped"
        elif row["experiment"] in rest:
            row["state"] = "not run"
    return rows
