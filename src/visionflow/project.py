"""What dvc.yaml says a run depends on, read without DVC: the watcher, the special-file check and
the stages' own mid-run guard use it. Torch-free."""

import json
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
    stages, params = pipeline(root)
    deps = {d for spec in stages.values() for d in fill(spec.get("deps", []), params)}
    outs = outs_of(stages, params)
    outside = {d for d in deps if not any(Path(d).is_relative_to(out) for out in outs)}
    return [root / d for d in sorted(outside | {"dvc.yaml", "params.yaml"})]


def pipeline(root: Path) -> tuple[dict, dict]:
    """dvc.yaml's stages and params.yaml, as read once."""
    stages = (read_yaml(root / "dvc.yaml") or {}).get("stages") or {}
    return stages, read_yaml(root / "params.yaml") or {}


def outs_of(stages: dict, params: dict) -> list[Path]:
    """Every stage's outputs as dvc.yaml lists them (a path, or {path: options}), relative."""
    paths = [
        out if isinstance(out, str) else next(iter(out))
        for spec in stages.values()
        for out in spec.get("outs", [])
    ]
    return [Path(out) for out in fill(paths, params)]


def all_outs(root: Path) -> list[Path]:
    return [root / out for out in outs_of(*pipeline(root))]


def dvc_root(start: Path) -> Path | None:
    """The DVC project `start` is in (the nearest folder above with a `.dvc` folder), or None."""
    start = start.resolve()
    return next((f for f in (start, *start.parents) if (f / ".dvc").is_dir()), None)


def cache_config(root: Path) -> tuple[Path, list[str]]:
    """DVC's cache folder and `cache.type` list, from the project's `.dvc/config` and
    `.dvc/config.local` (a global or system DVC config is not read)."""
    from configobj import ConfigObj  # DVC's own config reader

    folder, types = root / ".dvc" / "cache", []
    for name in ("config", "config.local"):
        section = ConfigObj(str(root / ".dvc" / name)).get("cache", {})
        if "dir" in section:
            folder = (root / ".dvc" / section["dir"]).resolve()  # relative to .dvc/
        if "type" in section:
            value = section["type"]
            types = value if isinstance(value, list) else [t.strip() for t in value.split(",")]
    return folder, types


def cache_object(cache: Path, md5: str) -> Path:
    return cache / "files" / "md5" / md5[:2] / md5[2:]


def recorded(path: Path, md5: str) -> bool:
    """Whether dvc.lock records the file `path` (or the folder output holding it) with this
    md5, and DVC's cache holds that object: DVC has recorded it, and `dvc checkout` restores it."""
    root = dvc_root(path.parent if path.parent.exists() else Path.cwd())
    lock = root / "dvc.lock" if root else None
    if lock is None or not lock.exists():
        return False
    relative, cache = path.resolve().relative_to(root), cache_config(root)[0]
    outs = [
        o for stage in (read_yaml(lock).get("stages") or {}).values() for o in stage.get("outs", [])
    ]
    for out in outs:
        if relative == Path(out["path"]):
            return out.get("md5") == md5 and cache_object(cache, md5).exists()
        if relative.is_relative_to(out["path"]) and str(out.get("md5", "")).endswith(".dir"):
            listing = cache_object(cache, out["md5"])
            if not listing.exists():
                return False
            inside = str(relative.relative_to(out["path"]))
            entries = json.loads(listing.read_text())
            found = any(e.get("relpath") == inside and e.get("md5") == md5 for e in entries)
            return found and cache_object(cache, md5).exists()
    return False


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
