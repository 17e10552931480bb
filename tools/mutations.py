"""Break each promise on purpose, one line at a time, and see which test fails (issue #56).

Clones the committed project (HEAD) into a temporary folder; for each break below, changes one
line there, runs the break's tests with pytest (PYTHONPATH at the clone's src/, the checkout's
venv), puts the line back, and prints which tests failed. A break that no test catches is a
promise nothing checks: the table in docs/tests.md ("Stop 55") comes from this script.

    .venv/bin/python tools/mutations.py [NAME ...] [--list]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINING = "src/visionflow/train/training.py"
RESUME = "src/visionflow/fit/resume.py"
SPREAD = "orchestration/spread.py"
RUN_TESTS = ["tests/test_run.py"]
PROGRESS = 'return Progress(state["history"], state["best"]'
# name: (file, the line's text, what replaces it, the tests to run)
BREAKS = {
    "scheduler not restored": (
        TRAINING, 'self.scheduler.load_state_dict(state["scheduler"])', "pass", RUN_TESTS
    ),
    "optimizer not restored": (
        TRAINING, 'self.optimizer.load_state_dict(state["optimizer"])', "pass", RUN_TESTS
    ),
    "torch generator not restored": (
        TRAINING, 'torch.set_rng_state(rng["torch"].cpu())', "pass", RUN_TESTS
    ),
    "batch order not restored": (
        TRAINING, 'self.shuffle.set_state(rng["shuffle"].cpu())', "pass", RUN_TESTS
    ),
    "augmentation generator not restored": (
        TRAINING, 'self.augment_rng.set_state(rng["augment"].cpu())', "pass", RUN_TESTS
    ),
    "GradScaler not restored": (
        TRAINING, 'self.scaler.load_state_dict(state["scaler"])', "pass", RUN_TESTS
    ),
    "weights not restored": (
        TRAINING, 'self.model.load_state_dict(state["model"])', "pass", RUN_TESTS
    ),
    "health monitor not restored": (
        RESUME, 'monitor.load_state_dict(state["health"])', "pass", RUN_TESTS
    ),
    "epoch records lost": (RESUME, PROGRESS, 'return Progress([], state["best"]', RUN_TESTS),
    "best epoch lost": (
        RESUME, PROGRESS, 'return Progress(state["history"], {"accuracy": -1.0, "epoch": 0}',
        RUN_TESTS,
    ),
    "early-stop count lost": (
        RESUME, 'state["epoch"] + 1, state["stale"])', 'state["epoch"] + 1, 0)', RUN_TESTS
    ),
    "a finished run never extended": (RESUME, "if epochs > budget:", "if False:", RUN_TESTS),
    "the commit on any remote will do": (
        SPREAD, '"--contains", head, "--list", f"{remote}/*"', '"--contains", head',
        ["tests/test_orchestration.py", "-m", "not slow"],
    ),
}  # fmt: skip


def failed_tests(clone: Path, tests: list[str]) -> tuple[int, list[str]]:
    env = {**os.environ, "PYTHONPATH": f"{clone / 'src'}{os.pathsep}{clone}"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*command, "-n", "2", "-rf", *tests], cwd=clone, env=env, capture_output=True, text=True
    )
    return result.returncode, sorted(set(re.findall(r"^FAILED (\S+)", result.stdout, re.M)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="the breaks to try (default: all)")
    parser.add_argument("--list", action="store_true", help="list the breaks and stop")
    args = parser.parse_args()
    if args.list:
        print("\n".join(BREAKS))
        return
    unknown = set(args.names) - set(BREAKS)
    if unknown:
        parser.error(f"no such break: {', '.join(sorted(unknown))} (--list names them)")
    with tempfile.TemporaryDirectory(prefix="visionflow-mutations-") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        for name in args.names or BREAKS:
            path, line, broken, tests = BREAKS[name]
            file = clone / path
            text = file.read_text()
            if text.count(line) != 1:
                sys.exit(f"{name}: {path} holds {text.count(line)} copies of {line!r}: update it")
            file.write_text(text.replace(line, broken))
            try:
                code, failed = failed_tests(clone, tests)
            finally:
                file.write_text(text)
            verdict = (
                f"{len(failed)} failed" if failed else "CAUGHT BY NO TEST" if not code else "error"
            )
            print(f"## {name}: {verdict}", *(f"   {t}" for t in failed), sep="\n", flush=True)


if __name__ == "__main__":
    main()
