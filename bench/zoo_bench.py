"""Benchmark: every classifier in torchvision's registry, through the project's own code paths.

For each of `torchvision.models.list_models(module=torchvision.models)` (80 in torchvision 0.29),
at the smallest size the architecture takes (32 px, or the size `zoo.size_problem` names: 224 for
ViT, Swin and MaxViT, 75 for inception_v3, ...), with 3 classes and random weights (no downloads):
  - build:   `models.build_model` (zoo.finetune: the FineTune wrapper and its dummy forward);
             parameters counted
  - train:   one step (forward, cross-entropy, backward, Adam) on a batch of 4 random images;
             the second of two steps is timed (the first allocates)
  - onnx:    `export.export_onnx` (the dynamo exporter, the legacy one as its recorded fallback),
             then parity with eager on 4 random uint8 images at batch 1, 3 and 4, checked as the
             export stage's `check_formats` checks ONNX (the file's own preprocessing, ONNX
             Runtime, params.yaml's export.onnx_rtol/onnx_atol and min_top1_agreement)
  - int8:    `quantize.quantize_onnx` (QDQ, minmax, calibrated on 8 random images): file sizes,
             and top-1 agreement and the largest logit difference with the fp32 file on 16
             other random images. Random weights on random images: no accuracy here
  - latency: the fp32 ONNX file in ONNX Runtime at batch 1 and 32, median ms
Each model runs in a fresh process, pinned to one core, torch and ONNX Runtime on one thread, with
a wall-clock budget (`--budget`, 240 s) and a memory budget (`--max-rss-gb`, 8 GB of resident
memory): past either it is killed and recorded as "timed out at <step>" (or "out of memory at
<step>"). A failing step is recorded with a one-line reason and the next steps that can still run
do. Results go to bench/zoo.json, one entry per model, written after each model, so a stopped run
resumes where it stopped (`--again` reruns models already there); `--until` stops launching
models at a clock time, and the rest are "not run (time)". docs/zoo.md is rewritten from the
JSON after each model (`--table` only rewrites it). The cheapest model of each family first, then
the next of each (torchvision's GFLOPs at the size run), so a run cut short has tried every family.

    nice -n 19 .venv/bin/python bench/zoo_bench.py [--budget 240] [--until 09:40] [--again]
        [--only resnet18,vit_b_16] [--table]
"""

