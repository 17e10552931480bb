"""Stage entry points: `python -m pipeline.<stage>`, one per stage in dvc.yaml.

Every stage runs through `run(main)`, which closes two gaps DVC leaves:
- Outputs are written into a staging folder (`staged(out)`) and moved into place only when the
  stage succeeded. The outs are `persist: true`, so DVC does not delete them first: a stage that
  fails leaves the previous results, and its dvc.lock entry, as they were.
- The stage's params and deps (as dvc.yaml lists them) are fingerprinted when it starts and
  checked when it ends. DVC hashes deps only after the command, so an edit made mid-run would be
  recorded in dvc.lock against outputs the old values produced; here the stage fails instead,
  naming what changed, and the next `dvc repro` runs it again.
"""

import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from visionflow import faults
from visionflow.errors import DataError
from visionflow.params import ParamsError, read_yaml
from visionflow.runner import file_stats


class GateError(RuntimeError):
    """A stage's check failed; the message carries the numbers."""


class Interrupted(RuntimeError):
    """Ctrl-C or SIGTERM stopped the stage at a safe point; the message says what was kept."""


STAGED: list[tuple[Path, Path]] = []  # (staging folder, final folder) of this process


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


def discard() -> None:
    for tmp, _ in STAGED:
        shutil.rmtree(tmp, ignore_errors=True)
    STAGED.clear()


def lookup(tree: dict, key: str):
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def snapshot(stage: str) -> dict | None:
    """The stage's param values and the (size, mtime) of every file of its deps; None outside a
    DVC project (a stage run by hand)."""
    if not (Path("dvc.yaml").exists() and Path("params.yaml").exists()):
        return None
    spec = (read_yaml("dvc.yaml").get("stages") or {}).get(stage)
    if spec is None:
        return None
    params = read_yaml("params.yaml") or {}
    deps = [
        re.sub(r"\$\{([^}]+)\}", lambda m: str(lookup(params, m[1])), d)
        for d in spec.get("deps", [])
    ]
    return {
        **{f"param {key}": lookup(params, key) for key in spec.get("params", [])},
        **file_stats(deps),
    }


def changes(before: dict, after: dict) -> list[str]:
    found = []
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key), after.get(key)
        if old == new:
            continue
        if key.startswith("param "):
            found.append(f"params.yaml {key[6:]}: {old!r} -> {new!r}")
        else:
            found.append(
                f"{key} " + ("added" if old is None else "removed" if new is None else "modified")
            )
    return found


def run(main: Callable[[], None]) -> None:
    """Run a stage's main; a known failure prints one clear line and exits 1 (no traceback),
    an interrupt exits 130. Either way the previous outputs stay in place."""
    stage = Path(sys.argv[0]).stem
    before = snapshot(stage)
    try:
        if faults.ACTIVE:
            faults.fault("stage.start", stage=stage)
        main()
        found = changes(before, snapshot(stage)) if before is not None else []
        if found:
            raise GateError(
                f"{stage}: changed while the stage ran: {'; '.join(found)}. Not recording this "
                "run (the previous results stay); run `dvc repro` again to use the new values"
            )
        publish()
    except (ParamsError, DataError, GateError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except (Interrupted, KeyboardInterrupt) as e:
        print(f"interrupted: {e or 'stopped'}", file=sys.stderr)
        sys.exit(130)
    finally:
        discard()
