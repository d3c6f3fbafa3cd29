"""LMDB environments shared per process, and reads that survive another process growing the map.

LMDB must not open one environment twice in a process: environments are shared per (process,
path), reference-counted, opened on demand (:class:`LmdbStore`). Readers open read-only *with*
the lock file (when writable): its reader table keeps a writer in another process from reusing
pages a reader sees. A grown map fails new reads with ``MapResizedError``, and ``set_mapsize(0)``
may run only with no transaction open (:class:`ReadGate`: reads share it, a remap takes it alone).
A file truncated *after* it was mapped kills the process with SIGBUS at the first read past its
end, so each read-only transaction first checks the file (:class:`MappedFile`, microseconds) and
raises :class:`StoreUnavailable`; a replaced file is adopted once :func:`check_lmdb` passes.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Self, Sequence

import lmdb

from ..directory.validate import check_lmdb
from ..errors import IndexerError
from .lmdb_faults import DAMAGE, FULL_DISK_SLACK, READ_DAMAGE, DiskFullError, MappedFile, StoreUnavailable, damaged_store


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

    def alone(self, fn: Callable[[], Any], path: Path, nested: str) -> None:
        """Run ``fn`` once no read of this process is open (or return once another thread did)."""
        if getattr(self._local, "depth", 0):
            # This thread itself holds an open read (a nested read): remapping now would pull
            # the map from under it. Rare; the caller's request fails cleanly and can be retried.
            raise IndexerError(f"{path}: {nested}")
        with self._cond:
            if self._remapping:             # another thread is already doing it: wait for it
                while self._remapping:
                    self._cond.wait()
                return
            self._remapping = True
            try:
                while self._readers:
                    self._cond.wait()
                fn()
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
    mapped: MappedFile | None = None                   # read-only environments: the checked file
    spec: tuple = ()                                   # (map_size, names, dupsort) to reopen with
    closed: bool = False                               # replaced file: old env closed, new not open


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
        shared.spec = (map_size, tuple(names), tuple(dupsort))
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
    mapped = MappedFile(path, env.stat()["psize"]) if readonly else None
    return SharedEnv(env, dbs, readonly, mapped=mapped)


def release(path: Path) -> None:
    key = (os.getpid(), os.path.realpath(path))
    with _LOCK:
        shared = _ENVS.get(key)
        if shared is None:
            return
        shared.refs -= 1
        if shared.refs <= 0:
            del _ENVS[key]
            if not shared.closed:
                shared.env.close()
                if shared.mapped is not None:
                    shared.mapped.close()


@contextmanager
def read_txn(shared: SharedEnv, path: Path, check: bool = True) -> Iterator[lmdb.Transaction]:
    """A read transaction of a read-only environment, remapping first if the map has grown;
    StoreUnavailable (never a read) when the file is not what was mapped (see the module doc)."""
    if check and shared.mapped is not None:
        _check_mapped(shared, path)
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
        # adopt the map size another process grew the file to, once no read is open here
        shared.gate.alone(lambda: shared.env.set_mapsize(0), path, "the gallery store grew during a read; retry")
    raise IndexerError(f"{path}: the gallery store keeps growing past its map; retry")


def _check_mapped(shared: SharedEnv, path: Path) -> None:
    mapped = shared.mapped
    problem = "replaced" if shared.closed else mapped.problem(shared.env)   # type: ignore[union-attr]
    if problem is None:
        return
    data = path / "data.mdb"
    if problem == "replaced":
        try:
            check_lmdb(path)            # the new file must be sound before it is mapped
            shared.gate.alone(lambda: _adopt(shared, path), path, "the gallery store was replaced during a read; retry")
            return
        except IndexerError as e:
            raise StoreUnavailable(f"{data}: replaced under the running process, and the new file cannot be "
                                   f"used ({str(e).split(': ', 1)[-1]})") from None
    raise StoreUnavailable(f"{data}: {problem} under the running process; not read (a read could crash it); "
                           f"restore the file or rebuild the index with `python -m indexer build`")


def _adopt(shared: SharedEnv, path: Path) -> None:
    """Swap a replaced file's environment in (called with no read of this process open).
    py-lmdb opens a path once per process, so the old environment is closed first."""
    if not shared.closed:
        if shared.mapped is None or shared.mapped.problem(shared.env) != "replaced":
            return                  # another thread adopted it already
        shared.env.close()
        shared.mapped.close()
        shared.closed = True
    map_size, names, dupsort = shared.spec
    new = _open(path, True, map_size, names, dupsort)
    shared.env, shared.mapped, shared.closed = new.env, new.mapped, False
    shared.dbs.clear()
    shared.dbs.update(new.dbs)      # stores hold this dict: they see the new handles


class LmdbStore:
    """An LMDB environment with named databases (``NAMES``), opened lazily per process (it
    pickles before first use); subclasses own the key layout, this class the environment."""

    NAMES: tuple[str, ...] = ()
    DUPSORT: tuple[str, ...] = ()
    #: read-only transactions check the mapped file first; False only to time what that costs
    #: (benchmarks/serving/store_check_cost.py)
    check_reads: bool = True

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
        if self._shared is not None and self._shared.env is not self._env:
            self._env = self._shared.env    # the file was replaced and reopened (_adopt)
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
        """A read transaction; in a writer, serialised with the writes of other threads (growing
        the map needs no transaction of this process open)."""
        try:
            if self._txn_lock is None:      # read-only: survives a writer growing the map
                self.env  # noqa: B018 - opens lazily
                with read_txn(self._shared, self.path, self.check_reads) as txn:  # type: ignore[arg-type]
                    yield txn
            else:
                with self._txn_lock, self.env.begin(write=False, buffers=False) as txn:
                    yield txn
        except READ_DAMAGE as e:
            raise damaged_store(self.path, e) from None

    def probe(self) -> None:
        """Read the first record of every database (the pages from each root down: a few page
        reads, cheap enough for each health request); garbage there fails in one line."""
        with self._read() as txn:
            for name in self.NAMES:
                try:
                    txn.cursor(self._db(name)).first()
                except READ_DAMAGE as e:
                    raise damaged_store(self.path, e, name) from None

    def walk(self) -> dict[str, int]:
        """Read every record of every database, values included (``indexer info --deep``): name
        -> records. Garbage the open-time checks cannot see fails in one line naming the file
        and database; seconds per GB, so only on request."""
        out = {}
        for name in self.NAMES:
            n = 0
            with self._read() as txn:
                try:
                    for _, v in txn.cursor(self._db(name)):
                        n += len(v) >= 0
                except READ_DAMAGE as e:
                    raise damaged_store(self.path, e, name) from None
            out[name] = n
        return out

    def write(self, fn: Callable[[lmdb.Transaction], Any]) -> Any:
        """Run ``fn`` (touching only the transaction; it may run twice) in one write
        transaction; on MDB_MAP_FULL double the map and retry."""
        if self.readonly:
            raise IndexerError(f"{self.path}: store opened read-only")
        with self._txn_lock:  # type: ignore[union-attr]
            while True:
                try:
                    with self.env.begin(write=True) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)
                except DAMAGE as e:
                    raise damaged_store(self.path, e) from None
                except lmdb.Error as e:
                    raise self._write_failed(e) from None

    def _write_failed(self, e: lmdb.Error) -> IndexerError:
        """A failed write transaction, told in one line; on a full disk the file is cut back to
        the committed size, so the failed command leaves the disk as it found it."""
        import shutil

        data = self.path / "data.mdb"
        try:
            free = shutil.disk_usage(self.path).free
            committed = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
            size = data.stat().st_size
        except (OSError, lmdb.Error):
            return IndexerError(f"{data}: write failed ({str(e).splitlines()[0]})")
        if free >= FULL_DISK_SLACK and "No space" not in str(e):
            return IndexerError(f"{data}: write failed ({str(e).splitlines()[0]})")
        given = 0
        if size > committed:
            os.truncate(data, committed)
            given = size - committed
        return DiskFullError(data, free + given, given)

    @property
    def map_size(self) -> int:
        return self.env.info()["map_size"]
