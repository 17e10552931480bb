"""The images most likely mislabelled (sanity.label_issues): the probe and confident learning in
this process, the stage's files and log, prepare.exclude, and `dvc repro sanity` on digits with
files in the wrong folder."""

import json
import shutil

import numpy as np
import pytest

from tests.helpers import ROOT, copy_project, digits_cache, digits_folder, sh, write_params
from visionflow.data import label_issues
from visionflow.errors import DataError

DIGITS = [str(d) for d in range(10)]


def flipped_digits(share: float, seed: int = 0):
    """scikit-learn's digits as normalised pixel rows, a share of labels moved to another class:
    (features, noisy labels, the flipped positions)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16 - 0.3) / 0.4  # about the cache's normalisation
    rng = np.random.default_rng(seed)
    flipped = rng.choice(len(x), round(share * len(x)), replace=False)
    labels = digits.target.copy()
    labels[flipped] = (labels[flipped] + rng.integers(1, 10, len(flipped))) % 10
    return x, labels, flipped


def precision_recall(found: np.ndarray, flipped: np.ndarray) -> tuple[float, float]:
    hits = np.isin(found, flipped).sum()
    return hits / max(len(found), 1), hits / len(flipped)


def test_the_probe_finds_most_flipped_digits_and_little_else():
    x, labels, flipped = flipped_digits(0.03)
    found = label_issues.find({"pixels": (x, False)}, labels, DIGITS, seed=0)
    precision, recall = precision_recall(found.index, flipped)
    assert recall >= 0.7 and precision >= 0.7, (precision, recall)
    assert found.folds == label_issues.FOLDS and found.probe == "pixels"
    assert np.all(np.diff(found.score) >= 0)  # the least confident first
    right = np.isin(found.index, flipped)  # for a flipped digit, the probe suggests its digit
    truth = np.asarray(__import__("sklearn.datasets").datasets.load_digits().target)
    assert np.mean(found.suggested[right] == truth[found.index[right]]) > 0.9


def test_probabilities_that_are_not_out_of_sample_find_nothing_to_trust():
    """The ranking follows the probe: the same probabilities given to other images (shuffled)
    find next to none of the flipped ones."""
    x, labels, flipped = flipped_digits(0.03)
    probabilities = label_issues.out_of_sample(x, labels, 5, linear=False, seed=0)
    good = label_issues.rank(labels, probabilities)
    shuffled = label_issues.rank(labels, np.random.default_rng(0).permutation(probabilities))
    assert precision_recall(good.index, flipped)[1] >= 0.7
    assert precision_recall(shuffled.index, flipped)[0] < 0.2  # flags hundreds, mostly right


def test_the_probe_that_agrees_with_the_labels_most_ranks():
    """Given a useless probe (features of noise) beside a good one, the good one ranks; the
    linear probe finds flipped digits too."""
    x, labels, flipped = flipped_digits(0.05)
    noise = np.random.default_rng(0).normal(size=x.shape)
    found = label_issues.find({"noise": (noise, True), "linear": (x, True)}, labels, DIGITS, seed=0)
    assert found.probe == "linear" and found.accuracy["noise"] < 0.3 < found.accuracy["linear"]
    precision, recall = precision_recall(found.index, flipped)
    assert recall >= 0.6 and precision >= 0.6, (precision, recall)


def test_folds_follow_the_smallest_class_and_refuse_one_image_or_one_class():
    assert label_issues.folds_for(np.array([0] * 9 + [1] * 3), ["a", "b"]) == 3
    assert label_issues.folds_for(np.array([0] * 20 + [1] * 20), ["a", "b"]) == 5
    with pytest.raises(ValueError, match=r"^classes \{'b': 1\} have fewer than 2 images"):
        label_issues.folds_for(np.array([0] * 9 + [1]), ["a", "b"])
    with pytest.raises(ValueError, match=r"^one class \('a'\)"):
        label_issues.folds_for(np.zeros(9, dtype=np.int64), ["a"])


def stage_params(tmp_path, train: dict, **sanity):
    from visionflow.params import load_params

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    write_params(tmp_path, {"sanity": sanity, "train": train})
    return load_params(tmp_path / "params.yaml")


def flip_cache(cache, share: float) -> set[str]:
    """Move a share of the train split's labels to another class; the names of those images."""
    from visionflow.data import dataset

    y = np.load(cache / "train_y.npy")
    rng = np.random.default_rng(1)
    flipped = rng.choice(len(y), round(share * len(y)), replace=False)
    y[flipped] = (y[flipped] + rng.integers(1, 10, len(flipped))) % 10
    np.save(cache / "train_y.npy", y)
    names = dataset.read_names(cache, "train")
    return {names[i] for i in flipped}


