"""Benchmark: `visionflow serve` under 1, 4 and 16 concurrent HTTP clients, side by side with
`visionflow predict` over the same photos, in one run (the #27 gate: at 16 clients serve reaches
at least 0.7x predict's images/s).

Generates `--unique` camera-size JPEGs (1024x768, bench/photos.py) and a folder of `--images`
hard links to them. Then, in `--rounds` rounds whose order rotates:

- predict: `visionflow predict --json --model M FOLDER > /dev/null` as a fresh process, timed
  from start to exit (Python, ONNX Runtime and the model load included, as a user pays them);
  images/s = images / that wall time.
- serve at C clients: one `visionflow serve` process (started once, warmed with 20 requests),
  and this process as the client: httpx.AsyncClient with C connections, C workers each posting
  the next photo's bytes (read into memory first) as image/jpeg until all `--images` are sent;
  images/s = images / wall time of the whole load; p50/p99 of each request's latency. The
  client runs on the same cores as the server: its CPU is reported beside the server's (the
  server's includes its decoding processes).

    .venv/bin/python bench/serve_bench.py [--images 1000] [--unique 200] [--rounds 3]

Run it in a project where `make repro` (or `dvc repro`) has made results/export/model.onnx.
"""

import argparse
import asyncio
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from photos import generate

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "results/export/model.onnx"
CLIENTS = (1, 4, 16)


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of a running process and its children (its decoding
    processes), from Linux's /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            total += cpu_of(int(child))
    return total


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_predict(visionflow: str, folder: Path, count: int) -> dict:
    start = time.perf_counter()
    with open(os.devnull, "w") as null:
        process = subprocess.Popen(
            [visionflow, "predict", "--json", "--model", str(MODEL), str(folder)],
            cwd=ROOT,
            stdout=null,
            stderr=subprocess.DEVNULL,
        )
        _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit("predict failed")
    return {"wall": wall, "rate": count / wall, "cpu": usage.ru_utime + usage.ru_stime}


async def load(url: str, bodies: list[bytes], clients: int) -> tuple[float, list[float]]:
    """Post every body once with `clients` concurrent workers: (wall s, latencies s)."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    latencies: list[float] = []
    todo = iter(bodies)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:

        async def worker():
            for body in todo:
                sent = time.perf_counter()
                answer = await client.post(
                    "/predict", content=body, headers={"content-type": "image/jpeg"}
                )
                latencies.append(time.perf_counter() - sent)
                if answer.status_code != 200:
                    raise RuntimeError(f"serve answered {answer.status_code}: {answer.text}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return time.perf_counter() - start, latencies


def run_serve(url: str, pid: int, bodies: list[bytes], clients: int) -> dict:
    server, client = cpu_of(pid), own_cpu()
    wall, latencies = asyncio.run(load(url, bodies, clients))
    cuts = statistics.quantiles(latencies, n=100)
    return {
        "wall": wall,
        "rate": len(bodies) / wall,
        "p50": cuts[49] * 1000,
        "p99": cuts[98] * 1000,
        "cpu": cpu_of(pid) - server,
        "client_cpu": own_cpu() - client,
    }


def start_server(visionflow: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [visionflow, "serve", "--model", str(MODEL), "--port", "0", "--reload-interval", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    found = re.search(r"http://127\.0\.0\.1:\d+", process.stdout.readline())
    if not found:
        process.kill()
        sys.exit("serve did not start")
    return process, found[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--unique", type=int, default=200, help="distinct photos generated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    visionflow = str(Path(sys.executable).parent / "visionflow")
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        photos, _ = generate(Path(tmp) / "photos", args.unique)
        folder = Path(tmp) / "folder"
        folder.mkdir()
        for i in range(args.images):
            os.link(photos[i % len(photos)], folder / f"{i:06d}.jpg")
        bodies = [path.read_bytes() for path in sorted(folder.iterdir())]
        run_predict(visionflow, folder, args.images)  # warms the page cache
        server, url = start_server(visionflow)
        try:
            asyncio.run(load(url, bodies[:20], 4))  # warm-up
            contenders = ["predict", *CLIENTS]
            results = {name: [] for name in contenders}
            for r in range(args.rounds):
                for name in contenders[r % len(contenders) :] + contenders[: r % len(contenders)]:
                    if name == "predict":
                        results[name].append(run_predict(visionflow, folder, args.images))
                    else:
                        results[name].append(run_serve(url, server.pid, bodies, name))
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    report(results, args)


def report(results: dict, args) -> None:
    def median(name, key):
        return statistics.median(r[key] for r in results[name])

    print(
        f"{args.images} photos of 1024x768 ({args.unique} distinct, hard-linked), "
        f"{args.rounds} rounds, medians; model {MODEL.relative_to(ROOT)}"
    )
    print("| contender | images/s | x predict | p50 ms | p99 ms | server CPU s | client CPU s |")
    print("|---|---|---|---|---|---|---|")
    base = median("predict", "rate")
    print(
        f"| `visionflow predict` (one process) | {base:.0f} | 1.00 | | | {median('predict', 'cpu'):.2f} | |"
    )
    for c in CLIENTS:
        rate = median(c, "rate")
        print(
            f"| serve, {c} client{'s' if c > 1 else ''} | {rate:.0f} | {rate / base:.2f} | "
            f"{median(c, 'p50'):.1f} | {median(c, 'p99'):.1f} | {median(c, 'cpu'):.2f} | "
            f"{median(c, 'client_cpu'):.2f} |"
        )
    ratios = [s["rate"] / p["rate"] for s, p in zip(results[16], results["predict"], strict=True)]
    print(f"serve at 16 clients / predict, per round: {', '.join(f'{x:.2f}' for x in ratios)}")


if __name__ == "__main__":
    main()
