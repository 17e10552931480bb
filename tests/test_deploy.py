"""Deploying (#27): the INT8 ONNX file the export stage writes, its gate through plain `dvc repro`,
and the models as DVC artifacts fetched by `dvc artifacts get` from a teammate's DVC remote.

Real DVC, GTO, git and ONNX Runtime in temporary repos copied from the session's one reproduced
project (tests/conftest.py).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from PIL import Image

from tests.helpers import ROOT, TINY, commit, copy_project, python_path, sh, write_params
from visionflow.deploy.inference import load_predictor, to_input
from visionflow.deploy.quantize import calibration_sample

pytestmark = pytest.mark.slow


def ran(result) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", result.stdout)


def onnx_client(model: Path, folder: Path, shadow: Path) -> list[dict]:
    """examples/onnx_client.py on every image of `folder`, with torch and visionflow made
    unimportable: what a user without this project runs."""
    for name in ("torch", "visionflow", "torchvision"):
        (shadow / name).mkdir(parents=True, exist_ok=True)
        (shadow / name / "__init__.py").write_text(f"raise ImportError('{name} is not allowed')")
    client = subprocess.run(
        [sys.executable, str(ROOT / "examples/onnx_client.py"), str(model), str(folder)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": python_path(shadow)},
    )
    assert client.returncode == 0, client.stderr
    return [json.loads(line) for line in client.stdout.splitlines()]


def test_repro_writes_an_int8_model_that_the_onnx_client_runs_unchanged(reproduced_base, tmp_path):
    export = reproduced_base / "results/export"
    x = np.load(reproduced_base / "data/prepared/test_x.npy")
    y = np.load(reproduced_base / "data/prepared/test_y.npy")
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(len(x)):  # every test image, exact pixels
        Image.fromarray(x[i, ..., 0]).save(folder / f"{i:04d}.png")
    fp32 = onnx_client(export / "model.onnx", folder, tmp_path / "shadow")
    int8 = onnx_client(export / "model.int8.onnx", folder, tmp_path / "shadow")
    classes = json.loads((reproduced_base / "data/prepared/classes.json").read_text())
    labels = [classes[label] for label in y]
    int8_accuracy = np.mean(
        [row["class"] == label for row, label in zip(int8, labels, strict=True)]
    )
    agreement = np.mean([a["class"] == b["class"] for a, b in zip(fp32, int8, strict=True)])

    # the stage's own numbers: the same test images, the same answers
    gate = json.loads((export / "int8.json").read_text())
    assert gate["passed"] and gate["images"] == len(y)
    assert gate["int8_accuracy"] == pytest.approx(int8_accuracy)
    assert gate["top1_agreement"] == pytest.approx(agreement) and agreement >= 0.97
    assert gate["calibration_split"] == "train" and gate["calibration"] == "minmax"
    # one number of it among the declared metrics (`dvc exp show --only-changed` keeps its
    # params in view: tests/test_dvc_contract.py)
    metrics = json.loads((export / "metrics.json").read_text())
    assert metrics["int8acc"] == gate["int8_accuracy"] and "onnx_ms" not in metrics
    latency = json.loads((reproduced_base / "results/export.timings/latency.json").read_text())
    assert {"onnx", "onnx_int8"} <= set(latency["batch_1"]) & set(latency["batch_64"])
    sizes = latency["size_bytes"]
    assert sizes["onnx_int8"] == (export / "model.int8.onnx").stat().st_size < sizes["onnx"]
    card = (export / "MODEL_CARD.md").read_text()
    assert "## INT8 ONNX (`model.int8.onnx`)" in card
    assert f"| test accuracy | {gate['fp32_accuracy']:.4f} | {gate['int8_accuracy']:.4f} |" in card
    # the image's range in the file is that of the stage's calibration sample of training images
    spec = load_predictor("onnx", export / "model.int8.onnx")[2]
    train_x = np.load(reproduced_base / "data/prepared/train_x.npy")
    sample = to_input(calibration_sample(train_x, gate["calibration_images"]), spec)
    scale = input_scale(export / "model.int8.onnx")
    assert scale == pytest.approx((sample.max() - min(sample.min(), 0)) / 255, rel=1e-3)


def input_scale(path: Path) -> float:
    model = onnx.load(str(path))
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    first = next(n for n in model.graph.node if n.input and n.input[0] == "image")
    return float(values[first.input[1]])


@pytest.mark.longest
def test_an_int8_miss_fails_plain_dvc_repro_and_promotes_nothing(
    reproduced_base, tmp_path, monkeypatch
):
    """The tightest gate (no drop at all) and an INT8 model that lost accuracy: the stage fails
    naming both accuracies, dvc.lock keeps the last good export, `dvc checkout` brings it back.
    With the accuracy gate off, the same model still misses on top-1 agreement with fp32 (it
    passed before: equal accuracies said nothing of the answers). Going back to params that ran
    restores the export from DVC's run-cache, and the miss's report no longer stays beside it."""
    project = copy_project(reproduced_base, tmp_path / "project")
    before = {p.name: p.read_bytes() for p in (project / "results/export").iterdir() if p.is_file()}
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["export"]
    write_params(project, {"export": {"int8_max_accuracy_drop": 0.0}})
    monkeypatch.setenv("VISIONFLOW_FAULT", "export.int8:nan")  # NaN logits: top-1 is class 0
    failed = sh(project, "dvc", "repro", check=False)
    monkeypatch.delenv("VISIONFLOW_FAULT")
    assert failed.returncode != 0 and ran(failed) == ["check", "export"]
    miss = json.loads((project / "results/export.miss.json").read_text())
    r = miss["int8"]
    assert miss["passed"] is True and r["passed"] is False  # parity held; the INT8 gate missed
    assert r["int8_accuracy"] < r["fp32_accuracy"]  # class 0 for every image
    said = (
        f"INT8 test accuracy {r['int8_accuracy']:.4f} is {r['accuracy_drop']:.4f} below fp32's "
        f"{r['fp32_accuracy']:.4f}, more than export.int8_max_accuracy_drop 0.0"
    )
    assert said in failed.stderr and "nothing promoted" in failed.stderr
    assert "dvc checkout export" in failed.stderr
    assert yaml.safe_load((project / "dvc.lock").read_text())["stages"]["export"] == lock
    assert not (project / "results/export").exists()  # DVC deleted it; its cache keeps it
    sh(project, "dvc", "checkout")
    after = {p.name: p.read_bytes() for p in (project / "results/export").iterdir()}
    assert after == before

    write_params(project, {"export": {"int8_max_accuracy_drop": 1.0}})  # accuracy gate off
    monkeypatch.setenv("VISIONFLOW_FAULT", "export.int8:nan")
    failed = sh(project, "dvc", "repro", check=False)
    monkeypatch.delenv("VISIONFLOW_FAULT")
    r = json.loads((project / "results/export.miss.json").read_text())["int8"]
    assert failed.returncode != 0 and r["top1_agreement"] < 0.9 == r["min_top1_agreement"]
    said = f"INT8 gives fp32's top-1 class on {r['top1_agreement']:.4f} of the test images, "
    assert said + "under export.int8_min_top1_agreement 0.9" in failed.stderr

    # back to params that ran: export comes from DVC's run-cache, and the miss's report goes
    write_params(project, {"export": {"int8_max_accuracy_drop": 0.01}})
    restored = sh(project, "dvc", "repro")
    assert ran(restored) == ["check"] and "Stage 'export' is cached" in restored.stdout
    assert not (project / "results/export.miss.json").exists()  # it stayed beside the export
    # (a passing export's own lines: tests/test_export.py, the same commit exported again)


def test_a_model_onnx_runtime_cannot_quantize_keeps_its_proven_fp32_formats(
    reproduced_base, tmp_path, monkeypatch
):
    """ONNX Runtime's quantizer fails on some graphs (swin_v2_t, docs/zoo.md): the stage says so
    in one line and int8.json, promotes the fp32 formats that passed parity, and no INT8 file."""
    project = copy_project(reproduced_base, tmp_path / "project")
    write_params(project, {"export": {"latency_repeats": 2}})  # reruns export alone
    monkeypatch.setenv("VISIONFLOW_FAULT", "export.quantize:raise")
    result = sh(project, "dvc", "repro")
    monkeypatch.delenv("VISIONFLOW_FAULT")
    assert ran(result) == ["check", "export"]
    warned = [line for line in result.stdout.splitlines() if "INT8 cannot quantize" in line]
    assert warned == [
        "export: warning: INT8 cannot quantize simple_cnn: FaultInjected: injected fault at "
        "export.quantize {}"
    ]
    out = project / "results/export"
    assert json.loads((out / "int8.json").read_text())["unavailable"].startswith("FaultInjected")
    assert json.loads((out / "parity.json").read_text())["passed"] is True
    assert (out / "model.onnx").exists() and not (out / "model.int8.onnx").exists()
    assert "int8acc" not in json.loads((out / "metrics.json").read_text())


def register(project: Path, name: str, version: str, stage: str | None = None) -> None:
    """Git tags as GTO writes them: `name@version`, and `name#stage#N` for a stage."""
    sh(project, "gto", "register", name, "HEAD", "--version", version)
    if stage:
        sh(project, "gto", "assign", name, "--version", version, "--stage", stage)


def test_dvc_artifacts_get_fetches_a_tagged_model_from_the_dvc_remote(reproduced_base, tmp_path):
    """The registry holds the classifier; its INT8 file, faster or slower by model and CPU, is
    no artifact of its own: it comes with the classifier's version or stage, by its tag."""
    project = copy_project(reproduced_base, tmp_path / "project")
    storage = tmp_path / "dvc-storage"
    sh(project, "git", "config", "user.name", "t")
    sh(project, "git", "config", "user.email", "t@t")
    sh(project, "dvc", "remote", "add", "-d", "storage", str(storage))
    commit(project, "a DVC remote")
    sh(project, "dvc", "push")
    register(project, "classifier", "v1.0.0", stage="prod")
    v1 = {
        name: (project / "results/export" / name).read_bytes()
        for name in ("model.onnx", "model.int8.onnx")
    }
    # a second version: INT8 calibrated on fewer training images (model.onnx stays the same);
    # the gate open, as this tiny model can lose a point or two that way
    write_params(
        project, {"export": {"int8_calibration_images": 64, "int8_max_accuracy_drop": 1.0}}
    )
    assert ran(sh(project, "dvc", "repro")) == ["check", "export"]
    commit(project, "INT8 calibrated on 64 images")
    sh(project, "dvc", "push")
    register(project, "classifier", "v1.1.0")
    v2_int8 = (project / "results/export/model.int8.onnx").read_bytes()
    assert v2_int8 != v1["model.int8.onnx"]
    # the INT8 numbers of two revisions, side by side, as the manual shows
    diff = sh(project, "dvc", "metrics", "diff", "HEAD~1", "--targets", "results/export/int8.json")
    assert re.search(r"int8\.json\s+calibration_images\s+512\s+64\b", diff.stdout), diff.stdout
    shutil.rmtree(project / ".dvc/cache")  # the DVC remote is the only copy of the data now

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    sh(fresh, "dvc", "artifacts", "get", str(project), "classifier")
    assert sorted(p.name for p in fresh.iterdir()) == ["model.onnx"]
    int8 = ["dvc", "get", str(project), "results/export/model.int8.onnx", "--rev"]
    got = {  # out: (the command's tail, the bytes it must fetch)
        "latest": (None, v1["model.onnx"]),  # v1.1.0's: the same fp32 file
        "prod.onnx": (["--stage", "prod"], v1["model.onnx"]),
        "v1.onnx": (["--rev", "v1.0.0"], v1["model.onnx"]),
        "int8-v1.onnx": ("classifier@v1.0.0", v1["model.int8.onnx"]),
        "int8-v1.1.onnx": ("classifier@v1.1.0", v2_int8),
        "int8-prod.onnx": ("classifier#prod#1", v1["model.int8.onnx"]),
    }
    for out, (tail, _) in got.items():
        if isinstance(tail, list):
            sh(fresh, "dvc", "artifacts", "get", str(project), "classifier", *tail, "-o", out)
        elif tail:
            sh(fresh, *int8, tail, "-o", out)
    for out, (_, expected) in got.items():
        path = fresh / ("model.onnx" if out == "latest" else out)
        assert path.read_bytes() == expected, out
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        size = TINY["prepare"]["image_size"]
        logits = session.run(None, {"image": np.zeros((2, 1, size, size), np.float32)})[0]
        assert logits.shape == (2, 10)
    assert v1["model.onnx"] == (reproduced_base / "results/export/model.onnx").read_bytes()

    # INT8 is no model of the registry: a GTO tag for it (as gto writes for any name) finds no
    # artifact of that name in dvc.yaml
    register(project, "classifier-int8", "v1.0.0")
    unregistered = sh(
        fresh, "dvc", "artifacts", "get", str(project), "classifier-int8", check=False
    )
    assert unregistered.returncode != 0 and "Unable to find artifact" in unregistered.stderr
