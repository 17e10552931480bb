"""The orchestration package's own logic, in process and fast: no Prefect server, no pipeline
run. What each module decides on its own (a sweep's table and its rounding, which experiment a
stop leaves `not run`, when a spread experiment counts as lost, which checkout may take part in
a spread sweep, which stage is retried, what the command lines refuse) is pinned here on tiny
real inputs: git repositories in `tmp_path`, DVC's own answers, real processes and signals. The
slow tests (test_flows) drive the same code through real flow runs against a Prefect server; the
two marked slow here do so for the spread heartbeat alone (the session's server; 30 s and about
4 minutes: Prefect's flow-run heartbeats come 30 s apart at the least).

Flows and tasks are called through `.fn` only where that path asks no server; the run logger is
Prefect's own null logger there (`disable_run_logger`)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from uuid import uuid4

import pytest
from prefect.client.schemas.objects import FlowRun
from prefect.logging import disable_run_logger
from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings
from prefect.states import (
    Cancelled,
    Cancelling,
    Completed,
    Crashed,
    Failed,
    Pending,
    Running,
    Scheduled,
)

from orchestration import experiments, in_turn, queued, record, reproduce, server, spread, sweep
from tests.helpers import ROOT, commit, python_path, sh
from visionflow.ops.repo import DvcBusy, StageFailed
from visionflow.ops.runner import workspace_lock

METRICS = "results/evaluate/metrics.json"


def project_folder(root: Path, params: str = "train:\n  lr: 0.001\n") -> Path:
    """The least a DVC project needs for the flows to find it and for `preflight` to pass:
    `.dvc/tmp`, a dvc.yaml with no stages, a params.yaml."""
    (root / ".dvc" / "tmp").mkdir(parents=True)
    (root / "dvc.yaml").write_text("stages: {}\n")
    (root / "params.yaml").write_text(params)
    return root


def params_of(tree: dict) -> dict:
    return {"params.yaml": {"data": tree}}


def revision(name: str, params: dict, metrics: dict | None) -> dict:
    data = {"params": params_of(params), "metrics": {METRICS: {"data": metrics}} if metrics else {}}
    return {"rev": "0" * 40, "name": name, "data": data, "error": None, "experiments": None}


# `dvc exp show --json` (DVC 3.67) on a baseline with two experiments of a sweep: e1 done (no
# executor), e2 running in DVC's queue (its metrics are still the baseline's); the sweep's e3
# has no record (it failed before DVC kept one). Trimmed to the fields the sweep reads.
EXP_SHOW = [
    {
        **revision("main", {"train": {"lr": 0.001, "epochs": 2}}, {"accuracy": 0.5}),
        "experiments": [
            {
                "name": "e1",
                "executor": None,
                "revs": [
                    revision(
                        "e1",
                        {"train": {"lr": 0.003, "epochs": 2}},
                        {"accuracy": 0.7722222222222223, "macro_f1": 0.61},
                    )
                ],
            },
            {
                "name": "e2",
                "executor": {"state": "running", "name": "dvc-task", "local": {"pid": 4242}},
                "revs": [revision("e2", {"train": {"lr": 0.001, "epochs": 3}}, {"accuracy": 0.5})],
            },
        ],
    }
]


class RecordedPoll(sweep.Poll):
    """A sweep's poll that reads DVC's recorded answer (EXP_SHOW) instead of asking DVC."""

    def exp_show(self, patience_s: float) -> list:
        return json.loads(json.dumps(EXP_SHOW))


def a_plan(root: Path, experiments: dict[str, list[str]]) -> sweep.Plan:
    return sweep.Plan(root, experiments, timeout_s=60, poll=RecordedPoll(root))


def test_each_override_is_one_set_param_whatever_its_value_holds():
    sets = ["train.lr=1e-3", "prepare.formats=[PNG, JPEG]"]
    assert sweep.exp_run_args("sweep-1", sets) == [
        *("exp", "run", "--name", "sweep-1"),
        *("--set-param", "train.lr=1e-3", "--set-param", "prepare.formats=[PNG, JPEG]"),
    ]
    assert sweep.exp_run_args("sweep-2", []) == ["exp", "run", "--name", "sweep-2"]


def test_a_failed_experiment_is_told_by_its_error_line_not_dvcs_sign_off():
    sign_off = "Having any troubles? Hit us up at https://dvc.org/support, we are always happy!\n\n"
    stage = "Running stage 'train':\nepoch 1\nerror: train.lr must be a number, got 'fast'\n"
    assert sweep.failure_line(stage + sign_off) == "error: train.lr must be a number, got 'fast'"
    dvc = "ERROR: failed to reproduce 'train': failed to run: python -m pipeline.train, exited 1"
    assert sweep.failure_line(f"epoch 1\n{dvc}\n{sign_off}") == dvc
    both = f"{stage}{dvc}\n{sign_off}"  # the stage's reason, not DVC's line naming the stage
    assert sweep.failure_line(both) == "error: train.lr must be a number, got 'fast'"
    assert sweep.failure_line("Killed\n  \n") == "Killed"  # no error line: the last one
    assert sweep.failure_line("") == ""


def test_a_sweeps_e_strings_reach_dvc_as_its_set_param_forms_each_whole(tmp_path, monkeypatch):
    """`-e "train.epochs=3 +train.new_key=1"` set train.epochs to "3 +train.new_key=1" (and so
    with `file:key=`, `~key`, `++key`): the command now passes each of DVC's `-S` forms on as
    it was written, a value with spaces or quotes whole."""
    given = []

    def flow(root, overrides, **options):
        given.append(overrides)
        return Completed(data=[])

    monkeypatch.setattr(experiments, "experiments", flow)
    sweep_of = [
        ("train.epochs=1 ++train.lr=2e-3", ["train.epochs=1", "++train.lr=2e-3"]),
        (
            "params.yaml:train.epochs=3  +train.new_key=1 ~train.note ~train.old=2",
            ["params.yaml:train.epochs=3", "+train.new_key=1", "~train.note", "~train.old=2"],
        ),
        ("conf/b.yaml:++train.lr=1 train.epochs=2", ["conf/b.yaml:++train.lr=1", "train.epochs=2"]),
        (
            "prepare.formats=[PNG, JPEG] train.note='a b=c' train.lr=1e-3",
            ["prepare.formats=[PNG, JPEG]", "train.note='a b=c'", "train.lr=1e-3"],
        ),
    ]
    argv = [arg for text, _ in sweep_of for arg in ("-e", text)]
    monkeypatch.setattr(sys, "argv", ["experiments", str(project_folder(tmp_path)), *argv])
    experiments.main()
    assert given == [[sets for _, sets in sweep_of]]
    assert sweep.exp_run_args("sweep-1", given[0][0]) == [
        *("exp", "run", "--name", "sweep-1"),
        *("--set-param", "train.epochs=1", "--set-param", "++train.lr=2e-3"),
    ]


def test_overrides_read_as_dvc_reads_them_and_name_the_param_without_its_file_or_prefix():
    sets = ["train.lr=1e-3", "train.model=simple_cnn", "params.yaml:train.epochs=3"]
    assert sweep.overrides(sets) == {
        "train.lr": 0.001,
        "train.model": "simple_cnn",
        "train.epochs": 3,
    }
    sets = ["++train.lr=2e-3", "+train.new_key=x", "p.yaml:++train.epochs=1", "~train.note"]
    assert sweep.overrides(sets) == {  # a deleted param reads as one the experiment lacks
        "train.lr": 0.002,
        "train.new_key": "x",
        "train.epochs": 1,
        "train.note": None,
    }


def test_an_ended_experiment_gives_its_main_metrics_as_dvc_exp_show_prints_them():
    done = {"state": "success", "metrics": {METRICS: {"data": {"accuracy": 0.7722222222222223}}}}
    assert sweep.five_digits(0.7722222222222223) == 0.77222
    assert sweep.five_digits(3) == 3 and sweep.five_digits(None) is None
    assert sweep.main_metrics(done) == "accuracy=0.77222"  # macro_f1 missing: not said
    with disable_run_logger():
        result = sweep.experiment_result("e1", done)
        failed = sweep.experiment_result("e2", {"state": "failed"}, " (see its log)")
    assert result == {"experiment": "e1", "state": "success", "accuracy": 0.77222, "macro_f1": None}
    assert failed.is_failed() and failed.message == "e2: failed (see its log)"


# `dvc metrics show --json`, `dvc metrics diff --json` and `dvc params diff --json` (DVC 3.67.1) of
# a one-stage project after `evaluate.top_k` went from 3 to 2 in params.yaml and `train.lr` from
# 0.01 to 0.001 in other.yaml, and the stage wrote one more metric; its metrics file renamed.
SHOWN = {"": {"data": {METRICS: {"data": {"accuracy": 0.7722222222222223, "top_k_acc": 0.91,
                                          "per_class": {"cat": 0.3333333333333333}}}}}}  # fmt: skip
METRICS_DIFF = {METRICS: {
    "absent_classes": {"old": None, "new": 1},
    "top_k_acc": {"old": 0.91, "new": 0.9066666666666667, "diff": -0.0033333333333332993},
}}  # fmt: skip
PARAMS_DIFF = {
    "params.yaml": {"evaluate.top_k": {"old": 3, "new": 2, "diff": -1}},
    "other.yaml": {"train.lr": {"old": 0.01, "new": 0.001, "diff": -0.009000000000000001}},
}


def test_the_metrics_artifacts_round_as_the_sweep_table_and_name_the_params_behind_a_change():
    """Before, the metrics table showed 0.7722222222222223 and the diff named no param."""
    assert reproduce.metric_rows(SHOWN) == [
        {"file": METRICS, "metric": "accuracy", "value": 0.77222},  # as sweep.five_digits
        {"file": METRICS, "metric": "top_k_acc", "value": 0.91},
        {"file": METRICS, "metric": "per_class.cat", "value": 0.33333},
    ]
    assert reproduce.diff_markdown(METRICS_DIFF, PARAMS_DIFF).split("\n\n") == [
        "## Metrics diff (workspace vs HEAD)",
        "Params changed against the last commit: `evaluate.top_k` 3 -> 2, "
        "`other.yaml:train.lr` 0.01 -> 0.001",
        "| file | metric | HEAD | workspace | change |\n| --- | --- | --- | --- | --- |\n"
        f"| {METRICS} | absent_classes | absent | 1 | absent |\n"
        f"| {METRICS} | top_k_acc | 0.91 | 0.90667 | -0.0033333 |",
    ]
    assert reproduce.diff_markdown({}, {}).split("\n\n")[1:] == [
        "Params changed against the last commit: none",
        "no metric changed against the last commit",
    ]


def test_a_poll_reads_each_experiments_state_and_one_dvc_has_no_record_of_as_failed(tmp_path):
    found = RecordedPoll(tmp_path).results(["e1", "e2", "e3"])
    assert [found[name]["state"] for name in ("e1", "e2", "e3")] == ["success", "running", "failed"]
    assert found["e2"]["pid"] == 4242 and found["e2"]["metrics"] == {}  # the baseline's: none
    assert found["e1"]["metrics"][METRICS]["data"]["macro_f1"] == 0.61


def test_the_sweep_table_has_the_params_that_differ_and_a_failed_ones_overrides(tmp_path):
    plan = a_plan(  # each column named by the param, whatever form of `-S` set it
        tmp_path,
        {"e1": ["++train.lr=3e-3"], "e2": ["train.epochs=3"], "e3": ["params.yaml:+train.lr=1e-2"]},
    )
    nothing = {"accuracy": None, "macro_f1": None}
    assert sweep.sweep_table(plan) == [
        {"experiment": "e1", "state": "success", "train.epochs": None, "train.lr": 0.003}
        | {"accuracy": 0.77222, "macro_f1": 0.61},
        {"experiment": "e2", "state": "running", "train.epochs": 3, "train.lr": None} | nothing,
        {"experiment": "e3", "state": "failed", "train.epochs": None, "train.lr": 0.01} | nothing,
    ]


def test_a_stopped_in_turn_sweep_marks_the_one_stopped_and_those_after_it_not_run(tmp_path):
    plan = a_plan(tmp_path, {"e1": [], "e2": [], "e3": [], "e4": []})
    rows = [{"experiment": name, "state": "failed"} for name in ("e1", "e2", "e3", "e4")]
    rows[0]["state"] = "success"
    marked = in_turn.marked_stopped(rows, plan, "e2")
    assert [row["state"] for row in marked] == ["success", "stopped", "not run", "not run"]


def test_the_holder_record_names_this_process_while_held_and_goes_with_it(tmp_path):
    root = project_folder(tmp_path)
    held = record.record_file(root)
    held.write_text("{half a record")  # a holder killed while writing it: no run to mark
    with pytest.raises(RuntimeError), record.record_holder(root):
        assert json.loads(held.read_text()) == {"flow_run_id": "", "pid": os.getpid()}
        raise RuntimeError("the run failed")
    assert not held.exists()
    assert not record.deployed()  # called here, not in a deployment's run
    stopped = record.stopped_run("stopped by SIGINT")
    assert stopped.is_cancelled() and stopped.message == "stopped by SIGINT"


def test_a_stage_is_retried_only_when_another_dvc_held_the_repository():
    busy = Failed(data=DvcBusy("another dvc holds the lock of /p"))
    assert reproduce.only_when_busy(None, None, busy)
    assert not reproduce.only_when_busy(None, None, Failed(data=StageFailed("stage train failed")))
    assert not reproduce.only_when_busy(None, None, Completed(data=True))


def test_reproduce_with_if_busy_skip_ends_at_once_while_another_run_holds_it(tmp_path):
    root = project_folder(tmp_path)
    with workspace_lock(root, wait=False) as held, disable_run_logger():
        assert held
        state = reproduce.reproduce.fn(str(root), if_busy="skip")
    assert state.is_completed() and state.name == "Skipped" and state.result() == []


@pytest.mark.parametrize(
    "command, argv, said",
    [
        (reproduce, ["--if-busy", "never"], "invalid choice: 'never'"),
        (reproduce, ["--interval", "60"], "schedule the served deployments: add --serve"),
        (reproduce, ["--cron", "0 * * * *"], "schedule the served deployments: add --serve"),
        (reproduce, ["--deployment", "reproduce/x"], "names what --watch starts: add --watch"),
        (reproduce, [], "is not inside a DVC project (no .dvc folder here or above)"),
        (experiments, [], "the following arguments are required: -e/--experiment"),
        (experiments, ["-e", "a=1", "--workers", "2", "--spread"], "not allowed with argument"),
        (experiments, ["-e", "a=1", "--timeout", "soon"], "invalid float value: 'soon'"),
        (experiments, ["-e", "a=1"], "is not inside a DVC project (no .dvc folder here or above)"),
    ],
)
def test_each_command_refuses_bad_arguments_in_one_line(
    tmp_path, monkeypatch, capsys, command, argv, said
):
    monkeypatch.setattr(sys, "argv", [command.__name__, str(tmp_path), *argv])
    with pytest.raises(SystemExit) as ended:
        command.main()
    assert said in capsys.readouterr().err + str(ended.value.code)


def test_a_sweep_is_refused_in_one_line_before_any_experiment_runs(tmp_path):
    """A project DVC would choke on, or a spread sweep from a checkout with no git remote, ends
    the sweep Failed with the line that says what to do, and no experiment runs."""
    broken = project_folder(tmp_path / "broken", params="train: [lr\n")
    fine = project_folder(tmp_path / "fine")
    sh(fine, "git", "init", "-q")
    overrides = [["train.lr=1e-3"]]
    with disable_run_logger():
        refused = experiments.experiments.fn(str(broken), overrides)
        spread_out = experiments.experiments.fn(str(fine), overrides, spread=True)
    assert refused.is_failed() and str(broken / "params.yaml") in refused.message
    assert spread_out.is_failed()
    assert spread_out.message.startswith(f"{fine} has no git remote 'origin': `git remote add")
    assert experiments.table_of(Cancelled()) == []  # stopped before its run began: no table


def test_the_commands_give_prefects_temporary_server_time_to_start_unless_told_otherwise(
    tmp_path, monkeypatch
):
    """Without PREFECT_API_URL, a command's flow run starts Prefect's temporary server, which got
    20 s: on a busy machine it failed every time. The commands give it STARTUP_TIMEOUT_S, unless
    the setting is set (here as a profile or the environment would set it)."""
    root = project_folder(tmp_path)
    waits = []

    def flow(*args, **options):
        waits.append(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
        return Completed(data=[])

    monkeypatch.setattr(experiments, "experiments", flow)
    monkeypatch.setattr(reproduce, "reproduce", flow)
    monkeypatch.setattr(sys, "argv", ["experiments", str(root), "-e", "train.lr=1e-3"])
    experiments.main()
    with temporary_settings(updates={PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 7}):
        experiments.main()
    monkeypatch.setattr(sys, "argv", ["reproduce", str(root)])
    with pytest.raises(SystemExit) as ended:
        reproduce.main()
    assert ended.value.code == 0
    assert waits == [server.STARTUP_TIMEOUT_S, 7, server.STARTUP_TIMEOUT_S]
    assert PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value() == 20  # Prefect's, as it was


@pytest.mark.parametrize("command", [["experiments", "-e", "train.lr=1e-3"], ["reproduce"]])
def test_a_temporary_prefect_server_that_does_not_start_is_one_line_that_says_what_to_do(
    tmp_path, command
):
    """Prefect's own error was a traceback ending in `RuntimeError: Timed out while attempting to
    connect to ephemeral Prefect API server.` A server given 0 s never answers in time."""
    root = project_folder(tmp_path / "project")
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    env |= {  # no PREFECT_API_URL: Prefect's own default profile, a temporary server
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "0",  # the user's: kept
        "PYTHONPATH": python_path(ROOT),
    }
    [module, *args] = command
    result = subprocess.run(
        [sys.executable, "-m", f"orchestration.{module}", str(root), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # an upper bound: it ends within seconds
    )
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert said == [
        "error: Prefect's temporary server did not start in 0 s (a busy machine?): run `prefect "
        "server start` in another terminal and `prefect config set "
        "PREFECT_API_URL=http://127.0.0.1:4200/api`, or raise "
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
    ]


