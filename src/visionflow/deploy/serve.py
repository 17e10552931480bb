"""`visionflow serve`: an exported ONNX model over HTTP, with dynamic batching.

    POST /predict[?top_k=K]   one image: a raw body (Content-Type image/* or
                              application/octet-stream) or a multipart form with one file field;
                              answers {"predictions": [{"class", "probability"}...], "model": sha256,
                              "batch_size": images in the batch it ran in}
    GET  /health              status, the model served, reloads, uploads being received,
                              batches run and their sizes
    GET  /metadata            classes, preprocessing, the model's sha256, opset and precision
                              (int8 or float32), limits

Starlette on uvicorn (a standard ASGI stack) in one process. Each request's image is decoded in a
pool of threads (Pillow and ONNX Runtime release the GIL) with the exact code and metadata
`visionflow predict` uses (`inference.load_images`, `to_input`), so the same file gives the same
pixels; the body is spooled to a private temporary file for it. Decoded images wait in one queue:
a batch runs as soon as `max_batch` images are waiting, `window` has passed since its first one,
or no other request is on its way (one client pays no window). Batches run one at a time on ONNX
Runtime in their own thread.

Bad input is a 400 (not an image, truncated, empty, a content type that is not an image) or a 413
(a body over `max_body` bytes, an image over `max_pixels`, a decompression bomb), always a JSON
`{"error": one line}`, and the server goes on. A body that sends no byte for `body_timeout_s` is
a 408 and its connection closed; past `max_uploads` bodies being received at once, a request is
a 503 with Retry-After: stalled clients hold neither the connections nor $TMPDIR. A model that
answers a batch with the wrong number of rows is a 500 for that batch's requests, logged. The
model file is watched (its stat, every `reload_interval` seconds): a changed file is loaded from
a snapshot of its bytes and validated fully (`inference.load_predictor`: metadata, shapes, one
forward pass) before it replaces the model served; a broken one is refused, logged and shown in
/health while the old one goes on serving. SIGTERM: see `Server`.

No torch: it answers its first request 0.3 s after it starts (2 CPU cores). For tests,
VISIONFLOW_FAULT='serve.infer@batch=1:pause=FILE' holds the first batch until FILE exists
(src/visionflow/faults.py).
"""

import asyncio
import contextlib
import ctypes
import errno
import hashlib
import itertools
import json
import logging
import mmap
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import h11
import numpy as np
import uvicorn
from PIL import Image, UnidentifiedImageError
from uvicorn.protocols.http.h11_impl import H11Protocol

from visionflow import faults
from visionflow.data.decode import Decode
from visionflow.deploy.inference import (
    NAMES,
    QUANTIZATION_KEY,
    ModelError,
    Predictor,
    file_format,
    load_images,
    load_predictor,
    to_input,
    top_k,
)

MB = 2**20
RAW_TYPES = ("application/octet-stream",)  # besides image/*: "these are a file's bytes"
FORMATS = Decode(1, "rgb").formats  # what the decoder opens (PNG, JPEG, ...), as prepare does
MAX_PIXELS = Decode(1, "rgb").max_pixels  # the decoder refuses larger images anyway


class Settings(NamedTuple):
    """The knobs of `visionflow serve` (its command-line flags)."""

    max_batch: int = 32  # images run together at most
    window_s: float = 0.002  # the longest a decoded image waits for others to join its batch
    top_k: int = 3  # classes per answer unless ?top_k= says otherwise
    max_body: int = 20 * MB  # bytes of one request body
    max_pixels: int = MAX_PIXELS  # width x height of one image, from its header
    reload_interval_s: float = 2.0  # how often the model file's stat is checked; 0: never
    decode_workers: int = os.cpu_count() or 1  # threads that decode images
    graceful_s: float = 10.0  # on SIGTERM/SIGINT, how long requests in flight may finish
    body_timeout_s: float = 10.0  # the longest a request body may go without a byte
    max_uploads: int = 32  # request bodies received at once (each up to max_body in $TMPDIR)


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


