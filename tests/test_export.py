import numpy as np
import onnx
import onnxruntime as ort
import torch

from visionflow.export import compare, export_onnx, onnx_parity
from visionflow.models import build_model


def test_onnx_matches_eager_at_each_batch_size_with_a_dynamic_batch(tmp_path):
    torch.manual_seed(0)
    model = build_model("simple_cnn", 3, 5, 16, dropout=0.5).eval()
    x = torch.randn(8, 3, 16, 16)
    path = tmp_path / "model.onnx"
    exporter = export_onnx(model, x, path, opset=18)
    assert exporter in {"dynamo", "legacy"}
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    results = onnx_parity(model, path, x, [1, 3, 8], rtol=1e-3, atol=1e-5)
    assert set(results) == {"batch_1", "batch_3", "batch_8"}
    for r in results.values():
        assert r["passed"] and r["top1_agreement"] == 1.0 and r["max_abs_diff"] < 1e-4
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.run(None, {"image": np.zeros((5, 3, 16, 16), np.float32)})[0].shape == (5, 5)


def test_gate_catches_a_model_that_is_not_the_exported_one(tmp_path):
    torch.manual_seed(0)
    model = build_model("simple_cnn", 1, 4, 8, dropout=0.5).eval()
    x = torch.randn(16, 1, 8, 8)
    path = tmp_path / "model.onnx"
    export_onnx(model, x, path, opset=18)
    model.train()  # dropout on: eager now computes something else than the file
    results = onnx_parity(model, path, x, [16], rtol=1e-3, atol=1e-5)
    assert not results["batch_16"]["passed"] and results["batch_16"]["max_abs_diff"] > 1e-3


def test_compare_reports_differences_and_top1():
    expected = np.array([[1.0, 2.0], [3.0, 1.0]], np.float32)
    assert compare(expected, expected.copy(), 0, 0)["passed"]
    flipped = np.array([[1.0, 0.5], [3.0, 1.0]], np.float32)
    r = compare(expected, flipped, rtol=1e-3, atol=1e-5)
    assert r["max_abs_diff"] == 1.5 and r["top1_agreement"] == 0.5 and not r["passed"]
