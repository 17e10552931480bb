"""Stage entry points: `python -m pipeline.<stage>`, one per stage in dvc.yaml."""

import sys
from collections.abc import Callable

from visionflow.data import DataError
from visionflow.params import ParamsError


class GateError(RuntimeError):
    """A stage's check failed; the message carries the numbers."""


def run(main: Callable[[], None]) -> None:
    """Run a stage's main; a known failure prints one clear line and exits 1 (no traceback)."""
    try:
        main()
    except (ParamsError, DataError, GateError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
