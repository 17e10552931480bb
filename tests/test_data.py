import numpy as np
import pytest
import torch

from tests.conftest import solid
from visionflow import data


def test_digits_is_the_real_offline_dataset():
    source = data.load_source("digits", None)
    assert len(source.labels) == 1797 and source.classes == [str(i) for i in range(10)]
    pixels = data.decode_all(source.images[:5], 16, "grayscale")
    assert pixels.shape == (5, 16, 16, 1) and pixels.dtype == np.uint8 and pixels.max() > 200


def test_imagefolder_classes_files_and_pixels(image_folder):
    source = data.load_source("imagefolder", image_folder)
    assert source.classes == ["blue", "green", "red"]  # sorted; .ipynb_checkpoints is no class
    assert np.bincount(source.labels).tolist() == [8, 8, 8]  # nested .jpg count; hidden/.txt don't
    names = {p.name for p in source.images}
    assert ".hidden.png" not in names and "notes.txt" not in names
    rgb = data.decode_all(source.images, 8, "rgb")
    assert rgb.shape == (24, 8, 8, 3)
    png_red = [i for i, p in enumerate(source.images) if p.parent.name == "red"][0]
    assert (rgb[png_red] == [255, 0, 0]).all()  # solid PNG resized stays exactly red
    gray = data.decode_all(source.images[:1], 8, "grayscale")
    assert gray.shape == (1, 8, 8, 1)
    assert int(gray[0, 0, 0, 0]) == 29  # PIL's luma of pure blue: 0.114 * 255


def test_imagefolder_empty_class_is_named(image_folder):
    (image_folder / "zebra").mkdir()
    with pytest.raises(data.DataError, match="class 'zebra'"):
        data.load_source("imagefolder", image_folder)


def test_imagefolder_missing_folder_is_named(tmp_path):
    with pytest.raises(data.DataError, match="nothing-here"):
        data.load_source("imagefolder", tmp_path / "nothing-here")


def test_undecodable_file_is_named(image_folder):
    bad = image_folder / "red" / "broken.jpg"
    bad.write_bytes(b"<html>not a jpeg</html>")
    source = data.load_source("imagefolder", image_folder)
    with pytest.raises(data.DataError, match="broken.jpg"):
        data.decode_all(source.images, 8, "rgb")


def test_exif_orientation_is_applied(tmp_path):
    image = solid((0, 0, 0), size=(20, 10))
    image.paste((255, 255, 255), (0, 0, 10, 10))  # white on the left half
    exif = image.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    path = tmp_path / "rotated.jpg"
    image.save(path, exif=exif, quality=100)
    upright = data.to_pixels(path, 10, "grayscale")[..., 0]  # shown 10 wide, 20 tall, squashed
    assert upright[:4].mean() > 200 and upright[-4:].mean() < 50  # white now on top


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_torchvision_sources_read_a_local_copy(mnist_root, name):
    source = data.load_source(name, mnist_root, download=False)
    assert len(source.labels) == 60 and len(source.classes) == 10
    assert source.is_test.sum() == 20
    splits = data.split_indices(source.labels, 0.25, 0.2, 0, source.is_test)
    assert np.array_equal(splits["test"], np.arange(40, 60))  # the official test split is kept
    assert len(splits["val"]) == 10 and len(splits["train"]) == 30


def test_cifar10_missing_copy_is_a_clear_error(tmp_path):
    with pytest.raises(data.DataError, match=r"cifar10 not usable .*prepare.download"):
        data.load_source("cifar10", tmp_path, download=False)


def test_split_is_stratified_disjoint_and_seeded():
    labels = np.repeat(np.arange(4), 50)
    splits = data.split_indices(labels, 0.25, 0.2, seed=1)
    everything = np.concatenate(list(splits.values()))
    assert sorted(everything.tolist()) == list(range(200))  # disjoint and complete
    for index in splits.values():
        counts = np.bincount(labels[index], minlength=4)
        assert counts.max() - counts.min() <= 1  # each class in the same share
    again = data.split_indices(labels, 0.25, 0.2, seed=1)
    other = data.split_indices(labels, 0.25, 0.2, seed=2)
    assert all(np.array_equal(splits[s], again[s]) for s in splits)
    assert not np.array_equal(splits["test"], other["test"])


def test_split_too_small_class_is_a_clear_error():
    with pytest.raises(data.DataError, match="per-class counts"):
        data.split_indices(np.array([0, 0, 0, 0, 1]), 0.25, 0.2, seed=0)


def test_cache_is_byte_identical_and_stats_use_train_only(tmp_path):
    source = data.load_source("digits", None)
    splits = data.split_indices(source.labels, 0.15, 0.2, 0)
    pixels = data.decode_all(source.images, 8, "grayscale")
    first = data.write_cache(tmp_path / "a", pixels, source, splits)
    second = data.write_cache(tmp_path / "b", pixels, source, splits)
    for name in ["classes.json", "stats.json", "manifest.json", *first["files"]]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    for name, entry in first["files"].items():
        assert data.sha256(tmp_path / "a" / name) == entry["sha256"]
    assert first == second
    x, y = data.read_split(tmp_path / "a", "train")
    assert x.dtype == np.uint8 and y.dtype == np.int64 and len(x) == len(splits["train"])
    meta = data.read_cache_meta(tmp_path / "a")
    train = pixels[splits["train"]] / 255
    assert meta.mean == pytest.approx([train.mean()]) and meta.std == pytest.approx([train.std()])
    assert meta.mean != pytest.approx([(pixels / 255).mean()], abs=1e-6)  # not the full set's


def test_model_input_is_normalised_and_reversible():
    x = torch.randint(0, 256, (4, 6, 6, 3), dtype=torch.uint8)
    mean, std = torch.tensor([0.5, 0.4, 0.3]), torch.tensor([0.2, 0.25, 0.3])
    model_input = data.to_model_input(x, mean, std)
    assert model_input.shape == (4, 3, 6, 6)
    expected = (x[..., 1].float() / 255 - 0.4) / 0.25
    assert torch.allclose(model_input[:, 1], expected)
    back = data.from_model_input(model_input, mean, std)
    assert torch.allclose(back * 255, x.permute(0, 3, 1, 2).float(), atol=1e-3)


def test_batches_cover_every_item_once_and_shuffle_with_a_generator():
    x, y = torch.arange(10).view(10, 1, 1, 1), torch.arange(10)
    plain = torch.cat([yb for _, yb in data.batches(x, y, 3)])
    assert plain.tolist() == list(range(10))
    shuffled = torch.cat([yb for _, yb in data.batches(x, y, 3, torch.Generator().manual_seed(0))])
    assert sorted(shuffled.tolist()) == list(range(10)) and shuffled.tolist() != list(range(10))