def a_flow_run(state, **labels) -> FlowRun:
    return FlowRun(id=uuid4(), flow_id=uuid4(), name="e1", labels=labels, state=state)


def test_a_spread_experiment_is_given_up_on_only_after_its_stated_silence():
    """Lost: running with its latest heartbeat (an event's id) unchanged for lost_after_s;
    Pending (a worker took it) and not started in STARTUP_S; Scheduled while no worker of the pool was online for
    lost_after_s (before, one no worker took, or one a dead worker left Pending, was waited on
    for good). Each on the sweep's own clock, restarted by any beat or change of state."""
    beats, where = {}, "worker-2:/srv/checkout"
    running = a_flow_run(Running(), **{spread.RAN_ON: where})
    assert not spread.gave_up("e1", running, "beat-1", beats, 60, 0)  # first seen: clock starts
    mark, seen_at = beats["e1"]
    beats["e1"] = (mark, seen_at - 100)  # the same count, 100 s ago on this process's clock
    assert not spread.gave_up("e1", running, "beat-1", beats, 600, 0)
    assert spread.gave_up("e1", running, "beat-1", beats, 60, 0) == (
        f"no heartbeat for 60 s: its worker or machine was lost ({where})"
    )
    assert not spread.gave_up("e1", running, "beat-2", beats, 60, 0)  # it beat: clock restarted
    assert beats["e1"][1] >= seen_at

    worker = {"prefect.worker.name": "ProcessWorker 1a2b"}
    pending = a_flow_run(Pending(), **worker)
    assert not spread.gave_up("e2", pending, None, beats, 60, 0)
    beats["e2"] = (beats["e2"][0], beats["e2"][1] - 100)  # a slow start is no loss
    assert not spread.gave_up("e2", pending, None, beats, 60, 0)
    beats["e2"] = (beats["e2"][0], beats["e2"][1] - spread.STARTUP_S)
    assert spread.gave_up("e2", pending, None, beats, 60, 0) == (
        f"left Pending for {spread.STARTUP_S:.0f} s: the worker that took it (ProcessWorker "
        "1a2b) was lost before it started"
    )
    started = a_flow_run(Running(), **worker)  # Pending long, then running: its clock restarts
    assert not spread.gave_up("e2", started, None, beats, 60, 0)

    scheduled = a_flow_run(Scheduled())
    assert not spread.gave_up(
        "e3", scheduled, None, beats, 60, 59, "visionflow"
    )  # a worker was online
    assert spread.gave_up("e3", scheduled, None, beats, 60, 61, "visionflow") == (
        "no worker of pool visionflow online for 60 s to take it "
        "(`prefect worker start --pool visionflow`)"
    )
    assert not spread.gave_up("e4", a_flow_run(Completed()), None, beats, 60, 600)
    cancelling = a_flow_run(Cancelling())  # stopped by hand, and its worker is dead: not
    assert not spread.gave_up("e5", cancelling, "beat-3", beats, 60, 0)  # waited on
    beats["e5"] = (beats["e5"][0], beats["e5"][1] - 100)  # for good
    assert spread.gave_up("e5", cancelling, "beat-3", beats, 60, 0).startswith(
        "cancelled, and no heartbeat"
    )


