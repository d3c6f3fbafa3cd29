"""The streaming plan's reads where the shards are: a ``ShardReader`` actor per shard (its
``StoreSource`` on the node that built it) and ``RemoteSource``, the driver's ``Source`` for it.

Why: on the driver the census, samples and exact answers read every vector over the shared
filesystem; here only ids in chunks (prefetched), sample rows and nq x k answers cross. The census
holds every id stream open, so all readers live at once: they reserve no CPU/GPU (else they could
wait for ever on fill tasks) but a memory token (``READER_MEMORY``, without which Ray ignores soft
affinity). Calls carry positions, not state, so retries after a restart answer the same.
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import IndexerError
from ..store.sources import CHUNK, ChunkedSource, StoreSource

# What a reader reserves of Ray's logical ``memory`` resource: a token that no CPU or GPU task
# competes for, there because Ray places a request of no resources at all on a random node,
# whatever a soft node affinity asks (ray-project/ray#25360 fixed that for hard affinity only;
# measured with Ray 2.60 on a 3-node local cluster: 3 of 6 zero-resource actors landed off their
# node, 0 of 8 with this token; tests/indexer/test_ray_cluster.py shows it).
READER_MEMORY = 2 ** 20


def task_error(e: BaseException) -> str:
    """The first line of what went wrong in a task (its own exception, not Ray's wrapper); for a
    failed actor ``__init__``, the traceback's last line (Ray keeps only the text)."""
    if getattr(e, "actor_init_failed", False):
        last = [ln.strip() for ln in str(e).splitlines() if ln.strip()][-1]
        head, _, rest = last.partition(": ")
        return rest if rest and head.rsplit(".", 1)[-1].endswith(("Error", "Exception")) else last
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip()
    return text.splitlines()[0] if text else type(cause).__name__


class ShardReader:
    """The Ray actor: one shard's store, read on its node. Counts its calls (tests, figures)."""

    def __init__(self, store_dir: str, model_hash: str, dim: int, threads: int = 1) -> None:
        import faiss

        faiss.omp_set_num_threads(max(1, int(threads)))
        self.src = StoreSource(store_dir, model_hash, dim)
        self.calls: Counter = Counter()
        self.cursor: tuple | None = None          # (kind, size, next start, iterator)

    def where(self) -> dict:
        """This reader's process and node, and its calls so far."""
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "calls": dict(self.calls)}

    def _next(self, kind: str, start: int, size: int) -> Any:
        """The chunk of ``size`` at position ``start`` of the id order: the open iterator goes on
        when the call follows the last one, else (a retry, a restart) one is opened and skipped."""
        c = self.cursor
        if c is None or c[:3] != (kind, size, start):
            it = self.src.id_chunks(size) if kind == "ids" else self.src.chunks(size)
            for _ in range(start // size):
                next(it, None)
            c = (kind, size, start, it)
        got = next(c[3], None)
        self.cursor = (kind, size, start + size, c[3])
        return got

    def next_ids(self, start: int, size: int) -> np.ndarray:
        self.calls["next_ids"] += 1
        got = self._next("ids", start, size)
        return np.zeros(0, np.int64) if got is None else got

    def next_chunk(self, start: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        self.calls["next_chunk"] += 1
        got = self._next("rows", start, size)
        return (np.zeros(0, np.int64), np.zeros((0, self.src.dim), np.float32)) if got is None else got

    def count(self) -> int:
        self.calls["count"] += 1
        return self.src.count()

    def sample(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.calls["sample"] += 1
        return self.src.sample(positions)

    def get(self, ids: np.ndarray) -> np.ndarray:
        self.calls["get"] += 1
        return self.src.get(ids)

    def knn(self, q: np.ndarray, k: int, drop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.calls["knn"] += 1
        return self.src.knn(q, k, drop)


def _nbytes(x: Any) -> int:
    if isinstance(x, np.ndarray):
        return int(x.nbytes)
    if isinstance(x, (tuple, list)):
        return sum(_nbytes(v) for v in x)
    return 8


class Pending:
    """A call a reader is answering; ``result()`` waits for it (``sources.answers``)."""

    def __init__(self, source: "RemoteSource", ref: Any, what: str) -> None:
        self.source, self.ref, self.what = source, ref, what

    def result(self) -> Any:
        return self.source._get(self.ref, self.what)


class RemoteSource(ChunkedSource):
    """A ``Source`` whose reads run in the shard's ``ShardReader``; ``received``: bytes reaching
    the driver per method; ``node``: the reader's node at open and close."""

    def __init__(self, ray: Any, actor: Any, shard: int, dim: int) -> None:
        self.ray, self.actor, self.shard, self.dim = ray, actor, shard, int(dim)
        self.received: Counter = Counter()
        self.node: str | None = None

    def _get(self, ref: Any, what: str) -> Any:
        try:
            got = self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            raise IndexerError(f"reading shard {self.shard} for the plan ({what}) failed: "
                               f"{task_error(e)}; rerun the same command to resume") from None
        self.received[what] += _nbytes(got)
        return got

    def submit(self, method: str, *args: Any) -> Pending:
        return Pending(self, getattr(self.actor, method).remote(*args), method)

    def _call(self, method: str, *args: Any) -> Any:
        return self.submit(method, *args).result()

    def where(self) -> dict:
        got = self._call("where")
        self.node = got["node"]
        return got

    def id_chunks(self, size: int = CHUNK) -> Iterator[np.ndarray]:
        """The ids in chunks of ``size``: the first asked for now (every shard's census stream
        starts at once), each next one before the current one is used."""
        return self._id_stream(self.actor.next_ids.remote(0, size), size)

    def _id_stream(self, ahead: Any, size: int) -> Iterator[np.ndarray]:
        start = 0
        while True:
            ref, ahead = ahead, self.actor.next_ids.remote(start + size, size)
            c = self._get(ref, "next_ids")
            if not len(c):
                return
            yield c
            start += size

    def chunks(self, size: int = CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        start = 0
        while True:
            cids, cx = self._call("next_chunk", start, size)
            if not len(cids):
                return
            yield cids, cx
            start += size

    def count(self) -> int:
        return int(self._call("count"))

    def sample(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._call("sample", np.asarray(positions, dtype=np.int64))

    def get(self, ids: np.ndarray) -> np.ndarray:
        return self._call("get", np.asarray(ids, dtype=np.int64))

    def knn(self, q: np.ndarray, k: int, drop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._call("knn", q, k, drop)

    def close(self) -> None:
        """Ends the reader (again: nothing), noting its node first (a reader that cannot answer
        any more keeps the node it last gave)."""
        if self.actor is not None:
            try:
                self.where()
            except IndexerError:
                pass
            self.ray.kill(self.actor)
            self.actor = None


def open_readers(ray: Any, shard_dirs: Sequence[str | Path], model_hash: str, dim: int, *,
                 max_retries: int = 3, threads: int = 1,
                 nodes: Sequence[str | None] | None = None) -> list[RemoteSource]:
    """One ``ShardReader`` per shard directory, on ``nodes[i]`` (elsewhere if gone), each
    answering once before the plan starts: a shard that cannot be opened fails here, by name."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ..directory.index_dir import STORE_DIR

    cls = ray.remote(ShardReader)
    out = []
    try:
        for i, d in enumerate(shard_dirs):
            node = nodes[i] if nodes else None
            # Restarts are the bound (``max_retries`` of them); a call waits through each restart
            # (max_task_retries=-1). A bounded count of call retries ran out while the reader's
            # lost node was not yet marked dead (each "actor temporarily unavailable" spends one,
            # seconds apart), and the stream failed though a restart elsewhere was coming (CI,
            # 2026-11-28). Only system failures retry: a call's own exception never does.
            opts: dict = {"num_cpus": 0, "memory": READER_MEMORY, "max_restarts": max_retries,
                          "max_task_retries": -1}
            if node:
                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
            actor = cls.options(**opts).remote(str(Path(d) / STORE_DIR), model_hash, int(dim), threads)
            out.append(RemoteSource(ray, actor, i, dim))
        for s in out:
            s.where()
    except BaseException:
        for s in out:
            s.close()
        raise
    return out
