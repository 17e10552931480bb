"""The real DVC pipeline in a temporary git repo, on tiny params: what `dvc repro` users rely on."""

import json
import os
import re
import shutil
import sys

import numpy as np
import onnx
import pytest
import yaml
from PIL import Image

from tests.helpers import ROOT, TINY, copy_project, python_path, sh, solid, write_params

pytestmark = pytest.mark.slow
STAGES = ["check", "prepare", "sanity", "train", "evaluate", "export"]


def ran(result) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", result.stdout)


@pytest.fixture(scope="module")
def reproduced(reproduced_base, tmp_path_factory):
    """A copy of the session's reproduced project for the tests that only read it (and run
    commands in it, which write DVC's scratch files)."""
    return copy_project(reproduced_base, tmp_path_factory.mktemp("repro") / "project")


def readable(path) -> bool:
    """The file is there and holds what its name says: JSON, a PNG, an array, a curve, a model."""
    if path.suffix == ".json":
        return json.loads(path.read_text()) not in ({}, [], None)
    if path.suffix == ".png":
        with Image.open(path) as image:
            return image.format == "PNG" and min(image.size) >= 32
    if path.suffix == ".npy":
        return np.load(path, mmap_mode="r").size > 0
    if path.suffix == ".tsv":
        return len(path.read_text().splitlines()) == 1 + TINY["train"]["epochs"]
    if path.suffix == ".onnx":
        onnx.checker.check_model(str(path))
        return True
    if path.name == "model.pt":
        import torch

        return bool(torch.load(path, weights_only=True)["state_dict"])
    return path.stat().st_size > 0  # MODEL_CARD.md, model.pt2, model.torchscript.pt


def test_every_stage_writes_its_outputs(reproduced):
    lock = yaml.safe_load((reproduced / "dvc.lock").read_text())
    assert list(lock["stages"]) == STAGES
    for path in [
        "results/check/params.json",
        "data/prepared/train_x.npy",
        "data/prepared/manifest.json",
        "results/sanity/labels.png",
        "results/sanity/scan.json",
        "results/train/model.pt",
        "results/train/metrics.json",
        "results/train/health.json",
        "results/train/live/plots/metrics/val/accuracy.tsv",
        "results/evaluate/metrics.json",
        "results/evaluate/scores.json",
        "results/evaluate/predictions.json",
        "results/evaluate/confusion.png",
        "results/evaluate/misclassified.png",
        "results/evaluate/top_losses.png",
        "results/evaluate/most_confused.json",
        "results/sanity/eval_view.png",
        "results/export/model.onnx",
        "results/export/model.pt2",
        "results/export/model.torchscript.pt",
        "results/export/parity.json",
        "results/export/metrics.json",
        "results/export.timings/latency.json",  # no output: it differs on every run
        "results/export/MODEL_CARD.md",
    ]:
        assert readable(reproduced / path), path
    scores = json.loads((reproduced / "results/evaluate/scores.json").read_text())
    test_images = len(np.load(reproduced / "data/prepared/test_y.npy"))
    assert (
        scores["images"] == test_images and 0 <= scores["accuracy"] <= scores["top_k_accuracy"] <= 1
    )
    assert sum(c["support"] for c in scores["per_class"].values()) == test_images
    parity = json.loads((reproduced / "results/export/parity.json").read_text())
    assert parity["passed"] is True
    assert set(parity["onnx"]) == {"batch_1", "batch_3", "batch_8"}
    onnx_file = onnx.load(str(reproduced / "results/export/model.onnx"))
    assert parity["opset"] == next(o.version for o in onnx_file.opset_import if o.domain == "")
    card = (reproduced / "results/export/MODEL_CARD.md").read_text()
    assert "onnxruntime" in card and "| onnx | batch_8 |" in card


