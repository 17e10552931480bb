"""INT8 ONNX (visionflow.deploy.quantize): a real ONNX Runtime quantizer on a real exported model."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from visionflow.deploy.export import export_onnx
from visionflow.deploy.inference import file_metadata, load_predictor, preprocess_spec, to_input
from visionflow.deploy.quantize import (
    QUANTIZATION_KEY,
    calibration_sample,
    int8_check,
    quantize_onnx,
)
from visionflow.train import loading
from visionflow.train.models import build_model

MEAN, STD = [0.3], [0.25]
SPEC = preprocess_spec(8, 1, MEAN, STD)
CLASSES = ["a", "b", "c", "d"]
META = file_metadata(CLASSES, SPEC)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    """A small CNN exported as the export stage exports it (dynamic batch, metadata)."""
    torch.manual_seed(0)
    model = build_model("simple_cnn", 1, 4, 8).eval()
    pixels = np.random.default_rng(0).integers(0, 256, (4, 8, 8, 1), dtype=np.uint8)
    x = loading.to_model_input(torch.from_numpy(pixels), torch.tensor(MEAN), torch.tensor(STD))
    path = tmp_path_factory.mktemp("fp32") / "model.onnx"
    export_onnx(model, x, path, 18, META)
    return path


@pytest.fixture(scope="module")
def pixels():
    return np.random.default_rng(1).integers(0, 256, (64, 8, 8, 1), dtype=np.uint8)


def ops(path) -> set[str]:
    return {node.op_type for node in onnx.load(str(path)).graph.node}


def input_range(path) -> tuple[float, float]:
    """The float range the INT8 file's first QuantizeLinear (on the image) maps to uint8."""
    model = onnx.load(str(path))
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    first = next(n for n in model.graph.node if n.input and n.input[0] == "image")
    assert first.op_type == "QuantizeLinear"
    scale, zero = float(values[first.input[1]]), int(values[first.input[2]])
    return -zero * scale, (255 - zero) * scale


@pytest.mark.parametrize("method", ["minmax", "entropy"])
def test_int8_file_is_qdq_carries_the_metadata_and_runs_as_the_fp32_file(
    fp32, pixels, tmp_path, method
):
    path = tmp_path / "model.int8.onnx"
    record = quantize_onnx(fp32, path, pixels[:32], SPEC, method, META)
    assert {"QuantizeLinear", "DequantizeLinear", "Conv", "Gemm"} <= ops(path)
    assert not ops(path) & {"QLinearConv", "ConvInteger", "MatMulInteger"}  # not QOperator
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert {k: props[k] for k in META} == META  # the same description as the fp32 file
    assert json.loads(props[QUANTIZATION_KEY]) == record
    assert record["calibration"] == method and record["calibration_images"] == 32
    # a client loads it as it loads model.onnx: float32 NCHW in, logits out, any batch
    predictor, classes, spec = load_predictor("onnx", path)
    assert (classes, spec) == (CLASSES, SPEC)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].type == "tensor(float)"
    for n in (1, 5):
        assert session.run(None, {"image": np.zeros((n, 1, 8, 8), np.float32)})[0].shape == (n, 4)
    reference, _, _ = load_predictor("onnx", fp32)
    x = to_input(pixels, SPEC)
    expected, actual = reference(x), predictor(x)
    # close, not equal (an untrained model: its logits are small and near each other)
    assert 0 < np.abs(actual - expected).max() < 0.2 * np.abs(expected).max()
    assert (actual.argmax(1) == expected.argmax(1)).mean() >= 0.9


def test_the_ranges_come_from_the_calibration_images(fp32, tmp_path):
    """The image's range in the INT8 file is the calibration images' range (MinMax): dark
    images give a narrow one. Calibrated on other images than these, it would not match."""
    dark = np.random.default_rng(2).integers(0, 51, (16, 8, 8, 1), dtype=np.uint8)
    low, high = float(to_input(dark, SPEC).min()), float(to_input(dark, SPEC).max())
    quantize_onnx(fp32, tmp_path / "dark.onnx", dark, SPEC, "minmax", META)
    got = input_range(tmp_path / "dark.onnx")
    assert got == pytest.approx((min(low, 0), max(high, 0)), abs=0.02)
    assert got[1] < (1 - MEAN[0]) / STD[0] - 0.5  # far below a full-range image's maximum


