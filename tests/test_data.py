import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import ROOT, python_path, solid, write_params
from visionflow.data import archive, dataset, pool, sources, splits
from visionflow.train import loading

RGB8 = dataset.Decode(8, "rgb")


def build(source, out, decode=RGB8, **kwargs):
    options = {
        "val_fraction": 0.25,
        "test_fraction": 0.25,
        "seed": 0,
        "workers": 1,
        "max_bad_fraction": 0.5,
        "min_per_class": 1,
        **kwargs,
    }
    return dataset.build_cache(source, out, decode, **options)


def test_digits_is_the_real_offline_dataset():
    source = sources.load_source("digits", None)
    assert len(source.labels) == 1797 and source.classes == [str(i) for i in range(10)]
    pixels = dataset.to_pixels(source.images[0], dataset.Decode(16, "grayscale"))
    assert pixels.shape == (16, 16, 1) and pixels.dtype == np.uint8 and pixels.max() > 200


def test_imagefolder_classes_files_and_pixels(image_folder):
    source = sources.load_source("imagefolder", image_folder)
    assert source.classes == ["blue", "green", "red"]  # sorted; .ipynb_checkpoints is no class
    assert np.bincount(source.labels).tolist() == [8, 8, 8]  # nested .jpg count; hidden files don't
    assert ".hidden.png" not in " ".join(source.names)
    assert source.skipped == {
        f"{c}/notes.txt": "not an image file type (.txt)" for c in ("blue", "green", "red")
    }
    red = dataset.to_pixels(
        source.images[source.names.index("red/5.png")], dataset.Decode(12, "rgb")
    )
    assert (red[4:] == [255, 0, 0]).all()  # solid stays exactly red through the resize
    assert red[0, 5, 1] > 60 and red[0, 0].tolist() == [255, 0, 0]  # the grey mark stays in place
    gray = dataset.to_pixels(
        source.images[source.names.index("blue/0.png")], dataset.Decode(8, "grayscale")
    )
    assert gray.shape == (8, 8, 1) and int(gray[-1, -1, 0]) == 29  # PIL's luma of pure blue


def test_imagefolder_empty_or_missing_class_is_named(image_folder, tmp_path):
    (image_folder / "zebra").mkdir()
    with pytest.raises(dataset.DataError, match="class 'zebra'"):
        sources.load_source("imagefolder", image_folder)
    with pytest.raises(dataset.DataError, match="nothing-here"):
        sources.load_source("imagefolder", tmp_path / "nothing-here")


def test_class_below_min_per_class_is_named(image_folder, tmp_path):
    for f in [
        *(image_folder / "green").glob("[2-5].png"),
        *(image_folder / "green").rglob("*.jpg"),
    ]:
        f.unlink()  # green keeps 0.png and 1.png
    source = sources.load_source("imagefolder", image_folder)
    with pytest.raises(dataset.DataError, match=r"minimum of 5 images: \{.green.: 2\}"):
        build(source, tmp_path / "out", min_per_class=5)


def test_links_are_never_followed_so_no_image_gets_two_labels(image_folder, tmp_path):
    """One rule for links, wherever they point: skipped and named in rejects.json. Before, an alias
    class folder became a class of copies and a loop recursed; a dangling link crashed the pool."""
    outside = tmp_path / "secret.png"
    solid((1, 2, 3)).save(outside)
    (image_folder / "red" / "link.png").symlink_to(outside)
    (image_folder / "red" / "inside.png").symlink_to(image_folder / "red" / "0.png")
    (image_folder / "green" / "also_red.png").symlink_to(image_folder / "red" / "1.png")
    (image_folder / "red" / "dangling.png").symlink_to(tmp_path / "gone.png")
    (image_folder / "red_alias").symlink_to(image_folder / "red")
    (image_folder / "blue" / "loop").symlink_to(image_folder)
    source = sources.load_source("imagefolder", image_folder)
    assert source.classes == ["blue", "green", "red"]
    links = [
        "blue/loop",
        "green/also_red.png",
        "red/dangling.png",
        "red/inside.png",
        "red/link.png",
        "red_alias",
    ]
    assert (
        sorted(k for k, why in source.skipped.items() if "links are not followed" in why) == links
    )
    assert not any(name in source.names for name in links)
    manifest = build(source, tmp_path / "out", max_bad_fraction=1.0)
    assert sum(sum(c.values()) for c in manifest["counts"].values()) == len(source.names)
    rejects = json.loads((tmp_path / "out" / "rejects.json").read_text())["files"]
    assert "links are not followed" in rejects["red_alias"]


