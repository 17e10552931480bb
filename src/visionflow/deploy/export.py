"""Export to ONNX, torch.export (`.pt2`) and TorchScript, and prove each computes what eager does.

The torch.export-based ONNX exporter (`dynamo=True`) is tried first; it has had accuracy regressions
upstream, so parity is a hard gate and the legacy exporter is a recorded fallback. TorchScript is
deprecated by PyTorch (its calls warn); users still ask for it, so it is exported with those
warnings silenced here and the deprecation stated in docs/export-and-serving.md.
"""

import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from visionflow.deploy.inference import (
    JIT_DEPRECATED,
    Predictor,
    load_predictor,
    module_predictor,
    to_input,
)
from visionflow.errors import CannotExport
from visionflow.train.loading import to_model_input

EXPORTER_KEY = "visionflow.exporter"  # in model.onnx: which torch.onnx exporter wrote it
FILES = {"onnx": "model.onnx", "pt2": "model.pt2", "torchscript": "model.torchscript.pt"}


def export_onnx(
    model: nn.Module,
    example: torch.Tensor,
    path: Path,
    opset: int,
    metadata: dict[str, str],
    program: torch.export.ExportedProgram | None = None,
) -> str:
    """Write `model` (eval, CPU, fp32) with a dynamic batch and metadata; returns the exporter
    used. `program`: the model's `exported` program, when made already."""
    names = {"input_names": ["image"], "output_names": ["logits"], "opset_version": opset}
    try:
        program = program or exported(model, example)
        torch.onnx.export(
            program, (example,), str(path), dynamo=True, external_data=False, verbose=False, **names
        )
        exporter = "dynamo"
    except (
        Exception
    ) as error:  # the new exporter fails on some models; the legacy one is the fallback
        warnings.warn(
            f"dynamo ONNX export failed ({type(error).__name__}: {error}); using dynamo=False",
            stacklevel=2,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(
                model,
                (example,),
                str(path),
                dynamo=False,
                dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}},
                **names,
            )
        exporter = "legacy"
    proto = onnx.load(str(path))
    onnx.helper.set_model_props(proto, {**metadata, EXPORTER_KEY: exporter})
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(path))
    return exporter


def onnx_opset(path: Path) -> int:
    """The default-domain opset a written ONNX file really declares."""
    model = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def exported(model: nn.Module, example: torch.Tensor) -> torch.export.ExportedProgram:
    """`model` through torch.export with a dynamic batch, less the source lines torch keeps in
    each node (`stack_trace`: absolute paths into this checkout and its venv). The ONNX
    exporter copies them into every node of model.onnx (`pkg.torch.onnx.stack_trace`, and so
    into model.int8.onnx), torch.export.save into model.pt2: the same commit exported in two
    folders gave two model.onnx files, and the user's home path shipped in every model."""
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(model, (example,), dynamic_shapes={"x": {0: batch}})
    for module in program.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                node.meta.pop("stack_trace", None)
    return program


def export_pt2(
    model: nn.Module,
    example: torch.Tensor,
    path: Path,
    metadata: dict[str, str],
    program: torch.export.ExportedProgram | None = None,
) -> None:
    torch.export.save(program or exported(model, example), str(path), extra_files=metadata)


def export_torchscript(
    model: nn.Module, example: torch.Tensor, path: Path, metadata: dict[str, str]
) -> None:
    """Traced in eval mode (the parity gate checks the trace at every batch size)."""
    with warnings.catch_warnings():  # "torch.jit.* is deprecated": known, and said in the docs
        warnings.filterwarnings("ignore", message=JIT_DEPRECATED)
        traced = torch.jit.trace(model, example, check_trace=False)
        forget_source_lines(traced)
        torch.jit.save(traced, str(path), _extra_files=metadata)


def forget_source_lines(traced: torch.jit.ScriptModule) -> None:
    """Clear what the tracer recorded of each node's Python call stack: absolute paths into this
    checkout and its venv, and line numbers of the calling code, which torch.jit.save writes
    into the file's `.debug_pkl` records. The same commit exported in another folder (a fresh
    clone) gave another model.torchscript.pt, and so another dvc.lock."""
    scratch = torch._C.Graph()
    blank = scratch.create("prim::Constant")  # no source range, scope or call stack

    def clear(nodes) -> None:
        for node in nodes:
            node.copyMetadata(blank)
            for block in node.blocks():
                clear(block.nodes())

    for module in traced.modules():
        for name in module._c._method_names():
            clear(module._c._get_method(name).graph.nodes())


def compare(
    expected: np.ndarray, actual: np.ndarray, rtol: float, atol: float, min_top1: float = 1.0
) -> dict:
    """Max absolute and relative difference, top-1 agreement, and whether within tolerance."""
    diff = np.abs(expected.astype(np.float64) - actual.astype(np.float64))
    agree = expected.argmax(1) == actual.argmax(1)
    return {
        "max_abs_diff": float(diff.max()),
        "max_rel_diff": float((diff / np.maximum(np.abs(expected), 1e-12)).max()),
        "top1_agreement": float(agree.mean()),
        "passed": bool(np.all(diff <= atol + rtol * np.abs(expected)) and agree.mean() >= min_top1),
    }


