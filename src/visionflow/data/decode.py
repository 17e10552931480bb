"""Image files to uint8 pixels, defensively, exactly as training saw them; torch-free, so the
ONNX path of `visionflow predict` and the CLI load without torch.

JPEGs are decoded at the reduced DCT scale that still covers the target size (`Image.draft`);
every image is then resized in two steps, a box reduce by a whole factor and the recorded filter
over the last `reducing_gap` times or more (Pillow's `resize(..., reducing_gap=)`): faster than
one resize from full size, pixels within 1 of it (docs/benchmarks.md measures both). The cache,
`visionflow predict` and the ONNX client all do both, and the exported models record them
(`jpeg_draft`, `reducing_gap`), so served pixels equal trained pixels.

Broken, empty, non-image and oversized files are a DataError with the reason; image modes are
normalised (alpha composited on a background, CMYK to RGB, 16-bit scaled, EXIF orientation applied).
"""

import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from visionflow.errors import DataError

RESIZE = "bilinear"  # PIL filter used to reach image_size; exported models record it
RESIZE_FILTERS = ("nearest", "box", "bilinear", "hamming", "bicubic", "lanczos")  # Pillow's
FITS = ("crop", "squash")  # crop: the centre square (torchvision's Resize + CenterCrop), aspect
# kept; squash: the whole image pressed into the square (what caches made before `fit` hold)
REDUCING_GAP = 3.0  # the filter resizes by at least this factor after the box reduce: Pillow's
# docs call 3 "indistinguishable from fair resampling in most cases"
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
SIXTEEN_BIT = {"I;16", "I;16L", "I;16B", "I;16N", "I"}


class Decode(NamedTuple):
    """How one image becomes cache pixels."""

    size: int  # square side, px
    color: str  # grayscale | rgb
    background: tuple[int, int, int] = (255, 255, 255)  # under transparent pixels
    max_pixels: int = 50_000_000  # larger images are rejected from their header, undecoded
    formats: tuple[str, ...] = ("PNG", "JPEG", "BMP", "GIF", "WEBP", "TIFF")  # PIL format names
    jpeg_draft: bool = True  # JPEGs decoded at a reduced DCT scale first (see `open_image`)
    reducing_gap: float | None = REDUCING_GAP  # None: one-step resize (models made before it)
    resize: str = RESIZE  # PIL filter name; a model file says which it was trained with
    exif_transpose: bool = True  # turned upright as the camera was held
    fit: str = "squash"  # FITS; models and caches made before it squashed


LINK_SKIPPED = "a link: links are not followed (copy the file or folder in)"