def run_stage_part(tmp_path, cache, monkeypatch, train=None, **sanity):
    """The stage's label-issue step in this process, its picture capped at 4 images (32 cost
    seconds to draw)."""
    import pipeline.sanity
    from pipeline.sanity import find_label_issues
    from visionflow.data import dataset

    monkeypatch.setattr(pipeline.sanity, "SHOWN", 4)

    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    params = stage_params(tmp_path, train or {}, **sanity)
    line = find_label_issues(cache, dataset.read_cache_meta(cache), params, out)
    return line, json.loads((out / "label_issues.json").read_text()), out


def test_the_stage_lists_and_draws_suspects_with_their_files_and_caps_the_picture(
    tmp_path, monkeypatch
):
    cache = digits_cache(tmp_path / "prepared")
    flipped = flip_cache(cache, 0.05)  # about 60: more than the picture shows
    line, report, out = run_stage_part(tmp_path, cache, monkeypatch, label_issues=True)
    assert report["ran"] and report["suspects"] == len(report["issues"])
    assert set(report["probe_accuracy"]) == {
        "pixels, PCA + kNN",
        "simple_cnn at random weights, its last conv pooled, logistic regression",
    }
    files = {row["file"] for row in report["issues"]}
    assert len(files & flipped) >= 0.7 * len(flipped)
    row = report["issues"][0]
    assert set(row) == {"file", "split", "given", "suggested", "score"}
    assert row["file"].startswith("#") and row["given"] != row["suggested"]
    assert {r["split"] for r in report["issues"]} >= {"train"}
    shares = report["per_class"]
    assert sum(v["suspects"] for v in shares.values()) == report["suspects"]
    assert f"suspected label issues of {report['images']} images" in line
    assert "; per class: " in line and "the picture shows the 4 likeliest" in line
    assert (out / "label_issues.png").stat().st_size > 0


def test_off_writes_the_files_saying_so_and_auto_runs_on_digits(tmp_path, monkeypatch):
    cache = digits_cache(tmp_path / "prepared")
    line, report, out = run_stage_part(tmp_path, cache, monkeypatch, label_issues=False)
    assert line == "sanity: label issues off (sanity.label_issues: false)"
    assert not report["ran"] and report["issues"] == []
    assert (out / "label_issues.png").stat().st_size > 0
    line, report, _ = run_stage_part(tmp_path, cache, monkeypatch, label_issues="auto")
    assert report["ran"] and report["work"]["share"] <= 0.2, report["work"]


def test_a_class_of_other_classes_images_is_mostly_suspects_and_named(tmp_path, monkeypatch):
    from visionflow.data import sources

    digits = sources.load_source("digits", None)
    labels = digits.labels.copy()
    odd = [np.flatnonzero(labels == d)[0] for d in range(8)]
    labels[odd] = 10  # a class "x" of a 0, a 1, ... a 7
    source = digits._replace(labels=labels, classes=[*DIGITS, "x"])
    cache = digits_cache(tmp_path / "prepared", source)
    line, report, _ = run_stage_part(tmp_path, cache, monkeypatch, label_issues=True)
    x = report["per_class"]["x"]
    assert x["images"] == 8 and x["suspects"] >= 4
    assert f"half or more of a class are suspects: 'x' ({x['suspects']} of 8)" in line


