"""What the tests share besides fixtures (tests/conftest.py): the project's files and tiny params,
a temporary git + DVC copy of the project, its commands, and the runner's invariants. No test
module imports another; each imports from here."""

import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def python_path(*first) -> str:
    """PYTHONPATH for a subprocess: `first`, then what this process was given (a machine whose
    packages were installed with `pip install --target` finds them only through it)."""
    return os.pathsep.join([*map(str, first), *filter(None, [os.environ.get("PYTHONPATH")])])


PROJECT_FILES = [
    "dvc.yaml",
    "params.yaml",
    "prefect.yaml",
    ".dvcignore",
    ".gitignore",
    ".dvc/config",
    ".dvc/.gitignore",
    ".dvc/plots",
    "pipeline",
    "orchestration",
    "src",
    "data/raw",
    "data/pretrained",
]


# Small enough for seconds per stage on 2 CPU cores; still the real stages and the real data.
# Four epochs: enough to kill a run after one checkpoint and resume it from another.
TINY = {
    "prepare": {"image_size": 8},
    "train": {"epochs": 4, "batch_size": 128},
    "export": {"batch_size": 8, "latency_repeats": 3},
}


def solid(color, size=(12, 10), mode="RGB") -> Image.Image:
    return Image.new(mode, size, color)


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write an array in the idx format MNIST ships in (big-endian dims, uint8 data)."""
    magic = 0x0800 | array.ndim
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def digits_cache(out: Path, source=None, val_fraction: float = 0.15) -> Path:
    """A real cache at `out`: scikit-learn's digits (or `source`) at 8x8 grayscale, split as the
    shipped params split them."""
    from visionflow.data import dataset, sources

    source = source or sources.load_source("digits", None)
    decode = dataset.Decode(8, "grayscale")
    dataset.build_cache(source, out, decode, val_fraction=val_fraction, test_fraction=0.2, seed=0)
    return out


def merge(base: dict, change: dict) -> dict:
    out = dict(base)
    for key, value in change.items():
        out[key] = merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return out


def add_stage(project: Path, name: str, cmd: str, out: str) -> None:
    """A stage of the test's own in the project's dvc.yaml (DVC reads block or flow style)."""
    spec = yaml.safe_load((project / "dvc.yaml").read_text())
    spec["stages"][name] = {"cmd": cmd, "outs": [out]}
    (project / "dvc.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


# A stage that prints a byte that is not UTF-8 (a Latin-1 file name, say), then succeeds.
LATIN = (
    'python -c "import sys; sys.stdout.buffer.write(bytes([99, 97, 102, 233, 10])); '
    "open('latin.txt', 'w').close()\""
)


def write_params(project: Path, change: dict) -> None:
    path = project / "params.yaml"
    path.write_text(
        yaml.safe_dump(merge(yaml.safe_load(path.read_text()), change), sort_keys=False)
    )


def note_in_params(project: Path, note: str) -> None:
    """The cheapest valid edit: a comment appended to params.yaml reruns `check` alone (its
    output is the same bytes, and no stage's params changed)."""
    with open(project / "params.yaml", "a") as params:
        params.write(f"# {note}\n")


def params_recorded(project: Path) -> bool:
    """dvc.lock's check records the params.yaml on disk (False while DVC rewrites dvc.lock)."""
    try:
        deps = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["check"]["deps"]
    except (KeyError, TypeError, yaml.YAMLError):
        return False
    md5 = hashlib.md5((project / "params.yaml").read_bytes()).hexdigest()
    return any(d["path"] == "params.yaml" and d["md5"] == md5 for d in deps)


def dvc_clean(project: Path, *targets: str) -> bool:
    """`dvc status [TARGETS]` finds nothing to do (for TARGETS and the stages they depend on):
    asked of DVC in this process, the same code and locks as the command (0.15 s; a `dvc`
    process spends 0.45 s of CPU)."""
    from dvc.repo import Repo

    with Repo(str(project)) as repo:
        named = [f"{project / 'dvc.yaml'}:{target}" for target in targets]  # not this cwd's
        return repo.status(targets=named or None, with_deps=True) == {}


GIVEN: set[int] = set()  # the ports free_port gave in this process: never one twice


def free_port() -> int:
    """A free port, drawn below the kernel's ephemeral range. bind(0) hands out a
    port of that range, which every outgoing connection draws from too: between the probe's
    close and the server's bind, another socket may take it (gloo opens many in each DDP run),
    and a client that retries its connect before the server listens may even connect to
    itself. A two-node rendezvous on port 41131 hung so in a clean-clone run, its node 0 past
    300 s. The draw is the system's: pytest-randomly seeds `random` alike in every worker.
    Each xdist worker draws from its own slice of the range, so two tests starting servers at
    once never draw the same port (they could, 1 in 22,768 per pair, from one shared range)."""
    range_file = Path("/proc/sys/net/ipv4/ip_local_port_range")
    lowest = int(range_file.read_text().split()[0]) if range_file.exists() else 32768
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    width = (lowest - 10000) // workers
    start = 10000 + int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")) * width
    while True:
        port = start + secrets.randbelow(width) if width > 1000 else 0  # else: the kernel's
        if port in GIVEN:  # pick, on a machine with no room below its range
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("", port))  # every address: torch's store binds them all
            except OSError:
                continue
            port = probe.getsockname()[1]
            GIVEN.add(port)
            return port


def sh(cwd: Path, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command in the project copy with the test's Python first on PATH."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": python_path(cwd / "src"),
        "DVC_NO_ANALYTICS": "1",
    }
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
    return result


