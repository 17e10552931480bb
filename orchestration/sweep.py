"""What every mode of a sweep shares: the plan it runs, the outcomes it returns, one experiment's
`dvc exp run` as a task, and what `dvc exp show` says of each experiment (the table).

A sweep is `dvc exp run -S ...` for each list of overrides. Each mode is one module with one
`run(plan, ...) -> Outcomes`, chosen by the `experiments` flow (orchestration/experiments.py):

    in_turn.run(plan)                                   one after another, in this checkout
    queued.run(plan, workers)                           DVC's queue, `workers` at a time
    spread.run(plan, deployment, remote, lost_after_s)  one flow run per experiment on a work pool

Every experiment runs in a temporary copy of a checkout (the workspace stays as it was), and the
outcomes are one row per experiment: its state, the params that differ from the baseline, the
main metrics (MAIN_METRICS).
"""

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, Failed, State

from orchestration.record import deployed
from visionflow.data.files import flatten
from visionflow.ops import repo
from visionflow.ops.leftovers import cleared_line
from visionflow.ops.repo import DvcBusy, DvcHung, StageFailed, dvc, readable
from visionflow.ops.runner import Timeout, dvc_command, run_group

MAIN_METRICS = {"results/evaluate/metrics.json": ("accuracy", "macro_f1")}
FINAL_STATES = ("success", "failed")  # an experiment's states in `dvc exp show` once it ended


@dataclass(frozen=True)
class Plan:
    """A sweep to run: the checkout it starts from, each experiment's name and overrides (in the
    order they run or are sent), the seconds each may take, and the sweep's one `Poll` of DVC
    (so a slow DVC's longer timeout stays for the whole sweep)."""

    root: Path
    experiments: dict[str, list[str]]  # name -> its overrides, e.g. ["train.lr=1e-3"]
    timeout_s: float
    poll: "Poll"


@dataclass
class Outcomes:
    """What a mode's `run` returns: the sweep's table, one row per experiment (`sweep_table`;
    spread adds where each ran and why one did not succeed), and why the sweep ended early
    (a stop, a cancellation), None when every experiment had its turn."""

    rows: list[dict]
    stopped: str | None = None


def exp_run_args(name: str, sets: list[str]) -> list[str]:
    return ["exp", "run", "--name", name, *(arg for item in sets for arg in ("--set-param", item))]


@task(task_run_name="{name}")
def run_experiment(root: Path, name: str, sets: list[str], timeout_s: float) -> dict | State:
    """`dvc exp run --temp` of one experiment, its output in the log; its state and main
    metrics, or a Failed state (a Cancelled one when its deployment's run was cancelled).
    A `dvc` killed before it recorded the end leaves no Running ghost: what it left is cleared
    and said (visionflow.ops.leftovers), here or, if this process was killed first (Prefect's
    runner kills a cancelled run's process after 30 s), by the reaper."""
    logger = get_run_logger()
    logger.info(f"{name} ({' '.join(sets)}): running")
    cmd = [*dvc_command(), *exp_run_args(name, sets), "--temp"]
    clear = [sys.executable, "-m", "visionflow.ops.leftovers", str(root), name]
    try:
        code, tail = run_group(cmd, root, timeout_s, readable(logger.info), not deployed(), clear)
    except Timeout as error:
        return Failed(message=f"{name}: {error}")
    except TerminationSignal:  # that cancellation: the experiment was stopped as every stop is
        return Cancelled(message=f"{name}: stopped by its cancellation")
    finally:
        if line := cleared_line(root, name):  # the group is gone, whatever ended the call
            logger.warning(line)
    if code != 0:
        return Failed(message=f"{name}: failed (exit {code}): {failure_line(tail)}")
    return experiment_result(name, Poll(root, logger.warning).results([name])[name])


def failure_line(tail: str) -> str:
    """The line of a failed `dvc exp run` that says why: the stage's own `error:` line, else
    DVC's `ERROR:` (which follows the stage's and names only the stage), not DVC's sign-off
    ("Having any troubles?")."""
    lines = [line.strip() for line in tail.strip().splitlines() if line.strip()]
    stage = [line for line in lines if line.startswith("error:")]
    dvc = [line for line in lines if line.startswith("ERROR:")]
    return (stage or dvc or lines or [""])[-1]