def is_hidden(path: Path, root: Path) -> bool:
    """A dot-file, or inside a dot-folder (`.git`, `.ipynb_checkpoints`), below `root`."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def normalise_mode(image: Image.Image, color: str, background: tuple[int, int, int]) -> Image.Image:
    """Any PIL mode -> L or RGB without mangling: alpha over `background`, 16-bit scaled, CMYK."""
    if image.mode in SIXTEEN_BIT:  # PIL's convert would clip 16-bit values at 255
        wide = np.asarray(image).astype(np.float64)
        image = Image.fromarray(np.clip(np.round(wide / 257), 0, 255).astype(np.uint8), "L")
    elif image.mode == "F":
        image = Image.fromarray(np.clip(np.asarray(image), 0, 255).astype(np.uint8), "L")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        under = Image.new("RGBA", image.size, (*background, 255))
        image = Image.alpha_composite(under, image.convert("RGBA"))
    return image.convert("L" if color == "grayscale" else "RGB")  # CMYK: PIL's conversion


def open_image(path: Path, decode: Decode) -> Image.Image:
    """Open, check and fully load one file, upright; any problem is a DataError with the reason."""
    try:
        empty = path.stat().st_size == 0
    except OSError as error:  # gone since the folder was listed (or a name too long)
        raise DataError(f"cannot read: {error.strerror}") from None
    if empty:
        raise DataError("empty file (0 bytes)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # an error below instead
        try:
            with Image.open(path, formats=list(decode.formats)) as opened:
                width, height = opened.size  # from the header; nothing decoded yet
                if width * height > decode.max_pixels:
                    raise DataError(
                        f"{width}x{height} = {width * height} px is over "
                        f"max_pixels ({decode.max_pixels}); not decoded"
                    )
                if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
                    raise DataError(
                        f"decompression bomb: {width}x{height} px is over Pillow's "
                        f"limit of {Image.MAX_IMAGE_PIXELS} px; not decoded"
                    )
                if decode.jpeg_draft and opened.format == "JPEG":
                    # libjpeg decodes at 1/2, 1/4 or 1/8 scale in the DCT, the smallest that
                    # still covers size x size (either way up): a 1024x768 photo for 64 px
                    # decodes at 128x96, a fraction of the work (docs/benchmarks.md measures
                    # it); the resize below does the rest
                    opened.draft(opened.mode, (decode.size, decode.size))
                opened.load()
                if decode.exif_transpose:  # upright, as the camera was held
                    ImageOps.exif_transpose(opened, in_place=True)
                return opened
        except DataError:
            raise
        except UnidentifiedImageError:
            formats = ", ".join(decode.formats)
            raise DataError(f"not a readable image in the allowed formats ({formats})") from None
        except Image.DecompressionBombError as error:
            raise DataError(f"decompression bomb: {error}") from None
        except (OSError, SyntaxError, ValueError) as error:  # truncated or corrupt data
            if (
                isinstance(error, OSError) and error.errno
            ):  # the file system's error, not the data's
                raise DataError(f"cannot read: {error.strerror}") from None
            raise DataError(f"corrupt or truncated: {error}") from None


def pixels_of(image: Image.Image, decode: Decode) -> np.ndarray:
    """Normalise the mode and resize: one uint8 HxWxC image."""
    image = normalise_mode(image, decode.color, decode.background)
    if image.size != (decode.size, decode.size):
        resample = Image.Resampling[decode.resize.upper()]
        width, height = image.size
        box = (0, 0, width, height)  # squash: all of it
        if decode.fit == "crop":  # the centre square, resized straight from the source
            side = min(width, height)
            left, top = (width - side) / 2, (height - side) / 2
            box = (left, top, left + side, top + side)
        size = (decode.size, decode.size)
        image = image.resize(size, resample, box=box, reducing_gap=decode.reducing_gap)
    pixels = np.asarray(image, dtype=np.uint8)
    return pixels[..., None] if pixels.ndim == 2 else pixels


def to_pixels(item, decode: Decode) -> np.ndarray:
    """An array or an image file as cache pixels; a file that cannot be used is a DataError."""
    if isinstance(item, np.ndarray):
        return pixels_of(Image.fromarray(item), decode)
    try:
        image = open_image(Path(item), decode)
    except DataError as error:
        raise DataError(f"cannot decode {item}: {error}") from None
    return pixels_of(image, decode)


def fit_kept(images: list | np.ndarray, fit: str, sample: int = 256) -> float:
    """The mean share of each image's area that `fit` keeps in the cache (crop: the centre square
    keeps 75% of a 4:3 photo; squash: all of it, distorted), from the headers of up to `sample`
    evenly spaced images (arrays: their shape); unreadable files are left out (prepare rejects
    them)."""
    if fit != "crop" or not len(images):
        return 1.0
    shares = []
    for i in np.linspace(0, len(images) - 1, min(sample, len(images))).astype(int):
        item = images[i]
        try:
            if isinstance(item, np.ndarray):
                height, width = item.shape[:2]
            else:
                with Image.open(item) as opened:  # the header only: nothing decoded
                    width, height = opened.size  # a quarter turn (EXIF) keeps the share
        except (OSError, ValueError, SyntaxError):
            continue
        shares.append(min(width, height) ** 2 / (width * height))
    return float(np.mean(shares)) if shares else 1.0
