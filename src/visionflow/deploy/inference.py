"""Predictions from an exported model, with exactly the training preprocessing.

Every exported file carries its own description: the class names in output order and the
preprocessing (`visionflow.classes`, `visionflow.preprocess`; ONNX `metadata_props`, and extra files
inside the TorchScript and `.pt2` archives). A client needs the file and nothing else.

A model file may come from someone else, so nothing in it is taken on trust: the formats that can
run code when loaded (TorchScript, `.pt2`) load only when the caller says it trusts the file, the
metadata is checked for shape and type, and then against the network itself (its declared input
and output shapes, and one forward pass of the input the metadata describes) before any
prediction: forged or mismatched metadata is a ModelError naming what disagrees, never wrong labels.
"""

import json
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from visionflow.data.decode import FITS, RESIZE, RESIZE_FILTERS, Decode, to_pixels
from visionflow.errors import DataError, ModelError

# torch is imported by the torch runtimes only: the ONNX path runs on ONNX Runtime and NumPy

Predictor = Callable[[np.ndarray], np.ndarray]  # float32 NCHW batch -> logits
RUNTIMES = ("onnx", "torchscript", "pt2", "torch")
JIT_DEPRECATED = r".*torch\.jit\.\w+` is deprecated"  # TorchScript still works in torch 2.14
CLASSES_KEY, PREPROCESS_KEY = "visionflow.classes", "visionflow.preprocess"
QUANTIZATION_KEY = "visionflow.quantization"  # an INT8 file's record of what was done
MAX_IMAGE_SIZE = 1024  # px, as prepare.image_size: a larger size in metadata is forged or a mistake
# What loading each format can do beyond reading numbers: these two run code from the file.
RUNS_CODE = {
    "torchscript": "TorchScript is a program: loading it runs code stored in the file",
    "pt2": "torch.export.load unpickles some weights with weights_only=False, which can run code",
}


def preprocess_spec(
    image_size: int,
    channels: int,
    mean: list[float],
    std: list[float],
    background: list[int] = (255, 255, 255),
    jpeg_draft: bool = False,
    reducing_gap: float | None = None,
    resize: str = RESIZE,
    fit: str = "squash",
) -> dict:
    """How to turn an image file into the model's input, as data (see `load_images`)."""
    return {
        "image_size": image_size,
        # JPEGs: Pillow's Image.draft(mode, (image_size, image_size)) before decoding
        "jpeg_draft": jpeg_draft,
        "color": "grayscale" if channels == 1 else "rgb",
        # crop: the centre square of the image (aspect kept), squash: all of it, to image_size
        "fit": fit,
        "resize": resize,  # PIL resampling filter, to image_size x image_size
        # Pillow's resize(..., reducing_gap=): a box reduce by a whole factor first, then the
        # filter over the last reducing_gap times or more; null: the filter alone
        "reducing_gap": reducing_gap,
        "exif_transpose": True,
        "background": list(background),  # RGB under transparent pixels, before the colour mode
        "mean": mean,
        "std": std,
        "input": {
            "dtype": "float32",
            "layout": "NCHW",
            "pixel_range": [0, 255],  # uint8 pixels after decoding, before scaling
            "value": "(pixel / 255 - mean) / std",
        },
    }


def spec_of(meta: dict) -> dict:
    """The preprocessing of a model saved by the train stage (its meta)."""
    return preprocess_spec(
        meta["image_size"],
        meta["in_channels"],
        meta["mean"],
        meta["std"],
        meta["background"],
        meta.get("jpeg_draft", False),  # models trained before the draft decode: off
        meta.get("reducing_gap"),  # before the two-step resize: one step
        meta.get("resize", RESIZE),  # before prepare.interpolation: bilinear
        meta.get("fit", "squash"),  # before prepare.fit: the whole image squashed
    )


def file_metadata(classes: list[str], spec: dict) -> dict[str, str]:
    """The metadata written into every exported file."""
    return {CLASSES_KEY: json.dumps(classes), PREPROCESS_KEY: json.dumps(spec, sort_keys=True)}