def test_calibration_sample_is_deterministic_spread_and_bounded():
    x = np.arange(100).reshape(100, 1, 1, 1).astype(np.uint8)
    sample = calibration_sample(x, 5)
    assert sample[:, 0, 0, 0].tolist() == [0, 25, 50, 74, 99]  # the whole split, evenly
    assert np.array_equal(calibration_sample(x, 5), sample)
    assert len(calibration_sample(x, 1000)) == 100  # never more than the split has
    assert calibration_sample(x, 1)[:, 0, 0, 0].tolist() == [0]


def test_int8_check_reports_both_accuracies_and_fails_past_the_allowed_drop():
    labels = np.arange(20) % 4
    right = np.eye(4, dtype=np.float32)[labels]

    def fp32(x):  # right on every image (x carries the image index in its first pixel)
        return right[x[:, 0, 0, 0].round().astype(int)]

    def int8(x):  # wrong on images 0 and 1
        logits, wrong = fp32(x).copy(), np.isin(x[:, 0, 0, 0].round(), [0, 1])
        logits[wrong] = np.roll(logits[wrong], 1, axis=1)  # the next class instead
        return logits

    pixels = np.arange(20, dtype=np.uint8).reshape(20, 1, 1, 1)
    spec = {"mean": [0.0], "std": [1 / 255]}  # to_input(pixels) == the index
    r = int8_check(fp32, int8, pixels, labels, spec, max_drop=0.0)
    assert r["fp32_accuracy"] == 1.0 and r["int8_accuracy"] == 0.9
    assert r["top1_agreement"] == 0.9 and r["accuracy_drop"] == pytest.approx(0.1)
    assert (r["int8_only_wrong"], r["fp32_only_wrong"]) == (2, 0) and r["images"] == 20
    assert r["p_value"] == 0.25 and r["passed"]  # 2 of 2 disagreements: a coin does it
    assert int8_check(fp32, int8, pixels, labels, spec, max_drop=0.1)["passed"]
    assert int8_check(int8, fp32, pixels, labels, spec, max_drop=0.0)["passed"]  # a gain


def test_an_unknown_calibration_method_is_refused(fp32, pixels, tmp_path):
    with pytest.raises(ValueError, match="minmax, entropy: 'percentile'"):
        quantize_onnx(fp32, tmp_path / "m.onnx", pixels, SPEC, "percentile", META)


def test_a_drop_of_exactly_the_allowed_amount_passes():
    """0.99 - 0.98 is 0.010000000000000009 in floating point: still a drop of 0.01."""
    labels = np.zeros(100, np.int64)
    pixels = np.arange(100, dtype=np.uint8).reshape(100, 1, 1, 1)
    spec = {"mean": [0.0], "std": [1 / 255]}  # to_input(pixels) == the index

    def wrong_below(k):  # class 1 for the first k images, class 0 (right) for the others
        return lambda x: np.stack([x[:, 0, 0, 0] >= k, x[:, 0, 0, 0] < k], 1).astype(np.float32)

    r = int8_check(wrong_below(1), wrong_below(2), pixels, labels, spec, max_drop=0.01)
    assert (r["fp32_accuracy"], r["int8_accuracy"]) == (0.99, 0.98) and r["passed"]
    assert r["p_value"] == 1.0  # within the allowance: no test needed


def lost(n: int, k: int, max_drop: float) -> dict:
    """int8_check on `n` test images that fp32 gets all right and INT8 gets `k` wrong."""
    labels = np.zeros(n, np.int64)
    pixels = (np.arange(n) % 256).astype(np.uint8).reshape(n, 1, 1, 1)
    index = np.arange(n)
    spec = {"mean": [0.0], "std": [1 / 255]}  # to_input(pixels) == the index mod 256
    fp32 = lambda x: np.tile([1.0, 0.0], (len(x), 1)).astype(np.float32)  # noqa: E731
    calls = iter(range(0, n, 256))

    def int8(x):  # the scorer calls it batch by batch, in order: wrong on the first k images
        start = next(calls)
        wrong = index[start : start + len(x)] < k
        return np.stack([~wrong, wrong], 1).astype(np.float32)

    return int8_check(fp32, int8, pixels, labels, spec, max_drop)


