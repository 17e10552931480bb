"""Nothing lost, on DVC's own semantics: cached outputs and the run-cache, resumable state that is
scratch keyed by params, data and code, a content-aware mid-run guard, disk full, a killed runner.

Each test works on its own copy of the session's reproduced project (so each passes alone), with
4 epochs so that there is something to kill and resume; plain `dvc` where the promise is DVC's,
`visionflow repro` where it adds one.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from tests.helpers import (
    TINY,
    assert_invariants,
    commit,
    copy_project,
    dvc_clean,
    env,
    live_metrics,
    ran,
    read_until,
    repro,
    same_weights,
    sh,
    start,
    trainers,
    weights,
    write_params,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def project(reproduced_base, tmp_path) -> Path:
    """A copy of the reproduced project (4 epochs: something to kill and resume)."""
    return copy_project(reproduced_base, tmp_path / "project")


def start_dvc(project: Path, *args: str, fault: str = "") -> subprocess.Popen:
    """Plain `dvc ARGS` in its own session, output readable line by line."""
    dvc = str(Path(sys.executable).parent / "dvc")
    return subprocess.Popen(
        [dvc, *args],
        cwd=project,
        env=env(project, fault),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def states(project: Path) -> list[Path]:
    """The fingerprint folders of the resumable state, newest first."""
    root = project / "checkpoints/train"
    folders = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    return sorted(folders, key=lambda p: p.stat().st_mtime, reverse=True)


def results(project: Path) -> dict[str, str]:
    """sha256 of each file the stages wrote, less their timings (results/<stage>.timings/, no DVC
    output: the latest run's, which no restore from DVC's cache brings back)."""
    files = [f for f in sorted((project / "results").rglob("*")) if f.is_file()]
    files = [f for f in files if ".timings/" not in str(f.relative_to(project))]
    return {str(f.relative_to(project)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def test_params_edited_mid_run_are_named_and_going_back_restores_from_the_run_cache(
    project, reproduced_base, tmp_path
):
    """params.yaml edited while train runs: the run fails naming the edit, and the recorded
    results stay. The next run trains the new params. Going back to the earlier params restores
    their results from DVC's run-cache, with no training, through plain `dvc repro` and
    `dvc exp run`."""
    before = results(project)
    lock = (project / "dvc.lock").read_bytes()
    go = tmp_path / "go"
    run = start(project, "-f", "-s", "train", fault=f"train.epoch_end@epoch=1:pause={go}")
    read_until(run, "fault: pause")
    write_params(project, {"train": {"lr": 3e-3}})
    go.touch()
    output = run.communicate(timeout=300)[0]
    assert run.returncode != 0
    assert "changed while the stage ran: params.yaml train.lr: 0.001 -> 0.003" in output, output
    assert (project / "dvc.lock").read_bytes() == lock
    assert same_weights(weights(project), weights(reproduced_base))  # not the mixed run's
    rerun = repro(project)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert ran(rerun.stdout) == ["check", "train", "evaluate", "export"]
    recorded = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["train"]
    assert recorded["params"]["params.yaml"]["train"]["lr"] == 3e-3
    diff = json.loads(sh(project, "dvc", "metrics", "diff", "--json").stdout)
    accuracy = diff["results/evaluate/metrics.json"]["accuracy"]
    assert accuracy["old"] != accuracy["new"]  # a new model, measured

    write_params(project, {"train": {"lr": 1e-3}})
    back = sh(project, "dvc", "repro").stdout
    assert ran(back) == ["check"]  # no training
    for stage in ("train", "evaluate", "export"):
        assert f"Stage '{stage}' is cached - skipping run, checking out outputs" in back
    assert results(project) == before and dvc_clean(project)
    write_params(project, {"train": {"lr": 3e-3}})
    experiment = sh(project, "dvc", "exp", "run", "-S", "train.lr=0.003").stdout
    assert "Stage 'train' is cached" in experiment and "Running stage 'train'" not in experiment
    assert_invariants(project)


def test_checkout_of_another_commit_and_exp_apply_leave_a_clean_workspace(project):
    write_params(project, {"sanity": {"per_class": 3}})  # a second commit, cheaply
    sh(project, "dvc", "repro")
    commit(project, "3 per class")
    sh(project, "git", "checkout", "-q", "HEAD~1")
    sh(project, "dvc", "checkout")
    assert dvc_clean(project)  # no uncached output (resumable state) to miss
    sh(project, "git", "checkout", "-q", "main")
    sh(project, "dvc", "checkout")
    assert dvc_clean(project)
    sh(project, "dvc", "exp", "run", "-n", "grid2", "-S", "sanity.per_class=2")
    sh(project, "git", "checkout", "HEAD", "--", "params.yaml", "dvc.lock")
    sh(project, "dvc", "checkout")
    sh(project, "dvc", "exp", "apply", "grid2")
    assert dvc_clean(project) and ran(sh(project, "dvc", "repro").stdout) == []


def test_a_failed_plain_dvc_repro_costs_nothing_dvc_checkout_cannot_restore(project):
    """A parity miss fails export and promotes nothing: its dvc.lock entry stays as it was, the
    unproven files never reach results/export, `dvc checkout` brings the last good export back
    from the cache, and the failed report is kept beside it."""
    before = results(project)
    lock = (project / "dvc.lock").read_text()
    write_params(project, {"export": {"onnx_rtol": 0.0, "onnx_atol": 0.0}})  # a parity miss
    failed = sh(project, "dvc", "repro", check=False)
    assert failed.returncode != 0 and "parity missed" in failed.stderr
    # the truth about results/export, and the one command that brings it back
    assert "keeps the last good export" not in failed.stderr
    assert "results/export: DVC deleted it before the stage ran; `dvc checkout export`" in (
        failed.stderr
    )
    assert ran(failed.stdout) == ["check", "export"]
    lock_after = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert lock_after["export"] == yaml.safe_load(lock)["stages"]["export"]  # not recorded
    assert not (project / "results/export").exists()  # DVC deleted it; the cache keeps it
    sh(project, "dvc", "checkout")  # the manual's one command
    after = results(project)
    assert after.pop("results/export.miss.json") and after == before
    assert json.loads((project / "results/export/parity.json").read_text())["passed"] is True
    miss = json.loads((project / "results/export.miss.json").read_text())
    batch = f"batch_{TINY['export']['batch_size']}"
    assert miss["passed"] is False and miss["onnx"][batch]["max_abs_diff"] > 0


def test_an_mtime_only_touch_mid_run_keeps_the_run(project, tmp_path):
    """Compared by content with the hashes DVC took before the run (nothing of ours reads the
    data at the start). A forced run of files DVC never hashed at their start stat says why it
    refuses them."""
    fresh_config(project)  # never ran here: DVC hashes the deps, finds a change, runs train
    go = tmp_path / "go"
    touched = ("src/visionflow/train/engine.py", "params.yaml", "data/prepared/train_x.npy")

    def touch_mid_run(*force: str) -> str:
        run = start_dvc(
            project, "repro", *force, "-s", "train", fault=f"train.epoch_end@epoch=2:pause={go}"
        )
        read_until(run, "fault: pause")
        for name in touched:
            os.utime(project / name)  # an editor's "save all", a branch switch and back
        go.touch()
        output = run.communicate(timeout=300)[0]
        go.unlink()
        return run.returncode, output

    code, output = touch_mid_run()
    assert code == 0, output
    assert (states(project)[0] / "published.json").exists()  # recorded: done with
    assert_invariants(project, "train")  # a new model
    os.utime(project / touched[2], ns=(1, 1))  # a stat DVC never hashed, and --force hashes none
    code, output = touch_mid_run("-f")
    assert code != 0 and "data/prepared/train_x.npy changed (its stat did" in output, output
    assert "DVC has no hash from before the run" in output
    assert "engine.py" not in output.split("changed while the stage ran")[1]  # known: compared


def fresh_config(project: Path) -> None:
    """Params that never ran here, so the run-cache cannot stand in for training."""
    write_params(project, {"train": {"lr": 2e-3}})


def test_a_real_change_mid_run_is_refused_and_the_next_run_resumes(project, tmp_path):
    fresh_config(project)
    go = tmp_path / "go"
    run = start_dvc(project, "repro", "-s", "train", fault=f"train.epoch_end@epoch=3:pause={go}")
    read_until(run, "fault: pause")
    scan = project / "results/sanity/scan.json"
    original = scan.read_bytes()
    scan.write_bytes(original + b" ")
    go.touch()
    output = run.communicate(timeout=300)[0]
    assert run.returncode != 0 and "results/sanity/scan.json modified" in output, output
    assert "Its resumable state is kept: undo the change" in output
    scan.write_bytes(original)
    resumed = sh(project, "dvc", "repro", "-s", "train").stdout
    assert re.search(
        r"resuming from checkpoints/train/\w+/epoch-0004\.pt \(epoch 4 done\)", resumed
    )


def test_a_code_change_does_not_resume_the_old_codes_checkpoint(project):
    killed = repro(project, "-f", "-s", "train", fault="train.epoch_end@epoch=2:kill")
    assert killed.returncode != 0 and states(project)
    engine = project / "src/visionflow/train/engine.py"
    engine.write_text(engine.read_text() + "\n# a fix\n")
    rerun = repro(project, "-s", "train")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert re.search(
        r"train: starting fresh: the code changed since the checkpoint in checkpoints/train/\w+\n",
        rerun.stdout,
    )
    assert "epoch   1/4" in rerun.stdout  # trained from the first epoch with the new code
    assert_invariants(project, "train")  # a new model


def trained(project: Path) -> dict:
    """What a train run gave, timings left out: weights, meta, metrics and curves' last values."""
    path = project / "results/train/model.pt"
    model = torch.load(path, weights_only=True)
    metrics = json.loads((project / "results/train/metrics.json").read_text())
    md5 = hashlib.md5(path.read_bytes()).hexdigest()  # DVC's: nothing after train reruns
    return {**model, "md5": md5, "metrics": metrics, "live": live_metrics(project)}


