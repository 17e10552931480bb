"""Run `dvc` safely: one run per workspace, and no stage process outliving its `dvc`.

DVC does not support two runs in one workspace, and a kill of `dvc` alone leaves the stage's
command running. `visionflow repro` (and the Prefect flows) therefore hold an OS file lock on
`.dvc/tmp/visionflow-run.lock` (the kernel releases it when the holder dies, so a dead run never
blocks the next) and start `dvc` in its own process group, which is killed whole whenever `dvc`
ends. Ctrl-C and SIGTERM are passed on to the group, so training stops at a safe point.

    visionflow repro [--if-busy wait|skip] [-- DVC REPRO ARGS...]
"""

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def environment() -> dict[str, str]:
    """Stages run `python -m ...`: this interpreter's folder goes first on PATH."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def dvc_command() -> list[str]:
    return [sys.executable, "-m", "dvc"]


def file_stats(paths) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file at or under `paths`, hidden files and __pycache__ skipped:
    cheap enough to compare before and after a run, or every half second while watching."""
    found = {}
    for path in map(Path, paths):
        files = [path] if path.is_file() else path.rglob("*") if path.is_dir() else []
        for f in files:
            if f.is_file() and "__pycache__" not in f.parts and not f.name.startswith("."):
                stat = f.stat()
                found[str(f)] = (stat.st_size, stat.st_mtime_ns)
    return found


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
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_group(
    cmd: list[str], workdir: Path, timeout_s: float, log: Callable[[str], None]
) -> tuple[int, str]:
    """Run `cmd` in its own process group, streaming lines to `log`. SIGINT and SIGTERM sent to
    this process are passed on to the group; when `cmd` ends, or this call ends early (timeout,
    cancellation, an error), whatever is left of the group is killed.

    Returns the exit code and the output's last 4,000 characters.
    """
    process = subprocess.Popen(cmd, cwd=workdir, env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip

    def kill_group() -> None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing left
            pass

    def reap() -> None:  # the moment `dvc` ends, its orphans go too (they hold our pipe open)
        process.wait()
        kill_group()

    def forward(signum, frame) -> None:
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:  # `dvc` and its group ended in this same instant
            pass

    watcher = threading.Thread(target=reap, daemon=True)
    watcher.start()
    handlers = (
        (signal.SIGINT, signal.SIGTERM)
        if threading.current_thread() is threading.main_thread()
        else ()
    )
    previous = {s: signal.signal(s, forward) for s in handlers}
    tail, deadline = "", time.monotonic() + timeout_s
    try:
        for line in process.stdout:
            log(line.rstrip())
            tail = (tail + line)[-4000:]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{' '.join(cmd)} ran past {timeout_s:.0f} s; killed")
        watcher.join()
        return process.returncode, tail
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        kill_group()  # timeout, cancellation, an error: nothing may survive
        watcher.join()


def repro(
    workdir: Path, args: list[str], wait: bool = True, timeout_s: float = 7 * 24 * 3600
) -> int:
    """`dvc repro ARGS` under the workspace lock and in its own process group; its exit code."""
    with workspace_lock(workdir, wait) as held:
        if not held:
            print("another run holds this workspace: skipping (--if-busy skip)")
            return 0
        code, _ = run_group([*dvc_command(), "repro", *args], workdir, timeout_s,
                            lambda line: print(line, flush=True))  # fmt: skip
        return code
