"""LMDB environments shared per process, and reads that survive another process growing the map.

py-lmdb (and LMDB itself) must not open one environment twice in a process, while an Index and
a tool may both want the same store: environments are shared per (process, path),
reference-counted and opened on demand. :class:`LmdbStore` is the environment under a store
(``indexer.store.GalleryStore`` adds the key layout on top).

Readers open read-only *with* the lock file (when the directory is writable), because a server
may read while ``indexer add`` writes in another process: the lock file's reader table is what
keeps the writer from reusing pages a reader still sees (``lock=False`` is only safe when nobody
writes). When the writer grows the map past the reader's mapping, LMDB refuses new read
transactions with ``MapResizedError``; the remedy, ``set_mapsize(0)`` (adopt the new size), may
only run while no transaction of this process is open. :class:`ReadGate` provides exactly that:
reads share it, a remap takes it alone.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Self, Sequence

import lmdb

from .errors import IndexerError
from .validate import check_lmdb


class ReadGate:
    """A readers-share / remap-alone lock (the standard library has no read-write lock)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._remapping = False
        self._local = threading.local()

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._remapping:
                self._cond.wait()
            self._readers += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    def remap(self, env: lmdb.Environment, path: Path) -> None:
        """Adopt the map size another process grew the file to, once no read is open here."""
        if getattr(self._local, "depth", 0):
            # This thread itself holds an open read (a nested read): remapping now would pull
            # the map from under it. Rare; the caller's request fails cleanly and can be retried.
            raise IndexerError(f"{path}: the gallery store grew during a read; retry")
        with self._cond:
            if self._remapping:             # another thread is already doing it: wait for it
                while self._remapping:
                    self._cond.wait()
                return
            self._remapping = True
            try:
                while self._readers:
                    self._cond.wait()
                env.set_mapsize(0)
            finally:
                self._remapping = False
                self._cond.notify_all()


@dataclass
class SharedEnv:
    env: lmdb.Environment
    dbs: dict[str, Any]
    readonly: bool
    refs: int = 1
    gate: ReadGate = field(default_factory=ReadGate)


_ENVS: dict[tuple[int, str], SharedEnv] = {}     # (pid, realpath) -> environment
_LOCK = threading.Lock()
_OPEN_LOCK = threading.Lock()       # two threads' first queries must not both acquire
DEFAULT_MAP_SIZE = 1 << 30


def acquire(path: Path, *, readonly: bool, map_size: int, names: Sequence[str],
            dupsort: Sequence[str] = ()) -> SharedEnv:
    """The process's environment for ``path`` (opened now if needed); pair with :func:`release`."""
    key = (os.getpid(), os.path.realpath(path))
    with _LOCK:
        shared = _ENVS.get(key)
        if shared is not None:
            if shared.readonly and not readonly:
                raise IndexerError(f"{path}: store is open read-only in this process (an open Index?); "
                                   "close it before writing")
            shared.refs += 1
            return shared
        shared = _open(path, readonly, map_size, names, dupsort)
        _ENVS[key] = shared
        return shared


def _open(path: Path, readonly: bool, map_size: int, names: Sequence[str],
          dupsort: Sequence[str]) -> SharedEnv:
    data = path / "data.mdb"
    if readonly or (data.exists() and data.stat().st_size > 0):
        check_lmdb(path)            # before LMDB maps a file that may be cut short (SIGBUS)
    try:
        if readonly:
            # map_size 0: adopt the size recorded in the file; lock file whenever we may use one
            env = lmdb.open(str(path), readonly=True, lock=os.access(path, os.W_OK), map_size=map_size,
                            max_dbs=len(names), readahead=False, max_readers=1024)
        else:
            path.mkdir(parents=True, exist_ok=True)
            env = lmdb.open(str(path), map_size=map_size, max_dbs=len(names), readahead=False)
    except lmdb.Error as e:
        raise IndexerError(f"{path}: cannot open the gallery store ({str(e).splitlines()[0]}); "
                           "rebuild the index with `python -m indexer build`") from None
    try:
        dbs = {n: env.open_db(n.encode(), create=not readonly, dupsort=(n in dupsort)) for n in names}
    except lmdb.Error as e:
        env.close()
        raise IndexerError(f"{path}: not a gallery store ({str(e).splitlines()[0]}); "
                           "rebuild the index with `python -m indexer build`") from None
    return SharedEnv(env, dbs, readonly)