def to_input(pixels: np.ndarray, spec: dict) -> np.ndarray:
    """uint8 NHWC -> float32 NCHW, as in training (`loading.to_model_input`), in NumPy."""
    mean = np.asarray(spec["mean"], np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(spec["std"], np.float32).reshape(1, -1, 1, 1)
    x = pixels.transpose(0, 3, 1, 2).astype(np.float32) / np.float32(255)
    return np.ascontiguousarray((x - mean) / std)


def load_images(paths: list[Path], spec: dict) -> tuple[np.ndarray, list[Path], dict[Path, str]]:
    """Decode what can be decoded; returns uint8 NHWC pixels, their paths, and errors by path."""
    pixels, good, errors = [], [], {}
    decode = Decode(
        spec["image_size"],
        spec["color"],
        tuple(spec["background"]),
        jpeg_draft=spec.get("jpeg_draft", False),  # files exported before it: full decoding
        reducing_gap=spec.get("reducing_gap"),  # and a one-step resize
        resize=spec["resize"],  # what the file says, checked against RESIZE_FILTERS
        exif_transpose=spec.get("exif_transpose", True),
        fit=spec.get("fit", "squash"),  # files exported before it: squashed
    )
    for path in paths:
        try:
            pixels.append(to_pixels(path, decode))
            good.append(path)
        except DataError as error:
            errors[path] = str(error)
    size, channels = spec["image_size"], 1 if spec["color"] == "grayscale" else 3
    empty = np.empty((0, size, size, channels), np.uint8)
    return (np.stack(pixels) if pixels else empty), good, errors


def onnx_predictor(path: Path, options=None) -> tuple[Predictor, dict[str, str]]:
    """`options`: an onnxruntime.SessionOptions (None: ONNX Runtime's defaults)."""
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as error:
        refusal = onnx_load_error(path, str(error), ort.__version__)
        if refusal is None:
            raise  # a corrupt or truncated file: the caller names it
        raise refusal from None
    inputs, outputs = session.get_inputs(), session.get_outputs()
    if len(inputs) != 1 or not outputs:
        raise ModelError(
            f"{path} has {len(inputs)} inputs and {len(outputs)} outputs; an image classifier "
            "has one input (the image batch) and its logits as the first output"
        )
    name = inputs[0].name
    meta = {
        **session.get_modelmeta().custom_metadata_map,
        DECLARED: json.dumps([inputs[0].type, inputs[0].shape, outputs[0].shape]),
    }
    return (lambda x: session.run(None, {name: x})[0]), meta


# What ONNX Runtime says when a file is newer than it or uses operators it lacks; its message
# opens with a C++ source location and signature, which hide these facts past a line's length.
ORT_TOO_NEW = {
    r"Unsupported model IR version: (\d+), max supported IR version: (\d+)": (
        "ONNX IR version",
        "upgrade onnxruntime, or export with the onnx and torch that this project pins",
    ),
    r"Opset (\d+) is under development.*?domain \S+ is till opset (\d+)": (
        "opset",
        "upgrade onnxruntime, or re-export with a lower export.opset",
    ),
}


def onnx_load_error(path: Path, message: str, version: str) -> ModelError | None:
    """ONNX Runtime's refusal of a newer file or a custom operator as one line saying why."""
    import re

    for pattern, (what, fix) in ORT_TOO_NEW.items():
        found = re.search(pattern, message, re.S)
        if found:
            return ModelError(
                f"{path} uses {what} {found[1]}, and this onnxruntime ({version}) reads up to "
                f"{found[2]}: {fix}"
            )
    custom = re.search(r"(\S+):(\w+)\(-?\d+\) is not a registered function/op", message)
    if custom:
        return ModelError(
            f"{path} uses operator {custom[2]} of domain {custom[1]}, which ONNX Runtime lacks "
            "(a custom-op library): visionflow exports standard ONNX operators only; ask for "
            "the model.onnx the export stage writes"
        )
    return None


def torchscript_predictor(path: Path) -> tuple[Predictor, dict[str, str]]:
    """A TorchScript file is code: load only files you made or trust."""
    import torch

    files = {CLASSES_KEY: "", PREPROCESS_KEY: ""}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=JIT_DEPRECATED)
        module = torch.jit.load(str(path), map_location="cpu", _extra_files=files)
    return module_predictor(module), {k: _text(v) for k, v in files.items()}


