"""``python -m indexer``: build, add, remove, repair, search, eval, info, merge.

Every command prints a one-line reason to stderr and exits 1 on bad input (2 for bad usage).
The commands that write an index directory (build, add, remove, repair, merge) hold its writer
lock (:mod:`indexer.directory.lock`): a second writer exits 1 naming the first one's pid, or waits with
``--wait``.
"""
from __future__ import annotations

import sys

from embedder.cli import run_main

from .cli.parser import parser
from .errors import IndexerError


def main(argv: list[str] | None = None) -> int:
    import lmdb

    return run_main("indexer", parser(), argv, expected=(IndexerError, lmdb.Error),
                    on_interrupt="interrupted (rerun the same command to resume)")


if __name__ == "__main__":
    sys.exit(main())