def test_exclude_drops_the_named_files_and_names_one_not_there(image_folder):
    from visionflow.data import sources

    source = sources.imagefolder_source(image_folder)
    kept = sources.exclude(source, ["red/3.png", "blue/nested/1.jpg"], "images")
    assert len(kept.names) == len(source.names) - 2
    assert "red/3.png" not in kept.names and kept.images[0] == source.images[0]
    assert len(kept.labels) == len(kept.images) == len(kept.names)
    with pytest.raises(DataError, match=r"^'red/9\.png' not in images \(names are paths"):
        sources.exclude(source, ["red/9.png"], "images")


def test_the_cache_names_each_image_in_split_order(tmp_path, image_folder):
    from visionflow.data import dataset, sources

    source = sources.imagefolder_source(image_folder)
    cache = tmp_path / "prepared"
    decode = dataset.Decode(8, "rgb")
    dataset.build_cache(
        source, cache, decode, val_fraction=0.2, test_fraction=0.2, seed=0, max_bad_fraction=1
    )
    names = sum((dataset.read_names(cache, s) for s in ("train", "val", "test")), [])
    assert sorted(names) == sorted(source.names)
    y = np.load(cache / "train_y.npy")
    for name, label in zip(dataset.read_names(cache, "train"), y, strict=True):
        assert name.split("/")[0] == source.classes[label]


@pytest.mark.slow
def test_dvc_repro_sanity_finds_digits_moved_to_a_wrong_folder(reproduced_base, tmp_path):
    """Done when (#59): 3% of digits' files in a wrong class folder; with label_issues on, the
    list holds 70% of them at least, and half of its suspects at least are moved files."""
    project = copy_project(reproduced_base, tmp_path / "project")
    moved = digits_folder(project / "data" / "digits", 0.03)
    write_params(
        project,
        {
            "prepare": {"source": "imagefolder", "path": "data/digits"},
            "sanity": {"label_issues": True},
        },
    )
    sh(project, "dvc", "repro", "sanity")
    report = json.loads((project / "results/sanity/label_issues.json").read_text())
    assert (project / "results/sanity/label_issues.png").stat().st_size > 0
    found = {row["file"] for row in report["issues"]}
    assert len(found & moved) >= 0.7 * len(moved), (len(found & moved), len(moved))
    assert len(found & moved) >= 0.5 * len(found), (len(found & moved), len(found))


def test_with_pretrained_weights_the_probe_reads_the_backbones_features(tmp_path, monkeypatch):
    """train.pretrained: the features the network's last linear layer takes, from one frozen
    forward pass, and a linear probe (a torchvision resnet18's random weights stand in)."""
    import torch
    from torchvision.models import resnet18

    from visionflow.data import sources

    torch.manual_seed(0)
    torch.save(resnet18(num_classes=3).state_dict(), tmp_path / "weights.pt")
    digits = sources.load_source("digits", None)
    few = digits._replace(
        images=digits.images[:400], labels=digits.labels[:400], names=digits.names[:400]
    )
    cache = digits_cache(tmp_path / "prepared", few)
    train = {"model": "resnet18", "pretrained": str(tmp_path / "weights.pt")}
    _, report, _ = run_stage_part(tmp_path, cache, monkeypatch, train, label_issues=True)
    assert (
        report["ran"] and report["probe"] == "resnet18's pretrained features, logistic regression"
    )
    assert list(report["probe_accuracy"]) == [report["probe"]]
    assert report["work"]["probe_macs"] > 0 and report["folds"] == 5


def test_textures_from_scratch_rank_by_the_random_network_not_the_pixels(tmp_path, monkeypatch):
    """Classes that differ by texture, not by where the ink is (noise at three block sizes): the
    pixels' neighbours cannot tell them apart, the random network's pooled features can, and
    their probe ranks."""
    from PIL import Image

    from visionflow.data import sources

    rng = np.random.default_rng(0)
    labels = np.arange(240) % 3
    images = np.stack(
        [
            np.asarray(
                Image.fromarray((rng.random((2 << c, 2 << c)) * 255).astype(np.uint8)).resize(
                    (32, 32), Image.NEAREST
                )
            )
            for c in labels
        ]
    )
    names = [f"#{i}" for i in range(len(labels))]
    source = sources.Source(images, labels.astype(np.int64), ["a", "b", "c"], None, names)
    cache = digits_cache(tmp_path / "prepared", source)
    y = np.load(cache / "train_y.npy")
    y[:6] = (y[:6] + 1) % 3  # six wrong labels
    np.save(cache / "train_y.npy", y)
    wrong = set(dataset_names(cache)[:6])
    _, report, _ = run_stage_part(tmp_path, cache, monkeypatch, label_issues=True)
    accuracy = report["probe_accuracy"]
    assert report["probe"].startswith("simple_cnn at random weights"), accuracy
    assert accuracy[report["probe"]] > accuracy["pixels, PCA + kNN"] + 0.1
    assert len(wrong & {row["file"] for row in report["issues"]}) >= 5


