"""Model files and metadata from someone else, predict in a shell pipe, a teammate's incomplete
remote: each gets a clear answer, never a wrong one and never code run from a file."""

import hashlib
import json
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image

from tests.conftest import ROOT, commit, copy_project, sh

pytestmark = pytest.mark.slow


class Payload:
    """Unpickling this runs code: it creates the file named by `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def evil_pt2(good: Path, dest: Path, marker: Path) -> Path:
    """A `.pt2` whose weights are pickles that run code: torch.export.load unpickles weights
    marked `use_pickle` with weights_only=False."""
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(dest, "w") as out:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("model_weights_config.json"):
                config = json.loads(data)
                for entry in config["config"].values():
                    entry["use_pickle"] = True
                data = json.dumps(config).encode()
            elif "/data/weights/weight_" in info.filename:
                data = pickle.dumps(Payload(marker))
            out.writestr(info, data)
    return dest


def forged(good: Path, dest: Path, **changes) -> Path:
    """model.onnx with its visionflow metadata changed (None: the key removed)."""
    model = onnx.load(str(good))
    meta = {p.key: p.value for p in model.metadata_props}
    spec = json.loads(meta["visionflow.preprocess"])
    for key, value in changes.items():
        if key == "classes" and value is None:
            meta.pop("visionflow.classes")
        elif key == "classes":
            meta["visionflow.classes"] = json.dumps(value)
        else:
            spec[key] = value
    meta["visionflow.preprocess"] = json.dumps(spec)
    del model.metadata_props[:]
    onnx.helper.set_model_props(model, meta)
    onnx.save(model, str(dest))
    return dest


def predict(project: Path, *args, check: bool = False) -> subprocess.CompletedProcess:
    return sh(
        project, sys.executable, "-m", "visionflow.cli", "predict", *map(str, args), check=check
    )


@pytest.fixture(scope="module")
def digit(reproduced_base, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("digit")
    x = np.load(reproduced_base / "data/prepared/test_x.npy")
    Image.fromarray(x[0, ..., 0]).save(folder / "digit.png")
    return folder / "digit.png"


def test_a_pt2_or_torchscript_file_never_runs_code_without_trust_code(
    reproduced_base, digit, tmp_path
):
    marker = tmp_path / "code-ran"
    evil = evil_pt2(reproduced_base / "results/export/model.pt2", tmp_path / "evil.pt2", marker)
    result = predict(reproduced_base, digit, "--model", evil)
    assert result.returncode == 2 and not marker.exists()  # refused before loading
    assert "can run code when loaded" in result.stderr and "--trust-code" in result.stderr
    assert "Traceback" not in result.stderr
    scripted = reproduced_base / "results/export/model.torchscript.pt"
    result = predict(reproduced_base, digit, "--model", scripted, "--json")
    assert result.returncode == 2 and "can run code" in result.stderr and not result.stdout
    trusted = predict(reproduced_base, digit, "--model", scripted, "--trust-code", "--json")
    assert trusted.returncode == 0 and json.loads(trusted.stdout)["predictions"]


def test_forged_metadata_is_an_error_naming_what_disagrees(reproduced_base, digit, tmp_path):
    """predict and the independent ONNX client check the metadata against the network."""
    good = reproduced_base / "results/export/model.onnx"
    ten = [str(i) for i in range(10)]
    cases = {
        "classes": (dict(classes=[*ten, "ten", "eleven"]), "lists 12 names, the network has 10"),
        "fewer": (dict(classes=ten[:5]), "lists 5 names, the network has 10"),
        "size": (dict(image_size=16), "takes ["),
        "mean": (dict(mean=[0.1, 0.2, 0.3]), "mean must be 1 finite numbers"),
        "std": (dict(std=[0.0]), "std must be"),
        "color": (dict(color="cmyk"), "color must be grayscale or rgb"),
        "missing": (dict(classes=None), "lacks the visionflow.classes metadata"),
    }
    client = [sys.executable, str(ROOT / "examples/onnx_client.py")]
    for name, (change, words) in cases.items():
        path = forged(good, tmp_path / f"{name}.onnx", **change)
        result = predict(reproduced_base, digit, "--model", path)
        assert result.returncode == 2 and words in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.stderr and not result.stdout, name
        answer = subprocess.run([*client, str(path), str(digit)], capture_output=True, text=True)
        assert answer.returncode != 0 and not answer.stdout, name
        assert answer.stderr.startswith("error: ") and "Traceback" not in answer.stderr, name
    assert json.loads(predict(reproduced_base, digit, "--json", check=True).stdout)["predictions"]


def test_predict_in_a_pipe_is_one_line_per_image_and_quiet_when_the_reader_goes(
    reproduced_base, digit, tmp_path
):
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(600):  # more than a batch: the pipe closes while predict still writes
        shutil.copy(digit, folder / f"{i:04d}.png")
    odd = folder / "a\tb\nc.png"
    shutil.copy(digit, odd)
    table = predict(reproduced_base, odd, digit, check=True).stdout.splitlines()
    assert len(table) == 2 and table[0].split("\t")[0] == f"{folder}/a\\tb\\nc.png"
    assert len(table[0].split("\t")) == 1 + 2 * 3  # file, then class and probability x top 3
    lines = predict(reproduced_base, odd, "--json", check=True).stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["file"] == str(odd)

    # the reader is gone before predict writes: a quiet stop, as `cat` stops
    cmd = [sys.executable, "-m", "visionflow.cli", "predict", str(folder)]
    process = subprocess.Popen(
        cmd, cwd=reproduced_base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    process.stdout.close()
    assert process.wait() == 141 and process.stderr.read() == ""
    process.stderr.close()
    head = subprocess.run(
        f"{' '.join(cmd)} --json | head -n 2",
        shell=True,
        cwd=reproduced_base,
        capture_output=True,
        text=True,
    )
    assert head.stderr == "" and len(head.stdout.splitlines()) == 2
    assert all(json.loads(line)["predictions"] for line in head.stdout.splitlines())


def test_a_missing_model_names_the_output_and_the_ways_to_get_it_back(
    reproduced_base, digit, tmp_path
):
    """A teammate's clone whose remote lacks one object: `dvc pull` names a hash only; predict
    names the file, `dvc pull export` from a complete remote, and `dvc repro export`."""
    first, storage = copy_project(reproduced_base, tmp_path / "first"), tmp_path / "storage"
    sh(first, "dvc", "remote", "add", "-d", "storage", str(storage))
    commit(first, "a DVC remote")
    sh(first, "dvc", "push")
    onnx_file = first / "results/export/model.onnx"
    onnx_file.unlink()  # the workspace lacks it, DVC's cache has it
    result = predict(first, digit)
    assert result.returncode == 2 and "`dvc checkout export` puts it back" in result.stderr
    sh(first, "dvc", "checkout", "export")
    assert onnx_file.is_file()

    md5 = hashlib.md5(onnx_file.read_bytes()).hexdigest()
    (storage / "files/md5" / md5[:2] / md5[2:]).unlink()  # the remote lacks one object
    second = tmp_path / "second"
    sh(tmp_path, "git", "clone", "-q", str(first), str(second))
    pulled = sh(second, "dvc", "pull", check=False)
    assert pulled.returncode != 0
    result = predict(second, digit)
    assert result.returncode == 2 and "results/export/model.onnx is missing" in result.stderr
    assert "`dvc pull export`" in result.stderr and "`dvc repro export`" in result.stderr
    assert "Traceback" not in result.stderr
