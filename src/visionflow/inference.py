"""Predictions from an exported model, with exactly the training preprocessing.

Every exported file carries its own description: the class names in output order and the
preprocessing (`visionflow.classes`, `visionflow.preprocess`; ONNX `metadata_props`, and extra files
inside the TorchScript and `.pt2` archives). A client needs the file and nothing else.
"""

import json
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from visionflow.decode import RESIZE, Decode, to_pixels
from visionflow.errors import DataError

# torch is imported by the torch runtimes only: the ONNX path runs on ONNX Runtime and NumPy

Predictor = Callable[[np.ndarray], np.ndarray]  # float32 NCHW batch -> logits
RUNTIMES = ("onnx", "torchscript", "pt2", "torch")
JIT_DEPRECATED = r".*torch\.jit\.\w+` is deprecated"  # TorchScript still works in torch 2.14
CLASSES_KEY, PREPROCESS_KEY = "visionflow.classes", "visionflow.preprocess"


def preprocess_spec(
    image_size: int,
    channels: int,
    mean: list[float],
    std: list[float],
    background: list[int] = (255, 255, 255),
) -> dict:
    """How to turn an image file into the model's input, as data (see `load_images`)."""
    return {
        "image_size": image_size,
        "color": "grayscale" if channels == 1 else "rgb",
        "resize": RESIZE,  # PIL resampling filter, to image_size x image_size (aspect not kept)
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
        meta["image_size"], meta["in_channels"], meta["mean"], meta["std"], meta["background"]
    )


def describe(classes: list[str], spec: dict) -> dict[str, str]:
    """The metadata written into every exported file."""
    return {CLASSES_KEY: json.dumps(classes), PREPROCESS_KEY: json.dumps(spec, sort_keys=True)}


def normalise(pixels: np.ndarray, spec: dict) -> np.ndarray:
    """uint8 NHWC -> float32 NCHW, as in training (`loading.to_model_input`), in NumPy."""
    mean = np.asarray(spec["mean"], np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(spec["std"], np.float32).reshape(1, -1, 1, 1)
    x = pixels.transpose(0, 3, 1, 2).astype(np.float32) / np.float32(255)
    return np.ascontiguousarray((x - mean) / std)


def load_images(paths: list[Path], spec: dict) -> tuple[np.ndarray, list[Path], dict[Path, str]]:
    """Decode what can be decoded; returns uint8 NHWC pixels, their paths, and errors by path."""
    pixels, good, errors = [], [], {}
    decode = Decode(spec["image_size"], spec["color"], tuple(spec["background"]))
    for path in paths:
        try:
            pixels.append(to_pixels(path, decode))
            good.append(path)
        except DataError as e:
            errors[path] = str(e)
    size, channels = spec["image_size"], 1 if spec["color"] == "grayscale" else 3
    empty = np.empty((0, size, size, channels), np.uint8)
    return (np.stack(pixels) if pixels else empty), good, errors


def onnx_predictor(path: Path) -> tuple[Predictor, dict[str, str]]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    meta = session.get_modelmeta().custom_metadata_map
    return (lambda x: session.run(None, {name: x})[0]), meta


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
    from visionflow.models import load_model

    model, meta = load_model(path)
    spec = spec_of(meta)
    return module_predictor(model), describe(meta["classes"], spec)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def module_predictor(module: Callable) -> Predictor:
    """A torch module (eager, scripted or exported) as a function on NumPy batches."""
    import torch

    @torch.no_grad()
    def run(x: np.ndarray) -> np.ndarray:
        return module(torch.from_numpy(x)).numpy()

    return run


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


def load_predictor(runtime: str | None, path: Path) -> tuple[Predictor, list[str], dict]:
    """A model file as a function on normalised batches, with its class names and preprocessing;
    `runtime` None: the one the file is for. A file of another format than `runtime` is a
    ValueError naming the format it is."""
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
    predictor, meta = LOADERS[found](Path(path))
    if not meta.get(CLASSES_KEY) or not meta.get(PREPROCESS_KEY):
        raise ValueError(
            f"{path} lacks {CLASSES_KEY} / {PREPROCESS_KEY} metadata; "
            "export it with `dvc repro export`"
        )
    return predictor, json.loads(meta[CLASSES_KEY]), json.loads(meta[PREPROCESS_KEY])


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def top_k(logits: np.ndarray, classes: list[str], k: int) -> list[list[tuple[str, float]]]:
    """The k most likely classes per image, with probabilities, most likely first."""
    probs = softmax(logits.astype(np.float64))
    order = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    return [[(classes[j], float(p[j])) for j in row] for p, row in zip(probs, order, strict=True)]
