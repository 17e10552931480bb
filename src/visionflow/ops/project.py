"""What dvc.yaml says a run depends on, read without DVC: the watcher, the pre-check before a run
(`preflight`) and the stages' own mid-run guard use it. Torch-free."""

import json
import os
import re
import stat
from pathlib import Path

from visionflow.data.files import Stat
from visionflow.params import ParamsError, overlap, read_file, read_yaml, refuse_link, stage_outputs


def lookup(tree: dict, key: str):
    """tree["a"]["b"] for key "a.b"; None where a part is missing."""
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def param_changes(keys: list[str], before: dict, after: dict) -> list[str]:
    """ "train.lr: 0.001 -> 0.003" for each value under `keys` (a stage's params in dvc.yaml: a
    key, or a section listed whole) that differs between two readings of params.yaml, key by key
    inside a section."""
    found = []
    for key in keys:
        old, new = lookup(before, key), lookup(after, key)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            inner = [f"{key}.{name}" for name in sorted(old.keys() | new.keys())]
            found += param_changes(inner, before, after)
        else:
            found.append(f"{key}: {old!r} -> {new!r}")
    return found


def fill(deps: list[str], params: dict) -> list[str]:
    """Deps as dvc.yaml lists them, with `${prepare.path}` and the like filled in from params."""
    return [re.sub(r"\$\{([^}]+)\}", lambda m: str(lookup(params, m[1])), d) for d in deps]


def all_deps(root: Path) -> list[Path]:
    """What a change to from outside reruns a stage: every dep of every stage that no stage
    writes (data/prepared, say, is prepare's output), plus dvc.yaml and params.yaml."""
    return deps_from_outside(root, *pipeline(root))


def deps_from_outside(root: Path, stages: dict, params: dict) -> list[Path]:
    """`all_deps` of dvc.yaml's stages and params.yaml, as read."""
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
    return [Path(out) for out in fill([out for _, out in stage_outputs(stages)], params)]


def all_outs(root: Path) -> list[Path]:
    return [root / out for out in outs_of(*pipeline(root))]


def dvc_root(start: Path) -> Path | None:
    """The DVC project `start` is in (the nearest folder above with a `.dvc` folder), or None."""
    start = start.resolve()
    return next((f for f in (start, *start.parents) if (f / ".dvc").is_dir()), None)


def hashes_dvc_knew(stats: dict[str, Stat]) -> tuple[dict[str, str], str]:
    """({path: md5} of each file DVC's state database holds a hash for at exactly its given
    stat (inode, mtime, size), why DVC knows nothing): what DVC hashed the file to when it last
    saw that stat (`dvc repro` hashes a stage's deps before running it). A path absent from the
    result DVC never hashed at that stat; outside a DVC project nothing is known."""
    root = dvc_root(Path.cwd())
    if root is None or not stats:
        return {}, "outside a DVC project"
    from dvc.repo import Repo  # imported on use: only a file whose stat changed mid-run needs it

    known = {}
    try:
        with Repo(str(root)) as repo:
            for path, s in stats.items():
                info = {"ino": s.inode, "mtime": s.mtime, "size": s.size, "type": "file"}
                _, hash_info = repo.state.get(os.path.abspath(path), repo.fs, info=info)
                if hash_info is not None and hash_info.name == "md5":
                    known[path] = hash_info.value
    except Exception as e:  # DVC's own error (a broken config, a locked state database): said
        return known, f"DVC's state could not be read: {type(e).__name__}: {e}"
    return known, "`dvc repro --force` hashes no dep first"


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


