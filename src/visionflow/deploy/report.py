"""The model card: one Markdown page that says what a shipped model is, how good, and how exact.

It states only what the export stage's inputs say: the model's meta (train's model.pt), the
cache's manifest, evaluate's metrics and export's own reports; never params.yaml, whose values
may have changed since the model was trained, nor a timing: the card is a DVC output, the same
bytes for the same inputs, and the latency (different on every run) has a file of its own.
"""

import platform

import onnx
import onnxruntime
import torch

from visionflow.train.models import input_words


def python_release() -> str:
    """Python's feature release (3.11): its patch level (3.11.2 here, 3.11.7 there) is the
    machine's, changes no byte of the models, and made a fresh clone's dvc.lock differ."""
    return ".".join(platform.python_version_tuple()[:2])


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def draft_words(spec: dict) -> str:
    if spec.get("jpeg_draft"):
        return (
            "JPEGs at the reduced DCT scale that still covers the size, Pillow's "
            "`Image.draft(mode, (size, size))`"
        )
    return "at full size"


def resize_words(spec: dict) -> str:
    what = {
        "crop": "the centre square (aspect kept)",
        "squash": "the whole image (aspect not kept)",
    }[spec.get("fit", "squash")]
    if spec.get("reducing_gap"):
        return (
            f"{what}, a box reduce by a whole factor, then {spec['resize']} over the last "
            f"{spec['reducing_gap']:g}x or more, Pillow's `resize(..., reducing_gap=)`"
        )
    return f"{what}, {spec['resize']}"


def data_line(made_from: dict) -> str:
    """Where the data came from and how it was split, from the cache's manifest."""
    if "seed" not in made_from:
        return "Source and split: unknown (a cache prepared before they were recorded)."
    path = f" (`{made_from['path']}`)" if made_from.get("path") else ""
    by = "each image's name hash" if made_from.get("placed_by") == "name hash" else "a permutation"
    return (
        f"Source `{made_from.get('source', 'unknown')}`{path}, split train/val/test by {by} with "
        f"seed {made_from['seed']} (val {made_from['val_fraction']}, test "
        f"{made_from['test_fraction']})."
        + (
            f" {made_from['excluded']} files left out (`prepare.exclude`)."
            if made_from.get("excluded")
            else ""
        )
    )


def training_line(meta: dict) -> str:
    """The training values, from the model's meta (the budget: an early stop did fewer), those the
    fine-tuning recipe (train.recipe) set named, and how a fine-tune spread its rates."""
    t = meta.get("train")
    if not t:
        return "Training values: unknown (a model.pt saved before they were recorded)."
    words = {"optimizer": "optimizer", "scheduler": "scheduler", "weight_decay": "weight decay"}
    words |= {"dropout": "dropout", "label_smoothing": "label smoothing"}
    found = " (train.lr auto: the range test's suggestion)" if t.get("lr_found") else ""
    parts = [
        f"{t['epochs']} epoch" + ("s" if t["epochs"] != 1 else ""),
        f"batch {t['batch_size']}",
        f"lr {t['lr']}{found}",
        *(
            f"{said} {t[key]}"  # a key an older model.pt lacks is left out; no smoothing too
            for key, said in words.items()
            if key in t and (key != "label_smoothing" or t[key])
        ),
        f"seed {t['seed']}",
    ]
    line = ", ".join(parts) + "." + augment_words(t.get("augment"))
    if recipe := [words[key] for key in words if key in t.get("recipe", {})]:
        line += f" The fine-tuning recipe (train.recipe) set the {', '.join(recipe)}."
    if "backbone_lr_factor" in t:
        frozen = t["freeze_epochs"]
        line += (
            f" The new head alone for {frozen} epoch{'s' if frozen != 1 else ''}." if frozen else ""
        )
        line += (
            f" The backbone's last layer group at lr x {t['backbone_lr_factor']:g}, each earlier "
            f"one at x {t['group_lr_factor']:.3g} of the next."
        )
    return line


def augment_words(augment: dict | None) -> str:
    """The training augmentation (train.augment) in a sentence; none for an older model.pt."""
    if augment is None:
        return ""
    words = {
        "crop_padding": "shifts of up to {} px",
        "rotation": "rotations of up to {} degrees",
        "hflip": "mirroring",
        "color_jitter": "brightness and contrast within 1 +- {}",
        "mixup": "MixUp (alpha {})",
        "cutmix": "CutMix (alpha {})",
    }
    on = [said.format(f"{augment[key]:g}") for key, said in words.items() if augment.get(key)]
    return f" Training augmentation: {', '.join(on) if on else 'none'}."