class Refused(Exception):
    """A request the server will not answer with predictions: an HTTP status and one line."""

    def __init__(self, status: int, reason: str, headers: dict | None = None):
        super().__init__(reason)
        self.status, self.headers = status, headers


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
    except (ModelError, ValueError, FileNotFoundError) as e:
        raise ModelError(str(e).replace(str(snapshot), str(path))) from None
    except Changing:
        raise
    except Exception as e:  # ONNX Runtime's own words for a corrupt or truncated file
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise ModelError(
                f"no room in {scratch} for the copy of {path} that serve loads: free space "
                "there, or point TMPDIR at a larger disk"
            ) from None
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        first = first.replace(str(snapshot), str(path))
        raise ModelError(f"{path} could not be loaded ({type(e).__name__}: {first})") from None
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
    """ONNX Runtime's threads sleep between runs: spinning (its default) burned 4-5 ms of CPU
    per run, a core's worth between requests, taken from the threads that decode images."""
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
    package for it would cost 0.65 s of start-up."""
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


def check_pixels(path: Path, max_pixels: int) -> int:
    """Refuse (413) an image whose header says it is too large, before anything is decoded;
    other problems are left to the decoder, which names them. Returns its pixels (0: no
    header to read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(path, formats=list(FORMATS)) as image:
                width, height = image.size
        except Image.DecompressionBombError:
            raise Refused(
                413, f"decompression bomb: over the limit of {max_pixels} px (--max-pixels)"
            ) from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
            return 0
    if width * height > max_pixels:
        raise Refused(
            413,
            f"{width}x{height} = {width * height} px is over the limit of {max_pixels} px "
            "(--max-pixels); not decoded",
        )
    return width * height


TRIM_AFTER_PIXELS = 4_000_000  # a decode this large hands its freed memory back (a few ms)


def release_freed_memory() -> None:
    """Give the memory a large decode freed back to the system. glibc keeps freed memory in
    each thread's arena: four decoding threads that each once decoded a 49 Mpx image kept 2.4 GB
    between them, though they decoded one at a time (`PixelBudget`)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


class PixelBudget:
    """The pixels being decoded at once, over all the decoding threads, kept within `limit`
    (--max-pixels): an image of the limit's size decodes alone, so memory does not grow with the
    threads (a 381 KB, 49 Mpx 16-bit PNG took 0.8 GB to decode; four at once 1.7 GB)."""

    def __init__(self, limit: int):
        self.limit, self.used, self.changed = limit, 0, threading.Condition()

    @contextlib.contextmanager
    def held(self, pixels: int):
        with self.changed:
            self.changed.wait_for(lambda: self.used == 0 or self.used + pixels <= self.limit)
            self.used += pixels
        try:
            yield
        finally:
            with self.changed:
                self.used -= pixels
                self.changed.notify_all()


def image_input(path: Path, spec: dict, budget: PixelBudget) -> np.ndarray:
    """One image file as the model's input (1 x C x H x W), exactly as `visionflow predict`
    makes it from the model's `spec`; a file that cannot be used is Refused with the decoder's
    reason. Runs in a decoding thread (Pillow releases the GIL while it decodes), within the
    budget of pixels decoding at once."""
    size = check_pixels(path, budget.limit)
    with budget.held(size):
        pixels, good, errors = load_images([path], spec)
    if size > TRIM_AFTER_PIXELS:
        release_freed_memory()
    if not good:
        reason = errors[path].removeprefix(f"cannot decode {path}: ")
        too_big = "max_pixels" in reason or "decompression bomb" in reason
        raise Refused(413 if too_big else 400, reason)
    return to_input(pixels, spec)


def infer(model: ServedModel, number: int, x: np.ndarray) -> np.ndarray:
    """One batch on ONNX Runtime (in the inference thread)."""
    if faults.ACTIVE:
        faults.fault("serve.infer", batch=number, size=len(x))
    return model.predictor(x)


class Batcher:
    """Images from concurrent requests joined into batches for ONNX Runtime."""

    def __init__(self, max_batch: int, window_s: float):
        self.max_batch, self.window_s = max_batch, window_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.coming = 0  # requests admitted whose image is not queued yet
        self.running = 0  # images in the batch on ONNX Runtime now
        self.sizes: Counter = Counter()  # batch size -> batches run
        self.failed, self.failing = 0, None  # batches failed; why the last one did, if it did
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="serve-infer")

    def put(self, model: ServedModel, x: np.ndarray) -> asyncio.Future:
        """Queue one image; the future gives its logits and the size of the batch it ran in."""
        done = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((model, x, done))
        return done

    async def gather(self) -> list:
        """The next batch: the first image waiting, then those that join it in time."""
        loop = asyncio.get_running_loop()
        batch = [await self.queue.get()]
        deadline = loop.time() + self.window_s
        while len(batch) < self.max_batch:
            if self.queue.empty() and self.coming == 0:
                break  # nobody else is on the way: waiting would only add latency
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.queue.get(), left))
            except asyncio.TimeoutError:
                break
        return batch

    async def run_forever(self) -> None:
        while True:
            batch = await self.gather()
            by_model: dict[int, list] = {}  # a reload may leave images of two models waiting
            for item in batch:
                by_model.setdefault(id(item[0]), []).append(item)
            for items in by_model.values():
                await self.run(items)

    async def run(self, items: list) -> None:
        model, number = items[0][0], sum(self.sizes.values()) + 1
        self.running = len(items)
        try:
            x = np.concatenate([x for _, x, _ in items])
            loop = asyncio.get_running_loop()
            logits = await loop.run_in_executor(self.pool, infer, model, number, x)
            if len(logits) != len(items):  # passed validation at batch 1, broken beyond it
                raise ModelError(
                    f"{model.path} returned {len(logits)} rows of logits for a batch of "
                    f"{len(items)} images: the model file is broken (re-export it)"
                )
        except Exception as e:  # the runtime or the model failed: each request says so (a
            # 500, its own exception: one shared would gather every request's traceback), the
            # log says so once, /health until a batch succeeds, and the batcher goes on
            self.failed += 1
            self.failing = f"batch {number} of {len(items)} images failed: {type(e).__name__}: {e}"
            log(self.failing)
            for _, _, done in items:
                if not done.done():
                    done.set_exception(Refused(500, self.failing))
        else:
            self.failing = None
            for row, (_, _, done) in zip(logits, items, strict=True):
                if not done.done():
                    done.set_result((row, len(items)))
        finally:
            self.running = 0
            self.sizes[len(items)] += 1

    def stats(self) -> dict:
        return {
            "count": sum(self.sizes.values()),
            "images": sum(size * n for size, n in self.sizes.items()),
            "sizes": {str(size): n for size, n in sorted(self.sizes.items())},
            "failed": self.failed,
            "last_failed": self.failing,  # None once a batch succeeds again
            "waiting": self.queue.qsize(),
            "running": self.running,
            "coming": self.coming,
        }


def log(message: str) -> None:
    print(f"serve: {message}", file=sys.stderr, flush=True)


def media_type(request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def top_k_of(request, default: int) -> int:
    raw = request.query_params.get("top_k")
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) < 10) or int(raw) < 1:
        raise Refused(400, f"top_k must be a whole number, 1 or more: {raw[:20]!r}")
    return int(raw)


def limited(request, limit: int, timeout_s: float):
    """The request with a receive that refuses (413) a body past `limit` bytes as it arrives,
    and drops (408, closing the connection) one that sends no byte for `timeout_s`."""
    from starlette.requests import Request

    seen = 0

    async def receive():
        nonlocal seen
        try:
            message = await asyncio.wait_for(request.receive(), timeout_s)
        except TimeoutError:
            raise Refused(
                408,
                f"the upload stalled: no byte of the body for {timeout_s:g} s (--body-timeout); "
                f"{seen} bytes came",
                {"Connection": "close"},
            ) from None
        seen += len(message.get("body", b""))
        if seen > limit:
            raise Refused(413, too_large(limit))
        return message

    return Request(request.scope, receive)


def too_large(limit: int) -> str:
    return f"the body is over the limit of {limit} bytes ({limit / MB:g} MB, --max-body-mb)"


NOT_AN_IMAGE_TYPE = (
    "Content-Type {} is not an image: send the file's bytes with Content-Type image/jpeg "
    "(image/png, ...) or application/octet-stream, or as a multipart form file "
    "(curl -F file=@photo.jpg)"
)


async def spool(request, dest: Path, limit: int, timeout_s: float) -> None:
    """The request's image into the file `dest`: a raw body, or a multipart form's one file."""
    kind = media_type(request)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise Refused(413, too_large(limit))
    request = limited(request, limit, timeout_s)
    if kind == "multipart/form-data":
        await spool_form(request, dest)
    elif kind.startswith("image/") or kind in RAW_TYPES:
        with open(dest, "wb") as out:
            async for chunk in request.stream():
                out.write(chunk)
    else:
        raise Refused(400, NOT_AN_IMAGE_TYPE.format(kind or "(none)"))
    if dest.stat().st_size == 0:
        raise Refused(400, "the image is empty (0 bytes): send the image file's bytes")


async def spool_form(request, dest: Path) -> None:
    """The one file of a multipart form into `dest`. A form that ends before its closing
    boundary (cut off mid-file), or that the parser cannot read, is a 400 saying so."""
    from starlette.datastructures import UploadFile
    from starlette.formparsers import MultiPartException, MultiPartParser

    class Parser(MultiPartParser):
        ended = False  # the closing boundary came (Starlette accepts a form without it)

        def on_end(self) -> None:
            self.ended = True

    parser = Parser(request.headers, request.stream(), max_files=1, max_fields=16)
    try:
        form = await parser.parse()
    except MultiPartException as e:
        why = f" ({e.__cause__})" if e.__cause__ else ""  # the parser's own words
        raise Refused(400, f"the multipart form is malformed: {e.message}{why}") from None
    try:
        if not parser.ended:
            raise Refused(
                400,
                "the multipart form is cut off: it ends before its closing boundary "
                "(mid-file?); send the whole form",
            )
        files = [value for _, value in form.multi_items() if isinstance(value, UploadFile)]
        if not files:
            raise Refused(
                400, "the multipart form has no file field: send one (-F file=@photo.jpg)"
            )
        with open(dest, "wb") as out:
            await files[0].seek(0)
            while chunk := await files[0].read(MB):
                out.write(chunk)
    finally:
        await form.close()


class Service:
    """The state of one server: the model served, the batcher, reloads, scratch space."""

    def __init__(self, model: ServedModel, settings: Settings, scratch: Path):
        self.model, self.settings, self.scratch = model, settings, scratch
        self.batcher = Batcher(settings.max_batch, settings.window_s)
        # threads, not processes: 0.7 ms less CPU per image (no pickling, no pipes), and
        # Pillow and ONNX Runtime release the GIL while they work (bench/serve_bench.py)
        self.decoders = ThreadPoolExecutor(settings.decode_workers, "serve-decode")
        self.budget = PixelBudget(settings.max_pixels)
        self.seen = model.stat  # the model file's stat when last looked at
        self.settling = None  # a new stat, loaded once a look later finds it unchanged
        self.reloads, self.refused, self.missing = 0, None, False
        self.uploads = 0  # request bodies being received now
        self.stopping = False  # set on SIGTERM/SIGINT: each answer closes its connection
        self.numbers = itertools.count()  # names of the request files in scratch

    async def predict(self, request):
        from starlette.responses import JSONResponse

        k = top_k_of(request, self.settings.top_k)
        model = self.model  # decoded with its metadata, run on it: a reload cannot split them
        dest = self.scratch / f"request-{next(self.numbers)}"
        self.batcher.coming += 1
        try:
            await self.spool(request, dest)
            x = await self.decode(dest, model.spec)
            done = self.batcher.put(model, x)
        finally:
            self.batcher.coming -= 1
            dest.unlink(missing_ok=True)
        logits, size = await done
        ranked = top_k(logits[None], model.classes, k)[0]
        rows = [{"class": c, "probability": p} for c, p in ranked]
        return JSONResponse({"predictions": rows, "model": model.sha256, "batch_size": size})

    async def spool(self, request, dest: Path) -> None:
        """The body into `dest`, at most max_uploads at once: slow or stalled clients cannot
        hold every connection and fill $TMPDIR. The server's own trouble storing it is a 503,
        not a 500."""
        s = self.settings
        if self.uploads >= s.max_uploads:
            raise Refused(
                503,
                f"{self.uploads} uploads are being received already (--max-uploads): try again",
                {"Retry-After": "1"},
            )
        self.uploads += 1
        try:
            dest.parent.mkdir(exist_ok=True)  # a /tmp cleaner may have removed an idle one
            await spool(request, dest, s.max_body, s.body_timeout_s)
        except OSError as e:
            raise Refused(503, f"the server cannot store the upload: {e.strerror or e}") from None
        finally:
            self.uploads -= 1

    async def decode(self, path: Path, spec: dict) -> np.ndarray:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.decoders, image_input, path, spec, self.budget)

    async def health(self, request):
        from starlette.responses import JSONResponse

        failing = self.batcher.failing is not None  # a load balancer takes it out (503)
        return JSONResponse(
            {
                "status": "failing" if failing else "ok",
                "model": {"path": str(self.model.path), "sha256": self.model.sha256},
                "loaded_at": iso(self.model.loaded_at),
                "reload": {
                    "interval_s": self.settings.reload_interval_s,
                    "reloads": self.reloads,
                    "refused": self.refused,  # why the file on disk is not the one served
                    "file_missing": self.missing,
                },
                "uploads": {"receiving": self.uploads, "max": self.settings.max_uploads},
                "batches": self.batcher.stats(),
            },
            status_code=503 if failing else 200,
        )

    async def metadata(self, request):
        from starlette.responses import JSONResponse

        m, s = self.model, self.settings
        return JSONResponse(
            {
                "classes": m.classes,
                "preprocess": m.spec,
                "model": {
                    "path": str(m.path),
                    "format": "onnx",
                    "sha256": m.sha256,
                    "opset": m.opset,
                    "precision": "int8" if m.quantization else "float32",
                    "quantization": m.quantization,  # the file's record; None: float32
                    "input": m.input_shape,
                    "loaded_at": iso(m.loaded_at),
                },
                "batching": {"max_batch": s.max_batch, "window_ms": s.window_s * 1000},
                "limits": {
                    "max_body_bytes": s.max_body,
                    "max_pixels": s.max_pixels,
                    "max_uploads": s.max_uploads,
                    "body_timeout_s": s.body_timeout_s,
                },
                "top_k": s.top_k,
            }
        )

    async def watch(self) -> None:
        """Look at the model file's stat every reload_interval_s; never ends on an error."""
        while True:
            await asyncio.sleep(self.settings.reload_interval_s)
            try:
                await self.check_model_file()
            except Exception as e:  # a reload problem must not stop the serving
                log(f"model file check failed: {type(e).__name__}: {e}")

    async def check_model_file(self) -> None:
        """Reload a changed model file, once it has stayed unchanged for a look and has been
        validated fully; keep the old one on any problem, and say so (stderr and /health)."""
        path, stat = self.model.path, file_stat(self.model.path)
        if stat == self.seen:
            return
        if stat is None:
            self.seen, self.missing = None, True
            log(f"{path} is gone; still serving sha256 {self.model.sha256[:12]}")
            return
        self.missing = False
        if stat != self.settling:  # changed since the last look: a copy may be under way
            self.settling = stat
            return
        loop = asyncio.get_running_loop()
        try:
            model = await loop.run_in_executor(None, load_served, path, self.scratch)
        except Changing:
            return  # being written: the next look tries again
        except ModelError as e:
            self.seen, self.refused = stat, str(e)
            log(f"reload refused: {e}; still serving sha256 {self.model.sha256[:12]}")
            return
        self.seen, self.refused = model.stat, None
        if model.sha256 != self.model.sha256:
            old, self.model, self.reloads = self.model, model, self.reloads + 1
            log(f"reloaded {path}: sha256 {old.sha256[:12]} -> {model.sha256[:12]}")

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        tasks = [asyncio.create_task(self.batcher.run_forever())]
        if self.settings.reload_interval_s > 0:
            tasks.append(asyncio.create_task(self.watch()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            self.decoders.shutdown(wait=False, cancel_futures=True)
            self.batcher.pool.shutdown(wait=False, cancel_futures=True)

    def app(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.requests import ClientDisconnect
        from starlette.routing import Route

        routes = [
            Route("/predict", self.predict, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metadata", self.metadata, methods=["GET"]),
        ]
        handlers = {
            # a refusal may come before the body is read (or all of it): the connection closes
            Refused: lambda request, e: error(
                e.status, str(e), {"Connection": "close"} | (e.headers or {})
            ),
            HTTPException: lambda request, e: error(e.status_code, str(e.detail)),
            ClientDisconnect: lambda request, e: error(400, "the client went away"),
            Exception: lambda request, e: error(500, f"{type(e).__name__}: {e}"),  # a bug
        }
        app = Starlette(routes=routes, exception_handlers=handlers, lifespan=self.lifespan)

        async def closing(scope, receive, send):
            """The app; once stopping, each answer says Connection: close (uvicorn then closes
            the connection after it, and the client knows to send no more on it)."""

            async def send_closing(message):
                if self.stopping and message["type"] == "http.response.start":
                    headers = list(message.get("headers", []))
                    if (b"connection", b"close") not in headers:
                        headers.append((b"connection", b"close"))
                    message = {**message, "headers": headers}
                await send(message)

            await app(scope, receive, send_closing)

        return closing


def error(status: int, reason: str, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": " ".join(reason.split())}, status_code=status, headers=headers)


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class HeadTimeout(H11Protocol):
    """uvicorn's HTTP/1.1, with a deadline for each request head, which uvicorn has not: a
    client that sent `GET /hea` and nothing more held its connection for good, and enough of
    them held every file descriptor (the server then answered nobody). The head must be whole
    within `head_timeout_s` (--body-timeout) of the connection or of the previous answer."""

    head_timeout_s = 10.0  # serve() sets it
    deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.deadline is not None and self.conn.their_state is not h11.IDLE:
            self.deadline.cancel()  # the head is in
            self.deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.arm()

    def arm(self) -> None:
        if self.deadline is None and self.conn.their_state is h11.IDLE:
            self.deadline = self.loop.call_later(self.head_timeout_s, self.head_too_late)

    def head_too_late(self) -> None:
        self.deadline = None
        if self.conn.their_state is h11.IDLE:
            self.timeout_keep_alive_handler()  # closes the connection


class Stopped(Exception):
    """SIGTERM, after uvicorn's graceful shutdown."""


class Server(uvicorn.Server):
    """uvicorn's server, stopping without losing a request a client has sent. uvicorn closes
    each idle kept-alive connection the moment it stops, and a POST a client sent on one just
    then is lost (16 keep-alive clients lost 6 to 11 POSTs; clients do not retry a POST).
    Here it stops accepting connections first, then each open one closes after its next answer
    (which says Connection: close) or, idle, after uvicorn's keep-alive timeout (5 s); then
    uvicorn's own shutdown (requests in flight finish, within graceful_s in all)."""

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    async def shutdown(self, sockets=None) -> None:
        log("stopping: no new connections; each open one closes after its next answer")
        self.service.stopping = True
        for server in self.servers:
            server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout_graceful_shutdown
        while self.server_state.connections and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.config.timeout_graceful_shutdown = max(0.0, deadline - loop.time())
        await super().shutdown(sockets)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket. Made with proto IPPROTO_TCP, as asyncio makes its own: asyncio
    sets TCP_NODELAY only on such sockets, and without it every answer on a kept-alive
    connection waited 40 ms for the client's delayed ACK (socket.create_server's proto is 0)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(model_path: Path, host: str, port: int, settings: Settings) -> int:
    """Serve until SIGINT or SIGTERM (requests in flight finish first); 2 when the model or
    the address cannot be used, with one line saying why."""
    # the multipart parser logs each malformed form to stderr: the 400 answer says it already
    logging.getLogger("python_multipart").setLevel(logging.CRITICAL)
    scratch = Path(tempfile.mkdtemp(prefix="visionflow-serve-"))
    try:
        try:
            model = load_served(model_path, scratch)
            sock = listen(host, port)
        except (ModelError, Changing) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            hint = " (another server there? choose another --port)"
            hint = hint if e.errno == errno.EADDRINUSE else ""
            print(
                f"error: cannot listen on {host}:{port}: {e.strerror or e}{hint}", file=sys.stderr
            )
            return 2
        service = Service(model, settings, scratch)
        HeadTimeout.head_timeout_s = settings.body_timeout_s
        config = uvicorn.Config(
            service.app(),
            http=HeadTimeout,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=settings.graceful_s,
        )
        print(
            f"serving {model_path} (sha256 {model.sha256[:12]}) at "
            f"{url_of(host, sock.getsockname()[1])}: POST /predict, GET /health, GET /metadata; "
            "Ctrl-C stops",
            flush=True,
        )

        def stopped(signum, frame):
            raise Stopped

        signal.signal(signal.SIGTERM, stopped)  # uvicorn raises it again once it has stopped
        try:
            Server(config, service).run(sockets=[sock])
        except (Stopped, KeyboardInterrupt):
            pass
        log("stopped")
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
