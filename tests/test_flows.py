"""Prefect flows against a real Prefect server (prefect_test_harness), on the tiny project."""

import os

import pytest

from tests.conftest import commit, make_project, write_params

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ.update({"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("flows") / "project")


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

    assert reproduce(str(project)) == ["prepare", "sanity", "train", "evaluate", "export"]
    assert "accuracy" in artifact("metrics").data
    assert "onnx" in str(artifact("export-parity").data)
    commit(project, "first run")
    assert reproduce(str(project)) == []  # up to date: no stage runs
    write_params(project, {"train": {"epochs": 3, "lr": 3e-3}})
    assert reproduce(str(project)) == ["train", "evaluate", "export"]
    assert "results/evaluate/metrics.json" in artifact("metrics-diff").data


def test_a_failing_stage_fails_the_flow_once_with_its_error(prefect_server, project):
    from pipeline.flows import reproduce

    write_params(project, {"train": {"epochs": "ten"}})
    state = reproduce(str(project), return_state=True)
    assert state.is_failed()
    with pytest.raises(
        Exception,
        match=r"(?s)stage train failed \(exit \d+\).*train.epochs: Input should be a valid integer",
    ) as e:
        state.result()
    assert str(e.value).count("Running stage 'train'") == 1  # failed on its own: not retried
    assert "epochs: ten" not in (project / "dvc.lock").read_text()
