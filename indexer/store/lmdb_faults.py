"""What can go wrong under an LMDB store, as one line each: a file truncated, replaced or removed
under this process (:class:`MappedFile`, checked before every read), pages LMDB cannot read
(``DAMAGE``), a full disk (:class:`DiskFullError`)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import lmdb

from ..errors import IndexerError


class StoreUnavailable(IndexerError):
    """The store's file was truncated, replaced or removed under this process: not read."""


# What LMDB raises for pages that are not what their parents say (garbage written inside the
# file, not a truncation): a request that meets one answers 503 naming the file, not 500.
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadValsizeError, lmdb.PanicError,
          lmdb.InvalidError)
# A read transaction whose page fetch met such a page is flagged failed inside LMDB, and some
# calls then report only that (MDB_BAD_TXN): in a read, nothing else marks a transaction so.
READ_DAMAGE = (*DAMAGE, lmdb.BadTxnError)


def damaged_store(path: Path, e: BaseException, db: str = "") -> StoreUnavailable:
    of = f" of database {db!r}" if db else ""
    return StoreUnavailable(f"{Path(path) / 'data.mdb'}: damaged: LMDB cannot read a page{of} ({e}); "
                            "restore the file or rebuild the index with `python -m indexer build` "
                            "(`python -m indexer info --deep` walks the whole store)")


class DiskFullError(IndexerError):
    """A write transaction failed with the store's disk full (LMDB reports it as EIO, so the free
    space tells); ``need``: the whole command's estimate, filled in by ``needing``."""

    def __init__(self, data: Path, free: int, given: int, need: int | None = None) -> None:
        self.data, self.free, self.given, self.need = data, free, given, need
        mb = lambda n: f"{n / 2 ** 20:.1f} MB"   # noqa: E731
        needs = f"needs about {mb(need)}, " if need else ""
        back = f"; the failed write's {mb(given)} given back" if given else ""
        super().__init__(f"no space left on device: {data} ({needs}{mb(free)} free{back}); free some "
                         "space and rerun the same command (it resumes where it stopped)")

    def needing(self, need: int) -> "DiskFullError":
        return DiskFullError(self.data, self.free, self.given, need)


FULL_DISK_SLACK = 1 << 20      # less free than this after a failed write: the disk is full


class MappedFile:
    """``data.mdb`` as this process mapped it: a descriptor of the same inode (a size check is one
    ``fstat``) plus the path. Cheap before every read: LMDB's meta read only when the size changed, the
    path stat'ed at most every ``STAT_EVERY_S`` (a replacement leaves the mapped inode whole)."""

    STAT_EVERY_S = 0.2

    def __init__(self, store_dir: Path, psize: int) -> None:
        self.path = Path(store_dir) / "data.mdb"
        self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        st = os.fstat(self.fd)
        self.ident = (st.st_dev, st.st_ino)
        self.psize = psize
        self._good_size = -1            # the size at the last check that passed
        self._stat_at = time.monotonic()

    def problem(self, env: lmdb.Environment) -> str | None:
        """Why reading ``env`` now could crash or read the wrong file ("replaced" / "removed" /
        a truncation), or None. Meta pages are only looked at once the file holds them."""
        size = os.fstat(self.fd).st_size
        truncated = None
        if size != self._good_size:
            need = 2 * self.psize
            if size >= need:
                need = max(need, (env.info()["last_pgno"] + 1) * self.psize)
            if size < need:
                truncated = f"truncated ({size} bytes, the store needs {need})"
            else:
                self._good_size = size
        now = time.monotonic()
        if truncated or now - self._stat_at >= self.STAT_EVERY_S:
            try:                        # a truncated inode may since have been replaced: adopt that
                cur = os.stat(self.path)
            except FileNotFoundError:
                return "removed"
            if (cur.st_dev, cur.st_ino) != self.ident:
                return "replaced"
            self._stat_at = now
        return truncated

    def close(self) -> None:
        os.close(self.fd)
