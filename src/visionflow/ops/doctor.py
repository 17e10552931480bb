"""`visionflow doctor`: what this machine and workspace can run, and the fix for each problem.

Each check gives a status (ok, warn, FAIL), what it found, and for a problem the fix. FAIL means
something the pipeline needs is missing or broken: the exit code is then 1.
"""

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

# (module, distribution): what the pipeline imports
PACKAGES = [
    ("torch", "torch"),
    ("torchvision", "torchvision"),
    ("onnx", "onnx"),
    ("onnxruntime", "onnxruntime"),
    ("dvc", "dvc"),
    ("dvclive", "dvclive"),
    ("prefect", "prefect"),
    ("pydantic", "pydantic"),
    ("numpy", "numpy"),
    ("PIL", "pillow"),
    ("sklearn", "scikit-learn"),
]
SETUP = "run `make setup` in the project (pip install -e '.[dev]' into .venv)"
CUDA_WHEELS = "pip install --force-reinstall torch torchvision --index-url https://download.pytorch.org/whl/cu126"
MIN_FREE_GB = 2.0


def check(name: str, status: str, found: str, fix: str = "") -> dict:
    return {"check": name, "status": status, "found": found, "fix": fix}


def packages() -> tuple[list[dict], dict]:
    results, modules = [], {}
    for module, dist in PACKAGES:
        try:
            modules[module] = importlib.import_module(module)
            results.append(check(module, "ok", metadata.version(dist)))
        except Exception as e:  # missing, or broken on import
            results.append(
                check(module, "FAIL", f"cannot be imported ({type(e).__name__}: {e})", SETUP)
            )
    return results, modules


def torch_pair(torch, torchvision) -> dict:
    """torchvision 0.N pairs with torch 2.(N-15): a mismatch fails at import or in C++ ops."""
    t_minor = int(torch.__version__.split(".")[1])
    v_minor = int(torchvision.__version__.split(".")[1])
    found = f"torch {torch.__version__}, torchvision {torchvision.__version__}"
    if v_minor != t_minor + 15:
        return check(
            "torch/torchvision",
            "FAIL",
            found + ": not a matching pair",
            f"install the torchvision for torch 2.{t_minor}: pip install torchvision==0.{t_minor + 15}.*",
        )
    return check("torch/torchvision", "ok", found + " (a matching pair)")


def nvidia_driver() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia/version").exists()


def gpu(torch, driver: bool) -> list[dict]:
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    results = [check("torch build", "ok", f"{build}" + (f", cuDNN {cudnn}" if cudnn else ""))]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        arch = f"sm_{props.major}{props.minor}"
        found = (
            f"{torch.cuda.device_count()} x {props.name} ({arch}), "
            f"{props.total_memory / 2**30:.0f} GiB; bf16 "
            f"{'yes' if torch.cuda.is_bf16_supported() else 'no'}"
        )
        if arch not in torch.cuda.get_arch_list():
            results.append(
                check(
                    "gpu",
                    "warn",
                    f"{found}; this torch has no kernels built for "
                    f"{arch} ({', '.join(torch.cuda.get_arch_list())})",
                    f"install a torch build that lists {arch}: {CUDA_WHEELS}",
                )
            )
        else:
            results.append(check("gpu", "ok", found))
    elif driver and not torch.version.cuda:
        results.append(
            check(
                "gpu",
                "FAIL",
                "an NVIDIA driver is installed, but this torch is a "
                "CPU-only build: training would run on the CPU",
                f"install a CUDA build of torch: {CUDA_WHEELS}",
            )
        )
    elif driver:
        results.append(
            check(
                "gpu",
                "FAIL",
                f"an NVIDIA driver is installed and torch is built for "
                f"CUDA {torch.version.cuda}, but torch sees no GPU",
                "check `nvidia-smi`; the driver may be older than the CUDA this torch "
                "needs, or CUDA_VISIBLE_DEVICES hides the GPU",
            )
        )
    else:
        results.append(
            check(
                "gpu",
                "ok",
                "none visible (no NVIDIA driver): training runs on the CPU with train.device: auto",
            )
        )
    return results


def runtime(onnxruntime) -> dict:
    return check("onnxruntime providers", "ok", ", ".join(onnxruntime.get_available_providers()))


def disk(workdir: Path) -> dict:
    free = shutil.disk_usage(workdir).free / 2**30
    if free < MIN_FREE_GB:
        return check(
            "disk",
            "warn",
            f"{free:.1f} GiB free in {workdir}",
            "free some space: the cache, DVC's cache and checkpoints live here",
        )
    return check("disk", "ok", f"{free:.0f} GiB free in {workdir}")


