"""Run `dvc` safely: one run per workspace, no stage process outliving its runner, nothing lost.

DVC does not support two runs in one workspace, a kill of `dvc` alone leaves the stage's command
running, and a failed stage leaves its outputs deleted (they stay in DVC's cache). So
`visionflow repro` (and the Prefect flows):
- hold an OS file lock on `.dvc/tmp/visionflow-run.lock` of the project root (found as DVC finds
  it: the nearest folder above with a `.dvc`); the kernel releases it when its holders die;
- start `dvc` in its own process group, killed whole when `dvc` ends, and beside it a reaper: a
  small process that kills the group when the runner dies, even by SIGKILL, and holds the lock
  until the group is gone, so no second run starts while a stage of the first still lives;
- pass Ctrl-C and SIGTERM on to the group, so training stops at a safe point;
- after a failed `dvc repro`, run `dvc checkout`: the previous results come back from the cache.

    visionflow repro [--if-busy wait|skip] [-- DVC REPRO ARGS...]
"""

import fcntl
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from visionflow.project import all_deps, special_files

STAGE_FAILED = "ERROR: failed to reproduce"  # DVC's line when a stage's command failed
BUSY_EXIT = 75  # "skipped: another run holds the workspace" (EX_TEMPFAIL: try again later)
GRACE_S = 5.0  # after a timeout's SIGTERM, seconds before SIGKILL
FORWARDED: list[int] = []  # SIGINT/SIGTERM this process passed on: it was asked to stop
HELD: list[int] = []  # the file descriptor of the workspace lock this process holds, if any

# The reaper: waits for EOF on stdin (the runner's end of the pipe closes when the runner ends,
# however it ends), then kills the process group until none of it is left, zombies included (DVC
# takes a dead run's lock entry for a live one until its process is reaped), for at most 30 s.
REAPER = """
import os, signal, sys, time
group, deadline = int(sys.argv[1]), time.monotonic() + 30
sys.stdin.buffer.read()
while time.monotonic() < deadline:
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        break
    time.sleep(0.05)
"""


class NotAProject(RuntimeError):
    """No `.dvc` folder here or above."""


class Timeout(TimeoutError):
    """A command ran past its time and was killed with its whole process group."""


