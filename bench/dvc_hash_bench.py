"""Benchmark: what detecting a change in a 20,000-file image folder costs, side by side in one
run: `dvc status` and `dvc repro` on the folder unchanged and with 10 new files, and the stage's
own mid-run guard (pipeline/__init__.py) against the guard it replaced (an md5 of every file).

Builds a temporary git + DVC project from this one's dvc.yaml, params.yaml, pipeline/ and src/,
with an image folder of `--files` distinct JPEGs (320x240, bench/photos.py) in data/raw, and
reproduces it once (not timed). Then, `--repeats` times each (the median is printed):
  - unchanged:  `dvc status`, then `dvc repro` (nothing to run)
  - 10 new:     10 more files; `dvc status`, then `dvc repro -s prepare` (prepare reruns and
                decodes all the files; its guard runs inside), then the 10 are removed and the
                project reproduced back (not timed)
  - the guard:  its start and end stat of every file, in this process; beside it, the md5 of
                every file that the guard before #26 took at each stage start
DVC keeps its own hashes by inode, mtime and size, so neither `dvc status` nor the guard reads an
unchanged file again.

    .venv/bin/python bench/dvc_hash_bench.py [--files 20000] [--repeats 3]
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from photos import generate

from visionflow.data.files import file_hash, file_stats

ROOT = Path(__file__).resolve().parents[1]


def sh(project: Path, *command: str) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"failed: {' '.join(command)}\n{done.stdout}{done.stderr}")
    return done.stdout


def timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def md5_all(folder: Path) -> list[str]:
    return [file_hash(p, "md5") for p in sorted(folder.rglob("*")) if p.is_file()]


def make_project(where: Path, files: int) -> Path:
    where.mkdir()
    for name in ("dvc.yaml", ".dvcignore"):
        shutil.copy(ROOT / name, where / name)
    for name in ("pipeline", "src"):
        shutil.copytree(ROOT / name, where / name, ignore=shutil.ignore_patterns("__pycache__"))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["prepare"] |= {"source": "imagefolder", "path": "data/raw", "image_size": 16}
    params["train"] |= {"epochs": 1}
    (where / "params.yaml").write_text(yaml.safe_dump(params))
    (where / "data/pretrained").mkdir(parents=True)
    (where / "data/pretrained/.gitkeep").touch()
    generate(where / "data/raw", files, size=(320, 240))
    sh(where, "git", "init", "-q")
    sh(where, "dvc", "init", "-q")
    sh(where, "git", "add", "-A")
    sh(where, "git", "-c", "user.name=bench", "-c", "user.email=b@b", "commit", "-qm", "bench")
    sh(where, "dvc", "repro")
    return where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)

    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        project = make_project(Path(tmp) / "project", args.files)
        raw = project / "data/raw"
        extra = Path(tmp) / "extra"
        new, _ = generate(extra, 10, size=(320, 240))
        for _ in range(args.repeats):
            add("unchanged: dvc status", timed(lambda: sh(project, "dvc", "status")))
            add("unchanged: dvc repro (nothing to run)", timed(lambda: sh(project, "dvc", "repro")))
            added = [raw / p.parent.name / f"new-{p.name}" for p in new]
            for source, dest in zip(new, added, strict=True):
                shutil.copy(source, dest)
            status = sh(project, "dvc", "status")
            assert "modified" in status, status
            add("10 new: dvc status", timed(lambda: sh(project, "dvc", "status")))
            add(
                "10 new: dvc repro -s prepare (decodes every file)",
                timed(lambda: sh(project, "dvc", "repro", "-s", "prepare")),
            )
            for path in added:
                path.unlink()
            sh(project, "dvc", "repro")  # back to the committed state
            guard = timed(lambda: file_stats([raw])) + timed(lambda: file_stats([raw]))
            add("guard: a stat of every file, start + end", guard)
            add("old guard: md5 of every file", timed(lambda: md5_all(raw)))
        size = sum(p.stat().st_size for p in raw.rglob("*") if p.is_file()) / 2**20
    print(f"{args.files} JPEGs of 320x240 in data/raw ({size:.0f} MB), median of {args.repeats}")
    print("| what | seconds |")
    print("|---|---|")
    for name, seconds in rows.items():
        print(f"| {name} | {statistics.median(seconds):.2f} |")


if __name__ == "__main__":
    main()