LOST_AFTER_S = spread.LEAST_LOST_AFTER_S  # the sweep's --lost-after here: 60 s, the least
BEAT_S = spread.beat_s(LOST_AFTER_S)  # Prefect's heartbeats 30 s apart, the least it sends
WITHIN_S = LOST_AFTER_S + BEAT_S  # the server's automation: one beat after the sweep


def parents_look(client, run_id, beats: dict) -> FlowRun:
    """What the sweep does with a child each time it looks (`wait_for_children`): read the flow
    run and its latest heartbeat from the server, and give up on it (cancel it, its row crashed)
    when it is silent."""
    run = client.read_flow_run(run_id)
    watch = run.state.is_running() or run.state.is_cancelling()
    beat = spread.last_beat(client, run_id) if watch else None
    if why := spread.gave_up(run.name, run, beat, beats, LOST_AFTER_S, 0):
        spread.give_up(client, run, why)
    return run


# An experiment's flow run on a machine of its own: Prefect's engine beats (every
# PREFECT_FLOWS_HEARTBEAT_FREQUENCY) while the run runs, until the machine dies (SIGKILL).
BEATING = """
import sys, time
from prefect import flow, runtime, tags
from prefect.client.orchestration import get_client

@flow(name="beating-experiment", flow_run_name="beating-{where}")
def beating(where):
    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(runtime.flow_run.id, {"visionflow.ran-on": where})
    time.sleep(3600)

with tags(sys.argv[2]):
    beating(sys.argv[1])
"""


