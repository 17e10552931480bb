"""Decoding on all cores: every image straight into its row of a raw scratch file, in a pool of
processes (files) or in this process (arrays), with a progress line on stderr; `dataset` writes
the cache from that file.

Only a digest of each image's pixels travels back from a process, so memory does not grow with the
folder. A process that dies (the out-of-memory killer, kill -9, a crash in a codec) is a DataError
saying so, not a hang; a stop (Ctrl-C, SIGTERM, an error) ends the processes at once. The fault
point `prepare.decode` (index) fires in the decoding processes (`visionflow.faults`).
"""

import contextlib
import hashlib
import multiprocessing
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from visionflow import faults
from visionflow.data.decode import Decode, open_image, pixels_of
from visionflow.errors import DataError, DiskFull

_worker: dict = {}  # per decoding process: the scratch file's descriptor, the Decode options, the images
# images per task handed to a decoding process: large enough that the hand-over (a pickle each
# way, a queue, a future) is small beside decoding even 32 px PNGs, small enough that the last
# tasks still spread over every core; capped below so each process gets about 8 tasks
# (docs/benchmarks.md, "Numbers that were code comments")
CHUNK = 64


def cores() -> int:
    """The CPU cores this process may run on: its affinity (a container's or taskset's share),
    not the host's count that `os.cpu_count()` gives."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _start_worker(path: Path, decode: Decode, images: Sequence) -> None:
    # Ctrl-C reaches the whole foreground group: the parent stops the pool (no traceback per
    # worker); SIGTERM from the parent ends a worker at once
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker["out"] = os.open(path, os.O_WRONLY)  # closed when the process ends
    _worker["decode"] = decode
    _worker["images"] = images  # inherited through fork, not pickled: a task is two numbers


def _decode_one(index: int, item) -> tuple[int, str | None, bytes]:
    """Decode one image straight into its row of the scratch file (every image has the same
    size); only a digest travels back."""
    decode = _worker["decode"]
    if faults.ACTIVE:
        faults.fault("prepare.decode", index=index)
    try:
        if isinstance(item, np.ndarray):
            image = Image.fromarray(item)
        else:
            image = open_image(Path(item), decode)
    except DataError as error:
        return index, str(error), b""
    pixels = pixels_of(image, decode).tobytes()
    os.pwrite(_worker["out"], pixels, index * len(pixels))
    return index, None, hashlib.blake2b(pixels, digest_size=16).digest()


def _decode_chunk(start: int, stop: int) -> list[tuple[int, str | None, bytes]]:
    items = _worker["images"][start:stop]
    return [_decode_one(start + i, item) for i, item in enumerate(items)]


def _decode_here(path: Path, images: Sequence, decode: Decode):
    """Yield each image's result, decoded in this process."""
    _worker["out"], _worker["decode"] = os.open(path, os.O_WRONLY), decode
    try:
        for index, item in enumerate(images):
            yield [_decode_one(index, item)]
    finally:
        os.close(_worker["out"])
        _worker.clear()


