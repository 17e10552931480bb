"""The Prefect side of visionflow: flows that run the DVC pipeline and its sweeps, and show them.

DVC stays the only DAG; these flows ask it, run `dvc` in process groups (visionflow.ops.runner),
and publish what happened. Run from the project root, as the stages are:

    record.py       the run record every flow that holds a workspace keeps, and a stopped run's end
    reproduce.py    the `reproduce` flow, the watcher and `--serve`: python -m orchestration.reproduce
    experiments.py  the `experiments` flow, which picks a sweep's mode: python -m orchestration.experiments
    sweep.py        what every mode shares: the plan, the outcomes, one experiment's run and table row
    in_turn.py      a sweep's experiments one after another, in this checkout
    queued.py       DVC's queue, N at a time, in this checkout
    spread.py       one flow run per experiment on a work pool's workers, each in its own checkout
    server.py       what the command lines give Prefect's temporary server, and say when it fails

Orchestration imports the library (visionflow) and Prefect, never the stages (`pipeline`); the
library never imports it (tests/test_layering.py).
"""
