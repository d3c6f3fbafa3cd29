"""``python -m indexer``: build, add, remove, repair, search, eval, info, merge. Bad input: one
line, exit 1 (2 bad usage). Writing commands hold the writer lock (:mod:`indexer.directory.lock`):
a second writer exits 1 naming the first one's pid, or waits with ``--wait``.
"""
from __future__ import annotations

import sys

from embedder import use_batch_budget
from embedder.cli import run_main

from .cli.parser import parser
from .errors import IndexerError


def main(argv: list[str] | None = None) -> int:
    import lmdb

    return run_main("indexer", parser(), argv, expected=(IndexerError, lmdb.Error),
                    on_interrupt="interrupted (rerun the same command to resume)")


if __name__ == "__main__":
    use_batch_budget()          # the user's own files: a phone's 24 MP HEIC is read, not refused
    sys.exit(main())
