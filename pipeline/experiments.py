"""The older name of orchestration/experiments.py (a sweep of experiments), kept so that
`python -m pipeline.experiments ...` and imports of it still work."""

from orchestration.experiments import experiments, main  # noqa: F401
from orchestration.spread import experiment  # noqa: F401

if __name__ == "__main__":
    main()
