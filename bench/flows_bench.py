"""Benchmark: what a no-op run of the `reproduce` flow costs against a bare `dvc status`, and what
the watcher costs while nothing changes, side by side in one run.

Copies the project (code, params, the built-in digits) into a temporary git + DVC repository,
reproduces it once, starts a Prefect server on 127.0.0.1, then times, alternating, `--repeats`
times each:
  - `dvc status`                      a fresh process, as cron would run it
  - `python -m orchestration.reproduce`  a fresh process: Python, Prefect, one flow run, `dvc status`
  - `reproduce()` in a warm process   the flow run itself (a served or watched deployment's cost
                                      once its process is up)
and prints the medians, their ratios and the peak memory of each process. Then it puts 20,000
small files in the data folder and measures the CPU the watcher uses over `--idle` seconds.

    .venv/bin/python bench/flows_bench.py [--repeats 5] [--idle 20]
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

from project_files import FILES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], cwd: Path, env: dict) -> tuple[float, float]:
    """(seconds, peak MB) of one command, a fresh process."""
    started = time.perf_counter()
    process = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    assert os.waitstatus_to_exitcode(status) == 0, cmd
    return seconds, usage.ru_maxrss / 1024


def make_project(dest: Path, env: dict) -> None:
    for name in FILES:
        src, target = ROOT / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        copy = shutil.copytree if src.is_dir() else shutil.copy2
        copy(
            src,
            target,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if src.is_dir() else {}),
        )
    for cmd in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "init"],
        [sys.executable, "-m", "dvc", "repro", "-q"],
    ):
        subprocess.run(cmd, cwd=dest, env=env, check=True, capture_output=True)


def start_server(home: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import urllib.request

    for _ in range(240):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=1)
            return server
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the Prefect server did not start")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--idle", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=4299)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="flows-bench-"))
    venv_bin = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": f"{venv_bin}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "PREFECT_HOME": str(tmp / "home"),
        "PREFECT_API_URL": f"http://127.0.0.1:{args.port}/api",
        "DVC_NO_ANALYTICS": "1",
    }
    project = tmp / "project"
    make_project(project, env)
    server = start_server(tmp / "home", args.port)
    try:
        status_cmd = [sys.executable, "-m", "dvc", "status"]
        flow_cmd = [sys.executable, "-m", "orchestration.reproduce", str(project)]
        warm_cmd = [
            sys.executable,
            "-c",
            (
                "import sys, time; from orchestration.reproduce import reproduce; "
                "reproduce(sys.argv[1]); start = time.perf_counter(); "
                "[reproduce(sys.argv[1]) for _ in range(int(sys.argv[2]))]; "
                "print((time.perf_counter() - start) / int(sys.argv[2]))"
            ),
            str(project),
            str(args.repeats),
        ]
        run(flow_cmd, project, env)  # the server's first flow run creates the flow
        times = {"dvc status": [], "python -m orchestration.reproduce": []}
        memory = {name: 0.0 for name in times}
        for _ in range(args.repeats):
            for name, cmd in (
                ("dvc status", status_cmd),
                ("python -m orchestration.reproduce", flow_cmd),
            ):
                seconds, mb = run(cmd, project, env)
                times[name].append(seconds)
                memory[name] = max(memory[name], mb)
        warm = subprocess.run(
            warm_cmd, cwd=project, env=env, capture_output=True, text=True, check=True
        )
        status = statistics.median(times["dvc status"])
        print(f"{'contender':34s} {'median s':>9s} {'x status':>9s} {'peak MB':>8s}")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"{name:34s} {median:9.2f} {median / status:9.2f} {memory[name]:8.0f}")
        flow_s = float(warm.stdout.split()[-1])
        print(f"{'reproduce() in a warm process':34s} {flow_s:9.2f} {flow_s / status:9.2f}")

        images = project / "data/raw/bench"  # 20,000 files for the watcher to watch
        for i in range(20_000):
            folder = images / f"c{i % 10}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i}.png").write_bytes(b"x")
        watcher = subprocess.Popen(
            [*flow_cmd, "--watch"],
            cwd=project,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        watcher.stdout.readline()  # "watching ...": set up
        start_cpu = cpu_seconds(watcher.pid)
        time.sleep(args.idle)
        used = cpu_seconds(watcher.pid) - start_cpu
        watcher.terminate()
        watcher.wait()
        print(
            f"watcher on 20,000 files: {used:.2f} s CPU in {args.idle:.0f} s idle "
            f"({100 * used / args.idle:.1f}% of a core)"
        )
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