def locked_file(path: Path) -> tuple[Path, str, str, str | None] | None:
    """What dvc.lock records of the file `path` (an output itself, or inside a folder output):
    (DVC's cache folder, the stage, the output as dvc.lock names it, the file's md5, None when
    the folder's listing is not in the cache); None when no stage records it."""
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    path = existing.resolve() / path.relative_to(existing)  # as dvc_root resolves the root
    root = dvc_root(existing)
    lock = root / "dvc.lock" if root else None
    if lock is None or not lock.is_file() or not path.is_relative_to(root):
        return None
    try:
        stages = read_yaml(lock).get("stages") or {}
    except Exception:  # an unreadable dvc.lock records nothing we can use
        return None
    relative, cache = path.relative_to(root), cache_config(root)[0]
    for stage, entry in stages.items():
        for out in entry.get("outs", []):
            if relative == Path(out["path"]):
                return cache, stage, out["path"], out.get("md5")
            if relative.is_relative_to(out["path"]):
                listing = cache_object(cache, str(out.get("md5", "")))
                inside = str(relative.relative_to(out["path"]))
                entries = json.loads(listing.read_text()) if listing.is_file() else []
                md5 = next((e.get("md5") for e in entries if e.get("relpath") == inside), None)
                return cache, stage, out["path"], md5
    return None


def in_cache(found: tuple[Path, str, str, str | None]) -> bool:
    cache, _, _, md5 = found
    return bool(md5) and cache_object(cache, md5).exists()


def recorded(path: Path, md5: str) -> bool:
    """Whether dvc.lock records the file `path` (or the folder output holding it) with this
    md5, and DVC's cache holds that object: DVC has recorded it, and `dvc checkout` restores it."""
    found = locked_file(path)
    return found is not None and found[3] == md5 and in_cache(found)


KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a device",
    stat.S_IFBLK: "a device",
}


def dvc_ignores(path: Path) -> bool:
    """What .dvcignore keeps out of the code folders stages depend on: Python's bytecode, hidden
    files (editors' swap and lock files) and emacs's backup (`x.py~`) and auto-save (`#x.py#`)
    files beside a package's modules."""
    name = path.name
    auto_save = len(name) > 1 and name.startswith("#") and name.endswith("#")
    editors = name.startswith(".") or name.endswith("~") or auto_save
    return (
        "__pycache__" in path.parts
        or path.suffix in (".pyc", ".pyo")
        or (editors and (path.parent / "__init__.py").exists())
    )


def special_files(paths: list[Path]) -> list[str]:
    """A line for each file at or under `paths` (links followed) that DVC cannot hash, naming it
    and what to do: a FIFO, socket or device (DVC would wait forever reading it) or a link to
    nothing (DVC stops with "unexpected error", naming no stage). Regular files are told apart
    by the directory entry, without a stat each: 20,000 images take a few tens of milliseconds."""
    found, folders = [], []

    def check(path: Path) -> None:
        try:
            kind = KINDS.get(stat.S_IFMT(path.stat().st_mode))
        except OSError:  # gone since, or a link to nothing (or to itself)
            if path.is_symlink():
                found.append(
                    f"{path} is a link to {os.readlink(path)}, which does not exist: DVC cannot "
                    "hash it; remove the link, or put its target back"
                )
            return
        if kind:
            found.append(f"{path} is {kind}: DVC would hang reading it; remove it")

    for path in paths:
        folders.append(path) if path.is_dir() else check(path)
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if dvc_ignores(Path(entry.path)):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    folders.append(Path(entry.path))
                elif not entry.is_file(follow_symlinks=False):  # a link, or a special file
                    check(Path(entry.path))
    return sorted(found)


def lock_problem(root: Path) -> str | None:
    """The line for a dvc.lock DVC cannot read (empty, cut short, not a lock file), which DVC
    reports as "validation failed / required key not provided"; None when there is none yet."""
    lock = root / "dvc.lock"
    if not lock.exists():
        return None  # before the first run
    fix = (
        "`git checkout dvc.lock` brings back the committed one, or delete it and DVC reruns "
        "every stage"
    )
    try:
        content = read_file(lock)
    except ParamsError as e:
        return f"{e}: {fix}"
    if not (isinstance(content, dict) and isinstance(content.get("stages"), dict)):
        return f"{lock} is empty or not a DVC lock file (it records no stages): {fix}"
    import voluptuous
    from dvc.schema import COMPILED_LOCKFILE_SCHEMA  # DVC's own check (imported only here)

    try:  # a file cut inside an entry still reads as YAML; DVC refuses it, then every restore
        COMPILED_LOCKFILE_SCHEMA(content)
    except voluptuous.Invalid as e:
        where = " > ".join(map(str, e.path))
        return f"{lock} is damaged (cut short or edited: {where}: {e.msg}): {fix}"
    return None


