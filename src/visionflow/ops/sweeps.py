"""A sweep's DVC side, for the `experiments` flow: `dvc exp run` arguments, DVC's queue
(workers, a guard process that stops the sweep if the flow's process dies, stopping it), and what
`dvc exp show` says of each experiment (its state, the params that differ from the baseline, the
main metrics). No Prefect here (docs/development.md, the layers): the flow makes the tasks and the table artifact.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from visionflow.data.files import flatten
from visionflow.ops import repo, runner
from visionflow.ops.repo import DvcBusy, DvcHung, StageFailed, dvc
from visionflow.ops.runner import dvc_command, environment, family, kill_family, stop_grace_s

MAIN_METRICS = {"results/evaluate/metrics.json": ("accuracy", "macro_f1")}


def exp_run_args(name: str, sets: list[str]) -> list[str]:
    return ["exp", "run", "--name", name, *(arg for s in sets for arg in ("--set-param", s))]


def start_workers(root: Path, workers: int) -> None:
    """`dvc queue start --jobs N`. The worker is a daemon: with our pipes it would hold them
    until the queue is empty."""
    subprocess.run(
        [*dvc_command(), "queue", "start", "--jobs", str(workers)],
        cwd=root,
        env=environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=repo.DVC_TIMEOUT_S,
        check=True,
    )


ENDED = ("success", "failed")

# A sweep's guard waits for EOF on stdin. Without "done" first, the flow process died (kill -9):
# the guard becomes `python -m pipeline.flows ROOT --stop-sweep NAME...`, which stops this
# sweep's experiments, holding the workspace lock it inherited until they are gone.
SWEEP_GUARD = """
import os, sys
if b"done" not in sys.stdin.buffer.read():
    os.execv(sys.executable, [sys.executable, "-m", "pipeline.flows", sys.argv[1], "--stop-sweep",
                              *sys.argv[2:]])
