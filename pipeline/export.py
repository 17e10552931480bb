"""Stage export: ONNX, torch.export and TorchScript files, each proven to match eager PyTorch,
and an INT8 ONNX file proven to keep the fp32 model's test accuracy.

Reads:  params.yaml (export.*); the model from train; real test images from the cache, and
        training images to calibrate INT8; evaluate's metrics (for the model card)
Writes: <out>/model.onnx, model.int8.onnx, model.pt2, model.torchscript.pt (each carrying its
        class names and preprocessing), parity.json (every check), int8.json (the INT8 gate:
        test accuracy of both, top-1 agreement, sizes, calibration), MODEL_CARD.md,
        metrics.json (what `dvc metrics` compares: parity passed, the
        worst logit difference of any format in units of 1e-6, which DVC's 5-decimal rounding
        keeps, and the INT8 file's test accuracy; the rest of int8.json is not among the declared
        metrics, whose columns `dvc exp show --only-changed` fits in 160).
        Files are written to a staging folder and moved into <out> only when every parity check
        and the INT8 gate pass; on a miss the stage fails with the numbers and <out>.miss.json
        holds the failed report; DVC deleted <out> before the stage ran, and the last good
        export stays in its cache (`dvc checkout export` puts it back; `visionflow repro` and
        the flows do it).
        <out>.timings/latency.json: the median ms per call of each runtime at batch 1 and 64,
        whether INT8 beat fp32 at each, and the file sizes. Not a DVC output: the clock gives
        other numbers on every run, and the outputs are the same for the same inputs.
Run:    python -m pipeline.export --model results/train/model.pt --data data/prepared \
            --metrics results/evaluate/metrics.json --out results/export
"""

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from pipeline import GateError, run, staged
from visionflow import faults
from visionflow.data.dataset import read_split, write_json
from visionflow.deploy.export import (
    EXPORTER_KEY,
    CannotExport,
    check_formats,
    export_all,
    latency_table,
    one_line,
    onnx_opset,
)
from visionflow.deploy.inference import (
    Predictor,
    file_metadata,
    load_predictor,
    module_predictor,
    spec_of,
    to_input,
)
from visionflow.deploy.quantize import calibration_sample, int8_check, quantize_onnx
from visionflow.deploy.report import model_card
from visionflow.errors import DiskFull
from visionflow.params import Export, load_params
from visionflow.train.models import load_model

INT8_FILE = "model.int8.onnx"


def print_parity(parity: dict) -> None:
    for runtime, results in parity.items():
        for name, result in results.items():
            if name == "metadata":
                print(f"parity {runtime:11s} metadata differs from the model's: {result}")
                continue
            print(
                f"parity {runtime:11s} {name:9s} max abs {result['max_abs_diff']:.2e}  "
                f"max rel {result['max_rel_diff']:.2e}  top-1 {result['top1_agreement']:.3f}  "
                + ("ok" if result["passed"] else "MISS")
            )


def print_int8(gate: dict) -> None:
    allowed = f"may drop {gate['max_accuracy_drop']}"
    if gate["drop_within_noise"]:  # passed, but over the allowance: the line says why
        allowed = (
            f"dropped {gate['accuracy_drop']:.4f}, over the {gate['max_accuracy_drop']} allowed, which "
            f"{gate['images']} test images cannot tell from noise: p {gate['p_value']:.2g}"
        )
    print(
        f"int8   onnx QDQ, {gate['calibration']} on {gate['calibration_images']} training "
        f"image{'s' if gate['calibration_images'] != 1 else ''}: "
        f"test accuracy {gate['int8_accuracy']:.4f} (fp32 {gate['fp32_accuracy']:.4f}, {allowed}), "
        f"top-1 agreement {gate['top1_agreement']:.4f} (at least {gate['min_top1_agreement']})  "
        + ("ok" if gate["passed"] else "MISS")
    )


def print_int8_speed(latency: dict) -> dict:
    """Whether INT8 ran faster than fp32 ONNX at each batch size on this machine; a line when it
    did not: its gain depends on the CPU's integer kernels, and a small model can lose."""
    faster = {b: row["onnx_int8"] < row["onnx"] for b, row in latency.items() if "onnx_int8" in row}

    def times(won: bool) -> str:
        return ", ".join(
            f"{b.replace('_', ' ')} {latency[b]['onnx_int8']:.3g} vs {latency[b]['onnx']:.3g} ms"
            for b, fast in faster.items()
            if fast == won
        )

    if all(faster.values()):
        return faster
    if not any(faster.values()):  # slower at every batch size measured
        advice = f"at every batch size measured ({times(False)}): serve model.onnx here"
    else:  # a win at some sizes only: said as it is, each size where it ran
        advice = (
            f"at {times(False)}, and faster at {times(True)}: model.int8.onnx pays only for "
            "batches like those"
        )
    print(
        f"export: note: model.int8.onnx is slower than model.onnx on this machine {advice} "
        "(its accuracy passed; the export's timings folder, latency.json)"
    )
    return faster


