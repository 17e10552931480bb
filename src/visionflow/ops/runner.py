"""Run `dvc` safely: one run per workspace, no stage process outliving its runner, nothing lost.

DVC does not support two runs in one workspace, a kill of `dvc` alone leaves the stage's command
running, and a failed stage leaves its outputs deleted (they stay in DVC's cache). So
`visionflow repro` (and the Prefect flows):
- hold an OS file lock on `.dvc/tmp/visionflow-run.lock` of the project root (found as DVC finds
  it: the nearest folder above with a `.dvc`); the kernel releases it when its holders die;
- start `dvc` in its own process group, killed whole when `dvc` ends, and beside it a reaper: a
  small process that kills the group when the runner dies, even by SIGKILL, and holds the lock
  until the group is gone, so no second run starts while a stage of the first still lives;
- stop the group one way, whatever asked (Ctrl-C, SIGTERM, a timeout, a cancellation, the
  runner's death): SIGINT, which DVC ignores while a stage runs and on which training finishes
  its epoch and checkpoints it; SIGKILL only after a grace period (VISIONFLOW_STOP_GRACE_S),
  to every process descended from the group, wherever it is (torchrun starts each rank in a
  session of its own), and to `dvc` last, once it has recorded its killed stage's end (a
  `dvc exp run --temp` killed with its stage stays Running in `dvc exp show` for good:
  reaper.kill_stage_first, visionflow.ops.leftovers); torchrun is given the same grace for its
  ranks (TORCH_ELASTIC_SHUTDOWN_TIMEOUT; its own default is 30 s);
- after a failed `dvc repro` (its exit code, not its words), run `dvc checkout --force`: the
  previous results come back from the cache. A run that may need that restore leaves a note
  in `.dvc/tmp` until it is done; a process killed before (Prefect SIGKILLs a cancelled flow
  run's process 30 s after its SIGTERM, and a stage at its safe point can take longer) leaves
  the note behind, and the next run (`visionflow repro`, the flows) restores first, saying so.
  That restore cannot be cut off for good: the note goes only once it is done;
- a stopped run (Ctrl-C, SIGTERM, a cancellation) ends with one line and exit code 130
  (STOPPED_EXIT), whatever the stage was doing; a failed one keeps DVC's code (255).

    visionflow repro [--if-busy wait|skip] [-- DVC REPRO ARGS...]
"""

import fcntl
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from visionflow import faults
from visionflow.errors import NotAProject, Timeout
from visionflow.ops.project import dvc_root, outs_of, pipeline, preflight
from visionflow.ops.reaper import kill_family, kill_stage_first

DVC_RUNS_A_STAGE = "Running stage '"  # DVC's line as it starts a stage's command
BUSY_EXIT = 75  # "skipped: another run holds the workspace" (EX_TEMPFAIL: try again later)
STOPPED_EXIT = 130  # a run stopped by Ctrl-C, SIGTERM or a cancellation (128 + SIGINT)
STOP_GRACE_S = 120.0  # default seconds a stopped stage gets to reach its safe point before SIGKILL
FORWARDED: list[int] = []  # SIGINT/SIGTERM this process passed on: it was asked to stop
HELD: list[int] = []  # the file descriptor of the workspace lock this process holds, if any
KILLED: list[float] = []  # grace periods after which a stopped group had to be killed

REAPER = Path(__file__).with_name("reaper.py")  # run as a script: see its docstring


