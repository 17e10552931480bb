"""Inputs from outside the project, through the stage commands: class folders made on another OS,
and a model card that states what the model was made from, not what params.yaml says now."""

import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import ROOT, copy_project, python_path, solid, write_params
from visionflow.data.decode import Decode, pixels_of
from visionflow.deploy.inference import load_images, preprocess_spec, to_input


def stage(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m pipeline.<stage> ARGS` in `cwd` (params.yaml there), the project's code."""
    env = {**os.environ, "PYTHONPATH": python_path(ROOT, ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_a_folder_made_on_macos_gives_nfc_class_names_and_look_alikes_are_warned(
    image_folder, tmp_path
):
    """A lone NFD folder (`café` from macOS) is the NFC class `café`; `Red` beside `red` (one
    folder on macOS and Windows) is named in the prepare log."""
    (image_folder / "green").rename(image_folder / "cafe\u0301")
    (image_folder / "Red").mkdir()
    for i in range(6):
        image = solid((200, 30, 30))
        image.putpixel((i, 3), (128, 128, 128))
        image.save(image_folder / "Red" / f"{i}.png")
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    prepare = {
        "source": "imagefolder",
        "path": str(image_folder),
        "image_size": 8,
        "color": "rgb",
        "val_fraction": 0.25,
        "test_fraction": 0.25,
        "max_bad_fraction": 0.5,  # the stray notes.txt files
        "min_per_class": 2,
    }
    write_params(tmp_path, {"prepare": prepare})
    made = stage(tmp_path, "pipeline.prepare", "--out", "prepared")
    assert made.returncode == 0, made.stdout + made.stderr
    assert "prepare: warning: classes 'Red' and 'red' differ only by letter case" in made.stdout
    classes = json.loads((tmp_path / "prepared/classes.json").read_text())
    assert classes == ["Red", "blue", "caf\u00e9", "red"]
    manifest = json.loads((tmp_path / "prepared/manifest.json").read_text())
    assert manifest["made_from"] == {
        "source": "imagefolder",
        "fit_kept": pytest.approx(0.8333, abs=1e-4),  # 12x10 images, their centre square
        "val_fraction": 0.25,
        "test_fraction": 0.25,
        "seed": 0,
    }


@pytest.mark.slow
@pytest.mark.longest
def test_the_model_card_states_what_the_model_was_made_from_not_params_yaml(
    reproduced_base, tmp_path
):
    """A pretrained resnet18 is normalised with ImageNet's mean/std, and the card says so (before:
    "train split"); params.yaml edited after training (not export deps) changes nothing in the
    card (before: it printed the new values beside the old model)."""
    import torchvision

    project = copy_project(reproduced_base, tmp_path / "project")
    torch.save(
        torchvision.models.resnet18(weights=None).state_dict(), project / "data/pretrained/r.pt"
    )
    pretrained = {"model": "resnet18", "pretrained": "data/pretrained/r.pt", "epochs": 1}
    write_params(project, {"train": pretrained})
    out = tmp_path / "train"
    trained = stage(
        project, "pipeline.train", "--data", "data/prepared", "--out", str(out),
        "--checkpoints", str(tmp_path / "state"),
    )  # fmt: skip
    assert trained.returncode == 0, trained.stdout + trained.stderr
    meta = torch.load(out / "model.pt", weights_only=True)["meta"]
    assert meta["norm"] == "ImageNet (the pretrained weights' statistics)"
    stale = {"seed": 7, "prepare": {"val_fraction": 0.3}, "train": {"lr": 0.5, "pretrained": ""}}
    write_params(project, stale)
    exported = stage(
        project, "pipeline.export", "--model", str(out / "model.pt"), "--data", "data/prepared",
        "--metrics", "results/evaluate/metrics.json", "--out", str(tmp_path / "export"),
    )  # fmt: skip
    assert exported.returncode == 0, exported.stdout + exported.stderr
    card = (tmp_path / "export/MODEL_CARD.md").read_text()
    assert (
        "Source `digits`, split train/val/test by a permutation with seed 0 (val 0.15, test 0.2)."
        in card
    )
    assert "Normalisation statistics: ImageNet (the pretrained weights' statistics)." in card
    assert (
        "1 epoch, batch 128, lr 0.001, optimizer adamw, scheduler onecycle, weight decay 0.01, "
        "dropout 0.25, label smoothing 0.1, seed 0. Training augmentation: shifts of up to 2 px, "
        "rotations of up to 10 degrees. The fine-tuning recipe (train.recipe) set the "
        "optimizer, scheduler, weight decay, label smoothing. The backbone's last layer group at "
        "lr x 1, each earlier one at x 1 of the next."
    ) in card
    seen = "network sees a 7 px centre crop of the 8 px cache (77% of its area; random resized"
    assert f"train: the {seen}" in trained.stdout and f"The {seen}" in card  # 224 of 256
    assert "[the highest-loss test images](../evaluate/top_losses.png)" in card


def photo(seed: int, size=(320, 240)) -> Image.Image:
    """A camera-like JPEG subject: smooth colour noise (blocks upscaled), not a flat colour."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(size[1] // 40, size[0] // 40, 3), dtype=np.uint8)
    return Image.fromarray(blocks).resize(size, Image.Resampling.BICUBIC)


def test_photos_decode_at_a_reduced_scale_and_predict_sees_the_cache_pixels(tmp_path):
    """The cache decodes JPEGs at the DCT scale that still covers the size (Image.draft) and
    resizes every image in two steps (reducing_gap); the exported preprocessing records both,
    and predict and the ONNX client give the same pixels."""
    folder = tmp_path / "photos"
    files = []
    for label in ("a", "b"):
        (folder / label).mkdir(parents=True)
        for i in range(9):
            files.append(folder / label / f"{i}.{'png' if i % 3 == 2 else 'jpg'}")
            photo(i + 10 * (label == "b")).save(files[-1], quality=90)
    pngs = [f for f in files if f.suffix == ".png"]
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: the camera was turned 90 degrees
    photo(99, (240, 320)).save(files[0], quality=90, exif=exif)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    prepare = {"source": "imagefolder", "path": str(folder), "image_size": 16, "color": "rgb"}
    write_params(tmp_path, {"prepare": {**prepare, "val_fraction": 0.25, "test_fraction": 0.25}})
    made = stage(tmp_path, "pipeline.prepare", "--out", "prepared")
    assert made.returncode == 0, made.stderr
    decode = json.loads((tmp_path / "prepared/decode.json").read_text())
    assert decode["jpeg_draft"] is True and decode["reducing_gap"] == 3.0
    assert decode["fit"] == "crop" and decode["resize"] == "bilinear"  # params.yaml's defaults
    cache = np.concatenate([np.load(tmp_path / f"prepared/{s}_x.npy") for s in SPLITS])

    background = decode["background"]
    spec = preprocess_spec(16, 3, [0.5] * 3, [0.25] * 3, background, True, 3.0, "bilinear", "crop")
    pixels, good, errors = load_images(files, spec)
    assert not errors and rows(pixels) == rows(cache)  # predict's pixels are the cache's
    # the centre square, as torchvision's Resize + CenterCrop keep it, not the squashed photo
    square = Decode(16, "rgb", fit="squash")
    centre = pixels_of(Image.open(pngs[0]).crop((40, 0, 280, 240)), square)
    squashed = pixels_of(Image.open(pngs[0]), square)
    cropped = pixels[files.index(pngs[0])].astype(int)
    assert np.abs(cropped - centre).mean() < 3 < np.abs(cropped - squashed).mean()
    full, _, _ = load_images(files, {**spec, "jpeg_draft": False})
    assert rows(full) != rows(pixels)  # the reduced scale is in effect (full decoding differs)
    one_step, _, _ = load_images(pngs, {**spec, "reducing_gap": None})
    assert rows(one_step) != rows(load_images(pngs, spec)[0])  # so is the two-step resize

    client = runpy.run_path(str(ROOT / "examples/onnx_client.py"))  # not run as __main__
    for i, path in enumerate(files):
        expected = to_input(pixels[i : i + 1], spec)[0]
        assert np.allclose(client["preprocess"](str(path), spec), expected, atol=1e-6), path
    # what a model file records is followed, by predict and the client alike (not assumed)
    for change in ({"resize": "nearest"}, {"exif_transpose": False}, {"fit": "squash"}):
        other = {**spec, **change}
        changed, _, _ = load_images(files, other)
        assert rows(changed) != rows(pixels), change
        for i, path in enumerate(files[:3]):
            expected = to_input(changed[i : i + 1], other)[0]
            assert np.allclose(client["preprocess"](str(path), other), expected, atol=1e-6)


SPLITS = ("train", "val", "test")


def rows(x: np.ndarray) -> list[bytes]:
    return sorted(image.tobytes() for image in x)
