"""Benchmark (#46): the default fine-tuning recipe against the defaults before it, training from
zero, and a plain torchvision fine-tuning script written without visionflow, at equal epochs.

The tasks are finetune_bench.py's, made here, offline: mobilenet_v3_small pretrained in plain
PyTorch on task A (22 classes of shapes), saved in torchvision's layout to data/pretrained/;
task B (10 letters, 50 PNGs per class: 15 train, 10 val, 25 test per class) is the user's photo
folder. Per seed, in a temporary copy of the project (`dvc repro evaluate`, as tests do):
  - recipe:   only train.model and train.pretrained set (and the common epochs, batch, device):
              train.recipe auto (the default) gives the fine-tuning recipe (params.FINETUNE:
              label smoothing 0.1 on the from-scratch defaults)
  - before:   the same with train.recipe scratch: the defaults before #46 (plateau, no freeze,
              one rate, Adam 1e-3, no label smoothing)
  - zero:     train.pretrained "": the same network from random weights
  - plain:    a script without visionflow on the same split (the prepared cache's .npy files):
              torchvision's model, the weights file, a new head, Adam at 1e-3 on the whole network,
              random resized crops and flips, the centre crop to test; the last epoch's model
Test accuracy (the evaluate stage's; the plain script's own), mean of the seeds, and the
seconds of `dvc repro evaluate` once prepare and sanity have run (train and evaluate, and DVC's
own time) or of the script. Then, seed 0: `visionflow lr-find`'s suggestion under the recipe,
and the recipe at rates around it, to see where runs converge.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python bench/recipe_bench.py [--seeds 3] [--tta]
        [--weights-cache /tmp/w.pt] [--contenders recipe,before] [--rates 1e-3,3e-3]
        [--variant onecycle:scheduler=onecycle,lr=5e-3 ...]

--variant NAME:key=value,... adds a contender: the first recipe measured (one-cycle, a frozen
first epoch, group factor 0.3, AdamW with weight decay 0.01, lr 1e-3; `HAND`) with these train.*
keys changed, set by hand under train.recipe scratch. Screen variants with --seeds 1 (seed 0)
or --seeds 0,1 and --contenders '' --rates ''.
"""

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from finetune_bench import (
    ARCH,
    CROP,
    MEAN,
    ROOT,
    SIZE,
    STD,
    letters_folder,
    make_project,
    pretrain,
    sh,
)

RATES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)  # the recipe at these, seed 0: where it converges
WEIGHTS = "data/pretrained/shapes_mnv3.pth"  # in the project copy
# The recipe as it was first measured (train.recipe auto's values then), set by hand: --variant
# changes keys of it
HAND = {
    "recipe": "scratch",
    "scheduler": "onecycle",
    "freeze_epochs": 1,
    "group_lr_factor": 0.3,
    "backbone_lr_factor": 1.0,
    "optimizer": "adamw",
    "weight_decay": 0.01,
    "label_smoothing": 0.0,
    "lr": 1e-3,
}


def set_params(project: Path, seed: int, train: dict, evaluate: dict) -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())  # each run from the same base
    params["seed"] = seed
    params["prepare"] |= {"source": "imagefolder", "path": "data/photos", "image_size": SIZE}
    params["prepare"] |= {"color": "rgb", "test_fraction": 0.5, "val_fraction": 0.4}
    params["train"] |= train
    params["evaluate"] |= evaluate if train.get("pretrained") else {}  # from zero: no crop to shift
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def pipeline_run(project: Path) -> dict:
    started = time.perf_counter()
    sh(project, "dvc", "repro", "evaluate")
    seconds = time.perf_counter() - started
    test = json.loads((project / "results/evaluate/metrics.json").read_text())
    tta = {"tta_accuracy": test["tta_acc"]} if "tta_acc" in test else {}
    return {"test_accuracy": test["accuracy"], **tta, "seconds": seconds}