def server_run(client, name: str) -> FlowRun | None:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    named = FlowRunFilter(name=FlowRunFilterName(any_=[name]))
    return next(iter(client.read_flow_runs(flow_run_filter=named)), None)


def wait_for_state(client, run_id, is_it, bound_s: float = 300) -> FlowRun:
    """The flow run once `is_it(state)`; `bound_s` is an upper bound only: nothing is timed."""
    deadline = time.monotonic() + bound_s
    while not is_it((run := client.read_flow_run(run_id)).state):
        assert time.monotonic() < deadline, f"{run.name} still {run.state}"
        time.sleep(1)
    return run


@pytest.mark.slow  # the session's Prefect server; seconds
def test_sweeps_started_at_once_keep_one_silent_runs_automation_and_a_paused_one_is_said(
    prefect_server,
):
    """Two sweeps started at once each find no automation and each make one: the next look keeps
    the one of least id (the same for both) and deletes the other. One a user paused stays
    paused, and the sweep says so, naming the command that resumes it."""
    from prefect.client.orchestration import get_client

    within = 4321  # an automation of its own: the heartbeat test's is WITHIN_S's
    tag = spread.crash_silent_runs(within)
    name = f"visionflow {within} s silent: crash runs tagged {tag}"
    with get_client(sync_client=True) as client:
        (first,) = client.read_automations_by_name(name)
        twin = spread.silent_runs_automation(name, within, tag).create().id  # the other sweep's
        said = []
        assert spread.crash_silent_runs(within, said.append) == tag
        (kept,) = client.read_automations_by_name(name)
        assert (kept.id, said) == (min(first.id, twin, key=str), [])
        gone = {first.id, twin} - {kept.id}
        spread.delete_automations(client, list(gone))  # the other sweep's delete: no error
        client.pause_automation(kept.id)
        assert spread.crash_silent_runs(within, said.append) == tag
        assert len(said) == 1 and f"`prefect automation resume '{name}'`" in said[0], said
        assert not client.read_automation(kept.id).enabled  # left as the user set it


