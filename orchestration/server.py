"""The Prefect API that the command lines (`python -m orchestration.reproduce`, `...experiments`)
talk to. Without PREFECT_API_URL, Prefect starts a temporary server for the command's flow runs
and waits PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS for it, 20 s by default: at a load of 8
on 2 cores that failed every time. The commands wait STARTUP_TIMEOUT_S unless that setting is set
(environment, profile), and when even that is not enough they say in one line what to do.
"""

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

STARTUP_TIMEOUT_S = 180  # seconds; `prefect server start` answered in about 15 s on idle 2 cores
NOT_STARTED = "Timed out while attempting to connect to ephemeral Prefect API server"  # Prefect's


@contextmanager
def patient_server() -> Iterator[None]:
    """Give Prefect's temporary server STARTUP_TIMEOUT_S to start (a user's own setting wins);
    if it still does not answer, exit with one line that says what to do instead."""
    patience = {PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: STARTUP_TIMEOUT_S}
    with temporary_settings(set_defaults=patience) as settings:
        try:
            yield
        except RuntimeError as error:
            if NOT_STARTED not in str(error):
                raise
            waited = settings.server.ephemeral.startup_timeout_seconds
            sys.exit(
                f"error: Prefect's temporary server did not start in {waited} s (a busy "
                "machine?): run `prefect server start` in another terminal and `prefect config "
                "set PREFECT_API_URL=http://127.0.0.1:4200/api`, or raise "
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
            )