def parity_miss(export: Export) -> str:
    return (
        f"parity missed (onnx rtol {export.onnx_rtol} atol {export.onnx_atol}; others rtol "
        f"{export.rtol} atol {export.atol})"
    )


def int8_miss(gate: dict) -> str:
    if "metadata" in gate:
        return f"INT8 file refused: {gate['metadata']}"
    over = (
        gate["accuracy_drop"] > gate["max_accuracy_drop"] + 1e-12 and not gate["drop_within_noise"]
    )
    if not over:  # the accuracy held: the answers differ
        return (
            f"INT8 gives fp32's top-1 class on {gate['top1_agreement']:.4f} of the test images, "
            f"under export.int8_min_top1_agreement {gate['min_top1_agreement']} (test accuracy "
            f"{gate['int8_accuracy']:.4f}, fp32 {gate['fp32_accuracy']:.4f})"
        )
    return (
        f"INT8 test accuracy {gate['int8_accuracy']:.4f} is {gate['accuracy_drop']:.4f} below fp32's "
        f"{gate['fp32_accuracy']:.4f}, more than export.int8_max_accuracy_drop "
        f"{gate['max_accuracy_drop']} (top-1 agreement with fp32 {gate['top1_agreement']:.4f}), "
        f"beyond the test split's noise: INT8 alone is wrong on {gate['int8_only_wrong']} of the "
        f"{gate['int8_only_wrong'] + gate['fp32_only_wrong']} images where they disagree "
        f"(p {gate['p_value']:.2g} at that drop)"
    )


def done_line(names: list[str], out: Path, unavailable: dict, exporter: str) -> str:
    not_made = f"(not {', '.join(unavailable)}: see parity.json) " if unavailable else ""
    return f"export: {', '.join(names)} in {out} {not_made}(ONNX via the {exporter} exporter)"


def gate_int8(int8: dict, made: bool, report: dict, out: Path, model: str) -> None:
    """The INT8 gate's line; a miss fails the stage. Without an INT8 file (ONNX Runtime cannot
    quantize the model) the fp32 formats, proven, are promoted without it."""
    if not made:
        print(f"export: warning: INT8 cannot quantize {model}: {int8['unavailable']}")
        return
    print_int8(int8)
    if not int8["passed"]:
        refuse({**report, "int8": int8}, out, int8_miss(int8))


def refuse(report: dict, out: Path, reason: str) -> None:
    """Fail the stage, nothing promoted; the failed report goes beside `out`."""
    miss = out.with_name(out.name + ".miss.json")
    write_json(miss, report)
    raise GateError(f"{reason}; nothing promoted; the failed report is {miss}")


def faulty(predictor: Predictor) -> Predictor:
    return lambda x: faults.fault("export.int8", predictor(x))


def int8_gate(
    onnx_path: Path,
    fp32: Predictor,
    metadata: dict,
    folder: Path,
    cache: Path,
    classes: list,
    spec: dict,
    export: Export,
) -> tuple[dict, Predictor]:
    """model.int8.onnx, calibrated on training images (never test images), with the fp32 file's
    `metadata`; it is loaded as a client loads it (the preprocessing read from it) and scored on
    the whole test split beside `fp32` (model.onnx as the parity check loaded it). Returns the
    gate's report and the INT8 predictor."""
    calibration = calibration_sample(
        read_split(cache, "train", mmap=True)[0], export.int8_calibration_images
    )
    int8_path = folder / INT8_FILE
    try:
        if faults.ACTIVE:
            faults.fault("export.quantize")
        record = quantize_onnx(
            onnx_path, int8_path, calibration, spec, export.int8_calibration, metadata
        )
    except Exception as error:  # ONNX Runtime's quantizer fails on some graphs (swin_v2_*)
        int8_path.unlink(missing_ok=True)
        return {"unavailable": one_line(error)}, None
    int8, file_classes, file_spec = load_predictor("onnx", int8_path)
    if faults.ACTIVE:  # tests: an INT8 model that lost its accuracy (export.int8:nan)
        int8 = faulty(int8)
    test_x, test_y = read_split(cache, "test", mmap=True)
    allowed = export.int8_max_accuracy_drop, export.int8_min_top1_agreement
    check = int8_check(fp32, int8, test_x, test_y, file_spec, *allowed)
    if (file_classes, file_spec) != (classes, spec):
        check.update(passed=False, metadata="the INT8 file's classes or preprocessing differ")
    sizes = {"onnx": onnx_path.stat().st_size, "onnx_int8": int8_path.stat().st_size}
    return {**record, **check, "size_bytes": sizes}, int8


def summary(report: dict, int8: dict) -> dict:
    """metrics.json: a few numbers to compare across runs; short names, so that
    `dvc exp show --only-changed` fits 160 columns with the params beside them. Latency is not
    among them (<out>.timings/latency.json): it differs on every run."""
    worst = max(
        result["max_abs_diff"]
        for runtime in ("onnx", "pt2", "torchscript")
        for result in report[runtime].values()
        if "max_abs_diff" in result
    )
    return {
        "parity_passed": report["passed"],
        "diff_e6": round(worst * 1e6, 4),  # the worst |logit difference| of any format, x 1e6
    } | ({"int8acc": int8["int8_accuracy"]} if "int8_accuracy" in int8 else {})  # INT8's test
    # accuracy (int8.json: more), unless ONNX Runtime cannot quantize the model