import argparse
import datetime
import functools
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "zoo.json"
TABLE = ROOT / "docs" / "zoo.md"
SMALL = 32  # px: the size tried first
CLASSES = 3
BATCH = 4  # images per training step
PARITY_IMAGES = 4  # parity at batch 1, 3 and 4, as check_formats picks them
CALIBRATION_IMAGES = 8
AGREEMENT_IMAGES = 16
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # ImageNet's, as the weights want
# what the page says below the counts: read off the run of 2026-12-03 (rewrite after a new run)
NOTES = [
    "What the run says:",
    "",
    "- **Every model that ran was built, trained a step and exported to ONNX by the dynamo "
    "exporter** (the legacy fallback was never needed), and every ONNX file matched eager "
    "PyTorch within `export.onnx_rtol`/`onnx_atol` with the same top-1 class: the `FineTune` "
    "wrapper (centre crop, 3 channels) exports in every family tried.",
    "- **INT8**: `swin_v2_t` and `swin_v2_s` fail inside `quantize_onnx` (`TypeError: object "
    "of type 'NoneType' has no len()`, in ONNX Runtime's quantizer; not isolated further: the "
    "bench now records the raising frame); `vit_l_16` and `vit_l_32` went past 8 GB resident "
    "while ONNX Runtime calibrated them (fp32 files of 1.2 GB; calibration keeps every "
    "intermediate tensor)."
    " On random weights the INT8 logits of "
    "the LayerNorm networks move most (`convnext_tiny` 62% of the largest logit, `vit_b_32` "
    "46%; most CNNs under 10%): random weights on random images, so this is a warning sign, "
    "not a measure; the export stage's gate is test accuracy.",
    "- **Sizes**: ViT and MaxViT really take one size (`maxvit_t` fails at 32 and 64 px). "
    "Swin is refused below its weights' `min_size` (224, v2 256) by `zoo.size_problem`, but "
    "torchvision's Swin pads its windows and runs at 32 px (`swin_t`, `swin_v2_t` checked at "
    "32 and 64 px): from scratch the limit is stricter than the network. `inception_v3` needs "
    "75 px, `alexnet` 63, `efficientnet_v2_*` 33 (their weights' `min_size`).",
    "- **vit_h_14** (fixed): its DEFAULT weights are 518 px, the size "
    "`size_problem` asks for, but `zoo.build` built it at torchvision's no-weights default of "
    "224, so at 518 px the dummy forward failed (`AssertionError: Wrong image height! Expected "
    "224 but got 518!`, a traceback: `build_model` caught RuntimeError only) and a file of "
    "the DEFAULT weights was refused (`other shapes encoder.pos_embedding`). `zoo.build` now "
    "gives a ViT its input size (the weights' size), as torchvision's builder does when it "
    "loads them. At 518 px its training step needs more than the bench's 8 GB.",
    "- `inception_v3` (random weights, one step): its eval-mode logits reach about 2e6 "
    "(BatchNorm's running statistics have seen one batch of 4), so its 4.0 logit difference is "
    "1e-6 of the logits and within the relative tolerance.",
    "- Times come from one shared, niced core: a model's train step and latencies can be off "
    "by 2x against its neighbours (resnet50's step took 2x resnext50_32x4d's). Export takes "
    "10-130 s a model, quantization 1-80 s: 70 models took 78 minutes, and the 10 costliest "
    "(VGG-16/19, RegNet 32/128 GF, Swin-B and V2-B, vit_h_14 at 518 px) 12 minutes more.",
]


# ---------------------------------------------------------------- one model, in its own process


def one_line(e: BaseException) -> str:
    """`Type: first line of the message`, at most 240 characters."""
    text = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {text[0] if text else ''}".strip().rstrip(":")
    return line if len(line) <= 240 else line[:237] + "..."


def failure(e: BaseException) -> dict:
    """A failed step: its one-line reason, and where it was raised (the innermost frame)."""
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}" if frame else "?"
    return {"ok": False, "error": one_line(e), "where": where}


def smallest_size(name: str) -> tuple[int, str | None]:
    """32 px, or the size zoo.size_problem names for a network from scratch; and its line."""
    from visionflow.train import zoo

    problem = zoo.size_problem(name, SMALL, "")
    if problem is None:
        return SMALL, None
    found = re.search(r"set prepare\.image_size to (\d+)", problem)
    if not found:
        raise ValueError(f"size_problem names no size: {problem}")
    return int(found.group(1)), problem


def ort_options():
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return options


def random_pixels(n: int, size: int, seed: int):
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def train_step_ms(model, size: int) -> float:
    """Forward, loss, backward and an Adam step on a batch of BATCH; the second of two, in ms."""
    import torch
    import torch.nn.functional as F

    model.train()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(BATCH, 3, size, size, generator=torch.Generator().manual_seed(0))
    y = torch.arange(BATCH) % CLASSES
    times = []
    for _ in range(2):
        start = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite loss {loss.item()}")
    return times[-1] * 1000


