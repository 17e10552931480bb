"""The model card: one Markdown page that says what a shipped model is, how good, and how exact."""

import platform

import onnx
import onnxruntime
import torch


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def model_card(meta: dict, params, metrics: dict, parity: dict, latency: dict, spec: dict) -> str:
    """`params` is the validated Params; `parity` and `latency` are the export stage's reports."""
    p, t = params.prepare, params.train
    parity_rows = [
        [
            runtime,
            name,
            f"{r['max_abs_diff']:.2e}",
            f"{r['max_rel_diff']:.2e}",
            f"{r['top1_agreement']:.3f}",
            "ok" if r["passed"] else "MISS",
        ]
        for runtime in ("onnx", "pt2", "torchscript")
        for name, r in parity[runtime].items()
        if "max_abs_diff" in r
    ]
    runtimes = list(next(iter(latency.values())))
    latency_rows = [[name, *(f"{latency[b][name]:.3f}" for b in latency)] for name in runtimes]
    scores = [
        [k, f"{v:.4f}" if isinstance(v, float) else v]
        for k, v in metrics.items()
        if not isinstance(v, dict)
    ]
    return f"""# Model card: {meta["model"]}

Classes ({len(meta["classes"])}, in output order): {", ".join(meta["classes"])}

## Data
Source `{p.source}` (`{p.path}`), {spec["image_size"]}x{spec["image_size"]} {spec["color"]}, split
train/val/test with seed {params.seed} (val {p.val_fraction}, test {p.test_fraction}).
Preprocessing: decode, EXIF transpose, convert to {spec["color"]}, resize ({spec["resize"]}) to
{spec["image_size"]}x{spec["image_size"]}, then `(pixel / 255 - mean) / std` with mean {
        [round(m, 4) for m in spec["mean"]]
    }
and std {
        [round(s, 4) for s in spec["std"]]
    } (train split), float32 NCHW. Every exported file carries this as
`visionflow.preprocess` and the class names as `visionflow.classes`.

## Training
{t.epochs} epochs, batch {t.batch_size}, lr {t.lr}, weight decay {t.weight_decay}, dropout
{t.dropout}; best epoch {meta["epoch"]} (val accuracy {meta["val_accuracy"]:.4f}).

## Test metrics
{table(["metric", "value"], scores)}

## Parity with eager PyTorch (real test images)
ONNX exporter: {parity["exporter"]}, opset {parity["opset"]}.

{table(["format", "batch", "max abs diff", "max rel diff", "top-1 agreement", "gate"], parity_rows)}

## Latency (median ms per call, this machine)
{table(["runtime", *latency], latency_rows)}

## Versions
{
        table(
            ["package", "version"],
            [
                ["python", platform.python_version()],
                ["torch", torch.__version__],
                ["onnx", onnx.__version__],
                ["onnxruntime", onnxruntime.__version__],
                ["opset", parity["opset"]],
            ],
        )
    }
"""
