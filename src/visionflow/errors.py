"""Errors that stages report as one line (no traceback); torch-free, so anything may import them."""


class DataError(ValueError):
    """The source data cannot be used; the message names the file, folder or class."""
