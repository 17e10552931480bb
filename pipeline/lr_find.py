"""The learning-rate range test on the prepared data and the configured model: `visionflow
lr-find` runs this module (the test itself, and `train.lr: auto`'s use of it: fit/lr_auto.py).

Reads:  params.yaml (seed, train.*), the cache from prepare
Writes: <out>/lr_find.png (loss against rate, log x, the suggestion marked), <out>/lr_find.json
Run:    python -m pipeline.lr_find --data data/prepared --out results/lr_find
"""

import argparse
from pathlib import Path

import torch

from pipeline import GateError, run
from visionflow.data import dataset
from visionflow.fit.lr_auto import no_rate, range_test_of, spread_for, spread_line
from visionflow.fit.setup import device_for, load_data, model_for, overfit_settings
from visionflow.params import load_params
from visionflow.train.lr_find import range_test_figure
from visionflow.train.training import seed_everything
from visionflow.train.zoo import FineTune


def main() -> None:
    parser = argparse.ArgumentParser(description="The learning-rate range test.")
    parser.add_argument("--data", type=Path, required=True, help="cache folder from prepare")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    args = parser.parse_args()
    if not (args.data / "manifest.json").is_file():
        raise GateError(f"--data {args.data} holds no prepared cache: `dvc repro sanity` makes it")
    if args.out.exists() and not args.out.is_dir():  # said now, not after the whole test
        raise GateError(f"--out {args.out} is a file: name a folder for lr_find.png and .json")
    params = load_params()
    train = overfit_settings(params.train)  # train.overfit_batches: its few batches, as auto
    seed_everything(params.seed, train.deterministic, compiled=False)
    device = device_for(train)
    data = load_data(args.data, train, device)
    model, mean, std, _ = model_for(train, data, device, print)
    norm = torch.tensor(mean, device=device), torch.tensor(std, device=device)
    train, spread = spread_for(train, model)  # measured as `train.lr: auto` trains
    found = range_test_of(train, model, data, norm, params.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    dataset.write_json(args.out / "lr_find.json", found)
    frozen = " (backbone frozen)" if isinstance(model, FineTune) and train.freeze_epochs else ""
    figure = range_test_figure(found, f"{train.model}{frozen}: {len(found['rates'])} steps")
    figure.savefig(args.out / "lr_find.png", dpi=100)
    if found["suggestion"] is None:
        raise GateError(no_rate(train, found))
    print(
        f"lr-find: suggested train.lr {found['suggestion']:.2e} ({train.model}, "
        f"{len(found['rates'])} steps; plot: {args.out / 'lr_find.png'})"
    )
    if spread:  # a number in train.lr keeps factors of 1: the head's rate for the whole network
        factors = " and ".join(f"train.{key} {value:.2g}" for key, value in spread.items())
        print(
            f"lr-find: measured on the new head alone (train.freeze_epochs {train.freeze_epochs}):"
            f" under `train.lr: auto`, {spread_line(train, found['suggestion'])}; with a number "
            f"in train.lr, set {factors} beside it"
        )


if __name__ == "__main__":
    run(main)