def test_a_class_of_links_only_says_its_links_were_skipped(image_folder, tmp_path):
    (image_folder / "links").mkdir()
    (image_folder / "links" / "a.png").symlink_to(image_folder / "red" / "0.png")
    with pytest.raises(
        dataset.DataError, match=r"class 'links' .* no image files \(1 links skipped"
    ):
        sources.load_source("imagefolder", image_folder)


def test_a_single_class_is_refused_before_anything_trains(image_folder, tmp_path):
    """Before, one class trained to test accuracy 1.0000 and exported a 1-class model."""
    for name in ("blue", "green"):
        shutil.rmtree(image_folder / name)
    source = sources.load_source("imagefolder", image_folder)
    with pytest.raises(
        dataset.DataError, match=r"1 class \(red\): a classifier needs at least two"
    ):
        build(source, tmp_path / "out")


def bad_files(folder):
    """Real broken inputs: truncated JPEG, zero bytes, an HTML page named .jpg."""
    buffer = io.BytesIO()
    solid((200, 10, 10), size=(64, 64)).save(buffer, "JPEG")
    (folder / "truncated.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    (folder / "empty.png").write_bytes(b"")
    (folder / "page.jpg").write_text("<html><body>404 not found</body></html>")


def test_bad_files_are_rejected_with_a_reason_each(image_folder, tmp_path):
    bad_files(image_folder / "red")
    source = sources.load_source("imagefolder", image_folder)
    manifest = build(source, tmp_path / "out", dedupe=False)
    rejects = json.loads((tmp_path / "out/rejects.json").read_text())
    files = rejects["files"]
    assert "truncated" in files["red/truncated.jpg"]
    assert files["red/empty.png"] == "empty file (0 bytes)"
    assert "not a readable image" in files["red/page.jpg"]
    assert "not an image file type" in files["red/notes.txt"]
    assert rejects["rejected"] == 6 and manifest["rejected"] == 6
    assert sum(sum(c.values()) for c in manifest["counts"].values()) == 24  # only good images used


def test_too_many_bad_files_fail_listing_them(image_folder, tmp_path):
    bad_files(image_folder / "red")
    source = sources.load_source("imagefolder", image_folder)
    with pytest.raises(dataset.DataError) as e:
        build(source, tmp_path / "out", max_bad_fraction=0.05)
    assert "6 of 30 files rejected" in str(e.value) and "red/truncated.jpg" in str(e.value)
    assert "shown" not in str(e.value)  # all 6 listed: nothing cut


def test_a_refused_prepare_says_the_list_was_cut_and_keeps_the_full_list_beside_the_output(
    image_folder, tmp_path
):
    """Before, the error listed 50 of 81 files without saying so, and the full list went with
    the discarded staging folder (the rejects.json left was the previous run's)."""
    for i in range(78):
        (image_folder / "red" / f"empty{i:02d}.png").write_bytes(b"")
    source = sources.load_source("imagefolder", image_folder)
    kept = tmp_path / "prepared.rejects.json"  # beside data/prepared, as the stage names it
    with pytest.raises(dataset.DataError) as e:
        build(source, tmp_path / "prepared.partial", max_bad_fraction=0.05, refused_report=kept)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("81 of 105 files rejected (77.1%), over the limit of 5.0%")
    assert lines[0].endswith(f"(all of them, each with its reason: {kept}):")
    assert len(lines) == 1 + 50 + 1  # the line, 50 files, the note that the list was cut
    assert lines[1] == "  blue/notes.txt: not an image file type (.txt)"
    assert lines[-1] == f"  (50 of 81 shown; the full list: {kept})"
    report = json.loads(kept.read_text())
    assert report["rejected"] == 81 and len(report["files"]) == 81
    assert report["files"]["red/empty77.png"] == "empty file (0 bytes)"  # one not listed
    build(source, tmp_path / "again", max_bad_fraction=1.0, refused_report=kept)
    assert not kept.exists()  # a run that passes drops the refused run's list: it is stale


def test_image_modes_are_normalised_not_mangled(tmp_path):
    white_bg = dataset.Decode(4, "rgb", background=(255, 255, 255))
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red
    rgba.putpixel((0, 0), (0, 0, 255, 255))
    rgba.save(tmp_path / "rgba.png")
    pixels = dataset.to_pixels(tmp_path / "rgba.png", white_bg)
    assert pixels[0, 0].tolist() == [0, 0, 255] and pixels[3, 3].tolist() == [255, 255, 255]
    half = Image.new("LA", (4, 4), (0, 128))  # black at half opacity over white
    half.save(tmp_path / "la.png")
    assert dataset.to_pixels(tmp_path / "la.png", white_bg)[0, 0].tolist() == [127, 127, 127]
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    palette.info["transparency"] = 1
    palette.save(tmp_path / "p.png", transparency=1)
    green_bg = dataset.Decode(4, "rgb", background=(0, 255, 0))
    assert dataset.to_pixels(tmp_path / "p.png", green_bg)[1, 1].tolist() == [0, 255, 0]
    Image.new("CMYK", (4, 4), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg", quality=100)
    red = dataset.to_pixels(tmp_path / "cmyk.jpg", white_bg)[2, 2].astype(int)
    assert red[0] > 240 and red[1] < 15 and red[2] < 15
    sixteen = np.array([[0, 32896], [65535, 257]], dtype=np.uint16)
    Image.fromarray(sixteen).save(tmp_path / "16bit.png")
    assert Image.open(tmp_path / "16bit.png").mode.startswith("I")
    gray = dataset.to_pixels(tmp_path / "16bit.png", dataset.Decode(2, "grayscale"))[..., 0]
    assert gray.tolist() == [[0, 128], [255, 1]]  # scaled by 257, not clipped at 255


def test_exif_orientation_is_applied(tmp_path):
    image = solid((0, 0, 0), size=(20, 10))
    image.paste((255, 255, 255), (0, 0, 10, 10))  # white on the left half
    exif = image.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    path = tmp_path / "rotated.jpg"
    image.save(path, exif=exif, quality=100)
    upright = dataset.to_pixels(path, dataset.Decode(10, "grayscale"))[..., 0]
    assert upright[:4].mean() > 200 and upright[-4:].mean() < 50  # white now on top


def test_oversized_and_bomb_images_are_rejected_without_decoding(tmp_path):
    bomb = tmp_path / "bomb.png"
    Image.new("1", (9500, 9500)).save(bomb, optimize=True)  # 90 Mpx in a few KB
    assert bomb.stat().st_size < 200_000
    with pytest.raises(dataset.DataError, match=r"9500x9500 = 90250000 px is over max_pixels"):
        dataset.to_pixels(bomb, dataset.Decode(8, "rgb", max_pixels=50_000_000))
    with pytest.raises(
        dataset.DataError, match="decompression bomb"
    ):  # Pillow's guard, as an error
        dataset.to_pixels(bomb, dataset.Decode(8, "rgb", max_pixels=10**9))


def test_only_allowed_formats_are_opened(tmp_path):
    solid((1, 2, 3)).save(tmp_path / "photo.jpg")
    with pytest.raises(dataset.DataError, match=r"allowed formats \(PNG\)"):
        dataset.to_pixels(tmp_path / "photo.jpg", dataset.Decode(8, "rgb", formats=("PNG",)))


def test_parallel_decoding_equals_serial_and_cache_is_byte_identical(image_folder, tmp_path):
    source = sources.load_source("imagefolder", image_folder)
    build(source, tmp_path / "serial", workers=1)
    build(source, tmp_path / "parallel", workers=2)
    names = sorted(p.name for p in (tmp_path / "serial").iterdir())
    assert "rejects.json" in names and not [n for n in names if n.startswith(".decoded")]
    assert names == sorted(p.name for p in (tmp_path / "parallel").iterdir())
    for name in names:
        assert (tmp_path / "serial" / name).read_bytes() == (
            tmp_path / "parallel" / name
        ).read_bytes(), name
    manifest = json.loads((tmp_path / "serial/manifest.json").read_text())
    for name, entry in manifest["files"].items():
        assert dataset.file_hash(tmp_path / "serial" / name) == entry["sha256"]


DIES = """
import sys
from pathlib import Path
from visionflow.data import dataset, sources
source = sources.load_source("imagefolder", Path(sys.argv[1]))
try:
    dataset.build_cache(source, Path(sys.argv[2]), dataset.Decode(8, "rgb"), val_fraction=0.25,
                     test_fraction=0.25, seed=0, workers=2, max_bad_fraction=0.5)
except dataset.DataError as e:
    sys.exit(f"error: {e}")
"""


def test_a_decoding_process_that_dies_is_one_clear_error_not_a_hang(image_folder, tmp_path):
    """The out-of-memory killer or kill -9 ends a worker mid-image: before, the pool started a
    new one and waited for good on the images the dead one held."""
    run = subprocess.run(
        [sys.executable, "-c", DIES, str(image_folder), str(tmp_path / "out")],
        env={**os.environ, "VISIONFLOW_FAULT": "prepare.decode@index=3:kill"},
        capture_output=True,
        text=True,
        timeout=120,  # a guard only: a broken pool is reported as soon as the worker is gone
    )
    assert "fault: kill at prepare.decode {'index': 3}" in run.stderr
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    error = run.stderr.splitlines()[-1]
    assert error.startswith("error: a decoding process died (SIGKILL: killed, or out of memory)")
    assert error.endswith("run again, or use fewer workers")
    assert not (tmp_path / "out/manifest.json").exists()


def test_progress_outside_a_terminal_is_a_plain_line_now_and_then(image_folder, tmp_path, capsys):
    """DVC's captured output and the Prefect logs get a few lines with the count, the rate and
    the time left, not a progress bar redrawn per file."""
    build(sources.load_source("imagefolder", image_folder), tmp_path / "out")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("decode")]
    assert "\r" not in "".join(lines) and lines  # the end, and a line every 5 s before it
    progress = pool.ProgressBar(24, every=0)  # a line at every step: each says count, rate, left
    for _ in range(3):
        progress(8)
    lines = lines[:-1] + [line for line in capsys.readouterr().err.splitlines()]
    for line in lines[:-1]:
        assert re.fullmatch(r"decode: \d+/24 images \(\d+/s, [\d.]+ s left\)", line), line
    assert re.fullmatch(r"decode: 24/24 images in [\d.]+ s \(\d+/s\)", lines[-1]), lines[-1]


def test_duplicates_across_splits_are_found_and_removed_from_the_later_split():
    parts = {"train": np.array([0, 1]), "val": np.array([2, 3]), "test": np.array([4, 5])}
    digests = ["a", "b", "a", "c", "c", "d"]  # 2 repeats train's 0; 4 repeats val's 3
    names = [f"img{i}" for i in range(6)]
    kept, report = splits.find_duplicates(parts, digests, names, remove=True)
    assert report["across_splits"] == 2 and report["removed"] == 2
    assert {(p["image"], p["same_as"]) for p in report["pairs"]} == {
        ("img2", "img0"),
        ("img4", "img3"),
    }
    assert (
        kept["val"].tolist() == [3]
        and kept["test"].tolist() == [5]
        and kept["train"].tolist() == [0, 1]
    )
    kept, report = splits.find_duplicates(parts, digests, names, remove=False)
    assert report["removed"] == 0 and kept["val"].tolist() == [2, 3]


@pytest.mark.parametrize("shard_images", [0, 4])  # one file per split; shards placed by hash
def test_build_cache_reports_and_removes_leaked_duplicates(image_folder, tmp_path, shard_images):
    for i in range(6):
        (image_folder / "red" / f"copy{i}.png").write_bytes(
            (image_folder / "red/0.png").read_bytes()
        )
    source = sources.load_source("imagefolder", image_folder)
    manifest = build(source, tmp_path / "out", dedupe=True, shard_images=shard_images)
    duplicates = json.loads((tmp_path / "out/duplicates.json").read_text())
    assert duplicates["across_splits"] == manifest["duplicates"] > 0
    seen = set()
    for split in splits.SPLITS:  # no val or test image equals one of an earlier split
        rows = {row.tobytes() for row in dataset.read_split(tmp_path / "out", split)[0]}
        assert not rows & seen, split
        seen |= rows


def burst_folder(root: Path) -> Path:
    """Two classes of 8 images: every 'burst' image a pixel copy of the others (burst photos),
    every 'scene' image distinct."""
    for i in range(8):
        for name in ("burst", "scene"):
            (root / name).mkdir(parents=True, exist_ok=True)
        solid((200, 30, 30)).save(root / "burst" / f"{i}.png")
        scene = solid((30, 200, 30))
        scene.putpixel((i, 0), (128, 128, 128))
        scene.save(root / "scene" / f"{i}.png")
    return root


@pytest.mark.parametrize("shard_images", [0, 4])  # one file per split; shards placed by hash
def test_dedupe_refuses_a_class_left_without_val_or_test_images_naming_it(tmp_path, shard_images):
    """Dedupe would drop every val and test image of 'burst' (each a copy of a train image):
    refused, by name, rather than a class tested on nothing; kept copies test it (leaking)."""
    source = sources.load_source("imagefolder", burst_folder(tmp_path / "images"))
    with pytest.raises(dataset.DataError) as error:
        build(source, tmp_path / "out", dedupe=True, shard_images=shard_images)
    assert re.fullmatch(
        r"class 'burst' lost every val and test image \(\d val, \d test\): each was a pixel "
        r"copy of an image in an earlier split \(burst/\d\.png is one\), so the class would be "
        r"scored on no image; give it distinct images, or set this false to keep the copies "
        r"\(they leak\)",
        str(error.value),
    )
    assert error.value.setting == "dedupe"  # the stage names prepare.dedupe
    manifest = build(source, tmp_path / "kept", dedupe=False, shard_images=shard_images)
    assert all(counts["burst"] > 0 for counts in manifest["counts"].values())


# runs ARGV and prints its peak RSS (KiB): a fresh, small process between, since a child
# started from this one (pytest, torch imported) is charged this one's size by exec
PEAK_RSS = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def peak_rss_mb(cwd: Path, *args: str) -> float:
    """Run `python -m ARGS` in `cwd` with the project's code; the peak resident memory (MB) of
    its largest process, as `/usr/bin/time -v` gives it."""
    env = {**os.environ, "PYTHONPATH": python_path(ROOT, ROOT / "src")}
    run = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, sys.executable, "-m", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return int(run.stdout.split()[-1]) / 1024


def test_prepares_memory_does_not_grow_with_the_images(tmp_path):
    """The digits cached at 256 px (118 MB of pixels) take prepare's memory less than 30 MB over
    caching them at 8 px. Before, the decoded scratch file and the splits stayed mapped and
    were read back whole, and the stats counted 4,096 images at a time in int64 copies: about
    900 MB more (bench/prepare_memory_bench.py: 32,000 images took 5x the memory of 2,000)."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    peaks = {}
    for size in (8, 256):
        write_params(tmp_path, {"prepare": {"source": "digits", "image_size": size}})
        peaks[size] = peak_rss_mb(tmp_path, "pipeline.prepare", "--out", f"prepared{size}")
    pixels = 1797 * 256 * 256 / 2**20
    print(f"peak RSS {peaks} MB; {pixels:.0f} MB of pixels at 256 px")
    assert peaks[256] - peaks[8] < 30


def test_torchvision_sources_read_a_local_copy(mnist_root):
    for name in ("mnist", "fashion_mnist"):
        source = sources.load_source(name, mnist_root, download=False)
        assert len(source.labels) == 60 and len(source.classes) == 10
        assert source.is_test.sum() == 20
        parts = splits.split_indices(source.labels, 0.25, 0.2, 0, source.is_test)
        assert np.array_equal(parts["test"], np.arange(40, 60))  # the official test split is kept
        assert len(parts["val"]) == 10 and len(parts["train"]) == 30


def test_cifar10_missing_copy_is_a_clear_error(tmp_path):
    with pytest.raises(dataset.DataError, match=r"cifar10 not usable .*downloading is off"):
        sources.load_source("cifar10", tmp_path, download=False)


def test_split_is_stratified_disjoint_and_seeded():
    labels = np.repeat(np.arange(4), 50)
    parts = splits.split_indices(labels, 0.25, 0.2, seed=1)
    everything = np.concatenate(list(parts.values()))
    assert sorted(everything.tolist()) == list(range(200))  # disjoint and complete
    for index in parts.values():
        counts = np.bincount(labels[index], minlength=4)
        assert counts.max() - counts.min() <= 1  # each class in the same share
    again = splits.split_indices(labels, 0.25, 0.2, seed=1)
    other = splits.split_indices(labels, 0.25, 0.2, seed=2)
    assert all(np.array_equal(parts[s], again[s]) for s in parts)
    assert not np.array_equal(parts["test"], other["test"])
    with pytest.raises(dataset.DataError, match="cannot split 5 images into the test split: .1. "):
        splits.split_indices(np.array([0, 0, 0, 0, 1]), 0.25, 0.2, seed=0)


def test_the_split_is_scikit_learns_index_for_index():
    """prepare splits without importing scikit-learn (1 s of CPU); caches made before, and the
    the manual's numbers, depend on its indices and their order staying the same."""
    from sklearn.model_selection import train_test_split

    rng = np.random.default_rng(0)
    for case in range(300):
        classes = int(rng.integers(2, 12))
        labels = rng.integers(0, classes, int(rng.integers(4 * classes, 400)))
        labels = labels[np.isin(labels, np.flatnonzero(np.bincount(labels) >= 2))]
        index = rng.permutation(len(labels)) + 7  # any index order, any values
        size, seed = float(rng.choice([0.1, 0.15, 0.2, 0.25, 0.33, 0.5])), case
        try:
            expected = train_test_split(index, test_size=size, stratify=labels, random_state=seed)
        except ValueError:
            with pytest.raises(ValueError):
                splits.stratified_split(index, labels, size, seed)
            continue
        got = splits.stratified_split(index, labels, size, seed)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True)), case


