"""Model files and metadata from someone else, predict in a shell pipe, a teammate's incomplete
remote: each gets a clear answer, never a wrong one and never code run from a file."""

import base64
import hashlib
import json
import os
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

from tests.helpers import ROOT, commit, copy_project, python_path, sh

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
        "gap": (dict(reducing_gap="x"), "reducing_gap must be null or a number over 1"),
        "gap below 1": (dict(reducing_gap=0.5), "reducing_gap must be null or a number over 1"),
        "draft": (dict(jpeg_draft="no"), "jpeg_draft must be true or false"),
        "resize": (dict(resize="sinc"), "resize must be one of"),
        "fit": (dict(fit="stretch"), "fit must be one of"),
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


# Ten more inputs of this kind (issue #29's closing request), each once wrong or a traceback.


def test_model_files_newer_than_onnxruntime_or_with_custom_ops_say_why(
    reproduced_base, digit, tmp_path
):
    """Before, ONNX Runtime's message was cut at 200 characters inside a C++ signature, before
    the versions that say what to do; a custom-op domain named only an op."""
    good = onnx.load(str(reproduced_base / "results/export/model.onnx"))
    files = {}
    for name, change in {
        "opset": lambda m: setattr(m.opset_import[0], "version", 999),
        "ir": lambda m: setattr(m, "ir_version", 99),
        "custom": lambda m: (
            setattr(m.graph.node[0], "domain", "com.example"),
            m.opset_import.add(domain="com.example", version=1),
        ),
    }.items():
        model = onnx.ModelProto()
        model.CopyFrom(good)
        change(model)
        files[name] = tmp_path / f"{name}.onnx"
        onnx.save(model, str(files[name]))
    words = {
        "opset": "uses opset 999, and this onnxruntime",
        "ir": "uses ONNX IR version 99, and this onnxruntime",
        "custom": "uses operator Conv of domain com.example, which ONNX Runtime lacks",
    }
    for name, path in files.items():
        result = predict(reproduced_base, digit, "--model", path)
        assert result.returncode == 2 and words[name] in result.stderr, result.stderr
        assert len(result.stderr.splitlines()) == 1 and not result.stdout


def test_a_foreign_model_pt_is_refused_before_the_network_is_built(
    reproduced_base, digit, tmp_path, capsys
):
    """Before: extra pickled objects gave torch's advice to load the file unsafely (with
    terminal colour codes); forged meta gave KeyError 'meta', a TypeError, or an attempt to
    allocate a petabyte for image_size 10**6."""
    import torch

    from visionflow.cli import main

    saved = torch.load(reproduced_base / "results/train/model.pt", weights_only=True)
    marker = tmp_path / "code-ran"
    cases = {
        "pickle": ({**saved, "extra": Payload(marker)}, "holds pickled objects besides tensors"),
        "size": (
            {**saved, "meta": {**saved["meta"], "image_size": 10**6}},
            "image_size must be a whole number of px, 1 to 1024: 1000000",
        ),
        "model": (
            {**saved, "meta": {**saved["meta"], "model": "resnet9000"}},
            "model 'resnet9000' is none of the project's or torchvision's",
        ),
        "meta": ({"state_dict": saved["state_dict"]}, "its meta lacks model, in_channels"),
    }
    for name, (content, words) in cases.items():
        torch.save(content, tmp_path / f"{name}.pt")
        assert main(["predict", str(digit), "--model", str(tmp_path / f"{name}.pt")]) == 2
        out, err = capsys.readouterr()
        assert words in err and len(err.splitlines()) == 1 and not out, (name, err)
    assert not marker.exists()


def test_class_and_file_names_cannot_drive_the_terminal_or_break_json(
    reproduced_base, digit, tmp_path
):
    """A forged class name with an escape sequence cleared the user's terminal, one with U+202E
    showed reversed; an empty or 50 MB name was printed as is; a file name that is not UTF-8
    became a lone surrogate (\\udcff) in --json, which strict JSON parsers refuse."""
    good = reproduced_base / "results/export/model.onnx"
    ten = [str(i) for i in range(10)]
    odd = forged(good, tmp_path / "odd.onnx", classes=["\x1b[2J", "\u202egnp.exe", *ten[2:]])
    table = predict(reproduced_base, digit, "--model", odd, "--top-k", "10", check=True).stdout
    assert "\\x1b[2J" in table and "\\u202egnp.exe" in table
    assert "\x1b" not in table and "\u202e" not in table
    for name, classes in {"empty": ["", *ten[1:]], "long": ["x" * 300, *ten[1:]]}.items():
        result = predict(
            reproduced_base, digit, "--model", forged(good, tmp_path / name, classes=classes)
        )
        assert result.returncode == 2 and "empty or over 255 bytes" in result.stderr, name

    folder = tmp_path / "names"
    folder.mkdir()
    shutil.copy(digit, folder / b"\xff.png".decode("utf-8", "surrogateescape"))
    line = predict(reproduced_base, folder, "--json", check=True).stdout
    assert line.isascii() and "\\udcff" not in line
    assert json.loads(line)["file"] == f"{folder}/\\xff.png"  # for display
    shutil.copy(digit, folder / "\\xff.png")  # a name that is those four characters
    lines = [json.loads(x) for x in predict(reproduced_base, folder, "--json").stdout.splitlines()]
    named = {
        os.fsdecode(base64.b64decode(x["file_bytes"])) if "file_bytes" in x else x["file"]
        for x in lines
    }
    assert named == {str(p) for p in folder.iterdir()}  # each its own: the names are exact


