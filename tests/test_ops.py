"""The ops layer's own logic, in process and fast: the runner's locks, process groups and
restore note, the reaper, DVC's answers (repo), `visionflow verify`, the watcher and the pre-run
checks (project). The slow tests (test_reliability, test_flows) drive the same code through whole
pipeline runs; these pin what each function promises on a tiny DVC project of two stages."""

import fcntl
import json
import logging
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from visionflow import faults
from visionflow.errors import NotAProject, StageFailed, Timeout
from visionflow.ops import project, reaper, repo, runner, verify, watching

# Two stages listed after the one they depend on: DVC's graph, not the file, orders them.
DVC_YAML = """\
stages:
  count:
    cmd: python -c "import os; print(len(os.listdir('data')))" > counted.txt
    deps: [data, listed]
    outs: [counted.txt]
  listed:
    cmd: python -c "import os; os.makedirs('listed', exist_ok=True); open('listed/a', 'w').write('a')"
    deps: [params.yaml]
    outs: [listed]
  skipped:
    cmd: echo hi > hi.txt
    outs:
      - hi.txt:
          cache: false
"""


@pytest.fixture(autouse=True)
def dvc_logs_to_the_test():
    """DVC's logger without the handlers an earlier test in this process may have left on it
    (DVC's CLI, run in process, binds one to the stream pytest captured then, closed since):
    its records go to pytest's own handler."""
    dvc_logger = logging.getLogger("dvc")
    handlers = dvc_logger.handlers[:]
    dvc_logger.handlers.clear()
    yield
    dvc_logger.handlers[:] = handlers


def dvc_project(root: Path) -> Path:
    """A DVC project without git: a data folder, and the stages above (not run yet)."""
    from dvc.repo import Repo

    (root / "data").mkdir(parents=True)
    (root / "data" / "one.png").write_bytes(b"1")
    (root / "dvc.yaml").write_text(DVC_YAML)
    (root / "params.yaml").write_text("prepare:\n  path: data\n")
    Repo.init(str(root), no_scm=True).close()
    return root


def reproduce(root: Path) -> None:
    """`dvc repro` in this process (in the project's folder, as DVC's command runs), with the
    stages' `python` this interpreter."""
    from dvc.repo import Repo

    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", path)
        patch.chdir(root)
        with Repo(str(root)) as dvc:
            dvc.reproduce()


