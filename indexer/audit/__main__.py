"""``python -m indexer.audit --index DIR [--out DIR] [-k K]``: the audit standalone
(``python -m indexer audit`` once wired into indexer's CLI)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
