"""Stage entry points run as DVC runs them (`python -m pipeline.<stage>` in the project folder)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT, digits_cache, python_path, write_params


@pytest.fixture
def cache(tmp_path):
    """A small real cache (digits at 8x8) and the shipped params.yaml in a working folder."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    digits_cache(tmp_path / "prepared")
    return tmp_path


def stage(cwd, module, *args):
    """`python -m MODULE ARGS` in `cwd`, as dvc.yaml's command runs it."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": python_path(ROOT)},
    )


def test_sanity_writes_grids_counts_and_scan(cache):
    result = stage(cache, "pipeline.sanity", "--data", "prepared", "--out", "sanity")
    assert result.returncode == 0, result.stderr
    out = cache / "sanity"
    for name in ("labels.png", "augmented.png", "counts.png", "scan.json"):
        assert (out / name).stat().st_size > 0, name
    train_counts = json.loads((out / "counts/train.json").read_text())
    assert [row["class"] for row in train_counts] == [str(i) for i in range(10)]
    scan = json.loads((out / "scan.json").read_text())
    assert sum(row["images"] for row in train_counts) == scan["splits"]["train"]["images"]
    assert scan["finite"] and scan["splits"]["test"]["label_range"] == [0, 9]
    assert scan["normalised_mean"][0] == pytest.approx(0, abs=1e-5)  # train stats normalise train
    assert scan["normalised_std"][0] == pytest.approx(1, abs=1e-4)
    assert scan["duplicates"]["across_splits"] == 0 and scan["rejected_files"] == 0


def labels_out_of_range(cache) -> None:
    y = np.load(cache / "prepared/val_y.npy")
    y[3] = 12
    np.save(cache / "prepared/val_y.npy", y)


def test_sanitys_scan_fails_on_labels_out_of_range_with_the_numbers(cache):
    """The scan, in this process; the test below runs the stage."""
    from pipeline import GateError
    from pipeline.sanity import scan

    labels_out_of_range(cache)
    with pytest.raises(
        GateError, match=r"^val: labels span 0\.\.12, outside 0\.\.9 for 10 classes"
    ):
        scan(cache / "prepared", [str(i) for i in range(10)])


@pytest.mark.slow
def test_sanity_fails_on_labels_out_of_range_with_the_numbers(cache):
    labels_out_of_range(cache)
    result = stage(cache, "pipeline.sanity", "--data", "prepared", "--out", "sanity")
    assert result.returncode == 1
    assert "val: labels span 0..12, outside 0..9 for 10 classes" in result.stderr


def test_sanity_fails_on_image_label_count_mismatch(cache):
    images = len(np.load(cache / "prepared/test_x.npy", mmap_mode="r"))
    np.save(cache / "prepared/test_y.npy", np.load(cache / "prepared/test_y.npy")[:-2])
    result = stage(cache, "pipeline.sanity", "--data", "prepared", "--out", "sanity")
    assert result.returncode == 1
    assert f"test: {images} images but {images - 2} labels" in result.stderr


def test_evaluate_refuses_a_model_with_another_class_count(cache):
    from visionflow.train.models import build_model, save_model

    model = build_model("simple_cnn", 1, 3, 8)
    meta = {
        "model": "simple_cnn",
        "in_channels": 1,
        "image_size": 8,
        "dropout": 0.0,
        "classes": ["a", "b", "c"],
        "mean": [0.3],
        "std": [0.3],
        "background": [255] * 3,
    }
    save_model(model, meta, cache / "model.pt")
    result = stage(
        cache, "pipeline.evaluate", "--model", "model.pt", "--data", "prepared", "--out", "ev"
    )
    assert result.returncode == 1
    assert (
        "the model has 3 classes ['a', 'b', 'c'], but the cache's classes.json has 10"
        in result.stderr
    )
    assert not (cache / "ev" / "metrics.json").exists()


def test_evaluate_names_a_class_the_test_split_lacks(tmp_path):
    """A class of 5 images beside one of 55, at test_fraction 0.1, gets no test image from the
    stratified split: evaluate says so in its log, scores.json and metrics.json, beside the
    macro F1 that counts it as 0."""
    from visionflow.data import dataset, sources
    from visionflow.train.models import build_model, save_model

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    images = np.random.default_rng(0).integers(0, 256, (60, 8, 8), dtype=np.uint8)
    labels = np.repeat([0, 1], [55, 5])
    names = [f"{['big', 'small'][c]}/IMG_{i:04d}.jpg" for i, c in enumerate(labels)]
    source = sources.Source(list(images), labels, ["big", "small"], None, names)
    decode = dataset.Decode(8, "grayscale")
    manifest = dataset.build_cache(
        source, tmp_path / "prepared", decode, val_fraction=0.15, test_fraction=0.1, seed=0
    )
    assert manifest["counts"]["test"] == {"big": 6, "small": 0}
    meta = {
        "model": "simple_cnn",
        "in_channels": 1,
        "image_size": 8,
        "dropout": 0.0,
        "classes": ["big", "small"],
        "mean": [0.5],
        "std": [0.3],
        "background": [255] * 3,
    }
    save_model(build_model("simple_cnn", 1, 2, 8), meta, tmp_path / "model.pt")
    result = stage(
        tmp_path, "pipeline.evaluate", "--model", "model.pt", "--data", "prepared", "--out", "ev"
    )
    assert result.returncode == 0, result.stderr
    assert (
        "evaluate: warning: no test image of class 'small': the accuracy says nothing of it, "
        "and macro F1 counts it as 0 (scores.json: classes_absent_from_test)"
    ) in result.stdout.splitlines()
    # each prediction names its file (#58: a fastai user finds a wrong image by its name)
    rows = json.loads((tmp_path / "ev/predictions.json").read_text())
    tested = dataset.read_names(tmp_path / "prepared", "test")
    assert [row["file"] for row in rows] == tested and tested[0].startswith("big/IMG_")
    scores = json.loads((tmp_path / "ev/scores.json").read_text())
    assert scores["classes_absent_from_test"] == ["small"]
    assert scores["per_class"]["small"]["support"] == 0
    metrics = json.loads((tmp_path / "ev/metrics.json").read_text())
    assert metrics.keys() == {"accuracy", "macro_f1", "top_k_acc", "loss", "absent_classes"}
    assert metrics["absent_classes"] == 1


def test_prepare_names_the_params_key_of_a_limit(image_folder, tmp_path):
    """The library says which of its limits the data went over; the stage names the key."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    write_params(
        tmp_path,
        {
            "prepare": {
                "source": "imagefolder",
                "path": str(image_folder),
                "min_per_class": 50,
                "max_bad_fraction": 0.5,
            }
        },
    )
    result = stage(tmp_path, "pipeline.prepare", "--out", "prepared")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    error = result.stderr.splitlines()[-1]
    assert error.startswith(
        "error: prepare.min_per_class: classes below the minimum of 50 images: {'blue': 8,"
    ), result.stderr
    assert not (tmp_path / "prepared").exists()


