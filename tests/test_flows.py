"""Prefect flows against a real Prefect server (`prefect server start`, started empty for the
run and shared by its workers), real DVC, a real process worker. Each test works on its own copy
of the session's reproduced project, and reads what its own flow runs published."""

import fcntl
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from uuid import UUID

import pytest
import yaml

from tests.helpers import (
    LATIN,
    ROOT,
    SAFE_POINT_GRACE,
    add_stage,
    commit,
    copy_project,
    dvc_clean,
    note_in_params,
    params_recorded,
    python_path,
    sh,
    write_params,
)
from visionflow.errors import StageFailed

pytestmark = pytest.mark.slow


@pytest.fixture
def project(reproduced_base, tmp_path, prefect_server) -> Path:
    return copy_project(reproduced_base, tmp_path / "project")


def flows_env(**extra: str) -> dict[str, str]:
    """The environment of a flows subprocess: the test server's API, the project importable."""
    from prefect.settings import PREFECT_API_URL

    return {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PYTHONPATH": python_path(ROOT),
        **extra,
    }


def start_flows(project, *args, env=None, **popen) -> subprocess.Popen:
    """`python -m orchestration.reproduce PROJECT ARGS...` in its own session (killable as a
    group)."""
    command = [sys.executable, "-m", "orchestration.reproduce", str(project), *args]
    return subprocess.Popen(command, env=env or flows_env(), start_new_session=True, **popen)


def prefect(*args, timeout=300, **run) -> subprocess.CompletedProcess:
    """The `prefect` CLI against the test server."""
    run.setdefault("env", flows_env())
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **run,
    )


def artifact(key, run_id):
    """The artifact `key` that one flow run published (the server is shared by the workers)."""
    from orchestration.experiments import published

    found = published(key, run_id)
    assert found, f"flow run {run_id} published no {key!r} artifact"
    return found[-1]


# What DVC tells a terminal after it records results: no line a flow's log should carry.
DVC_HINTS = ("To track the changes with git", "To enable auto staging", "git add ", "autostage")


def flow_logs(run_id) -> list:
    """Every log line of one flow run and its task runs, as the server has them (this
    process's unsent lines sent first)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    only_this_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))
    logs = []
    with get_client(sync_client=True) as client:
        while page := client.read_logs(log_filter=only_this_run, limit=200, offset=len(logs)):
            logs += page
    return logs


def assert_readable(logs, *expected: str) -> None:
    """No blank line and none of DVC's git hints; each of `expected` in some line."""
    messages = [log.message for log in logs]
    noise = [m for m in messages if not m.strip() or any(hint in m for hint in DVC_HINTS)]
    assert not noise, noise
    for text in expected:
        assert any(text in m for m in messages), f"no log line has {text!r}"


