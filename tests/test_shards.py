"""The prepared cache in shards (`prepare.shard_images`, issue #37): placement by each image's own
hash, shards cut where the content says, a few new images move a few shards through `dvc push`,
and a split of several shards reads and trains as one file."""

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import ROOT, python_path, sh, write_params
from visionflow.data import dataset, shards, sources
from visionflow.data.splits import SPLITS
from visionflow.errors import DataError
from visionflow.train import loading


def noise_pngs(root: Path, names: list[str], seed: int) -> None:
    """8x8 RGB PNGs of random pixels, one per name (`class/file.png`)."""
    rng = np.random.default_rng(seed)
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / name)


def build(images: Path, out: Path, shard_images: int, workers: int = 1) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    source = sources.load_source("imagefolder", images)
    decode = dataset.Decode(8, "rgb")
    split = {"val_fraction": 0.15, "test_fraction": 0.2, "seed": 0}
    return dataset.build_cache(
        source, out, decode, **split, workers=workers, shard_images=shard_images
    )


def md5s(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def objects(storage: Path) -> set[Path]:
    return {p for p in storage.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_ten_new_images_in_two_thousand_change_a_few_shards_and_dvc_pushes_only_those(tmp_path):
    """Issue #37's done-when: with `shard_images: 64`, 10 images added to 2,000 change at most
    half of the cache's files, and `dvc push` uploads only the changed ones."""
    images, repo, storage = tmp_path / "images", tmp_path / "repo", tmp_path / "storage"
    noise_pngs(images, [f"c{i % 4}/{i:04d}.png" for i in range(2000)], seed=0)
    repo.mkdir()
    sh(repo, "git", "init", "-q")
    sh(repo, "dvc", "init", "-q")
    sh(repo, "dvc", "remote", "add", "-d", "storage", str(storage))
    cache = repo / "prepared"
    manifest = build(images, cache, 64)
    assert all(len(names) > 1 for names in manifest["shards"].values())
    assert max(entry["shape"][0] for entry in manifest["files"].values() if "shape" in entry) <= 64
    before = md5s(cache)
    sh(repo, "dvc", "add", "prepared")
    sh(repo, "dvc", "push")
    pushed = objects(storage)

    noise_pngs(images, [f"c{i % 4}/new{i}.png" for i in range(10)], seed=1)
    build(images, cache, 64)
    after = md5s(cache)
    changed = {name for name, md5 in after.items() if before.get(name) != md5}
    print(f"{len(changed)} of {len(after)} cache files changed: {sorted(changed)}")
    assert len(changed) <= len(after) / 2
    assert {"manifest.json", "stats.json"} <= changed
    sh(repo, "dvc", "add", "prepared")
    sh(repo, "dvc", "push")
    uploaded = objects(storage) - pushed
    new_content = {after[name] for name in changed} - set(before.values())
    print(f"dvc push uploaded {len(uploaded)} objects ({len(new_content)} files and the listing)")
    assert {p.name for p in uploaded if not p.name.endswith(".dir")} == {
        md5[2:] for md5 in new_content
    }
    assert len(uploaded) == len(new_content) + 1  # and the folder's .dir listing

    build(images, tmp_path / "parallel", 64, workers=2)  # any prepare.workers: the same bytes
    assert md5s(tmp_path / "parallel") == after


def test_placement_is_per_image_stratified_and_moves_nothing_when_images_are_added():
    names = [f"{c}/{i}.png" for c in ("a", "b", "c") for i in range(300)] + ["d/0", "d/1", "d/2"]
    labels = np.array([0] * 300 + [1] * 300 + [2] * 300 + [3] * 3)
    split = shards.hash_split(labels, shards.image_keys(names, 0), 0.15, 0.2)
    where = {names[i]: s for s, index in split.items() for i in index}
    for c in range(3):
        in_class = np.flatnonzero(labels == c)
        test = np.isin(in_class, split["test"]).mean()
        val = np.isin(in_class, split["val"]).mean()
        assert test == pytest.approx(0.2, abs=0.05) and val == pytest.approx(0.8 * 0.15, abs=0.05)
    assert sorted(where[n] for n in ("d/0", "d/1", "d/2")) == ["test", "train", "val"]

    more = names[:900] + [f"a/new{i}.png" for i in range(30)]
    labels = np.concatenate([labels[:900], np.zeros(30, dtype=np.int64)])
    moved = shards.hash_split(labels, shards.image_keys(more, 0), 0.15, 0.2)
    assert all(where[more[i]] == s for s, index in moved.items() for i in index if i < 900)
    other_seed = shards.hash_split(labels, shards.image_keys(more, 1), 0.15, 0.2)
    assert not np.array_equal(other_seed["test"], moved["test"])

    keys = shards.image_keys(more, 0)
    cut = shards.cut(moved["train"], keys, "train", 16)
    assert np.array_equal(np.concatenate(list(cut.values())), moved["train"])
    assert max(map(len, cut.values())) <= 16 and sorted(cut) == list(cut)  # names in order
    with pytest.raises(DataError, match="no val images: the hashes of 2 images' names"):
        shards.hash_split(np.array([0, 1]), shards.image_keys(["a", "b"], 0), 0.15, 0.2)


def test_a_small_class_keeps_training_images_whichever_placement(tmp_path):
    """A class of 5 whose names' hashes place them all in val and test (before: train 0, val 2,
    test 3, and prepare succeeded) trains on one of them; a class the split leaves without a
    training image (all in a source's own test split) is refused in one line, either placement."""
    keys = shards.image_keys([f"tiny/{i}.png" for i in range(100)], 0)
    held_out = np.flatnonzero(keys[:, 0] / 2.0**64 < 0.2 + 0.8 * 0.15)  # test, then val
    names = [f"tiny/{i}.png" for i in held_out[:5]] + [f"big/{i}.png" for i in range(40)]
    noise_pngs(tmp_path / "images", names, seed=0)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    prepare = {"source": "imagefolder", "path": "images", "image_size": 8, "color": "rgb"}
    write_params(tmp_path, {"prepare": {**prepare, "shard_images": 4, "min_per_class": 5}})
    env = {**os.environ, "PYTHONPATH": python_path(ROOT, ROOT / "src")}
    made = subprocess.run(
        [sys.executable, "-m", "pipeline.prepare", "--out", "prepared"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    counts = json.loads((tmp_path / "prepared/manifest.json").read_text())["counts"]
    assert counts["train"]["tiny"] == 1 and sum(counts[s]["tiny"] for s in SPLITS) == 5

    def prepare_once(**popen) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pipeline.prepare", "--out", "again"],
            cwd=tmp_path, env=env, capture_output=True, text=True, **popen,
        )  # fmt: skip

    # a file past the process's largest (`ulimit -f`; FAT32's 4 GB): one line, not a traceback
    small_files = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))  # noqa: E731
    too_large = prepare_once(preexec_fn=small_files)
    assert too_large.returncode == 1 and "Traceback" not in too_large.stderr, too_large.stderr
    assert "grew past the largest this allows" in too_large.stderr
    # one image in a class, one file per split: the class named (it was an index, [2])
    (tmp_path / "images/one").mkdir()
    shutil.copy(tmp_path / "images" / names[-1], tmp_path / "images/one/0.png")
    write_params(tmp_path, {"prepare": {**prepare, "shard_images": 0, "min_per_class": 1}})
    refused = prepare_once()
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "(a class needs 2 images for a stratified split): {'one': 1}" in refused.stderr

    pixels = np.random.default_rng(0).integers(0, 256, (20, 8, 8), dtype=np.uint8)
    labels = np.arange(20) % 2
    only_in_test = sources.Source(
        list(pixels), labels, ["a", "b"], labels == 1, [f"#{i}" for i in range(20)]
    )
    for shard_images in (0, 4):
        with pytest.raises(DataError, match=r"^no training images for classes \['b'\]: "):
            dataset.build_cache(
                only_in_test, tmp_path / f"refused{shard_images}", dataset.Decode(8, "grayscale"),
                val_fraction=0.15, test_fraction=0.2, seed=0, shard_images=shard_images,
            )  # fmt: skip


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> tuple[Path, Path]:
    """The digits at 8x8 in shards of at most 16 images, and the same in one shard per split."""
    root = tmp_path_factory.mktemp("caches")
    source, decode = sources.load_source("digits", None), dataset.Decode(8, "grayscale")
    for name, size in (("many", 16), ("one", 10**6)):
        dataset.build_cache(
            source, root / name, decode, val_fraction=0.15, test_fraction=0.2, seed=0,
            shard_images=size, origin={"source": "digits"},
        )  # fmt: skip
    return root / "many", root / "one"


def test_a_split_in_many_shards_reads_and_trains_as_one_file(caches, tmp_path, monkeypatch):
    many, one = caches
    listed = json.loads((many / "manifest.json").read_text())["shards"]
    assert min(len(listed[s]) for s in SPLITS) > 5
    assert all(
        len(n) == 1 for n in json.loads((one / "manifest.json").read_text())["shards"].values()
    )
    assert (many / "stats.json").read_bytes() == (one / "stats.json").read_bytes()
    for split in SPLITS:
        (x, y), (x1, y1) = (
            dataset.read_split(many, split, mmap=True),
            dataset.read_split(one, split),
        )
        assert isinstance(x, shards.Shards) and x.shape == x1.shape and x.nbytes == x1.nbytes
        assert np.array_equal(np.asarray(x), x1) and np.array_equal(y, y1)
        assert np.array_equal(x[7:40][3:9], x1[10:16]) and np.array_equal(x[-3], x1[-3])
        assert np.array_equal(x[[5, 0, -1, 5]], x1[[5, 0, -1, 5]])
        with monkeypatch.context() as patch:  # fewer maps than shards: the oldest are closed
            patch.setattr(shards, "map_limit", lambda: 2)
            few = dataset.read_split(many, split, mmap=True)[0]
            assert np.array_equal(few[::-1], x1[::-1]) and len(few.maps) == 2

    # the train stage's loader: streamed from the shards (DataLoader workers), from one file,
    # or held in memory, the same batches in the same order
    x, y = loading.load_for_training(many, "train", torch.device("cpu"), max_bytes=0)
    np.save(tmp_path / "train_x.npy", np.asarray(x))
    one_file = np.load(tmp_path / "train_x.npy", mmap_mode="r")
    held, _ = loading.load_for_training(one, "train", torch.device("cpu"), max_bytes=2**30)
    assert isinstance(x, shards.Shards) and torch.is_tensor(held)

    def epoch(images, **ddp):
        generator = torch.Generator().manual_seed(3)
        return list(loading.batches(images, y, 100, generator, **ddp))

    streamed = epoch(x)
    assert len(streamed) == 13
    # however many workers the machine gives (its cores shared among the ranks on it)
    for other in (epoch(one_file), epoch(held), epoch(x, workers=0), epoch(x, workers=3)):
        for (a, b), (c, d) in zip(streamed, other, strict=True):
            assert torch.equal(a, c) and torch.equal(b, d)
    second_rank = epoch(x, rank=1, world=2)
    assert all(
        torch.equal(a, c)
        for (a, _), (c, _) in zip(second_rank, epoch(held, rank=1, world=2), strict=True)
    )

    monkeypatch.setattr(loading.os, "sched_getaffinity", lambda pid: set(range(16)))
    for ranks_here, workers in (("1", 8), ("4", 4), ("32", 1), ("0", 8), ("two", 8)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks_here)
        assert loading.loader_workers() == workers

    from pipeline.sanity import scan
    from visionflow.deploy.quantize import calibration_sample

    assert scan(many, dataset.read_cache_meta(many).classes) == scan(
        one, dataset.read_cache_meta(one).classes
    )
    assert np.array_equal(calibration_sample(x, 50), calibration_sample(one_file, 50))
    assert np.array_equal(np.ascontiguousarray(x[:8]), one_file[:8])  # export's parity batch


def test_a_missing_shard_is_named(caches, tmp_path):
    many = shutil.copytree(caches[0], tmp_path / "many")
    name = json.loads((many / "manifest.json").read_text())["shards"]["val"][2]
    (many / f"{name}_x.npy").unlink()
    with pytest.raises(
        DataError, match=rf"lists shard {name}_x.npy of the val split, which is missing"
    ):
        dataset.read_split(many, "val", mmap=True)
    with pytest.raises(DataError, match=rf"{name}_x.npy: sha256 missing"):
        dataset.verify_cache(many)


@pytest.mark.slow
def test_every_stage_reads_a_sharded_cache(caches, tmp_path):
    """sanity, train (the split streamed from its shards) and evaluate, as DVC runs them (export
    reads the cache as the tests above do: a slice of the test split, `calibration_sample`)."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(caches[0], tmp_path / "prepared")
    write_params(
        tmp_path,
        {
            "train": {"epochs": 1, "batch_size": 32, "max_memory_gb": 0.0},
        },
    )
    env = {**os.environ, "PYTHONPATH": python_path(ROOT)}
    said = {}
    for stage in (
        "sanity --data prepared --out sanity",
        "train --data prepared --out train --checkpoints checkpoints",
        "evaluate --model train/model.pt --data prepared --out evaluate",
    ):
        name, *args = stage.split()
        run = subprocess.run(
            [sys.executable, "-m", f"pipeline.{name}", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=env,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        said[name] = run.stdout
    assert "memory-mapped" in said["train"]
    test_images = sum(
        json.loads((tmp_path / "prepared/manifest.json").read_text())["counts"]["test"].values()
    )
    assert json.loads((tmp_path / "evaluate/scores.json").read_text())["images"] == test_images