def test_stats_use_the_train_split_only(tmp_path):
    source = sources.load_source("digits", None)
    manifest = build(
        source,
        tmp_path / "a",
        decode=dataset.Decode(8, "grayscale"),
        val_fraction=0.15,
        test_fraction=0.2,
    )
    x, y = dataset.read_split(tmp_path / "a", "train")
    assert (
        x.dtype == np.uint8
        and y.dtype == np.int64
        and len(x) == sum(manifest["counts"]["train"].values())
    )
    meta = dataset.read_cache_meta(tmp_path / "a")
    assert meta.mean == pytest.approx([(x / 255).mean()]) and meta.std == pytest.approx(
        [(x / 255).std()]
    )
    test_x, _ = dataset.read_split(tmp_path / "a", "test")
    assert meta.mean != pytest.approx([(test_x / 255).mean()], abs=1e-6)


def test_model_input_is_normalised_and_reversible():
    x = torch.randint(0, 256, (4, 6, 6, 3), dtype=torch.uint8)
    mean, std = torch.tensor([0.5, 0.4, 0.3]), torch.tensor([0.2, 0.25, 0.3])
    model_input = loading.to_model_input(x, mean, std)
    assert model_input.shape == (4, 3, 6, 6)
    expected = (x[..., 1].float() / 255 - 0.4) / 0.25
    assert torch.allclose(model_input[:, 1], expected)
    back = loading.from_model_input(model_input, mean, std)
    assert torch.allclose(back * 255, x.permute(0, 3, 1, 2).float(), atol=1e-3)