def preflight(root: Path) -> list[str]:
    """What would stop `dvc repro` or `dvc status`, or make them hang, or answer in words that
    name nothing, found before DVC runs: each problem one line naming the file and what to do.
    dvc.yaml and params.yaml must be files (not links) that read; prepare.path must not overlap
    an output; no dep may be a FIFO, a device or a link to nothing; dvc.lock must read."""
    try:
        for name in ("dvc.yaml", "params.yaml"):
            refuse_link(root / name)
        spec, params = read_file(root / "dvc.yaml"), read_file(root / "params.yaml")
    except ParamsError as e:
        return [str(e)]
    stages = spec.get("stages") if isinstance(spec, dict) else None
    stages = stages if isinstance(stages, dict) else {}  # DVC names what is wrong in dvc.yaml,
    params = params if isinstance(params, dict) else {}  # the check stage in params.yaml
    data = lookup(params, "prepare.path")
    crossed = overlap(root, data, stage_outputs(stages)) if isinstance(data, str) else None
    problems = [f"{root / 'params.yaml'}: {crossed}" if crossed else missing_data(root, data)]
    problems += special_files(deps_from_outside(root, stages, params))
    problems.append(lock_problem(root))
    return [line for line in problems if line]


def missing_data(root: Path, data) -> str | None:
    """The line for a prepare.path that is not there (a teammate's clone without the images),
    which DVC reports as "[Errno 2] No such file or directory" and nothing to do about it."""
    if not isinstance(data, str) or not data or os.path.lexists(root / data):
        return None
    tilde = " (`~` is not expanded: write the whole path)" if data.startswith("~") else ""
    return (
        f"{root / 'params.yaml'}: prepare.path {data} does not exist{tilde}, and stage prepare "
        f"depends on it: put the images there (`dvc pull {data}` if DVC tracks them, `git "
        f"checkout -- {data}` if git does), or point prepare.path at the folder that holds them"
    )


def missing_output(path: Path, what: str = "file") -> str:
    """One line for a pipeline output missing from the workspace, naming it and the ways to get
    it back: `dvc checkout` when DVC's cache has it, else `dvc pull` from a remote that has it
    or `dvc repro` of its stage."""
    found = locked_file(path)
    if found is None:
        return f"no {what} at {path}: `dvc repro` makes it (or name another with --model)"
    _, stage, out, _ = found
    if in_cache(found):
        return f"{path} is missing, but DVC's cache has it: `dvc checkout {stage}` puts it back"
    return (
        f"{path} is missing, and DVC's cache lacks it (dvc.lock's stage {stage} records {out}; "
        f"a `dvc pull` that named a missing hash means the remote lacks it too): `dvc pull "
        f"{stage}` from a remote that has it (`-r NAME`), or `dvc repro {stage}` to make it again"
    )


def module_file(root: Path, name: str) -> Path | None:
    """The project file of module `name` (pipeline.x, visionflow.x.y), or None if it is not ours."""
    top, *rest = name.split(".")
    base = {"pipeline": root / "pipeline", "visionflow": root / "src/visionflow"}.get(top)
    if base is None:
        return None
    path = base.joinpath(*rest)
    if path.is_dir():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def stage_modules(root: Path, stage: str) -> list[str]:
    """Every project file that `python -m pipeline.<stage>` can load, relative to `root`: its
    imports, theirs, and so on, imports inside functions too (read from the source, so a lazy
    import counts), and each package's __init__ on the way. These are the stage's code deps in
    dvc.yaml, no more (a change elsewhere reruns nothing) and no less."""
    import ast

    seen, todo = set(), [f"pipeline.{stage}"]
    while todo:
        parts = todo.pop().split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c loads a and a.b first
            path = module_file(root, ".".join(parts[:i]))
            if path is None or path in seen:
                continue
            seen.add(path)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    todo += [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    todo += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return sorted(str(p.relative_to(root)) for p in seen)
