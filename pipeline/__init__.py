"""Stage entry points: `python -m pipeline.<stage>`, one per stage in dvc.yaml.

Every stage runs through `run(main)`, which closes two gaps DVC leaves:
- Outputs are written into a staging folder (`staged(out)`) and moved into place only when the
  stage succeeded, so a half-written or unproven output (an export that missed parity) never sits
  at the real path. DVC deletes a stage's outputs before it runs it; after a failure they are still
  in DVC's cache, and `dvc checkout` puts them back (`visionflow repro` and the flows do it).
- The stage's params and deps (as dvc.yaml lists them) are fingerprinted when it starts (a
  stat per file, nothing read) and checked when it ends. DVC hashes deps only after the command,
  so an edit made mid-run would be recorded in dvc.lock against outputs the old values produced;
  here the stage fails instead, naming what changed, and the next `dvc repro` runs it again. A
  file whose stat changed but whose content did not (an editor's "save all", a branch switch and
  back) is not a change: its content is compared with the hash DVC took before the run. Under
  `torchrun` rank 0 alone checks.
"""

import errno
import hashlib
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from visionflow import faults
from visionflow.data.files import StatTable, file_hash, file_stats, iter_stats
from visionflow.errors import DataError, DiskFull, GateError, Interrupted
from visionflow.ops import project
from visionflow.ops.project import fill, param_changes
from visionflow.params import ParamsError, read_yaml


def stage_started() -> str | None:
    """The stage this process was started as (`python -m pipeline.<stage>`, a torchrun rank
    too); None in a process that imports the flows, or a test."""
    argv = sys.orig_argv
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    stage = module.removeprefix("pipeline.")
    return stage if stage != module and stage not in ("flows", "experiments") else None


def stopped_while_starting(signum, frame) -> None:
    # os.write, not print: a signal that lands while the stage prints to stderr would make
    # print re-enter stderr's buffer ("RuntimeError: reentrant call"), with a traceback
    os.write(2, b"interrupted: stopped while the stage was starting; nothing written\n")
    sys.exit(130)  # as a stop at a safe point, and no KeyboardInterrupt traceback


# A stop may come while the stage still imports (torch takes seconds): the same quiet exit 130 as
# a stop later on. `run(main)` installs the handlers for the rest of the stage.
if stage_started():
    signal.signal(signal.SIGINT, stopped_while_starting)
    signal.signal(signal.SIGTERM, stopped_while_starting)
    if faults.ACTIVE:
        faults.fault("stage.import", stage=stage_started())


STAGED: list[tuple[Path, Path]] = []  # (staging folder, final folder) of this process
PUBLISHED: list[Callable[[], None]] = []  # what to do once the outputs are in place


