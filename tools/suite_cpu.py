"""Benchmark: where the test suite's CPU goes, by process and by test.

Runs pytest (default `-n 3`, as `make test`) with a hook in this venv's site-packages that makes
every Python process write, at its exit, its own CPU seconds (user + sys), its command line and
the test it ran for (PYTEST_CURRENT_TEST, which subprocesses inherit). Then prints the CPU by
kind of process (a stage, a `dvc` subcommand, a `visionflow` subcommand, Prefect, the pytest
workers), by test file and the costliest tests. The hook is removed when the run ends.

Not counted: processes that end by a signal or `os._exit` (killed stages, multiprocessing
children) and the Prefect server (a daemon): the total printed is below `time`'s.

    .venv/bin/python tools/suite_cpu.py [PYTEST ARGS...]
"""

import collections
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HOOK = """\
import atexit, os, resource, sys
def _log(folder={folder!r}):
    try:
        r = resource.getrusage(resource.RUSAGE_SELF)
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" (")[0]
        argv = " ".join(sys.argv).replace("\\t", " ").replace("\\n", " ")
        with open(os.path.join(folder, str(os.getpid())), "a") as f:
            f.write(f"{{r.ru_utime + r.ru_stime:.2f}}\\t{{test}}\\t{{argv}}\\n")
    except Exception:
        pass
atexit.register(_log)
"""

STAGES = ("check", "prepare", "sanity", "train", "evaluate", "export")


def kind(argv: str) -> str:
    words = argv.split()
    for stage in STAGES:  # first: a test's project lives under pytest's folder (/tmp/pytest-of-…)
        if words and words[0].endswith(f"pipeline/{stage}.py"):
            return f"stage {stage}"
    if not words or words[0] == "-c" or words[0].endswith(("/pytest", "pytest/__main__.py")):
        return "pytest and its workers (tests run in-process)"
    if "orchestration/" in words[0] or words[0].endswith(("pipeline/flows.py", "experiments.py")):
        return "orchestration (the flows)"
    if words[0].endswith(("/dvc", "dvc/__main__.py")):
        return f"dvc {words[1] if len(words) > 1 else ''}"
    if words[0].endswith(("/visionflow", "visionflow/cli.py")):
        return f"visionflow {words[1] if len(words) > 1 else ''}"
    if "prefect" in argv:
        return "prefect " + " ".join(w for w in words[1:3] if not w.startswith("-"))
    return Path(words[0]).name


def table(title: str, costs: collections.Counter, counts: collections.Counter, n: int) -> None:
    print(f"\n{title}\n{'CPU s':>8} {'procs':>6}")
    for name, cpu in costs.most_common(n):
        print(f"{cpu:8.1f} {counts[name]:6d}  {name}")


def main() -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    folder = Path(tempfile.mkdtemp(prefix="visionflow-cpu-"))
    module, pth = site / "visionflow_cpu_hook.py", site / "visionflow_cpu_hook.pth"
    module.write_text(HOOK.format(folder=str(folder)))
    pth.write_text("import visionflow_cpu_hook\n")
    args = sys.argv[1:] or ["-n", "3"]
    start = time.monotonic()
    try:
        code = subprocess.run([sys.executable, "-m", "pytest", "-q", *args]).returncode
    finally:
        pth.unlink()
        module.unlink()
    wall = time.monotonic() - start
    rows = []
    for log in folder.iterdir():
        for line in log.read_text().splitlines():
            cpu, test, argv = (line.split("\t", 2) + ["", ""])[:3]
            if re.fullmatch(r"\d+\.\d+", cpu):
                rows.append((float(cpu), test, argv))
    by_kind, kinds, by_file, files, by_test, tests = (collections.Counter() for _ in range(6))
    for cpu, test, argv in rows:
        for costs, counts, key in (
            (by_kind, kinds, kind(argv)),
            (by_file, files, test.split("::")[0] or "(no test: fixtures, workers)"),
            (by_test, tests, test or "(no test)"),
        ):
            costs[key] += cpu
            counts[key] += 1
    total = sum(cpu for cpu, _, _ in rows)
    print(f"\npytest exit {code}, {wall:.0f} s wall; {total:.0f} s of CPU in {len(rows)} processes")
    table("by kind of process", by_kind, kinds, 25)
    table("by test file (subprocesses and in-process work)", by_file, files, 25)
    table("costliest tests", by_test, tests, 20)


if __name__ == "__main__":
    main()
