"""The real DVC pipeline in a temporary git repo, on tiny params: what `dvc repro` users rely on."""

import json
import re

import pytest
import yaml

from tests.conftest import commit, sh, write_params

pytestmark = pytest.mark.slow
STAGES = ["prepare", "sanity", "train", "evaluate", "export"]


def ran(result) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", result.stdout)


def test_repro_runs_all_then_nothing_then_only_what_a_param_touches(project):
    first = sh(project, "dvc", "repro")
    assert ran(first) == STAGES
    for path in [
        "data/prepared/train_x.npy",
        "data/prepared/manifest.json",
        "results/sanity/labels.png",
        "results/sanity/scan.json",
        "results/train/model.pt",
        "results/train/live/plots/metrics/val/accuracy.tsv",
        "results/evaluate/metrics.json",
        "results/evaluate/predictions.json",
        "results/export/model.onnx",
        "results/export/parity.json",
    ]:
        assert (project / path).is_file(), path
    metrics = json.loads((project / "results/evaluate/metrics.json").read_text())
    assert metrics["images"] == 360 and 0 <= metrics["accuracy"] <= 1
    assert json.loads((project / "results/export/parity.json").read_text())["passed"] is True
    commit(project, "first run")

    assert ran(sh(project, "dvc", "repro")) == []

    write_params(project, {"train": {"epochs": 3}})
    assert ran(sh(project, "dvc", "repro")) == ["train", "evaluate", "export"]
    diff = json.loads(sh(project, "dvc", "metrics", "diff", "--json").stdout)
    assert "results/evaluate/metrics.json" in diff
    assert diff["results/train/live/metrics.json"]["step"] == {"old": 1, "new": 2, "diff": 1}

    write_params(project, {"sanity": {"per_class": 3}})
    assert ran(sh(project, "dvc", "repro")) == ["sanity"]  # same scan.json: train is not rerun

    # A parity miss fails export, promotes no model, and dvc.lock keeps the last good export.
    write_params(project, {"export": {"rtol": 0.0, "atol": 0.0}})
    failed = sh(project, "dvc", "repro", check=False)
    assert failed.returncode != 0 and ran(failed) == ["export"]
    assert "ONNX parity missed" in failed.stderr
    assert not (project / "results/export/model.onnx").exists()
    parity = json.loads((project / "results/export/parity.json").read_text())
    assert parity["passed"] is False and parity["onnx"]["batch_8"]["max_abs_diff"] > 0
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert float(lock["stages"]["export"]["params"]["params.yaml"]["export.atol"]) == 1e-5


def test_bad_params_fail_the_stage_naming_the_key(project):
    write_params(project, {"train": {"lerning_rate": 0.1}})
    result = sh(project, "dvc", "repro", check=False)
    assert result.returncode != 0
    assert "train.lerning_rate: unknown key; did you mean 'lr'" in result.stderr
    assert ran(result) == ["prepare"]  # the first stage refuses before doing any work


def test_imagefolder_source_is_a_tracked_dependency(project, image_folder):
    write_params(
        project,
        {
            "prepare": {
                "source": "imagefolder",
                "path": str(image_folder),
                "color": "rgb",
                "val_fraction": 0.25,
            }
        },
    )
    assert ran(sh(project, "dvc", "repro", "prepare")) == ["prepare"]
    classes = json.loads((project / "data/prepared/classes.json").read_text())
    assert classes == ["blue", "green", "red"]
    assert sh(project, "dvc", "status", "prepare").stdout.strip().endswith("up to date.")
    (image_folder / "red" / "6.png").write_bytes((image_folder / "red" / "0.png").read_bytes())
    assert "changed deps" in sh(project, "dvc", "status", "prepare").stdout