def experiment_result(name: str, summary: dict, hint: str = "") -> dict | State:
    """An ended experiment's task result: its state and main metrics (said in the log too), or
    a Failed state when it did not succeed (a task's message, with no traceback to read past);
    `hint` ends that message (where its output is)."""
    get_run_logger().info(f"{name}: {summary['state']} {main_metrics(summary)}".rstrip())
    if summary["state"] != "success":
        return Failed(message=f"{name}: {summary['state']}{hint}")
    return {"experiment": name, "state": summary["state"], **metric_values(summary)}


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

    def __init__(self, root: Path, log: Callable[[str], None] = print):
        self.root, self.log = root, log
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
            except DvcHung as error:
                self.timeout_s = min(2 * self.timeout_s, self.MAX_GROWTH * self.first)
                problem = f"{error}; asking again with {self.timeout_s:.0f} s"
            except (StageFailed, DvcBusy) as error:
                problem = str(error).splitlines()[0]
            else:
                self.took = time.monotonic() - start
                if self.took > self.timeout_s / 2:
                    self.log(f"`dvc exp show` took {self.took:.0f} s (the machine is busy)")
                return json.loads(shown or "[]")
            self.took = time.monotonic() - start
            if time.monotonic() + self.RETRY_S > deadline:
                raise StageFailed(f"no answer from DVC in {patience_s:.0f} s: {problem}")
            self.log(f"{problem} (asked again in {self.RETRY_S:.0f} s; the sweep goes on)")
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
        name: five_digits((metrics.get(path) or {}).get("data", {}).get(name))
        for path, names in MAIN_METRICS.items()
        for name in names
    }


def five_digits(value):
    """A number to 5 significant digits; anything else as it is."""
    if isinstance(value, float):
        return float(f"{value:.5g}")
    return value


def main_metrics(summary: dict) -> str:
    values = metric_values(summary)
    return " ".join(f"{name}={value}" for name, value in values.items() if value is not None)


def sweep_table(plan: Plan) -> list[dict]:
    """One row per experiment of the sweep: name, state, the params that differ from its
    baseline (the union over the sweep, so every row has the same columns), the main metrics.
    A failed experiment, whose params DVC does not show, has the overrides it was given."""
    summaries = plan.poll.results(plan.experiments)
    diffs = {}
    for name, summary in summaries.items():
        params = flatten((summary.get("params") or {}).get("params.yaml", {}).get("data", {}))
        base = flatten((summary.get("baseline") or {}).get("params.yaml", {}).get("data", {}))
        diffs[name] = overrides(plan.experiments.get(name, [])) | {
            key: value for key, value in params.items() if base.get(key) != value
        }
    keys = sorted({key for diff in diffs.values() for key in diff})
    rows = []
    for name, summary in summaries.items():
        row = {"experiment": name, "state": summary["state"]}
        row |= {key: diffs[name].get(key) for key in keys}
        rows.append(row | metric_values(summary))
    return rows


def overrides(sets: list[str]) -> dict:
    """`-S` overrides as {param: value}, the param named without the file or the prefix that DVC
    reads ("params.yaml:train.lr=1e-3", "+train.new=1", "++train.lr=1e-3"): "train.lr=1e-3" ->
    {"train.lr": 0.001} (a value that is not JSON stays text); "~train.note" (deleted) ->
    {"train.note": None}, as a param the experiment lacks."""
    found = {}
    for item in sets:
        if ":" in item.partition("=")[0]:  # file.yaml:override, split where DVC splits it
            item = item.partition(":")[2]
        key, _, text = item.partition("=")
        if key.startswith("~"):
            found[key[1:]] = None
            continue
        try:
            found[key.lstrip("+")] = json.loads(text)
        except ValueError:
            found[key.lstrip("+")] = text
    return found
