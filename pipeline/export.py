"""Stage export: ONNX, torch.export and TorchScript files, each proven to match eager PyTorch.

Reads:  params.yaml (export.*); the model from train; real test images from the cache; evaluate's
        metrics (for the model card)
Writes: <out>/model.onnx, model.pt2, model.torchscript.pt (each carrying its class names and
        preprocessing), parity.json (every check), latency.json, MODEL_CARD.md, metrics.json
        (what `dvc metrics` compares: parity passed, the worst logit difference of any format in
        units of 1e-6, which DVC's 5-decimal rounding keeps, and ONNX latency at batch 1).
        Files are written to a staging folder and moved into <out> only when every parity check
        passes; on a miss the stage fails with the numbers and <out>.miss.json holds the failed
        report; DVC deleted <out> before the stage ran, and the last good export stays in its
        cache (`dvc checkout export` puts it back; `visionflow repro` and the flows do it).
Run:    python -m pipeline.export --model results/train/model.pt --data data/prepared \
            --metrics results/evaluate/metrics.json --out results/export
"""

import argparse
import json
import shutil
from pathlib import Path

import torch

from pipeline import GateError, run, staged
from visionflow import data
from visionflow.errors import DiskFull
from visionflow.export import check_formats, export_all, latency_table, onnx_opset
from visionflow.inference import describe, module_predictor, normalise, spec_of
from visionflow.models import load_model
from visionflow.params import load_params
from visionflow.report import model_card


def print_parity(parity: dict) -> None:
    for runtime, results in parity.items():
        for name, r in results.items():
            if name == "metadata":
                print(f"parity {runtime:11s} metadata differs from the model's: {r}")
                continue
            print(
                f"parity {runtime:11s} {name:9s} max abs {r['max_abs_diff']:.2e}  "
                f"max rel {r['max_rel_diff']:.2e}  top-1 {r['top1_agreement']:.3f}  "
                + ("ok" if r["passed"] else "MISS")
            )


def summary(report: dict, latency: dict) -> dict:
    """metrics.json: a few numbers to compare across runs; short names, so that
    `dvc exp show --only-changed` fits 160 columns with the params beside them."""
    worst = max(
        r["max_abs_diff"]
        for runtime in ("onnx", "pt2", "torchscript")
        for r in report[runtime].values()
        if "max_abs_diff" in r
    )
    return {
        "parity_passed": report["passed"],
        "diff_e6": round(worst * 1e6, 4),  # the worst |logit difference| of any format, x 1e6
        "onnx_ms": round(latency["batch_1"]["onnx"], 4),  # ONNX Runtime at batch 1, median ms
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Export three formats with a parity gate.")
    parser.add_argument("--model", type=Path, required=True, help="model.pt from train")
    parser.add_argument("--data", type=Path, required=True, help="cache folder from prepare")
    parser.add_argument("--metrics", type=Path, required=True, help="metrics.json from evaluate")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    args = parser.parse_args()
    params = load_params()
    e = params.export

    model, meta = load_model(args.model, map_location="cpu")  # eval mode, CPU, fp32
    spec = spec_of(meta)
    pixels = data.read_split(args.data, "test")[0][: e.batch_size]  # real test images, uint8
    example = torch.from_numpy(normalise(pixels, spec))

    out = staged(args.out)  # moved to args.out only when every parity check passes
    # three formats of about the model's size, and the reports; checked first, because
    # torch.jit.save aborts the whole process on a full disk
    needed = 4 * args.model.stat().st_size + 2**20
    if shutil.disk_usage(out).free < needed:
        raise DiskFull.at(out, needed)
    metadata = describe(meta["classes"], spec)
    paths, exporter = export_all(model, example, out, e.opset, metadata)
    opset = onnx_opset(paths["onnx"])  # what the file says, which every record states
    if opset != e.opset:
        raise GateError(
            f"export.opset is {e.opset}, but the {exporter} exporter wrote opset {opset}"
        )
    parity, predictors = check_formats(
        model,
        paths,
        pixels,
        meta["classes"],
        spec,
        (e.onnx_rtol, e.onnx_atol),
        (e.rtol, e.atol),
        e.min_top1_agreement,
    )
    passed = all(r["passed"] for results in parity.values() for r in results.values())
    report = {"exporter": exporter, "opset": opset, "passed": passed, **parity}
    data.write_json(out / "parity.json", report)
    print_parity(parity)
    if not passed:
        miss = args.out.with_name(args.out.name + ".miss.json")
        data.write_json(miss, report)
        raise GateError(
            f"parity missed (onnx rtol {e.onnx_rtol} atol {e.onnx_atol}; others rtol {e.rtol} "
            f"atol {e.atol}); nothing promoted; the failed report is {miss}"
        )

    predictors = {"eager": module_predictor(model), **predictors}
    latency = latency_table(predictors, example.numpy(), (1, 64), e.latency_repeats)
    data.write_json(out / "latency.json", {"unit": "ms (median)", **latency})
    data.write_json(out / "metrics.json", summary(report, latency))
    metrics = json.loads(args.metrics.read_text())
    manifest = json.loads((args.data / "manifest.json").read_text())  # the source and split
    card = model_card(meta, manifest, metrics, report, latency, spec)
    (out / "MODEL_CARD.md").write_text(card)
    print(
        f"export: {', '.join(p.name for p in paths.values())} in {args.out} "
        f"(ONNX via the {exporter} exporter)"
    )


if __name__ == "__main__":
    run(main)