"""


@contextmanager
def guarded(root: Path, names) -> Iterator[None]:
    """While a queued sweep runs, a guard process that stops it if this process dies (DVC's
    queue worker is a daemon: nothing else would)."""
    log = open(root / ".dvc" / "tmp" / "visionflow-sweep-guard.log", "a")  # not our stdout:
    guard = subprocess.Popen(  # it may be a pipe that dies with this process
        [sys.executable, "-c", SWEEP_GUARD, str(root), *names],
        cwd=root,
        env=environment(),
        stdin=subprocess.PIPE,
        stdout=log,
        stderr=subprocess.STDOUT,
        pass_fds=tuple(runner.HELD),  # the workspace stays held until the sweep is stopped
        start_new_session=True,
    )
    log.close()
    try:
        yield
    finally:
        guard.communicate(b"done")  # ended here, stopped here if need be: the guard goes


def stop_queue(
    root: Path, plan, say: Callable[[str], None], known: dict[str, dict] | None = None
) -> None:
    """Drop this sweep's queued experiments and stop its running ones: SIGINT to each one's own
    processes (`interrupt`), then, the grace period (`stop_grace_s()`) later, SIGKILL to what is
    left of them. When DVC does not answer in time, what the sweep `known` last is stopped."""
    try:
        now = Poll(root, say).results(plan, patience_s=30.0)
    except StageFailed as e:
        if known is None:
            raise
        say(f"{e}: stopping what the sweep saw last")
        now = known
    queued = [name for name, summary in now.items() if summary["state"] == "queued"]
    running = {
        name: summary["pid"] for name, summary in now.items() if summary["state"] == "running"
    }
    if queued:
        try:  # best effort: a queued one that started meanwhile is stopped below next time
            dvc(root, "queue", "remove", *queued, doing="dropping the sweep's queued experiments")
        except (StageFailed, DvcBusy) as e:
            say(str(e))
    asked = interrupt(root, running, say)
    pids = set(asked)
    while pids:
        pids = {pid for pid in pids if alive(pid)}
        for pid in [pid for pid in pids if time.time() > asked[pid] + stop_grace_s()]:
            kill_family(pid, group=False)
            pids.discard(pid)
        time.sleep(0.2)


def interrupt(root: Path, running: dict[str, int | None], say) -> dict[int, float]:
    """SIGINT to each running experiment's own processes: the stage stops at its safe point and
    DVC records the failure. Not `dvc queue kill`: an experiment runs in DVC's queue worker's
    process group, and DVC signals the whole group; the worker, interrupted, died without
    recording the end (`dvc queue status`: Running with no worker, the copy left in
    .dvc/tmp/exps). Each is asked once: a second SIGINT stops training at once, losing the epoch,
    so a guard that takes over from a killed flow keeps the first ask's time (kept in .dvc/tmp).
    Returns each asked process and when it was asked."""
    record = root / ".dvc" / "tmp" / "visionflow-sweep-stop.json"
    try:
        asked = {int(pid): at for pid, at in json.loads(record.read_text()).items()}
    except (OSError, ValueError):
        asked = {}
    asked = {pid: at for pid, at in asked.items() if alive(pid)}
    for name, pid in running.items():
        if pid is None:  # DVC did not say its process: DVC stops it
            try:
                dvc(root, "queue", "kill", name, doing=f"stopping {name}")
            except (StageFailed, DvcBusy) as e:
                say(str(e))
        elif pid not in asked:
            asked[pid] = time.time()
            for member in family(pid, group=False):
                try:
                    os.kill(member, signal.SIGINT)
                except ProcessLookupError:
                    pass
    record.write_text(json.dumps(asked))
    return {pid: at for pid, at in asked.items() if pid in running.values()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


class Poll:
    """What `dvc exp show --json` says of a sweep's experiments, for a sweep that must outlive a
    slow or failing answer: DVC is slow exactly when the machine is busy with the sweep's own
    training, and the experiments' processes, not this poll, are what the sweep waits on.

    An ask that fails (DVC's queue can list an experiment whose executor file is already gone,
    "No such file or directory: .dvc/tmp/exps/run/...") is asked again RETRY_S later. One that
    runs past its timeout (repo.DVC_TIMEOUT_S at first) is ended and asked again with twice the
    timeout, up to MAX_GROWTH times the first, which later asks keep. Each is a line in the log,
    and so is an answer that took over half its timeout; `took` is the last ask's seconds (a
    caller polls no more often than that, so polls cost at most half the time). Only
    `patience_s` without any answer raises (StageFailed).
    """

    RETRY_S = 5.0
    MAX_GROWTH = 8
    first_timeout_s: float | None = None  # None: repo.DVC_TIMEOUT_S when the poll is made

    def __init__(self, root: Path, say: Callable[[str], None] = print):
        self.root, self.say = root, say
        self.first = self.timeout_s = self.first_timeout_s or repo.DVC_TIMEOUT_S
        self.took = 0.0

    def exp_show(self, patience_s: float) -> list:
        deadline = time.monotonic() + patience_s
        while True:
            start = time.monotonic()
            try:
                shown = dvc(
                    self.root,
                    *("exp", "show", "--json"),
                    doing="following experiments",
                    timeout_s=self.timeout_s,
                    point="sweep.poll",
                )
            except DvcHung as e:
                self.timeout_s = min(2 * self.timeout_s, self.MAX_GROWTH * self.first)
                problem = f"{e}; asking again with {self.timeout_s:.0f} s"
            except (StageFailed, DvcBusy) as e:
                problem = str(e).splitlines()[0]
            else:
                self.took = time.monotonic() - start
                if self.took > self.timeout_s / 2:
                    self.say(f"`dvc exp show` took {self.took:.0f} s (the machine is busy)")
                return json.loads(shown or "[]")
            self.took = time.monotonic() - start
            if time.monotonic() + self.RETRY_S > deadline:
                raise StageFailed(f"no answer from DVC in {patience_s:.0f} s: {problem}")
            self.say(f"{problem} (asked again in {self.RETRY_S:.0f} s; the sweep goes on)")
            time.sleep(self.RETRY_S)

    def results(self, names, patience_s: float = 600.0) -> dict[str, dict]:
        """For each experiment name: its state (queued, running, success, failed), params and
        metrics, and the baseline's params."""
        found = {}
        for baseline in self.exp_show(patience_s):
            for exp in baseline.get("experiments") or []:
                if exp.get("name") in names:
                    data = exp["revs"][0].get("data") or {}
                    state = (exp.get("executor") or {}).get("state")
                    state = state or ("success" if data.get("metrics") else "failed")
                    found[exp["name"]] = {  # metrics of one not done are its baseline's: none
                        "state": state,
                        "pid": ((exp.get("executor") or {}).get("local") or {}).get("pid"),
                        "params": data.get("params", {}),
                        "metrics": data.get("metrics", {}) if state == "success" else {},
                        "baseline": (baseline.get("data") or {}).get("params", {}),
                    }
        return {name: found.get(name, {"state": "failed"}) for name in names}  # no record: failed


