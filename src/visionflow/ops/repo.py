"""Asking DVC about the project, for the flows and `visionflow repro`: short `dvc` commands with
a timeout that names what they were doing, the stages in the order of DVC's own graph, a stage's
dvc.lock entry, and whether `dvc repro` would skip a stage. No Prefect here (docs/development.md, the layers):
the flows add the tasks, states and artifacts.
"""

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from visionflow.errors import DvcBusy, DvcHung, StageFailed
from visionflow.ops.project import special_files
from visionflow.ops.runner import dvc_busy, dvc_command, environment
from visionflow.params import read_yaml

DVC_TIMEOUT_S = (
    120.0  # a helper `dvc` call (status, metrics, exp show, queue) that takes longer hangs
)


# `dvc ARGS` with the fault point argv[1] first, in the dvc process, so that its timeout applies
FAULTED_DVC = (
    "import sys; from visionflow import faults; faults.fault(sys.argv[1]); "
    "from dvc.cli import main; sys.exit(main(sys.argv[2:]))"
)


def dvc(
    workdir: Path, *args: str, doing: str, timeout_s: float | None = None, point: str = ""
) -> str:
    """A short dvc command's output; a failure or a hang (past `timeout_s`, DVC_TIMEOUT_S by
    default) raises, naming what it was `doing`; DvcBusy when another dvc holds the repository's
    lock (before, or when the command failed). `point` names a fault point (faults.py) that the
    dvc process meets first."""
    command = f"`dvc {' '.join(args)}` ({doing})"
    timeout_s = timeout_s or DVC_TIMEOUT_S
    if dvc_busy(workdir):
        raise DvcBusy.at(workdir, command)
    argv = [*dvc_command(), *args]
    if point and os.environ.get("VISIONFLOW_FAULT"):
        argv = [sys.executable, "-c", FAULTED_DVC, point, *args]
    try:
        result = subprocess.run(
            argv,
            cwd=workdir,
            env=environment(),
            capture_output=True,
            encoding="utf-8",
            errors="backslashreplace",  # a path or message in any bytes: `\xff`, not a crash
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise DvcHung(f"{command} did not finish in {timeout_s:.0f} s") from None
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
    process (`Stage.changed()`, the test `dvc repro` makes): a `dvc` process to say so costs a
    Python start and DVC's imports. False when unsure (DVC's lock taken, an output in use, no such single stage, a
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
