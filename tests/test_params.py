import math
import os
import runpy
import subprocess
import sys

import pytest
import yaml
from pydantic import ValidationError

from tests.helpers import ROOT, python_path
from visionflow.params import (
    Augment,
    Export,
    Health,
    ParamsError,
    Prepare,
    load_params,
    parse_params,
    read_yaml,
)

SHIPPED = (ROOT / "params.yaml").read_text()


def params_with(**sections) -> dict:
    raw = read_yaml(ROOT / "params.yaml")
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    return raw


def test_shipped_params_are_valid_and_frozen():
    params = load_params(ROOT / "params.yaml")
    assert params.prepare.source == "digits"
    with pytest.raises(ValidationError, match="frozen"):
        params.train.lr = 1.0  # frozen: a stage cannot change its own knobs


def test_typo_names_the_key_and_the_closest_valid_key():
    with pytest.raises(ParamsError) as e:
        parse_params(params_with(train={"lerning_rate": 0.1}))
    assert "train.lerning_rate: unknown key" in str(e.value)
    assert "did you mean 'lr'" in str(e.value)

    with pytest.raises(ParamsError, match=r"train.epocs: unknown key; did you mean 'epochs'"):
        parse_params(params_with(train={"epocs": 3}))


def test_unknown_section_is_rejected():
    with pytest.raises(ParamsError, match=r"traning: unknown key; did you mean 'train'"):
        parse_params(params_with(traning={"epochs": 3}))


def test_wrong_type_names_the_key_and_value():
    with pytest.raises(ParamsError, match=r"train.epochs: .*integer.*'ten'"):
        parse_params(params_with(train={"epochs": "ten"}))
    with pytest.raises(ParamsError, match=r"prepare.source: .*'pictures'"):
        parse_params(params_with(prepare={"source": "pictures"}))


def test_out_of_range_is_rejected():
    with pytest.raises(ParamsError, match=r"prepare.val_fraction"):
        parse_params(params_with(prepare={"val_fraction": 0.9}))
    with pytest.raises(ParamsError, match=r"prepare.shard_images: .*greater than or equal to 0"):
        parse_params(params_with(prepare={"shard_images": -64}))


@pytest.mark.parametrize(
    "key, value, problem",
    [
        ("int8_max_accuracy_drop", 1.5, "less than or equal to 1"),
        ("int8_max_accuracy_drop", -0.01, "greater than or equal to 0"),
        ("int8_max_accuracy_drop", "1%", "number"),
        ("int8_calibration_images", 0, "greater than or equal to 1"),
        ("int8_calibration", "percentile", "'minmax' or 'entropy'"),
    ],
)
def test_a_bad_int8_setting_is_refused_naming_the_key(key, value, problem):
    with pytest.raises(ParamsError) as e:
        parse_params(params_with(export={key: value}))
    line = str(e.value).splitlines()[-1]
    assert line.startswith(f"  export.{key}: ") and problem in line, str(e.value)


def test_an_opset_the_exporter_cannot_write_is_refused_naming_the_key():
    """Before, export.opset 99 was accepted and the file was written at opset 18."""
    import onnx.defs

    newest = onnx.defs.onnx_opset_version()
    parse_params(params_with(export={"opset": newest}))
    with pytest.raises(ParamsError, match=rf"export.opset: .*writes opsets 17 to {newest}, not 99"):
        parse_params(params_with(export={"opset": 99}))


def test_the_shipped_params_load_without_importing_onnx_or_torch():
    """Every stage, and the check stage that runs on every params edit, loads params first: the
    onnx import alone took half a second there."""
    probe = (
        "import sys\nfrom visionflow.params import load_params\nload_params()\n"
        "print(sorted({'onnx', 'torch'} & set(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": python_path(ROOT / "src")}
    loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "[]"
    assert '"onnx>=1.16"' in (ROOT / "pyproject.toml").read_text()  # writes up to opset 21