def assert_one_task_per_experiment(run_id, rows: list[dict]) -> None:
    """A sweep's flow run has one task run per experiment, named after it: Completed, with its
    accuracy in the task's log, when it succeeded; Failed otherwise."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    found = {}
    with get_client(sync_client=True) as client:

        def all_ended() -> bool:  # task runs reach the server as events: wait for the last one
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
            )
            found.clear()
            found.update({run.name: run for run in runs})
            return len(runs) >= len(rows) and all(r.state and r.state.is_final() for r in runs)

        wait_for(all_ended, 60, "a task run per experiment")
    assert sorted(found) == sorted(row["experiment"] for row in rows)
    logs = flow_logs(run_id)
    for row in rows:
        state = found[row["experiment"]].state
        if row["state"] == "success":
            assert state.is_completed(), (row, state)
            said = f"{row['experiment']}: success accuracy={row['accuracy']}"
            task_run = found[row["experiment"]].id
            assert any(log.task_run_id == task_run and said in log.message for log in logs)
        else:
            assert state.is_failed() and row["experiment"] in state.message, (row, state)


def flow_run_id(cli_output: str) -> str:
    """The flow run that `prefect deployment run` created, from its own words."""
    return re.search(r"UUID: ([0-9a-f-]{36})", cli_output).group(1)


def stage_processes(project, module="pipeline.") -> list[int]:
    """Live stage processes working in `project` or in a DVC temporary copy of it."""
    found = []
    for proc in os.listdir("/proc"):
        try:
            cmdline = open(f"/proc/{proc}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            cwd = os.readlink(f"/proc/{proc}/cwd")
        except (OSError, ValueError):
            continue
        if module in cmdline and cwd.startswith(str(project)):
            found.append(int(proc))
    return found


def wait_for(condition, timeout_s=300, what="the condition"):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.fixture
def hold(tmp_path):
    """hold(path): take an exclusive flock on `path` as another process would (a separate open
    file), until the test ends or the returned release() is called."""
    handles = []

    def take(path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
        fcntl.flock(handle, fcntl.LOCK_EX)
        handles.append(handle)
        return handle.close

    yield take
    for handle in handles:
        handle.close()


def test_reproduce_on_a_fresh_server_does_nothing_then_only_what_changed(project):
    """Up to date: no stage runs. A change runs what depends on it, in DVC's order whatever the
    order of the stages in dvc.yaml (DVC reads a graph)."""
    from orchestration.reproduce import reproduce

    spec = yaml.safe_load((project / "dvc.yaml").read_text())
    stages = spec["stages"]
    spec["stages"] = {"export": stages.pop("export"), **stages}  # export written first
    (project / "dvc.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    assert dvc_clean(project)
    assert reproduce(str(project)) == []  # up to date: no stage runs
    write_params(project, {"evaluate": {"top_k": 2}})  # no training: the trained model stays
    state = reproduce(str(project), return_state=True)
    assert state.result() == ["check", "evaluate", "export"]
    run = state.state_details.flow_run_id
    values = [row["value"] for row in json.loads(artifact("metrics", run).data)]
    assert "accuracy" in artifact("metrics", run).data and values
    assert all(v == float(f"{v:.5g}") for v in values if isinstance(v, float))  # as the sweep's
    diff = artifact("metrics-diff", run).data
    assert "results/evaluate/metrics.json | top_k_acc |" in diff
    assert "Params changed against the last commit: `evaluate.top_k` 3 -> 2" in diff, diff
    assert "onnx" in str(artifact("export-parity", run).data)
    assert dvc_clean(project)
    assert_readable(flow_logs(run), "Running stage 'evaluate'", "Updating lock file 'dvc.lock'")


def test_the_cli_exits_75_when_skipped_and_never_imports_torch(project, hold):
    release = hold(project / ".dvc/tmp/visionflow-run.lock")  # another run holds the workspace
    skipped = start_flows(project, "--if-busy", "skip", stdout=subprocess.PIPE, text=True)
    out, _ = skipped.communicate(timeout=120)
    assert skipped.returncode == 75 and json.loads(out) == {"ran": [], "skipped": True}
    visionflow = sh(
        project, sys.executable, "-m", "visionflow.cli", "repro", "--if-busy", "skip", check=False
    )
    assert visionflow.returncode == 75 and "skipped" in visionflow.stderr
    release()
    # every mode finds the project root, or says there is none; `pipeline.flows`, the older name
    # of orchestration.reproduce, runs the same command
    for mode in ("--serve", "--watch"):
        outside = subprocess.run(
            [sys.executable, "-m", "pipeline.flows", str(project.parent), mode],
            env=flows_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert outside.returncode == 1 and "is not inside a DVC project" in outside.stderr
    probe = (  # the CLI, then: was torch ever imported in this process?
        "import runpy, sys\nsys.argv = ['flows', sys.argv[1]]\n"
        "try:\n    runpy.run_module('pipeline.flows', run_name='__main__')\n"
        "finally:\n    print('torch imported:', 'torch' in sys.modules)\n"
    )
    noop = subprocess.run(
        [sys.executable, "-c", probe, str(project)],
        env=flows_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert noop.returncode == 0, noop.stderr[-2000:]
    assert noop.stdout.splitlines() == ['{"ran": [], "skipped": false}', "torch imported: False"]


def test_a_second_run_waits_for_the_first_then_finds_nothing_to_do(project, tmp_path):
    note_in_params(project, "a comment: check alone reruns")
    go = tmp_path / "go"
    env = flows_env(VISIONFLOW_FAULT=f"stage.start@stage=check:pause={go}")
    first = start_flows(project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: stage_processes(project, "pipeline.check"), what="the first run's stage")
    second = start_flows(project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    waited = []
    for line in second.stderr:  # it says so, then blocks on the workspace lock
        waited.append(line)
        if "waiting for it to finish" in line:
            break
    go.touch()
    first_out, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err[-2000:]
    assert json.loads(first_out)["ran"] == ["check"]
    second_out, second_err = second.communicate(timeout=300)
    assert second.returncode == 0, second_err[-2000:]
    assert json.loads(second_out)["ran"] == []  # it waited: then nothing was left to do
    assert "waiting for it to finish" in "".join(waited) and "up to date" in second_err


def test_the_metrics_diff_says_when_no_metric_changed(project):
    from orchestration.reproduce import reproduce

    note_in_params(project, "reruns check alone: no metric changes")
    state = reproduce(str(project), return_state=True)
    assert state.result() == ["check"]
    diff = artifact("metrics-diff", state.state_details.flow_run_id).data
    assert "no metric changed against the last commit" in diff, diff


def test_a_failing_stage_fails_the_flow_once_with_its_error(project):
    from orchestration.reproduce import reproduce

    write_params(project, {"train": {"epochs": "ten"}})
    state = reproduce(str(project), return_state=True)
    assert state.is_failed()
    with pytest.raises(
        Exception,
        match=r"(?s)stage check failed \(exit \d+\).*train.epochs: Input should be a valid integer",
    ) as e:
        state.result()
    assert str(e.value).count("Running stage 'check'") == 1  # failed on its own: not retried
    assert "epochs: ten" not in (project / "dvc.lock").read_text()


def test_a_failed_stage_gets_its_previous_results_back(project, monkeypatch):
    from orchestration.reproduce import reproduce

    metrics = (project / "results/evaluate/metrics.json").read_bytes()
    write_params(project, {"evaluate": {"top_k": 2}})
    monkeypatch.setenv("VISIONFLOW_FAULT", "stage.start@stage=evaluate:raise")
    assert reproduce(str(project), return_state=True).is_failed()
    assert (project / "results/evaluate/metrics.json").read_bytes() == metrics  # dvc checkout


def test_a_silent_stage_past_its_timeout_is_killed_with_its_group(project, monkeypatch, tmp_path):
    from orchestration.reproduce import reproduce

    model = (project / "results/train/model.pt").read_bytes()
    write_params(project, {"train": {"lr": 5e-3}})
    monkeypatch.setenv("VISIONFLOW_FAULT", f"stage.start@stage=train:pause={tmp_path / 'never'}")
    started = time.monotonic()
    state = reproduce(str(project), stage_timeout_s=5, return_state=True)
    took = time.monotonic() - started
    assert state.is_failed() and took < 45, (state, took)  # 5 s, SIGTERM, SIGKILL 5 s later
    with pytest.raises(Exception, match=r"stage train: .*ran past 5 s and was stopped"):
        state.result()
    assert stage_processes(project) == []  # dvc, the stage, everything in its group
    assert (project / "results/train/model.pt").read_bytes() == model  # restored from the cache


def test_a_stage_that_prints_bytes_that_are_not_utf8_runs_to_the_end(project):
    from orchestration.reproduce import reproduce

    add_stage(project, "latin", LATIN, "latin.txt")
    state = reproduce(str(project), return_state=True)
    assert state.is_completed(), state.message
    assert state.result() == ["latin"] and dvc_clean(project)
    assert_readable(flow_logs(state.state_details.flow_run_id), "caf\\xe9")


def test_another_dvc_holding_the_repository_is_waited_out_with_prefect_retries(project, hold):
    from orchestration.reproduce import reproduce

    note_in_params(project, "a comment: check alone reruns")
    release = hold(project / ".dvc/tmp/lock")  # DVC's own lock, as a user's `dvc` holds it
    threading.Timer(7, release).start()  # longer than one retry delay, shorter than all three
    assert reproduce(str(project)) == ["check"]
    assert dvc_clean(project)


def test_a_dvc_lock_taken_while_a_stage_runs_leaves_results_that_match_dvc_lock(
    project, hold, tmp_path, monkeypatch
):
    """DVC lets go of its lock while the stage's command runs; a user's `dvc` that takes it then
    keeps DVC from recording the results. The flow puts the outputs back as dvc.lock records
    them once the lock is free, and Prefect's retry runs the stage again."""
    from orchestration.reproduce import reproduce

    go = tmp_path / "go"
    monkeypatch.setenv("VISIONFLOW_FAULT", f"stage.start@stage=sanity:pause={go}")
    write_params(project, {"sanity": {"per_class": 4}})
    flow = threading.Thread(target=lambda: ran.append(reproduce(str(project), return_state=True)))
    ran = []
    flow.start()
    wait_for(lambda: stage_processes(project, "pipeline.sanity"), what="the stage")
    release = hold(project / ".dvc/tmp/lock")  # taken while the stage runs, held past its end
    go.touch()
    wait_for(lambda: not stage_processes(project, " repro "), what="DVC to give up recording it")
    release()
    flow.join(timeout=600)
    assert ran and ran[0].is_completed(), ran
    assert ran[0].result() == ["check", "sanity"] and dvc_clean(project)