def environment() -> dict[str, str]:
    """Stages run `python -m ...`: this interpreter's folder goes first on PATH. A stage under
    `torchrun` gives its ranks the runner's grace period before it kills them (torchrun's
    default is 30 s), unless set already."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    grace = str(math.ceil(stop_grace_s()))  # torchrun takes whole seconds
    return {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": grace, **os.environ, "PATH": path}


def dvc_command() -> list[str]:
    return [sys.executable, "-m", "dvc"]


def find_root(start: Path) -> Path:
    """The DVC project `start` is in, as DVC finds it: the nearest folder with a `.dvc` folder."""
    root = dvc_root(start)
    if root is None:
        raise NotAProject(
            f"{start.resolve()} is not inside a DVC project (no .dvc folder here or above)"
        )
    return root


@contextmanager
def workspace_lock(workdir: Path, wait: bool, log: Callable[[str], None] = print) -> Iterator[bool]:
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
            log("another run holds this workspace: waiting for it to finish")
            fcntl.flock(handle, fcntl.LOCK_EX)
        HELD.append(handle.fileno())
        try:
            yield True
        finally:
            HELD.remove(handle.fileno())
            fcntl.flock(handle, fcntl.LOCK_UN)


def stop_grace_s() -> float:
    """Seconds a stage asked to stop gets to finish its epoch and checkpoint it before it is
    killed: VISIONFLOW_STOP_GRACE_S, else STOP_GRACE_S. Give it more than one epoch takes."""
    value = os.environ.get("VISIONFLOW_STOP_GRACE_S", "")
    try:
        seconds = float(value) if value else STOP_GRACE_S
    except ValueError:
        seconds = math.nan
    if not seconds >= 0:  # nan too
        raise ValueError(f"VISIONFLOW_STOP_GRACE_S={value!r} is not a number of seconds >= 0")
    return seconds


class Group:
    """A process group `run_group` started (`dvc` leads it), and the one way it is stopped:
    SIGINT first (DVC ignores it while a stage runs, the stage stops at its safe point and DVC
    records the failure; a stage DVC starts after it, the one that finished just then being
    done, gets it too), SIGKILL once the grace period is over. The reaper is told, so it keeps
    the same deadline."""

    def __init__(self, pid: int, grace_s: float, reaper: subprocess.Popen):
        self.pid, self.grace_s, self.reaper = pid, grace_s, reaper
        # one end at a time: the stop's thread and the caller's finish both end the group, and a
        # second kill_stage_first that found the stage already killed would kill dvc at once,
        # before it recorded the end (a Running ghost, #57)
        self.ending = threading.Lock()
        self.deadline: float | None = None  # set by the first stop

    def signal(self, signum: int) -> bool:
        """Send `signum` to the group; False when nothing of it is left."""
        try:
            os.killpg(self.pid, signum)
            return True
        except ProcessLookupError:
            return False

    def tell_reaper(self, word: bytes | None) -> None:
        """Write a line to the reaper (None: close its stdin)."""
        try:
            if word is None:
                self.reaper.stdin.close()
            else:
                self.reaper.stdin.write(word + b"\n")
                self.reaper.stdin.flush()
        except (BrokenPipeError, ValueError):  # the reaper is gone (killed), or told already
            pass

    def stop(self) -> None:
        """Ask the group to stop at its safe point (once; the grace period runs from now, and
        is kept even if nothing else waits for it)."""
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace_s
            self.tell_reaper(b"stop")
            self.signal(signal.SIGINT)
            threading.Thread(target=self.end, daemon=True).start()

    def end(self) -> None:
        """Stop the group, wait for it until the grace period is over, then kill what is left,
        the stage before `dvc` so that DVC records the end (`kill_stage_first`; recorded in
        KILLED: the stage never reached its safe point)."""
        self.stop()
        with self.ending:
            while self.signal(0) and time.monotonic() < self.deadline:
                time.sleep(0.1)
            if kill_stage_first(self.pid):
                KILLED.append(self.grace_s)


def start_group(
    cmd: list[str], workdir: Path, after: list[str] = ()
) -> tuple[subprocess.Popen, Group]:
    """`cmd` started in its own process group, its output piped, and the reaper that stops the
    group if this process dies, then runs `after`."""
    process = subprocess.Popen(
        cmd,
        cwd=workdir,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        encoding="utf-8",
        errors="backslashreplace",  # a stage may print any bytes (a file name): `\xff`, not a crash
        start_new_session=True,
    )
    grace_s, output = stop_grace_s(), process.stdout.fileno()
    reaper = subprocess.Popen(  # the standard library alone: no PYTHONPATH of ours
        [sys.executable, str(REAPER), str(process.pid), str(grace_s), str(output), *after],
        stdin=subprocess.PIPE,
        pass_fds=(*HELD, output),  # the workspace lock stays held until the group is gone
        start_new_session=True,  # not killed with this process's group
    )
    return process, Group(process.pid, grace_s, reaper)


def supervise(process: subprocess.Popen, group: Group, timeout_s: float):
    """Two threads: one ends the group's orphans the moment `cmd` ends (they hold our pipe
    open), one stops the group at the deadline, whether or not it prints. Returns the first,
    the event to set when the call ends, and the event set when the deadline passed."""

    def reap() -> None:
        process.wait()
        if group.deadline is not None or process.returncode < 0:
            group.end()  # stopped, or DVC itself killed: the stage may be checkpointing
        else:
            kill_family(group.pid)

    call_done, timed_out = threading.Event(), threading.Event()

    def expire() -> None:
        if faults.ACTIVE:
            faults.fault("runner.timer")  # tests: start counting once a stage is at work
        if not call_done.wait(timeout_s):
            timed_out.set()
            group.end()

    watcher = threading.Thread(target=reap, daemon=True)
    watcher.start()
    threading.Thread(target=expire, daemon=True).start()
    return watcher, call_done, timed_out


def finish(process: subprocess.Popen, group: Group, watcher: threading.Thread) -> None:
    """Nothing of the group survives: a command still running (the call ended early, by a
    cancellation or an error) is stopped the usual way, then whatever is left is killed."""
    if process.poll() is None:
        drain = threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True)
        drain.start()  # a stage that cannot print cannot reach its safe point
        group.end()
    kill_family(group.pid)  # nothing may survive this call
    watcher.join()
    group.tell_reaper(b"done")
    group.tell_reaper(None)
    group.reaper.wait()


def run_group(
    cmd: list[str],
    workdir: Path,
    timeout_s: float,
    log: Callable[[str], None],
    sigterm: bool = True,
    after: list[str] = (),
) -> tuple[int, str]:
    """Run `cmd` in its own process group, streaming lines to `log`. Every way of stopping it
    goes through `Group.end`: SIGINT, a grace period for the stage's safe point
    (`stop_grace_s()`), then SIGKILL. SIGINT or SIGTERM sent to this process ask the group to
    stop (recorded in `FORWARDED`; a second SIGINT is passed on: Ctrl-C twice stops at once); so
    does `timeout_s`, printing or silent (then `Timeout` is raised), and an early end of this call
    (cancellation, an error). If this process dies, the reaper does the same. When `cmd` ends on
    its own, whatever is left of its group is killed at once; when it was stopped or killed, the
    rest of the group gets the grace period. With `sigterm` off, SIGTERM is left to the
    handler in place (Prefect's, whose exception is an early end of this call). `after` is a
    command the reaper runs once the group is gone, should this process die first (a caller
    that lives does its own cleanup).

    Returns the exit code and the output's last 4,000 characters.
    """
    process, group = start_group(cmd, workdir, after)
    watcher, call_done, timed_out = supervise(process, group, timeout_s)
    handlers = (
        (signal.SIGINT, signal.SIGTERM)[: 2 if sigterm else 1]
        if threading.current_thread() is threading.main_thread()
        else ()
    )

    def forward(signum: int, frame) -> None:
        FORWARDED.append(signum)  # for the caller: it was asked to stop, and ends after this run
        if group.deadline is None:
            group.stop()
        elif signum == signal.SIGINT:  # Ctrl-C again: the stage stops at once
            group.signal(signal.SIGINT)

    previous = {signum: signal.signal(signum, forward) for signum in handlers}
    tail = ""
    try:
        for line in process.stdout:
            log(line.rstrip())
            tail = (tail + line)[-4000:]
            if group.deadline is not None and line.startswith(DVC_RUNS_A_STAGE):
                group.signal(signal.SIGINT)  # stopping: the next stage stops at its start
        watcher.join()
        if timed_out.is_set():
            raise Timeout(f"`{' '.join(cmd[2:])}` ran past {timeout_s:.0f} s and was stopped")
        return process.returncode, tail
    finally:
        call_done.set()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        finish(process, group, watcher)


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


def wait_until_free(workdir: Path, timeout_s: float = 60) -> None:
    """Until no other `dvc` holds the repository's lock (at most `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while dvc_busy(workdir) and time.monotonic() < deadline:
        time.sleep(0.5)


def restore_note(workdir: Path) -> Path:
    """The note a run that may need a restore keeps while it runs: the stages to restore, one a
    line (none: every stage). The file's name is the one earlier versions wrote, so a note
    they left is still found."""
    return workdir / ".dvc" / "tmp" / "visionflow-restore-owed"


def mend_rwlock(workdir: Path, log: Callable[[str], None]) -> None:
    """Remove DVC's stage lock file (`.dvc/tmp/rwlock`) when a `dvc` killed while writing it left
    it empty or half written: every later `dvc repro` fails on it ("Unable to read RWLock-file ...
    JSON structure is corrupted"). What it held went with the killed process. Only while no
    other `dvc` holds the repository (a writer mid-write would be one)."""
    path = workdir / ".dvc" / "tmp" / "rwlock"
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return
    except (ValueError, UnicodeDecodeError):
        if not dvc_busy(workdir):
            path.unlink(missing_ok=True)
            log("removed DVC's stage lock file (.dvc/tmp/rwlock), left half written by a kill")


def begin_restorable_run(workdir: Path, log: Callable[[str], None], *stages: str) -> None:
    """Before a run that may leave outputs deleted: first the restore a killed run left undone
    (its process died before it could restore), then this run's note. Under the workspace lock."""
    mend_rwlock(workdir, log)
    note = restore_note(workdir)
    if note.exists():
        left = note.read_text().split()
        log(
            "the previous run left its results unrestored (killed first, or no room on the "
            f"disk): restoring {', '.join(left) or 'every stage'} now"
        )
        restore(workdir, log, *left)
    note.parent.mkdir(parents=True, exist_ok=True)
    note.write_text("".join(f"{stage}\n" for stage in stages))


def drop_restore_note(workdir: Path) -> None:
    """The run ended without needing a restore (or the restore was done): drop its note."""
    restore_note(workdir).unlink(missing_ok=True)


def stop_message(what: str, killed_before: int) -> str:
    """The one line for a stopped run: what stopped, by which signal, and whether the stage had
    to be killed after its grace period."""
    line = f"{what} stopped by {signal.Signals(FORWARDED[-1]).name}"
    if len(KILLED) > killed_before:
        line += (
            f", killed after VISIONFLOW_STOP_GRACE_S={KILLED[-1]:g} s without reaching its "
            "safe point"
        )
    return line


def restore(workdir: Path, log: Callable[[str], None], *stages: str) -> None:
    """After a failed run: `dvc checkout --force STAGES` (default: every stage of dvc.yaml) puts
    back the outputs that dvc.lock records (the failed stage's previous results among them) from
    DVC's cache, whatever the stage left at their paths (it came from the run that failed, or
    that DVC could not record); the staging folders a killed stage left beside them go too.
    Stage outputs only: data tracked with `dvc add` is the user's, new files in it included."""
    mend_rwlock(workdir, log)  # `dvc` killed past the grace period, maybe while writing it
    try:
        specs, params = pipeline(workdir)
        outs, stages = [workdir / out for out in outs_of(specs, params)], stages or tuple(specs)
    except Exception:  # dvc.yaml or params.yaml unreadable: DVC has said so; nothing to restore
        log("dvc.yaml could not be read: nothing restored")
        return
    for out in outs:
        for suffix in (".partial", ".old", ".extract"):  # staging, swap, an archive's files
            shutil.rmtree(out.with_name(out.name + suffix), ignore_errors=True)
    wait_until_free(workdir)  # a `dvc status` of the user's (an editor's, say) lets go soon
    cmd = [*dvc_command(), "checkout", "--force", *stages]
    code, tail = run_group(cmd, workdir, 600, lambda line: None)
    free = shutil.disk_usage(workdir).free
    if code == 0:
        log("restored the previous results from DVC's cache (dvc checkout)")
        drop_restore_note(workdir)
    elif free < 2**20:  # DVC says "Is your cache up to date?": the cache is fine, the disk full
        log(
            f"disk full: {workdir} has {free / 2**20:.1f} MB free, too little to restore the "
            "previous results from DVC's cache: free space, and the next run (visionflow repro, "
            "the flows) restores them first (or `dvc checkout --force`)"
        )  # the note stays: the next run owes the restore
    else:
        log(f"dvc checkout could not restore the previous results:\n{tail}")
        drop_restore_note(workdir)  # not doable as things are: the next run does not try again


def repro(start: Path, args: list[str], wait: bool = True, timeout_s: float = 7 * 24 * 3600) -> int:
    """`dvc repro ARGS` under the workspace lock and in its own process group; its exit code."""
    try:
        workdir = find_root(start)
    except NotAProject as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    problems = preflight(workdir)  # DVC would hang, or answer in words that name nothing
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        return 1
    try:
        stop_grace_s()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    with workspace_lock(workdir, wait) as held:
        if not held:
            print("another run holds this workspace: skipped (--if-busy skip)", file=sys.stderr)
            return BUSY_EXIT
        # from here to the end, a stop is recorded, never fatal: the restore must happen
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda number, frame: FORWARDED.append(number))
        report = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        begin_restorable_run(workdir, report)
        cmd, killed = [*dvc_command(), "repro", *args], len(KILLED)
        code, tail = run_group(cmd, workdir, timeout_s, lambda line: print(line, flush=True))
        if code != 0:  # failed, stopped or killed: DVC's exit code, whatever it printed
            restore(workdir, report)  # drops the note once restored
        else:
            drop_restore_note(workdir)
        if FORWARDED and code != 0:  # stopped: one line and one code, whatever it was doing
            report(f"{stop_message('the run', killed)} (exit {STOPPED_EXIT})")
            return STOPPED_EXIT
        return code