def release(path: Path) -> None:
    key = (os.getpid(), os.path.realpath(path))
    with _LOCK:
        shared = _ENVS.get(key)
        if shared is None:
            return
        shared.refs -= 1
        if shared.refs <= 0:
            del _ENVS[key]
            shared.env.close()


@contextmanager
def read_txn(shared: SharedEnv, path: Path) -> Iterator[lmdb.Transaction]:
    """A read transaction of a read-only environment, remapping first if the map has grown."""
    for _ in range(3):
        with shared.gate.reading():
            try:
                txn = shared.env.begin(write=False, buffers=False)
            except lmdb.MapResizedError:
                txn = None
            if txn is not None:
                with txn:
                    yield txn
                return
        shared.gate.remap(shared.env, path)
    raise IndexerError(f"{path}: the gallery store keeps growing past its map; retry")


class LmdbStore:
    """An LMDB environment with named databases (``NAMES``), opened lazily in each process
    (so a store pickles before first use), read and written through :meth:`_read` and
    :meth:`write`. Subclasses own the key layout; this class owns only the environment."""

    NAMES: tuple[str, ...] = ()
    DUPSORT: tuple[str, ...] = ()

    def __init__(self, path: str | Path, *, readonly: bool = True, map_size: int | None = None) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self._map_size = map_size if map_size is not None else (0 if readonly else DEFAULT_MAP_SIZE)
        self._env: lmdb.Environment | None = None
        self._shared: SharedEnv | None = None
        self._dbs: dict[str, Any] = {}
        self._pid = -1
        self._txn_lock: threading.RLock | None = None if readonly else threading.RLock()

    @property
    def exists(self) -> bool:
        """Whether the LMDB file is there (a writer creates it on first use)."""
        return (self.path / "data.mdb").exists()

    def __getstate__(self) -> dict:
        d = self.__dict__.copy()
        d.update(_env=None, _shared=None, _dbs={}, _pid=-1, _txn_lock=None)
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        if not self.readonly:
            self._txn_lock = threading.RLock()

    @property
    def env(self) -> lmdb.Environment:
        if self._env is None or self._pid != os.getpid():
            with _OPEN_LOCK:
                if self._env is None or self._pid != os.getpid():
                    shared = acquire(self.path, readonly=self.readonly, map_size=self._map_size,
                                     names=self.NAMES, dupsort=self.DUPSORT)
                    self._shared, self._dbs, self._pid, self._env = shared, shared.dbs, os.getpid(), shared.env
        return self._env

    def close(self) -> None:
        if self._env is not None and self._pid == os.getpid():
            release(self.path)
        self._env, self._shared, self._dbs = None, None, {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _db(self, name: str) -> Any:
        self.env  # noqa: B018 - opens lazily
        return self._dbs[name]

    @contextmanager
    def _read(self) -> Iterator[lmdb.Transaction]:
        """A read transaction. In a writer, reads and writes from several threads (the ingest
        reader thread and the committing thread) are serialised, because growing the map is
        only allowed while no transaction of this process is open."""
        if self._txn_lock is None:      # read-only: survives a writer growing the map
            self.env  # noqa: B018 - opens lazily
            with read_txn(self._shared, self.path) as txn:  # type: ignore[arg-type]
                yield txn
        else:
            with self._txn_lock, self.env.begin(write=False, buffers=False) as txn:
                yield txn

    def write(self, fn: Callable[[lmdb.Transaction], Any]) -> Any:
        """Run ``fn`` in one write transaction; on MDB_MAP_FULL double the map and retry.

        ``fn`` must only touch the transaction (it may run more than once).
        """
        if self.readonly:
            raise IndexerError(f"{self.path}: store opened read-only")
        with self._txn_lock:  # type: ignore[union-attr]
            while True:
                try:
                    with self.env.begin(write=True) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)

    @property
    def map_size(self) -> int:
        return self.env.info()["map_size"]