def staged(out: Path) -> Path:
    """A fresh staging folder beside `out`; `run` moves it to `out` when the stage succeeds."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run
    tmp.mkdir(parents=True)
    STAGED.append((tmp, out))
    return tmp


def publish() -> None:
    for tmp, out in STAGED:
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    STAGED.clear()
    while PUBLISHED:
        PUBLISHED.pop(0)()


def when_published(action: Callable[[], None]) -> None:
    """Run `action` only once the stage has succeeded and its outputs are in place (say, drop
    resumable state that a refused run would still need)."""
    PUBLISHED.append(action)


def discard() -> None:
    for tmp, _ in STAGED:
        shutil.rmtree(tmp, ignore_errors=True)
    STAGED.clear()
    PUBLISHED.clear()


def stage_spec(stage: str) -> tuple[dict, dict] | None:
    """(the stage's entry in dvc.yaml, params.yaml); None outside a DVC project (a stage run by hand)."""
    if not (Path("dvc.yaml").exists() and Path("params.yaml").exists()):
        return None
    spec = (read_yaml("dvc.yaml").get("stages") or {}).get(stage)
    return None if spec is None else (spec, read_yaml("params.yaml") or {})


def deps_of(spec: dict, params: dict) -> list[str]:
    """The stage's deps as dvc.yaml lists them, `${prepare.path}` filled in."""
    return fill(spec.get("deps", []), params)


def code_digest(stage: str) -> str:
    """sha256 of the content of the stage's code deps (the `.py` files dvc.yaml lists, and those
    in the folders it lists, bytecode and hidden files skipped as .dvcignore skips them); outside
    a DVC project, of the project modules loaded so far. Resumable state is keyed by it, so a code
    change never resumes the old code's checkpoint."""
    found = stage_spec(stage)
    if found:
        files = sorted(f for f in file_stats(deps_of(*found)) if f.endswith(".py"))
    else:
        root = Path(__file__).resolve().parents[1]
        loaded = (
            Path(m.__file__).resolve()
            for m in list(sys.modules.values())
            if getattr(m, "__file__", None)
        )
        files = sorted(str(f) for f in loaded if f.is_relative_to(root) and ".venv" not in f.parts)
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode() + b"\0" + Path(name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


class Snapshot:
    """The stage's param values and the stat of every file of its deps when it started; no file
    is read then. At the end only a file whose stat changed is read, and compared with the hash
    DVC's state recorded for its start stat (DVC hashed the deps to decide the stage must run), so
    data is read once per run beyond DVC's own hashing. A file DVC never hashed at its start stat
    (`dvc repro --force`, a stage run by hand) counts as modified when its stat changed."""

    def __init__(self, spec: dict, params: dict):
        self.params_file = params
        self.keys, self.deps = spec.get("params", []), deps_of(spec, self.params_file)
        self.stats = StatTable(self.deps)  # compact: an image folder's files are most of it

    def changes(self) -> list[str]:
        params = read_yaml("params.yaml") or {}
        found = [
            f"params.yaml {line}" for line in param_changes(self.keys, self.params_file, params)
        ]
        # the files now, one at a time against the start's table: no second table is built
        seen = np.zeros(len(self.stats), dtype=bool)
        started, lines = {}, {}
        for path, now in iter_stats(self.deps):
            i = self.stats.find(path)
            if i is None:
                lines[path] = f"{path} added"
                continue
            seen[i] = True
            if now != self.stats.stat(i):
                started[path] = self.stats.stat(i)
        for i in np.flatnonzero(~seen):
            path = self.stats.name(i)
            lines[path] = f"{path} removed"
        known, unknown_because = project.hashes_dvc_knew(started)
        for path in started:
            if path not in known:
                lines[path] = (
                    f"{path} changed (its stat did, and DVC has no hash from before the run "
                    f"to compare its content with: {unknown_because})"
                )
            elif file_hash(Path(path), "md5") != known[path]:
                lines[path] = f"{path} modified"
        return found + [lines[path] for path in sorted(lines)]


def disk_full_message(error: OSError) -> str | None:
    """One line for a full disk, a file too large, or a place the stage may not write (a
    read-only file system, no permission), else None (any other OSError is a bug to show in
    full)."""
    if isinstance(error, DiskFull):
        return str(error)
    where = (
        Path(error.filename).parent if error.filename else (STAGED[0][0] if STAGED else Path.cwd())
    )
    if error.errno == errno.ENOSPC:  # without a file name: where this stage was writing
        return str(DiskFull.at(where))
    if error.errno == errno.EFBIG:  # a file past the file system's or the process's largest
        return (
            f"a file in {where} grew past the largest this allows: the file system's (FAT32: "
            "4 GB) or the shell's `ulimit -f`; write to another file system, or raise the limit"
        )
    if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM) and error.filename:
        return (
            f"cannot write {error.filename}: {error.strerror}; make it writable (or the folder "
            "the stage's command line in dvc.yaml names), then run again"
        )
    return None


def stop_at_once(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the same clean stop (train finishes its epoch)


# bytes beyond the outputs' size that DVC's cache must have free (a run-cache entry, say)
CACHE_MARGIN = 2**20


def check_cache_room() -> None:
    """DVC copies a stage's outputs into its cache after the command ends; a cache that fills
    then leaves dvc.lock naming objects the cache lacks (DVC 3.67). So the room is checked
    before anything is published: a stage whose outputs would not fit fails now, with nothing
    recorded, the previous results restorable and the resumable state kept."""
    root = project.dvc_root(Path.cwd())
    if root is None or not STAGED:  # a stage run by hand, outside a DVC project
        return
    cache, types = project.cache_config(root)
    existing = next(p for p in (cache, *cache.parents) if p.exists())
    same_disk = existing.stat().st_dev == STAGED[0][0].stat().st_dev
    if same_disk and types and "copy" not in types:  # moved and linked: no second copy
        return
    files = [f for tmp, _ in STAGED for f in tmp.rglob("*") if f.is_file()]
    needed = sum(f.stat().st_size for f in files) + CACHE_MARGIN
    free = shutil.disk_usage(existing).free
    if needed > free:
        outs = ", ".join(str(out) for _, out in STAGED)
        raise DiskFull(
            f"disk full: DVC's cache {cache} has {free / 2**20:.1f} MB free and {outs} need "
            f"{needed / 2**20:.1f} MB there; nothing was recorded. Free space (`dvc gc` removes "
            "what no commit uses) and run `dvc repro` again: the resumable state is kept"
        )


def print_what_is_left(stage: str, found: tuple[dict, dict] | None) -> None:
    """After a failure, the truth about the stage's outputs: DVC deleted them before the stage
    ran (unless persistent), so name the command that brings the recorded ones back."""
    if found is None:
        return
    spec, params = found
    outs = fill([o if isinstance(o, str) else next(iter(o)) for o in spec.get("outs", [])], params)
    gone = [out for out in outs if not Path(out).exists()]
    if not gone:
        return
    try:
        recorded = stage in ((read_yaml("dvc.lock") or {}).get("stages") or {})
    except Exception:  # no dvc.lock, or one DVC cannot read either: nothing recorded to restore
        recorded = False
    if recorded:
        print(
            f"{', '.join(gone)}: DVC deleted it before the stage ran; `dvc checkout {stage}` "
            "brings back the last recorded results (visionflow repro and the flows do it "
            "themselves)",
            file=sys.stderr,
        )


def run(main: Callable[[], None]) -> None:
    """Run a stage's main; a known failure prints one clear line and exits 1 (no traceback),
    an interrupt (Ctrl-C or SIGTERM) exits 130. Either way the staging folder is removed."""
    signal.signal(signal.SIGTERM, stop_at_once)
    # SIGINT is how the runner, the flows and a terminal stop a stage, even one started with it
    # ignored (a script's background job ignores it, and Python then keeps it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stage = Path(sys.argv[0]).stem
    spec = stage_spec(stage)
    rank = int(os.environ.get("RANK", "0"))  # under torchrun: one guard for all ranks
    before = Snapshot(*spec) if spec and rank == 0 else None
    if faults.ACTIVE and before is not None:
        faults.fault("stage.snapshot", stage=stage, rank=rank)
    try:
        if faults.ACTIVE:
            faults.fault("stage.start", stage=stage)
        main()
        found = before.changes() if before is not None else []
        if found:
            raise GateError(
                f"{stage}: changed while the stage ran: {'; '.join(found)}. Not recording this "
                "run. Its resumable state is kept: undo the change and `dvc repro` resumes from "
                "it; or keep the change and `dvc repro` runs the stage with it (for a code, params "
                "or data change, training starts again)"
            )
        check_cache_room()
        publish()
        if faults.ACTIVE:
            faults.fault("stage.published", stage=stage)
    except (ParamsError, DataError, GateError) as error:
        print(f"error: {error}", file=sys.stderr)
        print_what_is_left(stage, spec)
        sys.exit(1)
    except (Interrupted, KeyboardInterrupt) as error:
        print(f"interrupted: {str(error) or 'stopped at once'}", file=sys.stderr)
        print_what_is_left(stage, spec)
        sys.exit(130)
    except OSError as error:
        message = disk_full_message(error)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        print_what_is_left(stage, spec)
        sys.exit(1)
    finally:
        discard()