def epochs_run(output: str, budget: int) -> list[int]:
    return [int(e) for e in re.findall(rf"^epoch +(\d+)/{budget} ", output, re.MULTILINE)]


def test_a_larger_epoch_budget_extends_the_recorded_run(project):
    """train.epochs 4 -> 5: under the plateau schedule a 5-epoch run's first 4 epochs are the
    recorded run's, so plain `dvc repro` trains epoch 5 alone and ends where an uninterrupted
    5-epoch run ends. Before, it trained from epoch 1, saying only "no checkpoint to resume".
    Cosine's fresh start, and why, is tests/test_run.py's (in process, the same lines)."""
    write_params(project, {"train": {"epochs": 5}})
    extended = sh(project, "dvc", "repro", "train").stdout
    assert re.search(
        r"train: extending the recorded 4-epoch run to 5 epochs: resuming from "
        r"checkpoints/train/\w+/epoch-0004\.pt \(epoch 4 done\)",
        extended,
    ), extended
    assert epochs_run(extended, 5) == [5]
    longer = trained(project)
    assert longer["meta"]["train"]["epochs"] == 5  # the kept epoch's meta says this run's budget
    again = sh(project, "dvc", "repro", "-f", "-s", "train").stdout  # recorded, unchanged: fresh
    assert "recorded by DVC; starting fresh" in again and epochs_run(again, 5) == [1, 2, 3, 4, 5]
    uninterrupted = trained(project)
    assert same_weights(longer.pop("state_dict"), uninterrupted.pop("state_dict"))
    assert longer == uninterrupted


