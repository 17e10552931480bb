"""INT8 ONNX: static quantization in QDQ form with ONNX Runtime's quantizer, and its accuracy gate.

Activations uint8 and weights int8 per output channel (U8S8), in QDQ form (QuantizeLinear /
DequantizeLinear pairs around float operators, which ONNX Runtime fuses into integer kernels).
U8S8 because it is what ORT's x86 integer kernels are fast at: int8 activations (S8S8) ran
slower than fp32, U8S8 faster, on a resnet18; and ORT's QOperator form lost a tenth of the digits
model's test accuracy where QDQ kept it (both measured: docs/export-and-serving.md, "INT8"). The ranges are calibrated on training images only
(never test images), preprocessed exactly as the model's own metadata says; the input stays
float32 NCHW and the output float logits, so any client of the fp32 file runs this one unchanged.
The file carries the fp32 file's metadata (`visionflow.classes`, `visionflow.preprocess`) plus
`visionflow.quantization`, what was done.

No torch here: ONNX, ONNX Runtime and NumPy.
"""

import json
import logging
import math
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_static,
)
from onnxruntime.quantization.shape_inference import quant_pre_process

from visionflow.deploy.inference import QUANTIZATION_KEY, Predictor, to_input

METHODS = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy}
EVAL_BATCH = 256  # test images per ONNX Runtime call while scoring: bounded memory at any size


def calibration_sample(pixels: np.ndarray, n: int) -> np.ndarray:
    """`n` images evenly spaced over a split (all of them when it has fewer): deterministic,
    and spread over the whole split whatever its order. Read row by row from a memory map."""
    index = np.unique(np.linspace(0, len(pixels) - 1, min(n, len(pixels))).round().astype(int))
    return np.ascontiguousarray(pixels[index])


class CalibrationImages(CalibrationDataReader):
    """uint8 NHWC images for ORT's calibrator, one normalised image per call: the Entropy
    calibrator stacks the calls' outputs and fails on a ragged last batch, and one image at a
    time holds one image in memory whatever the sample size."""

    def __init__(self, input_name: str, pixels: np.ndarray, spec: dict):
        self.input_name, self.pixels, self.spec, self.next = input_name, pixels, spec, 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.next >= len(self.pixels):
            return None
        self.next += 1
        return {self.input_name: to_input(self.pixels[self.next - 1 : self.next], self.spec)}


@contextmanager
def quiet_root_logger():
    """The quantizer gives its advice at WARNING on the root logger ("Please consider to run
    pre-processing", which is done here): kept out of the stage's log."""
    level = logging.root.level
    logging.root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logging.root.setLevel(level)


def quantize_onnx(
    fp32: Path, out: Path, calibration: np.ndarray, spec: dict, method: str, metadata: dict
) -> dict:
    """Write the INT8 (QDQ) version of the ONNX file `fp32` to `out`, its ranges calibrated on
    `calibration` (uint8 NHWC training images) by `method` (minmax | entropy); `metadata` is
    written into it as into the fp32 file. Returns what `visionflow.quantization` records."""
    if method not in METHODS:
        raise ValueError(f"calibration method must be one of {', '.join(METHODS)}: {method!r}")
    record = {
        "format": "QDQ",
        "activations": "uint8",
        "weights": "int8, per output channel",
        "calibration": method,
        "calibration_images": len(calibration),
        "calibration_split": "train",
    }
    name = onnx.load(str(fp32), load_external_data=False).graph.input[0].name
    # the pre-processed model goes beside the output, not into the system's temp folder (often
    # a small tmpfs); ORT puts its augmented calibration model there itself
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp, quiet_root_logger():
        pre = Path(tmp) / "pre.onnx"
        quant_pre_process(str(fp32), str(pre))  # symbolic shape inference, basic graph fusions
        quantize_static(
            str(pre),
            str(out),
            CalibrationImages(name, calibration, spec),
            quant_format=QuantFormat.QDQ,
            per_channel=True,  # a scale per output channel: filters' ranges differ widely
            activation_type=QuantType.QUInt8,  # U8S8: see the docstring
            weight_type=QuantType.QInt8,
            calibrate_method=METHODS[method],
            calibration_providers=["CPUExecutionProvider"],
        )
    proto = onnx.load(str(out))
    del proto.metadata_props[:]  # ORT's own notes ("onnx.infer", ...) out; ours in
    onnx.helper.set_model_props(proto, {**metadata, QUANTIZATION_KEY: json.dumps(record)})
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(out))
    return record


