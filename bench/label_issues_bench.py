"""Benchmark: how many wrong labels the sanity stage's label-issue list finds (#59), what it costs
against the train stage, and what excluding its suspects does to test accuracy.

Folders made here, a known share (1%, 5%, 10%) of their files put in a wrong class's folder:
  - digits:  scikit-learn's 1,797 digits as 8x8 PNGs, the default pipeline (16 px grayscale,
             simple_cnn, 20 epochs); the probe on pixels (PCA + kNN)
  - photos:  bench/photos.py's photo-like JPEGs (5 classes, each a colour cast and a texture
             scale; 1,000 at 128x96), 32 px RGB, simple_cnn; the probe on pixels
  - letters: bench/finetune_bench.py's letters (10 classes, 100 per class, 64 px), with
             `--pretrained`: mobilenet_v3_small pretrained here on its shapes task (the weights
             cached with `--weights-cache`), fine-tuned; the probe on the frozen backbone's
             features (logistic regression). The same folder's pixel probe is reported beside.
Each case runs in a temporary copy of the project, as a user would: `dvc repro sanity` with
`sanity.label_issues: true`, then the train stage (`dvc repro train`, timed) and `dvc repro
evaluate`; then every suspect goes into `prepare.exclude` and `dvc repro evaluate` runs again.
Reported: precision and recall of the suspects against the moved files; the test accuracy the
pipeline reports (against the labels as given) and against the files' true classes, before and
after the exclusion (the split moves with the excluded files, so the test images differ); the
sanity stage's seconds with the list and without it (`python -m pipeline.sanity`, interleaved),
the train stage's (`dvc repro train`, then `dvc repro --force --single-item train`), each the
least of `--repeats` runs (the one other work on the machine disturbed least), and the stage's
own estimate of the share (label_issues.json's `work.share`).

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python bench/label_issues_bench.py [--cases digits photos]
        [--rates 0.01 0.05 0.1] [--pretrained --weights-cache /tmp/shapes.pt] [--out results.json]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from finetune_bench import make_project  # noqa: E402  (a committed copy of the project)
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def sh(project: Path, *cmd: str) -> float:
    """Run a command in the project; its seconds."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(project / "src"),
        "DVC_NO_ANALYTICS": "1",
    }
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {result.returncode}\n{result.stderr}")
    return time.perf_counter() - started


def set_params(project: Path, change: dict) -> None:
    params = yaml.safe_load((project / "params.yaml").read_text())
    for section, values in change.items():
        params[section] = {**params[section], **values} if isinstance(values, dict) else values
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def write_folder(root: Path, images: list, labels: np.ndarray, classes: list[str], rate: float):
    """Images into `root/<class>/<i>.png`, a share `rate` of them in a wrong class's folder;
    {path under root: true class} and the moved paths."""
    rng = np.random.default_rng(1)
    moved = set(rng.choice(len(labels), round(rate * len(labels)), replace=False).tolist())
    truth, wrong = {}, set()
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        folder = (label + rng.integers(1, len(classes))) % len(classes) if i in moved else label
        name = f"{classes[folder]}/{i:05d}.png"
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(root / name)
        truth[name] = classes[label]
        if i in moved:
            wrong.add(name)
    return truth, wrong


def digits_images():
    from sklearn.datasets import load_digits

    d = load_digits()
    images = list(np.round(d.images * (255 / 16)).astype(np.uint8))
    return images, d.target, [str(c) for c in range(10)]


def photo_images(count: int = 1000, classes: int = 5):
    from photos import photo

    rng = np.random.default_rng(0)
    labels = np.arange(count) % classes
    images = [np.asarray(photo(rng, int(c), (128, 96))) for c in labels]
    return images, labels, [f"class{c}" for c in range(classes)]


def letter_images(per_class: int = 100):
    from finetune_bench import LETTERS, letter_mask, picture

    rng = np.random.default_rng(0)
    labels = np.arange(per_class * len(LETTERS)) % len(LETTERS)
    images = [picture(letter_mask(LETTERS[c], rng), rng) for c in labels]
    return images, labels, list(LETTERS)


CASES = {  # images, and the params a user would set for them
    "digits": (digits_images, {}),
    "photos": (photo_images, {"prepare": {"image_size": 32, "color": "rgb"}}),
    "letters": (letter_images, {"prepare": {"image_size": 64, "color": "rgb"}}),
}


def accuracies(project: Path, truth: dict) -> dict:
    metrics = json.loads((project / "results/evaluate/metrics.json").read_text())
    rows = json.loads((project / "results/evaluate/predictions.json").read_text())
    true = np.mean([truth[r["file"]] == r["predicted"] for r in rows])
    return {"test_accuracy": metrics["accuracy"], "true_label_accuracy": round(float(true), 4)}