@pytest.mark.longest  # mostly waiting: started first, beside the tests that compute
@pytest.mark.slow  # the session's Prefect server; about 4 minutes: Prefect's beats are 30 s apart at the least
def test_a_silent_spread_experiment_is_given_up_on_by_the_sweep_and_crashed_by_the_server(
    prefect_server,
):
    """Prefect's own flow-run heartbeats, from the run's process: the sweep, judging by the
    latest heartbeat event alone, calls two runs alive for longer than the server's automation
    waits (`crash_silent_runs`) while they beat. Then both machines die (SIGKILL): the watched
    one is given up on (`lost_after_s`: Cancelling, its row crashed, saying where it ran), and
    the server marks the unwatched one Crashed with no sweep ever looking at it (the cancelled
    one it leaves to the sweep's give-up: the automation forces no state)."""
    from prefect.client.orchestration import get_client

    tag = spread.crash_silent_runs(WITHIN_S)
    assert spread.crash_silent_runs(WITHIN_S) == tag  # made once: found again by its name
    from prefect.settings import PREFECT_API_URL

    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        spread.BEAT_SETTING: str(BEAT_S),
    }
    wheres = {side: f"{side}:{uuid4().hex[:8]}" for side in ("watched", "unwatched")}
    machines = {
        side: subprocess.Popen(
            [sys.executable, "-c", BEATING, where, tag], env=env, start_new_session=True
        )
        for side, where in wheres.items()
    }
    try:
        with get_client(sync_client=True) as client:
            runs = {}
            deadline = time.monotonic() + 300  # upper bounds only: nothing here is timed
            while len(runs) < 2 or not all(run.state.is_running() for run in runs.values()):
                assert time.monotonic() < deadline, runs
                found = {side: server_run(client, f"beating-{w}") for side, w in wheres.items()}
                runs = {side: run for side, run in found.items() if run}
                time.sleep(1)
            watched, unwatched = runs["watched"].id, runs["unwatched"].id
            beats, seen = {}, set()  # alive past the automation's wait, by its beats alone
            watched_from = time.monotonic()
            while time.monotonic() - watched_from <= WITHIN_S + 10:
                run = parents_look(client, watched, beats)
                assert not run.state.is_final(), f"lost while it beat: {run.state.message}"
                assert client.read_flow_run(unwatched).state.is_running()
                seen.add(spread.last_beat(client, watched))
                time.sleep(1)
            assert len(seen - {None}) >= 3, seen  # one at the start, then every BEAT_S
            for machine in machines.values():  # both machines die
                os.killpg(machine.pid, signal.SIGKILL)
                machine.wait()
            deadline = time.monotonic() + 300
            while not run.state.is_final():
                assert time.monotonic() < deadline, f"still alive, beats {beats}"
                run = parents_look(client, watched, beats)
                time.sleep(1)
            where = wheres["watched"]
            why = f"no heartbeat for {LOST_AFTER_S:.0f} s: its worker or machine was lost ({where})"
            assert (run.state.name, run.state.message) == ("Crashed", why)  # its row
            cancelling = client.read_flow_run(watched).state  # its worker, if alive, stops it
            assert (cancelling.is_cancelling(), cancelling.message) == (True, why)
            # the unwatched one: the server crashes it, no sweep ever looking at it
            server_says = f"no heartbeat for {WITHIN_S} s: its worker or machine was lost"
            crashed = wait_for_state(client, unwatched, lambda state: state.is_final()).state
            assert (crashed.name, crashed.message) == ("Crashed", server_says)
            # the cancelled one, unforced by the server: the sweep's give-up crashes it
            assert client.read_flow_run(watched).state.is_cancelling()
            ends, lost = {run.name: run}, {run.name: time.monotonic()}
            assert spread.settle_lost(ends, lost, lambda names: [], notice_s=0) == set()
            assert client.read_flow_run(watched).state.name == "Crashed"
        row = spread.where_and_why(ends[run.name])
        assert row == {"ran on": where, "state": "crashed", "why": why}
        pushed = spread.settle_lost(ends, lost, lambda names: names, 0)  # its result reached
        assert pushed == {run.name}  # the remote anyway: it succeeded
        assert spread.where_and_why(ends[run.name], True)["state"] == "success"
    finally:
        for machine in machines.values():
            if machine.poll() is None:
                os.killpg(machine.pid, signal.SIGKILL)
                machine.wait()


