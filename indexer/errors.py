"""The one exception type the CLI turns into a one-line reason and a non-zero exit."""
from __future__ import annotations


class IndexerError(RuntimeError):
    """A problem the user can fix (bad input, wrong model, empty gallery, ...): the message is
    printed as is, on one line, without a traceback."""


def size_text(b: int | float) -> str:
    """Bytes for a message: 4.0 KiB, 12.3 MiB, 2.0 GiB (a budget of a few KiB must not read "0 MiB")."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{int(b)} B"
