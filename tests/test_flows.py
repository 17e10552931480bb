"""Prefect flows against a real Prefect server (prefect_test_harness), on the tiny project."""

import fcntl
import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, commit, make_project, write_params

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ.update({"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def project(tmp_path_factory, prefect_server):
    from pipeline.flows import ensure_limit

    project = make_project(tmp_path_factory.mktemp("flows") / "project")
    ensure_limit(project)  # the flow's concurrency limit is strict: it must exist
    return project


def flows_env() -> dict[str, str]:
    """The environment of a flows subprocess: the test server's API, the project importable."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT)}


def start_flows(project, *args, **popen) -> subprocess.Popen:
    """`python -m pipeline.flows PROJECT ARGS...` in its own session (killable as a group)."""
    command = [sys.executable, "-m", "pipeline.flows", str(project), *args]
    return subprocess.Popen(command, env=flows_env(), start_new_session=True, **popen)


def artifact(key):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )
    return sorted(found, key=lambda a: a.created)[-1]


def test_reproduce_runs_then_does_nothing_then_only_what_changed(prefect_server, project):
    from pipeline.flows import reproduce

    assert reproduce(str(project)) == ["check", "prepare", "sanity", "train", "evaluate", "export"]
    assert "accuracy" in artifact("metrics").data
    assert "onnx" in str(artifact("export-parity").data)
    commit(project, "first run")
    assert reproduce(str(project)) == []  # up to date: no stage runs
    write_params(project, {"train": {"epochs": 3, "lr": 3e-3}})
    assert reproduce(str(project)) == ["check", "train", "evaluate", "export"]
    assert "results/evaluate/metrics.json" in artifact("metrics-diff").data


def test_a_failing_stage_fails_the_flow_once_with_its_error(prefect_server, project):
    from pipeline.flows import reproduce

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


def test_a_failed_stage_gets_its_previous_results_back(prefect_server, project, monkeypatch):
    from pipeline.flows import reproduce

    write_params(project, {"train": {"epochs": 3}})
    reproduce(str(project))  # a baseline (up to date when the tests run in order)
    metrics = (project / "results/evaluate/metrics.json").read_bytes()
    write_params(project, {"evaluate": {"top_k": 2}})
    monkeypatch.setenv("VISIONFLOW_FAULT", "stage.start@stage=evaluate:raise")
    assert reproduce(str(project), return_state=True).is_failed()
    assert (project / "results/evaluate/metrics.json").read_bytes() == metrics  # dvc checkout
    monkeypatch.delenv("VISIONFLOW_FAULT")
    write_params(project, {"evaluate": {"top_k": 3}})


def held_by_another(lock_file) -> bool:
    with open(lock_file, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def test_overlapping_runs_never_run_dvc_at_once(prefect_server, project):

    write_params(project, {"train": {"epochs": 4, "lr": 1e-3}})

    def start(*extra):
        return start_flows(
            project, *extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    first = start()
    lock_file = project / ".dvc/tmp/visionflow-run.lock"
    deadline = time.monotonic() + 120
    while not (lock_file.exists() and held_by_another(lock_file)) and time.monotonic() < deadline:
        time.sleep(0.2)
    skipper, waiter = start("--if-busy", "skip"), start("--if-busy", "wait")
    skipped_out, skipped_err = skipper.communicate(timeout=300)
    assert first.poll() is None  # the skipper ended while the first still ran
    assert json.loads(skipped_out.splitlines()[-1]) == {"ran": []} and "skipping" in skipped_err
    first_out, first_err = first.communicate(timeout=600)
    assert first.returncode == 0, first_err[-2000:]
    assert json.loads(first_out.splitlines()[-1])["ran"] == ["check", "train", "evaluate", "export"]
    waited_out, waited_err = waiter.communicate(timeout=300)
    assert waiter.returncode == 0, waited_err[-2000:]
    assert json.loads(waited_out.splitlines()[-1]) == {"ran": []}  # it waited: then nothing to do
    assert "up to date" in waited_err and "waiting for it to finish" in waited_err


def test_experiments_flow_runs_each_override_and_publishes_the_comparison(prefect_server, project):
    from pipeline.flows import experiments, reproduce

    reproduce(str(project))  # the baseline the experiments are compared with (up to date in order)
    commit(project, "baseline")
    table = experiments(str(project), [["train.lr=0.003"], ["train.epochs=3"]])
    assert "0.003" in table and "accuracy" in table and "train.epochs" in table
    assert artifact("experiments").data.count("\n") >= 4  # header, rule, baseline, two experiments
    assert max(map(len, table.splitlines())) <= 160  # what differs, not every metric and dep hash


def test_served_deployment_runs_on_demand_and_its_schedule_survives_shutdown(
    prefect_server, project
):
    from prefect.client.orchestration import get_client

    env = flows_env()
    server = start_flows(project, "--serve", "--interval", "3600", stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline:
                try:
                    client.read_deployment_by_name("reproduce/scheduled")
                    break
                except Exception:
                    time.sleep(1)
        prefect = [sys.executable, "-m", "prefect"]
        run = subprocess.run([*prefect, "deployment", "run", "reproduce/scheduled", "--watch"], env=env,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert "COMPLETED" in (run.stdout + run.stderr).upper()
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("reproduce/scheduled")
    assert (
        not deployment.paused and deployment.schedules
    )  # still scheduled after the server stopped


def test_watcher_turns_a_burst_of_edits_into_one_run(prefect_server, project):
    import yaml

    watcher = start_flows(project, "--watch", "--settle", "2", stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        assert watcher.stdout.readline().startswith("watching")
        for epochs in (5, 6, 5):  # a burst: three saves within a second
            write_params(project, {"train": {"epochs": epochs, "lr": 2e-3}})
            time.sleep(0.3)

        def locked_lr():  # None until train has run (when this test runs alone, say)
            lock = project / "dvc.lock"
            stages = yaml.safe_load(lock.read_text())["stages"] if lock.exists() else {}
            train = stages.get("train")
            return float(train["params"]["params.yaml"]["train.lr"]) if train else None

        deadline = time.monotonic() + 300
        while locked_lr() != 2e-3 and time.monotonic() < deadline:
            time.sleep(1)
        assert locked_lr() == 2e-3  # the run happened and recorded the settled params
        time.sleep(5)  # long enough for a second, unwanted run to start
    finally:
        os.killpg(watcher.pid, 15)
        out, _ = watcher.communicate(timeout=60)
    assert out.count("change settled: starting a run") == 1


def training_processes(project) -> list[int]:
    """Live processes running the train stage with `project` as their working folder."""
    found = []
    for proc in os.listdir("/proc"):
        try:
            cmdline = open(f"/proc/{proc}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            if "pipeline.train" in cmdline and os.readlink(f"/proc/{proc}/cwd") == str(project):
                found.append(int(proc))
        except (OSError, ValueError):
            continue
    return found


def test_cancelling_a_run_during_training_leaves_no_training_process(prefect_server, project):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    write_params(project, {"train": {"epochs": 400, "lr": 1.5e-3}})  # long enough to cancel
    env = flows_env()
    server = start_flows(project, "--serve", "--interval", "3600", stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        run = None
        while run is None and time.monotonic() < deadline:
            try:
                run = run_deployment("reproduce/scheduled", timeout=0)
            except Exception:
                time.sleep(1)
        deadline = time.monotonic() + 300
        while not training_processes(project) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert training_processes(project), "training never started"
        cancel = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "cancel", str(run.id)],
                                env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        deadline = time.monotonic() + 120
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline:
                state = client.read_flow_run(run.id).state
                if state.is_final() and not training_processes(project):
                    break
                time.sleep(1)
        assert state.is_cancelled(), state
        assert training_processes(project) == []
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    write_params(project, {"train": {"epochs": 3}})


def test_prefect_yaml_deploys_both_flows_to_a_work_pool(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client

    env = {**flows_env(), "VISIONFLOW_WORKDIR": str(ROOT)}
    prefect = [sys.executable, "-m", "prefect"]
    pool = subprocess.run([*prefect, "work-pool", "create", "visionflow", "--type", "process"], env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert pool.returncode == 0, pool.stdout + pool.stderr
    deploy = subprocess.run([*prefect, "--no-prompt", "deploy", "--all"], env=env, capture_output=True,
                            text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    with get_client(sync_client=True) as client:
        scheduled = client.read_deployment_by_name("reproduce/pool-scheduled")
        sweep = client.read_deployment_by_name("experiments/pool-experiments")
    assert scheduled.work_pool_name == sweep.work_pool_name == "visionflow"
    assert scheduled.schedules and scheduled.parameters["if_busy"] == "skip"


def test_queued_experiments_run_with_workers(prefect_server, project):
    from pipeline.flows import experiments

    commit(project, "before the queue")  # the queue runs from commits plus the stashed changes
    table = experiments(str(project), [["train.lr=0.004"], ["train.lr=0.005"]], workers=2)
    assert "0.004" in table and "0.005" in table
    from pipeline.flows import dvc

    status = dvc(project, "queue", "status").stdout
    assert status.count("Success") == 2 and "Queued" not in status and "Running" not in status
