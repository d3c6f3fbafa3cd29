"""Serving a sharded index across Ray nodes: one actor per shard, and the router that fans a
query batch out to them and merges their top-k.

Why: ``Index.open`` serves a sharded index in one process (:class:`indexer.shards.PartsIndex`:
every part memory-mapped there), so the whole index must fit one machine's page cache and
CPUs. Here each shard's part is searched by a ``ShardSearcher`` actor on the node that built
the shard (``ray_build._near``: soft affinity to the node its shard manifest records as
``node``; elsewhere at once if that node is gone), and :class:`Router` stands where
``PartsIndex`` stands in an :class:`indexer.Index` (``search(q, k) -> (D, I)``, ``ntotal``,
``d``), so ``Index``, ``Searcher``, the API and the UI are unchanged. Only the query vectors go
out and (distances, ids) come back; the store (metadata, thumbnails) is read by the serving
process from the shared filesystem, as the build already requires (every path means the same
files on every node).

Equal answers: every part is a copy of the trained index (the same coarse quantizer) searched
with the index's search parameters, so each actor's top-k is exactly the shard's share of what
``IndexShardsIVF`` computes in one process; the held-out vectors' small part is searched by the
router itself (it lives in the index directory, beside the manifest). The merge is faiss's own
``merge_knn_results`` (what ``IndexShards`` uses), in the same part order, so ids, distances and
the -1 padding are those of the in-process search.

Node loss: a fan-out waits at most ``timeout`` seconds; a shard whose actor did not answer in
time or died is left out and named in :attr:`Router.partial` (per thread: the last search of the
calling thread), which serving turns into the answer's ``partial`` field; :meth:`Router.missing`
pings every actor (``/api/health``). A search that arrives while a fan-out is in flight waits
for it and goes out with the next one (:meth:`Router.search`), so it ends within about twice
the bound. Actors are restarted by Ray for ever (``max_restarts=-1``);
an answer is whole again as soon as the shard's actor answers, with no restart of the server.
When every shard is missing the search fails (IndexerError: the API's 503).

Live updates: a reopened index (``Index.reopen`` after ``indexer add/remove``) gets a new
Router; actors are shared through a per-process pool keyed by the part file's identity (path,
inode, mtime, size: parts are replaced atomically, never rewritten in place) and the search
parameters, so an unchanged shard keeps its actor and a changed one gets a new actor, while
requests still on the old Router keep the old actors until that Router is gone (one request, one
state). Ray is imported lazily.
"""
from __future__ import annotations

import json
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import faiss
import numpy as np

from . import faiss_index as fx
from .errors import IndexerError
from .index_dir import MANIFEST, PART_FILE
from .manifest import Manifest
from .ray_sources import READER_MEMORY
from .shards import shard_paths

DEFAULT_TIMEOUT_S = 5.0       # a fan-out's bound: shards slower than this are left out
OPEN_TIMEOUT_S = 120.0        # how long opening waits for every actor to load its part
DEFAULT_CONCURRENCY = 8       # searches one actor runs at once (faiss releases the GIL)


@dataclass(frozen=True)
class RayServing:
    """How a sharded index is served over Ray (``Index.open(ray=...)``; a bare address string
    means these defaults). ``address``: the cluster (``HOST:PORT``, ``auto``, ``local``; None:
    this process is already connected). ``timeout``: the fan-out's bound in seconds.
    ``placement(i, shard_dir)``: Ray options for shard i's actor instead of the soft affinity to
    the node that built it (a test pins actors to nodes it will kill). ``strict``: a search that
    would leave a shard out fails instead (``indexer eval``: no figure from a partial answer)."""

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


class ShardSearcher:
    """The Ray actor: one shard's part, memory-mapped on its node, searched with the index's
    search parameters. Stateless between calls, so a restarted actor answers the same."""

    def __init__(self, part_file: str, search_params: str, threads: int = 1) -> None:
        faiss.omp_set_num_threads(max(1, int(threads)))
        self.part_file = part_file
        self.index = faiss.read_index(part_file, faiss.IO_FLAG_MMAP)
        fx.set_search_params(self.index, search_params)

    def ready(self) -> int:
        """The part's vector count (also: the actor is up)."""
        return int(self.index.ntotal)

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.search(q, k)

    def where(self) -> dict:
        """This actor's process and node (tests, ``describe``)."""
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "part": self.part_file}


