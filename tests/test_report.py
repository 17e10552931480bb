"""What people look at rather than read, in process: the pictures (viz: the label grid, the
confusion matrix, the image grids, the class counts) and the model card's words (report). The
stages that draw and write them run in test_stages (sanity) and the slow pipeline tests."""

import numpy as np
import pytest


@pytest.fixture
def plt():
    from visionflow.deploy import viz

    yield viz.plt
    viz.plt.close("all")


def test_the_label_grid_is_one_row_per_class_of_what_the_model_sees(plt):
    from visionflow.deploy import viz

    labels = np.array([0, 1, 0, 2, 1, 0])
    images = (labels / 4.0)[:, None, None, None] * np.ones((6, 1, 8, 8))  # class c: grey c/4
    figure = viz.label_grid(images, labels, ["zero", "one", "two"], k=2)
    (ax,) = figure.axes
    pixels = np.asarray(ax.images[0].get_array())
    gap = 1  # white between the images: height // 8
    assert pixels.shape == (3 * 8 + 2 * gap, 2 * 8 + gap)
    rows = [pixels[r * 9 : r * 9 + 8] for r in range(3)]
    assert [row[:, :8].mean() for row in rows] == [0.0, 0.25, 0.5]
    assert rows[2][:, 9:].min() == 1.0  # class two has one image: the second place stays white
    assert [t.get_text() for t in ax.get_yticklabels()] == ["zero", "one", "two"]


def test_the_confusion_matrix_is_row_normalised_and_an_empty_row_stays_zero(plt):
    from visionflow.deploy import viz

    figure = viz.confusion_figure(np.array([[3, 1, 0], [0, 0, 0], [0, 2, 2]]), ["a", "b", "c"])
    ax = figure.axes[0]
    share = np.asarray(ax.images[0].get_array())
    np.testing.assert_allclose(share, [[0.75, 0.25, 0], [0, 0, 0], [0, 0.5, 0.5]])
    assert sorted(t.get_text() for t in ax.texts) == ["0.25", "0.50", "0.50", "0.75"]


def test_image_grids_title_each_image_and_say_when_there_is_none(plt):
    from visionflow.deploy import viz

    images = np.zeros((3, 1, 4, 4))
    figure = viz.top_losses_grid(images, ["cat", "dog", "cat"], ["dog", "dog", "fox"],
                                 [2.5, 0.1, 1.0], [0.9, 0.8, 0.7])  # fmt: skip
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert titles == [
        "pred cat\ntrue dog\nloss 2.50, p 0.90",
        "pred dog\ntrue dog\nloss 0.10, p 0.80",
        "pred cat\ntrue fox\nloss 1.00, p 0.70",
    ]
    files = ["cat/IMG_0001.jpg", "dog/a.png", "fox/b.png"]  # #58: each image's file, last
    named = viz.mistakes_grid(images, ["dog", "dog", "fox"], ["cat", "cat", "cat"],
                              [0.9, 0.8, 0.7], files)  # fmt: skip
    titles = [ax.get_title().splitlines() for ax in named.axes if ax.get_title()]
    assert [lines[-1] for lines in titles] == files
    named = viz.top_losses_grid(images, ["cat"] * 3, ["dog"] * 3, [1.0] * 3, [0.5] * 3, files)
    assert [ax.get_title().splitlines()[-1] for ax in named.axes if ax.get_title()] == files
    empty = viz.mistakes_grid(np.zeros((0, 1, 4, 4)), [], [], [])
    assert [t.get_text() for t in empty.axes[0].texts] == ["no mistakes"]
    counts = viz.counts_figure({"train": {"a": 5, "b": 3}, "test": {"a": 1, "b": 1}})
    legend = [t.get_text() for t in counts.axes[0].get_legend().get_texts()]
    assert legend == ["train (8)", "test (2)"]


def collisions(figure) -> list[tuple[str, str]]:
    """The pairs of things drawn that overlap, as the PNG shows them: titles (each image's and
    the figure's) with each other, with the images, or over the figure's edge."""
    figure.canvas.draw()
    titled = [ax for ax in figure.axes if ax.get_title()]
    texts = [(ax.get_title(), ax.title.get_window_extent()) for ax in titled]
    texts += [(text.get_text(), text.get_window_extent()) for text in figure.texts]  # the heading
    images = [(f"image {i}", ax.get_window_extent()) for i, ax in enumerate(titled)]
    found = [(a, "the figure's edge") for a, box in texts if not figure.bbox.contains(*box.min)
             or not figure.bbox.contains(*box.max)]  # fmt: skip
    for i, (a, box) in enumerate(texts):
        found += [(a, b) for b, other in texts[i + 1 :] + images if box.overlaps(other)]
    return found