def test_a_fifo_in_the_data_folder_is_named_instead_of_hanging_dvc(project):
    from orchestration.reproduce import reproduce

    fifo = project / "data/raw/pipe.png"
    os.mkfifo(fifo)
    state = reproduce(str(project), return_state=True)
    with pytest.raises(Exception, match=re.escape(f"{fifo} is a FIFO: DVC would hang reading it")):
        state.result()
    visionflow = sh(project, sys.executable, "-m", "visionflow.cli", "repro", check=False)
    assert visionflow.returncode == 1 and f"{fifo} is a FIFO" in visionflow.stderr
    fifo.unlink()


def test_only_dvcs_own_lock_error_makes_a_failed_stage_a_busy_one():
    """A stage whose own output says "Unable to acquire lock" failed on its own: it is not
    retried as if another dvc held the repository (a review found it run four times)."""
    from dvc.lock import FAILED_TO_LOCK_MESSAGE

    from visionflow.ops.repo import lock_refused

    dvc_line = f"ERROR: failed to reproduce 'train': {FAILED_TO_LOCK_MESSAGE}"
    assert lock_refused(f"Running stage 'train':\nepoch 1\n{dvc_line}\n", "train")
    own = "torch.distributed: Unable to acquire lock on /dev/shm/store, giving up\n"
    failed = "ERROR: failed to reproduce 'train': failed to run: python -m pipeline.train, exited 1"
    assert not lock_refused(f"Running stage 'train':\n{own}{failed}\n", "train")
    assert not lock_refused(dvc_line, "evaluate")  # another stage's line is not this one's


def test_a_fifo_made_during_a_run_meets_the_stage_timeout(project, tmp_path, monkeypatch):
    """A FIFO that appears after the first check (made by a stage, say) is left to the stage's
    own `dvc repro`, which the stage timeout ends: never a hang in the flow's process."""
    from orchestration.reproduce import reproduce

    go = tmp_path / "go"
    monkeypatch.setenv("VISIONFLOW_FAULT", f"stage.start@stage=check:pause={go}")
    note_in_params(project, "a comment: check reruns, then prepare is asked")
    flow = threading.Thread(
        target=lambda: ran.append(reproduce(str(project), stage_timeout_s=5, return_state=True)),
        daemon=True,  # a hang fails the test, not the whole run
    )
    ran = []
    flow.start()
    wait_for(lambda: stage_processes(project, "pipeline.check"), what="the check stage")
    os.mkfifo(project / "data/raw/pipe.png")  # a dep of prepare, made while check runs
    go.touch()
    flow.join(timeout=120)
    assert ran and ran[0].is_failed(), ran
    with pytest.raises(Exception, match=r"stage prepare: .*ran past 5 s and was stopped"):
        ran[0].result()


def test_experiments_in_turn_each_start_from_the_baseline_and_leave_the_workspace(project):
    from orchestration.experiments import experiments

    params = (project / "params.yaml").read_text()
    overrides = [["evaluate.top_k=2"], ["train.epochs=0"], ["sanity.per_class=3"]]  # no training:
    state = experiments(str(project), overrides, return_state=True)
    with pytest.raises(Exception, match=r"experiments sweep-\w+-2 did not succeed"):
        state.result()  # check refuses the second one, and the third one still runs
    run = state.state_details.flow_run_id
    rows = json.loads(artifact("experiments", run).data)
    assert [row["state"] for row in rows] == ["success", "failed", "success"]
    keys = ("evaluate.top_k", "train.epochs", "sanity.per_class")  # the failed one's too
    assert [tuple(row[key] for key in keys) for row in rows] == [
        (2, None, None),
        (None, 0, None),
        (None, None, 3),
    ]
    assert rows[1]["accuracy"] is None and all(0 <= rows[i]["accuracy"] <= 1 for i in (0, 2))
    # as `dvc exp show` shows them, 5 significant digits: 0.62222, not 0.6222222222222222
    assert all(rows[i]["accuracy"] == float(f"{rows[i]['accuracy']:.5g}") for i in (0, 2)), rows
    assert (project / "params.yaml").read_text() == params and dvc_clean(project)
    assert_one_task_per_experiment(run, rows)
    assert_readable(flow_logs(run), "Running stage 'evaluate'", "train.epochs: Input should be")


