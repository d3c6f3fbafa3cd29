"""Serving a sharded index across Ray nodes: a ``ShardSearcher`` actor per shard, on the node that
built it (:func:`shard_node`), and :class:`Router`, which stands where ``PartsIndex`` stands
(``Index``, the API and the UI unchanged) and merges their top-k. Why: in one process the whole
index must fit one machine. Only query vectors and (distances, ids) travel, over the data plane
(:mod:`indexer.ray.link`); the store is read from the shared filesystem.

Equal answers: the router assigns lists once with the shared coarse quantizer, each actor scans
only those (``search_preassigned``), the router searches the held-out part, and faiss's
``merge_knn_results`` merges in part order (ids, distances and -1 padding as in process).

Node loss: a fan-out waits at most ``timeout`` seconds; a shard that did not answer is named in
the answer's ``partial`` (a search arriving mid fan-out joins the next one: within about twice the
bound); every shard missing is an IndexerError (the API's 503). Actors restart for ever and are
pooled per process by the part file's identity (path, inode, mtime, size) and search parameters,
so a reopened index keeps unchanged shards' actors while requests on the old Router keep theirs.
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait as wait_readable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Callable, Sequence

import faiss
import numpy as np

from ..ann import faiss_index as fx
from ..directory.index_dir import MANIFEST, PART_FILE, RUN_FILE
from ..directory.manifest import Manifest
from ..directory.shard_files import shard_paths
from ..errors import IndexerError
from ..searchable import Answer
from .actor import ShardSearcher, plain_ivf
from .cluster import connect, near, ray_module
from .link import CONNECT_SLICE_S, ShardLink
from .readers import READER_MEMORY

_log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0       # a fan-out's bound: shards slower than this are left out
OPEN_TIMEOUT_S = 120.0        # how long opening waits for every actor to load its part
DEFAULT_CONCURRENCY = 8       # Ray calls one actor runs at once (ready, endpoint, where)


@dataclass(frozen=True)
class RayServing:
    """How a sharded index is served over Ray (``Index.open(ray=...)``; a bare address: these
    defaults). ``address``: ``HOST:PORT``, ``auto``, ``local`` or None (connected already); ``timeout``:
    the fan-out's bound in seconds; ``placement(i, shard_dir)``: Ray options for shard i's actor
    instead of the soft affinity (tests); ``strict``: fail rather than leave a shard out (eval)."""

    address: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    strict: bool = False
    concurrency: int = DEFAULT_CONCURRENCY
    threads: int = 1
    placement: Callable[[int, Path], dict] | None = field(default=None, compare=False)

    @classmethod
    def of(cls, ray: "str | RayServing") -> "RayServing":
        if isinstance(ray, RayServing):
            return ray
        return cls(address=str(ray))

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"--shard-timeout {self.timeout}: expected a positive number of seconds")
        if self.concurrency < 1 or self.threads < 1:
            raise ValueError("RayServing: concurrency and threads must be positive")


def shard_node(shard: Path) -> str | None:
    """The Ray node id that holds ``shard``: where the last ``--ray`` build filled (else built) it,
    per ``OUT/shards/ray.json``; older builds: the shard manifest's ``node``; None: no record."""
    shard = Path(shard)
    try:
        facts = json.loads((shard.parent / RUN_FILE).read_text())
        i = int(shard.name)
        for key in ("fill_nodes", "nodes"):
            nodes = facts.get(key) or []
            if i < len(nodes) and nodes[i]:
                return str(nodes[i])
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    try:
        return json.loads((shard / MANIFEST).read_text()).get("node") or None
    except (OSError, ValueError, AttributeError):
        return None


def _identity(path: Path) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_ino, st.st_mtime_ns, st.st_size)


class _Pool:
    """This process's shard actors, shared by the Routers that search the same part file with
    the same settings; an actor is killed when its last Router is gone."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.actors: dict[tuple, list] = {}        # key -> [handle, users, authkey]

    def acquire(self, key: tuple, make: Callable[[bytes], Any]) -> tuple[Any, bytes]:
        """The actor for ``key`` (made by ``make(authkey)`` if none) and its data plane's key:
        32 random bytes made here for each actor, passed to it at creation, never logged."""
        with self.lock:
            got = self.actors.get(key)
            if got is None:
                authkey = secrets.token_bytes(32)
                got = self.actors[key] = [make(authkey), 0, authkey]
            got[1] += 1
            return got[0], got[2]

    def release(self, keys: Sequence[tuple]) -> None:
        dead = []
        with self.lock:
            for key in keys:
                got = self.actors.get(key)
                if got is None:
                    continue
                got[1] -= 1
                if got[1] <= 0:
                    dead.append(self.actors.pop(key)[0])
        if dead:
            try:
                ray = ray_module()
                if ray.is_initialized():
                    for a in dead:
                        ray.kill(a)
            except Exception:  # noqa: BLE001 - interpreter shutdown: Ray ends them with the driver
                pass


_POOL = _Pool()


class _Request:
    """One caller's search waiting for (or in) a shared fan-out."""

    __slots__ = ("q", "k", "widen", "result", "partial", "error", "done")

    def __init__(self, q: np.ndarray, k: int, widen: float = 1.0) -> None:
        self.q, self.k, self.widen = q, k, widen
        self.result: Any = None
        self.partial: list[int] = []
        self.error: BaseException | None = None
        self.done = False