def onnx_parity(model, size: int, folder: Path, e) -> tuple[dict, Path, dict, dict]:
    """export_onnx with the stage's metadata, then ONNX parity as check_formats checks it."""
    import torch

    from visionflow.deploy.export import check_parity, export_onnx
    from visionflow.deploy.inference import (
        file_metadata,
        load_predictor,
        module_predictor,
        preprocess_spec,
        to_input,
    )
    from visionflow.train.loading import to_model_input

    model.eval()
    spec = preprocess_spec(size, 3, MEAN, STD)
    metadata = file_metadata([f"class{i}" for i in range(CLASSES)], spec)
    pixels = random_pixels(PARITY_IMAGES, size, seed=1)
    example = torch.from_numpy(to_input(pixels, spec))
    path = folder / "model.onnx"
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exporter = export_onnx(model, example, path, e.opset, metadata)
    record = {"exporter": exporter, "export_s": round(time.perf_counter() - start, 2)}
    if exporter != "dynamo":  # why the dynamo exporter failed: export_onnx's warning
        fallback = [str(w.message) for w in caught if "dynamo ONNX export failed" in str(w.message)]
        record["dynamo_error"] = fallback[0].splitlines()[0][:240] if fallback else "?"
    predictor, _, file_spec = load_predictor("onnx", path, onnx_options=ort_options())
    eager = module_predictor(model)
    mean, std = torch.tensor(MEAN), torch.tensor(STD)
    parity = check_parity(
        lambda p: eager(to_model_input(torch.from_numpy(p), mean, std).numpy()),
        lambda p: predictor(to_input(p, file_spec)),
        pixels,
        sorted({1, 3, PARITY_IMAGES}),
        e.onnx_rtol,
        e.onnx_atol,
        e.min_top1_agreement,
    )
    worst = max(r["max_abs_diff"] for r in parity.values())
    record |= {
        "max_abs_diff": worst,
        "max_rel_diff": max(r["max_rel_diff"] for r in parity.values()),
        "top1_agreement": min(r["top1_agreement"] for r in parity.values()),
        "passed": all(r["passed"] for r in parity.values()),
        "logit_scale": float(abs(eager(example.numpy())).max()),  # what the diff is relative to
    }
    return record, path, spec, metadata


def int8(path: Path, size: int, spec: dict, metadata: dict) -> dict:
    """quantize_onnx, then the INT8 file against the fp32 one on random images."""
    import numpy as np

    from visionflow.deploy.inference import load_predictor, to_input
    from visionflow.deploy.quantize import quantize_onnx

    out = path.with_name("model.int8.onnx")
    start = time.perf_counter()
    quantize_onnx(path, out, random_pixels(CALIBRATION_IMAGES, size, 2), spec, "minmax", metadata)
    seconds = time.perf_counter() - start
    fp32 = load_predictor("onnx", path, onnx_options=ort_options())[0]
    q8 = load_predictor("onnx", out, onnx_options=ort_options())[0]
    x = to_input(random_pixels(AGREEMENT_IMAGES, size, 3), spec)
    a, b = fp32(x), q8(x)
    return {
        "quantize_s": round(seconds, 2),
        "fp32_mb": path.stat().st_size / 1e6,
        "int8_mb": out.stat().st_size / 1e6,
        "top1_agreement": float((a.argmax(1) == b.argmax(1)).mean()),
        "max_abs_diff": float(np.abs(a - b).max()),
        "logit_scale": float(np.abs(a).max()),
    }


def latency(path: Path, size: int, spec: dict) -> dict:
    """Median ms per call of the fp32 ONNX file at batch 1 (5 calls) and 32 (3, or 1 when a
    call takes over 20 s), one thread."""
    from visionflow.deploy.export import latency_ms
    from visionflow.deploy.inference import load_predictor, to_input

    run = load_predictor("onnx", path, onnx_options=ort_options())[0]
    x1 = to_input(random_pixels(1, size, 4), spec)
    x32 = to_input(random_pixels(32, size, 5), spec)
    start = time.perf_counter()
    run(x32)
    slow = time.perf_counter() - start > 20
    return {
        "b1_ms": latency_ms(lambda: run(x1), 5, warmup=2),
        "b32_ms": latency_ms(lambda: run(x32), 1 if slow else 3, warmup=0),
    }


