"""`visionflow doctor` on this machine (no GPU), with a package missing, and its single checks."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import ROOT, copy_project, python_path, write_params
from visionflow.ops import doctor


def run_doctor(*args, pythonpath: str = "", env_change: dict | None = None, cwd=ROOT):
    env = {
        **os.environ,
        # as `make test` runs: the venv first on PATH (the stages' `python`)
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": python_path(*filter(None, [pythonpath]), ROOT / "src"),
        **(env_change or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "visionflow.cli", "doctor", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def by_name(report: dict) -> dict:
    return {c["check"]: c for c in report["checks"]}


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="reads what a machine without a GPU reports")
def test_doctor_reports_this_machine_and_the_workspace(reproduced_base, tmp_path):
    project = copy_project(reproduced_base, tmp_path / "project")
    result = run_doctor("--json", cwd=project)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    checks = by_name(report)
    assert report["ok"] is True and not [c for c in report["checks"] if c["status"] == "FAIL"]
    for name in ("python", "torch", "torchvision", "onnx", "onnxruntime", "dvc", "prefect"):
        assert checks[name]["status"] == "ok" and checks[name]["found"][0].isdigit(), name
    assert checks["torch"]["found"] == torch.__version__.split("+")[0]
    assert checks["gpu"]["found"].startswith("none visible")
    assert "CPUExecutionProvider" in checks["onnxruntime providers"]["found"]
    assert checks["dvc repo"]["found"] == str(project)
    assert (checks["pipeline"]["status"], checks["pipeline"]["found"]) == ("ok", "up to date")
    assert checks["torch/torchvision"]["found"].endswith("(a matching pair)")
    assert "GiB free" in checks["disk"]["found"]
    # the copy's stages would run this checkout's library (PYTHONPATH), not the copy's own src/
    library = checks["stage python"]
    assert (
        library["status"] == "warn"
        and f"not this checkout's {project}/src/visionflow" in library["found"]
    )
    write_params(project, {"evaluate": {"top_k": 2}})  # a change `make repro` would run
    stale = by_name({"checks": doctor.workspace(project)})["pipeline"]  # no second doctor run
    assert (stale["status"], stale["found"]) == ("warn", "not up to date: check, evaluate")


def test_a_missing_package_fails_with_the_fix(monkeypatch):
    """Doctor's package check in this process, onnxruntime not importable (None in sys.modules:
    Python's own "import halted"); the test below runs the whole command with it shadowed."""
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    found, modules = doctor.packages()
    failed = [c for c in found if c["status"] != "ok"]
    assert [c["check"] for c in failed] == ["onnxruntime"] and "onnxruntime" not in modules
    assert failed[0]["found"] == (
        "cannot be imported (ModuleNotFoundError: import of onnxruntime halted; None in sys.modules)"
    )
    assert failed[0]["fix"].startswith("run `make setup`")
    assert {"torch", "dvc", "prefect"} <= modules.keys()


@pytest.mark.slow
def test_doctor_fails_on_a_missing_package_with_the_fix(tmp_path):
    shadow = tmp_path / "onnxruntime"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('simulated: not installed')\n")
    result = run_doctor(pythonpath=str(tmp_path))
    assert result.returncode == 1
    assert "FAIL  onnxruntime" in result.stdout and "simulated: not installed" in result.stdout
    assert "fix: run `make setup`" in result.stdout
    assert "doctor: 1 failure(s)" in result.stdout