def tta_line(metrics: dict) -> str:
    """What `tta_acc` is, when evaluate.tta wrote it: no exported file averages."""
    if "tta_acc" not in metrics:
        return ""
    return (
        "`tta_acc` is the test accuracy of the evaluate stage's test-time augmentation (the mean "
        "prediction over shifted crops and/or mirrored images, `evaluate.tta`); every exported "
        "file is single-pass, scored by `accuracy`.\n"
    )


def int8_section(int8: dict) -> str:
    """fp32 against INT8 ONNX: test accuracy, agreement and size, side by side."""
    sizes = int8["size_bytes"]
    rows = [
        ["test accuracy", f"{int8['fp32_accuracy']:.4f}", f"{int8['int8_accuracy']:.4f}"],
        ["top-1 agreement with fp32", "1", f"{int8['top1_agreement']:.4f}"],
        ["size (KB)", f"{sizes['onnx'] / 1024:.1f}", f"{sizes['onnx_int8'] / 1024:.1f}"],
    ]
    how = (
        f"Static quantization in {int8['format']} form by ONNX Runtime (activations "
        f"{int8['activations']}, weights {int8['weights']}), its ranges from "
        f"{int8['calibration']} calibration on {int8['calibration_images']} "
        f"{int8['calibration_split']} images; both files scored on all {int8['images']} test "
        f"images, and INT8 may lose at most {int8['max_accuracy_drop']} of fp32's accuracy "
        "or a drop the test split cannot tell from noise (a paired binomial test on the images "
        "where the two disagree, 95%). INT8 runs faster on CPUs with fast integer kernels, and "
        "on larger models; on others, serve `model.onnx` (the latency below says which the "
        "exporting machine was)."
    )
    return f"""## INT8 ONNX (`model.int8.onnx`)
{how}

{table(["", "fp32 `model.onnx`", "INT8 `model.int8.onnx`"], rows)}
"""


def parity_table(parity: dict) -> str:
    """Each format's parity check at each batch size, as a Markdown table."""
    rows = [
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
    return table(
        ["format", "batch", "max abs diff", "max rel diff", "top-1 agreement", "gate"], rows
    )


def model_card(
    meta: dict,
    manifest: dict,
    metrics: dict,
    parity: dict,
    spec: dict,
    int8: dict | None = None,
) -> str:
    """`meta` is model.pt's, `manifest` the cache's manifest.json; `parity` and `int8` are the
    export stage's reports, `spec` the preprocessing every exported file carries."""
    scores = [
        [k, f"{v:.4f}" if isinstance(v, float) else v]
        for k, v in metrics.items()
        if not isinstance(v, dict)
    ]
    return f"""# Model card: {meta["model"]}

Classes ({len(meta["classes"])}, in output order): {", ".join(meta["classes"])}

## Data
{data_line(manifest.get("made_from", {}))}
Labels: [the images most likely mislabelled](../sanity/label_issues.png) and [their
list](../sanity/label_issues.json) (file, split, given and suggested label), from the sanity stage
before training (`sanity.label_issues`).
Preprocessing: decode ({draft_words(spec)}), EXIF transpose, convert to {spec["color"]}, resize ({
        resize_words(spec)
    }) to
{spec["image_size"]}x{spec["image_size"]}, then `(pixel / 255 - mean) / std` with mean {
        [round(m, 4) for m in spec["mean"]]
    }
and std {[round(s, 4) for s in spec["std"]]}, float32 NCHW. Normalisation statistics: {
        meta.get("norm", "unknown (a model.pt saved before this was recorded)")
    }. Every exported file carries this as `visionflow.preprocess` and the class names as
`visionflow.classes`. The network sees {input_words(meta)}.

## Training
{training_line(meta)} Best epoch {meta["epoch"]} (val accuracy {meta["val_accuracy"]:.4f}).

## Test metrics
{table(["metric", "value"], scores)}

{
        tta_line(metrics)
    }Where it fails: [the highest-loss test images](../evaluate/top_losses.png) (predicted /
actual / loss / probability) and [the class pairs most confused](../evaluate/most_confused.json).

## Parity with eager PyTorch (real test images)
ONNX exporter: {parity["exporter"]}, opset {parity["opset"]}.

{parity_table(parity)}

{int8_section(int8) if int8 else ""}
## Latency
Measured anew on every run, on the machine that exported the model:
[latency.json](../export.timings/latency.json) beside this folder (the median ms per call of
each runtime at batch 1 and 64, and whether INT8 beat fp32), not on this page, whose bytes the
same inputs reproduce.

## Versions
{
        table(
            ["package", "version"],
            [
                ["python", python_release()],
                ["torch", torch.__version__],
                ["onnx", onnx.__version__],
                ["onnxruntime", onnxruntime.__version__],
                ["opset", parity["opset"]],
            ],
        )
    }
"""