def measure(name: str, save) -> None:
    """Every step for `name`; `save(step=..., **fields)` records progress as it goes (the parent
    reads it if this process is killed)."""
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    from visionflow.params import load_params
    from visionflow.train.models import build_model

    e = load_params(ROOT / "params.yaml").export
    save(step="size")
    size, problem = smallest_size(name)
    save(input_px=size, size_problem_at_32=problem, step="build")
    start = time.perf_counter()
    network = {"input_size": size, "mean": MEAN, "std": STD}
    try:
        model = build_model(name, 3, CLASSES, size, network=network)
    except Exception as err:
        save(build=failure(err), step="done")
        return
    params = sum(p.numel() for p in model.parameters())
    save(build={"ok": True, "s": round(time.perf_counter() - start, 2)}, params=params)
    save(step="train")
    try:
        save(train={"ok": True, "ms": train_step_ms(model, size)})
    except Exception as err:
        save(train=failure(err))
    save(step="onnx")
    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
        try:
            record, path, spec, metadata = onnx_parity(model, size, Path(tmp), e)
            save(onnx={"ok": True, **record})
        except Exception as err:
            save(onnx=failure(err), step="done")
            return
        del model
        for step, fn in (("int8", int8), ("latency", latency)):
            save(step=step)
            try:
                args = (path, size, spec, metadata) if step == "int8" else (path, size, spec)
                save(**{step: {"ok": True, **fn(*args)}})
            except Exception as err:
                save(**{step: failure(err)})
    save(step="done")


def child(name: str, progress: Path) -> None:
    record = {"model": name}

    def save(**fields) -> None:
        record.update(fields)
        tmp = progress.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, progress)

    warnings.filterwarnings("ignore")  # torch.onnx and torch.jit chatter: the results say it
    try:
        measure(name, save)
    except Exception as err:  # a step outside the per-step guards (size, params.yaml)
        save(error=one_line(err), trace=traceback.format_exc()[-2000:])


# ---------------------------------------------------------------- the table, from the JSON


def fmt(x: float | None, digits: int = 3) -> str:
    """A number for the table: 3 significant digits, or a dash."""
    if x is None:
        return "–"
    return f"{x:.{digits}g}" if abs(x) < 10**digits else f"{x:.0f}"


def outcome(r: dict | None) -> str:
    """One word per model: works, fails (a step failed), timed out, ..., not run (time)."""
    if r is None:
        return "not run (time)"
    if r.get("stopped"):
        return r["stopped"].split(" at ")[0]
    if r.get("error"):
        return "fails"
    steps = [r.get(s) for s in ("build", "train", "onnx", "int8", "latency")]
    if all(s and s.get("ok") for s in steps) and r["onnx"]["passed"]:
        return "works"
    return "fails"


def first_problem(r: dict) -> tuple[str, str] | None:
    """(step, reason) of the first thing that did not work, or None."""
    if r.get("error"):
        return "setup", r["error"]
    for step in ("build", "train", "onnx", "int8", "latency"):
        s = r.get(step)
        if s is None:
            return (step, r["stopped"]) if r.get("stopped") else None
        if not s.get("ok"):
            return step, s["error"]
        if step == "onnx" and not s["passed"]:
            return (
                "onnx parity",
                f"max abs diff {s['max_abs_diff']:.2e} (logits up to {s['logit_scale']:.3g})",
            )
    return ("?", r["stopped"]) if r.get("stopped") else None


@functools.cache
def static(name: str) -> tuple[int | None, int | None]:
    """The input side and the parameter count (3 classes, built on the meta device: no memory)
    of a model without a record (not run, or stopped before it was built)."""
    import torch

    from visionflow.train import zoo

    try:
        size = smallest_size(name)[0]
        with torch.device("meta"):
            net = zoo.build(name, CLASSES, size)
        return size, sum(p.numel() for p in net.parameters())
    except Exception:
        return None, None