def test_batches_cover_every_item_once_and_shuffle_with_a_generator():
    x, y = torch.arange(10).view(10, 1, 1, 1), torch.arange(10)
    plain = torch.cat([yb for _, yb in loading.batches(x, y, 3)])
    assert plain.tolist() == list(range(10))
    shuffled = torch.cat(
        [yb for _, yb in loading.batches(x, y, 3, torch.Generator().manual_seed(0))]
    )
    assert sorted(shuffled.tolist()) == list(range(10)) and shuffled.tolist() != list(range(10))


# --- archives -------------------------------------------------------------------------------


def png_bytes(color=(255, 0, 0)) -> bytes:
    buffer = io.BytesIO()
    solid(color).save(buffer, "PNG")
    return buffer.getvalue()


def make_tar(path, members):
    """members: (TarInfo, bytes | None)."""
    with tarfile.open(path, "w:gz" if path.name.endswith(".gz") else "w") as tf:
        for info, payload in members:
            if payload is not None:
                info.size = len(payload)
            tf.addfile(info, io.BytesIO(payload) if payload is not None else None)


def test_good_archives_extract_to_the_image_folder(tmp_path):
    zpath, tpath = tmp_path / "pets.zip", tmp_path / "pets.tar.gz"
    with zipfile.ZipFile(zpath, "w") as zf:
        for c in ("cat", "dog"):
            zf.writestr(f"pets/{c}/1.png", png_bytes())
    make_tar(tpath, [(tarfile.TarInfo(f"{c}/1.png"), png_bytes()) for c in ("cat", "dog")])
    for path in (zpath, tpath):
        assert archive.is_archive(path)
        root = archive.extract(path, tmp_path / f"x-{path.name}", max_bytes=10**6)
        assert sorted(p.name for p in root.iterdir()) == ["cat", "dog"]
        assert sources.load_source("imagefolder", root).classes == ["cat", "dog"]


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "hardlink", "device"])
def test_malicious_tar_is_refused_naming_the_member(tmp_path, kind):
    evil = tarfile.TarInfo(
        {"dotdot": "cat/../../evil.png", "absolute": "/tmp/evil-abs.png"}.get(kind, "cat/evil")
    )
    payload = png_bytes()
    if kind in ("symlink", "hardlink"):
        evil.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
        evil.linkname = "/etc/passwd"
        payload = None
    elif kind == "device":
        evil.type, evil.devmajor, evil.devminor = tarfile.CHRTYPE, 1, 3
        payload = None
    path = tmp_path / "evil.tar"
    make_tar(path, [(tarfile.TarInfo("cat/ok.png"), png_bytes()), (evil, payload)])
    dest = tmp_path / "dest" / "inside"
    with pytest.raises(dataset.DataError, match=f"member '{evil.name}'"):
        archive.extract(path, dest, max_bytes=10**6)
    assert not (tmp_path / "evil.png").exists() and not os.path.exists("/tmp/evil-abs.png")
    assert not dest.exists() or not any(dest.rglob("*"))  # refused before anything is written


