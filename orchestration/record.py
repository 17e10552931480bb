"""What the flows that hold a workspace share: the record of the flow run holding it, and how a
stopped run ends.

The workspace lock (visionflow.ops.runner.workspace_lock) is the kernel's; the record beside it
names the flow run that holds it, so the next run can mark a holder whose process died Crashed
instead of leaving it Running for good."""

import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import UUID

from prefect import get_run_logger, runtime
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, State


def record_file(root: Path) -> Path:
    """The record of the flow run holding the workspace: {"flow_run_id", "pid"}."""
    return root / ".dvc" / "tmp" / "visionflow-flow-run.json"


@contextmanager
def record_holder(root: Path) -> Iterator[None]:
    """Record this flow run as the one holding the workspace (the lock is held already). A
    record another run left means its process died holding it (kill -9, a lost machine): that
    run is marked Crashed, so it does not show as Running for good."""
    record = record_file(root)
    this_run = str(runtime.flow_run.id or "")
    try:
        previous_holder = json.loads(record.read_text()).get("flow_run_id")
    except (OSError, ValueError, AttributeError):
        previous_holder = None
    if previous_holder and previous_holder != this_run:
        mark_crashed(root, previous_holder, this_run)
    record.write_text(json.dumps({"flow_run_id": this_run, "pid": os.getpid()}))
    try:
        yield
    finally:
        record.unlink(missing_ok=True)


def mark_crashed(root: Path, dead_run: str, this_run: str) -> None:
    """Mark the flow run `dead_run`, whose process died holding `root`, Crashed (unless it ended)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    logger = get_run_logger()
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(UUID(dead_run))
            if run.state is None or run.state.is_final():
                return
            message = f"its process died while it held {root} (found by flow run {this_run})"
            client.set_flow_run_state(run.id, Crashed(message=message), force=True)
        logger.warning(f"flow run {run.name} ({dead_run}) {message}: marked Crashed")
    except Exception as error:  # another server's run, say: report it, never fail this run
        logger.warning(f"flow run {dead_run} held {root} when its process died ({error})")


def stopped_run(message: str) -> State:
    """The end of a stopped run: Cancelled. A deployment's run (served, on a worker) ends the way
    Prefect ends a cancelled one, quietly: its engine would log a returned Cancelled state as an
    unexpected exception, with a traceback."""
    if runtime.deployment.id:
        raise TerminationSignal(signal.SIGTERM)
    return Cancelled(message=message)


def deployed() -> bool:
    """Whether this flow run is a deployment's (served, or on a worker). Prefect's runner cancels
    such a run with a SIGTERM that its own handler takes (it tells the run's process first, only
    while that handler is in place), so a stage's runner leaves SIGTERM to it."""
    return bool(runtime.deployment.id)