def test_image_titles_fit_their_cells_whatever_the_class_names(plt):
    """Before, 32 classes of 18-character names ran each image's title into its neighbours' and
    the next row's images; now each name stays whole on its own line, and a longer one is cut
    in the middle (its start and end kept), at any number of images."""
    from visionflow.deploy import viz

    birds = ["barn_owl", "blue_jay", "great_tit", "house_wren", "mallard", "osprey", "raven",
             "robin"]  # fmt: skip
    names = [f"{bird}_{region}"[:15].ljust(15, "_") + f"_{i:02d}" for i, (bird, region) in
             enumerate((b, r) for r in ("north", "south", "east", "west") for b in birds)]  # fmt: skip
    assert len(set(names)) == 32 and {len(name) for name in names} == {18}
    rng = np.random.default_rng(0)
    images = rng.random((16, 3, 32, 32))  # evaluate.top_losses' default: 16
    guess, truth = [[names[i] for i in rng.integers(0, 32, 16)] for _ in range(2)]
    losses, probs = (rng.random(16) * 5).tolist(), rng.random(16).tolist()
    top = viz.top_losses_grid(images, guess, truth, losses, probs)
    assert collisions(top) == []
    titles = [ax.get_title().splitlines() for ax in top.axes if ax.get_title()]
    assert [lines[:2] for lines in titles] == [
        [f"pred {g}", f"true {t}"] for g, t in zip(guess, truth, strict=True)
    ]
    assert collisions(viz.mistakes_grid(images, truth, guess, probs)) == []
    long = [f"{'W' * 30}_{name}_{'m' * 20}" for name in names]  # the widest letters, 69 of them
    for n in (1, 3, 20):  # one image, a few, rows and a part row
        picked = [long[i % 32] for i in range(n)]
        grid = viz.top_losses_grid(np.zeros((n, 1, 8, 8)), picked, picked, [1.0] * n, [0.5] * n)
        assert collisions(grid) == [], n
        first = grid.axes[0].get_title().splitlines()[0]
        assert first.startswith("pred WWW") and "…" in first and first.endswith("mmm")


def test_the_model_cards_lines_say_what_the_inputs_say_and_unknown_when_they_do_not():
    from visionflow.deploy import report

    assert report.data_line({}).startswith("Source and split: unknown")
    made_from = {"source": "imagefolder", "path": "data/raw", "seed": 3, "placed_by": "name hash",
                 "val_fraction": 0.1, "test_fraction": 0.2}  # fmt: skip
    assert report.data_line(made_from) == (
        "Source `imagefolder` (`data/raw`), split train/val/test by each image's name hash with "
        "seed 3 (val 0.1, test 0.2)."
    )
    train = {"epochs": 1, "batch_size": 64, "lr": 0.01, "lr_found": True, "weight_decay": 0,
             "dropout": 0.1, "seed": 0}  # fmt: skip
    assert report.training_line({"train": train}) == (
        "1 epoch, batch 64, lr 0.01 (train.lr auto: the range test's suggestion), weight decay "
        "0, dropout 0.1, seed 0."
    )
    tuned = train | {"lr_found": False, "weight_decay": 0.01, "label_smoothing": 0.1,
                     "optimizer": "adamw", "scheduler": "onecycle", "freeze_epochs": 1,
                     "backbone_lr_factor": 0.1, "group_lr_factor": 0.1**0.5,
                     "recipe": {"optimizer": "adamw", "label_smoothing": 0.1},
                     "augment": {"crop_padding": 2, "hflip": True, "rotation": 0.0,
                                 "color_jitter": 0.0, "mixup": 0.2, "cutmix": 0.0}}  # fmt: skip
    assert report.training_line({"train": tuned}) == (
        "1 epoch, batch 64, lr 0.01, optimizer adamw, scheduler onecycle, weight decay 0.01, "
        "dropout 0.1, label smoothing 0.1, seed 0. Training augmentation: shifts of up to 2 px, "
        "mirroring, MixUp (alpha 0.2). The fine-tuning recipe (train.recipe) set the "
        "optimizer, label smoothing. The new head alone for 1 epoch. The backbone's last layer "
        "group at lr x 0.1, each earlier one at x 0.316 of the next."
    )
    assert report.training_line({}).startswith("Training values: unknown")
    assert report.resize_words({"fit": "crop", "resize": "bilinear", "reducing_gap": 2.0}) == (
        "the centre square (aspect kept), a box reduce by a whole factor, then bilinear over "
        "the last 2x or more, Pillow's `resize(..., reducing_gap=)`"
    )
    assert report.draft_words({}) == "at full size" and report.tta_line({}) == ""


def test_the_parity_table_marks_a_miss_and_leaves_out_what_was_not_checked():
    from visionflow.deploy import report

    check = {"max_abs_diff": 1e-7, "max_rel_diff": 2e-6, "top1_agreement": 1.0, "passed": True}
    parity = {
        "onnx": {"1": check, "8": {**check, "max_abs_diff": 0.5, "passed": False}},
        "pt2": {"1": check},
        "torchscript": {"1": {"skipped": "not asked"}},
    }
    assert report.parity_table(parity).splitlines()[2:] == [
        "| onnx | 1 | 1.00e-07 | 2.00e-06 | 1.000 | ok |",
        "| onnx | 8 | 5.00e-01 | 2.00e-06 | 1.000 | MISS |",
        "| pt2 | 1 | 1.00e-07 | 2.00e-06 | 1.000 | ok |",
    ]