def _decode_in_pool(path: Path, images: Sequence, decode: Decode, workers: int):
    """Yield the results of each chunk of images as a process finishes it. A process that dies
    (the out-of-memory killer, kill -9, a crash in a codec) is a DataError, not a hang; a stop
    (Ctrl-C, SIGTERM, an error, the caller closing this generator) ends the processes at once."""
    size = max(1, min(CHUNK, len(images) // (8 * workers)))
    starts = range(0, len(images), size)
    context = multiprocessing.get_context("fork")  # workers inherit the imports: no start-up cost
    pool = ProcessPoolExecutor(
        min(workers, len(starts)), context, _start_worker, (path, decode, images)
    )
    done = 0
    try:
        # a task is its first and last index (the processes have the images from the fork: the
        # paths are not made and held in every queued task), and as_completed lets go of each
        # future it yields, so a chunk's results are freed once read (prepare's memory does not
        # grow with the folder by more than a few bytes an image)
        for future in as_completed([pool.submit(_decode_chunk, i, i + size) for i in starts]):
            results = future.result()
            done += len(results)
            yield results
    except BrokenProcessPool:
        processes = _workers(pool)
        pool.shutdown(wait=True)  # the rest are stopped and reaped: their exit codes are known
        raise DataError(_died(processes, done, len(images), path), setting="workers") from None
    except BaseException:  # Ctrl-C, SIGTERM, an error: the workers stop now, unfinished
        _stop(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _workers(pool: ProcessPoolExecutor) -> list:
    """The pool's processes, all started by the first submit (fork), from its private
    `_processes` ([] where a Python lacks it: `_stop` then uses 3.14's public kill_workers())."""
    return list((getattr(pool, "_processes", None) or {}).values())


def _stop(pool: ProcessPoolExecutor) -> None:
    """End the pool's processes, whatever they are doing, so that its shutdown cannot wait: the
    ones that exist now (a stop can come while the jobs are still being submitted), and the half
    message a process stopped while it sent a result leaves in the results pipe, which the
    pool's reader would wait on for good, since this process holds a writing end of it too:
    closed, the reader sees the pipe's end and the pool ends as broken."""
    processes = _workers(pool)
    if not processes and hasattr(pool, "kill_workers"):  # Python 3.14's public way
        pool.kill_workers()
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(5)  # SIGTERM ends a worker at once (`_start_worker`); else SIGKILL
        if process.is_alive():
            process.kill()
            process.join()
    writer = getattr(
        getattr(pool, "_result_queue", None), "_writer", None
    )  # private: read with getattr, None where absent
    if writer is not None:
        writer.close()


def _died(processes: list, done: int, total: int, path: Path) -> str:
    """What a dead decoding process's exit says; the pool itself SIGTERMs the others. SIGBUS
    with the disk of `path` (the mapped file) full is a full disk, whatever `dataset.reserve` did (a
    file system without real allocation)."""
    codes = [p.exitcode for p in processes if p.exitcode not in (None, 0, -signal.SIGTERM)]
    if -signal.SIGBUS in codes and shutil.disk_usage(path.parent).free < 2**20:
        raise DiskFull.at(path.parent)
    how = "killed, or out of memory"
    if codes and codes[0] < 0:
        how = f"{signal.Signals(-codes[0]).name}: {how}"
    return (
        f"a decoding process died ({how}) after {done} of {total} images were decoded; run "
        "again, or use fewer workers"
    )


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{seconds // 60:.0f} min {seconds % 60:.0f} s"


class ProgressBar:
    """Images decoded of the total, the rate and the time left, on stderr: tqdm's bar in a
    terminal; elsewhere (DVC's captured output, the Prefect logs) a plain line every `every`
    seconds and one at the end, never a redraw per file (a quick decode is one line)."""

    def __init__(self, total: int, every: float = 5.0, stream=None, what: str = "decode"):
        self.stream = stream or sys.stderr
        self.total, self.every, self.done, self.what = total, every, 0, what
        self.start = time.monotonic()
        self.shown = (self.start, 0)  # when the last line went out, at what count
        tty = total > 0 and getattr(self.stream, "isatty", lambda: False)()
        self.bar = (
            tqdm(total=total, desc=what, unit="img", file=self.stream, mininterval=0.5)
            if tty
            else None
        )

    def __call__(self, n: int) -> None:
        """`n` more images are done (decoded or rejected)."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            if self.done >= self.total:
                self.bar.close()
            return
        now, (then, _) = time.monotonic(), self.shown
        if self.done >= self.total or now - then >= self.every:
            self.shown = (now, self.done)
            print(self.line(now - self.start), file=self.stream, flush=True)

    def line(self, elapsed: float) -> str:
        rate = self.done / max(elapsed, 1e-9)
        if self.done >= self.total:
            done = f"{self.done}/{self.total} images in {_duration(elapsed)} ({rate:.0f}/s)"
            return f"{self.what}: {done}"
        left = _duration((self.total - self.done) / max(rate, 1e-9))
        return f"{self.what}: {self.done}/{self.total} images ({rate:.0f}/s, {left} left)"


def decode_into(
    path: Path, images: Sequence, decode: Decode, workers: int = 1, progress=None
) -> tuple[np.ndarray, dict[int, str], np.ndarray]:
    """Decode every image into the raw file at `path` (N x size x size x C uint8, no header, made
    by the caller): image i at i times its bytes.

    Files are decoded in `workers` processes, each writing its rows of the file; arrays are
    decoded in this one. `progress(n)` is called as each n more images are done
    (default: a `ProgressBar` on stderr). Returns the mask of decoded images, the reason for each
    rejected index, and a digest of each image's pixels.
    """
    ok = np.zeros(len(images), dtype=bool)
    rejected, digests = {}, np.zeros(len(images), dtype="S16")  # not a bytes object each
    progress = progress or ProgressBar(len(images))
    files = len(images) > 0 and not isinstance(images[0], np.ndarray)
    parallel = workers > 1 and files
    chunks = (
        _decode_in_pool(path, images, decode, workers)
        if parallel
        else _decode_here(path, images, decode)
    )
    with contextlib.closing(chunks):  # a stop here stops the pool too
        for results in chunks:
            for index, reason, digest in results:
                if reason is None:
                    ok[index], digests[index] = True, digest
                else:
                    rejected[index] = reason
            progress(len(results))
    return ok, rejected, digests
