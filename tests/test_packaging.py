"""What a machine that runs work gets: the DVC remotes' extras and the work pools' image, as
files (the development machines have no Docker daemon: the image is not built here)."""

import json
import re
import subprocess

import pytest
import yaml

from tests.helpers import ROOT


def declared_extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]")[1].split("\n[")[0]
    return set(re.findall(r"^(\w+) = \[", section, re.MULTILINE))


def test_the_image_installs_declared_extras_and_runs_a_worker_for_the_deployed_pool():
    docker = (ROOT / "Dockerfile").read_text()
    extras = re.search(r"^ARG EXTRAS=([\w,]+)$", docker, re.MULTILINE).group(1).split(",")
    assert set(extras) == {"s3", "gs", "azure", "ssh"} <= declared_extras()
    assert 'pip install --no-cache-dir -e ".[${EXTRAS}]"' in docker
    command = json.loads(re.search(r"^CMD (.+)$", docker, re.MULTILINE).group(1))
    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    pools = {deployment["work_pool"]["name"] for deployment in deployments}
    assert command[:3] == ["prefect", "worker", "start"]
    assert command[command.index("--pool") + 1] in pools
    # the pull step's checkout is the image's (worker_checkout reads this at run time)
    workdir = re.search(r"^WORKDIR (\S+)$", docker, re.MULTILINE).group(1)
    assert f"VISIONFLOW_WORKDIR={workdir}" in docker
    left_out = (ROOT / ".dockerignore").read_text().split()
    assert {".venv/", ".dvc/cache/", "results/", "data/**"} <= set(left_out)  # data/prepared too


def test_the_pull_step_names_a_missing_or_wrong_checkout(tmp_path, monkeypatch):
    from visionflow.ops.worker import worker_checkout

    monkeypatch.delenv("VISIONFLOW_WORKDIR", raising=False)
    with pytest.raises(RuntimeError, match="VISIONFLOW_WORKDIR is not set where this worker runs"):
        worker_checkout()
    monkeypatch.setenv("VISIONFLOW_WORKDIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="no dvc.yaml there; point it at a checkout"):
        worker_checkout()
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(ROOT)  # put back after the test
    assert worker_checkout() == {"directory": str(tmp_path)}


def test_the_python_floor_is_the_one_doctor_checks_and_the_docs_say():
    """pip refuses an older Python with requires-python; doctor says the same floor."""
    from visionflow.ops.doctor import MIN_PYTHON

    floor = re.search(
        r'^requires-python = ">=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE
    )
    assert tuple(map(int, floor.groups())) == MIN_PYTHON == (3, 11)
    for page in ("README.md", "docs/index.md"):
        assert "Python 3.11+" in (ROOT / page).read_text(), page


def test_no_file_cites_a_page_a_clone_does_not_have():
    """shared/ is the team's, beside the checkout: a clone has no shared/STYLE.md to read."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    citing = [
        name
        for name in tracked
        if (ROOT / name).is_file()
        and name != "tests/test_packaging.py"
        and re.search(rb"shared/(STYLE|DESIGN)\.md", (ROOT / name).read_bytes())
    ]
    assert citing == []


def test_the_image_leaves_out_data_that_dvc_tracks_but_keeps_its_pointers():
    """`dvc add data/images` leaves the images in the folder, ignored by git but not by docker
    build: they went into every image. What git tracks there must stay (dvc pull reads the .dvc
    pointers; a worker with a tracked file missing refuses as uncommitted changes)."""
    rules = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert "data/**" in rules and not [rule for rule in rules if rule.startswith("!")]
    assert ".git" not in rules and ".git/" not in rules  # DVC needs the history
    docker = (ROOT / "Dockerfile").read_text()
    # git's own files under data/ (pointers, .gitignore files, committed weights) come back
    assert docker.index("RUN git ls-files -z data | xargs -0 -r git checkout --") > docker.index(
        "COPY . ."
    )
