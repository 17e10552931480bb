"""Watching what the pipeline depends on (every dep in dvc.yaml, params.yaml, dvc.yaml) by
filesystem events (inotify, through watchdog), for the flows' `--watch`: no polling of files,
so an idle watch over 20,000 images costs no measurable CPU (docs/benchmarks.md).
"""

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from visionflow.ops.project import all_deps, dvc_ignores


def settled_changes(root: Path, settle_s: float) -> Iterator[list[str]]:
    """Yields once per burst of changes to the deps of the project at `root`, after `settle_s`
    seconds without a further change: an editor's save or a copy of many images is one; what
    it yields is the burst's changed paths, relative to `root`, sorted. A dep folder (or one
    above a dep) that goes and comes back is watched again; a change to params.yaml or dvc.yaml
    reads the deps again (a new `prepare.path` is watched, the old one no longer)."""
    from watchdog.events import FileSystemEventHandler
    from watchdog.observers import Observer

    deps = all_deps(root)
    says_deps = {root / "params.yaml", root / "dvc.yaml"}  # what the deps are
    changed_at: list[float] = []
    changed: set[Path] = set()  # this burst's paths
    lock = threading.Lock()
    rewatch = threading.Event()
    reread = threading.Event()  # params.yaml or dvc.yaml changed: the deps are read again
    gone: set[Path] = set()  # folders (deps or above) that came or went: watched again

    class Changes(FileSystemEventHandler):
        def on_any_event(self, event) -> None:
            if event.event_type in ("opened", "closed_no_write"):
                return
            if event.is_directory and event.event_type == "modified":
                return  # a file in it came, went or changed: that file's own event says so
            paths = [Path(p) for p in (event.src_path, getattr(event, "dest_path", "")) if p]
            with lock:
                now = list(deps)
            hits, above = touched(paths, now, event.event_type)
            if hits & says_deps:
                reread.set()
                rewatch.set()
            if above:
                with lock:
                    gone.update(above)
                rewatch.set()
            if hits:
                with lock:
                    changed.update(hits)
                    changed_at[:] = [time.monotonic()]

    observer, handler = Observer(), Changes()
    watched: dict[tuple[Path, bool], object] = {}  # (folder, recursive): its watch

    def schedule() -> None:
        """Watch again what went or came back (at or below a folder in `gone`), watch what is
        new, drop what is no longer there. The other watches are never taken down: a change
        made meanwhile (right after a run, say) is seen, which unscheduling all first missed."""
        if reread.is_set():
            reread.clear()
            with contextlib.suppress(Exception):  # a half-written file: the next event reads it
                read = all_deps(root)
                with lock:
                    deps[:] = read
        with lock:
            came_or_went = list(gone)
            gone.clear()
            points = watch_points(root, deps)
        rewatched(observer, handler, watched, points, came_or_went)

    schedule()
    observer.start()
    print(f"watching {len(deps)} deps of {root} (settle {settle_s} s)", flush=True)
    try:
        while True:
            if rewatch.wait(0.2):
                rewatch.clear()
                schedule()
            if rewatch.is_set():  # the burst waits until what it may have changed is watched
                continue
            if changed_at and time.monotonic() - changed_at[0] >= settle_s:
                with lock:
                    burst = sorted(os.path.relpath(path, root) for path in changed)
                    changed_at.clear()
                    changed.clear()
                yield burst
    finally:
        observer.stop()


def touched(paths: list[Path], deps: list[Path], event_type: str) -> tuple[set, set]:
    """The paths an event touched that matter: at or below a dep, or, for a folder that came
    or went, above one (its watch is gone or due); and those above ones apart. What DVC ignores
    (bytecode a stage's import writes, an editor's swap file) touches nothing."""
    paths = [path for path in paths if not dvc_ignores(path)]
    hits = {path for path in paths for dep in deps if path.is_relative_to(dep)}
    above = set()
    if event_type in ("created", "deleted", "moved"):
        above = {path for path in paths for dep in deps if dep.is_relative_to(path)}
    return hits | above, above


def rewatched(observer, handler, watched: dict, points: set, came_or_went: list[Path]) -> None:
    """Take down the watches of `watched` not among `points` or at or below a folder that came
    or went, and watch each point not watched (it updates `watched`)."""
    for point, watch in list(watched.items()):
        if point not in points or any(point[0].is_relative_to(p) for p in came_or_went):
            with contextlib.suppress(KeyError):  # watchdog dropped it with its folder
                observer.unschedule(watch)
            del watched[point]
    for folder, recursive in sorted(points - watched.keys()):
        with contextlib.suppress(FileNotFoundError):  # gone again: `rewatch` is set again
            watched[folder, recursive] = observer.schedule(
                handler, str(folder), recursive=recursive
            )


def watch_points(root: Path, deps: list[Path]) -> set[tuple[Path, bool]]:
    """(folder, recursive) to watch: a folder dep whole, plus its parent (to see it go and come
    back); a file dep, or a dep not there yet, through its nearest existing folder."""
    points = set()
    for dep in deps:
        if dep.is_dir():
            points.add((dep, True))
        parent = next(p for p in dep.parents if p.is_dir())
        points.add((parent, False))
    return points