@pytest.fixture(scope="module")
def test_pngs(reproduced, tmp_path_factory):
    """The first 40 test images of the cache, written as PNG files (exact pixels)."""
    folder = tmp_path_factory.mktemp("pngs")
    x = np.load(reproduced / "data/prepared/test_x.npy")
    paths = []
    for i in range(40):
        paths.append(folder / f"{i:03d}.png")
        Image.fromarray(x[i, ..., 0]).save(paths[-1])
    return paths


@pytest.fixture
def predict(reproduced, monkeypatch, capsys):
    """`visionflow predict ARGS` in the project, in this process (the CLI's own code; its
    import-free ONNX path has a subprocess test of its own): (exit code, stdout, stderr)."""
    from visionflow.cli import main

    monkeypatch.chdir(reproduced)

    def run(*args):
        capsys.readouterr()
        code = main(["predict", *map(str, args)])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.mark.parametrize("runtime", ["onnx", "pt2", "torchscript", "torch"])
def test_predict_agrees_with_evaluate(reproduced, predict, test_pngs, runtime):
    evaluated = json.loads((reproduced / "results/evaluate/predictions.json").read_text())
    code, out, err = predict("--json", "--runtime", runtime, "--trust-code", *test_pngs)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]  # JSON Lines: an object per image
    predicted = [row["predictions"][0]["class"] for row in rows]
    assert predicted == [row["predicted"] for row in evaluated[:40]]
    assert all(len(row["predictions"]) == 3 for row in rows)


def test_onnx_only_client_gets_the_same_predictions(reproduced, predict, test_pngs, tmp_path):
    # torch and visionflow cannot be imported by the client: shadow both with failing packages
    for name in ("torch", "visionflow", "torchvision"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} is not allowed')")
    env = {**os.environ, "PYTHONPATH": python_path(tmp_path)}
    folder = tmp_path / "images"  # more than one of the client's batches of 64
    folder.mkdir()
    for i in range(80):
        shutil.copy(test_pngs[i % len(test_pngs)], folder / f"{i:03d}.png")
    wide = folder / "sixteen_bit.png"  # 16-bit: training scales it; the client clipped it
    x = np.load(reproduced / "data/prepared/test_x.npy")
    Image.fromarray(x[0, ..., 0].astype(np.uint16) * 257).save(wide)
    (folder / "zz_broken.png").write_bytes(b"not a PNG")  # one line saying so; the rest go on
    import subprocess

    client = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/onnx_client.py"),
            str(reproduced / "results/export/model.onnx"),
            str(folder),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert client.returncode == 1 and "error: " in client.stderr  # the broken file, named
    lines = [json.loads(line) for line in client.stdout.splitlines()]
    rows = [json.loads(line) for line in predict("--json", folder)[1].splitlines()]
    assert [line["file"] for line in lines] == [row["file"] for row in rows]  # one stable order
    assert len(lines) == 82 and "82/82 images" in client.stderr
    assert "error" in lines[-1] and "error" in rows[-1]
    lines, rows = lines[:-1], rows[:-1]
    assert [line["class"] for line in lines] == [row["predictions"][0]["class"] for row in rows]
    probabilities = [row["predictions"][0]["probability"] for row in rows]
    assert [line["probability"] for line in lines] == pytest.approx(probabilities, abs=1e-6)


def test_predict_on_a_long_folder_into_a_pipe_shows_progress(predict, test_pngs, tmp_path):
    for i in range(300):  # more than one batch of 256
        shutil.copy(test_pngs[i % len(test_pngs)], tmp_path / f"{i:03d}.png")
    code, out, err = predict("--json", tmp_path)
    assert code == 0 and len(out.splitlines()) == 300
    assert re.search(r"^predict: 300/300 images in [\d.]+ s \(\d+/s\)$", err, re.M), err


