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
`{"error": one line}`, and the server goes on. A body that sends no byte for `body_timeout_s`, or
that averages under `min_upload_rate` after that grace, is a 408 and its connection closed; past
`max_uploads` bodies being received at once, a request is a 503 with Retry-After (and /health a
503 "uploads full"): stalled or dripping clients hold neither the connections nor $TMPDIR. A model that
answers a batch with the wrong number of rows is a 500 for that batch's requests, logged. The
model file is watched (its stat, every `reload_interval` seconds): a changed file is loaded from
a snapshot of its bytes and validated fully (`inference.load_predictor`: metadata, shapes, one
forward pass) before it replaces the model served; a broken one is refused, logged and shown in
/health while the old one goes on serving. SIGTERM: see `server.Server`.

No torch, so it starts answering quickly (docs/benchmarks.md measures the start). For tests,
VISIONFLOW_FAULT='serve.infer@batch=1:pause=FILE' holds the first batch until FILE exists
(src/visionflow/faults.py).
"""

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import uvicorn

from visionflow.data.decode import Decode
from visionflow.deploy.batching import Batcher, PixelBudget, Refused, image_input, log
from visionflow.deploy.inference import (
    ModelError,
    top_k,
)
from visionflow.deploy.served import Changing, ServedModel, file_stat, load_served
from visionflow.deploy.server import HeadTimeout, Server, listen

MB = 2**20
RAW_TYPES = ("application/octet-stream",)  # besides image/*: "these are a file's bytes"
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
    min_upload_rate: float = 32 * 1024  # bytes/s a body must average after body_timeout_s


def media_type(request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def top_k_of(request, default: int) -> int:
    raw = request.query_params.get("top_k")
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) < 10) or int(raw) < 1:
        raise Refused(400, f"top_k must be a whole number, 1 or more: {raw[:20]!r}")
    return int(raw)


def limited(request, limit: int, timeout_s: float, min_rate: float):
    """The request with a receive that refuses (413) a body past `limit` bytes as it arrives,
    and drops (408, closing the connection) one that sends no byte for `timeout_s`, or that,
    once `timeout_s` has passed since its first byte was awaited, has averaged under `min_rate`
    bytes/s. A deadline per receive alone let a client that drips a byte now and then hold an
    upload slot for good: with --max-uploads of them, every other client got a 503."""
    from starlette.requests import Request

    seen, loop = 0, asyncio.get_running_loop()
    start = last = loop.time()  # when the body was first awaited; when its last bytes came

    async def receive():
        nonlocal seen, last
        # the body's deadline for the bytes so far: the grace, then min_rate on average
        due = start + timeout_s + seen / min_rate
        try:
            wait = min(due, last + timeout_s) - loop.time()
            message = await asyncio.wait_for(request.receive(), wait)
        except TimeoutError:  # asyncio.TimeoutError is this class from Python 3.11 on
            elapsed = loop.time() - start
            if due < last + timeout_s:
                reason = (
                    f"the upload is too slow: {seen} bytes in {elapsed:.0f} s, under the "
                    f"minimum of {min_rate / 1024:g} KB/s (--min-upload-rate) after the first "
                    f"{timeout_s:g} s (--body-timeout)"
                )
            else:
                reason = (
                    f"the upload stalled: no byte of the body for {timeout_s:g} s "
                    f"(--body-timeout); {seen} bytes came"
                )
            raise Refused(408, reason, {"Connection": "close"}) from None
        seen, last = seen + len(message.get("body", b"")), loop.time()
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


async def spool(request, dest: Path, limit: int, timeout_s: float, min_rate: float) -> None:
    """The request's image into the file `dest`: a raw body, or a multipart form's one file."""
    kind = media_type(request)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise Refused(413, too_large(limit))
    request = limited(request, limit, timeout_s, min_rate)
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
        complete = False  # the closing boundary came (Starlette accepts a form without it)

        def on_end(self) -> None:
            self.complete = True

    parser = Parser(request.headers, request.stream(), max_files=1, max_fields=16)
    try:
        form = await parser.parse()
    except MultiPartException as error:
        reason = f" ({error.__cause__})" if error.__cause__ else ""  # the parser's own words
        raise Refused(400, f"the multipart form is malformed: {error.message}{reason}") from None
    try:
        if not parser.complete:
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
        # threads, not processes: less CPU per image (no pickling, no pipes), and
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
            await spool(request, dest, s.max_body, s.body_timeout_s, s.min_upload_rate)
        except OSError as error:
            raise Refused(
                503, f"the server cannot store the upload: {error.strerror or error}"
            ) from None
        finally:
            self.uploads -= 1

    async def decode(self, path: Path, spec: dict) -> np.ndarray:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.decoders, image_input, path, spec, self.budget)

    async def health(self, request):
        from starlette.responses import JSONResponse

        # a load balancer takes it out (503) while its batches fail, or while every upload
        # slot is taken (it refuses each new upload then)
        failing = self.batcher.failing is not None
        full = self.uploads >= self.settings.max_uploads
        status = "failing" if failing else "uploads full" if full else "ok"
        return JSONResponse(
            {
                "status": status,
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
            status_code=200 if status == "ok" else 503,
            headers={"Retry-After": "1"} if full and not failing else None,
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
                    "min_upload_rate_kb_s": s.min_upload_rate / 1024,
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
            except Exception as error:  # a reload problem must not stop the serving
                log(f"model file check failed: {type(error).__name__}: {error}")

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
        except ModelError as error:
            self.seen, self.refused = stat, str(error)
            log(f"reload refused: {error}; still serving sha256 {self.model.sha256[:12]}")
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
            Refused: lambda request, raised: error(
                raised.status, str(raised), {"Connection": "close"} | (raised.headers or {})
            ),
            HTTPException: lambda request, raised: error(raised.status_code, str(raised.detail)),
            ClientDisconnect: lambda request, raised: error(400, "the client went away"),
            Exception: lambda request, raised: error(
                500, f"{type(raised).__name__}: {raised}"
            ),  # a bug
        }
        app = Starlette(routes=routes, exception_handlers=handlers, lifespan=self.lifespan)

        async def closing(scope, receive, send):
            """The app; once stopping, each answer says Connection: close (uvicorn then closes
            the connection after it, and the client knows to send no more on it). So does the
            answer to a request with a body that no route reads (GET /health with one, a 404):
            uvicorn would go on reading that body, each byte resetting its keep-alive timer, so
            a client dripping it held the connection for good, and enough of them every file
            descriptor."""
            unread = scope["type"] == "http" and has_body(scope) and scope["path"] != "/predict"

            async def send_closing(message):
                if (self.stopping or unread) and message["type"] == "http.response.start":
                    headers = list(message.get("headers", []))
                    if (b"connection", b"close") not in headers:
                        headers.append((b"connection", b"close"))
                    message = {**message, "headers": headers}
                await send(message)

            await app(scope, receive, send_closing)

        return closing


def has_body(scope) -> bool:
    """Whether the request's head announces a body (a length over 0, or chunks)."""
    headers = dict(scope.get("headers", []))
    length = headers.get(b"content-length", b"0")
    return b"transfer-encoding" in headers or not (length.isdigit() and int(length) == 0)


def error(status: int, reason: str, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": " ".join(reason.split())}, status_code=status, headers=headers)


def iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


class Stopped(Exception):
    """SIGTERM, after uvicorn's graceful shutdown."""


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
        except (ModelError, Changing) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        except OSError as error:
            hint = " (another server there? choose another --port)"
            hint = hint if error.errno == errno.EADDRINUSE else ""
            print(
                f"error: cannot listen on {host}:{port}: {error.strerror or error}{hint}",
                file=sys.stderr,
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
