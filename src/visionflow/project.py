"""What dvc.yaml says a run depends on, read without DVC: the watcher, the special-file check and
the stages' own mid-run guard use it. Torch-free."""

import os
import re
import stat
from pathlib import Path

from visionflow.params import read_yaml


def lookup(tree: dict, key: str):
    """tree["a"]["b"] for key "a.b"; None where a part is missing."""
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def fill(deps: list[str], params: dict) -> list[str]:
    """Deps as dvc.yaml lists them, with `${prepare.path}` and the like filled in from params."""
    return [re.sub(r"\$\{([^}]+)\}", lambda m: str(lookup(params, m[1])), d) for d in deps]


def all_deps(root: Path) -> list[Path]:
    """What a change to from outside reruns a stage: every dep of every stage that no stage
    writes (data/prepared, say, is prepare's output), plus dvc.yaml and params.yaml."""
    stages = (read_yaml(root / "dvc.yaml") or {}).get("stages") or {}
    params = read_yaml(root / "params.yaml") or {}
    deps = {d for spec in stages.values() for d in fill(spec.get("deps", []), params)}
    outs = [
        Path(out if isinstance(out, str) else next(iter(out)))  # a path, or {path: options}
        for spec in stages.values()
        for out in spec.get("outs", [])
    ]
    outside = {d for d in deps if not any(Path(d).is_relative_to(out) for out in outs)}
    return [root / d for d in sorted(outside | {"dvc.yaml", "params.yaml"})]


KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a device",
    stat.S_IFBLK: "a device",
}


def special_files(paths: list[Path]) -> list[str]:
    """ "<path> is a FIFO" for each FIFO, socket or device at or under `paths` (links followed):
    DVC would wait forever reading one while hashing. Regular files are told apart by the
    directory entry, without a stat each, so 20,000 images take a few tens of milliseconds."""
    found, folders = [], []

    def check(path: Path) -> None:
        try:
            kind = KINDS.get(stat.S_IFMT(path.stat().st_mode))
        except OSError:  # a dangling link, or gone since: DVC reports those itself
            return
        if kind:
            found.append(f"{path} is {kind}")

    for path in paths:
        folders.append(path) if path.is_dir() else check(path)
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(Path(entry.path))
                elif not entry.is_file(follow_symlinks=False):  # a link, or a special file
                    check(Path(entry.path))
    return sorted(found)
