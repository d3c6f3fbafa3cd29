"""The one error policy of the project's command lines (indexer, app.py, training, embedder).

An expected error (bad input the user can fix) ends as ONE line on stderr, ``PROG: error: ...``,
and a non-zero exit code, never a traceback. It lives here because every package may import
embedder (the dependencies point one way: training, indexer, serving -> embedder).
"""
from __future__ import annotations

import sys


def one_line(e: BaseException) -> str:
    """An error's message on one line (a KeyError's own text, not its repr; whitespace and line
    breaks collapsed, so nothing is lost); its type's name when it has no message."""
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(text.split()) or type(e).__name__


def fail(prog: str, e: BaseException | str, code: int = 1) -> int:
    """Print ``PROG: error: MESSAGE`` to stderr and return ``code`` (what ``main`` returns)."""
    print(f"{prog}: error: {e if isinstance(e, str) else one_line(e)}", file=sys.stderr)
    return code