def workspace(workdir: Path) -> list[dict]:
    if not (workdir / ".dvc").is_dir() or not (workdir / "dvc.yaml").exists():
        return [
            check(
                "dvc repo",
                "warn",
                f"{workdir} is not the project (no .dvc/ or dvc.yaml)",
                "run doctor from the project's root",
            )
        ]
    results = [check("dvc repo", "ok", str(workdir))]
    from visionflow.ops.project import preflight  # here: doctor must run without pydantic too

    problems = preflight(workdir)  # what makes `dvc status` fail, hang or lose an edit
    if problems:  # each line names the file and the fix; `dvc status` would only fail or hang
        return results + [check("pipeline inputs", "FAIL", line) for line in problems]
    status = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "--json"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if status.returncode != 0:
        results.append(
            check(
                "pipeline",
                "warn",
                f"`dvc status` failed: {status.stderr.strip()[-300:]}",
                "run `dvc status` to see why",
            )
        )
    elif json.loads(status.stdout or "{}"):
        changed = ", ".join(json.loads(status.stdout))
        results.append(check("pipeline", "warn", f"not up to date: {changed}", "run `make repro`"))
    else:
        results.append(check("pipeline", "ok", "up to date"))
    return results


def prefect_api() -> dict:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return check(
            "prefect api", "ok", "none configured: each flow run starts a temporary local server"
        )
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=3).raise_for_status()
        return check("prefect api", "ok", f"{url} answers")
    except httpx.HTTPError as e:
        return check(
            "prefect api",
            "warn",
            f"{url} does not answer ({type(e).__name__})",
            "start it with `prefect server start`, or unset PREFECT_API_URL",
        )


# pyproject's requires-python: the suite runs on 3.11 only, and 3.10 differed where it was
# untested (asyncio.wait_for raised asyncio.TimeoutError, not TimeoutError: a 500, not a 408)
MIN_PYTHON = (3, 11)


ACTIVATE = "`source .venv/bin/activate` (or `export PATH=$PWD/.venv/bin:$PATH`) before `dvc`"
STAGE_NEEDS = ("visionflow", "torch", "dvclive")  # what `python -m pipeline.<stage>` imports


def stage_python(workdir: Path, timeout_s: float = 60) -> dict:
    """The `python` that DVC runs each stage with: the first on PATH, which `.venv/bin/dvc`
    alone does not change. Outside the venv it lacks the packages, and every stage fails with
    ModuleNotFoundError; a venv made for another checkout runs that checkout's library."""
    found = shutil.which("python")
    if found is None:
        return check("stage python", "FAIL", "no `python` on PATH: no stage can start", ACTIVATE)
    probe = (
        f"import importlib.util as u; print(*[m for m in {STAGE_NEEDS!r} if u.find_spec(m) is None]); "
        "s = u.find_spec('visionflow'); print(s.origin if s else '')"
    )
    try:  # in a session of its own: a python that hangs goes with what it started
        process = subprocess.Popen(
            [found, "-c", probe], stdout=subprocess.PIPE, text=True, cwd=workdir,
            start_new_session=True,
        )  # fmt: skip
    except OSError as e:  # not runnable
        return check("stage python", "FAIL", f"{found} cannot run ({e.strerror or e})", ACTIVATE)
    try:
        out = process.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return check("stage python", "FAIL", f"{found} did not answer in {timeout_s:g} s", ACTIVATE)
    missing, library = [*out.split("\n"), ""][:2]
    if missing.split():
        return check(
            "stage python",
            "FAIL",
            f"{found} (the stages' `python`, first on PATH) cannot import "
            f"{', '.join(missing.split())}: `dvc repro` would stop with ModuleNotFoundError",
            ACTIVATE,
        )
    own = workdir / "src/visionflow"
    if own.is_dir() and not Path(library).resolve().is_relative_to(own.resolve()):
        return check(
            "stage python",
            "warn",
            f"{found} runs the library in {Path(library).parent}, not this checkout's {own}: "
            "the stages would run other code than DVC records",
            "`pip install -e .` in this checkout (or activate its own venv)",
        )
    return check("stage python", "ok", found)


def diagnose(workdir: Path) -> list[dict]:
    results = [
        check(
            "python",
            "ok" if sys.version_info >= MIN_PYTHON else "FAIL",
            sys.version.split()[0],
            "" if sys.version_info >= MIN_PYTHON else "use Python 3.11 or newer",
        )
    ]
    found, modules = packages()
    results += found
    results.append(stage_python(workdir))
    if "torch" in modules:
        results += gpu(modules["torch"], nvidia_driver())
        if "torchvision" in modules:
            results.append(torch_pair(modules["torch"], modules["torchvision"]))
    if "onnxruntime" in modules:
        results.append(runtime(modules["onnxruntime"]))
    results.append(disk(workdir))
    if "dvc" in modules:
        results += workspace(workdir)
    if "prefect" in modules:
        results.append(prefect_api())
    return results


def doctor(workdir: Path, as_json: bool) -> int:
    results = diagnose(workdir)
    failed = [r for r in results if r["status"] == "FAIL"]
    if as_json:
        print(json.dumps({"ok": not failed, "checks": results}, indent=2))
    else:
        for r in results:
            print(f"{r['status']:5s} {r['check']:22s} {r['found']}")
            if r["fix"] and r["status"] != "ok":
                print(f"{'':5s} {'':22s} fix: {r['fix']}")
        problems = sum(r["status"] != "ok" for r in results)
        print(f"doctor: {len(failed)} failure(s), {problems - len(failed)} warning(s)")
    return 1 if failed else 0