def test_zip_slip_and_zip_bomb_are_refused(tmp_path):
    slip = tmp_path / "slip.zip"
    with zipfile.ZipFile(slip, "w") as zf:
        zf.writestr("cat/1.png", png_bytes())
        zf.writestr("../../evil.png", png_bytes())
    with pytest.raises(dataset.DataError, match=r"member '\.\./\.\./evil.png' climbs out"):
        archive.extract(slip, tmp_path / "d1" / "x", max_bytes=10**6)
    assert not (tmp_path / "evil.png").exists()
    bomb = tmp_path / "bomb.zip"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("cat/zeros.png", b"\0" * (30 * 2**20))  # 30 MB of zeros, ~30 KB compressed
    with pytest.raises(
        dataset.DataError, match=r"member 'cat/zeros.png' expands .* \(zip bomb\?\)"
    ):
        archive.extract(bomb, tmp_path / "d2", max_bytes=10**12)
    assert not (tmp_path / "d2").exists() or not any((tmp_path / "d2").rglob("*"))
    with pytest.raises(dataset.DataError, match="over the limit of 100 bytes"):
        archive.extract(_ok_zip(tmp_path), tmp_path / "d3", max_bytes=100)


def _ok_zip(tmp_path):
    path = tmp_path / "ok.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("cat/1.png", png_bytes())
        zf.writestr("dog/1.png", png_bytes())
    return path