def pt2_predictor(path: Path) -> tuple[Predictor, dict[str, str]]:
    import torch

    files = {CLASSES_KEY: "", PREPROCESS_KEY: ""}
    module = torch.export.load(str(path), extra_files=files).module()
    return module_predictor(module), {k: _text(v) for k, v in files.items()}


def torch_predictor(path: Path) -> tuple[Predictor, dict[str, str]]:
    """A checkpoint as the train stage writes it (model.pt), in eager PyTorch."""
    import pickle

    import torch

    from visionflow.train import OWN_MODELS, zoo
    from visionflow.train.models import model_from

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's advice (load it unsafely) is not ours to give
        raise ModelError(
            f"{path} holds pickled objects besides tensors and plain data, which can run code "
            "when loaded: not loaded (a model.pt the train stage writes has none; ask for the "
            "model.onnx instead)"
        ) from None
    meta = saved.get("meta") if isinstance(saved, dict) else None
    name = meta.get("model") if isinstance(meta, dict) else None
    if isinstance(name, str) and zoo.is_import_path(name):
        raise ModelError(
            f"{path} is a network of the project's own code ({name}), which building it would "
            "import and run: not loaded (ask for the model.onnx instead)"
        )
    problems = meta_problems(meta, [*OWN_MODELS, *zoo.registry()])
    if problems:  # checked before the network is built: a forged image_size could fill memory
        raise ModelError(f"{path} is not a checkpoint the train stage writes: {problems}")
    try:
        model, meta = model_from(saved)
    except (KeyError, RuntimeError, TypeError, ValueError) as error:
        words = " ".join(str(error).split())  # torch's lines, as one
        raise ModelError(
            f"{path}: its weights do not fit the network its meta describes: {words[:300]}"
        ) from None
    return module_predictor(model), file_metadata(meta["classes"], spec_of(meta))


def meta_problems(meta, models) -> str:
    """What is wrong with a checkpoint's meta, in words ("": usable)."""
    keys = ("model", "in_channels", "image_size", "dropout", "classes", "mean", "std")
    if not isinstance(meta, dict) or any(k not in meta for k in keys):
        return f"its meta lacks {', '.join(k for k in keys if k not in (meta or {}))}"
    if meta["model"] not in models:
        return f"model {meta['model']!r} is none of the project's or torchvision's classifiers"
    if meta["in_channels"] not in (1, 3):
        return f"in_channels must be 1 or 3: {meta['in_channels']!r}"
    spec = preprocess_spec(
        meta["image_size"],
        meta["in_channels"],
        meta["mean"],
        meta["std"],
        meta.get("background", [255, 255, 255]),
        meta.get("jpeg_draft", False),
        meta.get("reducing_gap"),
    )
    return "; ".join(class_problems(meta["classes"]) + spec_problems(spec))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def module_predictor(module: Callable) -> Predictor:
    """A torch module (eager, scripted or exported) as a function on NumPy batches."""
    import torch

    @torch.no_grad()
    def run(x: np.ndarray) -> np.ndarray:
        return module(torch.from_numpy(x)).numpy()

    return run


DECLARED = "declared"  # (input type, input shape, output shape) an ONNX file states


LOADERS = {
    "onnx": onnx_predictor,
    "torchscript": torchscript_predictor,
    "pt2": pt2_predictor,
    "torch": torch_predictor,
}


NAMES = {
    "onnx": "an ONNX file",
    "torchscript": "a TorchScript file",
    "pt2": "a torch.export .pt2 file",
    "torch": "a PyTorch training checkpoint",
}