def test_a_spread_sweeps_table_says_where_each_ran_and_why_one_did_not_succeed(tmp_path):
    where = {spread.RAN_ON: "worker-2:/srv/checkout"}
    done = a_flow_run(Completed(message="e1 ran on worker-2:/srv/checkout"), **where)
    message = "Flow run encountered an exception: StageFailed: stage train failed (exit 1)"
    failed = a_flow_run(Failed(message=message), **where)
    lost = a_flow_run(Crashed(message="no heartbeat for 60 s: its worker or machine was lost"))
    assert spread.where_and_why(done) == {
        "ran on": where[spread.RAN_ON],
        "state": "success",
        "why": None,
    }
    assert spread.where_and_why(failed)["why"] == "stage train failed (exit 1)"
    assert spread.where_and_why(lost) == {
        "ran on": None,
        "state": "crashed",
        "why": "no heartbeat for 60 s: its worker or machine was lost",
    }
    assert spread.where_and_why(lost, pushed=True) == {  # lost, and its result on the remote
        "ran on": None,
        "state": "success",
        "why": "no heartbeat for 60 s: its worker or machine was lost; it pushed its result anyway",
    }
    plan = a_plan(tmp_path, {f"e{n}": [] for n in range(1, 6)} | {"e1": ["train.lr=3e-3"]})
    plan.experiments["e2"] = ["train.epochs=3"]
    running = {  # the runs not ended, as the server had them at the stop
        "e3": a_flow_run(Running(), **where),
        "e4": a_flow_run(Pending(), **{"prefect.worker.name": "ProcessWorker 1a2b"}),
        "e5": a_flow_run(Scheduled()),
    }
    rows = spread.stopped_rows(plan, {"e1": done, "e2": failed}, running)
    assert [(row["experiment"], row["state"], row["ran on"], row["why"]) for row in rows] == [
        ("e1", "success", where[spread.RAN_ON], None),
        ("e2", "failed", where[spread.RAN_ON], "stage train failed (exit 1)"),
        ("e3", "stopped", where[spread.RAN_ON], "stopped while it ran"),  # it said null
        ("e4", "stopped", None, "stopped before it started on ProcessWorker 1a2b, which took it"),
        ("e5", "stopped", None, "stopped before any worker took it"),
    ]
    assert [(row["train.lr"], row["train.epochs"]) for row in rows[:3]] == [
        (0.003, None),
        (None, 3),
        (None, None),
    ]


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A git checkout with one commit, a bare repository as its remote `origin`, and a DVC
    folder with no DVC remote yet."""
    sh(tmp_path, "git", "init", "-q", "--bare", "origin.git")
    root = project_folder(tmp_path / "checkout")
    sh(root, "git", "init", "-q")
    sh(root, "git", "remote", "add", "origin", str(tmp_path / "origin.git"))
    commit(root, "the sweep's commit")
    return root


def with_dvc_remote(root: Path) -> None:
    store = root.parent / "dvc-store"
    (root / ".dvc" / "config").write_text(
        f"[core]\n    remote = store\n['remote \"store\"']\n    url = {store}\n"
    )


def test_a_checkout_without_the_remotes_or_the_pushed_commit_cannot_start_a_spread_sweep(checkout):
    no_git = spread.spread_problem(checkout, "upstream")
    assert no_git.startswith(f"{checkout} has no git remote 'upstream': `git remote add upstream")
    no_dvc = spread.spread_problem(checkout, "origin")
    assert no_dvc.startswith(f"{checkout} has no default DVC remote: `dvc remote add -d NAME URL`")
    with_dvc_remote(checkout)
    head = sh(checkout, "git", "rev-parse", "HEAD").stdout.strip()
    not_pushed = spread.spread_problem(checkout, "origin")
    assert (
        not_pushed
        == f"commit {head[:8]} is not on origin: `git push origin` first (every worker needs it)"
    )
    sh(checkout, "git", "push", "-q", "origin", "HEAD:refs/heads/main")
    assert spread.spread_problem(checkout, "origin") is None


def test_a_lost_experiments_result_is_looked_for_on_the_git_remote(checkout):
    """A lost experiment that came back and pushed succeeded: `dvc exp list` of the remote
    finds it by name (DVC's ref of an experiment of this commit, pushed as `dvc exp push`
    pushes it); one that never pushed is not there."""
    head = sh(checkout, "git", "rev-parse", "HEAD").stdout.strip()
    sh(checkout, "git", "update-ref", f"refs/exps/{head[:2]}/{head[2:]}/sweep-x-1", "HEAD")
    sh(checkout, "git", "push", "-q", "origin", "refs/exps/*:refs/exps/*")
    names = ["sweep-x-1", "sweep-x-2"]
    assert spread.on_remote(checkout, "origin", head, names) == ["sweep-x-1"]
    assert spread.on_remote(checkout, "origin", head, []) == []  # nothing lost: DVC not asked


def test_a_commit_pushed_to_another_remote_is_not_on_the_named_one_for_a_spread_sweep(checkout):
    """The workers clone the named remote: a commit that only another remote of this checkout
    has (its remote-tracking branch here says so) would be refused by every one of them."""
    with_dvc_remote(checkout)
    sh(checkout.parent, "git", "init", "-q", "--bare", "fork.git")
    sh(checkout, "git", "remote", "add", "fork", str(checkout.parent / "fork.git"))
    sh(checkout, "git", "push", "-q", "fork", "HEAD:refs/heads/main")
    head = sh(checkout, "git", "rev-parse", "HEAD").stdout.strip()
    assert sh(checkout, "git", "branch", "-r", "--contains", head).stdout.split() == ["fork/main"]
    assert (
        spread.spread_problem(checkout, "origin")
        == f"commit {head[:8]} is not on origin: `git push origin` first (every worker needs it)"
    )
    assert spread.spread_problem(checkout, "fork") is None
    sh(checkout, "git", "push", "-q", "origin", "HEAD:refs/heads/sweeps")  # any branch of it
    assert spread.spread_problem(checkout, "origin") is None


@pytest.mark.slow  # the session's Prefect server; 30 s: Prefect's heartbeats come 30 s apart
def test_a_spread_experiment_beats_while_it_waits_for_its_checkout(prefect_server, checkout):
    """The experiment flow beats (Prefect's engine, at the pace the sweep sets) from its start
    and on while it waits for its checkout's lock (another run holds it), and says where it
    runs; then its refusal ends it Failed."""
    import fcntl
    import socket

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY

    with_dvc_remote(checkout)
    name = f"waits-{uuid4().hex[:8]}"
    lock = checkout / ".dvc" / "tmp" / "visionflow-run.lock"

    def on_a_worker() -> None:  # as the sweep's job variables set it for the run's process
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: BEAT_S}):
            ended.append(spread.experiment(name, [], "f" * 40, str(checkout), return_state=True))

    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as another run's process holds it
        ended, beats = [], set()
        thread = threading.Thread(target=on_a_worker)
        thread.start()
        try:
            deadline = time.monotonic() + 300  # an upper bound only: nothing here is timed
            with get_client(sync_client=True) as client:
                while len(beats - {None}) < 2:  # one at its start, one BEAT_S later
                    run = server_run(client, name)
                    beats.add(spread.last_beat(client, run.id) if run else None)
                    assert time.monotonic() < deadline, f"no 2nd beat: {beats}"
                    time.sleep(1)
                run = client.read_flow_run(run.id)
            assert run.state.is_running() and not ended
            assert run.labels[spread.RAN_ON] == f"{socket.gethostname()}:{checkout}"
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
            thread.join(120)
    [state] = ended
    assert state.is_failed() and "the sweep's is ffffffff" in state.message, state


def test_a_worker_checkout_at_another_commit_or_with_changes_refuses_the_experiment(checkout):
    with_dvc_remote(checkout)
    head = sh(checkout, "git", "rev-parse", "HEAD").stdout.strip()
    other = spread.spread_problem(checkout, "origin", "f" * 40)
    assert other.startswith(f"{checkout} is at commit {head[:8]}, the sweep's is ffffffff")
    (checkout / "params.yaml").write_text("train:\n  lr: 0.1\n")
    changed = spread.spread_problem(checkout, "origin", head)
    assert changed.startswith(f"{checkout} has uncommitted changes (params.yaml)")
    assert spread.uncommitted(checkout) == ["params.yaml"]


# A stand-in for one experiment's stage: counts the SIGINTs it gets, and says how many when
# SIGTERM ends it (a SIGINT sent before is handled first: signals are taken lowest number first).
COUNTS_SIGINTS = """
import os, signal, time
asked = []
signal.signal(signal.SIGINT, lambda *_: asked.append(1))
# os.write: the signal can land while print("ready") still holds stdout's buffer
signal.signal(signal.SIGTERM, lambda *_: (os.write(1, b"%d\\n" % len(asked)), os._exit(0)))
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def test_a_queued_experiment_is_asked_to_stop_once_so_it_keeps_its_safe_point(tmp_path):
    """A second SIGINT would stop training at once, losing the epoch: a second ask (the process
    that takes over from a killed flow, say) keeps the first ask's time and sends nothing."""
    root = project_folder(tmp_path)
    stage = subprocess.Popen(
        [sys.executable, "-c", COUNTS_SIGINTS], stdout=subprocess.PIPE, text=True
    )
    try:
        assert stage.stdout.readline() == "ready\n"
        first = queued.interrupt(root, {"e1": stage.pid}, print)
        again = queued.interrupt(root, {"e1": stage.pid}, print)
        assert first == again and list(first) == [stage.pid]
        assert queued.alive(stage.pid)
    finally:
        stage.terminate()
        out, _ = stage.communicate(timeout=60)
    assert out == "1\n"
    assert not queued.alive(stage.pid)
    kept = json.loads((root / ".dvc" / "tmp" / "visionflow-sweep-stop.json").read_text())
    assert kept == {str(stage.pid): first[stage.pid]}


def test_only_dvcs_queue_workers_in_this_workspace_are_waited_for(tmp_path):
    here, elsewhere = tmp_path.resolve() / "here", tmp_path.resolve() / "elsewhere"
    here.mkdir(), elsewhere.mkdir()
    sleeping = [sys.executable, "-c", "import time; time.sleep(600)"]
    worker = subprocess.Popen([*sleeping, "queue-worker"], cwd=here)
    other = subprocess.Popen(sleeping, cwd=here)  # not a queue worker
    try:
        assert queued.queue_workers(here) == [worker.pid]
        assert queued.queue_workers(elsewhere) == []
    finally:
        for process in (worker, other):
            process.kill()
            process.wait()


def guards(root: Path) -> list[int]:
    """The processes standing by to stop a queued sweep in `root` if its flow dies, once one
    shows its command line (a process just started may still show its parent's for a moment)."""
    for _ in range(6000):  # the event: the guard's command line; the bound only ends a hang
        found = running_guards(root)
        if found:
            return found
        time.sleep(0.01)
    return []


def running_guards(root: Path) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if queued.STOP_ON_DEATH.encode() in cmdline and str(root).encode() in cmdline:
            found.append(int(pid))
    return found


def test_a_queued_sweep_that_ends_takes_its_guard_with_it_and_stops_nothing(tmp_path):
    root = project_folder(tmp_path)
    with queued.stopped_if_this_process_dies(root, ["e1", "e2"]):
        [guard] = guards(root)
    assert not queued.alive(guard)  # ended and reaped, not left to stop the sweep later
    assert (root / ".dvc" / "tmp" / "visionflow-sweep-guard.log").read_text() == ""


def test_an_override_with_a_quote_not_closed_is_refused_before_any_experiment_runs():
    """`-e "train.model='simple"` ran its experiment, which failed in DVC's parser 15 s later."""
    from orchestration.experiments import input_problems, split_overrides

    sets = [split_overrides("train.epochs=1 train.model='simple"), ["train.note='a b'"]]
    assert input_problems(sets, 0, 60, 60) == [
        'override "train.model=\'simple" has a quote that is not closed'
    ]
    for endless in (float("inf"), 1e300):  # they passed, then ended in a traceback
        [said] = input_problems([], 0, 60, endless)
        assert said.startswith(f"--lost-after is {endless} s: it must be at most 604800")
