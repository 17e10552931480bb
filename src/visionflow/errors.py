"""Errors that stages report as one line (no traceback); torch-free, so anything may import them."""


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