def sanity_seconds(project: Path, setting) -> float:
    set_params(project, {"sanity": {"label_issues": setting}})
    out = project / "bench-sanity"
    seconds = sh(project, sys.executable, "-m", "pipeline.sanity", "--data", "data/prepared",
                 "--out", str(out))  # fmt: skip
    shutil.rmtree(out)
    return seconds


def run_case(
    case: str, rate: float, work: Path, train: dict, weights: Path | None, repeats: int
) -> dict:
    make, params = CASES[case]
    project = work / f"{case}-{rate}"
    make_project(project)
    if weights:  # train.pretrained's file, where dvc.yaml tracks it
        shutil.copy(weights, project / "data/pretrained/shapes.pt")
    images, labels, classes = make()
    truth, moved = write_folder(project / "data/images", images, labels, classes, rate)
    set_params(project, params | {"train": params.get("train", {}) | train})
    set_params(project, {"prepare": {"source": "imagefolder", "path": "data/images"},
                         "sanity": {"label_issues": True}})  # fmt: skip
    sh(project, "dvc", "repro", "sanity")
    report = json.loads((project / "results/sanity/label_issues.json").read_text())
    found = {r["file"] for r in report["issues"]}
    hits = len(found & moved)
    row = {
        "case": case,
        "rate": rate,
        "images": len(labels),
        "moved": len(moved),
        "suspects": len(found),
        "precision": round(hits / max(len(found), 1), 3),
        "recall": round(hits / max(len(moved), 1), 3),
        "probe": report.get("probe"),
        "probe_accuracy": report.get("probe_accuracy"),
        "estimated_share": report.get("work", {}).get("share"),
    }
    if train.get("pretrained"):  # the same folder's pixel probe, beside the backbone's
        pixels = {**train, "pretrained": "", "freeze_epochs": 0, "backbone_lr_factor": 1.0}
        set_params(project, {"train": pixels})
        shutil.rmtree(project / "bench-pixels", ignore_errors=True)
        sh(project, sys.executable, "-m", "pipeline.sanity", "--data", "data/prepared",
           "--out", "bench-pixels")  # fmt: skip
        p = {
            r["file"]
            for r in json.loads((project / "bench-pixels/label_issues.json").read_text())["issues"]
        }
        row["pixel_probe"] = {
            "suspects": len(p),
            "precision": round(len(p & moved) / max(len(p), 1), 3),
            "recall": round(len(p & moved) / max(len(moved), 1), 3),
        }
        set_params(project, {"train": train})
    seconds = [sh(project, "dvc", "repro", "train")]
    sh(project, "dvc", "repro", "evaluate")
    row["before"] = accuracies(project, truth)
    for _ in range(repeats - 1):  # the same train stage again, DVC's run-cache bypassed
        seconds.append(sh(project, "dvc", "repro", "--force", "--single-item", "train"))
    row["train_seconds"] = round(min(seconds), 1)  # the least disturbed by other work
    for setting in (False, True):  # interleaved: the machine's load falls on both alike
        row[f"sanity_seconds_{'with' if setting else 'without'}"] = []
    for _ in range(repeats):
        for setting in (False, True):
            key = f"sanity_seconds_{'with' if setting else 'without'}"
            row[key].append(sanity_seconds(project, setting))
    for key in ("sanity_seconds_without", "sanity_seconds_with"):
        row[key] = round(min(row[key]), 1)
    row["probe_share_of_train"] = round(
        (row["sanity_seconds_with"] - row["sanity_seconds_without"]) / row["train_seconds"], 3
    )
    set_params(project, {"prepare": {"exclude": sorted(found)}})
    sh(project, "dvc", "repro", "evaluate")
    row["after"] = accuracies(project, truth)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["digits", "photos"], choices=CASES)
    parser.add_argument("--rates", nargs="+", type=float, default=[0.01, 0.05, 0.10])
    parser.add_argument(
        "--pretrained", action="store_true", help="letters: fine-tune the shapes backbone"
    )
    parser.add_argument(
        "--weights-cache", type=Path, help="the pretrained state_dict, kept between runs"
    )
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--repeats", type=int, default=3, help="timings: the least of this many")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="label-issues-") as tmp:
        for case in args.cases:
            train, saved = {}, None
            if case == "letters" and args.pretrained:
                import torch
                from finetune_bench import pretrained_weights

                args.pretrain_epochs = 40  # finetune_bench's default
                weights, _ = pretrained_weights(args)
                saved = Path(tmp) / "shapes.pt"
                torch.save(weights, saved)
                train = {"model": "mobilenet_v3_small", "pretrained": "data/pretrained/shapes.pt",
                         "freeze_epochs": 2, "backbone_lr_factor": 0.1, "epochs": 10}  # fmt: skip
            for rate in args.rates:
                rows.append(run_case(case, rate, Path(tmp), train, saved, args.repeats))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