def test_deleted_state_never_leaves_a_stuck_pipeline(project, tmp_path):
    go = tmp_path / "go"
    run = start_dvc(
        project, "repro", "-f", "-s", "train", fault=f"train.epoch_end@epoch=2:pause={go}"
    )
    read_until(run, "fault: pause")
    subprocess.run(["rm", "-rf", str(project / "checkpoints/train")], check=True)  # a disk cleanup
    go.touch()
    output = run.communicate(timeout=300)[0]
    assert run.returncode == 0, output  # the best model was kept in memory too
    assert dvc_clean(project)

    killed = repro(project, "-f", "-s", "train", fault="train.epoch_end@epoch=3:kill")
    assert killed.returncode != 0
    best = states(project)[0] / "best-0003.pt"  # epoch 3's checkpoint names it
    best.write_bytes(best.read_bytes()[:1000])  # truncated: never published as the model
    rerun = repro(project, "-f", "-s", "train")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "its best-0003.pt is missing or unreadable; starting fresh" in rerun.stdout
    assert_invariants(project)


def workspace_free(project: Path) -> bool:
    lock = project / ".dvc/tmp/visionflow-run.lock"
    return subprocess.run(["flock", "-n", str(lock), "true"]).returncode == 0


def test_sigkill_of_the_runner_checkpoints_the_epoch_and_leaves_no_stage_or_overlap(
    project, tmp_path
):
    go = tmp_path / "go"  # the reaper's stop request lets the paused step go on
    fault = f"train.loss@epoch=2,step=2:pause={go};train.stop:touch={go}"
    run = start(project, "-f", "-s", "train", fault=fault, VISIONFLOW_STOP_GRACE_S="300")
    read_until(run, "fault: pause")
    assert trainers(project)
    os.kill(run.pid, signal.SIGKILL)  # the runner only: `kill -9 PID`
    run.wait()
    deadline = time.monotonic() + 300
    while not workspace_free(project):  # ... until nothing of the group is left
        assert time.monotonic() < deadline, "the workspace lock was never released"
        time.sleep(0.1)
    assert not trainers(project)
    rerun = repro(project, "-f", "-s", "train")
    assert rerun.returncode == 0 and "epoch-0002.pt (epoch 2 done)" in rerun.stdout, rerun.stdout
    assert_invariants(project)


