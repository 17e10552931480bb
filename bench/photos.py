"""A generated photo folder for the benchmarks: camera-size JPEGs in a few classes, nothing
downloaded. Each class has its own colour cast and texture scale; every photo its own noise,
brightness and framing, so JPEG's DCT sees real texture and a classifier has something to learn."""

from pathlib import Path

import numpy as np
from PIL import Image


def photo(rng: np.random.Generator, label: int, size=(1024, 768)) -> Image.Image:
    """A photo-like JPEG subject: smooth blocks at a class's scale, tinted by the class's cast,
    with per-photo brightness and fine noise (JPEG's DCT sees real texture)."""
    cells = 4 + 3 * label  # texture scale: the class's main cue
    blocks = rng.random((cells, cells * 4 // 3, 3))
    cast = np.roll(np.array([1.0, 0.8, 0.6]), label)  # colour cast: another cue
    image = Image.fromarray((255 * blocks * cast).astype(np.uint8)).resize(size, Image.BICUBIC)
    pixels = np.asarray(image, np.float32) * rng.uniform(0.6, 1.2)
    pixels += rng.normal(0, 12, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def generate(
    root: Path, count: int, classes: int = 5, size=(1024, 768)
) -> tuple[list[Path], np.ndarray]:
    """`count` JPEGs in `root/class<k>/`, the classes taking turns; their paths and labels."""
    rng = np.random.default_rng(0)
    paths, labels = [], []
    for i in range(count):
        label = i % classes
        paths.append(root / f"class{label}" / f"{i:05d}.jpg")
        paths[-1].parent.mkdir(parents=True, exist_ok=True)
        photo(rng, label, size).save(paths[-1], quality=90)
        labels.append(label)
    return paths, np.array(labels)
