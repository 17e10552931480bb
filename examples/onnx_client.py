"""Classify images with the exported ONNX file alone: ONNX Runtime, NumPy and Pillow; no torch.

The file carries what a client needs: `visionflow.classes` (class names in output order) and
`visionflow.preprocess` (image size, colour mode, resize filter, mean/std, input layout).

    python examples/onnx_client.py results/export/model.onnx IMAGE|FOLDER [...]

Prints one JSON object per image and line, in the order given (a folder's files sorted):
{"file", "class", "probability"}, or {"file", "error"} for one that cannot be read (named on
stderr too, exit 1); on stderr, a count every 5 s for a long folder.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image, ImageOps

SIXTEEN_BIT = {"I;16", "I;16L", "I;16B", "I;16N", "I"}


def preprocess(path: str, spec: dict) -> np.ndarray:
    """One image -> float32 CHW, exactly as in training (visionflow.data.decode): a JPEG decoded at
    the reduced DCT scale the file records (`jpeg_draft`), EXIF orientation, 16-bit scaled (not clipped) to 8 bits, alpha over the background, then the
    colour mode, the centre square or the whole image (`fit`), the resize (in two steps where the
    file records `reducing_gap`), and
    (pixel / 255 - mean) / std."""
    size = spec["image_size"]
    with Image.open(path) as image:
        if spec.get("jpeg_draft") and image.format == "JPEG":  # as training decoded it
            image.draft(image.mode, (size, size))  # libjpeg at 1/2, 1/4 or 1/8 scale
        image.load()
        if spec["exif_transpose"]:
            image = ImageOps.exif_transpose(image)
        if image.mode in SIXTEEN_BIT:  # Pillow's convert would clip 16-bit values at 255
            wide = np.asarray(image).astype(np.float64)
            image = Image.fromarray(np.clip(np.round(wide / 257), 0, 255).astype(np.uint8), "L")
        elif image.mode == "F":
            image = Image.fromarray(np.clip(np.asarray(image), 0, 255).astype(np.uint8), "L")
        if image.mode == "P" and "transparency" in image.info:
            image = image.convert("RGBA")
        if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
            under = Image.new("RGBA", image.size, (*spec["background"], 255))
            image = Image.alpha_composite(under, image.convert("RGBA"))
        image = image.convert("L" if spec["color"] == "grayscale" else "RGB")
        if image.size != (size, size):
            resample = Image.Resampling[spec["resize"].upper()]
            width, height = image.size
            box = (0, 0, width, height)  # fit: squash, the whole image
            if spec["fit"] == "crop":  # the centre square, aspect kept
                side = min(width, height)
                left, top = (width - side) / 2, (height - side) / 2
                box = (left, top, left + side, top + side)
            # a box reduce by a whole factor first, when the file records it (reducing_gap)
            gap = spec.get("reducing_gap")
            image = image.resize((size, size), resample, box=box, reducing_gap=gap)
    pixels = np.asarray(image, dtype=np.uint8).reshape(size, size, -1)
    scaled = pixels.astype(np.float32) / np.float32(255)
    mean = np.asarray(spec["mean"], np.float32)
    std = np.asarray(spec["std"], np.float32)
    return ((scaled - mean) / std).transpose(2, 0, 1)


# visionflow's own lists (decode.RESIZE_FILTERS, decode.FITS, decode.IMAGE_SUFFIXES), copied: this client
# imports nothing of visionflow
FILTERS = ("nearest", "box", "bilinear", "hamming", "bicubic", "lanczos")
FITS = ("crop", "squash")


def spec_problems(spec: dict) -> list[str]:
    """The decoding keys a forged or mistaken file could get wrong, beyond sizes and statistics."""
    found = []
    if spec.get("resize") not in FILTERS:
        found.append(f"resize must be one of {', '.join(FILTERS)}: {spec.get('resize')!r}")
    if spec.get("fit") not in FITS:
        found.append(f"fit must be one of {', '.join(FITS)}: {spec.get('fit')!r}")
    for key in ("exif_transpose", "jpeg_draft"):
        if not isinstance(spec[key], bool):
            found.append(f"{key} must be true or false: {spec[key]!r}")
    gap = spec["reducing_gap"]
    if gap is not None and not (type(gap) in (int, float) and 1 < gap <= 1024):
        found.append(f"reducing_gap must be null or a number over 1 (at most 1024): {gap!r}")
    background = spec.get("background")
    if not (
        isinstance(background, list)
        and len(background) == 3
        and all(type(v) is int and 0 <= v <= 255 for v in background)
    ):
        found.append(f"background must be 3 whole numbers 0 to 255: {background!r}")
    return found


def open_model(model_path: str) -> tuple[ort.InferenceSession, list[str], dict]:
    """The session, class names and preprocessing; metadata that is missing, malformed or does
    not fit the network is an error naming what is wrong (a model file may come from anyone;
    an ONNX file runs no code, but its metadata can still lie)."""
    session = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    meta = session.get_modelmeta().custom_metadata_map
    missing = [k for k in ("visionflow.classes", "visionflow.preprocess") if k not in meta]
    if missing:
        sys.exit(
            f"error: {model_path} lacks the {' and '.join(missing)} metadata visionflow writes"
        )
    try:
        classes = json.loads(meta["visionflow.classes"])
        spec = json.loads(meta["visionflow.preprocess"])
        channels = {"grayscale": 1, "rgb": 3}[spec["color"]]
        size = spec["image_size"]
        if not (len(spec["mean"]) == len(spec["std"]) == channels and min(spec["std"]) > 0):
            raise ValueError(f"mean/std need {channels} values, std > 0")
        if not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
            raise ValueError("visionflow.classes is not a list of names")
        if not (type(size) is int and 1 <= size <= 1024 and len(set(classes)) == len(classes) >= 2):
            raise ValueError("image_size a whole number 1 to 1024 px, two or more distinct names")
        spec.setdefault("exif_transpose", True)  # keys a file made before them lacks: as trained
        spec.setdefault("jpeg_draft", False)
        spec.setdefault("reducing_gap", None)
        spec.setdefault("fit", "squash")
        problems = spec_problems(spec)
        if problems:
            raise ValueError("; ".join(problems))
    except (ValueError, KeyError, TypeError) as e:
        sys.exit(f"error: {model_path}: its visionflow metadata is malformed ({e!r})")
    try:  # the input the metadata describes, once: the network must take it
        dummy = np.zeros((1, channels, size, size), np.float32)
        logits = session.run(None, {session.get_inputs()[0].name: dummy})[0]
    except Exception as e:  # ONNX Runtime's own error for a wrong shape or type
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sys.exit(f"error: {model_path}: the network does not take {dummy.shape} float32: {first}")
    if logits.shape != (1, len(classes)):
        sys.exit(
            f"error: {model_path}: its metadata lists {len(classes)} classes, the network gives "
            f"{logits.shape} for one image"
        )
    return session, classes, spec


SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}  # copied, above


def image_files(args: list[str]) -> list[str]:
    """Files as given; a folder as its image files, sorted (a stable order), hidden ones skipped."""
    found = []
    for arg in args:
        folder = Path(arg)
        if not folder.is_dir():
            found.append(arg)
            continue
        for path in sorted(folder.rglob("*")):
            hidden = any(part.startswith(".") for part in path.relative_to(folder).parts)
            if path.is_file() and path.suffix.lower() in SUFFIXES and not hidden:
                found.append(str(path))
    return found


def inputs(paths: list[str], spec: dict) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The model input of each image that can be read, and why each other one cannot."""
    good, bad = {}, {}
    for path in paths:
        try:
            good[path] = preprocess(path, spec)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:  # unusable
            bad[path] = f"{type(e).__name__}: {e}"
    return good, bad