def metric_values(summary: dict) -> dict:
    """The main metrics of one experiment (None where it has none), to 5 significant digits as
    `dvc exp show` prints them (0.77222, not 0.7722222222222223)."""
    metrics = summary.get("metrics", {})
    return {
        name: shown((metrics.get(path) or {}).get("data", {}).get(name))
        for path, names in MAIN_METRICS.items()
        for name in names
    }


def shown(value):
    """A number to 5 significant digits; anything else as it is."""
    if isinstance(value, float):
        return float(f"{value:.5g}")
    return value


def main_metrics(summary: dict) -> str:
    values = metric_values(summary)
    return " ".join(f"{name}={value}" for name, value in values.items() if value is not None)


def sweep_table(poll: Poll, plan: dict[str, list[str]]) -> list[dict]:
    """One row per experiment of the sweep: name, state, the params that differ from its
    baseline (the union over the sweep, so every row has the same columns), the main metrics.
    A failed experiment, whose params DVC does not show, has the overrides it was given."""
    summaries = poll.results(plan)
    diffs = {}
    for name, summary in summaries.items():
        params = flatten((summary.get("params") or {}).get("params.yaml", {}).get("data", {}))
        base = flatten((summary.get("baseline") or {}).get("params.yaml", {}).get("data", {}))
        diffs[name] = overrides(plan.get(name, [])) | {
            k: v for k, v in params.items() if base.get(k) != v
        }
    keys = sorted({key for diff in diffs.values() for key in diff})
    rows = []
    for name, summary in summaries.items():
        row = {"experiment": name, "state": summary["state"]}
        row |= {key: diffs[name].get(key) for key in keys}
        rows.append(row | metric_values(summary))
    return rows


def overrides(sets: list[str]) -> dict:
    """`-S` overrides as {param: value}: "train.lr=1e-3" -> {"train.lr": 0.001} (a value that is
    not JSON stays text)."""
    found = {}
    for item in sets:
        key, _, text = item.partition("=")
        try:
            found[key.rpartition(":")[2]] = json.loads(text)
        except ValueError:
            found[key.rpartition(":")[2]] = text
    return found


def stop_idle_workers(root: Path, say: Callable[[str], None]) -> None:
    """`dvc queue stop` once a sweep has ended, then wait (up to the grace period) for DVC's queue
    workers in this workspace to go: left alone they outlive the sweep."""
    try:
        dvc(root, "queue", "stop", doing="stopping DVC's idle queue workers")
    except (StageFailed, DvcBusy) as e:
        say(str(e))
        return
    deadline = time.monotonic() + stop_grace_s()
    while queue_workers(root) and time.monotonic() < deadline:
        time.sleep(0.2)