def _ray() -> Any:
    from .ray_build import _ray as import_ray

    return import_ray()


def shard_node(shard: Path) -> str | None:
    """The Ray node id that holds ``shard``: where the last ``--ray`` build filled its part
    (``fill_nodes``) or, failing that, built it (``nodes``), as ``OUT/shards/ray.json`` records
    them (``ray_build.RUN_FILE``); older builds: the shard manifest's ``node``. None: no record."""
    from .ray_build import RUN_FILE

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
        self.actors: dict[tuple, list] = {}        # key -> [handle, users]

    def acquire(self, key: tuple, make: Callable[[], Any]) -> Any:
        with self.lock:
            got = self.actors.get(key)
            if got is None:
                got = self.actors[key] = [make(), 0]
            got[1] += 1
            return got[0]

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
                ray = _ray()
                if ray.is_initialized():
                    for a in dead:
                        ray.kill(a)
            except Exception:  # noqa: BLE001 - interpreter shutdown: Ray ends them with the driver
                pass


_POOL = _Pool()


def connect(address: str | None) -> None:
    """Join the cluster unless this process already has (``ray_build.connect``: one line for an
    unreachable address)."""
    ray = _ray()
    if not ray.is_initialized():
        from .ray_build import connect as ray_connect

        ray_connect(address)


class _Request:
    """One caller's search waiting for (or in) a shared fan-out."""

    __slots__ = ("q", "k", "result", "partial", "error", "done")

    def __init__(self, q: np.ndarray, k: int) -> None:
        self.q, self.k = q, k
        self.result: Any = None
        self.partial: list[int] = []
        self.error: BaseException | None = None
        self.done = False


