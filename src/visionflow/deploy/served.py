"""The model `visionflow serve` serves: an ONNX file read from a snapshot of its bytes, validated
in full (`inference.load_predictor`: metadata, shapes, one forward pass) and identified by its
sha256, opset and metadata, read from the file's protobuf without the onnx package. No torch."""

import errno
import hashlib
import json
import mmap
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from visionflow.deploy.inference import (
    NAMES,
    QUANTIZATION_KEY,
    ModelError,
    Predictor,
    file_format,
    load_predictor,
)


@dataclass(frozen=True)
class ServedModel:
    """A loaded, validated model and what identifies it."""

    path: Path
    predictor: Predictor
    classes: list[str]
    spec: dict
    sha256: str
    opset: int | None
    input_shape: list
    stat: tuple | None  # the file's (inode, size, mtime) when it was read
    loaded_at: float  # time.time()
    quantization: dict | str | None = None  # an INT8 file's `visionflow.quantization` record


class Changing(Exception):
    """The model file changed while it was being read (a copy in progress): try again later."""


def file_stat(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def load_served(path: Path, scratch: Path) -> ServedModel:
    """Load `path` and validate it fully, from a snapshot of its bytes (so the bytes hashed are
    the bytes run, even while someone replaces the file); any problem is a ModelError naming
    `path`, a file changing meanwhile is Changing."""
    before = file_stat(path)
    if before is None or not Path(path).is_file():
        raise ModelError(f"no model file at {path} (run `dvc repro` first?)")
    snapshot = scratch / f"model-{uuid.uuid4().hex}.onnx"
    try:
        scratch.mkdir(exist_ok=True)  # a /tmp cleaner may have removed an idle one
        shutil.copyfile(path, snapshot)
        kind = file_format(snapshot)
        if kind != "onnx":
            what = NAMES[kind] if kind else "not a model file visionflow exports"
            raise ModelError(
                f"{path} is {what}: serve runs ONNX files on ONNX Runtime (no torch); serve "
                "the model.onnx the export stage writes (`dvc repro export`)"
            )
        if file_stat(path) != before:
            raise Changing(f"{path} changed while it was read")
        sha, opset, meta = fingerprint(snapshot)
        predictor, classes, spec = load_predictor("onnx", snapshot, onnx_options=session_options())
    except (ModelError, ValueError, FileNotFoundError) as error:
        raise ModelError(str(error).replace(str(snapshot), str(path))) from None
    except Changing:
        raise
    except Exception as error:  # ONNX Runtime's own words for a corrupt or truncated file
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            raise ModelError(
                f"no room in {scratch} for the copy of {path} that serve loads: free space "
                "there, or point TMPDIR at a larger disk"
            ) from None
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        first = first.replace(str(snapshot), str(path))
        raise ModelError(f"{path} could not be loaded ({type(error).__name__}: {first})") from None
    finally:
        snapshot.unlink(missing_ok=True)
    shape = input_shape(spec)
    quantization = json_or_text(meta.get(QUANTIZATION_KEY))
    return ServedModel(
        Path(path), predictor, classes, spec, sha, opset, shape, before, time.time(), quantization
    )


def fingerprint(path: Path) -> tuple[str, int | None, dict[str, str]]:
    """The file's sha256, opset and metadata, read through a memory map: a large model is
    neither held twice in memory nor copied."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return hashlib.sha256(view).hexdigest(), onnx_opset(view), onnx_metadata(view)
        finally:
            view.release()


def json_or_text(value: str | None):
    """A metadata value as the JSON it should be, or as its text when it is not."""
    try:
        return None if value is None else json.loads(value)
    except ValueError:
        return value


def session_options():
    """ONNX Runtime's threads sleep between runs: spinning (its default) burns CPU after each
    run, a core's worth between requests, taken from the threads that decode images."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def input_shape(spec: dict) -> list:
    """The input the model takes, N x C x H x W (load_predictor has checked it)."""
    channels = 1 if spec["color"] == "grayscale" else 3
    return ["N", channels, spec["image_size"], spec["image_size"]]


def onnx_opset(data: bytes | memoryview) -> int | None:
    """The default-domain opset an ONNX file imports, read from the protobuf's top level
    (ModelProto field 8, OperatorSetIdProto {1: domain, 2: version}): importing the onnx
    package for it would cost most of serve's start-up."""
    for field, value in protobuf_fields(data):
        if field == 8 and not isinstance(value, int):
            entry = dict(protobuf_fields(value))
            if entry.get(1, b"") in (b"", b"ai.onnx") and isinstance(entry.get(2), int):
                return entry[2]
    return None


def onnx_metadata(data: bytes | memoryview) -> dict[str, str]:
    """The metadata an ONNX file carries (ModelProto field 14, StringStringEntryProto
    {1: key, 2: value}), read as onnx_opset reads the opset."""
    meta = {}
    for field, value in protobuf_fields(data):
        if field == 14 and not isinstance(value, int):
            entry = dict(protobuf_fields(value))
            key, text = entry.get(1, b""), entry.get(2, b"")
            if not isinstance(key, int) and not isinstance(text, int):
                meta[bytes(key).decode("utf-8", "replace")] = bytes(text).decode("utf-8", "replace")
    return meta


def protobuf_fields(data: bytes | memoryview):
    """(field number, value) of a protobuf message's top level: ints for varints, bytes for
    length-delimited fields (slices of `data`: a memoryview is not copied); fixed-width fields
    are skipped. Stops at malformed data."""
    i, n = 0, len(data)
    while i < n:
        key, i = varint(data, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(data, i)
            yield field, value
        elif wire == 2:
            length, i = varint(data, i)
            if i + length > n:
                return
            yield field, data[i : i + length]
            i += length
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            return


def varint(data: bytes | memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while i < len(data):
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i
    return value, len(data) + 1  # truncated: past the end stops the caller