def test_an_unreachable_prefect_api_is_a_warning_with_the_fix():
    """Doctor's own check, asked in this process (a doctor process imports everything it checks:
    5 s of CPU); the test above runs the whole command."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        check = doctor.prefect_api()
    assert check["status"] == "warn" and "does not answer" in check["found"]
    assert "prefect server start" in check["fix"]


def fake_torch(cuda_build: str | None) -> SimpleNamespace:
    """The attributes `doctor.gpu` reads, for builds this machine does not have."""
    return SimpleNamespace(
        version=SimpleNamespace(cuda=cuda_build),
        backends=SimpleNamespace(cudnn=SimpleNamespace(is_available=lambda: False)),
        cuda=SimpleNamespace(is_available=lambda: False),
    )


def test_a_cpu_only_torch_beside_an_nvidia_driver_fails_with_the_fix():
    checks = {c["check"]: c for c in doctor.gpu(fake_torch(None), driver=True)}
    assert checks["torch build"]["found"] == "CPU-only"
    assert checks["gpu"]["status"] == "FAIL" and "CPU-only build" in checks["gpu"]["found"]
    assert "download.pytorch.org/whl/cu" in checks["gpu"]["fix"]
    unseen = {c["check"]: c for c in doctor.gpu(fake_torch("12.6"), driver=True)}["gpu"]
    assert unseen["status"] == "FAIL" and "torch sees no GPU" in unseen["found"]
    assert {c["check"]: c for c in doctor.gpu(fake_torch(None), driver=False)}["gpu"][
        "status"
    ] == "ok"


def test_a_torch_torchvision_mismatch_fails():
    pair = doctor.torch_pair(
        SimpleNamespace(__version__="2.14.1"), SimpleNamespace(__version__="0.28.0")
    )
    assert pair["status"] == "FAIL" and "torchvision==0.29.*" in pair["fix"]
    ok = doctor.torch_pair(
        SimpleNamespace(__version__="2.14.1"), SimpleNamespace(__version__="0.29.1")
    )
    assert ok["status"] == "ok"


@pytest.mark.slow
def test_a_prefect_server_that_answers_is_ok(prefect_server):
    check = doctor.prefect_api()
    assert (check["status"], check["found"]) == ("ok", f"{prefect_server} answers")


def python_outside_the_venv(tmp_path) -> Path:
    """A folder whose `python` is the Python the venv was made from, without its packages."""
    bare = tmp_path / "bin"
    bare.mkdir()
    base = subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.base_prefix)"], capture_output=True, text=True
    ).stdout.strip()
    (bare / "python").symlink_to(f"{base}/bin/python3")
    return bare


def assert_outside_the_venv(found: dict) -> None:
    assert found["status"] == "FAIL"
    # visionflow too where PYTHONPATH does not bring this checkout's src/ (a clean clone's CI)
    assert re.search(r"cannot import (visionflow, )?torch, dvclive", found["found"])
    assert "ModuleNotFoundError" in found["found"]
    assert found["fix"].startswith("`source .venv/bin/activate`")


def test_a_stage_python_outside_the_venv_fails_with_the_fix(tmp_path, monkeypatch):
    """`.venv/bin/dvc repro` runs each stage with the `python` first on PATH: without the venv
    there, every stage stopped with ModuleNotFoundError and doctor said nothing. Doctor's own
    check, in this process; the test below runs the whole command."""
    monkeypatch.setenv("PATH", f"{python_outside_the_venv(tmp_path)}{os.pathsep}/usr/bin:/bin")
    assert_outside_the_venv(doctor.stage_python(ROOT))


@pytest.mark.slow
def test_doctor_fails_on_a_stage_python_outside_the_venv(tmp_path):
    bare = python_outside_the_venv(tmp_path)
    result = run_doctor("--json", env_change={"PATH": f"{bare}{os.pathsep}/usr/bin:/bin"})
    assert result.returncode == 1
    assert_outside_the_venv(by_name(json.loads(result.stdout))["stage python"])


def test_a_stage_python_that_hangs_is_said_and_ended_with_what_it_started(tmp_path, monkeypatch):
    import psutil

    bare = tmp_path / "bin"
    bare.mkdir()
    started = tmp_path / "started"
    (bare / "python").write_text(f"#!/bin/sh\nsleep 1000 &\necho $! > {started}\nexec sleep 1000\n")
    (bare / "python").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bare}{os.pathsep}{os.environ['PATH']}")
    found = doctor.stage_python(ROOT, timeout_s=2)
    assert (found["status"], found["found"]) == ("FAIL", f"{bare}/python did not answer in 2 s")
    with pytest.raises(psutil.NoSuchProcess):  # what it started went with it
        psutil.Process(int(started.read_text())).wait(timeout=30)
        psutil.Process(int(started.read_text())).status()
