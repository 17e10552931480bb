"""The reaper beside each `dvc` group that `runner.start_group` starts, run as a script:
`python reaper.py GROUP GRACE_S OUTPUT_FD`. One starts beside every run, so it imports the
standard library and psutil alone (psutil, which DVC installs, reads the process table on Linux
and macOS alike); the runner and the queued sweep import its `family` and `kill_family`.

It waits for EOF on stdin (the runner's end of the pipe closes when the runner ends,
however it ends). A line "stop" means the runner has asked the group to stop (the grace period
runs from then); "done" means the group has ended. Without "done", the runner died: the reaper
keeps the group's output pipe open (drained, so a stage can still print), asks the group to
stop with SIGINT if the runner had not, waits out the grace period, then kills the group until
none of it is left, zombies included (DVC takes a dead run's lock entry for a live one until its
process is reaped), for at most 30 s; and, even when the group ended first, what it had started
in sessions of their own (torchrun's ranks) as the reaper saw them when the runner died. Then it
runs the command after OUTPUT_FD, if any (`runner.run_group`'s `after`: what DVC could not
record, cleared).

A kill past the grace period spares `dvc`, the group's leader, at first (`kill_stage_first`):
it kills the stage's processes, and DVC, seeing its stage die, records the end as after any
failure (a `dvc exp run --temp` writes its experiment failed and removes its temporary copy;
killed with its stage, it left `dvc exp show` saying Running, and the copy in .dvc/tmp/exps,
for good). DVC gets RECORD_S for that, then it is killed too.
"""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

RECORD_S = 30.0  # seconds `dvc` gets to record the end of a stage killed under it (~3 s here)


def main() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stop sent to every process (systemd's
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # control group) must not end the guard
    group, grace, output = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    after = sys.argv[4:]  # a command to run once the group is gone, if the runner died
    deadline, done = None, False
    for line in sys.stdin.buffer:
        if line.strip() == b"stop":
            deadline = deadline or time.monotonic() + grace
        done = done or line.strip() == b"done"
    threading.Thread(
        target=lambda: [None for _ in iter(lambda: os.read(output, 65536), b"")], daemon=True
    ).start()
    # torchrun's ranks, each in a session of its own, noted while the group can still name
    # them: once it is empty they are orphans no sweep of it finds
    seen = {pid: started(pid) for pid in family(group)}
    try:
        if not done:
            if deadline is None:
                os.killpg(group, signal.SIGINT)
                deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                os.killpg(group, 0)
                time.sleep(0.1)
            kill_stage_first(group)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            kill_family(group)
            kill_seen(seen)
            os.killpg(group, signal.SIGKILL)
            time.sleep(0.05)
    except (ProcessLookupError, PermissionError):
        kill_seen(seen)  # the group is gone: what it started may not be
    if after and not done:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run(after, stdin=subprocess.DEVNULL, timeout=600, check=False)


def family(leader: int, group: bool = True) -> set[int]:
    """The live processes of `leader`'s process group (or `leader` alone) and every process
    descended from them, whatever group or session it is in (torchrun starts each rank with
    `setsid`): read from /proc before a kill, since the ranks of a killed launcher are
    reparented out of reach."""
    parents, found = {}, set()
    for process in psutil.process_iter(["ppid", "status"]):
        if process.info["status"] in (psutil.STATUS_ZOMBIE, None):  # dead already, or gone
            continue
        try:
            mine = os.getpgid(process.pid) == leader if group else process.pid == leader
        except OSError:  # ended meanwhile
            continue
        parents[process.pid] = process.info["ppid"]
        if mine:
            found.add(process.pid)
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_family(leader: int, group: bool = True) -> bool:
    """SIGKILL `family(leader, group)`, looking again until none is left (a process may fork as
    it is killed); True when there was anything to kill."""
    found = family(leader, group)
    for _ in range(10):
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        again = family(leader, group)
        if not again - found:
            break
        found |= again
    return bool(found)


def kill_stage_first(leader: int, record_s: float = RECORD_S) -> bool:
    """`kill_family(leader)`, letting `leader` (`dvc`) record the end first when anything runs
    under it: what ran under it (the stage, and whatever that starts, until none is left) is
    killed, not what `leader` starts afterwards (a failed stage's report: DVC's analytics
    daemon, say), and `leader` gets `record_s` to end on its own before it is killed too. A
    `leader` with nothing under it is what hangs: killed at once. True when there was anything
    to kill."""
    stage = family(leader) - {leader}
    deadline = time.monotonic() + record_s
    while stage and time.monotonic() < deadline and started(leader) is not None:
        under = family(leader) - {leader}
        later = {pid for pid in under - stage if parent(pid) == leader}
        under -= set().union(*(family(pid, group=False) for pid in later))
        for pid in under:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stage |= under
        time.sleep(0.05)
    return kill_family(leader) or bool(stage)


def parent(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def started(pid: int) -> str | None:
    """A process's start time, which tells it from a later one that reuses its pid; None when it
    is gone or a zombie."""
    try:
        process = psutil.Process(pid)
        zombie = process.status() == psutil.STATUS_ZOMBIE
        return None if zombie else repr(process.create_time())
    except psutil.Error:
        return None


def kill_seen(seen: dict[int, str | None]) -> None:
    for pid, start in seen.items():
        if start is not None and started(pid) == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