def queue_workers(root: Path) -> list[int]:
    """DVC's queue worker processes working in `root`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:
            continue
        if b"queue-worker" in cmdline and cwd == root:
            found.append(int(pid))
    return found


# --- a sweep spread over a work pool's workers: each experiment runs in the checkout of the
# worker that took it, then travels through the git and DVC remotes (`dvc exp push`/`pull`).


def git(root: Path, *args: str) -> str:
    result = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if result.returncode != 0:
        raise StageFailed(f"`git {' '.join(args)}` in {root} failed: {result.stderr.strip()}")
    return result.stdout


def uncommitted(root: Path) -> list[str]:
    """Tracked files changed and not committed: a spread sweep's experiments run the commit."""
    lines = git(root, "status", "--porcelain", "--untracked-files=no").splitlines()
    return [line[3:] for line in lines]


def spread_problem(root: Path, remote: str, commit: str | None = None) -> str | None:
    """Why this checkout cannot take part in a spread sweep from `commit` (this one's HEAD when
    None): no git `remote`, no default DVC remote (the experiments' metrics and models travel
    through it), the commit not on `remote`, or, for a worker, another commit or uncommitted
    changes (`dvc exp run` would take them into the experiment)."""
    if subprocess.run(
        ["git", "remote", "get-url", remote], cwd=root, capture_output=True
    ).returncode:
        return f"{root} has no git remote {remote!r}: `git remote add {remote} URL` (the experiments travel through it)"
    default = dvc_waiting(root, "remote", "default", doing="finding the DVC remote", timeout_s=300)
    if not default.strip():
        return f"{root} has no default DVC remote: `dvc remote add -d NAME URL` (the experiments' metrics and models travel through it)"
    head = git(root, "rev-parse", "HEAD").strip()
    if commit is None:
        git(root, "fetch", "-q", remote)  # only its branches: another remote's do not count
        if not git(root, "branch", "-r", "--contains", head, "--list", f"{remote}/*").strip():
            return f"commit {head[:8]} is not on {remote}: `git push {remote}` first (every worker needs it)"
        return None
    if head != commit:
        return (
            f"{root} is at commit {head[:8]}, the sweep's is {commit[:8]}: every worker's "
            "checkout needs the sweep's commit (`git pull` there)"
        )
    if changed := uncommitted(root):
        return (
            f"{root} has uncommitted changes ({', '.join(changed[:3])}): a sweep's experiment runs "
            "the commit alone (commit or `git stash` them there)"
        )
    return None


def dvc_waiting(root: Path, *args: str, doing: str, timeout_s: float) -> str:
    """`dvc ARGS`, waiting out (up to `timeout_s`) another dvc that holds the repository (a
    `dvc status` takes its lock too) instead of failing on it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return dvc(root, *args, doing=doing, timeout_s=timeout_s)
        except DvcBusy:
            if time.monotonic() > deadline:
                raise
            runner.wait_until_free(root, timeout_s=max(deadline - time.monotonic(), 1))


def push_experiment(root: Path, name: str, remote: str, timeout_s: float) -> None:
    """`dvc exp push`: the experiment's commit to the git remote, its outputs to the DVC remote;
    an experiment already there under the name, other than this one, fails it."""
    out = dvc_waiting(
        root, "exp", "push", remote, name, doing=f"pushing {name} to {remote}", timeout_s=timeout_s
    )
    if "diverged" in out:  # DVC says so and exits 0
        raise StageFailed(
            f"{remote} has another experiment named {name}: not pushed ({out.strip()})"
        )


def pull_experiments(root: Path, names: list[str], remote: str, timeout_s: float) -> None:
    if names:
        doing = f"pulling the sweep from {remote}"
        dvc_waiting(root, "exp", "pull", remote, *names, doing=doing, timeout_s=timeout_s)