def test_a_sweep_refuses_negative_workers_and_an_override_without_a_value_before_queueing(
    project,
):
    """`--workers -1` queued the experiments and started no DVC worker (`dvc queue start --jobs
    -1` starts none): the sweep waited out its hour. `-e train.lr` ran an experiment bound to
    fail. The CLI refuses both, and so does the flow (a deployment's run has no CLI)."""
    from orchestration.experiments import experiments

    for args, named in (
        (["--workers", "-1", "-e", "train.lr=1e-3"], "workers is -1"),
        (["-e", "train.lr"], "override 'train.lr' is not key=value"),
        (["--timeout", "0", "-e", "train.lr=1e-3"], "timeout is 0.0 s"),
    ):
        result = sh(project, sys.executable, "-m", "orchestration.experiments", *args, check=False)
        assert result.returncode == 2 and named in result.stderr, (args, result.stderr)
    state = experiments(str(project), [["evaluate.top_k=2"]], workers=-1, return_state=True)
    assert (
        state.is_failed()
        and state.message == "workers is -1: 0 runs them in turn, N > 0 N at a time"
    )
    assert sh(project, "dvc", "queue", "status").stdout.startswith("No experiment tasks")
    assert dvc_clean(project)


def test_a_bad_schedule_or_settle_is_one_line_before_anything_is_served(tmp_path):
    """`--serve --interval 0` (or -5, or a bad --cron) ended in Prefect's validation traceback
    once serving began; `--watch --settle -1` was taken."""
    for args, named in (
        (["--serve", "--interval", "0"], "--interval 0: seconds between runs, above 0"),
        (["--serve", "--interval", "-5"], "--interval -5: seconds between runs, above 0"),
        (["--serve", "--cron", "bogus"], "--cron 'bogus' is not a cron schedule"),
        (["--watch", "--settle", "-1"], "--settle -1: quiet seconds, 0 or more"),
    ):
        command = [sys.executable, "-m", "orchestration.reproduce", str(tmp_path), *args]
        env = {**os.environ, "PYTHONPATH": python_path(ROOT)}  # refused before a server is asked
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and named in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_ctrl_c_stops_an_in_turn_sweep_from_its_terminal_and_the_run_ends_cancelled(
    project, tmp_path
):
    """`python -m pipeline.experiments` (the older name of orchestration.experiments, which
    users have) stopped with Ctrl-C in its first experiment's training: that one reaches its
    safe point, the second never runs, the command prints the table and exits 130, and the
    sweep's run on the server is Cancelled (it was Failed, exit 1). The first one's `-e` holds
    two of DVC's `-S` forms, which reach its training each whole (the command glued
    `++train.lr=...` to train.epochs' value, and DVC refused it)."""
    from prefect.client.orchestration import get_client

    params = (project / "params.yaml").read_text()
    at, go = tmp_path / "at", tmp_path / "go"
    env = flows_env(VISIONFLOW_FAULT=AT_EPOCH_2.format(at=at, go=go), **SAFE_POINT_GRACE)
    command = [sys.executable, "-m", "pipeline.experiments", str(project)]
    sweep = subprocess.Popen(
        [*command, "-e", "train.epochs=3 ++train.lr=0.007", "-e", "train.lr=0.008"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    wait_for(at.exists, what="the first experiment's epoch 2")
    sweep.send_signal(signal.SIGINT)
    out, err = sweep.communicate(timeout=300)
    assert sweep.returncode == 130, err[-3000:]
    assert "stopped: sweep stopped by SIGINT during sweep-" in err, err[-3000:]
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(row["state"], row["train.lr"], row["train.epochs"]) for row in rows] == [
        ("stopped", 0.007, 3),
        ("not run", 0.008, None),
    ]
    epoch_1 = [line for line in err.splitlines() if "epoch   1/3 " in line]  # 3 epochs, not 4
    assert epoch_1 and "lr 7.00e-03" in epoch_1[0], err[-3000:]
    with get_client(sync_client=True) as client:
        [run] = [r for r in client.read_flow_runs() if rows[0]["experiment"][6:14] in str(r.id)]
    assert run.state.is_cancelled() and "the rest not run" in run.state.message
    assert not stage_processes(project)
    assert (project / "params.yaml").read_text() == params


@pytest.mark.longest
def test_a_queued_sweep_outlives_polls_that_hang_and_reports_only_itself(project, monkeypatch):
    from orchestration.experiments import experiments
    from orchestration.queued import queue_workers
    from orchestration.sweep import Poll

    # Every `dvc exp show` the sweep asks answers 3 s late, and a poll's first timeout is 1 s:
    # the first asks are ended unanswered, whatever the machine's speed (what stopped sweeps).
    monkeypatch.setattr(Poll, "first_timeout_s", 1.0)
    monkeypatch.setattr(Poll, "MAX_GROWTH", 64)  # 64 s: even a loaded machine answers
    monkeypatch.setattr(Poll, "RETRY_S", 0.5)
    monkeypatch.setenv("VISIONFLOW_FAULT", "sweep.poll:sleep=3")
    overrides = [["train.epochs=0"], ["sanity.per_class=4"]]
    state = experiments(str(project), overrides, workers=2, return_state=True)
    with pytest.raises(Exception, match=r"experiments sweep-\w+-1 did not succeed"):
        state.result()  # the first one is refused by check; the second one still ran
    run_id = state.state_details.flow_run_id
    rows = json.loads(artifact("experiments", run_id).data)
    failed, done = rows
    assert (failed["state"], failed["accuracy"]) == ("failed", None)  # not its baseline's
    assert failed["train.epochs"] == 0  # what it was given, though DVC shows no params for it
    assert done["state"] == "success" and 0 <= done["accuracy"] <= 1
    assert_one_task_per_experiment(run_id, rows)
    said = [log.message for log in flow_logs(run_id)]
    assert any("did not finish in 1 s; asking again with 2 s" in line for line in said), said
    assert not queue_workers(project)  # the sweep stopped DVC's idle worker as it ended
    monkeypatch.delenv("VISIONFLOW_FAULT")
    state = experiments(str(project), [["sanity.per_class=5"]], workers=1, return_state=True)
    rows = state.result()
    assert [(row["state"], row["sanity.per_class"]) for row in rows] == [("success", 5)]
    table = artifact("experiments", state.state_details.flow_run_id).data
    assert len(json.loads(table)) == 1  # this sweep, not the queue's past
    status = sh(project, "dvc", "queue", "status").stdout
    assert "Running" not in status and "Queued" not in status
    assert not queue_workers(project)


WAIT = {"if_busy": "wait"}  # a run started by hand waits for a scheduled one that got there first
# Training says it is at epoch 2 and pauses there; the stop request itself lets it go on.
AT_EPOCH_2 = (
    "train.loss@epoch=2,step=2:touch={at};train.loss@epoch=2,step=2:pause={go};"
    "train.stop:touch={go}"
)
# ... and the rest of epoch 2 takes a while after the stop (longer than DVC's queue worker took
# to die when it was interrupted too)
SLOW_EPOCH_2 = ";train.batch@epoch=2:sleep=2"


def newest_state(project: Path) -> Path:
    """The resumable state folder of the newest training configuration."""
    folders = [p for p in (project / "checkpoints/train").iterdir() if p.is_dir()]
    return max(folders, key=lambda p: p.stat().st_mtime)


def test_a_stage_past_its_timeout_checkpoints_its_epoch_and_the_next_run_resumes(
    project, monkeypatch, tmp_path
):
    """The stage timeout stops training as every stop does: the epoch in progress finishes and
    is checkpointed, DVC lives on, the previous results come back; `dvc repro` resumes it."""
    from orchestration.reproduce import reproduce
    from visionflow import faults

    at, go = tmp_path / "at", tmp_path / "go"
    monkeypatch.setenv("VISIONFLOW_FAULT", AT_EPOCH_2.format(at=at, go=go))
    monkeypatch.setenv("VISIONFLOW_STOP_GRACE_S", "300")
    timer = faults.parse(f"runner.timer:pause={at}")  # the timeout counts once training is there
    monkeypatch.setattr(faults, "FAULTS", timer)
    monkeypatch.setattr(faults, "ACTIVE", True)
    model = (project / "results/train/model.pt").read_bytes()
    write_params(project, {"train": {"lr": 5e-3}})
    state = reproduce(str(project), stage_timeout_s=1, return_state=True)
    with pytest.raises(Exception, match=r"stage train: .*ran past 1 s and was stopped"):
        state.result()
    assert stage_processes(project) == []
    assert (project / "results/train/model.pt").read_bytes() == model  # restored from the cache
    assert (newest_state(project) / "epoch-0002.pt").exists()
    rerun = sh(project, "dvc", "repro", "-s", "train")
    assert "epoch-0002.pt (epoch 2 done)" in rerun.stdout, rerun.stdout


@pytest.mark.longest
def test_a_sweep_whose_flow_process_is_killed_leaves_nothing_running_and_is_marked_crashed(
    project, tmp_path
):
    from prefect.client.orchestration import get_client

    from orchestration.reproduce import reproduce

    sweep = "import sys\nfrom orchestration.experiments import experiments\n"
    sweep += "experiments(sys.argv[1], [['train.lr=0.007']], workers=1)\n"
    at, go = tmp_path / "at", tmp_path / "go"  # the stop comes at epoch 2, which goes on a while
    env = flows_env(
        VISIONFLOW_FAULT=AT_EPOCH_2.format(at=at, go=go) + SLOW_EPOCH_2,
        VISIONFLOW_STOP_GRACE_S="300",  # the stopped stage reaches its safe point
    )
    flow = subprocess.Popen(
        [sys.executable, "-c", sweep, str(project)],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(at.exists, what="the queued training at epoch 2")
    orphan = json.loads((project / ".dvc/tmp/visionflow-flow-run.json").read_text())
    os.kill(flow.pid, signal.SIGTERM)  # the flow stops its sweep...
    wait_for(go.exists, what="the stop asked of the experiment")
    os.kill(flow.pid, signal.SIGKILL)  # ...and is killed meanwhile (Prefect: 30 s after a cancel)
    flow.wait()
    assert reproduce(str(project)) == []  # waits for the guard to stop the sweep, then the work
    assert not stage_processes(project)
    wait_for(lambda: not stage_processes(project, "queue-worker"), 60, "the queue stopped")
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(UUID(orphan["flow_run_id"])).state
    assert state.is_crashed() and "its process died while it held" in state.message
    # The stop reached the experiment's own processes alone, and once (the guard that took over
    # did not ask again: a second SIGINT stops training at once): training reached its safe point, and
    # DVC's worker outlived the experiment, so it recorded the end and removed its copy
    log = sh(project, "dvc", "queue", "logs", f"sweep-{orphan['flow_run_id'][:8]}-1").stdout
    assert "train stopped after epoch 2" in log, log[-2000:]
    status = sh(project, "dvc", "queue", "status").stdout
    assert "Running" not in status, status
    assert not [p for p in (project / ".dvc/tmp/exps").glob("tmp*") if p.is_dir()]


@pytest.mark.longest
def test_served_deployments_run_on_demand_cancel_cleanly_and_stay_scheduled(project, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    at, go = tmp_path / "at", tmp_path / "go"  # training is at epoch 2; it may go on
    env = flows_env(
        VISIONFLOW_FAULT=AT_EPOCH_2.format(at=at, go=go),
        VISIONFLOW_STOP_GRACE_S="300",  # the stopped stage reaches its safe point
        PREFECT_RUNNER_POLL_FREQUENCY="1",  # the served process asks for runs every second
    )
    server = start_flows(
        project,
        "--serve",
        "--interval",
        "3600",
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with get_client(sync_client=True) as client:

            def served():
                try:
                    return bool(client.read_deployment_by_name("experiments/on-demand"))
                except Exception:
                    return False

            wait_for(served, 120, "the served deployments")
            run = prefect(
                "deployment",
                "run",
                "reproduce/scheduled",
                "--params",
                json.dumps(WAIT),
                "--watch",
                timeout=600,
            )
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
            assert "COMPLETED" in (run.stdout + run.stderr).upper()  # up to date: nothing ran

            def cancel(flow_run) -> None:  # as a user would, then wait for the final state
                result = prefect("flow-run", "cancel", str(flow_run.id), timeout=120)
                assert result.returncode == 0, result.stdout + result.stderr
                wait_for(lambda: client.read_flow_run(flow_run.id).state.is_final(), 120)
                assert client.read_flow_run(flow_run.id).state.is_cancelled()

            write_params(project, {"train": {"lr": 6e-3}})  # train pauses: a long training run
            flow_run = run_deployment("reproduce/scheduled", timeout=0, parameters=WAIT)
            wait_for(at.exists, what="training at epoch 2")
            cancel(flow_run)  # SIGTERM to the flow run's process: epoch 2 finishes, checkpointed
            wait_for(lambda: not stage_processes(project), 30, "no stage process left")
            assert_stopped_in_one_line(client, flow_run.id, "train")
            assert (project / "results/train/model.pt").exists()  # restored
            assert (newest_state(project) / "epoch-0002.pt").exists()
            rerun = sh(project, "dvc", "repro", "-s", "train")  # the plain command resumes it
            assert "epoch-0002.pt (epoch 2 done)" in rerun.stdout, rerun.stdout

            at.unlink()
            go.unlink()
            sweep = run_deployment(
                "experiments/on-demand",
                timeout=0,
                parameters={"overrides": [["train.lr=0.007"]], "workers": 1},
            )
            wait_for(at.exists, what="queued training at epoch 2")
            cancel(sweep)
            wait_for(lambda: not stage_processes(project), 60, "no experiment process left")
            log = sh(project, "dvc", "queue", "logs", f"sweep-{str(sweep.id)[:8]}-1").stdout
            assert "train stopped after epoch 2" in log, log[-2000:]  # at its safe point
            status = sh(project, "dvc", "queue", "status").stdout  # its end recorded
            assert "Running" not in status, status
            wait_for(lambda: not stage_processes(project, "queue-worker"), 60, "the queue stopped")

            at.unlink()
            go.unlink()  # in turn: the cancelled sweep runs no more experiments (it ran the next)
            sweep = run_deployment(
                "experiments/on-demand",
                timeout=0,
                parameters={"overrides": [["train.lr=0.007"], ["train.lr=0.008"]]},
            )
            wait_for(at.exists, what="the first experiment at epoch 2")
            at.unlink()  # the second one would make it again
            cancel(sweep)
            wait_for(lambda: not stage_processes(project), 60, "no experiment process left")
            tasks = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[sweep.id]))
            )
            assert [t.name for t in tasks] == [f"sweep-{str(sweep.id)[:8]}-1"], tasks
            assert tasks[0].state.is_cancelled() and not at.exists()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("reproduce/scheduled")
    assert not deployment.paused and deployment.schedules  # still scheduled after it stopped


def assert_stopped_in_one_line(client, run_id, stage: str) -> None:
    """A cancelled run's stopped stage: its task Cancelled, one line saying so, no traceback."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    only = FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
    wait_for(
        lambda: any(
            r.state.is_final()
            for r in client.read_task_runs(flow_run_filter=only)
            if r.name == stage
        ),
        60,
        f"the {stage} task's final state",
    )
    task = next(r for r in client.read_task_runs(flow_run_filter=only) if r.name == stage)
    assert task.state.is_cancelled(), task.state
    messages = [log.message for log in flow_logs(run_id)]
    assert not [m for m in messages if "Traceback" in m], messages
    said = [m for m in messages if f"stage {stage} stopped by SIGTERM" in m]
    assert len([m for m in said if not m.startswith("Finished in state")]) == 1, said


def start_worker(workdir: Path, cwd: Path) -> subprocess.Popen:
    """`prefect worker start --pool visionflow --limit 1` for the checkout `workdir` (a machine's
    VISIONFLOW_WORKDIR), started in `cwd`."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefect",
            "worker",
            "start",
            "--pool",
            "visionflow",
            "--limit",
            "1",
        ],
        env=flows_env(VISIONFLOW_WORKDIR=str(workdir), PREFECT_WORKER_QUERY_SECONDS="1"),
        cwd=cwd,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop_worker(worker: subprocess.Popen) -> None:
    os.killpg(worker.pid, signal.SIGTERM)
    try:
        worker.wait(timeout=30)
    except subprocess.TimeoutExpired:  # not seen since the scheduler is off; never hang here
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)