def test_the_int8_gate_fails_on_a_drop_the_test_split_can_tell_from_noise_only():
    """0.01 of the digits' 360 test images is 3.6 images: a run whose INT8 lost 8 (the same
    model up to float order) failed the gate, though a split that small shows that by chance."""
    noise = lost(360, 8, 0.01)
    assert noise["accuracy_drop"] > 0.01 and noise["passed"]
    assert noise["p_value"] == pytest.approx(0.0763, abs=1e-4)  # 0.68 ** 8 ... (1+3.6/8)/2
    assert noise["drop_within_noise"] and not lost(360, 3, 0.01)["drop_within_noise"]
    assert not lost(360, 10, 0.01)["passed"]  # p 0.021
    assert lost(100, 4, 0.0)["passed"] and not lost(100, 5, 0.0)["passed"]  # 0.5**4, 0.5**5
    assert not lost(3600, 60, 0.01)["passed"]  # a larger split tells a smaller drop apart
    assert lost(360, 360, 1.0)["passed"]  # 1: the gate off


def test_equal_accuracies_with_other_answers_miss_the_agreement_floor():
    """INT8 right on the images fp32 gets wrong and wrong on those it gets right: the same
    accuracy, no answer in common. It passed the gate before the agreement floor."""
    labels = np.zeros(20, np.int64)
    pixels = np.arange(20, dtype=np.uint8).reshape(20, 1, 1, 1)
    spec = {"mean": [0.0], "std": [1 / 255]}  # to_input(pixels) == the index
    half = lambda x: np.stack([x[:, 0, 0, 0].round() % 2 == 0, x[:, 0, 0, 0].round() % 2 == 1], 1)  # noqa: E731
    fp32 = lambda x: half(x).astype(np.float32)  # noqa: E731
    int8 = lambda x: (~half(x)).astype(np.float32)  # noqa: E731
    r = int8_check(fp32, int8, pixels, labels, spec, max_drop=0.0, min_agreement=0.9)
    assert r["fp32_accuracy"] == r["int8_accuracy"] == 0.5 and r["top1_agreement"] == 0.0
    assert not r["passed"]
    assert int8_check(fp32, int8, pixels, labels, spec, 0.0, min_agreement=0.0)["passed"]


def test_the_int8_line_says_a_drop_over_the_allowance_passed_as_noise(capsys):
    """A drop over export.int8_max_accuracy_drop that the test split cannot tell from noise
    printed `may drop 0.0 ... ok`, as if there were none."""
    from pipeline.export import print_int8, print_int8_speed

    r = {**lost(90, 1, 0.0), "calibration": "minmax", "calibration_images": 1}
    print_int8(r)
    line = capsys.readouterr().out
    assert r["passed"] and "may drop" not in line and line.rstrip().endswith("ok")
    assert (
        "dropped 0.0111, over the 0.0 allowed, which 90 test images cannot tell from noise: p 0.5)"
        in line
    )
    assert "top-1 agreement 0.9889 (at least 0.0)" in line
    latency = {
        "batch_1": {"onnx": 0.02, "onnx_int8": 0.04},
        "batch_64": {"onnx": 1.0, "onnx_int8": 0.5},
    }
    assert print_int8_speed(latency) == {"batch_1": False, "batch_64": True}
    said = capsys.readouterr().out  # it said "slower" quoting batch 64 too, where it was faster
    assert "slower than model.onnx on this machine at batch 1 0.04 vs 0.02 ms, and faster" in said
    assert "faster at batch 64 0.5 vs 1 ms: model.int8.onnx pays only for batches like" in said
    latency["batch_64"]["onnx_int8"] = 2.0
    print_int8_speed(latency)
    said = capsys.readouterr().out
    assert "at every batch size measured (batch 1 0.04 vs 0.02 ms, batch 64 2 vs 1 ms)" in said
    assert "serve model.onnx here" in said
    latency["batch_64"]["onnx_int8"] = 0.5
    latency["batch_1"]["onnx_int8"] = 0.01
    assert all(print_int8_speed(latency).values()) and capsys.readouterr().out == ""
