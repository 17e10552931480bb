"""What a Prefect worker runs before each flow run of prefect.yaml's deployments: the pull step
that makes the run's working directory this machine's checkout.

Prefect fills `{{ $VAR }}` in prefect.yaml when `prefect deploy` runs, so a deployment made on
one machine sent every worker to that machine's path. `worker_checkout` reads the variable
when the run starts, in the worker's own environment: each machine keeps its checkout where it
likes. Standard library only: it runs before the checkout's code is on the path.
"""

import os
from pathlib import Path

VARIABLE = "VISIONFLOW_WORKDIR"


def worker_checkout() -> dict[str, str]:
    """Prefect pull step: change to the checkout that VISIONFLOW_WORKDIR names in this worker's
    environment (the returned `directory` is available to later steps, as Prefect's own
    `set_working_directory` returns it)."""
    path = os.environ.get(VARIABLE, "")
    if not path:
        raise RuntimeError(
            f"{VARIABLE} is not set where this worker runs: start the worker with "
            f"`{VARIABLE}=/path/to/your/checkout prefect worker start --pool visionflow`"
        )
    if not (Path(path) / "dvc.yaml").is_file():
        raise RuntimeError(f"{VARIABLE}={path}: no dvc.yaml there; point it at a checkout")
    os.chdir(path)
    return {"directory": path}
