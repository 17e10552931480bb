"""Classify images with the exported ONNX file alone: ONNX Runtime, NumPy and Pillow; no torch.

The file carries what a client needs: `visionflow.classes` (class names in output order) and
`visionflow.preprocess` (image size, colour mode, resize filter, mean/std, input layout).

    python examples/onnx_client.py results/export/model.onnx IMAGE [IMAGE ...]

Prints one JSON object per image: {"file", "class", "probability"}.
"""

import json
import sys

import numpy as np
import onnxruntime as ort
from PIL import Image, ImageOps


def preprocess(path: str, spec: dict) -> np.ndarray:
    """One image -> float32 CHW, exactly as in training."""
    size = spec["image_size"]
    with Image.open(path) as image:
        if spec["exif_transpose"]:
            image = ImageOps.exif_transpose(image)
        if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
            under = Image.new("RGBA", image.size, (*spec["background"], 255))
            image = Image.alpha_composite(under, image.convert("RGBA"))
        image = image.convert("L" if spec["color"] == "grayscale" else "RGB")
        image = image.resize((size, size), Image.Resampling[spec["resize"].upper()])
    pixels = np.asarray(image, dtype=np.float32).reshape(size, size, -1) / np.float32(255)
    mean = np.asarray(spec["mean"], np.float32)
    std = np.asarray(spec["std"], np.float32)
    return ((pixels - mean) / std).transpose(2, 0, 1)


def main(model_path: str, image_paths: list[str]) -> None:
    session = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    meta = session.get_modelmeta().custom_metadata_map
    classes = json.loads(meta["visionflow.classes"])
    spec = json.loads(meta["visionflow.preprocess"])
    batch = np.stack([preprocess(p, spec) for p in image_paths])
    logits = session.run(None, {session.get_inputs()[0].name: batch})[0]
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    for path, p in zip(image_paths, probs, strict=True):
        best = int(p.argmax())
        print(json.dumps({"file": path, "class": classes[best], "probability": float(p[best])}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