def timed(predictors: dict, int8: Predictor | None, x: np.ndarray, repeats: int) -> dict:
    """latency.json: the table of every runtime (INT8's too, when made) at batch 1 and 64, and
    whether INT8 ran faster than fp32 at each, with a line when it did not."""
    if int8 is None:
        return latency_table(predictors, x, (1, 64), repeats)
    latency = latency_table({**predictors, "onnx_int8": int8}, x, (1, 64), repeats)
    return latency | {"int8_faster_than_fp32": print_int8_speed(latency)}  # batch size -> bool


def main() -> None:
    parser = argparse.ArgumentParser(description="Export three formats with a parity gate.")
    parser.add_argument("--model", type=Path, required=True, help="model.pt from train")
    parser.add_argument("--data", type=Path, required=True, help="cache folder from prepare")
    parser.add_argument("--metrics", type=Path, required=True, help="metrics.json from evaluate")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    args = parser.parse_args()
    params = load_params()
    export = params.export

    model, meta = load_model(args.model, map_location="cpu")  # eval mode, CPU, fp32
    spec, classes = spec_of(meta), meta["classes"]
    # real test images, uint8: the first few, read from a memory map (not the whole split) and
    # copied out of it (torch warns on a tensor over read-only memory)
    pixels = np.array(read_split(args.data, "test", mmap=True)[0][: export.batch_size])
    example = torch.from_numpy(to_input(pixels, spec))

    out = staged(args.out)  # moved to args.out only when parity and the INT8 gate pass
    # three formats of about the model's size, the quantizer's copy and INT8 file, and the
    # reports; checked first, because torch.jit.save aborts the whole process on a full disk
    needed = 6 * args.model.stat().st_size + 2**20
    if shutil.disk_usage(out).free < needed:
        raise DiskFull.at(out, needed)
    metadata = file_metadata(classes, spec)
    try:
        paths, exporter, unavailable = export_all(model, example, out, export.opset, metadata)
    except CannotExport as error:
        raise GateError(f"{error}; nothing promoted") from None
    for runtime, reason in unavailable.items():  # the others are proven and promoted without it
        print(f"export: warning: {runtime} cannot express {meta['model']}: {reason}")
    opset = onnx_opset(paths["onnx"])  # what the file says, which every record states
    if opset != export.opset:
        raise GateError(
            f"export.opset is {export.opset}, but the {exporter} exporter wrote opset {opset}"
        )
    parity, predictors = check_formats(
        model,
        paths,
        pixels,
        classes,
        spec,
        (export.onnx_rtol, export.onnx_atol),
        (export.rtol, export.atol),
        export.min_top1_agreement,
    )
    passed = all(result["passed"] for results in parity.values() for result in results.values())
    report = {"exporter": exporter, "opset": opset, "passed": passed, **parity}
    report |= {runtime: {} for runtime in unavailable}  # no parity to show: not made
    report["unavailable"] = unavailable  # format -> why it cannot express this model
    print_parity(parity)
    if not passed:
        refuse(report, args.out, parity_miss(export))
    write_json(out / "parity.json", report)
    onnx_metadata = {**metadata, EXPORTER_KEY: exporter}  # as export_onnx wrote it
    int8, int8_predictor = int8_gate(
        paths["onnx"], predictors["onnx"], onnx_metadata, out, args.data, classes, spec, export
    )
    gate_int8(int8, int8_predictor is not None, report, args.out, meta["model"])
    predictors = {"eager": module_predictor(model), **predictors}
    latency = timed(predictors, int8_predictor, example.numpy(), export.latency_repeats)
    sizes = int8.get("size_bytes", {"onnx": paths["onnx"].stat().st_size})
    timings = args.out.with_name(args.out.name + ".timings")  # this run's, on this machine
    timings.mkdir(parents=True, exist_ok=True)
    write_json(timings / "latency.json", {"unit": "ms (median)", **latency, "size_bytes": sizes})
    write_json(out / "int8.json", int8)
    write_json(out / "metrics.json", summary(report, int8))
    metrics = json.loads(args.metrics.read_text())
    manifest = json.loads((args.data / "manifest.json").read_text())  # the source and split
    card = model_card(meta, manifest, metrics, report, spec, int8 if int8_predictor else None)
    (out / "MODEL_CARD.md").write_text(card)
    names = [p.name for p in paths.values()] + ([INT8_FILE] if int8_predictor else [])
    args.out.with_name(args.out.name + ".miss.json").unlink(missing_ok=True)  # an old miss's
    print(done_line(names, args.out, unavailable, exporter))


if __name__ == "__main__":
    run(main)