def gone(pid: int) -> bool:
    """Ended (a zombie waiting for its parent counts as ended)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_fault_applies_only_where_its_keys_match(tmp_path, monkeypatch):
    """The fault points the slow tests use to kill, fail and pause stages (faults.py)."""
    stopping = tmp_path / "stopping"
    spec = f"train.loss@epoch=2:nan; stage.start@stage=evaluate:raise; train.stop:touch={stopping}"
    monkeypatch.setattr(faults, "FAULTS", faults.parse(spec))
    assert faults.fault("train.loss", 1.0, epoch=1, step=0) == 1.0
    assert math.isnan(faults.fault("train.loss", 1.0, epoch=2, step=5))
    faults.fault("stage.start", stage="train")
    with pytest.raises(faults.FaultInjected, match="injected fault at stage.start"):
        faults.fault("stage.start", stage="evaluate")
    assert not stopping.exists()
    faults.fault("train.stop")
    assert stopping.exists()
    with pytest.raises(ValueError, match="'train.loss:explode' is not <point>"):
        faults.parse("train.loss:explode")


def test_the_stop_grace_period_is_seconds_from_the_environment(monkeypatch):
    monkeypatch.delenv("VISIONFLOW_STOP_GRACE_S", raising=False)
    assert runner.stop_grace_s() == runner.STOP_GRACE_S
    monkeypatch.setenv("VISIONFLOW_STOP_GRACE_S", "2.5")
    assert runner.stop_grace_s() == 2.5
    environment = runner.environment()
    assert environment["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "3"  # torchrun takes whole seconds
    assert environment["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    for bad in ("soon", "nan", "-1"):
        monkeypatch.setenv("VISIONFLOW_STOP_GRACE_S", bad)
        with pytest.raises(ValueError, match=f"VISIONFLOW_STOP_GRACE_S='{bad}' is not a number"):
            runner.stop_grace_s()


def test_the_project_root_is_the_nearest_folder_with_dvc(tmp_path):
    (tmp_path / "outer" / ".dvc").mkdir(parents=True)
    (tmp_path / "outer" / "inner" / ".dvc").mkdir(parents=True)
    (tmp_path / "outer" / "inner" / "deep").mkdir()
    assert runner.find_root(tmp_path / "outer" / "inner" / "deep") == tmp_path / "outer" / "inner"
    assert project.dvc_root(tmp_path / "outer") == tmp_path / "outer"
    with pytest.raises(NotAProject, match=f"{tmp_path} is not inside a DVC project"):
        runner.find_root(tmp_path)


def test_one_run_holds_the_workspace_and_dvcs_own_lock_is_asked_of_the_lock(tmp_path):
    with runner.workspace_lock(tmp_path, wait=False) as first:
        assert first and runner.HELD  # kept open for the reaper to inherit
        with runner.workspace_lock(tmp_path, wait=False) as second:
            assert not second
    with runner.workspace_lock(tmp_path, wait=False) as again:
        assert again
    assert not runner.HELD
    assert not runner.dvc_busy(tmp_path)  # no lock file yet
    lock = tmp_path / ".dvc" / "tmp" / "lock"
    with open(lock, "a") as dvc:  # as another `dvc` takes it (flock: per open file)
        fcntl.flock(dvc, fcntl.LOCK_EX)
        assert runner.dvc_busy(tmp_path)
    assert not runner.dvc_busy(tmp_path)


def test_a_half_written_rwlock_goes_and_a_whole_one_stays(tmp_path):
    said = []
    runner.mend_rwlock(tmp_path, said.append)  # none: nothing to do
    rwlock = tmp_path / ".dvc" / "tmp" / "rwlock"
    rwlock.parent.mkdir(parents=True)
    rwlock.write_text('{"read": {}, "write": {}}')
    runner.mend_rwlock(tmp_path, said.append)
    assert rwlock.exists() and not said
    rwlock.write_text('{"read": {"data": [{"pid": 12')  # `dvc` killed while writing it
    runner.mend_rwlock(tmp_path, said.append)
    assert not rwlock.exists() and "half written" in said[0]


def test_a_run_that_may_need_a_restore_keeps_a_note_until_it_is_done(tmp_path):
    said = []
    runner.begin_restorable_run(tmp_path, said.append, "train", "evaluate")
    assert runner.restore_note(tmp_path).read_text() == "train\nevaluate\n" and not said
    runner.drop_restore_note(tmp_path)
    assert not runner.restore_note(tmp_path).exists()
    runner.drop_restore_note(tmp_path)  # twice is fine


def test_a_group_streams_its_lines_returns_its_code_and_leaves_nothing_running(tmp_path):
    """What the command left behind in its group (holding the output pipe open) ends with it."""
    lines = []
    child = tmp_path / "child"
    code, tail = runner.run_group(
        [sys.executable, "-c", LEAVES_A_CHILD, str(child)], tmp_path, 600, lines.append
    )
    assert (code, lines) == (3, ["first", "second"]) and tail == "first\nsecond\n"
    assert gone(int(child.read_text()))


# Starts a child in its group that would sleep for ten minutes, with the output pipe, and exits 3.
LEAVES_A_CHILD = """\
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
print("first"); print("second", flush=True)
sys.exit(3)
"""


def test_a_group_past_its_timeout_is_stopped_and_killed_when_it_ignores_sigint(
    tmp_path, monkeypatch
):
    """The timeout counts once the command is at work (the fault point `runner.timer` waits
    for the file it writes), so the SIGINT finds it ignoring SIGINT, as DVC does."""
    monkeypatch.setenv("VISIONFLOW_STOP_GRACE_S", "0")
    working = tmp_path / "working"
    monkeypatch.setattr(faults, "FAULTS", faults.parse(f"runner.timer:pause={working}"))
    monkeypatch.setattr(faults, "ACTIVE", True)
    killed = len(runner.KILLED)
    command = f"{IGNORES_SIGINT}; open({str(working)!r}, 'w').close(); time.sleep(600)"
    with pytest.raises(Timeout, match="ran past 1 s and was stopped"):
        runner.run_group([sys.executable, "-c", command], tmp_path, 1, print)
    assert set(runner.KILLED[killed:]) == {0.0}  # killed: it never reached a safe point
    monkeypatch.setattr(runner, "FORWARDED", [signal.SIGTERM])
    assert runner.stop_message("the run", killed) == (
        "the run stopped by SIGTERM, killed after VISIONFLOW_STOP_GRACE_S=0 s without reaching "
        "its safe point"
    )


IGNORES_SIGINT = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN)"


# A leader that ignores SIGINT, as DVC does while a stage runs, under it a stage that does too;
# when its stage dies it writes `recorded` (as DVC records a failed stage) and exits 1.
RECORDS_ITS_STAGES_END = f"""\
{IGNORES_SIGINT}; import subprocess, sys
stage = subprocess.Popen([sys.executable, "-c", "{IGNORES_SIGINT}; time.sleep(600)"])
print("ready", flush=True)
stage.wait()
open(sys.argv[1], "w").write(str(stage.returncode))
sys.exit(1)
"""


def test_the_reaper_ends_the_group_of_a_runner_that_died_its_stage_before_dvc(tmp_path):
    """No "done" from the runner (its end of the pipe closed): SIGINT, the grace period, then
    SIGKILL for a group that ignores SIGINT, as DVC does while a stage runs: the stage first,
    so that the leader (DVC) sees it die and records the end, then whatever is left. Then the
    command the runner gave it runs (`after`: what DVC could not record, cleared)."""
    recorded, after = tmp_path / "recorded", tmp_path / "after"
    group = subprocess.Popen(
        [sys.executable, "-c", RECORDS_ITS_STAGES_END, str(recorded)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert group.stdout.readline() == b"ready\n"
    assert reaper.started(group.pid) is not None
    touch = [sys.executable, "-c", f"open({str(after)!r}, 'w').close()"]
    guard = subprocess.Popen(
        [sys.executable, str(runner.REAPER), str(group.pid), "0", str(group.stdout.fileno())]
        + touch,
        stdin=subprocess.PIPE,
        pass_fds=(group.stdout.fileno(),),
    )
    guard.stdin.close()  # the runner is gone
    assert group.wait(timeout=120) == 1  # it outlived its stage, and ended on its own
    assert recorded.read_text() == str(-signal.SIGKILL)
    assert reaper.started(group.pid) is None
    assert guard.wait(timeout=120) == 0
    assert after.exists()


def test_a_leader_with_nothing_under_it_past_the_grace_is_killed_at_once(tmp_path):
    """DVC itself is what outlived the grace period (hashing a FIFO, say): no wait for it to
    record anything."""
    group = subprocess.Popen(
        [sys.executable, "-c", f"{IGNORES_SIGINT}; print('ready', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert group.stdout.readline() == b"ready\n"
    assert reaper.kill_stage_first(group.pid, record_s=600)
    assert group.wait(timeout=60) == -signal.SIGKILL


def experiment_project(root: Path, working: Path) -> Path:
    """A git + DVC project of one stage that never reaches a safe point: it ignores SIGINT,
    writes `working` once at work, and sleeps."""
    from dvc.repo import Repo

    from tests.helpers import commit, sh

    root.mkdir()
    (root / "work.py").write_text(
        f"{IGNORES_SIGINT}\nopen({str(working)!r}, 'w').close()\ntime.sleep(600)\n"
    )
    (root / "params.yaml").write_text("lr: 1\n")
    (root / "dvc.yaml").write_text(
        "stages:\n  work:\n    cmd: python work.py > out.txt\n    deps: [work.py]\n"
        "    params: [lr]\n    outs: [out.txt]\n"
    )
    sh(root, "git", "init", "-q")
    Repo.init(str(root)).close()  # in process: a second sooner than `dvc init`
    commit(root, "one stage")
    return root


def running_and_copies(root: Path) -> tuple[list[str], list[str]]:
    """The experiments `dvc exp show` calls running (asked in process: a second sooner), and
    DVC's temporary copies on disk."""
    from dvc.repo import Repo

    with Repo(str(root)) as dvc:
        shown = dvc.experiments.show()
    running = [
        exp.name
        for baseline in shown
        for exp in baseline.experiments or []
        if exp.executor and exp.executor.state == "running"
    ]
    copies = sorted(p.name for p in (root / ".dvc/tmp/exps/standalone").glob("tmp*"))
    return running, copies