def online_workers() -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        workers = client.read_workers_for_work_pool("visionflow")
    return len([w for w in workers if w.status and w.status.value == "ONLINE"])


def spread_sweep(project: Path, *args: str) -> subprocess.Popen:
    """`python -m orchestration.experiments PROJECT --spread ARGS...`, its output captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "orchestration.experiments", str(project), "--spread", *args],
        env=flows_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def running_experiments(sweep: subprocess.Popen, beats: int) -> dict:
    """The spread experiments running now that sent at least `beats` heartbeats (Prefect's
    events), by name (the sweep still going)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    from orchestration.spread import HEARTBEAT

    def beats_of(client, run) -> int:
        of_run = EventResourceFilter(id=[f"prefect.flow-run.{run.id}"])
        found = EventFilter(event=EventNameFilter(name=[HEARTBEAT]), resource=of_run)
        return client.read_events(found, limit=1).total

    assert sweep.poll() is None, sweep.communicate()
    running = FlowRunFilter(
        name=FlowRunFilterName(like_="sweep-"),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["RUNNING"])),
    )
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=running)
        return {run.name: run for run in runs if beats_of(client, run) >= beats}


@pytest.mark.longest
def test_prefect_yaml_deployments_run_on_workers_and_a_sweep_spreads_over_two_clones(
    project, tmp_path, hold
):
    """Deployed from one checkout, run by workers whose VISIONFLOW_WORKDIR names their own: the
    working directory is the worker's, read when the run starts (two machines, two paths). A
    spread sweep of 2 runs on both workers, and both clones see both (`dvc exp pull`). Then
    experiments that wait for their checkout live on by their heartbeats (Prefect's); one whose
    machine dies is marked crashed in a minute's stead (--lost-after 60), its row saying why; a
    sweep stopped with SIGTERM ends Cancelled with its table so far."""
    from prefect.client.orchestration import get_client

    from orchestration.experiments import experiments
    from orchestration.spread import RAN_ON, experiment, spread_problem

    deploying = flows_env(VISIONFLOW_WORKDIR=str(tmp_path / "the-deploying-machines-checkout"))
    # the session's server may have it from another test: made again, as prefect.yaml names it
    pool = prefect(
        "work-pool",
        "create",
        "visionflow",
        "--type",
        "process",
        "--overwrite",
        env=deploying,
        cwd=project,
    )
    assert pool.returncode == 0, pool.stdout + pool.stderr
    deploy = prefect("--no-prompt", "deploy", "--all", env=deploying, cwd=project)
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    workers = [start_worker(project, cwd=tmp_path)]  # not the checkout: VISIONFLOW_WORKDIR leads
    try:
        note_in_params(project, "a comment: check alone reruns")
        run = prefect(
            "deployment",
            "run",
            "reproduce/pool-scheduled",
            "--params",
            json.dumps(WAIT),
            "--watch",
            env=flows_env(),
            timeout=600,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "COMPLETED" in (run.stdout + run.stderr).upper()
        assert dvc_clean(project)
        # A second machine: a clone at another path of the same git remote, `dvc pull`ed from
        # the same DVC remote, with a worker of its own
        remote, store, clone = tmp_path / "remote.git", tmp_path / "store", tmp_path / "clone"
        branch = sh(project, "git", "branch", "--show-current").stdout.strip()
        sh(tmp_path, "git", "init", "-q", "--bare", "-b", branch, str(remote))
        sh(project, "git", "remote", "add", "origin", str(remote))
        sh(project, "dvc", "remote", "add", "-d", "store", str(store))
        commit(project, "a comment, a remote")
        sh(project, "git", "push", "-q", "origin", "HEAD")
        sh(project, "dvc", "push", "-q")
        sh(tmp_path, "git", "clone", "-q", str(remote), str(clone))
        sh(clone, "dvc", "pull", "-q")
        workers.append(start_worker(clone, cwd=tmp_path))
        wait_for(lambda: online_workers() >= 2, 120, "both workers online")
        # what each side refuses, in one line, before anything runs
        with pytest.raises(StageFailed, match=r"is at commit \w+, the sweep's is 00000000"):
            experiment("elsewhere", [], "0" * 40, workdir=str(clone))
        head = sh(clone, "git", "rev-parse", "HEAD").stdout.strip()
        note_in_params(clone, "an edit of this machine's own")
        with pytest.raises(StageFailed, match=r"has uncommitted changes \(params.yaml\)"):
            experiment("edited", [], head, workdir=str(clone))  # dvc exp run would take it
        sh(clone, "git", "checkout", "params.yaml")
        with pytest.raises(Exception, match="no deployment nope/nope on the Prefect server"):
            experiments(str(project), [["sanity.per_class=2"]], spread=True, deployment="nope/nope")
        assert "has no git remote 'upstream'" in spread_problem(project, "upstream")
        sh(tmp_path, "git", "init", "-q", "--bare", str(tmp_path / "upstream.git"))
        sh(project, "git", "remote", "add", "upstream", str(tmp_path / "upstream.git"))
        # pushed to origin alone: not on upstream, whose workers would refuse it
        assert "is not on upstream: `git push upstream`" in spread_problem(project, "upstream")
        sh(project, "git", "remote", "remove", "upstream")
        sweep = subprocess.run(
            [sys.executable, "-m", "orchestration.experiments", str(project), "--spread"]
            + [arg for n in (2, 3) for arg in ("-e", f"sanity.per_class={n}")],
            env=flows_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
        rows = [json.loads(line) for line in sweep.stdout.splitlines()]
        assert [(row["state"], row["sanity.per_class"]) for row in rows] == [
            ("success", n) for n in (2, 3)
        ]
        host = socket.gethostname()
        assert {row["ran on"] for row in rows} == {f"{host}:{project}", f"{host}:{clone}"}
        names = {row["experiment"] for row in rows}
        sh(clone, "dvc", "exp", "pull", "origin", *names)
        for checkout in (project, clone):  # the sweep pulled them into the submitting one
            shown = json.loads(sh(checkout, "dvc", "exp", "show", "--json").stdout)
            found = {e["name"] for b in shown for e in b.get("experiments") or []}
            assert names <= found, (checkout, found)

        # Both checkouts held by another run: each experiment waits for its lock, alive by its
        # heartbeats past --lost-after (it was marked Crashed 61 s after it showed Running)
        release = hold(project / ".dvc/tmp/visionflow-run.lock")
        hold(clone / ".dvc/tmp/visionflow-run.lock")
        two = ("-e", "sanity.per_class=6", "-e", "sanity.per_class=7")
        # 60 s, the least: Prefect's heartbeats come 30 s apart at the least
        sweep = spread_sweep(project, "--lost-after", "60", *two)
        # 4 beats, 30 s apart (the first at its start): each has waited over 60 s
        wait_for(lambda: len(running_experiments(sweep, 4)) == 2, 600, "4 beats from each")
        waiting = running_experiments(sweep, 4)
        # then the clone's machine dies: its worker, and the run it started in a session of its own
        [lost] = [run for run in waiting.values() if run.labels[RAN_ON] == f"{host}:{clone}"]
        os.killpg(workers[-1].pid, signal.SIGKILL)
        workers.pop().wait()
        for pid in stage_processes(clone, module=""):
            os.kill(pid, signal.SIGKILL)
        release()  # the other one runs, and the sweep ends
        out, err = sweep.communicate(timeout=600)
        assert sweep.returncode == 1, err[-3000:]
        said = err.rstrip().splitlines()[-1]  # the line says which one failed, and why
        assert said.startswith(f"error: experiments {lost.name} did"), said
        assert f"{lost.name}: no heartbeat for 60 s" in said, said
        assert "Traceback" not in err, err[-3000:]  # one line says why, no Prefect traceback
        rows = {row["experiment"]: row for row in map(json.loads, out.splitlines())}
        crashed, [done] = rows.pop(lost.name), rows.values()
        assert (crashed["state"], crashed["ran on"], crashed["accuracy"]) == (
            "crashed",
            f"{host}:{clone}",
            None,
        )
        assert crashed["why"].startswith("no heartbeat for 60 s: its worker or machine was lost")
        with get_client(sync_client=True) as client:  # cancelled; its worker dead: not left
            assert client.read_flow_run(lost.id).state.is_crashed()  # Running nor Cancelling
        assert (done["state"], done["ran on"], done["why"]) == (
            "success",
            f"{host}:{project}",
            None,
        )

        # SIGTERM to a spread sweep whose experiment waits: Cancelled, as Ctrl-C and SIGHUP
        release = hold(project / ".dvc/tmp/visionflow-run.lock")
        sweep = spread_sweep(project, "-e", "sanity.per_class=8")
        wait_for(lambda: running_experiments(sweep, 1), what="the experiment's first beat")
        sweep.send_signal(signal.SIGTERM)
        out, err = sweep.communicate(timeout=300)
        assert sweep.returncode == 130, err[-3000:]
        [row] = [json.loads(line) for line in out.splitlines()]  # the table so far
        assert (row["state"], row["sanity.per_class"]) == ("stopped", 8)
        assert (row["ran on"], row["why"]) == (f"{host}:{project}", "stopped while it ran")
        with get_client(sync_client=True) as client:
            [run] = [r for r in client.read_flow_runs() if row["experiment"][6:14] in str(r.id)]
        assert run.state.is_cancelled(), run.state  # it was Crashed
        release()
    finally:
        for worker in workers:
            stop_worker(worker)


def test_the_watch_follows_a_new_prepare_path_and_lets_the_old_one_go(tmp_path, capsys):
    """The deps are read again when params.yaml changes. Before, they were read once: after
    prepare.path changed, an image added to the new folder started no run and one added to the
    old folder still did."""
    import contextlib

    from visionflow.ops.watching import settled_changes

    stage = {"cmd": "true", "deps": ["${prepare.path}"]}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"prepare": stage}}))
    (tmp_path / "params.yaml").write_text("prepare:\n  path: old\n")
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    bursts = queue.Queue()

    def watch() -> None:  # two bursts, then the watch ends
        with contextlib.closing(settled_changes(tmp_path, 0.5)) as changes:
            for _, burst in zip(range(2), changes, strict=False):
                bursts.put(burst)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    wait_for(lambda: "watching" in capsys.readouterr().out, 60, "the watch to start")
    (tmp_path / "params.yaml").write_text("prepare:\n  path: new\n")
    assert bursts.get(timeout=60) == ["params.yaml"]
    (tmp_path / "old/a.png").write_bytes(b"x")  # no longer a dep: in no burst
    (tmp_path / "new/b.png").write_bytes(b"x")
    assert bursts.get(timeout=60) == ["new/b.png"]
    watcher.join(timeout=60)