def test_predict_takes_the_runtime_from_the_file_and_names_a_mismatch(
    reproduced, predict, test_pngs, tmp_path
):
    export = reproduced / "results/export"
    code, out, err = predict(
        "--json", "--model", export / "model.pt2", "--trust-code", test_pngs[0]
    )
    assert code == 0 and json.loads(out)["predictions"], err
    for model, runtime, real in (
        ("model.onnx", "torchscript", "an ONNX file"),
        ("model.pt2", "torch", "a torch.export .pt2 file"),
        ("model.torchscript.pt", "pt2", "a TorchScript file"),
    ):
        code, _, err = predict("--model", export / model, "--runtime", runtime, test_pngs[0])
        assert code == 2 and f"is {real}, not for --runtime {runtime}" in err
    for model in ("model.torchscript.pt", "model.pt2"):  # files that can run code
        code, _, err = predict("--model", export / model, test_pngs[0])
        assert code == 2 and "which can run code when loaded" in err and "--trust-code" in err
    _, _, err = predict(
        "--model", export / "model.torchscript.pt", "--runtime", "onnx", test_pngs[0]
    )
    assert err.count("\n") == 1  # one line: the file is not loaded
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes((export / "model.onnx").read_bytes()[:1000])
    code, _, err = predict("--model", truncated, test_pngs[0])
    assert code == 2 and f"error: {truncated} could not be loaded" in err


def test_nothing_to_predict_is_an_error(predict, tmp_path):
    code, _, err = predict(tmp_path)
    assert code == 2 and f"no image files in {tmp_path}" in err


def test_the_onnx_path_of_predict_never_imports_torch(reproduced, test_pngs):
    probe = (
        "import sys\nfrom visionflow.cli import main\ncode = main(sys.argv[1:])\n"
        "print('torch' in sys.modules, 'torchvision' in sys.modules, code)"
    )
    result = sh(reproduced, sys.executable, "-c", probe, "predict", str(test_pngs[0]))
    assert result.stdout.splitlines()[-1] == "False False 0"
    assert "Traceback" not in result.stderr


def test_predict_names_a_corrupt_image_and_still_predicts_the_rest(predict, test_pngs, tmp_path):
    bad = tmp_path / "truncated.png"
    bad.write_bytes(test_pngs[0].read_bytes()[:40])
    code, out, err = predict("--json", test_pngs[0], bad, test_pngs[1])
    assert code == 1
    assert f"cannot decode {bad}" in err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [("predictions" in row) for row in rows] == [True, False, True]
    assert str(bad) in rows[1]["error"]


def test_a_new_pretrained_weights_file_makes_train_stale(reproduced):
    weights = reproduced / "data/pretrained/resnet18.pt"
    weights.write_bytes(b"weights")
    try:
        stale = json.loads(sh(reproduced, "dvc", "status", "--json").stdout)
        assert set(stale) == {"train"}  # and what follows it, once train has rerun
    finally:
        weights.unlink()
    assert json.loads(sh(reproduced, "dvc", "status", "--json").stdout or "{}") == {}


def test_rerun_only_what_changed(reproduced_base, tmp_path):
    """A retrain and its metrics diff: test_nothing_lost's run-cache test; a parity miss:
    test_nothing_lost's failed plain `dvc repro` test."""
    project = copy_project(reproduced_base, tmp_path / "project")
    assert ran(sh(project, "dvc", "repro")) == []
    write_params(project, {"sanity": {"per_class": 3}})
    assert ran(sh(project, "dvc", "repro")) == ["check", "sanity"]  # same scan.json: no train


