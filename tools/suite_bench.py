"""Benchmark: the whole test suite against one full `dvc repro` of the default pipeline, in one run
on the same machine (the ratio is what holds across machines; the seconds are this one's).

Clones the committed project into a temporary folder, sets it up (`make setup`, not timed), then
times in turn:
  - the yardstick           `dvc repro --force` of commit caa9cb7 (the pipeline as it was), fixed
                            so that the budget does not tighten as the product gets faster
  - `dvc repro --force`     the default pipeline as it is now, every stage, in the clone
  - `make test`             the suite as CI runs it, with pytest's 15 slowest tests
  - the yardstick again     (a change in the machine's load shows as two different yardsticks)
and prints them, the suite's ratio to the yardstick (budget: 30x, issue #47), and the slowest
tests (the table in docs/tests.md). The yardstick runs in a worktree of the clone at caa9cb7 with
the clone's .venv (PYTHONPATH at the worktree's own src/): only the code differs, not the
packages. tools/tiers_bench.py times both tiers against it with an existing venv.

    .venv/bin/python tools/suite_bench.py [--keep]
"""

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
YARDSTICK = "caa9cb7"  # the frozen yardstick (issue #38): one full dvc repro of this commit


def timed(cmd: list[str], cwd: Path, env: dict) -> tuple[float, str]:
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    took = time.monotonic() - start
    if result.returncode != 0:
        log = Path(tempfile.mkstemp(prefix="visionflow-suite-", suffix=".log")[1])
        log.write_text(result.stdout + result.stderr)
        raise SystemExit(
            f"{' '.join(cmd)} failed; its whole output is in {log}:\n{result.stdout[-3000:]}"
        )
    return took, result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="visionflow-suite-"))
    try:
        measure(folder / "clone")
    finally:
        if args.keep:
            print(f"clone kept: {folder / 'clone'}")
        else:  # a clone with its venv is 6 GB
            shutil.rmtree(folder, ignore_errors=True)


def measure(clone: Path) -> None:
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    subprocess.run(["make", "setup"], cwd=clone, check=True, capture_output=True)
    venv = clone / ".venv/bin"
    env = {**os.environ, "PATH": f"{venv}{os.pathsep}{os.environ['PATH']}"}
    old = clone.with_name("yardstick")
    subprocess.run(["git", "worktree", "add", "-q", str(old), YARDSTICK], cwd=clone, check=True)
    old_env = {**env, "PYTHONPATH": str(old / "src")}
    before, _ = timed([str(venv / "dvc"), "repro", "--force"], old, old_env)
    print(f"yardstick, dvc repro --force of {YARDSTICK}: {before:.0f} s", flush=True)
    repro_s, _ = timed([str(venv / "dvc"), "repro", "--force"], clone, env)
    print(f"dvc repro --force (default params):    {repro_s:.0f} s", flush=True)
    suite_s, out = timed(["make", "test"], clone, env)  # it lists the 15 slowest tests
    print(f"make test:                             {suite_s:.0f} s", flush=True)
    after, _ = timed([str(venv / "dvc"), "repro", "--force"], old, old_env)
    print(f"yardstick again:                       {after:.0f} s")
    stick = (before + after) / 2
    print(
        f"ratio:                                 {suite_s / stick:.1f}x the yardstick (budget 30x)"
    )
    print(f"                                       {suite_s / repro_s:.1f}x one full dvc repro now")
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "slowest 15 durations" in line)
    print("\n".join(lines[start : start + 16]))
    print(lines[-1])


if __name__ == "__main__":
    main()