def cells(name: str, r: dict | None) -> list[str]:
    if r is None or r.get("params") is None:
        px, count = static(name)
        r = {**(r or {}), "input_px": px, "params": count, "not_run": r is None}
    if r.get("not_run"):
        params = fmt(r["params"] / 1e6) if r["params"] else "–"
        return [
            f"`{name}`",
            str(r["input_px"] or "–"),
            params,
            "not run (time)",
            "–",
            "–",
            "–",
            "–",
        ]
    build, train = r.get("build") or {}, r.get("train") or {}
    onnx_, q8, lat = r.get("onnx") or {}, r.get("int8") or {}, r.get("latency") or {}
    params = fmt(r["params"] / 1e6) if r.get("params") else "–"
    step = train.get("ms") if train.get("ok") else None
    train_cell = fmt(step) if step is not None else (f"fails: {train['error']}" if train else "–")
    if not build.get("ok", True):
        train_cell = f"build fails: {build['error']}"
    if onnx_.get("ok"):
        diff = f"{onnx_['max_abs_diff']:.1e}"
        onnx_cell = (diff if onnx_["passed"] else f"**miss** {diff}") + (
            f" (legacy exporter: dynamo failed: {onnx_.get('dynamo_error')})"
            if onnx_["exporter"] != "dynamo"
            else ""
        )
    else:
        onnx_cell = f"fails: {onnx_['error']}" if onnx_ else "–"
    if q8.get("ok"):
        q8_cell = (
            f"ok, {fmt(q8['int8_mb'])} MB ({q8['int8_mb'] / q8['fp32_mb']:.2f}x), "
            f"agree {q8['top1_agreement']:.2f}, err {q8['max_abs_diff'] / q8['logit_scale']:.0%}"
        )
    else:
        q8_cell = f"fails: {q8['error']}" if q8 else "–"
    if lat.get("ok"):
        lat_b1, lat_b32 = fmt(lat["b1_ms"]), fmt(lat["b32_ms"])
    else:
        lat_b1 = lat_b32 = f"fails: {lat['error']}" if lat else "–"
    row = [f"`{name}`", str(r.get("input_px", "–")), params, train_cell, onnx_cell, q8_cell]
    row += [lat_b1, lat_b32]
    if r.get("stopped"):  # the first cell not reached says where it stopped
        where = next((i for i, c in enumerate(row) if c == "–" and i >= 3), None)
        if where is not None:
            row[where] = r["stopped"]
    return [c.replace("|", "\\|") for c in row]


def line(r: dict) -> str:
    """One line per model for the log."""
    problem = first_problem(r)
    tail = f": {problem[0]}: {problem[1]}" if problem else ""
    return f"{r['model']} {outcome(r)} in {r.get('wall_s', '?')} s{tail}"