def environment() -> dict[str, str]:
    """Stages run `python -m ...`: this interpreter's folder goes first on PATH."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def dvc_command() -> list[str]:
    return [sys.executable, "-m", "dvc"]


def find_root(start: Path) -> Path:
    """The DVC project `start` is in, as DVC finds it: the nearest folder with a `.dvc` folder."""
    start = start.resolve()
    for folder in (start, *start.parents):
        if (folder / ".dvc").is_dir():
            return folder
    raise NotAProject(f"{start} is not inside a DVC project (no .dvc folder here or above)")


@contextmanager
def workspace_lock(workdir: Path, wait: bool, say: Callable[[str], None] = print) -> Iterator[bool]:
    """Hold the workspace's run lock; yields False at once when busy and `wait` is off."""
    lock_file = workdir / ".dvc" / "tmp" / "visionflow-run.lock"
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            say("another run holds this workspace: waiting for it to finish")
            fcntl.flock(handle, fcntl.LOCK_EX)
        HELD.append(handle.fileno())
        try:
            yield True
        finally:
            HELD.remove(handle.fileno())
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_group(
    cmd: list[str], workdir: Path, timeout_s: float, log: Callable[[str], None]
) -> tuple[int, str]:
    """Run `cmd` in its own process group, streaming lines to `log`. SIGINT and SIGTERM sent to
    this process are passed on to the group (and recorded in `FORWARDED`); when `cmd` ends, or
    this call ends early (timeout, cancellation, an error), whatever is left of the group is
    killed; if this process dies, the reaper kills it. At `timeout_s`, printing or silent, the group gets SIGTERM (training stops
    at a safe point), then SIGKILL `GRACE_S` later, and `Timeout` is raised.

    Returns the exit code and the output's last 4,000 characters.
    """
    process = subprocess.Popen(
        cmd,
        cwd=workdir,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    reaper = subprocess.Popen(
        [sys.executable, "-c", REAPER, str(process.pid)],
        stdin=subprocess.PIPE,
        pass_fds=tuple(HELD),  # the workspace lock stays held until the group is gone
        start_new_session=True,  # not killed with this process's group
    )

    def signal_group(signum: int) -> None:
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:  # nothing left
            pass

    def reap() -> None:  # the moment `dvc` ends, its orphans go too (they hold our pipe open)
        process.wait()
        signal_group(signal.SIGKILL)

    ended, timed_out = threading.Event(), threading.Event()

    def expire() -> None:  # the deadline, whether or not the command prints
        if not ended.wait(timeout_s):
            timed_out.set()
            signal_group(signal.SIGTERM)
            if not ended.wait(GRACE_S):
                signal_group(signal.SIGKILL)

    watcher = threading.Thread(target=reap, daemon=True)
    watcher.start()
    threading.Thread(target=expire, daemon=True).start()
    handlers = (
        (signal.SIGINT, signal.SIGTERM)
        if threading.current_thread() is threading.main_thread()
        else ()
    )

    def forward(signum: int, frame) -> None:
        FORWARDED.append(signum)  # for a caller that loops (the watcher): stop after this run
        signal_group(signum)

    previous = {s: signal.signal(s, forward) for s in handlers}
    tail = ""
    try:
        for line in process.stdout:
            log(line.rstrip())
            tail = (tail + line)[-4000:]
        watcher.join()
        if timed_out.is_set():
            raise Timeout(f"`{' '.join(cmd[2:])}` ran past {timeout_s:.0f} s and was killed")
        return process.returncode, tail
    finally:
        ended.set()
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal_group(signal.SIGKILL)  # timeout, cancellation, an error: nothing may survive
        watcher.join()
        reaper.stdin.close()  # the group is gone: the reaper finds nothing and ends
        reaper.wait()


def dvc_busy(workdir: Path) -> bool:
    """Whether another `dvc` process holds the repository's lock (`.dvc/tmp/lock`, which DVC
    takes with flock): asked of the lock itself, not read from DVC's error message."""
    lock_file = workdir / ".dvc" / "tmp" / "lock"
    if not lock_file.exists():
        return False
    with open(lock_file, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def restore(workdir: Path, log: Callable[[str], None], *stages: str) -> None:
    """After a failed run: `dvc checkout [STAGES]` puts back the outputs that dvc.lock records
    (the failed stage's previous results among them) from DVC's cache. Named stages are forced:
    what is in their outputs now came from the run that failed (or that DVC could not record)."""
    cmd = [*dvc_command(), "checkout", *(["--force", *stages] if stages else [])]
    code, tail = run_group(cmd, workdir, 600, lambda line: None)
    if code == 0:
        log("restored the previous results from DVC's cache (dvc checkout)")
    else:
        log(f"dvc checkout could not restore the previous results:\n{tail}")


def repro(start: Path, args: list[str], wait: bool = True, timeout_s: float = 7 * 24 * 3600) -> int:
    """`dvc repro ARGS` under the workspace lock and in its own process group; its exit code."""
    try:
        workdir = find_root(start)
    except NotAProject as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    special = special_files(all_deps(workdir))
    if special:
        print(f"error: {'; '.join(special)}: DVC would hang reading it; remove it", file=sys.stderr)
        return 1
    with workspace_lock(workdir, wait) as held:
        if not held:
            print("another run holds this workspace: skipped (--if-busy skip)", file=sys.stderr)
            return BUSY_EXIT
        cmd = [*dvc_command(), "repro", *args]
        code, tail = run_group(cmd, workdir, timeout_s, lambda line: print(line, flush=True))
        if code != 0 and STAGE_FAILED in tail:  # not DVC's own lock, a bad argument, ...
            restore(workdir, lambda line: print(line, file=sys.stderr, flush=True))
        return code