def test_a_refused_prepare_names_where_the_full_list_of_rejects_is(image_folder, tmp_path):
    """Too many rejects: the error says the list was cut and names the file that has it whole,
    beside the output. Before, the full list went with the discarded staging folder, and the
    rejects.json left in the output was the previous run's."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    folder = {"source": "imagefolder", "path": str(image_folder), "max_bad_fraction": 0.5}
    write_params(tmp_path, {"prepare": folder})
    assert stage(tmp_path, "pipeline.prepare", "--out", "data/prepared").returncode == 0
    for i in range(48):  # with the 3 stray notes.txt: 51 rejects, one more than are listed
        (image_folder / "red" / f"empty{i:02d}.png").write_bytes(b"")
    result = stage(tmp_path, "pipeline.prepare", "--out", "data/prepared")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    error = next(line for line in result.stderr.splitlines() if line.startswith("error: "))
    assert error == (
        "error: prepare.max_bad_fraction: 51 of 75 files rejected (68.0%), over the limit of "
        "50.0% (all of them, each with its reason: data/prepared.rejects.json):"
    )
    assert "  (50 of 51 shown; the full list: data/prepared.rejects.json)" in result.stderr
    previous = json.loads((tmp_path / "data/prepared/rejects.json").read_text())
    refused = json.loads((tmp_path / "data/prepared.rejects.json").read_text())
    assert previous["rejected"] == 3 and len(refused["files"]) == 51
    assert not (tmp_path / "data/prepared.partial").exists()
    write_params(tmp_path, {"prepare": {**folder, "max_bad_fraction": 0.7}})
    assert stage(tmp_path, "pipeline.prepare", "--out", "data/prepared").returncode == 0
    assert not (tmp_path / "data/prepared.rejects.json").exists()  # stale once a run passes


def test_outputs_are_published_whole_or_not_at_all(tmp_path):
    """`run` moves a stage's staging folder into place only when it succeeded (then the actions
    that wait for it run); a failed stage's staging folder goes and the old output stays."""
    import pipeline

    out = tmp_path / "results" / "train"
    out.mkdir(parents=True)
    (out / "model.pt").write_text("old")
    done = []
    (pipeline.staged(out) / "model.pt").write_text("new")
    pipeline.when_published(lambda: done.append((out / "model.pt").read_text()))
    assert (out / "model.pt").read_text() == "old" and not done
    pipeline.publish()
    assert done == ["new"] and sorted(p.name for p in out.parent.iterdir()) == ["train"]
    (pipeline.staged(out) / "model.pt").write_text("refused")
    pipeline.when_published(lambda: done.append("never"))
    pipeline.discard()
    pipeline.publish()  # nothing left to publish
    assert (out / "model.pt").read_text() == "new" and done == ["new"]
    assert not out.with_name("train.partial").exists()