def test_predict_from_a_subfolder_or_with_nowhere_to_write(reproduced_base, digit):
    """Before: from a subfolder of the project, "no model file at results/export/model.onnx:
    `dvc repro` makes it"; `>&-` and a full disk ended in tracebacks; `-` (stdin) was "no
    such file"."""
    env = {**os.environ, "PYTHONPATH": python_path(reproduced_base / "src")}
    cmd = f"{sys.executable} -m visionflow.cli predict {digit}"
    inside = subprocess.run(
        f"{cmd} --json",
        shell=True,
        cwd=reproduced_base / "results",
        env=env,
        capture_output=True,
        text=True,
    )
    assert inside.returncode == 0 and json.loads(inside.stdout)["predictions"], inside.stderr
    for redirect, words in {
        ">&-": "error: standard output is closed",
        ">/dev/full": "error: cannot write the predictions: No space left on device",
    }.items():
        result = subprocess.run(
            f"{cmd} {redirect}",
            shell=True,
            cwd=reproduced_base,
            env=env,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 2 and result.stderr.startswith(words), result.stderr
        assert len(result.stderr.splitlines()) == 1, result.stderr
    result = predict(reproduced_base, "-")
    assert result.returncode == 2 and "not standard input: save it to a file" in result.stderr


def test_an_empty_or_missing_prepare_path_is_named_before_dvc_runs(reproduced_base, tmp_path):
    """Before: `prepare.path: ""` made DVC stop with "unexpected error" (and the checker said
    `prepare.path:  holds results/check...`); a clone without data/raw got DVC's "[Errno 2] No
    such file or directory" and no way out."""
    (tmp_path / ".dvc").mkdir()
    shutil.copy(reproduced_base / "dvc.yaml", tmp_path)
    params = (reproduced_base / "params.yaml").read_text()
    expected = {
        '""': "prepare.path: empty: name the folder of images",
        "data/raw": "prepare.path data/raw does not exist, and stage prepare depends on it",
        "~/photos": "prepare.path ~/photos does not exist (`~` is not expanded",
    }
    for value, words in expected.items():
        (tmp_path / "params.yaml").write_text(params.replace("path: data/raw", f"path: {value}"))
        result = subprocess.run(
            [sys.executable, "-m", "visionflow.cli", "repro"],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": python_path(ROOT / "src")},
            capture_output=True,
            text=True,
        )
        assert result.returncode == 1 and words in result.stderr, (value, result.stderr)
        assert "Traceback" not in result.stderr and "Running stage" not in result.stdout


def test_a_file_removed_while_predict_runs_is_one_error_line(
    reproduced_base, digit, tmp_path, monkeypatch, capsys
):
    """Before: a file listed, then deleted before it was decoded, ended in a traceback
    (FileNotFoundError from the size check), and the other images' lines were lost."""
    from visionflow import cli

    folder = tmp_path / "changing"
    folder.mkdir()
    for name in ("a.png", "b.png"):
        shutil.copy(digit, folder / name)
    listed = cli.expand

    def expand_then_delete(inputs):  # another process removes b.png just after the listing
        found = listed(inputs)
        (folder / "b.png").unlink()
        return found

    monkeypatch.setattr(cli, "expand", expand_then_delete)
    model = reproduced_base / "results/export/model.onnx"
    assert cli.main(["predict", str(folder), "--model", str(model), "--json"]) == 1
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0]["predictions"] and lines[1]["error"].endswith(
        "cannot read: No such file or directory"
    )
    assert err == f"error: cannot decode {folder}/b.png: cannot read: No such file or directory\n"


def test_doctor_names_a_linked_params_yaml_and_a_link_to_nothing(tmp_path):
    """Before: `visionflow doctor` said "pipeline up to date" beside a symlinked params.yaml (which
    `dvc exp run --queue` loses edits to) and passed on DVC's "unexpected error" for a dep that
    links to nothing; it now runs the same preflight as `visionflow repro`, one FAIL line each.
    Asked in this process: a doctor process imports everything it checks (tests/test_doctor.py
    runs the command and its exit code)."""
    from visionflow.ops.doctor import workspace

    (tmp_path / ".dvc").mkdir()
    (tmp_path / "data/raw").mkdir(parents=True)
    shutil.copy(ROOT / "dvc.yaml", tmp_path)
    shutil.copy(ROOT / "params.yaml", tmp_path / "real.yaml")
    (tmp_path / "params.yaml").symlink_to(tmp_path / "real.yaml")
    (tmp_path / "data/raw/gone.png").symlink_to(tmp_path / "nowhere.png")

    def failed() -> list[str]:
        checks = workspace(tmp_path)
        assert not [c for c in checks if c["check"] == "pipeline"]  # no "up to date" beside it
        return [c["found"] for c in checks if c["status"] == "FAIL"]

    linked = failed()
    assert any("params.yaml" in line and "is a symbolic link" in line for line in linked), linked
    (tmp_path / "params.yaml").unlink()
    shutil.copy(tmp_path / "real.yaml", tmp_path / "params.yaml")
    dangling = failed()
    assert len(dangling) == 1 and "gone.png is a link to" in dangling[0], dangling