def check_parity(
    reference: Callable[[np.ndarray], np.ndarray],
    candidate: Callable[[np.ndarray], np.ndarray],
    pixels: np.ndarray,
    batch_sizes: list[int],
    rtol: float,
    atol: float,
    min_top1: float = 1.0,
) -> dict[str, dict]:
    """Compare two functions of uint8 NHWC images on the first n images, for each n."""
    return {
        f"batch_{n}": compare(reference(pixels[:n]), candidate(pixels[:n]), rtol, atol, min_top1)
        for n in batch_sizes
    }


def export_all(
    model: nn.Module, example: torch.Tensor, folder: Path, opset: int, metadata: dict[str, str]
) -> tuple[dict[str, Path], str, dict[str, str]]:
    """Write the three formats into `folder`; returns the paths of those made, the ONNX exporter
    used, and for each format that cannot express the model, why (one line): some architectures
    do not trace or do not pass torch.export. ONNX, which INT8 and serving need, must be made."""
    paths = {runtime: folder / name for runtime, name in FILES.items()}
    try:  # made once for ONNX's dynamo exporter and model.pt2 (it is the slow part)
        program = exported(model, example)
    except Exception:  # each says why below (ONNX through the legacy exporter)
        program = None
    try:
        exporter = export_onnx(model, example, paths["onnx"], opset, metadata, program)
    except Exception as error:  # both exporters failed
        raise CannotExport(
            f"ONNX cannot express {type(model).__name__}: {one_line(error)}"
        ) from None
    unavailable = {}
    writers = {"pt2": partial(export_pt2, program=program), "torchscript": export_torchscript}
    for runtime, write in writers.items():
        try:
            write(model, example, paths[runtime], metadata)
        except Exception as error:  # the format cannot express this model: said, not promoted
            paths.pop(runtime).unlink(missing_ok=True)
            unavailable[runtime] = one_line(error)
    return paths, exporter, unavailable


def one_line(error: Exception) -> str:
    """An exporter's error as one line of at most 300 characters."""
    words = " ".join(str(error).split())
    return f"{type(error).__name__}: {words[:300]}"


def check_formats(
    model: nn.Module,
    paths: dict[str, Path],
    pixels: np.ndarray,
    classes: list[str],
    spec: dict,
    onnx_tol: tuple[float, float],
    torch_tol: tuple[float, float],
    min_top1: float,
) -> tuple[dict[str, dict], dict[str, Predictor]]:
    """Parity of each exported file with eager `model`, loaded as a client loads it.

    ONNX is checked end to end as a client runs it: uint8 images, the preprocessing read from the
    file, ONNX Runtime, against the training path (torch normalisation, eager model). The torch
    formats get the same normalised batch as eager, so their tolerance can be tight. A file whose
    class names or preprocessing differ from the model's fails too.
    """
    mean, std = torch.tensor(spec["mean"]), torch.tensor(spec["std"])
    eager = module_predictor(model)
    batch_sizes = sorted({min(n, len(pixels)) for n in (1, 3, len(pixels))})
    normalised = to_model_input(torch.from_numpy(pixels), mean, std).contiguous().numpy()
    parity, predictors = {}, {}
    for runtime, path in paths.items():
        # files this process just wrote: the torch formats' code is its own
        predictor, file_classes, file_spec = load_predictor(runtime, path, trust_code=True)
        if runtime == "onnx":
            parity[runtime] = check_parity(
                lambda p: eager(to_model_input(torch.from_numpy(p), mean, std).numpy()),
                lambda p, r=predictor, s=file_spec: r(to_input(p, s)),
                pixels,
                batch_sizes,
                *onnx_tol,
                min_top1,
            )
        else:
            parity[runtime] = check_parity(
                eager, predictor, normalised, batch_sizes, *torch_tol, min_top1
            )
        if (file_classes, file_spec) != (classes, spec):
            parity[runtime]["metadata"] = {
                "passed": False,
                "classes": file_classes,
                "preprocess": file_spec,
            }
        predictors[runtime] = predictor
    return parity, predictors


WARMUP = 3  # untimed calls of each predictor at each batch size


def latency_table(
    predictors: dict[str, Predictor], x: np.ndarray, batch_sizes: tuple[int, ...], repeats: int
) -> dict[str, dict[str, float]]:
    """Median ms per call of each predictor, at each batch size (rows of `x` repeated to fill it).
    The predictors take turns, call by call, so that a pause of the machine (another process, a
    thread pool waking up) falls on all of them rather than on the one timed just then."""
    table = {}
    for n in batch_sizes:
        batch = x[np.arange(n) % len(x)]
        times = {name: [] for name in predictors}
        for turn in range(WARMUP + repeats):
            for name, predict in predictors.items():
                start = time.perf_counter()
                predict(batch)
                if turn >= WARMUP:
                    times[name].append(time.perf_counter() - start)
        table[f"batch_{n}"] = {
            name: float(np.median(seconds) * 1000) for name, seconds in times.items()
        }
    return table
