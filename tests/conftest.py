"""Shared fixtures: tiny generated data and a temporary git + DVC copy of the project."""

import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import (
    commit,
    free_port,
    make_project,
    sh,
    solid,
    write_idx,
)

# Under pytest-xdist each worker gets its share of the cores: torch's default (a thread per core
# in every stage process of every worker) oversubscribes them, and spinning threads burn the time.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORKERS)))
# A stopped stage gets this long to reach its safe point before SIGKILL (120 s for users). Tests
# whose stage pauses for good wait it out; those about the safe point give their stage longer.
os.environ.setdefault("VISIONFLOW_STOP_GRACE_S", "5")


# What makes a test slow by the tiers' definition (docs/tests.md): a whole pipeline run, a
# Prefect server. `make test-fast` must never start either.
SLOW_FIXTURES = {"reproduced_base", "prefect_server"}


def pytest_collection_modifyitems(items):
    """A test not marked slow that needs a slow fixture (itself, or through another fixture)
    stops the run at collection, naming it. Then the order (after pytest-randomly's shuffle,
    kept within each group): the fast tests, which run while the first worker builds the
    reproduced project; the longest tests, so that each starts early and no
    worker ends the run on one alone; the rest, which fill the workers to the end. (`make test`
    hands a worker one test at a time, so this order is the order they start in.)"""
    unmarked = [
        f"{item.nodeid} ({', '.join(sorted(SLOW_FIXTURES & set(item.fixturenames)))})"
        for item in items
        if SLOW_FIXTURES & set(item.fixturenames) and not item.get_closest_marker("slow")
    ]
    if unmarked:
        raise pytest.UsageError(
            "mark these tests slow, or give them a fast fixture: " + "; ".join(unmarked)
        )

    def group(item) -> int:
        if not item.get_closest_marker("slow"):
            return 0
        return 1 if item.get_closest_marker("longest") else 2

    items.sort(key=group)


@pytest.fixture
def image_folder(tmp_path) -> Path:
    """Three classes of solid-colour PNG and JPEG files, with a nested folder and hidden entries."""
    root = tmp_path / "images"
    colors = {"blue": (0, 0, 255), "green": (0, 255, 0), "red": (255, 0, 0)}
    for name, color in colors.items():
        (root / name / "nested").mkdir(parents=True)
        for i in range(6):  # one grey pixel at column i makes each image distinct
            image = solid(color)
            image.putpixel((i, 0), (128, 128, 128))
            image.save(root / name / f"{i}.png")
        for i in range(2):
            image = solid(color)
            image.putpixel((i, 5), (128, 128, 128))
            image.save(root / name / "nested" / f"{i}.jpg", quality=95)
        (root / name / ".hidden.png").write_bytes(b"not an image")
        (root / name / "notes.txt").write_text("a stray note")
    (root / ".ipynb_checkpoints").mkdir()
    solid((9, 9, 9)).save(root / ".ipynb_checkpoints" / "x.png")
    return root


@pytest.fixture
def mnist_root(tmp_path) -> Path:
    """A tiny MNIST (and FashionMNIST) copy in torchvision's on-disk layout: 40 train, 20 test."""
    rng = np.random.default_rng(0)
    root = tmp_path / "tv"
    for folder in ("MNIST", "FashionMNIST"):
        raw = root / folder / "raw"
        raw.mkdir(parents=True)
        for prefix, n in (("train", 40), ("t10k", 20)):
            labels = np.arange(n) % 10
            images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
            write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
            write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return root


@pytest.fixture
def project(tmp_path) -> Path:
    return make_project(tmp_path / "project")


def build_base(shared: Path) -> Path:
    """The reproduced project in `shared`, built by the first process to ask (the others wait)."""
    project, done = shared / "reproduced" / "project", shared / "reproduced" / "done"
    with open(shared / "reproduced.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(project.parent, ignore_errors=True)  # a build that failed halfway
            make_project(project)
            sh(project, "dvc", "repro")
            commit(project, "first run")
            done.touch()
    return project


def shared_folder(tmp_path_factory) -> Path:
    """This run's temporary folder, shared by all pytest-xdist workers (above each one's own)."""
    shared = tmp_path_factory.getbasetemp()
    return shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared


@pytest.fixture(scope="session", autouse=True)
def base_in_background(request, tmp_path_factory):
    """When any test of this run needs the reproduced project, start building it at once, so
    that the tests that do not need it run meanwhile."""
    if not any("reproduced_base" in item.fixturenames for item in request.session.items):
        yield
        return
    shared = shared_folder(tmp_path_factory)
    builder = threading.Thread(target=build_base, args=(shared,), daemon=True)
    builder.start()  # a failure here is raised again by the fixture below, in a test
    yield
    builder.join()


@pytest.fixture(scope="session")
def reproduced_base(tmp_path_factory) -> Path:
    """One full `dvc repro` of the tiny project, committed, shared by the whole session (all
    pytest-xdist workers: the first to ask builds it, the others wait for it). Read its files as
    they are; a test that runs anything in it, DVC included, works on `copy_project` of it."""
    return build_base(shared_folder(tmp_path_factory))


# Starts `prefect server start ARGS...` and stops it once the pytest process PID has ended.
WATCHED_SERVER = """\
import os, subprocess, sys, time
server = subprocess.Popen(sys.argv[2:])
while server.poll() is None:
    try:
        os.kill(int(sys.argv[1]), 0)
    except ProcessLookupError:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    time.sleep(1)
"""


def prefect_api(shared: Path) -> str:
    """The API URL of this run's Prefect server: `prefect server start` on 127.0.0.1 with an
    empty database of its own, started by the first process to ask (the others wait) and
    told to stop within a second of the run's end (it takes a few seconds). One server for all pytest-xdist workers: each
    start costs 10 s of CPU, and an idle server about 1.6 s a minute."""
    folder = shared / "prefect-server"
    url = folder / "api-url"
    with open(shared / "prefect-server.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if url.exists():
            return url.read_text()
        folder.mkdir(exist_ok=True)
        port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
            "PREFECT_HOME": str(folder / "home"),
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{folder}/prefect.db",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            # No runs from schedules: prefect.yaml's hourly deployment would start one at once,
            # and a worker told to stop then waits for it. Tests start every run they check.
            "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
        }
        run = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
        server = [sys.executable, "-m", "prefect", "server", "start", "--no-ui"]
        with open(folder / "server.log", "w") as log:
            subprocess.Popen(
                [sys.executable, "-c", WATCHED_SERVER, str(run), *server, "--port", str(port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        api = f"http://127.0.0.1:{port}/api"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{api}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                log = (folder / "server.log").read_text()[-3000:]
                raise RuntimeError(f"the test Prefect server did not start in 120 s:\n{log}")
            time.sleep(0.5)
        url.write_text(api)
        return api


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> str:
    """This run's Prefect server for the tests' own Prefect client and the processes they start
    (`flows_env`); each worker keeps its own PREFECT_HOME."""
    api = prefect_api(shared_folder(tmp_path_factory))
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    import prefect.context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api}):
        # as prefect_test_harness does, so that the flows a test runs in a thread see it too
        settings = prefect.context.get_settings_context()
        with prefect.context._temporary_global_settings_context(settings):
            yield api