def test_the_runner_finds_the_project_root_and_creates_nothing_elsewhere(project):
    docs = project / "docs"
    docs.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "visionflow.cli", "repro"],
        cwd=docs,
        env=env(project),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "Data and pipelines are up to date" in result.stdout
    assert not (docs / ".dvc").exists()
    outside = subprocess.run(
        [sys.executable, "-m", "visionflow.cli", "repro"],
        cwd=project.parent,
        env=env(project),
        capture_output=True,
        text=True,
    )
    assert outside.returncode == 2 and "is not inside a DVC project" in outside.stderr
    assert not (project.parent / ".dvc").exists()


def test_an_experiment_started_during_a_run_loses_no_epoch(project, tmp_path):
    go = tmp_path / "go"
    run = start(project, "-f", "-s", "train", fault=f"train.epoch_end@epoch=3:pause={go}")
    read_until(run, "fault: pause")
    experiment = sh(project, "dvc", "exp", "run", "-S", "train.lr=3e-3", check=False)
    assert experiment.returncode != 0  # DVC's own lock: but it wrote params.yaml first
    go.touch()
    output = run.communicate(timeout=300)[0]
    assert run.returncode != 0 and "params.yaml train.lr: 0.001 -> 0.003" in output, output
    write_params(project, {"train": {"lr": 1e-3}})  # the user puts the value back
    resumed = repro(project, "-f", "-s", "train")
    assert "(epoch 4 done)" in resumed.stdout and resumed.returncode == 0, resumed.stdout
    assert_invariants(project)


def tmpfs(path: Path, size: str):
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here to fill")
    return path


@pytest.fixture
def full_disk(tmp_path):
    disk = tmpfs(tmp_path / "disk", "200k")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_is_one_line_naming_the_folder_and_leaves_nothing(project, full_disk):
    stage_env = env(project)
    prepare = subprocess.run(
        [sys.executable, "-m", "pipeline.prepare", "--out", str(full_disk / "prepared")],
        cwd=project,
        env=stage_env,
        capture_output=True,
        text=True,
    )
    assert prepare.returncode == 1 and "Traceback" not in prepare.stderr
    assert re.search(
        rf"error: disk full: no room to write in {full_disk}/prepared.partial "
        r"\([\d.]+ MB needed, 0\.\d MB free\)",
        prepare.stderr,
    ), prepare.stderr
    train = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.train",
            "--data",
            "data/prepared",
            "--out",
            str(full_disk / "train"),
            "--checkpoints",
            str(full_disk / "ck"),
        ],
        cwd=project,
        env=stage_env,
        capture_output=True,
        text=True,
    )
    assert train.returncode == 1 and "Traceback" not in train.stderr
    assert f"error: disk full: no room to write in {full_disk}/" in train.stderr, train.stderr
    left = [p.relative_to(full_disk) for p in full_disk.rglob("*") if p.is_file()]
    # no partial array or temp file; complete state (the best file, run.json) may stay, the
    # one-trainer lock (ck/.lock: a lock file stays, as flock's do), and the timings of the
    # epochs that ran (train.timings/: not an output, as far as the run went)
    kept = [p for p in left if p.parts[0] != "train.timings" and p != Path("ck/.lock")]
    assert {p.name for p in kept} <= {"best-0001.pt", "run.json"}
    assert not [p for p in kept if p.suffix == ".tmp" or p.name.startswith(".")]
    assert not list(full_disk.glob("*.partial"))  # or staging (a complete best file is state)
    assert dvc_clean(project)  # the project's own results untouched