def test_float_written_1e_minus_3_is_a_float(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(SHIPPED.replace("  lr: 1.0e-3", "  lr: 1e-3"))
    assert yaml.safe_load(path.read_text())["train"]["lr"] == "1e-3"  # PyYAML's reading, not DVC's
    assert load_params(path).train.lr == pytest.approx(0.001)


def test_an_item_yaml_reads_as_a_comment_says_to_quote_it(tmp_path):
    """`- #5` is an empty item: YAML starts a comment at the #."""
    path = tmp_path / "params.yaml"
    path.write_text(SHIPPED.replace("  exclude: []", "  exclude:\n    - #5"))
    with pytest.raises(ParamsError, match=r"prepare.exclude.0: .* \(got None; empty in YAML, wh"):
        load_params(path)


def test_yaml_1_1_words_are_strings_as_in_dvc(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(SHIPPED.replace("  amp: auto", "  amp: off"))
    assert load_params(path).train.amp == "off"  # PyYAML would read False
    path.write_text(SHIPPED.replace("  hflip: false", "  hflip: yes"))
    with pytest.raises(
        ParamsError, match=r"train.augment.hflip: must be true or false \(got 'yes'\)"
    ):
        load_params(path)


def test_a_boolean_is_not_a_number():
    with pytest.raises(ParamsError, match=r"train.epochs: .*integer.*True"):
        parse_params(params_with(train={"epochs": True}))
    with pytest.raises(ParamsError, match=r"train.lr: .*number.*False"):
        parse_params(params_with(train={"lr": False}))
    assert parse_params(params_with(train={"lr": 1})).train.lr == 1.0  # an int is a float


def test_a_value_no_member_of_a_union_takes_is_one_line_naming_each():
    """`sanity.label_issues: maybe` was two lines under pydantic's member names
    (`sanity.label_issues.bool: ...`, `sanity.label_issues.literal['auto']: ...`)."""
    with pytest.raises(ParamsError) as raised:
        parse_params(params_with(sanity={"label_issues": "maybe"}, train={"channels_last": 2}))
    lines = str(raised.value).splitlines()[1:]
    assert lines == [
        "  sanity.label_issues: must be true or false, or 'auto' (got 'maybe')",
        "  train.channels_last: must be 'auto', or true or false (got 2)",
    ]


def test_duplicate_keys_and_missing_sections_are_refused(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(SHIPPED.replace("  lr: 1.0e-3", "  lr: 1.0e-3\n  lr: 3.0e-3"))
    with pytest.raises(ParamsError, match=r'duplicate key "lr".*\(line \d+\)'):
        load_params(path)
    with pytest.raises(ParamsError, match=r"sanity: missing"):
        parse_params({k: v for k, v in params_with().items() if k != "sanity"})
    with pytest.raises(ParamsError, match=r"train.lr: missing"):
        parse_params(
            params_with(train={"lr": None})
            | {"train": {k: v for k, v in params_with()["train"].items() if k != "lr"}}
        )


def test_every_problem_is_listed_at_once():
    with pytest.raises(ParamsError) as e:
        parse_params(params_with(train={"epochs": 0, "batchsize": 3}))
    assert "train.epochs" in str(e.value) and "train.batchsize" in str(e.value)


def test_defaults_match_the_shipped_file():
    """Keys that no stage lists keep a default (DVC does not need them); it is the shipped value."""
    shipped = load_params(ROOT / "params.yaml")
    assert Prepare.model_fields["workers"].default == shipped.prepare.workers
    assert Augment() == shipped.train.augment and Health() == shipped.train.health
    int8 = [k for k in Export.model_fields if k.startswith("int8_")]  # for a params.yaml before it
    assert int8 and all(Export.model_fields[k].default == getattr(shipped.export, k) for k in int8)


def test_check_command_exits_nonzero_naming_file_and_key(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(SHIPPED.replace("  epochs: 20", "  epocs: 3"))
    result = subprocess.run(
        [sys.executable, "-m", "visionflow.params", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert str(path) in result.stderr and "train.epocs" in result.stderr
    path.write_text(SHIPPED)
    assert subprocess.run([sys.executable, "-m", "visionflow.params", str(path)]).returncode == 0


def test_values_no_stage_could_use_are_refused_here():
    """Refused by check, before prepare and sanity rerun for nothing."""
    with pytest.raises(
        ParamsError,
        match=r"^invalid params:\n  train.pretrained is for resnet18 and torchvision.s classifiers, not simple_cnn$",
    ):
        parse_params(params_with(train={"pretrained": "imagenet"}))
    with pytest.raises(ParamsError, match=r"train.lr: Input should be a finite number"):
        parse_params(params_with(train={"lr": float("inf")}))
    with pytest.raises(ParamsError, match=r"seed: Input should be greater than or equal to 0"):
        parse_params(params_with(seed=-1))
    with pytest.raises(ParamsError, match=r"seed: Input should be less than 4294967296"):
        parse_params(params_with(seed=2**32))


def test_the_parameter_reference_in_the_docs_is_the_params_models_and_file():
    made = runpy.run_path(str(ROOT / "docs/make_reference.py"))["reference"](ROOT / "params.yaml")
    assert "| `prepare.fit` | `crop` \\| `squash` |  | `crop` |" in made  # a choice, a default
    assert "| `train.lr` | float \\| `auto` |  | required | learning rate (> 0) \\| auto" in made
    committed = (ROOT / "docs/reference.md").read_text()
    assert committed == made, "run: .venv/bin/python docs/make_reference.py"


@pytest.mark.parametrize("key", ["mixup", "cutmix"])
def test_a_batch_mixing_alpha_is_a_finite_number_not_below_0(key):
    """train.augment.mixup and cutmix: a Beta(alpha, alpha) weight, 0 = off (the default)."""
    assert getattr(load_params(ROOT / "params.yaml").train.augment, key) == 0.0
    for bad, said in ((-0.2, r"greater than or equal to 0 \(got -0.2\)"), (math.inf, "finite")):
        with pytest.raises(ParamsError, match=rf"train.augment.{key}: .*{said}"):
            parse_params(params_with(train={"augment": {key: bad}}))
    assert getattr(parse_params(params_with(train={"augment": {key: 0.4}})).train.augment, key)
    with pytest.raises(ParamsError, match=rf"train.augment.{key} blends a batch's images in pairs"):
        parse_params(params_with(train={"augment": {key: 0.4}, "batch_size": 1}))  # a no-op else
