"""Benchmark: which stages a harmless code change reruns, file by file. For every Python file of
the library (src/visionflow) and the stages (pipeline/), a comment is appended and `dvc status
--json` is asked which stages changed; then the file is put back. Also what Python's bytecode
(`__pycache__`, written when the stages' modules are imported; with .dvcignore and without its
bytecode lines), an editor's hidden swap file and an editable install's `src/*.egg-info` do to
`dvc status`.

Works on a copy of a reproduced project (`dvc status` clean): the copy gets a git repo of its
own, so the project itself is never edited. Prints one row per package and outcome, and with
`--json` writes {file: [stages]} so that two runs (two dvc.yaml) can be compared: `--before`
reads such a file and prints both columns.

    PYTHONPATH=src .venv/bin/python bench/rerun_map.py [--project .] [--json map.json] \
        [--before old.json]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".venv", "tmp", "checkpoints", "__pycache__", "*.egg-info")
STAGES = ["check", "prepare", "sanity", "train", "evaluate", "export"]


def sh(project: Path, *command: str, env: dict[str, str | None] | None = None) -> str:
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}  # None: unset it
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"failed: {' '.join(command)}\n{done.stdout}{done.stderr}")
    return done.stdout


def stale(project: Path) -> list[str]:
    """The stages `dvc status` reports, in pipeline order."""
    found = json.loads(sh(project, "dvc", "status", "--json"))
    return [stage for stage in STAGES if stage in found]


def copy_of(project: Path, where: Path) -> Path:
    """The reproduced project with its DVC cache and results, in a git repo of its own."""
    shutil.copytree(project, where, ignore=SKIP, symlinks=True)
    sh(where, "git", "init", "-q")
    sh(where, "git", "add", "-A")
    sh(where, "git", "-c", "user.name=bench", "-c", "user.email=b@b", "commit", "-qm", "copy")
    if stale(where):
        sys.exit(f"{project}: `dvc status` is not clean; run `dvc repro` first")
    return where


def probe(project: Path, path: Path) -> list[str]:
    """The stages that a comment appended to `path` makes stale (the file is put back after)."""
    text = path.read_bytes()
    try:
        path.write_bytes(text + b"\n# a harmless change\n")
        return stale(project)
    finally:
        path.write_bytes(text)


def junk(project: Path) -> dict[str, list[str]]:
    """What bytecode (every stage's modules imported with bytecode writing on), an editor's swap
    file and an editable install's egg-info make stale; bytecode also without .dvcignore's lines."""
    found = {}
    stages = ", ".join(f"pipeline.{s}" for s in STAGES)
    code = f"import importlib; [importlib.import_module(m) for m in '{stages}'.split(', ')]"
    env = {"PYTHONPATH": f"{project / 'src'}:{project}", "PYTHONDONTWRITEBYTECODE": None}
    sh(project, sys.executable, "-c", code, env=env)
    written = len(list(project.glob("src/visionflow/**/__pycache__/*.pyc")))
    found[f"__pycache__ ({written} .pyc files, the stages imported)"] = stale(project)
    ignore = project / ".dvcignore"
    kept = ignore.read_text() if ignore.exists() else ""
    bare = [line for line in kept.splitlines() if "__pycache__" not in line and ".py" not in line]
    ignore.write_text("\n".join(bare) + "\n")
    found["__pycache__, without .dvcignore's bytecode lines"] = stale(project)
    ignore.write_text(kept)
    (project / "src/visionflow/train/.engine.py.swp").write_bytes(b"vim")
    found["src/visionflow/train/.engine.py.swp (an editor's swap file)"] = stale(project)
    egg = project / "src/visionflow.egg-info"  # what `pip install -e .` leaves beside the package
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Name: visionflow\n")
    found["src/visionflow.egg-info (pip install -e .)"] = stale(project)
    return found


def rerun_map(project: Path) -> dict[str, list[str]]:
    files = sorted(project.glob("src/visionflow/**/*.py")) + sorted(project.glob("pipeline/*.py"))
    found = {str(f.relative_to(project)): probe(project, f) for f in files}
    return found | junk(project)


def package(name: str) -> str:
    parts = Path(name).parts
    if parts[0] == "pipeline":
        return name
    if parts[0] == "src" and len(parts) > 3:
        return f"src/visionflow/{parts[2]}/"
    return "src/visionflow/*.py" if parts[0] == "src" and name.endswith(".py") else name


def rows(found: dict, before: dict | None) -> list[str]:
    """A markdown row per package and outcome (before, after): the files it holds."""
    groups: dict[tuple, list[str]] = {}
    for name, stages in found.items():
        was = ", ".join((before or {}).get(name, ["?"])) or "none"
        groups.setdefault((package(name), was, ", ".join(stages) or "none"), []).append(name)
    lines = []
    for (pkg, was, now), names in groups.items():
        grouped = pkg.endswith(("/", "*.py"))
        members = ", ".join(Path(n).name for n in names)
        what = f"{pkg} ({len(names)}: {members})" if grouped else pkg
        lines.append(f"| {what} | {was} | {now} |" if before is not None else f"| {what} | {now} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", type=Path, default=ROOT)
    parser.add_argument("--json", type=Path, help="write {file: [stages]} here")
    parser.add_argument("--before", type=Path, help="a --json file of another run, to compare")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        found = rerun_map(copy_of(args.project.resolve(), Path(tmp) / "project"))
    if args.json:
        args.json.write_text(json.dumps(found, indent=1) + "\n")
    before = json.loads(args.before.read_text()) if args.before else None
    print("| a comment appended to | " + ("before | after |" if before else "stages stale |"))
    print("|---|---|---|" if before else "|---|---|")
    print("\n".join(rows(found, before)))


if __name__ == "__main__":
    main()