def test_a_temporary_experiment_killed_past_its_grace_leaves_no_running_ghost(
    tmp_path, monkeypatch, capfd
):
    """#57 (3): a `dvc exp run --temp` whose stage never reaches its safe point is killed after
    the grace period, the stage before DVC: DVC records the end and removes its temporary copy
    (killed with its stage, it left `dvc exp show` saying Running, and the copy, for good). And
    a `dvc` killed outright (SIGKILL to its group) leaves that ghost, which the reaper, once the
    runner is gone too, clears and names (`leftovers`, the command the runner gave it)."""
    from visionflow.ops import leftovers

    working = tmp_path / "working"
    root = experiment_project(tmp_path / "project", working)
    monkeypatch.setenv("VISIONFLOW_STOP_GRACE_S", "0")
    monkeypatch.setattr(faults, "FAULTS", faults.parse(f"runner.timer:pause={working}"))
    monkeypatch.setattr(faults, "ACTIVE", True)
    run = [*runner.dvc_command(), "exp", "run", "--temp", "--name"]
    with pytest.raises(Timeout, match="ran past 1 s"):
        runner.run_group([*run, "stopped", "-S", "lr=2"], root, 1, print)
    assert running_and_copies(root) == ([], [])

    working.unlink()  # now `dvc` killed outright, then its runner: the reaper clears the ghost
    clear = [sys.executable, "-m", "visionflow.ops.leftovers", str(root), "killed"]
    process, group = runner.start_group([*run, "killed", "-S", "lr=3"], root, after=clear)
    while not working.exists():
        assert process.poll() is None, process.stdout.read()
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    reaper.kill_family(process.pid)  # the stage, which the group's kill reached too
    running, [copy] = running_and_copies(root)
    assert running == ["killed"]  # DVC's ghost: no process, and it says Running
    group.tell_reaper(None)  # the runner is gone
    assert group.reaper.wait(timeout=120) == 0
    assert running_and_copies(root) == ([], [])
    said = capfd.readouterr().err  # the runner's stderr, which the reaper inherited
    assert "killed: dvc was killed before it recorded the end: its record written failed" in said
    assert f"its temporary copy removed (.dvc/tmp/exps/standalone/{copy})" in said
    assert leftovers.cleared_line(root, "killed") is None  # nothing left to say
    process.stdout.close()