def file_format(path: Path) -> str | None:
    """Which runtime a model file is for, from its content: the three torch formats are zip
    archives told apart by their entries; ONNX is a protobuf whose first field is ir_version."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
        if any("/code/" in n for n in names):
            return "torchscript"
        if any(n.endswith("/models/model.json") or n.endswith("/archive_format") for n in names):
            return "pt2"
        return "torch" if any(n.endswith("/data.pkl") for n in names) else None
    with open(path, "rb") as f:
        return "onnx" if f.read(1) == b"\x08" else None


def load_predictor(
    runtime: str | None, path: Path, trust_code: bool = False, onnx_options=None
) -> tuple[Predictor, list[str], dict]:
    """A model file as a function on normalised batches, with its class names and preprocessing;
    `runtime` None: the one the file is for. A file of another format than `runtime` is a
    ValueError naming the format it is; a format that runs code when loaded is a ModelError
    unless `trust_code`; metadata that is malformed or disagrees with the network is a
    ModelError saying what disagrees. `onnx_options`: ONNX Runtime's SessionOptions for an ONNX
    file (serve turns off the threads' spinning between runs)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no model file at {path} (run `dvc repro` first?)")
    found = file_format(Path(path))
    if found is None:
        raise ValueError(
            f"{path} is not a model file visionflow exports (ONNX, TorchScript, .pt2, model.pt)"
        )
    if runtime is not None and runtime != found:
        raise ValueError(
            f"{path} is {NAMES[found]}, not for --runtime {runtime}: use --runtime {found}, "
            "or leave --runtime out"
        )
    if found in RUNS_CODE and not trust_code:
        raise ModelError(
            f"{path} is {NAMES[found]}, which can run code when loaded ({RUNS_CODE[found]}): "
            "load it only if you made it or trust where it came from, with --trust-code; an "
            "ONNX file (model.onnx) runs no code and is the format to take from someone else"
        )
    if found == "onnx":
        predictor, meta = onnx_predictor(Path(path), onnx_options)
    else:
        predictor, meta = LOADERS[found](Path(path))
    try:
        classes, spec = parse_metadata(meta)
        check_against_network(predictor, classes, spec, meta.get(DECLARED))
    except ModelError as error:
        raise ModelError(
            f"{path}: {error}; not used (re-export it with `dvc repro export`)"
        ) from None
    return predictor, classes, spec


def parse_metadata(meta: dict[str, str]) -> tuple[list[str], dict]:
    """The class names and preprocessing a file states, checked for type and range."""
    missing = [key for key in (CLASSES_KEY, PREPROCESS_KEY) if not meta.get(key)]
    if missing:
        raise ModelError(f"it lacks the {' and '.join(missing)} metadata visionflow writes")
    try:
        classes, spec = json.loads(meta[CLASSES_KEY]), json.loads(meta[PREPROCESS_KEY])
    except json.JSONDecodeError as error:
        raise ModelError(f"its metadata is not JSON ({error})") from None
    problems = class_problems(classes) + spec_problems(spec)
    if problems:
        raise ModelError("its metadata is invalid: " + "; ".join(problems))
    spec.setdefault("fit", "squash")  # made before prepare.fit: squashed, and /metadata says so
    return classes, spec


def class_problems(classes) -> list[str]:
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        return [f"{CLASSES_KEY} is not a list of names"]
    if len(classes) < 2 or len(set(classes)) != len(classes):
        return [f"{CLASSES_KEY} needs two or more distinct names, got {classes[:12]}"]
    # names are folder names: never empty, at most 255 bytes (a longer one is forged)
    odd = [c for c in classes if not c or len(c.encode("utf-8", "surrogatepass")) > 255]
    if odd:
        shown = [c if len(c) <= 40 else c[:40] + f"... ({len(c)} characters)" for c in odd[:3]]
        return [f"{CLASSES_KEY} has names that are empty or over 255 bytes: {shown}"]
    return []


def spec_problems(spec) -> list[str]:
    """What is wrong with a preprocessing description, as readable lines (none: usable)."""
    if not isinstance(spec, dict):
        return [f"{PREPROCESS_KEY} is not a mapping"]
    size, color = spec.get("image_size"), spec.get("color")
    found = []
    if type(size) is not int or not 1 <= size <= MAX_IMAGE_SIZE:
        found.append(f"image_size must be a whole number of px, 1 to {MAX_IMAGE_SIZE}: {size!r}")
    if color not in ("grayscale", "rgb"):
        found.append(f"color must be grayscale or rgb: {color!r}")
    if spec.get("resize") not in RESIZE_FILTERS:
        found.append(f"resize must be one of {', '.join(RESIZE_FILTERS)}: {spec.get('resize')!r}")
    if spec.get("fit", "squash") not in FITS:
        found.append(f"fit must be one of {', '.join(FITS)}: {spec.get('fit')!r}")
    channels = 1 if color == "grayscale" else 3
    for key in ("mean", "std"):
        values = spec.get(key)
        if not _numbers(values, channels) or (key == "std" and min(values) <= 0):
            found.append(f"{key} must be {channels} finite numbers (std > 0): {values!r}")
    background = spec.get("background")
    if not _numbers(background, 3) or any(
        type(v) is not int or not 0 <= v <= 255 for v in background
    ):
        found.append(f"background must be 3 whole numbers 0 to 255: {background!r}")
    for key in ("exif_transpose", "jpeg_draft"):
        if not isinstance(spec.get(key, True), bool):
            found.append(f"{key} must be true or false")
    gap = spec.get("reducing_gap")
    if gap is not None and not (type(gap) in (int, float) and 1 < gap <= 1024):
        found.append(f"reducing_gap must be null or a number over 1 (at most 1024): {gap!r}")
    return found


def _numbers(values, n: int) -> bool:
    return (
        isinstance(values, list)
        and len(values) == n
        and all(type(v) in (int, float) and np.isfinite(v) for v in values)
    )


def check_against_network(
    predictor: Predictor, classes: list[str], spec: dict, declared: str | None
) -> None:
    """The network takes the input the metadata describes and has an output per class name: from
    the shapes an ONNX file declares, then by one forward pass of that input."""
    channels = 1 if spec["color"] == "grayscale" else 3
    wanted = [channels, spec["image_size"], spec["image_size"]]
    if declared:
        kind, inputs, outputs = json.loads(declared)
        fixed = [dim if isinstance(dim, int) else None for dim in inputs[1:]]
        if kind != "tensor(float)" or len(inputs) != 4:
            raise ModelError(f"the network's input is {kind} {inputs}, not a float32 NCHW batch")
        if any(dim is not None and dim != w for dim, w in zip(fixed, wanted, strict=True)):
            raise ModelError(
                f"the metadata describes {spec['color']} {spec['image_size']} px images "
                f"(N x {' x '.join(map(str, wanted))}), the network takes {inputs}"
            )
        if len(outputs) == 2 and isinstance(outputs[1], int) and outputs[1] != len(classes):
            raise ModelError(
                f"{CLASSES_KEY} lists {len(classes)} names, the network has {outputs[1]} outputs"
            )
    try:
        logits = predictor(np.zeros((1, *wanted), np.float32))
    except Exception as error:  # a runtime's own error on the wrong input
        first = (
            str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        )
        raise ModelError(
            f"the network does not run on the input its metadata describes "
            f"(1 x {' x '.join(map(str, wanted))} float32): {first}"
        ) from None
    if np.shape(logits) != (1, len(classes)):
        raise ModelError(
            f"{CLASSES_KEY} lists {len(classes)} names, the network gives "
            f"{np.shape(logits)} for one image"
        )


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def top_k(logits: np.ndarray, classes: list[str], k: int) -> list[list[tuple[str, float]]]:
    """The k most likely classes per image, with probabilities, most likely first."""
    probs = softmax(logits.astype(np.float64))
    order = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    return [[(classes[j], float(p[j])) for j in row] for p, row in zip(probs, order, strict=True)]