def dataset_names(cache) -> list[str]:
    from visionflow.data import dataset

    return dataset.read_names(cache, "train")


def test_the_multiply_adds_equal_torchs_count_and_pixels_are_averaged_down():
    """forward_macs (auto's estimate) against torch's FlopCounterMode, for the project's CNN and
    a torchvision resnet; the pixel features of a 64 px image are averaged to 32 px a side."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from torchvision.models import resnet18

    from visionflow.train import features
    from visionflow.train.models import build_model

    for model, channels, size in ((build_model("simple_cnn", 1, 10, 16), 1, 16),
                                  (resnet18(num_classes=5), 3, 32)):  # fmt: skip
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            model.eval()(torch.zeros(1, channels, size, size))
        assert features.forward_macs(model, channels, size) == counter.get_total_flops() // 2
    x = np.random.default_rng(0).integers(0, 256, (3, 64, 64, 3), dtype=np.uint8)
    pixels = features.pixels(x, torch.zeros(3), torch.ones(3))
    assert pixels.shape == (3, 3 * features.PIXEL_SIDE**2)
    assert np.allclose(pixels[0, 0], x[0, :2, :2, 0].mean() / 255, atol=1e-6)


def test_a_sharded_cache_names_each_image_in_its_shards_order(tmp_path):
    from visionflow.data import dataset, sources

    source = sources.load_source("digits", None)
    cache = tmp_path / "prepared"
    dataset.build_cache(
        source, cache, dataset.Decode(8, "grayscale"), val_fraction=0.15, test_fraction=0.2,
        seed=0, shard_images=100,
    )  # fmt: skip
    for split in ("train", "val", "test"):
        names = dataset.read_names(cache, split)
        x, y = dataset.read_split(cache, split)
        index = [int(name.removeprefix("#")) for name in names]
        assert source.labels[index].tolist() == y.tolist()
        assert np.array_equal(x[..., 0], source.images[index])  # the same images, in order


def test_prepare_leaves_out_the_excluded_files_and_refuses_one_not_in_the_folder(
    tmp_path, image_folder
):
    """prepare.exclude through the stage's build: the files are not in the cache, the manifest
    counts them; a name not in the folder is the error the stage prefixes with its key."""
    from pipeline.prepare import build
    from visionflow.data import dataset
    from visionflow.params import load_params

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    change = {"source": "imagefolder", "path": str(image_folder), "image_size": 8,
              "max_bad_fraction": 0.5, "min_per_class": 1, "workers": 1}  # fmt: skip
    twice = ["red/3.png", "blue/nested/1.jpg", "red/3.png"]  # a name listed twice: one file
    write_params(tmp_path, {"prepare": change | {"exclude": twice}})
    manifest = build(load_params(tmp_path / "params.yaml"), tmp_path / "prepared")
    names = sum(
        (dataset.read_names(tmp_path / "prepared", s) for s in ("train", "val", "test")), []
    )
    assert len(names) == 22 and not {"red/3.png", "blue/nested/1.jpg"} & set(names)
    assert manifest["made_from"]["excluded"] == 2
    write_params(tmp_path, {"prepare": {"exclude": ["red/9.png"]}})
    with pytest.raises(DataError, match=r"^'red/9\.png' not in .*images") as error:
        build(load_params(tmp_path / "params.yaml"), tmp_path / "again")
    assert error.value.setting == "exclude"