def test_imagefolder_and_archive_sources_are_tracked_dependencies(project, image_folder, tmp_path):
    folder = {
        "source": "imagefolder",
        "path": str(image_folder),
        "color": "rgb",
        "val_fraction": 0.25,
        "max_bad_fraction": 0.2,
        "min_per_class": 2,
    }
    write_params(project, {"prepare": folder})
    result = sh(project, "dvc", "repro", "prepare")
    assert (
        ran(result) == ["check", "prepare"] and "3 files rejected" in result.stdout
    )  # the stray notes
    classes = json.loads((project / "data/prepared/classes.json").read_text())
    assert classes == ["blue", "green", "red"]
    rejects = json.loads((project / "data/prepared/rejects.json").read_text())
    assert set(rejects["files"]) == {"blue/notes.txt", "green/notes.txt", "red/notes.txt"}
    assert sh(project, "dvc", "status", "prepare").stdout.strip().endswith("up to date.")
    (image_folder / "red" / "6.png").write_bytes((image_folder / "red" / "0.png").read_bytes())
    assert "changed deps" in sh(project, "dvc", "status", "prepare").stdout
    (image_folder / "red" / "6.png").unlink()

    zipped = shutil.make_archive(str(tmp_path / "images"), "zip", image_folder.parent, "images")
    write_params(project, {"prepare": {**folder, "path": zipped}})
    assert ran(sh(project, "dvc", "repro", "prepare")) == ["check", "prepare"]
    arrays = {
        n: (project / "data/prepared" / n).read_bytes() for n in ("train_x.npy", "test_y.npy")
    }
    assert json.loads((project / "data/prepared/classes.json").read_text()) == classes
    write_params(project, {"prepare": folder})  # the folder and its archive give the same cache
    sh(project, "dvc", "repro", "prepare")
    assert arrays == {n: (project / "data/prepared" / n).read_bytes() for n in arrays}


def test_a_class_whose_val_and_test_images_are_all_copies_is_refused_by_name(project, tmp_path):
    """Burst photos: every 'burst' image is a pixel copy of the others, so dedupe would leave it
    no val or test image and evaluate would score it on nothing. Plain `dvc repro` stops at
    prepare with one line naming the class and the key; nothing half-written, nothing recorded."""
    images = tmp_path / "images"
    for name in ("burst", "scene"):
        (images / name).mkdir(parents=True)
    for i in range(8):
        solid((200, 30, 30)).save(images / "burst" / f"{i}.png")
        scene = solid((30, 200, 30))
        scene.putpixel((i, 0), (128, 128, 128))  # each scene image distinct
        scene.save(images / "scene" / f"{i}.png")
    write_params(
        project, {"prepare": {"source": "imagefolder", "path": str(images), "color": "rgb"}}
    )
    result = sh(project, "dvc", "repro", check=False)
    assert result.returncode != 0 and ran(result) == ["check", "prepare"]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: prepare.dedupe: class 'burst' lost every val and test image (1 val, 2 test): each "
        "was a pixel copy of an image in an earlier split (burst/6.png is one), so the class would "
        "be scored on no image; give it distinct images, or set this false to keep the copies "
        "(they leak)"
    ], result.stderr
    assert "Traceback" not in result.stderr
    assert not any((project / "data").glob("prepared*"))  # no cache, no half-written one
    recorded = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert "prepare" not in recorded


def test_verify_is_not_all_good_when_the_manifest_or_the_cache_is_gone(reproduced_base, tmp_path):
    project = copy_project(reproduced_base, tmp_path / "project")
    verify = [sys.executable, "-m", "visionflow.cli", "verify"]
    classes = project / "data/prepared/classes.json"  # class names go into every exported model
    original = classes.read_bytes()
    classes.write_text(classes.read_text().replace('"0"', '"O"'))
    result = sh(project, *verify, check=False)
    assert result.returncode == 1 and "classes.json: sha256" in result.stdout
    classes.write_bytes(original)
    manifest = project / "data/prepared/manifest.json"
    original = manifest.read_bytes()
    manifest.write_text("{not json")
    result = sh(project, *verify, check=False)
    assert result.returncode == 1 and "is not a manifest prepare wrote" in result.stdout
    assert "Traceback" not in result.stderr
    manifest.write_bytes(original)
    assert sh(project, *verify).returncode == 0
    (project / "data/prepared/manifest.json").unlink()
    result = sh(project, *verify, check=False)
    assert result.returncode == 1 and "manifest.json is missing" in result.stdout
    shutil.rmtree(project / "data/prepared")
    result = sh(project, *verify, check=False)
    assert result.returncode == 1 and "all good" not in result.stdout