def write(names: list[str], results_path: Path, table_path: Path) -> None:
    data = json.loads(results_path.read_text()) if results_path.exists() else {}
    results, v = data.get("models", {}), data.get("versions", {})
    settings = data.get("settings", {})
    rows = {n: results.get(n) for n in names}
    counts: dict[str, list[str]] = {}
    by_step: dict[str, list[str]] = {}
    for n, r in rows.items():
        counts.setdefault(outcome(r), []).append(n)
        if r is not None and outcome(r) == "fails":
            step, why = first_problem(r)
            by_step.setdefault(step, []).append(f"`{n}` ({why})")
    dates = sorted({r["date"] for r in results.values() if r and r.get("date")})
    out = [
        "# The torchvision registry, measured",
        "",
        f"Every classifier in torchvision's registry ({len(names)} models), run through the "
        "project's own code paths by `bench/zoo_bench.py`: built with `models.build_model` "
        "(the `FineTune` wrapper), one training step, ONNX export with `export.export_onnx` and "
        "the export stage's parity check, INT8 with `quantize.quantize_onnx`, and ONNX Runtime "
        "latency. Random weights (no downloads), 3 classes, the smallest input each architecture "
        "takes. Raw numbers: `bench/zoo.json`. Regenerate this page with "
        "`.venv/bin/python bench/zoo_bench.py --table`.",
        "",
        f"Run {', '.join(dates) or '–'} on {settings.get('machine', '?')}; torch "
        f"{v.get('torch', '?')}, torchvision {v.get('torchvision', '?')}, onnx "
        f"{v.get('onnx', '?')}, onnxruntime {v.get('onnxruntime', '?')}, Python "
        f"{v.get('python', '?')}. Torch and ONNX Runtime on one thread; each model in its own "
        f"process with {settings.get('budget_s', 240):.0f} s and "
        f"{settings.get('max_rss_gb', 8):g} GB of resident memory. The machine is shared with "
        "other work: times are indicative, not a ranking to a few percent.",
        "",
        "## Summary",
        "",
    ]
    for word in ("works", "fails", "timed out", "out of memory", "process died", "not run (time)"):
        if word in counts:
            out.append(f"- **{word}**: {len(counts[word])}")
    for step, items in by_step.items():
        out.append(f"- fails at {step} ({len(items)}): {'; '.join(items)}")
    for word in ("timed out", "out of memory", "process died", "not run (time)"):
        if word in counts:
            where = [f"`{n}` ({rows[n]['stopped']})" if rows[n] else f"`{n}`" for n in counts[word]]
            out.append(f"- {word}: {', '.join(where)}")
    out += ["", *step_table(rows), "", *NOTES, ""]
    out += [
        "## Every model",
        "",
        "Columns: input side in px; parameters in millions (3 classes); one training step "
        f"(forward, backward, Adam) on a batch of {BATCH}, ms; ONNX parity against eager PyTorch: "
        "the largest logit difference at batch 1, 3 and 4 (**miss** when outside "
        "`export.onnx_rtol`/`onnx_atol` or a top-1 flip); INT8 (QDQ): the file's size and its "
        "share of the fp32 file's, top-1 agreement with fp32 on 16 random images, and the largest "
        "logit difference as a share of the largest fp32 logit (random weights: no accuracy "
        "here; the export stage's gate is test accuracy); fp32 ONNX "
        "Runtime latency, median ms per call, at batch 1 and 32.",
        "",
        "| model | px | params (M) | train step ms | ONNX parity | INT8 | b1 ms | b32 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    out += ["| " + " | ".join(cells(n, r)) + " |" for n, r in rows.items()]
    table_path.write_text("\n".join(out) + "\n")


def step_table(rows: dict) -> list[str]:
    """How many models reached each step, and how it went there."""
    ran = [r for r in rows.values() if r is not None]

    def count(step: str, test) -> int:
        return sum(1 for r in ran if r.get(step) is not None and test(r[step]))

    def stopped(step: str) -> int:
        return sum(1 for r in ran if (r.get("stopped") or "").split(" at ")[-1].startswith(step))

    ok = lambda s: s.get("ok")  # noqa: E731
    failed = lambda s: not s.get("ok")  # noqa: E731
    exporters = {
        name: count("onnx", lambda s, n=name: s.get("exporter") == n)
        for name in ("dynamo", "legacy")
    }
    parity = count("onnx", lambda s: s.get("ok") and s["passed"])
    return [
        "| step | ok | failed | stopped here (time or memory) |",
        "|---|---|---|---|",
        f"| build | {count('build', ok)} | {count('build', failed)} | {stopped('build')} |",
        f"| train step | {count('train', ok)} | {count('train', failed)} | {stopped('train')} |",
        f"| ONNX export | {count('onnx', ok)} (dynamo {exporters['dynamo']}, legacy fallback "
        f"{exporters['legacy']}) | {count('onnx', failed)} | {stopped('onnx')} |",
        f"| ONNX parity | {parity} | {count('onnx', lambda s: s.get('ok') and not s['passed'])}"
        " | – |",
        f"| INT8 | {count('int8', ok)} | {count('int8', failed)} | {stopped('int8')} |",
        f"| latency | {count('latency', ok)} | {count('latency', failed)} | {stopped('latency')} |",
    ]


# ---------------------------------------------------------------- the parent: every model


def rss_gb(pid: int) -> float:
    """Resident memory of `pid` and its children, in GB (from /proc)."""
    total = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        ppid = re.search(r"PPid:\s+(\d+)", text)
        if status.parent.name == str(pid) or (ppid and ppid.group(1) == str(pid)):
            found = re.search(r"VmRSS:\s+(\d+)", text)
            total += int(found.group(1)) if found else 0
    return total / 1e6


def run_one(name: str, budget: float, max_rss: float) -> dict:
    """`name` in a fresh process pinned to one core; its record, or why it was stopped."""
    with tempfile.TemporaryDirectory(prefix="zoo-run-") as tmp:
        progress, log = Path(tmp) / "progress.json", Path(tmp) / "stderr.txt"
        core = {max(os.sched_getaffinity(0))}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with log.open("wb") as stderr:  # a file, not a pipe: a chatty child never blocks on it
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", name, "--progress", str(progress)],
                env=env,
                start_new_session=True,
                preexec_fn=lambda: os.sched_setaffinity(0, core),
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        start, stopped = time.monotonic(), None
        while proc.poll() is None:
            time.sleep(0.5)
            if time.monotonic() - start > budget:
                stopped = "timed out"
            elif rss_gb(proc.pid) > max_rss:
                stopped = "out of memory"
            if stopped:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        stderr = log.read_text(errors="replace")
        record = json.loads(progress.read_text()) if progress.exists() else {"model": name}
    record["wall_s"] = round(time.monotonic() - start, 1)
    step = record.pop("step", "start")
    if stopped and step != "done":  # (a child killed as it exited had finished)
        limit = f"{budget:.0f} s" if stopped == "timed out" else f"over {max_rss:g} GB resident"
        record["stopped"] = f"{stopped} at {step} ({limit})"
    elif step != "done" and "error" not in record:  # died without a Python exception
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        record["stopped"] = f"process died at {step} (exit {proc.returncode})" + (
            f": {lines[-1][:200]}" if lines else ""
        )
    return record


def cost(name: str) -> float:
    """torchvision's GFLOPs for its default weights, scaled to the size run (the order to run in)."""
    from visionflow.train import zoo

    meta = zoo.weights_enum(name, "").meta
    crop = zoo.preprocessing(name, "")["crop_size"]
    size = smallest_size(name)[0]
    return meta.get("_ops", 1.0) * (size / crop) ** 2


def run_order(names: list[str]) -> list[str]:
    """The cheapest model of each family first (vgg, vit, swin, ...), then the next of each: a
    run cut short has measured every family it could."""
    by_cost = sorted(names, key=cost)
    rank, seen = {}, {}
    for name in by_cost:
        family = re.match(r"[a-z]+", name).group()
        rank[name] = seen[family] = seen.get(family, -1) + 1
    return sorted(by_cost, key=lambda n: rank[n])  # stable: by cost within a rank


def load_results() -> dict:
    return json.loads(RESULTS.read_text())["models"] if RESULTS.exists() else {}


def versions() -> dict:
    import onnx
    import onnxruntime
    import torch
    import torchvision

    return {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": platform.python_version(),
    }


def save_results(results: dict, settings: dict) -> None:
    data = {"settings": settings, "versions": versions(), "models": results}
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, RESULTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=240, help="seconds per model")
    parser.add_argument("--max-rss-gb", type=float, default=8.0, help="resident memory per model")
    parser.add_argument("--until", help="HH:MM: launch no model after this (local time)")
    parser.add_argument("--again", action="store_true", help="rerun models already measured")
    parser.add_argument("--only", help="comma-separated model names")
    parser.add_argument("--table", action="store_true", help="only rewrite docs/zoo.md")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--progress", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.progress)

    from visionflow.train import zoo

    names = zoo.registry()
    if args.table:
        return write(names, RESULTS, TABLE)
    deadline = None
    if args.until:
        hour, minute = map(int, args.until.split(":"))
        deadline = datetime.datetime.now().replace(hour=hour, minute=minute, second=0)
    results = load_results()
    todo = args.only.split(",") if args.only else names
    todo = run_order([n for n in todo if args.again or n not in results])
    settings = {
        "budget_s": args.budget,
        "max_rss_gb": args.max_rss_gb,
        "batch": BATCH,
        "classes": CLASSES,
        "machine": f"{os.cpu_count()} CPU cores (shared), one pinned per model, nice 19",
    }
    for i, name in enumerate(todo):
        if deadline and datetime.datetime.now() >= deadline:
            print(f"--until {args.until} reached: {len(todo) - i} models not run", flush=True)
            break
        record = run_one(name, args.budget, args.max_rss_gb)
        record["date"] = datetime.date.today().isoformat()
        results[name] = record
        save_results(results, settings)
        write(names, RESULTS, TABLE)
        print(f"[{i + 1}/{len(todo)}] {line(record)}", flush=True)


if __name__ == "__main__":
    main()