def test_a_stage_names_the_params_and_deps_that_changed_while_it_ran(tmp_path, monkeypatch):
    """Outside a DVC project (a stage run by hand) DVC has no hash to compare a touched file
    with, so a changed stat is a change, said as such."""
    import pipeline

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("a.png", "b.png", ".hidden"):
        (tmp_path / "data" / name).write_text(name)
    (tmp_path / "params.yaml").write_text("train:\n  lr: 0.001\n  epochs: 4\nother: 1\n")
    spec = {"deps": ["${prepare.path}"], "params": ["train"]}
    before = pipeline.Snapshot(spec, {"prepare": {"path": "data"}, "train": {"lr": 0.001}})
    assert before.changes() == ["params.yaml train.epochs: None -> 4"]
    (tmp_path / "params.yaml").write_text("train:\n  lr: 0.003\nother: 2\n")
    (tmp_path / "data" / "a.png").unlink()
    (tmp_path / "data" / "c.png").write_text("c")
    (tmp_path / "data" / ".hidden").write_text("a hidden file is not data")
    with open(tmp_path / "data" / "b.png", "a") as f:
        f.write("more")
    assert before.changes() == [
        "params.yaml train.lr: 0.001 -> 0.003",
        "data/a.png removed",
        "data/b.png changed (its stat did, and DVC has no hash from before the run to compare "
        "its content with: outside a DVC project)",
        "data/c.png added",
    ]


def test_a_full_disk_a_file_too_large_and_no_right_to_write_are_one_line_and_others_are_not(
    tmp_path,
):
    import errno

    import pipeline

    full = pipeline.disk_full_message(OSError(errno.ENOSPC, "No space", str(tmp_path / "x.npy")))
    assert full.startswith(f"disk full: no room to write in {tmp_path} (") and "MB free" in full
    large = pipeline.disk_full_message(OSError(errno.EFBIG, "File too large", str(tmp_path / "x")))
    assert large.startswith(f"a file in {tmp_path} grew past the largest this allows")
    # a read-only checkpoints folder was a traceback from deep in the resume (adversarial pass)
    read_only = pipeline.disk_full_message(
        OSError(errno.EROFS, "Read-only file system", "checkpoints/train/abc")
    )
    assert read_only.startswith("cannot write checkpoints/train/abc: Read-only file system; ")
    denied = pipeline.disk_full_message(PermissionError(errno.EACCES, "Permission denied", "x"))
    assert denied.startswith("cannot write x: Permission denied; make it writable")
    assert pipeline.disk_full_message(FileNotFoundError(errno.ENOENT, "No such file", "x")) is None
