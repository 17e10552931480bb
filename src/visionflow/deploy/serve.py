"""`visionflow serve`: an exported ONNX model over HTTP, with dynamic batching.

    POST /predict[?top_k=K]   one image: a raw body (Content-Type image/* or
                              application/octet-stream) or a multipart form with one file field;
                              answers {"predictions": [{"class", "probability"}...], "model": sha256,
                              "batch_size": images in the batch it ran in}
    GET  /health/live         liveness: 200 whenever the process answers
    GET  /health/ready        readiness: 200 while a model is loaded and its batches are not
                              failing (503 "failing" then); never 503 for busy upload slots
    GET  /health              readiness's status code, with the report: the model served,
                              reloads, uploads being received and refused, batches run
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
that averages under `min_upload_rate` after that grace, is a 408 and its connection closed. At
most `max_uploads` bodies are received at once (then a 503 with Retry-After), shared out by
client address (then a 429 for that address): one that owes too much grace for its slow
uploads, reconnecting or not, or that already has `per_client()` uploads when few slots are
left, is refused. Stalled, dripping or reconnecting clients from one address hold neither every
connection nor $TMPDIR (`serve_uploads.Uploads`). A model that
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
from visionflow.deploy.serve_uploads import MB, Upload, Uploads, spool
from visionflow.deploy.served import Changing, ServedModel, file_stat, load_served
from visionflow.deploy.server import HeadTimeout, Server, listen

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
    max_uploads_per_client: int = 0  # one address's share (Uploads); 0: max_uploads / 4

    def per_client(self) -> int:
        return self.max_uploads_per_client or max(1, self.max_uploads // 4)


def top_k_of(request, default: int) -> int:
    raw = request.query_params.get("top_k")
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) < 10) or int(raw) < 1:
        raise Refused(400, f"top_k must be a whole number, 1 or more: {raw[:20]!r}")
    return int(raw)


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
        self.uploads = Uploads(settings.max_uploads, settings.per_client(), settings.body_timeout_s)
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
        """The body into `dest`, if the server and the client's address have an upload slot
        (`Uploads`): slow or stalled clients cannot hold every connection and fill $TMPDIR. The
        server's own trouble storing it is a 503, not a 500."""
        s = self.settings
        # the peer's address; behind a proxy on 127.0.0.1, the one its X-Forwarded-For names
        # (uvicorn's ProxyHeadersMiddleware; FORWARDED_ALLOW_IPS trusts other proxies)
        address = request.client.host if request.client else ""
        upload = Upload(request, s.max_body, s.body_timeout_s, s.min_upload_rate)
        self.uploads.admit(address, upload)
        try:
            dest.parent.mkdir(exist_ok=True)  # a /tmp cleaner may have removed an idle one
            await spool(upload.request, dest, s.max_body)
        except OSError as error:
            raise Refused(
                503, f"the server cannot store the upload: {error.strerror or error}"
            ) from None
        finally:
            self.uploads.end(address, upload)

    async def decode(self, path: Path, spec: dict) -> np.ndarray:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.decoders, image_input, path, spec, self.budget)

    async def live(self, request):
        """Liveness: the process answers. A liveness probe restarts a server that fails it, and
        a restart mends nothing else (Kubernetes' livenessProbe)."""
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "alive"})

    async def ready(self, request):
        """Readiness: a model is loaded (always, once serving) and its batches are not failing.
        Never "busy": full upload slots are said to the clients that meet them (503 or 429 with
        Retry-After); a replica taken out of its load balancer for them is what slow clients
        want."""
        from starlette.responses import JSONResponse

        failing = self.batcher.failing
        body = {"status": "failing", "reason": failing} if failing else {"status": "ready"}
        return JSONResponse(body | {"model": self.model.sha256}, 503 if failing else 200)

    async def health(self, request):
        """Readiness (its status code, as /health/ready's) and the server's report."""
        from starlette.responses import JSONResponse

        failing = self.batcher.failing is not None
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
                "uploads": self.uploads.report(),
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
                    "max_uploads_per_client": s.per_client(),
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
            Route("/health/live", self.live, methods=["GET"]),
            Route("/health/ready", self.ready, methods=["GET"]),
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
            f"{url_of(host, sock.getsockname()[1])}: POST /predict, GET /health (/live, /ready), "
            "GET /metadata; "
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