def main(model_path: str, image_paths: list[str], batch: int = 64) -> int:
    """One JSON line per image, in order; 1 when some image could not be read, else 0."""
    session, classes, spec = open_model(model_path)
    input_name = session.get_inputs()[0].name
    shown, failed = time.monotonic(), 0
    for start in range(0, len(image_paths), batch):  # a batch at a time: memory stays flat
        paths = image_paths[start : start + batch]
        good, bad = inputs(paths, spec)
        probs = {}
        if good:
            logits = session.run(None, {input_name: np.stack(list(good.values()))})[0]
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs = dict(zip(good, e / e.sum(axis=1, keepdims=True), strict=True))
        for path in paths:
            name = path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            if path in bad:
                print(json.dumps({"file": name, "error": bad[path]}))
                print(f"error: {name}: {bad[path]}", file=sys.stderr)
                continue
            best = int(probs[path].argmax())
            line = {"file": name, "class": classes[best], "probability": float(probs[path][best])}
            print(json.dumps(line))
        sys.stdout.flush()
        failed += len(bad)
        done = start + len(paths)
        if time.monotonic() - shown >= 5 or (done == len(image_paths) > batch):  # long folders
            shown = time.monotonic()
            print(f"{done}/{len(image_paths)} images", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    files = image_files(sys.argv[2:])
    if not files:
        print(f"error: no image files in {', '.join(sys.argv[2:])}", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], files))