def test_dvcs_addresses_lock_entries_and_hints_read_as_dvc_writes_them(tmp_path):
    assert repo.dvcfile_and_name(tmp_path, "sub/dvc.yaml:fit") == (tmp_path / "sub/dvc.yaml", "fit")
    assert repo.dvcfile_and_name(tmp_path, "train") == (tmp_path / "dvc.yaml", "train")
    assert repo.locked(tmp_path, "train") is None  # no dvc.lock yet
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages:\n  train:\n    cmd: python t.py\n")
    assert repo.locked(tmp_path, "train") == {"cmd": "python t.py"}
    assert repo.locked(tmp_path, "evaluate") is None
    shown = []
    say = repo.readable(shown.append)
    for line in [
        "Running stage 'a':",
        "",
        "To track the changes with git, run:",
        "",
        "\tgit add dvc.lock",
        "Done",
    ]:
        say(line)
    assert shown == ["Running stage 'a':", "Done"]
    refused = "ERROR: failed to reproduce 'train': Unable to acquire lock. Most likely ..."
    assert repo.lock_refused(refused, "train")
    assert not repo.lock_refused("train: Unable to acquire lock on my own file", "train")


def test_stages_come_in_dvcs_order_and_unchanged_is_dvcs_own_check(tmp_path):
    root = dvc_project(tmp_path / "p")
    assert repo.stages_in_order(root) == ["listed", "count", "skipped"]
    assert not repo.unchanged(root, "count")  # never run
    reproduce(root)
    assert (root / "counted.txt").read_text() == "1\n"
    assert all(repo.unchanged(root, stage) for stage in ("listed", "count"))
    (root / "data" / "two.png").write_bytes(b"2")
    assert not repo.unchanged(root, "count") and repo.unchanged(root, "listed")
    assert not repo.unchanged(root, "no-such-stage")  # unsure: the stage's own repro decides
    status = json.loads(repo.dvc(root, "status", "--json", doing="asking what changed"))
    assert list(status) == ["count"]
    with pytest.raises(StageFailed, match=r"`dvc repro nope` \(the test's typo\) failed \(exit"):
        repo.dvc(root, "repro", "nope", doing="the test's typo")