def test_watcher_turns_a_burst_of_edits_into_one_run_and_sees_every_dep(project, tmp_path):
    go = tmp_path / "go"  # train pauses at its start while this file is missing
    go.touch()
    watcher = start_flows(
        project,
        "--watch",
        "--settle",
        "2",
        env=flows_env(VISIONFLOW_FAULT=f"stage.start@stage=train:pause={go}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines = queue.Queue()
    reader = threading.Thread(
        target=lambda: [lines.put(line) for line in watcher.stdout], daemon=True
    )
    reader.start()
    try:
        assert lines.get(timeout=120).startswith("watching")

        def one_run(*changed: str) -> None:
            """The next lines: one burst (the paths it changed: one of `changed`) and the end
            of its run."""
            said = lines.get(timeout=60)
            assert said in [f"change settled ({c}): starting a run\n" for c in changed], said
            assert lines.get(timeout=120).startswith("run ended: ")

        for save in (1, 2, 3):  # a burst: three saves in a row
            note_in_params(project, f"save {save}")
        one_run("params.yaml")
        assert params_recorded(project)
        extra = project / "data/pretrained/new.txt"  # a train dep outside the code and params
        extra.write_text("x")
        time.sleep(0.3)
        extra.unlink()  # back as it was: the run that starts finds nothing to do
        one_run("data/pretrained/new.txt")
        pretrained = project / "data/pretrained"  # removed and made again: watched again
        readme = (pretrained / "README.md").read_bytes()
        shutil.rmtree(pretrained)
        pretrained.mkdir()
        (pretrained / "README.md").write_bytes(readme)
        # README.md is seen when it is written after the folder is watched again, not before
        one_run("data/pretrained", "data/pretrained, data/pretrained/README.md")
        extra.write_text("x")
        time.sleep(0.3)
        extra.unlink()
        one_run("data/pretrained/new.txt")

        go.unlink()  # `kill <watcher>` during a run: the run ends, then the watcher
        write_params(project, {"train": {"lr": 3e-3}})
        # params.yaml alone: a run that changed what it watches (its own outputs among the deps)
        # would have started another, seen here before this one or in this line's paths
        assert lines.get(timeout=60) == "change settled (params.yaml): starting a run\n"
        wait_for(lambda: stage_processes(project, "pipeline.train"), what="a paused train stage")
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(timeout=60) == 130  # a stopped run, as visionflow repro
        reader.join(timeout=60)
        assert list(lines.queue) == ["stopped: the run in progress was ended first\n"]
    finally:
        if watcher.poll() is None:
            os.killpg(watcher.pid, signal.SIGTERM)
            watcher.wait(timeout=60)
    assert not stage_processes(project)