class Router:
    """A sharded index's parts searched by their shards' actors: ``PartsIndex``'s face
    (``search``, ``ntotal``, ``d``), plus :attr:`partial` and :meth:`missing`."""

    def __init__(self, directory: Path, manifest: Manifest, config: RayServing) -> None:
        ray = _ray()
        connect(config.address)
        self.ray, self.config = ray, config
        self.directory = Path(directory)
        sh = manifest.sharded
        params = manifest.search_params or ""
        try:
            trained = faiss.read_index(str(self.directory / sh["trained"]))
            self.held = faiss.read_index(str(self.directory / sh["held"]), faiss.IO_FLAG_MMAP)
        except RuntimeError as e:
            from .validate import damaged, faiss_reason

            raise damaged(self.directory, f"faiss cannot read a part ({faiss_reason(e)})") from None
        fx.set_search_params(self.held, params)
        self.d = int(trained.d)
        self.keep_max = faiss.is_similarity_metric(trained.metric_type)
        self.shards = shard_paths(self.directory, manifest)
        cls = ray.remote(ShardSearcher)
        self.keys: list[tuple] = []
        self.actors: list[Any] = []
        for i, s in enumerate(self.shards):
            part = s / PART_FILE
            where = config.placement(i, s) if config.placement else _near(shard_node(s))
            key = (_identity(part), params, config.concurrency, config.threads, repr(sorted(where.items())))
            # A token of Ray's logical memory: an actor that requests no resource at all is placed
            # anywhere whatever its soft node affinity says (ray_sources.READER_MEMORY's reason).
            opts = {"num_cpus": 0, "memory": READER_MEMORY, "max_restarts": -1, "max_task_retries": 0,
                    "max_concurrency": config.concurrency, **where}
            self.actors.append(_POOL.acquire(key, lambda: cls.options(**opts).remote(
                str(part), params, config.threads)))
            self.keys.append(key)
        self._finalizer = weakref.finalize(self, _POOL.release, list(self.keys))
        self.counts = self._ready()
        self.ntotal = int(sum(self.counts) + self.held.ntotal)
        self._local = threading.local()
        self._cv = threading.Condition()
        self._queue: list[_Request] = []
        self._leading = False

    def _ready(self) -> list[int]:
        """Every actor's part count, once each has loaded its part (a shard that cannot be
        opened fails here, by name)."""
        refs = [a.ready.remote() for a in self.actors]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=OPEN_TIMEOUT_S)
        out = []
        for i, ref in enumerate(refs):
            if ref not in ready:
                self.close()
                raise IndexerError(f"{self.shards[i]}: its shard actor did not start in "
                                   f"{OPEN_TIMEOUT_S:.0f} s (is a node of the cluster able to read it?)")
            try:
                out.append(int(self.ray.get(ref)))
            except self.ray.exceptions.RayError as e:
                from .ray_sources import task_error

                self.close()
                raise IndexerError(f"{self.shards[i]}: its shard actor cannot open {PART_FILE} "
                                   f"({task_error(e)})") from None
        return out

    @property
    def partial(self) -> list[int]:
        """The shards left out of the calling thread's last search (empty: it was whole)."""
        return list(getattr(self._local, "partial", ()))

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(D, I) of the parts searched as one, as ``PartsIndex.search``; shards that did not
        answer within the bound are left out and recorded in :attr:`partial`.

        Concurrent searches share fan-outs: while one is in flight, the searches that arrive
        (with the same k) queue and go out together as the next one (one Ray call per shard
        for the lot instead of one each), so a lone client waits for nothing and many clients
        pay the calls' fixed cost once per batch. Each caller gets its own rows."""
        q = np.ascontiguousarray(q, dtype=np.float32)
        k = max(1, min(int(k), max(1, self.ntotal)))
        req = _Request(q, k)
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
        self._local.partial = req.partial
        if req.error is not None:
            raise req.error
        return req.result

    def _lead(self) -> None:
        """Send what is queued (the first request's k) as one fan-out, hand the rows out, and
        let the next waiting thread lead the next batch."""
        try:
            with self._cv:
                k = self._queue[0].k
                batch = [r for r in self._queue if r.k == k]
                self._queue = [r for r in self._queue if r.k != k]
            qs = batch[0].q if len(batch) == 1 else np.concatenate([r.q for r in batch])
            d = i = error = None
            self._local.partial = []
            try:
                d, i = self._fanout(qs, k)
            except Exception as e:  # noqa: BLE001 - every caller of the batch gets it
                error = e
            missing = self._local.partial
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

    def _fanout(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One fan-out of ``q`` to every shard's actor and the merge (sets this thread's
        :attr:`partial`)."""
        ray = self.ray
        qref = ray.put(q) if q.nbytes > 100_000 else q     # small: inlined in each call
        refs = [a.search.remote(qref, k) for a in self.actors]
        dh, ih = self.held.search(q, k)            # the held-out part, here, meanwhile
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.timeout)
        done = set(ready)
        got: dict[int, Any] = {}
        answered = [i for i, ref in enumerate(refs) if ref in done]
        try:                                       # one call for all (the usual case) ...
            got = dict(zip(answered, ray.get([refs[i] for i in answered])))
        except ray.exceptions.RayError:            # ... else one by one: which actor died
            for i in answered:
                try:
                    got[i] = ray.get(refs[i])
                except ray.exceptions.RayError:
                    pass
        missing = [i for i in range(len(refs)) if i not in got]
        ds = [got[i][0] for i in sorted(got)]
        is_ = [got[i][1] for i in sorted(got)]
        self._local.partial = missing
        if missing and self.config.strict:
            raise IndexerError(f"{self.directory}: shard(s) {', '.join(map(str, missing))} did not answer "
                               f"within {self.config.timeout:g} s; the answer would be partial")
        if len(missing) == len(refs) and refs:
            raise IndexerError(f"{self.directory}: no shard answered within {self.config.timeout:g} s "
                               f"(shards {', '.join(map(str, missing))}); is the Ray cluster up?")
        ds.append(dh)
        is_.append(ih)
        if len(ds) == 1:
            return ds[0], is_[0]
        return faiss.merge_knn_results(np.stack(ds), np.stack(is_), keep_max=self.keep_max)

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
        """Lets go of this Router's actors (each ends with its last Router)."""
        self._finalizer()


def _near(node: str | None) -> dict:
    from .ray_build import _near as near

    return near(node)


def wait_whole(router: Router, timeout: float) -> bool:
    """Whether every shard answers within ``timeout`` seconds (polls :meth:`Router.missing`)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not router.missing(timeout=min(2.0, router.config.timeout)):
            return True
        time.sleep(0.2)
    return False


__all__ = ["RayServing", "Router", "ShardSearcher", "shard_node", "wait_whole", "DEFAULT_TIMEOUT_S"]
