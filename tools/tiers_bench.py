"""Benchmark: the two test tiers against the frozen yardstick, in one run on the same machine
(issue #47: `make test-fast` within 3x, `make test` within 30x one `dvc repro --force` of
commit caa9cb7; the ratios are what holds across machines, the seconds are this one's).

Clones the committed project (HEAD) into a temporary folder and adds a worktree of the clone at
the yardstick's commit. Both use an existing venv (`--venv`, default the checkout's .venv, set
up by `make setup`) with PYTHONPATH at their own src/: only the code differs, not the packages,
and nothing is installed. Then it times in turn:
  - the yardstick        `dvc repro --force` of caa9cb7 (its default pipeline)
  - `make test-fast`     its pytest command, read from the Makefile (`make -n`), in the clone
  - `make test`          the same, with `--full`
  - the yardstick again  (a change in the machine's load shows as two different yardsticks)
and prints each, the tiers' ratios to the yardstick's mean and their budgets. Record the
numbers, the date and what else ran on the machine in docs/tests.md. `--busy N` keeps N busy
loops (a core each) running the whole time: #47's "five runs in a row beside two busy loops" is
`--full-only --repeat 5 --busy 2` (a failure stops the benchmark, naming its log).

    .venv/bin/python tools/tiers_bench.py [--full | --full-only] [--repeat N] [--busy N]
        [--venv PATH] [--keep]
"""

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
YARDSTICK = "caa9cb7"  # the frozen yardstick (issues #38, #47): one full dvc repro of this commit
BUDGETS = {"test-fast": 3, "test": 30}  # at most this many yardsticks (issue #47)


def timed(cmd: str, cwd: Path, env: dict) -> tuple[float, str, Path]:
    """Seconds `cmd` (a shell line) took, and its output, the whole of which is kept in a log
    file (pytest's seed and slowest tests); a failure stops the benchmark with its tail."""
    start = time.monotonic()
    result = subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True)
    took = time.monotonic() - start
    log = Path(tempfile.mkstemp(prefix="visionflow-tiers-", suffix=".log")[1])
    log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"{cmd} failed; its whole output is in {log}:\n{result.stdout[-3000:]}")
    return took, result.stdout, log


def pytest_of(target: str, clone: Path) -> str:
    """The pytest command `make TARGET` runs, as the Makefile has it (setup left out: the venv
    is there already, and `make setup` would install the clone into it)."""
    lines = subprocess.run(
        ["make", "-s", "-n", "-o", "setup", target],
        cwd=clone,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    (command,) = [line for line in lines if " -m pytest" in line]
    return command


def prepare(folder: Path, venv: Path) -> tuple[Path, Path, dict]:
    """The clone of HEAD and the yardstick's worktree, each with the venv as its .venv; the
    environment both run in (the venv first on PATH, for the stages' `python -m ...`)."""
    clone, old = folder / "clone", folder / "yardstick"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "worktree", "add", "-q", str(old), YARDSTICK], cwd=clone, check=True)
    for checkout in (clone, old):
        (checkout / ".venv").symlink_to(venv)
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    return clone, old, env


def measure(folder: Path, venv: Path, targets: list[str], repeat: int) -> None:
    clone, old, env = prepare(folder, venv)
    old_env = {**env, "PYTHONPATH": str(old / "src")}
    new_env = {**env, "PYTHONPATH": f"{clone / 'src'}{os.pathsep}{clone}"}
    repro = f"{shlex.quote(str(venv / 'bin/dvc'))} repro --force"
    sticks, tiers = [], {}
    took, *_ = timed(repro, old, old_env)
    sticks.append(took)
    print(f"yardstick, dvc repro --force of {YARDSTICK}: {took:.0f} s", flush=True)
    for _ in range(repeat):
        for target in targets:
            command = pytest_of(target, clone)
            took, out, log = timed(command, clone, new_env)
            tiers.setdefault(target, []).append(took)
            print(
                f"make {target} ({command}): {took:.0f} s; {out.splitlines()[-1]}; {log}",
                flush=True,
            )
    took, *_ = timed(repro, old, old_env)
    sticks.append(took)
    print(f"yardstick again: {took:.0f} s", flush=True)
    stick = sum(sticks) / len(sticks)
    for target, seconds in tiers.items():
        ratios = ", ".join(f"{s / stick:.1f}x" for s in seconds)
        print(f"make {target}: {ratios} the yardstick ({stick:.0f} s); budget {BUDGETS[target]}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="time `make test` too")
    parser.add_argument("--full-only", action="store_true", help="time `make test` alone")
    parser.add_argument("--repeat", type=int, default=1, help="time each tier this many times")
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside it, a core each")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv", help="the venv to use")
    parser.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    args = parser.parse_args()
    venv = args.venv.absolute()
    if not (venv / "bin" / "dvc").exists():
        raise SystemExit(f"no venv with dvc at {venv}: run `make setup`, or pass --venv")
    folder = Path(tempfile.mkdtemp(prefix="visionflow-tiers-"))
    targets = ["test"] if args.full_only else ["test-fast", "test"] if args.full else ["test-fast"]
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"  # ends with us
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(args.busy)]
    try:
        measure(folder, venv, targets, args.repeat)
    finally:
        for loop in busy:
            loop.kill()
        if args.keep:
            print(f"clone kept: {folder / 'clone'}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