def top1(predictor: Predictor, pixels: np.ndarray, spec: dict) -> np.ndarray:
    """The top-1 class index per image, in batches of EVAL_BATCH (pixels may be memory-mapped)."""
    return np.concatenate(
        [
            predictor(to_input(np.asarray(pixels[s : s + EVAL_BATCH]), spec)).argmax(1)
            for s in range(0, len(pixels), EVAL_BATCH)
        ]
    )


CONFIDENCE = 0.95  # the INT8 gate fails on a drop the test split shows at this confidence


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in logs (exact at any n)."""
    if k <= 0 or p >= 1:
        return 1.0
    if p <= 0:
        return 0.0
    terms = (
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
        + i * math.log(p) + (n - i) * math.log1p(-p)
        for i in range(k, n + 1)
    )  # fmt: skip
    return min(1.0, sum(math.exp(term) for term in terms))


def int8_check(
    fp32: Predictor,
    int8: Predictor,
    pixels: np.ndarray,
    labels: np.ndarray,
    spec: dict,
    max_drop: float,
    min_agreement: float = 0.0,
) -> dict:
    """Test accuracy of both models, their top-1 agreement, and whether INT8 lost more than
    `max_drop` (a fraction of the test images) against fp32 by more than the test split can
    tell from noise.

    Only the images where the two disagree count (a paired, McNemar-style test): of those `d`,
    INT8 alone is wrong on `b` and fp32 alone on `c`, and the drop is (b - c) / n. A drop of
    exactly `max_drop` makes each disagreement INT8's loss with chance p0 = (1 + max_drop n / d)
    / 2; the gate fails when b or more of d is less likely than 1 - CONFIDENCE under p0 (exact
    binomial tail). So 0.01 of 360 images is not failed by 8 lost images, which a split that
    small shows by chance, while any drop a split of any size can show is (max_drop 0: INT8
    worse than fp32 at all; 1: never). Equal accuracies say nothing of the answers: INT8 must
    also give fp32's top-1 class on at least `min_agreement` of the images."""
    fp32_top1, int8_top1 = top1(fp32, pixels, spec), top1(int8, pixels, spec)
    fp32_right, int8_right = fp32_top1 == labels, int8_top1 == labels
    lost, gained = int((fp32_right & ~int8_right).sum()), int((~fp32_right & int8_right).sum())
    n, changed = len(labels), lost + gained
    p_value = binomial_tail(lost, changed, (1 + max_drop * n / changed) / 2) if changed else 1.0
    drop = float(fp32_right.mean()) - float(int8_right.mean())
    agreement = float((fp32_top1 == int8_top1).mean())
    # so that a drop of exactly max_drop passes: 0.99 - 0.98 is 0.010000000000000009
    within = drop <= max_drop + 1e-12
    return {
        "images": n,
        "fp32_accuracy": float(fp32_right.mean()),
        "int8_accuracy": float(int8_right.mean()),
        "accuracy_drop": drop,
        "max_accuracy_drop": max_drop,
        "top1_agreement": agreement,
        "min_top1_agreement": min_agreement,
        "int8_only_wrong": lost,  # test images fp32 gets right and INT8 wrong
        "fp32_only_wrong": gained,
        "p_value": p_value,  # of losing `int8_only_wrong` or more if the drop were max_drop
        # a drop over max_drop that passed: the test split cannot tell it from noise
        "drop_within_noise": bool(not within and p_value >= 1 - CONFIDENCE),
        "passed": bool((within or p_value >= 1 - CONFIDENCE) and agreement >= min_agreement),
    }