def test_class_folders_equal_once_unicode_normalised_are_refused_naming_both(image_folder):
    """`café` as NFC and as NFD (a folder copied from macOS): before, two classes of one name."""
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    (image_folder / "green").rename(image_folder / "caff")  # sorts between the two forms
    shutil.copytree(image_folder / "red", image_folder / nfd)
    source = sources.load_source("imagefolder", image_folder)
    assert source.classes == ["blue", "caff", nfc, "red"]  # the NFC name, in its NFC place
    labels = dict(zip(source.names, source.labels.tolist(), strict=True))
    assert [labels[n] for n in labels if n.startswith(nfd)] == [2] * 8
    shutil.copytree(image_folder / "red", image_folder / nfc)
    with pytest.raises(dataset.DataError) as refused:
        sources.load_source("imagefolder", image_folder)
    message = str(refused.value)
    assert r"'caf\xe9'" in message and r"'cafe\u0301'" in message and str(image_folder) in message
    assert "merge them into one folder or rename one" in message


def test_class_names_that_differ_only_by_case_spaces_or_invisible_characters_are_named():
    found = sources.look_alike_classes(["Cat", "cat", "dog", "dog\u200b", "bird ", "bird", "ox"])
    assert [w.split(" differ")[0] for w in found] == [
        "classes 'Cat' and 'cat'",
        r"classes 'dog' and 'dog\u200b'",
        "classes 'bird ' and 'bird'",
    ]
    assert sources.look_alike_classes(["0", "1", "cat", "dog"]) == []


