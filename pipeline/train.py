"""Stage train: fit the model on the cached train split, keep the best by validation accuracy.

Reads:  params.yaml (seed, train.*); the cache from prepare; sanity's scan (train runs after the check)
Writes: <out>/model.pt (best epoch: state_dict + meta, loads with weights_only=True),
        <out>/metrics.json (what `dvc metrics` compares: the kept epoch and its val accuracy,
        healthy and the count of findings), <out>/health.json (every check that reads no clock),
        <out>/live/ (DVCLive: per-epoch curves, x = epoch); <out>.timings/ (not a DVC output: the
        run's images/s, epoch seconds, peak memory and data wait, DVCLive curves, and health.json,
        the data-bound check; they differ on every run, the outputs not),
        <checkpoints>/<fingerprint>/ (resumable state: a checkpoint per epoch and best-<epoch>.pt, for this run's params, data and code
        only; not a DVC output, so DVC neither deletes nor tracks it; kept until DVC has recorded
        the outputs it gave, then the next run of the same configuration starts fresh),
        <checkpoints>/.lock (held while the stage runs: a second trainer waits for the first)
Run:    python -m pipeline.train --data data/prepared --out results/train --checkpoints checkpoints/train

The run itself is `visionflow.fit.run.Run`: a killed run resumes from its last checkpoint on the
next `dvc repro` and ends with the same weights and metrics as an uninterrupted one (CPU,
train.deterministic: true). So does a finished run given a larger train.epochs (plateau, step or
no schedule: the cosine schedule's rate depends on the budget); a run that cannot resume says
which key changed since the newest checkpoint.
"""

import argparse
from pathlib import Path

from pipeline import code_digest, run, staged, when_published
from visionflow.fit.run import Run
from visionflow.params import load_params


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train on the cached train split.")
    parser.add_argument("--data", type=Path, required=True, help="cache folder from prepare")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    parser.add_argument("--checkpoints", type=Path, required=True, help="resumable state folder")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    training = Run(load_params(), args.data, args.out, args.checkpoints, code_digest("train"))
    training.resume()
    staging = staged(args.out) if training.rank == 0 else None  # moved to --out on success
    training.fit(staging)
    if training.rank == 0:
        training.write_outputs(staging)
        # once the outputs are in place: a refused run (a dep changed while it ran) is not marked
        when_published(training.mark_published)


if __name__ == "__main__":
    run(main)