class Router:
    """A sharded index's parts searched by their shards' actors (a
    :class:`indexer.searchable.Searchable`): each answer names the shards it left out."""

    summary = None                      # each shard's actor holds its own part

    def __init__(self, directory: Path, manifest: Manifest, config: RayServing) -> None:
        ray = ray_module()
        connect(config.address)        # joins unless this process already has
        self.ray, self.config = ray, config
        self.directory = Path(directory)
        sh = manifest.sharded
        params = manifest.search_params or ""
        try:
            trained = faiss.read_index(str(self.directory / sh.trained))
            self.held = fx.no_prefetch(faiss.read_index(str(self.directory / sh.held), faiss.IO_FLAG_MMAP))
        except RuntimeError as e:
            from ..directory.validate import damaged, faiss_reason

            raise damaged(self.directory, f"faiss cannot read a part ({faiss_reason(e)})") from None
        fx.set_search_params(self.held, params)
        # The coarse assignment, once per query here, as IndexShardsIVF does in one process:
        # every part has the trained quantizer, so the actors only scan the lists it names
        # (5 shards searching alone would assign each query 5 times, ~20% of a part's search
        # at nprobe 16: docs/benchmarks/scaling.md). The held part's quantizer carries the search parameters.
        self.ivf = plain_ivf(self.held)
        self.d = int(trained.d)
        self.keep_max = faiss.is_similarity_metric(trained.metric_type)
        self.shards = shard_paths(self.directory, manifest)
        cls = ray.remote(ShardSearcher)
        self.keys: list[tuple] = []
        self.actors: list[Any] = []
        self.links: list[ShardLink] = []
        for i, s in enumerate(self.shards):
            part = s / PART_FILE
            where = config.placement(i, s) if config.placement else near(shard_node(s))
            key = (_identity(part), params, config.concurrency, config.threads, repr(sorted(where.items())))
            # A token of Ray's logical memory: an actor that requests no resource at all is placed
            # anywhere whatever its soft node affinity says (ray_sources.READER_MEMORY's reason).
            # Ray runs its workers at niceness 15 (worker_niceness: batch tasks must not starve
            # the raylet); a serving actor answers a waiting user, at the niceness Ray's own job
            # supervisor gets (0), else on a busy node each search waits behind every other process.
            opts = {"num_cpus": 0, "memory": READER_MEMORY, "max_restarts": -1, "max_task_retries": 0,
                    "max_concurrency": config.concurrency,
                    "runtime_env": {"env_vars": {"RAY_worker_niceness": "0"}}, **where}
            actor, authkey = _POOL.acquire(key, lambda authkey: cls.options(**opts).remote(
                str(part), params, config.threads, authkey))
            self.actors.append(actor)
            self.keys.append(key)
            self.links.append(ShardLink(actor, authkey, None, config.timeout))
        self._finalizer = weakref.finalize(self, _release, list(self.keys), list(self.links))
        self.counts = self._ready()
        self.ntotal = int(sum(self.counts) + self.held.ntotal)
        self._cv = threading.Condition()
        self._queue: list[_Request] = []
        self._leading = False

    def _ready(self) -> list[int]:
        """Every actor's part count and data-plane endpoint, once each has loaded its part (a
        shard that cannot be opened fails here, by name)."""
        refs = [a.ready.remote() for a in self.actors]
        where = [a.endpoint.remote() for a in self.actors]
        ready, _ = self.ray.wait(refs + where, num_returns=2 * len(refs), timeout=OPEN_TIMEOUT_S)
        out = []
        for i, ref in enumerate(refs):
            if ref not in ready or where[i] not in ready:
                self.close()
                raise IndexerError(f"{self.shards[i]}: its shard actor did not start in "
                                   f"{OPEN_TIMEOUT_S:.0f} s (is a node of the cluster able to read it?)")
            try:
                out.append(int(self.ray.get(ref)))
                self.links[i].endpoint = tuple(self.ray.get(where[i]))
            except self.ray.exceptions.RayError as e:
                from .readers import task_error

                self.close()
                raise IndexerError(f"{self.shards[i]}: its shard actor cannot open {PART_FILE} "
                                   f"({task_error(e)})") from None
        return out

    def search(self, q: np.ndarray, k: int, widen: float = 1.0) -> Answer:
        """The parts searched as one, as ``PartsIndex.search``; shards that did not answer in
        time are named in ``partial``. Searches arriving (with the same k and widen) while a
        fan-out is in flight go out together as the next one; each caller gets its own rows."""
        q = np.ascontiguousarray(q, dtype=np.float32)
        k = max(1, min(int(k), max(1, self.ntotal)))
        req = _Request(q, k, float(widen))
        with self._cv:
            self._queue.append(req)
        while True:
            with self._cv:
                while not req.done and self._leading:
                    self._cv.wait()
                if req.done:
                    break
                self._leading = True
            self._lead()                # a batch (this request's, or the first queued k's)
        if req.error is not None:
            raise req.error
        return Answer(*req.result, tuple(req.partial))

    def _lead(self) -> None:
        """Send what is queued (the first request's k) as one fan-out, hand the rows out, and
        let the next waiting thread lead the next batch."""
        try:
            with self._cv:
                key = (self._queue[0].k, self._queue[0].widen)
                batch = [r for r in self._queue if (r.k, r.widen) == key]
                self._queue = [r for r in self._queue if (r.k, r.widen) != key]
            qs = batch[0].q if len(batch) == 1 else np.concatenate([r.q for r in batch])
            d = i = error = None
            missing: list[int] = []
            try:
                d, i, missing = self._fanout(qs, *key)
            except Exception as e:  # noqa: BLE001 - every caller of the batch gets it
                error = e
            row = 0
            for r in batch:
                n = len(r.q)
                r.result = None if d is None else (d[row:row + n], i[row:row + n])
                r.partial, r.error, r.done = list(missing), error, True
                row += n
        finally:
            with self._cv:
                self._leading = False
                self._cv.notify_all()

    def _fanout(self, q: np.ndarray, k: int, widen: float = 1.0) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """One fan-out of ``q`` to every shard's actor and the merge: (D, I, the shards left out:
        no connection now, a failed one, an error answer, or no answer ``timeout`` s after send)."""
        deadline = time.monotonic() + self.config.timeout
        dq = iq = None
        if self.ivf is not None:    # the lists to scan, chosen here: widen is this call's alone
            dq, iq = self.ivf.quantizer.search(q, fx.wider_nprobe(self.ivf, widen))
        message = ForkingPickler.dumps((q, k, dq, iq))     # Connection.send's pickle, once for all
        waiting: dict[Connection, int] = {}
        until = time.monotonic() + min(CONNECT_SLICE_S, self.config.timeout / 4)   # reconnections
        for link in self.links:                     # every shard's connect, if any, at once
            link.prepare(self.ray)
        for i, link in enumerate(self.links):
            conn = link.take(self.ray, until)
            if conn is None:
                continue
            try:
                conn.send_bytes(message)
                waiting[conn] = i
            except (OSError, EOFError, ValueError):
                link.broken(conn)
        # the held-out part, here, meanwhile
        dh, ih = self.held.search(q, k) if iq is None else fx.preassigned(self.ivf, q, k, iq, dq)
        got: dict[int, Any] = {}
        errors: list[str] = []
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in wait_readable(list(waiting), timeout=left):
                i = waiting.pop(conn)
                try:
                    answer = conn.recv()
                except (OSError, EOFError):
                    self.links[i].broken(conn)
                    continue
                self.links[i].give(conn)
                if isinstance(answer, tuple) and len(answer) == 2:
                    got[i] = answer
                else:                              # the actor's error: the shard is left out
                    errors.append(f"shard {i}: {answer}")
        for conn, i in waiting.items():            # late: closed, so no later search reads it
            self.links[i].broken(conn)
        missing = [i for i in range(len(self.links)) if i not in got]
        ds = [got[i][0] for i in sorted(got)]
        is_ = [got[i][1] for i in sorted(got)]
        if missing and self.config.strict:
            raise IndexerError(f"{self.directory}: shard(s) {', '.join(map(str, missing))} did not answer "
                               f"within {self.config.timeout:g} s; the answer would be partial")
        if missing and len(missing) == len(self.links):
            raise IndexerError(f"{self.directory}: no shard answered within {self.config.timeout:g} s "
                               f"(shards {', '.join(map(str, missing))}); is the Ray cluster up?"
                               + (f" ({'; '.join(errors)})" if errors else ""))
        ds.append(dh)
        is_.append(ih)
        if len(ds) == 1:
            return ds[0], is_[0], missing
        return (*faiss.merge_knn_results(np.stack(ds), np.stack(is_), keep_max=self.keep_max), missing)

    def missing(self, timeout: float | None = None) -> list[int]:
        """The shards whose actor does not answer now (within ``timeout``, default the fan-out's
        bound): what ``/api/health`` names."""
        refs = [a.ready.remote() for a in self.actors]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=timeout or self.config.timeout)
        out = []
        for i, ref in enumerate(refs):
            if ref not in ready:
                out.append(i)
                continue
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayError:
                out.append(i)
        return out

    def where(self) -> list[dict]:
        """Each shard actor's process and node."""
        return self.ray.get([a.where.remote() for a in self.actors], timeout=OPEN_TIMEOUT_S)

    def close(self) -> None:
        """Lets go of this Router's connections and actors (each ends with its last Router)."""
        self._finalizer()


def _release(keys: Sequence[tuple], links: Sequence[ShardLink]) -> None:
    for link in links:
        link.close()
    _POOL.release(keys)