def plain_script(project: Path, weights: Path, seed: int, epochs: int, batch: int) -> dict:
    """Fine-tuning as a user writes it with torchvision alone, on the pipeline's split."""
    from torchvision.models import get_model
    from torchvision.transforms import v2

    started = time.perf_counter()
    cache = project / "data/prepared"
    x, y = np.load(cache / "train_x.npy"), torch.from_numpy(np.load(cache / "train_y.npy"))
    xt, yt = np.load(cache / "test_x.npy"), torch.from_numpy(np.load(cache / "test_y.npy"))
    torch.manual_seed(seed)
    model = get_model(ARCH)
    state = torch.load(weights, weights_only=True)
    model.load_state_dict(
        {k: v for k, v in state.items() if not k.startswith("classifier.3")}, strict=False
    )
    model.classifier[3] = torch.nn.Linear(model.classifier[3].in_features, int(y.max()) + 1)
    train_tf = v2.Compose([v2.RandomResizedCrop(CROP, antialias=True), v2.RandomHorizontalFlip()])
    norm = v2.Normalize(MEAN, STD)
    images = torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(epochs):
        model.train()
        for index in torch.randperm(len(y)).split(batch):
            inputs = torch.stack([norm(train_tf(images[i])) for i in index])
            loss = F.cross_entropy(model(inputs), y[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    test = torch.from_numpy(xt).permute(0, 3, 1, 2).float() / 255
    top = (SIZE - CROP) // 2
    with torch.no_grad():
        logits = model(norm(test[..., top : top + CROP, top : top + CROP]))
    accuracy = (logits.argmax(1) == yt).float().mean().item()
    return {"test_accuracy": accuracy, "seconds": time.perf_counter() - started}


def lr_find(project: Path) -> float:
    out = sh(project, sys.executable, "-m", "visionflow.cli", "lr-find").stdout
    return float(re.search(r"suggested train.lr (\S+)", out)[1])


def variant(spec: str) -> tuple[str, dict]:
    """`NAME:key=value,key=value` -> (NAME, the recipe's keys with these train.* values), set by
    hand under train.recipe scratch (auto would turn a key set back to its from-scratch default,
    e.g. group_lr_factor 1.0, into the recipe's)."""
    name, _, pairs = spec.partition(":")
    changes = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
    return name, HAND | {k: yaml.safe_load(v) for k, v in changes.items()}


def seeds(text: str) -> list[int]:
    """`3`: seeds 0, 1, 2; `1,2` (a comma): these."""
    return [int(s) for s in text.split(",") if s] if "," in text else list(range(int(text)))


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds", type=seeds, default=range(3), help="N: seeds 0 .. N-1; or a list: 1,2"
    )
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--pretrain-epochs", type=int, default=30)
    parser.add_argument("--weights-cache", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument(
        "--contenders",
        default="recipe,before,zero,plain",
        help="which of recipe, before, zero, plain to run (comma-separated; '' for none)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        type=variant,
        help="NAME:key=value,...: a contender with the recipe's keys changed (repeatable)",
    )
    parser.add_argument(
        "--rates",
        default=",".join(map(str, RATES)),
        help="the recipe's rate sweep on seed 0, after lr-find ('' skips both)",
    )
    parser.add_argument(
        "--tta", action="store_true", help="evaluate.tta on (pretrained runs): tta_acc beside it"
    )
    return parser.parse_args()


def project_with_weights(tmp: Path, args) -> tuple[Path, dict]:
    """The project copy, its letters folder, and the pretrained weights file in it."""
    project = tmp / "project"
    make_project(project)
    letters_folder(project / "data/photos", 50, seed=1234)
    if args.weights_cache and args.weights_cache.exists():
        saved = torch.load(args.weights_cache, weights_only=True)
    else:
        weights, report = pretrain(args.pretrain_epochs, seed=0)
        saved = {"state_dict": weights, "report": report}
        if args.weights_cache:
            torch.save(saved, args.weights_cache)
    torch.save(saved["state_dict"], project / WEIGHTS)
    print(f"pretrained: {saved['report']}", flush=True)
    return project, saved["report"]


def main() -> None:
    args = arguments()
    tmp = Path(tempfile.mkdtemp(prefix="recipe-bench-"))
    try:
        project, pretrained = project_with_weights(tmp, args)
        common = {"model": ARCH, "epochs": args.epochs, "batch_size": args.batch_size}
        common |= {"device": "cpu"}
        evaluate = {"tta": args.tta}
        contenders = {
            "recipe": {"pretrained": WEIGHTS, "recipe": "auto"},
            "before": {"pretrained": WEIGHTS, "recipe": "scratch"},
            "zero": {"pretrained": "", "recipe": "auto"},
        }
        chosen = [c for c in args.contenders.split(",") if c]
        contenders = {k: v for k, v in contenders.items() if k in chosen}
        contenders |= {name: {"pretrained": WEIGHTS} | hand for name, hand in args.variant}
        runs = {name: [] for name in [*contenders, *(["plain"] if "plain" in chosen else [])]}
        for seed in args.seeds:
            set_params(project, seed, common | contenders.get("recipe", {}), evaluate)
            sh(project, "dvc", "repro", "sanity")  # prepare and sanity: outside the timings
            for name, train in contenders.items():
                set_params(project, seed, common | train, evaluate)
                runs[name].append(pipeline_run(project))
                print(f"seed {seed} {name:7s} {runs[name][-1]}", flush=True)
            if "plain" in runs:
                weights = project / WEIGHTS
                runs["plain"].append(
                    plain_script(project, weights, seed, args.epochs, args.batch_size)
                )
                print(f"seed {seed} plain   {runs['plain'][-1]}", flush=True)
        suggested, sweep = rate_sweep(project, common, evaluate, args)
        report(runs, sweep, suggested, pretrained, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def rate_sweep(project: Path, common: dict, evaluate: dict, args) -> tuple[float | None, dict]:
    """Seed 0: lr-find's suggestion under the recipe, then the recipe at each of --rates and at
    `auto`: where runs converge, and whether the suggestion lies there."""
    rates = [float(r) for r in args.rates.split(",") if r]
    if not rates:
        return None, {}
    recipe = common | {"pretrained": WEIGHTS, "recipe": "auto"}
    set_params(project, 0, recipe, evaluate)
    sh(project, "dvc", "repro", "sanity")
    suggested = lr_find(project)
    print(f"lr-find suggests {suggested:.2e}", flush=True)
    sweep = {}
    for rate in (*rates, "auto"):
        set_params(project, 0, recipe | {"lr": rate}, evaluate)
        sweep[str(rate)] = pipeline_run(project)
        print(f"recipe at lr {rate}: {sweep[str(rate)]}", flush=True)
    return suggested, sweep


def report(runs: dict, sweep: dict, suggested: float | None, pretrained: dict, args) -> None:
    print(f"\npretraining: held-out accuracy {pretrained['held_out_accuracy']:.4f}")
    print("\n| contender | test accuracy per seed | mean | median seconds |\n|---|---|---|---|")
    for name, results in runs.items():
        accs = [r["test_accuracy"] for r in results]
        seconds = statistics.median(r["seconds"] for r in results)
        cells = ", ".join(f"{a:.3f}" for a in accs)
        print(f"| {name} | {cells} | **{statistics.mean(accs):.3f}** | {seconds:.0f} |")
    with_tta = {k: v for k, v in runs.items() if v and all("tta_accuracy" in r for r in v)}
    if with_tta:
        print(
            "\n| contender | single pass per seed | with TTA per seed | means |\n|---|---|---|---|"
        )
    for name, results in with_tta.items():
        one, tta = ([r[k] for r in results] for k in ("test_accuracy", "tta_accuracy"))
        cells = [", ".join(f"{a:.3f}" for a in accs) for accs in (one, tta)]
        means = f"{statistics.mean(one):.3f} -> {statistics.mean(tta):.3f}"
        print(f"| {name} | {cells[0]} | {cells[1]} | {means} |")
    if suggested is not None:
        print(f"\nlr-find (seed 0, recipe): {suggested:.2e}")
        print("| recipe's lr (seed 0) | test accuracy |\n|---|---|")
    for rate, result in sweep.items():
        print(f"| {rate} | {result['test_accuracy']:.3f} |")
    if args.out:
        data = {"runs": runs, "sweep": sweep, "suggested": suggested, "pretrained": pretrained}
        args.out.write_text(json.dumps(data, indent=1, default=str))


if __name__ == "__main__":
    main()