def make_project(dest: Path) -> Path:
    """A committed git + DVC copy of the project with tiny params (DVCLive needs a first commit)."""
    for name in PROJECT_FILES:
        src = ROOT / name
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(
                src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            shutil.copy2(src, dest / name)
    write_params(dest, TINY)
    sh(dest, "git", "init", "-q", "-b", "main")
    commit(dest, "init")
    return dest


def commit(project: Path, message: str) -> None:
    sh(project, "git", "add", "-A")
    sh(
        project,
        "git",
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        message,
    )


def copy_project(src: Path, dest: Path) -> Path:
    """A copy of a project with its git history and DVC cache (not its .dvc/tmp: locks, state)."""

    def skip(folder, names):
        return ["tmp"] if Path(folder).name == ".dvc" else []

    shutil.copytree(src, dest, symlinks=True, ignore=skip)
    return dest


SAFE_POINT_GRACE = {"VISIONFLOW_STOP_GRACE_S": "300"}  # for a stage that must reach its safe point


def env(project: Path, fault: str = "", **extra: str) -> dict:
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": python_path(project / "src"),
        "DVC_NO_ANALYTICS": "1",
        "VISIONFLOW_FAULT": fault,
        **extra,
    }


def repro_cmd(*dvc_args: str) -> list[str]:
    return [sys.executable, "-m", "visionflow.cli", "repro", "--", *dvc_args]


def repro(project: Path, *dvc_args: str, fault: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        repro_cmd(*dvc_args),
        cwd=project,
        env=env(project, fault, **SAFE_POINT_GRACE),
        capture_output=True,
        text=True,
        timeout=600,
    )


def start(project: Path, *dvc_args: str, fault: str = "", **extra: str) -> subprocess.Popen:
    """The runner in its own session, as a terminal's foreground job would be."""
    return subprocess.Popen(
        repro_cmd(*dvc_args),
        cwd=project,
        env=env(project, fault, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def read_until(process: subprocess.Popen, marker: str, timeout: float = 300) -> str:
    seen, deadline = "", time.monotonic() + timeout
    while marker not in seen:
        line = process.stdout.readline()
        assert line and time.monotonic() < deadline, f"no {marker!r} in:\n{seen}"
        seen += line
    return seen


def ran(output: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", output)


def trainers(project: Path) -> list[psutil.Process]:
    """Live training processes started in this project."""
    found = []
    for p in psutil.process_iter(["cmdline", "cwd"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "pipeline.train" in cmd and p.info["cwd"] == str(project) and p.status() != "zombie":
            found.append(p)
    return found


def weights(project: Path) -> dict:
    import torch  # conftest imports this module: collection stays free of torch

    return torch.load(project / "results/train/model.pt", weights_only=True)["state_dict"]


def same_weights(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def state_folder(project: Path) -> Path:
    """The resumable state of the newest configuration (one folder per fingerprint)."""
    folders = [p for p in (project / "checkpoints/train").iterdir() if p.is_dir()]
    return max(folders, key=lambda p: p.stat().st_mtime)


def file_hashes(project: Path) -> dict[str, str]:
    """sha256 of every file of the project but git's and DVC's own scratch folders and Python's
    bytecode (any import may write it; git and .dvcignore ignore it: a fresh venv's first
    `visionflow repro` wrote cli's, runner's and reaper's)."""
    skip = (project / ".git", project / ".dvc" / "tmp")
    return {
        str(p.relative_to(project)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(project.rglob("*"))
        if p.is_file()
        and not any(p.is_relative_to(s) for s in skip)
        and "__pycache__" not in p.parts
    }


def assert_invariants(project: Path, *targets: str) -> None:
    """Every stage recorded, every checkpoint readable, no trainer left, the workspace lock and
    DVC's own free again: `repro [TARGETS]` runs and leaves DVC's status clean. A test whose run
    made a new model names "train", so that evaluate and export do not run for nothing."""
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"check", "prepare", "sanity", "train", "evaluate", "export"}
    import torch

    for path in (project / "checkpoints/train").glob("**/*.pt"):
        torch.load(path, weights_only=True)
    assert not trainers(project)
    clean = repro(project, *targets)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert dvc_clean(project, *targets)


def assert_resumes_to_the_baseline(
    project: Path, epoch: int, baseline: dict, *targets: str
) -> subprocess.CompletedProcess:
    """The next run resumes from epoch `epoch`'s checkpoint and ends equal to the uninterrupted
    run; returns that run. TARGETS: as `assert_invariants`'s."""
    resumed = repro(project, "-f", "-s", "train")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert re.search(rf"resuming from checkpoints/train/\w+/epoch-{epoch:04d}\.pt", resumed.stdout)
    assert same_weights(weights(project), baseline)
    assert_invariants(project, *targets)
    return resumed


def live_metrics(project: Path) -> dict:
    """DVCLive's last values (the timings, which differ between any two runs, are elsewhere)."""
    return json.loads((project / "results/train/live/metrics.json").read_text())


def digits_folder(root: Path, moved: float, seed: int = 0) -> set[str]:
    """scikit-learn's digits as an image folder (`root/<digit>/<i>.png`, 8x8 grayscale), with a
    share `moved` of the files put in a wrong class's folder; the moved files' paths under
    `root`, as the cache names them."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    wrong = set(rng.choice(len(digits.target), round(moved * len(digits.target)), replace=False))
    paths = set()
    for i, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        folder = (label + rng.integers(1, 10)) % 10 if i in wrong else label
        path = root / str(folder) / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.round(image * (255 / 16)).astype(np.uint8)).save(path)
        if i in wrong:
            paths.add(f"{folder}/{i}.png")
    return paths
