"""What happens to a request's image in `visionflow serve` between its body and its answer: its
size checked from the header, decoded within a budget of pixels at once (`PixelBudget`), and run
with others in one batch (`Batcher`). No torch."""

import asyncio
import contextlib
import ctypes
import sys
import threading
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from visionflow import faults
from visionflow.data.decode import Decode
from visionflow.deploy.inference import (
    ModelError,
    load_images,
    to_input,
)
from visionflow.deploy.served import ServedModel

FORMATS = Decode(1, "rgb").formats  # what the decoder opens (PNG, JPEG, ...), as prepare does


def log(message: str) -> None:
    print(f"serve: {message}", file=sys.stderr, flush=True)


class Refused(Exception):
    """A request the server will not answer with predictions: an HTTP status and one line."""

    def __init__(self, status: int, reason: str, headers: dict | None = None):
        super().__init__(reason)
        self.status, self.headers = status, headers


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


TRIM_AFTER_PIXELS = 4_000_000  # a decode this large hands its freed memory back (a trim is cheap)


def release_freed_memory() -> None:
    """Give the memory a large decode freed back to the system. glibc keeps freed memory in
    each thread's arena: decoding threads that each once decoded a large image kept that memory
    between them, though they decoded one at a time (`PixelBudget`; docs/export-and-serving.md)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


class PixelBudget:
    """The pixels being decoded at once, over all the decoding threads, kept within `limit`
    (--max-pixels): an image of the limit's size decodes alone, so memory does not grow with the
    threads (a small file can decode to a large image: docs/export-and-serving.md has the numbers)."""

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
            except TimeoutError:
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
        except Exception as error:  # the runtime or the model failed: each request says so (a
            # 500, its own exception: one shared would gather every request's traceback), the
            # log says so once, /health until a batch succeeds, and the batcher goes on
            self.failed += 1
            self.failing = (
                f"batch {number} of {len(items)} images failed: {type(error).__name__}: {error}"
            )
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
