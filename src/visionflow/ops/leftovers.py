"""What a `dvc exp run --temp` killed before it recorded its end leaves, cleared as DVC clears it.

DVC records a temporary experiment's end in its executor file (`.dvc/tmp/exps/standalone/run/
<rev>/<rev>.run`) and then removes the experiment's temporary copy; a `dvc` killed first (past
the stop's grace period, by the runner or the reaper, or by anyone) leaves the file saying
running and the copy in place, and since DVC keeps no process id for such a run, `dvc exp show`
lists it as Running, with its baseline's metrics, for good. No `dvc` command clears it (`dvc exp
remove`, `dvc queue kill` and `dvc queue remove` know the queue's experiments alone). The
runner kills the stage before `dvc` so that DVC records the end itself (reaper.kill_stage_first);
this is for a `dvc` that did not manage it.

    python -m visionflow.ops.leftovers ROOT NAME     (the reaper runs it once a group is gone)
"""

import os
import sys
from pathlib import Path


def clear_killed_experiment(root: Path, name: str) -> list[str]:
    """Experiment `name`'s record in the project at `root` left running by a killed `dvc` (call
    it only once that `dvc` is gone): written failed, as DVC writes a failed one, and its
    temporary copy removed. Returns the copies removed."""
    from dvc.repo import Repo
    from dvc.repo.experiments.executor.base import ExecutorInfo, TaskStatus
    from dvc.utils.fs import remove

    with Repo(str(root)) as repo:
        records = Path(repo.experiments.tempdir_queue.pid_dir)
    removed = []
    for infofile in sorted(records.glob("*/*.run")):
        try:
            info = ExecutorInfo.load_json(str(infofile))
        except (OSError, ValueError, TypeError):  # half written by the kill: not ours to judge
            continue
        if info.name != name or info.status > TaskStatus.RUNNING:
            continue
        info.status = TaskStatus.FAILED
        info.dump_json(str(infofile))
        if os.path.exists(info.root_dir):
            remove(info.root_dir)
            removed.append(info.root_dir)
    return removed


def cleared_line(root: Path, name: str) -> str | None:
    """The line that says what `clear_killed_experiment` removed; None when nothing was left."""
    removed = clear_killed_experiment(root, name)
    if not removed:
        return None
    copies = ", ".join(os.path.relpath(path, root) for path in removed)
    return (
        f"{name}: dvc was killed before it recorded the end: its record written failed and its "
        f"temporary copy removed ({copies}), so `dvc exp show` lists no Running ghost"
    )


def main() -> None:
    root, name = Path(sys.argv[1]), sys.argv[2]
    if line := cleared_line(root, name):
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
