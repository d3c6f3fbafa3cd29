"""The one exception type the CLI turns into a one-line reason and a non-zero exit."""
from __future__ import annotations


class IndexerError(RuntimeError):
    """A problem the user can fix (bad input, wrong model, empty gallery, ...).

    The message is meant to be printed as is, on one line, without a traceback.
    """
