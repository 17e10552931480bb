"""The errors users meet, each reported as one line (no traceback) naming what is wrong; torch-free,
so anything may import them (each module that raises one imports it from here)."""

from pathlib import Path


class DataError(ValueError):
    """The source data cannot be used; the message names the file, folder or class.

    `setting` is the argument whose value the data went against (`max_bad_fraction`, say): the
    library knows values, not params files, so the stage names its key (`prepare.max_bad_fraction`).
    """

    def __init__(self, message: str, setting: str | None = None):
        super().__init__(message)
        self.setting = setting


class Unavailable(RuntimeError):
    """Something the params ask for is not there (a GPU, a weights file, the network); the message
    says what is missing and the fix, and the stage adds the params key."""


class DiskFull(OSError):
    """No room to write; the message names the folder and, where known, the bytes needed and free."""

    @classmethod
    def at(cls, folder, needed: int | None = None) -> "DiskFull":
        import shutil

        free = shutil.disk_usage(folder).free
        need = f"{needed / 2**20:.1f} MB needed, " if needed is not None else ""
        return cls(f"disk full: no room to write in {folder} ({need}{free / 2**20:.1f} MB free)")


class ParamsError(ValueError):
    """params.yaml (or dvc.yaml beside it) cannot be used; the message names the file and every
    offending key."""


class StageFailed(RuntimeError):
    """A stage or a dvc command failed; the message carries the end of its output."""


class DvcHung(StageFailed):
    """A helper dvc command ran past DVC_TIMEOUT_S."""


class DvcBusy(RuntimeError):
    """Another `dvc` process holds the repository's lock (a user's own `dvc` command, say)."""

    @classmethod
    def at(cls, workdir: Path, what: str) -> "DvcBusy":
        return cls(f"{what}: another dvc process holds {workdir}/.dvc/tmp/lock")


class NotAProject(RuntimeError):
    """No `.dvc` folder here or above."""


class Timeout(TimeoutError):
    """A command ran past its time and was stopped with its whole process group (SIGINT, then
    SIGKILL after the grace period)."""


class ModelError(ValueError):
    """A model file that cannot be used as it is: untrusted code, bad or mismatched metadata."""


class CannotExport(RuntimeError):
    """No ONNX exporter can express the model: nothing else is worth making."""


class OutOfMemory(RuntimeError):
    """The GPU ran out of memory and no retry was left; the health report has the numbers."""


class NonFiniteLoss(RuntimeError):
    """Too many non-finite losses in a row; the message names the epoch and step."""


class GateError(RuntimeError):
    """A stage's check failed; the message carries the numbers."""


class Interrupted(RuntimeError):
    """Ctrl-C or SIGTERM stopped the stage at a safe point; the message says what was kept."""