def test_a_full_dvc_cache_records_nothing_and_the_next_run_publishes_without_training(
    project, tmp_path
):
    """DVC caches a stage's outputs after its command ends; a cache that fills then would leave
    dvc.lock naming objects it lacks. The stage checks the room first, and keeps its state."""
    cache = project / ".dvc/cache"
    pages = sum(-(-f.stat().st_size // 4096) for f in cache.rglob("*") if f.is_file())
    # room for what is cached now and a little more (tmpfs counts whole pages), not for the
    # new results/train and the stage's margin
    disk = tmpfs(tmp_path / "cache", str((pages + 64) * 4096))
    try:
        shutil.copytree(cache, disk, dirs_exist_ok=True, symlinks=True)
        sh(project, "dvc", "config", "--local", "cache.dir", str(disk))
        lock = (project / "dvc.lock").read_bytes()
        full = start_dvc(project, "repro", "-f", "-s", "train")
        output = full.communicate(timeout=300)[0]
        assert full.returncode != 0 and "Traceback" not in output, output
        assert re.search(
            rf"error: disk full: DVC's cache {disk} has [\d.]+ MB free and results/train need "
            r"[\d.]+ MB there; nothing was recorded",
            output,
        ), output
        assert (project / "dvc.lock").read_bytes() == lock
        sh(project, "dvc", "checkout")  # plain DVC: its cache still has the previous results
        assert dvc_clean(project)
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # room again
        rerun = start_dvc(project, "repro", "-f", "-s", "train")
        output = rerun.communicate(timeout=300)[0]
        assert rerun.returncode == 0, output
        assert "(epoch 4 done)" in output and "epoch   1/4" not in output  # nothing retrained
        assert dvc_clean(project)
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def test_an_archive_is_extracted_beside_the_project_after_a_free_space_check(
    project, image_folder, tmp_path, full_disk
):
    noise = np.random.default_rng(0).integers(0, 256, (320, 320, 3), dtype=np.uint8)
    Image.fromarray(noise).save(image_folder / "red" / "big.png")  # 300 kB: over the small disk
    archive = shutil.make_archive(str(tmp_path / "images"), "zip", image_folder.parent, "images")
    prepare = {"source": "imagefolder", "path": archive, "max_bad_fraction": 0.5}  # the notes
    write_params(project, {"prepare": prepare})
    prepare = [sys.executable, "-m", "pipeline.prepare", "--out"]
    small_tmp = env(project) | {"TMPDIR": str(full_disk)}  # the system's temp folder is full
    made = subprocess.run(
        [*prepare, str(tmp_path / "prepared")],
        cwd=project,
        env=small_tmp,
        text=True,
        capture_output=True,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    assert (tmp_path / "prepared/manifest.json").exists()
    assert not (tmp_path / "prepared.extract").exists()  # extracted beside it, then removed
    no_room = subprocess.run(
        [*prepare, str(full_disk / "prepared")],
        cwd=project,
        env=env(project),
        text=True,
        capture_output=True,
    )
    assert no_room.returncode == 1 and "Traceback" not in no_room.stderr
    assert re.search(
        rf"error: disk full: no room to write in {full_disk}/prepared.extract \([\d.]+ MB needed",
        no_room.stderr,
    ), no_room.stderr
    assert not list(full_disk.iterdir())  # nothing half-extracted left