def test_the_decode_pools_stop_does_without_the_executors_private_attributes(
    image_folder, tmp_path, monkeypatch
):
    """`_stop` reads ProcessPoolExecutor's private `_processes` and `_result_queue`: a Python
    without them still decodes, and a stop still ends the pool (no AttributeError)."""
    import concurrent.futures

    class Bare(concurrent.futures.ProcessPoolExecutor):  # the private names hidden
        def __getattribute__(self, name):
            if name in ("_processes", "_result_queue") and sys._getframe(1).f_globals is vars(pool):
                raise AttributeError(name)
            return super().__getattribute__(name)

    monkeypatch.setattr(pool, "ProcessPoolExecutor", Bare)
    source = sources.load_source("imagefolder", image_folder)
    scratch = tmp_path / "decoded"
    scratch.write_bytes(bytes(len(source.images) * 8 * 8 * 3))
    results = pool._decode_in_pool(scratch, source.images, dataset.Decode(8, "rgb"), workers=2)
    next(results)
    results.close()  # a stop while the pool works: `_stop` ends it
    assert len(list(pool._decode_in_pool(scratch, source.images, dataset.Decode(8, "rgb"), 2))) > 0


def test_file_stats_skip_hidden_files_caches_and_broken_links(tmp_path):
    from visionflow.data import files

    (tmp_path / "a" / "__pycache__").mkdir(parents=True)
    for name in ("a/one.png", "a/.DS_Store", "a/__pycache__/m.pyc", "two.png"):
        (tmp_path / name).write_bytes(b"12345")
    (tmp_path / "a" / "gone.png").symlink_to(tmp_path / "nowhere")
    stats = files.file_stats([tmp_path / "a", tmp_path / "two.png"])
    assert sorted(stats) == [str(tmp_path / "a/one.png"), str(tmp_path / "two.png")]
    assert stats[str(tmp_path / "two.png")].size == 5
    before = stats[str(tmp_path / "two.png")]
    (tmp_path / "two.png").write_bytes(b"54321")  # the same size: the stat still differs
    os.utime(tmp_path / "two.png", ns=(before.mtime_ns, before.mtime_ns))  # even mtime set back
    assert files.file_stats([tmp_path / "two.png"])[str(tmp_path / "two.png")] != before
    assert files.flatten({"train": {"lr": 0.1, "health": {"n": 3}}}) == {
        "train.lr": 0.1,
        "train.health.n": 3,
    }


