"""Nothing is lost when a run is killed, interrupted, raced or fed a corrupted cache.

Real DVC in a temporary git repo, driven through the project's runner (`visionflow repro`), with
faults injected through VISIONFLOW_FAULT. Each test works on its own copy of the session's
reproduced project (4 epochs), whose model is the uninterrupted run, and ends with the
invariants: dvc.lock parses, every checkpoint loads with weights_only=True, `dvc status` works,
and a clean run afterwards succeeds.
"""

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from tests.helpers import (
    LATIN,
    SAFE_POINT_GRACE,
    TINY,
    add_stage,
    assert_invariants,
    assert_resumes_to_the_baseline,
    copy_project,
    dvc_clean,
    env,
    file_hashes,
    live_metrics,
    note_in_params,
    params_recorded,
    ran,
    read_until,
    repro,
    repro_cmd,
    same_weights,
    sh,
    start,
    state_folder,
    trainers,
    weights,
    write_params,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def project(reproduced_base, tmp_path) -> Path:
    return copy_project(reproduced_base, tmp_path / "project")


@pytest.fixture(scope="session")
def baseline(reproduced_base) -> dict:
    """The weights of the uninterrupted run with the shipped tiny params."""
    return weights(reproduced_base)


def test_sigkill_after_epoch_3_resumes_and_equals_an_uninterrupted_run(
    project, baseline, reproduced_base
):
    """Killed after epoch 3, the run resumes there and ends equal to the uninterrupted one, even
    when another configuration ran meanwhile and was killed too: each configuration keeps its
    own state folder, and a new one never deletes the state of the current run."""
    killed = repro(
        project, "--force", "--single-item", "train", fault="train.epoch_end@epoch=3:kill"
    )
    assert killed.returncode != 0
    assert same_weights(weights(project), baseline)  # the previous model is in place
    first = state_folder(project)
    assert (first / "epoch-0003.pt").exists()

    write_params(project, {"train": {"lr": 2e-3}})  # another configuration, killed after epoch 2
    killed = repro(project, "-s", "train", fault="train.epoch_end@epoch=2:kill")
    assert killed.returncode != 0
    second = state_folder(project)
    assert second != first and (first / "epoch-0003.pt").exists()
    assert sorted(p.name for p in second.glob("epoch-*.pt")) == ["epoch-0001.pt", "epoch-0002.pt"]
    resumed = repro(project, "-s", "train")
    assert f"resuming from checkpoints/train/{second.name}/epoch-0002.pt" in resumed.stdout
    write_params(project, {"train": {"lr": 1e-3}})  # back to the first (shipped): it resumes

    assert_resumes_to_the_baseline(project, 3, baseline)
    assert state_folder(project) == first
    assert live_metrics(project) == live_metrics(reproduced_base)
    curve = (project / "results/train/live/plots/metrics/val/accuracy.tsv").read_text()
    epochs = TINY["train"]["epochs"]
    assert len(curve.splitlines()) == 1 + epochs  # header + every epoch, those before the kill too
    # kept until DVC has recorded what it gave; then the next run of these params starts fresh
    assert (first / "published.json").exists()


def test_sigkill_while_a_checkpoint_is_written_keeps_the_previous_one(project, baseline):
    killed = repro(project, "-f", "-s", "train", fault="checkpoint.write@epoch=3:kill")
    assert killed.returncode != 0
    folder = state_folder(project)
    assert list(folder.glob(".epoch-0003.pt.*.tmp"))  # the half-written file
    assert not (folder / "epoch-0003.pt").exists()
    assert torch.load(folder / "epoch-0002.pt", weights_only=True)["epoch"] == 2
    # epoch 3's best model was written just before; each kept checkpoint (epochs 1 and 2) keeps
    # the one it names, so a fallback past an unreadable newest one finds its best file
    names = {p.name for p in folder.glob("best-*.pt")}
    assert names == {"best-0001.pt", "best-0002.pt", "best-0003.pt"}
    assert_resumes_to_the_baseline(project, 2, baseline)
    assert not list(folder.glob(".*.tmp"))  # the stray was removed


def test_a_run_of_nan_losses_stops_and_keeps_the_last_good_checkpoint(project, baseline):
    failed = repro(project, "-f", "-s", "train", fault="train.loss@epoch=2:nan")
    assert failed.returncode != 0
    assert (
        "loss was not finite in 5 optimizer steps in a row (epoch 2, micro-batch 5)"
        in failed.stdout
    )
    folder = state_folder(project)
    assert sorted(p.name for p in folder.glob("epoch-*.pt")) == ["epoch-0001.pt"]
    assert torch.load(folder / "epoch-0001.pt", weights_only=True)["epoch"] == 1
    assert same_weights(weights(project), baseline)
    assert_resumes_to_the_baseline(project, 1, baseline)


def test_a_failed_stage_keeps_its_results_and_lock_and_reruns_alone(project):
    entry = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["sanity"]
    results = file_hashes(project / "results/sanity")
    write_params(project, {"sanity": {"per_class": 2}})
    failed = repro(project, fault="stage.start@stage=sanity:raise")
    assert failed.returncode != 0 and ran(failed.stdout) == ["check", "sanity"]
    assert "injected fault at stage.start" in failed.stdout
    assert yaml.safe_load((project / "dvc.lock").read_text())["stages"]["sanity"] == entry
    assert file_hashes(project / "results/sanity") == results
    fixed = repro(project)
    assert fixed.returncode == 0 and ran(fixed.stdout) == ["sanity"]  # check passed the first time
    assert_invariants(project)


# Each stop lets the paused step go on by itself: the stage's stop request touches the file.
PAUSED_IN_EPOCH = "train.loss@epoch={epoch},step=2:pause={go};train.stop:touch={go}"
# epoch: the stop that comes in it. One run pays for all three (each stop's run resumes the last).
STOPS = {2: "ctrl-c", 3: "sigterm", 4: "sigterm-to-all"}


def test_ctrl_c_or_sigterm_checkpoint_the_epoch_in_progress_and_the_rerun_resumes(
    project, tmp_path, baseline
):
    """Three stops in a row, each in the epoch after the last one's checkpoint: a terminal's
    Ctrl-C, `kill PID` (a cancelled flow run's process), systemd's stop of every process. Each
    finishes and checkpoints its epoch and puts the previous results back; the next run resumes
    from that checkpoint, and the last one ends equal to the uninterrupted run."""
    for epoch, stop in STOPS.items():
        go = tmp_path / f"go-{epoch}"
        run = start(
            project,
            "-f",
            "-s",
            "train",
            fault=PAUSED_IN_EPOCH.format(epoch=epoch, go=go),
            **SAFE_POINT_GRACE,
        )
        seen = read_until(run, "fault: pause")
        if epoch > 2:  # resumed from the last stop's checkpoint
            assert re.search(
                rf"resuming from checkpoints/train/\w+/epoch-{epoch - 1:04d}\.pt", seen
            )
        if stop == "ctrl-c":
            os.killpg(run.pid, signal.SIGINT)  # a terminal's Ctrl-C: the foreground process group
        elif stop == "sigterm":
            os.kill(run.pid, signal.SIGTERM)  # `kill PID`, a cancelled flow run's process
        else:  # systemd's control-group stop: every process, DVC and the reaper too
            for process in [psutil.Process(run.pid), *psutil.Process(run.pid).children(True)]:
                process.send_signal(signal.SIGTERM)
        output = seen + run.communicate(timeout=300)[0]
        assert run.returncode != 0 and "Traceback" not in output, (stop, output)
        assert f"train stopped after epoch {epoch}" in output, (stop, output)
        assert "restored the previous results" in output, stop  # DVC lived on, recorded nothing
        checkpoint = torch.load(state_folder(project) / f"epoch-{epoch:04d}.pt", weights_only=True)
        assert checkpoint["epoch"] == epoch, stop
        assert same_weights(weights(project), baseline), stop
    assert_resumes_to_the_baseline(project, max(STOPS), baseline)


def test_sigkill_of_dvc_leaves_no_training_process(project, tmp_path):
    run = start(
        project, "-f", "-s", "train", fault=f"train.loss@epoch=2,step=1:pause={tmp_path / 'never'}"
    )
    read_until(run, "fault: pause")
    assert trainers(project)
    dvc = next(c for c in psutil.Process(run.pid).children() if "dvc" in " ".join(c.cmdline()))
    dvc.send_signal(signal.SIGKILL)
    run.communicate(timeout=300)  # the stage got its grace period (it stayed paused), then SIGKILL
    assert run.returncode != 0
    assert not trainers(project)
    assert_invariants(project)


def stage_trainers(project: Path) -> list:
    """The stage's trainers: `trainers` less the shell DVC may run one in (its command line
    names pipeline.train in one argument; dash does not exec it) and their data loader's
    workers (forked: the same command line)."""
    found = [p for p in trainers(project) if "pipeline.train" in p.info["cmdline"]]
    pids, stage = {p.pid for p in found}, []
    for p in found:
        with suppress(psutil.NoSuchProcess):  # a worker that ended meanwhile
            if p.ppid() not in pids:
                stage.append(p)
    return stage


def test_a_dvc_repro_beside_the_trainer_of_a_stopped_one_waits_for_it(project, tmp_path, baseline):
    """Plain `dvc repro` whose DVC alone gets a scheduler's SIGTERM: its trainer lives on (here
    paused in epoch 2). A second `dvc repro` does not train beside it: it names its pid and
    waits; `kill PID`, as that line says, stops the orphan at its epoch's end, and the second
    resumes from that checkpoint to the uninterrupted run's weights."""
    go, log = tmp_path / "go", tmp_path / "first.log"
    dvc = [str(Path(sys.executable).parent / "dvc"), "repro", "-f", "-s", "train"]
    paused = env(project, f"train.loss@epoch=2,step=1:pause={go}")
    with log.open("w") as out:  # a file: the trainer writes on after DVC is gone
        first = subprocess.Popen(dvc, cwd=project, env=paused, stdout=out, stderr=out)
    try:
        while "fault: pause" not in log.read_text():
            assert first.poll() is None, log.read_text()
            time.sleep(0.1)
        [orphan] = stage_trainers(project)
        first.send_signal(signal.SIGTERM)  # DVC alone, not the stage's process group
        first.wait(timeout=120)
        second = subprocess.Popen(
            dvc,
            cwd=project,
            env=env(project),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        seen = read_until(second, f"another trainer (pid {orphan.pid}) holds checkpoints/train")
        assert len(stage_trainers(project)) == 2  # the orphan in its epoch, the second waiting
        orphan.send_signal(signal.SIGTERM)
        go.touch()
        seen += read_until(second, "resuming from")
        assert orphan not in trainers(project)  # it had ended
        output = seen + second.communicate(timeout=300)[0]
    finally:
        go.touch()
        for trainer in trainers(project):
            trainer.kill()
    assert "train stopped after epoch 2" in log.read_text()
    assert second.returncode == 0, output
    assert re.search(r"resuming from checkpoints/train/\w+/epoch-0002\.pt", output), output
    assert same_weights(weights(project), baseline)
    assert_invariants(project)


def test_a_killed_prepare_is_restored_whatever_it_printed_or_left(project, tmp_path):
    left = project / "data/prepared.partial"
    left.mkdir()
    (left / "train_x.npy").write_bytes(b"half an array")  # what a killed prepare leaves
    run = start(
        project, "-f", "-s", "prepare", fault=f"stage.start@stage=prepare:pause={tmp_path}/n"
    )
    read_until(run, "fault: pause")
    assert not (project / "data/prepared").exists()  # DVC deleted it before the stage ran
    dvc = next(c for c in psutil.Process(run.pid).children() if "dvc" in " ".join(c.cmdline()))
    dvc.send_signal(signal.SIGKILL)  # no DVC error line at all: the exit code says it failed
    output = run.communicate(timeout=300)[0]
    assert run.returncode != 0 and "restored the previous results" in output, output
    assert (project / "data/prepared/manifest.json").exists() and not left.exists()
    assert_invariants(project)


def test_a_kill_just_after_export_promoted_its_files_restores_the_recorded_export(project):
    lock = (project / "dvc.lock").read_bytes()
    killed = repro(project, "-f", "-s", "export", fault="stage.published@stage=export:kill")
    assert killed.returncode != 0
    assert "restored the previous results" in killed.stderr, killed.stdout + killed.stderr
    assert (project / "dvc.lock").read_bytes() == lock
    assert dvc_clean(project)  # the unrecorded export is gone, the recorded one is back
    assert_invariants(project)


def test_two_runs_started_together_never_overlap(project, tmp_path):
    note_in_params(project, "a comment: check alone reruns")
    go = tmp_path / "go"  # the run that gets the workspace holds it in its stage
    runs = [start(project, fault=f"stage.start@stage=check:pause={go}") for _ in range(2)]
    outputs = [[], []]
    readers = [
        threading.Thread(target=lambda r=r, out=out: out.extend(r.stdout), daemon=True)
        for r, out in zip(runs, outputs, strict=True)
    ]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 120
    while not ("fault: pause" in str(outputs) and "waiting for it" in str(outputs)):
        assert time.monotonic() < deadline, outputs
        time.sleep(0.1)  # one run paused in its stage, the other waiting for the workspace
    go.touch()
    for run, reader in zip(runs, readers, strict=True):
        run.wait(timeout=300)
        reader.join(timeout=60)
    outputs = ["".join(lines) for lines in outputs]
    assert [r.returncode for r in runs] == [0, 0], outputs
    waited = [o for o in outputs if "another run holds this workspace: waiting" in o]
    assert len(waited) == 1  # the other went first
    assert ran(waited[0]) == [] and "Data and pipelines are up to date" in waited[0]
    first = next(o for o in outputs if o is not waited[0])
    assert ran(first) == ["check"]
    assert params_recorded(project)  # the edit's run was recorded
    assert_invariants(project)


def test_a_flipped_byte_in_the_cache_is_found_before_training(project):
    array = project / "data/prepared/train_x.npy"
    good = array.read_bytes()
    flipped = bytearray(good)
    flipped[-10] ^= 0xFF
    array.write_bytes(bytes(flipped))
    verify = sh(project, sys.executable, "-m", "visionflow.cli", "verify", check=False)
    assert verify.returncode == 1 and "data/prepared/train_x.npy: sha256" in verify.stdout
    failed = repro(project, "-f", "-s", "train")
    assert failed.returncode != 0
    assert "the prepared cache is corrupted: data/prepared/train_x.npy: sha256" in failed.stdout
    assert "epoch   1" not in failed.stdout  # refused before any training
    sh(project, "dvc", "checkout", "--force", "data/prepared")
    assert array.read_bytes() == good
    assert sh(project, sys.executable, "-m", "visionflow.cli", "verify").returncode == 0
    assert_invariants(project)


def test_verify_names_a_corrupted_dvc_cache_object(project):
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    out = next(o for o in lock["stages"]["evaluate"]["outs"] if o["path"] == "results/evaluate")
    listing = project / ".dvc/cache/files/md5" / out["md5"][:2] / out["md5"][2:]
    entry = next(e for e in json.loads(listing.read_text()) if e["relpath"] == "metrics.json")
    obj = project / ".dvc/cache/files/md5" / entry["md5"][:2] / entry["md5"][2:]
    good = obj.read_bytes()
    obj.chmod(0o644)
    obj.write_bytes(good.replace(b"{", b"[", 1))
    verify = sh(project, sys.executable, "-m", "visionflow.cli", "verify", check=False)
    assert verify.returncode == 1
    assert f"results/evaluate/metrics.json: object {obj} has md5" in verify.stdout
    obj.write_bytes(good)
    assert "all good" in sh(project, sys.executable, "-m", "visionflow.cli", "verify").stdout


def test_a_run_with_nothing_changed_changes_no_file(project):
    before = file_hashes(project)
    again = repro(project)
    assert again.returncode == 0 and ran(again.stdout) == []
    assert file_hashes(project) == before


def test_ctrl_c_during_prepares_decoding_stops_its_pool_at_once(project, image_folder, tmp_path):
    """Under plain `dvc repro`, Ctrl-C reaches the whole foreground group: DVC ignores it, the
    decoding workers ignore it too, and the stage stops them (no traceback per worker, no hang)."""
    folder = {"source": "imagefolder", "path": str(image_folder), "max_bad_fraction": 0.5}
    write_params(project, {"prepare": {**folder, "workers": 2}})
    run = subprocess.Popen(
        [str(Path(sys.executable).parent / "dvc"), "repro", "-s", "prepare"],
        cwd=project,
        env=env(project, f"prepare.decode@index=3:pause={tmp_path / 'never'}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a group of its own, as a terminal's foreground job
    )
    read_until(run, "fault: pause")  # a worker is at work on an image
    os.killpg(run.pid, signal.SIGINT)
    output = run.communicate(timeout=120)[0]  # today's hang was for good
    assert run.returncode != 0
    assert "interrupted" in output and "Traceback" not in output, output
    left = [p for p in psutil.process_iter(["cmdline", "cwd"]) if p.info["cwd"] == str(project)]
    assert not [p for p in left if "pipeline.prepare" in " ".join(p.info["cmdline"] or [])]
    sh(project, "dvc", "checkout")  # plain DVC: the previous cache comes back
    assert (project / "data/prepared/manifest.json").exists()


def test_a_second_ctrl_c_ends_an_epoch_that_cannot_finish_with_one_line_and_130(project, tmp_path):
    """Plain `dvc repro` in a terminal, a memory-mapped split (DataLoader workers that ignore
    Ctrl-C): the first Ctrl-C asks to finish the epoch, which cannot (a batch never comes); the
    second ends the stage at once with its one line and 130, and no process of it is left. Seen
    on photo folders: `stopped at once`, then the stage ran on for 1-2 minutes."""
    write_params(project, {"train": {"max_memory_gb": 0}})  # memory-mapped: loader workers
    asked = tmp_path / "asked"  # the first Ctrl-C reached the stage: an event, not a wait
    fault = f"train.batch@epoch=1,step=2:pause={tmp_path / 'never'};train.stop:touch={asked}"
    run = subprocess.Popen(
        [str(Path(sys.executable).parent / "dvc"), "repro", "-s", "train"],
        cwd=project,
        # DVC runs a stage through $SHELL, else /bin/sh: dash stays the stage's parent and,
        # given the group's Ctrl-C too, ends by SIGINT after the stage's 130 (DVC: -2); bash (a
        # terminal's usual $SHELL) runs the stage in its place
        env=env(project, fault) | {"SHELL": "/bin/bash"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a group of its own, as a terminal's foreground job
    )
    try:
        seen = read_until(run, "fault: pause")  # the epoch's second batch never comes
        assert "(memory-mapped)" in seen, seen
        workers = [
            p for p in trainers(project) if "pipeline.train" in " ".join(p.parent().cmdline())
        ]
        assert workers  # the loader's, alive while the batch waits
        os.killpg(run.pid, signal.SIGINT)  # a terminal's Ctrl-C: the foreground process group
        while not asked.exists():
            assert run.poll() is None, seen + run.communicate()[0]
            time.sleep(0.05)
        os.killpg(run.pid, signal.SIGINT)
        output = seen + run.communicate(timeout=300)[0]  # the stage's end, and DVC's after it
        said = [line for line in output.splitlines() if line.startswith("interrupted:")]
        assert said == ["interrupted: stopped at once"] and "Traceback" not in output, output
        assert "exited with 130" in output, output  # the stage's code, in DVC's line
        assert not trainers(project) and not any(w.is_running() for w in workers)
    finally:  # a failure leaves no paused stage behind
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)


def test_a_stage_that_ignores_its_stop_is_killed_after_the_grace_period(project, tmp_path):
    never = tmp_path / "never"  # training stays paused: it never reaches its safe point
    run = start(project, "-f", "-s", "train", fault=f"train.loss@epoch=2,step=1:pause={never}")
    read_until(run, "fault: pause")
    os.kill(run.pid, signal.SIGTERM)
    run.communicate(timeout=300)  # 5 s of grace (the suite's), then SIGKILL; before, for good
    assert run.returncode != 0 and not trainers(project)
    assert_invariants(project)


def test_a_stop_as_a_stage_ends_keeps_dvc_from_starting_the_next_one(project, tmp_path):
    go = tmp_path / "go"  # train has put its outputs in place and is about to exit 0
    fault = f"stage.published@stage=train:pause={go};train.stop:touch={go}"
    evaluate = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["evaluate"]
    results = file_hashes(project / "results/evaluate")
    run = start(project, "-f", "--downstream", "train", fault=fault, **SAFE_POINT_GRACE)
    read_until(run, "fault: pause")
    os.kill(run.pid, signal.SIGTERM)
    output = run.communicate(timeout=300)[0]
    # DVC stops as it starts evaluate (before its command, or the command at its start)
    assert run.returncode != 0 and "Running stage 'export'" not in output, output
    assert yaml.safe_load((project / "dvc.lock").read_text())["stages"]["evaluate"] == evaluate
    assert file_hashes(project / "results/evaluate") == results  # restored
    assert "restored the previous results" in output
    assert_invariants(project)


def test_a_failed_run_restores_stage_outputs_only_never_dvc_added_data(project):
    photos = project / "data/photos"
    photos.mkdir()
    (photos / "a.txt").write_text("tracked")
    sh(project, "dvc", "add", "-q", "data/photos")
    (photos / "new.txt").write_text("added since, not yet tracked")  # the user's own work
    failed = repro(project, "no-such-stage")
    assert failed.returncode != 0 and "restored the previous results" in failed.stderr
    assert (photos / "new.txt").read_text() == "added since, not yet tracked"


@pytest.mark.parametrize("value", ["abc", "-1", "nan"])
def test_a_grace_period_that_is_no_number_of_seconds_is_refused_up_front(project, value):
    result = subprocess.run(
        repro_cmd(),
        cwd=project,
        env=env(project, VISIONFLOW_STOP_GRACE_S=value),
        text=True,
        capture_output=True,
    )
    assert result.returncode == 2
    assert f"VISIONFLOW_STOP_GRACE_S={value!r} is not a number of seconds >= 0" in result.stderr


def test_a_stage_that_prints_bytes_that_are_not_utf8_runs_to_the_end(project):
    add_stage(project, "latin", LATIN, "latin.txt")
    done = repro(project, "latin")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "caf\\xe9" in done.stdout and "Traceback" not in done.stderr
    assert (project / "latin.txt").exists() and dvc_clean(project)


def test_a_stop_while_the_stage_imports_exits_130_with_one_line(project, tmp_path):
    never = tmp_path / "never"  # evaluate paused among its imports (torch's take seconds)
    run = start(project, "-f", "-s", "evaluate", fault=f"stage.import@stage=evaluate:pause={never}")
    read_until(run, "fault: pause")
    os.kill(run.pid, signal.SIGTERM)
    output = run.communicate(timeout=300)[0]
    assert run.returncode == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert "interrupted: stopped while the stage was starting" in output
    assert output.count("stopped by SIGTERM") == 1 and "the run stopped by SIGTERM" in output
    assert "restored the previous results" in output and dvc_clean(project)


def test_a_stage_killed_after_a_grace_of_0_says_so_and_exits_130(project, tmp_path):
    never = tmp_path / "never"
    run = start(
        project,
        "-f",
        "-s",
        "train",
        fault=f"train.loss@epoch=2,step=1:pause={never}",
        VISIONFLOW_STOP_GRACE_S="0",
    )
    read_until(run, "fault: pause")
    os.kill(run.pid, signal.SIGTERM)
    output = run.communicate(timeout=300)[0]
    assert run.returncode == 130, output  # was 247: -9, DVC's own death
    assert "killed after VISIONFLOW_STOP_GRACE_S=0 s without reaching its safe point" in output
    assert not trainers(project)
    failed = repro(project, "-f", "-s", "sanity", fault="stage.start@stage=sanity:raise")
    assert failed.returncode == 255 and "stopped by" not in failed.stderr  # a failure stays 255
    assert_invariants(project)


def test_a_stage_lock_file_a_kill_left_half_written_is_mended_by_the_next_run(project):
    rwlock = project / ".dvc/tmp/rwlock"  # DVC truncates it, then writes: a SIGKILL between
    rwlock.parent.mkdir(exist_ok=True)  # (`dvc` killed with a stage past its grace) leaves this
    rwlock.write_text('{"write": {"results/tr')
    assert "RWLock-file" in sh(project, "dvc", "repro", "-f", "-s", "check", check=False).stderr
    mended = repro(project, "-f", "-s", "check")
    assert mended.returncode == 0, mended.stdout + mended.stderr
    assert "removed DVC's stage lock file (.dvc/tmp/rwlock)" in mended.stderr
    sh(project, "dvc", "repro", "-f", "-s", "check")  # the plain command works again


def test_a_runner_killed_before_its_restore_leaves_it_to_the_next_run(project, tmp_path):
    never = tmp_path / "never"  # as Prefect kills a cancelled flow run's process after 30 s
    run = start(project, "-f", "-s", "train", fault=f"train.loss@epoch=2,step=1:pause={never}")
    read_until(run, "fault: pause")
    os.kill(run.pid, signal.SIGKILL)
    run.communicate(timeout=300)
    with open(project / ".dvc/tmp/visionflow-run.lock") as lock:  # the reaper lets go of it
        fcntl.flock(lock, fcntl.LOCK_EX)  # once the stage is gone (5 s of grace, then SIGKILL)
    assert not (project / "results/train").exists()  # DVC deleted it; nobody restored it
    nxt = repro(project)
    assert nxt.returncode == 0, nxt.stdout + nxt.stderr
    said = "the previous run left its results unrestored (killed first, or no room on the disk)"
    assert said in nxt.stderr and "restored the previous results" in nxt.stderr
    assert ran(nxt.stdout) == [] and dvc_clean(project)  # restored, not retrained


def torchrun_train(project: Path) -> None:
    """The train stage under `torchrun`, two CPU ranks (gloo), as the manual says to run it."""
    spec = yaml.safe_load((project / "dvc.yaml").read_text())
    cmd = spec["stages"]["train"]["cmd"].replace(
        "python -m", "torchrun --standalone --nproc_per_node 2 -m"
    )
    spec["stages"]["train"]["cmd"] = cmd
    (project / "dvc.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def test_a_kill_after_the_grace_period_reaches_every_torchrun_rank(project, tmp_path):
    torchrun_train(project)
    never = tmp_path / "never"  # every rank paused: none reaches its safe point
    run = start(project, "-f", "-s", "train", fault=f"train.loss@epoch=1,step=1:pause={never}")
    read_until(run, "fault: pause")
    ranks = [p for p in trainers(project) if "torchrun" not in " ".join(p.cmdline())]
    assert len(ranks) == 2 and all(os.getsid(p.pid) == p.pid for p in ranks)  # own sessions
    shutdown = {p.environ().get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") for p in ranks}
    os.kill(run.pid, signal.SIGTERM)
    output = run.communicate(timeout=300)[0]
    left = [p for p in ranks if p.is_running() and p.status() != "zombie"]
    for p in left:  # before: both ranks kept training, the workspace free
        p.kill()
    assert not left and run.returncode == 130, output
    assert shutdown == {"5"}  # torchrun waits for its ranks as long as the runner does


def test_a_dvc_lock_cut_inside_an_entry_is_named_and_no_restore_is_claimed(project):
    lock = project / "dvc.lock"
    text = lock.read_text()
    lock.write_text(text[: text.rindex("    outs:\n") + len("    outs:\n")])  # YAML still reads
    result = repro(project)
    assert result.returncode == 1 and ran(result.stdout) == [], result.stdout + result.stderr
    assert "dvc.lock is damaged (cut short or edited" in result.stderr
    assert "git checkout dvc.lock" in result.stderr and "restore" not in result.stderr


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 64 MB tmpfs of its own, to fill (mounting needs root: skipped otherwise)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)


@contextmanager
def filled(disk: Path) -> Iterator[Path]:
    """`disk` full to the last page, and kept full (another writer takes any page freed, by DVC
    say) until the block ends; then the filler file goes."""
    filler, done = disk / "filler", threading.Event()
    handle = open(filler, "wb", buffering=0)

    def fill() -> None:
        for size in (2**20, 2**12, 1):
            try:
                while True:
                    handle.write(b"\0" * size)
            except OSError:
                pass

    def keep_full() -> None:
        while not done.wait(0.01):
            fill()

    fill()
    keeper = threading.Thread(target=keep_full, daemon=True)
    keeper.start()
    try:
        yield filler
    finally:
        done.set()
        keeper.join()
        handle.close()
        filler.unlink()


def test_a_disk_that_fills_while_prepare_decodes_is_named_and_the_results_come_back(
    reproduced_base, small_disk, image_folder, tmp_path
):
    project = copy_project(reproduced_base, small_disk / "project")
    params = (project / "params.yaml").read_text()
    folder = {"source": "imagefolder", "path": str(image_folder), "max_bad_fraction": 0.5}
    rgb = {"image_size": 64, "color": "rgb"}  # 12 KB an image: each has pages of its own
    write_params(project, {"prepare": {**folder, "workers": 2, **rgb}})
    go = tmp_path / "go"  # a worker holds image 3; the disk fills before it writes its pixels
    run = start(project, "-s", "prepare", fault=f"prepare.decode@index=3:pause={go}")
    read_until(run, "fault: pause")
    with filled(small_disk):
        go.touch()
        output = run.communicate(timeout=300)[0]
    assert run.returncode == 255, output
    assert "disk full: no room to write in" in output and "SIGBUS" not in output, output
    (project / "params.yaml").write_text(params)
    again = repro(project)  # restores first if the full disk kept the first restore from it
    assert again.returncode == 0 and ran(again.stdout) == [], again.stdout + again.stderr
    assert dvc_clean(project) and (project / "data/prepared/manifest.json").exists()


def test_the_reaper_kills_what_the_group_started_in_a_session_of_its_own_once_it_is_empty(
    tmp_path,
):
    """The runner dies; the group ends on the reaper's SIGINT but leaves a process in a session
    of its own (as torchrun's ranks are). Before, the reaper found the group empty and swept
    nothing: the process kept running."""
    from visionflow.ops.runner import REAPER

    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, subprocess; signal.signal(signal.SIGINT, signal.SIG_DFL); "
            "rank = subprocess.Popen(['sleep', '600'], start_new_session=True); "
            "print(rank.pid, flush=True); signal.pause()",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    rank = psutil.Process(int(leader.stdout.readline()))
    output, keep = os.pipe()  # the group's output, which the reaper drains
    reaper = subprocess.Popen(
        [sys.executable, str(REAPER), str(leader.pid), "300", str(output)],
        stdin=subprocess.PIPE,
        pass_fds=(output,),
    )
    try:
        reaper.stdin.close()  # the runner died: the reaper stops the group
        assert leader.wait(timeout=60) == -signal.SIGINT
        assert reaper.wait(timeout=60) == 0  # the group empty, long before the grace ends
        deadline = time.monotonic() + 60  # SIGKILLed by the reaper (it is not our child)
        while rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the process outlived its group and the reaper"
            time.sleep(0.1)
    finally:
        os.close(keep)
        os.close(output)
        if rank.is_running():
            rank.kill()
        reaper.kill()