def test_verify_rehashes_every_cached_object_and_names_a_changed_one(tmp_path, capsys):
    root = dvc_project(tmp_path / "p")
    reproduce(root)
    assert verify.uncached_outs(root) == {"hi.txt"}
    checked, problems = verify.dvc_objects(root)
    assert (checked, problems) == (3, [])  # counted.txt; listed's .dir listing and its one file
    md5 = repo.locked(root, "count")["outs"][0]["md5"]
    obj = project.cache_object(root / ".dvc" / "cache", md5)
    obj.chmod(0o644)  # DVC keeps its objects read-only
    obj.write_text("9\n")
    assert verify.verify(root, root / "prepared") == 1
    out = capsys.readouterr().out
    assert f"BAD  counted.txt: object {obj} has md5 " in out and f"dvc.lock says {md5}" in out
    assert f"BAD  {root / 'prepared' / 'manifest.json'} is missing" in out
    assert out.endswith(
        f"0 prepared files in {root / 'prepared'}, 3 DVC cache objects: 2 problem(s)\n"
    )


def test_a_missing_output_is_told_apart_from_one_the_cache_has(tmp_path):
    root = dvc_project(tmp_path / "p")
    reproduce(root)
    counted = root / "counted.txt"
    found = project.locked_file(root / "listed" / "a")
    assert found[:3] == (root / ".dvc" / "cache", "listed", "listed") and project.in_cache(found)
    assert project.recorded(counted, project.locked_file(counted)[3])
    assert not project.recorded(counted, "0" * 32)
    counted.unlink()
    assert project.missing_output(counted) == (
        f"{counted} is missing, but DVC's cache has it: `dvc checkout count` puts it back"
    )
    other = root / "model.pt"
    assert project.missing_output(other, "model") == (
        f"no model at {other}: `dvc repro` makes it (or name another with --model)"
    )


def test_preflight_names_missing_data_a_fifo_dep_and_a_damaged_lock(tmp_path):
    root = dvc_project(tmp_path / "p")
    assert project.preflight(root) == []
    (root / "params.yaml").write_text("prepare:\n  path: photos\n")
    assert project.preflight(root) == [project.missing_data(root, "photos")]
    assert "prepare.path photos does not exist" in project.missing_data(root, "photos")
    (root / "params.yaml").write_text("prepare:\n  path: data\n")
    os.mkfifo(root / "data" / "pipe")
    (root / "dvc.lock").write_text("schema: '2.0'\n")
    fifo, lock = project.preflight(root)
    assert fifo == f"{root / 'data' / 'pipe'} is a FIFO: DVC would hang reading it; remove it"
    assert lock.startswith(f"{root / 'dvc.lock'} is empty or not a DVC lock file")