def test_the_guards_table_of_a_folder_holds_each_file_in_little_more_than_its_name(tmp_path):
    """prepare's memory grows with the folder by the mid-run guard's table of every file's stat
    (#57: 0.8 KB a file as dicts of tuples, two of them at the end): it is two arrays."""
    import tracemalloc

    from visionflow.data import files

    for i in range(2000):
        (tmp_path / f"image_{i:05d}.png").write_bytes(b"x")
    expected = files.file_stats([tmp_path])
    tracemalloc.start()
    table = files.StatTable([tmp_path])
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    name = str(tmp_path / "image_01234.png")
    assert table.stat(table.find(name)) == expected[name]
    assert table.name(table.find(name)) == name and table.find(name + "x") is None
    assert len(table) == 2000
    assert held / 2000 < len(name) + 100, f"{held / 2000:.0f} bytes a file"


def test_verify_cache_names_each_file_that_differs_from_the_manifest(tmp_path):
    from visionflow.data import files

    cache = tmp_path / "prepared"
    cache.mkdir()
    with pytest.raises(files.DataError, match="manifest.json is missing: run `dvc repro prepare`"):
        files.verify_cache(cache)
    (cache / "manifest.json").write_text("[]")
    with pytest.raises(files.DataError, match="is not a manifest prepare wrote"):
        files.verify_cache(cache)
    for name in ("train_x.npy", "classes.json"):
        (cache / name).write_text(name)
    listed = {n: {"sha256": files.file_hash(cache / n)} for n in ("train_x.npy", "classes.json")}
    (cache / "manifest.json").write_text(json.dumps({"files": listed}))
    assert files.verify_cache(cache) == [str(cache / "train_x.npy"), str(cache / "classes.json")]
    (cache / "classes.json").write_text('["a", "b"]')
    (cache / "train_x.npy").unlink()
    with pytest.raises(files.DataError) as error:
        files.verify_cache(cache)
    assert f"{cache / 'train_x.npy'}: sha256 missing, manifest says" in str(error.value)
    assert f"{cache / 'classes.json'}: sha256 {files.file_hash(cache / 'classes.json')}" in str(
        error.value
    )


def test_prepare_writes_the_same_cache_without_linux_only_calls(tmp_path, monkeypatch):
    """macOS has neither os.posix_fallocate nor os.preadv: prepare stopped there with an
    AttributeError. Without them it writes the same cache, byte for byte."""
    from tests.helpers import digits_cache

    linux = digits_cache(tmp_path / "linux")
    monkeypatch.delattr(os, "posix_fallocate")
    monkeypatch.delattr(os, "preadv")
    elsewhere = digits_cache(tmp_path / "elsewhere")
    files = sorted(p.name for p in linux.iterdir())
    assert files == sorted(p.name for p in elsewhere.iterdir()) and "train_x.npy" in files
    for name in files:
        assert (linux / name).read_bytes() == (elsewhere / name).read_bytes(), name


def test_a_class_too_small_to_split_is_named():
    """It said "per-class counts [20 20 2 20]: classes [2] have 1 image: 2 at least": an index,
    and a count of 2 beside "have 1" (the count after the test split took one)."""
    from visionflow.data.splits import split_indices

    labels = np.repeat(np.arange(4), [20, 20, 2, 20])
    classes = ["a b", "cat", "two", "dog"]
    with pytest.raises(dataset.DataError) as error:
        split_indices(labels, 0.15, 0.2, 0, classes=classes)
    assert str(error.value) == (
        "cannot split 62 images into train and val (what the test split left): 'two' (2 in all) "
        "would have 1 image there, 2 at least: give the class more images (3 at least: train, val "
        "and test)"
    )
    with pytest.raises(dataset.DataError, match=r"into the test split: 'two' \(1 in all\)"):
        split_indices(np.repeat(np.arange(4), [20, 20, 1, 20]), 0.15, 0.2, 0, classes=classes)