def test_what_dvcignore_keeps_out_of_code_folders_is_no_change_and_no_special_file(tmp_path):
    """Bytecode a stage's import writes and an editor's lock file (a link to nothing, as emacs
    leaves `.#engine.py`) in a layer folder: DVC ignores both (.dvcignore), so the watcher starts
    no run for them and the preflight refuses nothing; a dangling link in the images still is."""
    code, images = tmp_path / "src" / "train", tmp_path / "images"
    (code / "__pycache__").mkdir(parents=True)
    images.mkdir()
    (code / "__init__.py").write_text("")
    bytecode = code / "__pycache__" / "engine.cpython-311.pyc"
    editors = [code / ".engine.py.swp", code / "engine.py~", code / "#engine.py#"]
    assert watching.touched([bytecode, *editors], [code], "created") == (
        set(),
        set(),
    )
    assert watching.touched([code / "engine.py"], [code], "modified")[0] == {code / "engine.py"}
    (code / ".#engine.py").symlink_to("user@host.1234")
    (images / "cat.png").symlink_to("gone.png")
    assert project.special_files([code, images]) == [
        f"{images / 'cat.png'} is a link to gone.png, which does not exist: DVC cannot hash it; "
        "remove the link, or put its target back"
    ]


def test_param_changes_are_named_key_by_key():
    before = {"train": {"lr": 0.001, "epochs": 4}, "prepare": {"path": "data"}}
    after = {"train": {"lr": 0.003, "epochs": 4, "seed": 1}, "prepare": {"path": "data"}}
    assert project.param_changes(["train", "prepare.path"], before, after) == [
        "train.lr: 0.001 -> 0.003",
        "train.seed: None -> 1",
    ]
    assert project.fill(["${prepare.path}/x"], after) == ["data/x"]


def test_the_watcher_sees_which_points_to_watch_and_what_an_event_touched(tmp_path):
    data, params = tmp_path / "data", tmp_path / "params.yaml"
    data.mkdir()
    missing = tmp_path / "later" / "images"
    assert watching.watch_points(tmp_path, [data, params, missing]) == {
        (data, True),  # a folder dep whole, and its parent to see it go and come back
        (tmp_path, False),
    }
    assert watching.touched([data / "a.png"], [data, params], "modified") == (
        {data / "a.png"},
        set(),
    )
    assert watching.touched([tmp_path / "later"], [missing], "created") == (
        {tmp_path / "later"},
        {tmp_path / "later"},  # above a dep: watched again
    )
    assert watching.touched([tmp_path / "notes.txt"], [data, params], "modified") == (set(), set())


def test_changes_to_the_deps_are_yielded_after_they_settle_and_nothing_else(tmp_path, capsys):
    """Each yield is a burst: the changed deps, relative and sorted (how the two files below
    fall into bursts depends on the machine's speed; that they are seen does not)."""
    root = dvc_project(tmp_path / "p")
    changes = watching.settled_changes(root, settle_s=0.2)
    bursts = queue.Queue()

    def burst() -> None:
        threading.Thread(target=lambda: bursts.put(next(changes)), daemon=True).start()

    burst()
    deadline = time.monotonic() + 120
    while "watching 3 deps" not in capsys.readouterr().out:  # its watches are in place
        assert time.monotonic() < deadline, "the watcher did not start"
        time.sleep(0.05)
    (root / "notes.txt").write_text("not a dep")
    for name in ("b.png", "a.png"):
        (root / "data" / name).write_bytes(b"new")
    seen = []
    while set(seen) != {"data/a.png", "data/b.png"}:
        got = bursts.get(timeout=120)
        assert got == sorted(got) and set(got) <= {"data/a.png", "data/b.png"}, got
        seen += got
        if set(seen) != {"data/a.png", "data/b.png"}:
            burst()
    changes.close()  # suspended at its yield: the observer stops
