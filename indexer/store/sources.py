"""Where the streaming build's vectors come from: a ``Source`` per shard, asked only what it can
answer where it lives: ids in chunks (census), rows at positions (samples), its exact top-k of the
held-out queries (``knn``), its vectors in chunks (fill). ``StoreSource`` reads a store here,
``ArraySource`` wraps arrays, ``indexer.ray.readers.RemoteSource`` asks the shard's node.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from embedder.knn import exact_knn

from .gallery import GalleryStore

CHUNK = 65_536


class Source(Protocol):
    """One shard's vectors: its ids ascending (at once, in chunks, or a count), its vectors in
    chunks, by id or at positions (a sample), and its exact top-k of some queries."""

    dim: int

    def ids(self) -> np.ndarray: ...
    def id_chunks(self, size: int = CHUNK) -> Iterator[np.ndarray]: ...
    def count(self) -> int: ...
    def chunks(self, size: int = CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]: ...
    def get(self, ids: np.ndarray) -> np.ndarray: ...
    def sample(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    def knn(self, q: np.ndarray, k: int, drop: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    def submit(self, method: str, *args: Any) -> "Submitted": ...


class Submitted(Protocol):
    """A call handed to a source: its answer when taken (``readers.Pending`` for a remote one)."""

    def result(self) -> Any: ...


class Deferred:
    """A local source's answer to ``submit``: computed when taken, so local shards answer one at
    a time (one shard's sample or top-k in memory), as remote ones are collected."""

    def __init__(self, call: Callable[..., Any], *args: Any) -> None:
        self.call, self.args = call, args

    def result(self) -> Any:
        return self.call(*self.args)


def answers(sources: Sequence[Source], method: str, args: Sequence[tuple]) -> Iterator[Any]:
    """``sources[s].method(*args[s])`` for each shard, in shard order: every call submitted at
    once (remote sources work in parallel; local ones when taken), answers taken one at a time."""
    started = [src.submit(method, *a) for src, a in zip(sources, args)]
    for pending in started:
        yield pending.result()


class ChunkedSource:
    """What a source answers from its chunks: its ids, their count, its exact top-k (the base of
    StoreSource, ArraySource and ``ray_sources.RemoteSource``)."""

    dim: int

    def id_chunks(self, size: int = CHUNK) -> Iterator[np.ndarray]: ...
    def chunks(self, size: int = CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]: ...

    def ids(self) -> np.ndarray:
        parts = list(self.id_chunks())
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def count(self) -> int:
        return sum(len(c) for c in self.id_chunks())

    def knn(self, q: np.ndarray, k: int, drop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This shard's exact top-k of ``q`` but ``drop``, in one pass over its chunks."""
        return exact_knn(q, self.chunks(), k, "ip", exclude=drop)

    def submit(self, method: str, *args: Any) -> Submitted:
        return Deferred(getattr(self, method), *args)

    def close(self) -> None:
        pass


class StoreSource(ChunkedSource):
    """A shard's LMDB store: the embeddings of one model, read in chunks (never all at once)."""

    def __init__(self, store_dir: str | Path, model_hash: str, dim: int) -> None:
        self.store = GalleryStore(store_dir)
        self.model_hash, self.dim = model_hash, int(dim)

    def id_chunks(self, size: int = CHUNK) -> Iterator[np.ndarray]:
        """The ids ascending, ``size`` at a time."""
        return (ids for ids, _ in self.store.iter_embeddings(self.model_hash, size, vectors=False))

    def chunks(self, size: int = CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self.store.iter_embeddings(self.model_hash, size)

    def sample(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, vectors) at ``positions`` (ascending) of the id order: one pass over the keys."""
        positions = np.asarray(positions, dtype=np.int64)
        got, at = [], 0
        for c in self.id_chunks():
            lo, hi = np.searchsorted(positions, [at, at + len(c)])
            got.append(c[positions[lo:hi] - at])
            at += len(c)
        ids = np.concatenate(got) if got else np.zeros(0, np.int64)
        return ids, self.get(ids)

    def get(self, ids: np.ndarray) -> np.ndarray:
        if len(ids) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self.store.get_embeddings(self.model_hash, [int(i) for i in ids])

    def close(self) -> None:
        self.store.close()


class ArraySource(ChunkedSource):
    """(ids ascending, vectors) already in arrays, e.g. ``np.load(..., mmap_mode="r")``: the
    benchmark's synthetic shards, and tests."""

    def __init__(self, ids: np.ndarray, x: np.ndarray) -> None:
        self._ids, self.x, self.dim = np.asarray(ids, dtype=np.int64), x, int(x.shape[1])

    def ids(self) -> np.ndarray:
        return self._ids

    def id_chunks(self, size: int = CHUNK) -> Iterator[np.ndarray]:
        return (ids for ids, _ in self.chunks(size))

    def count(self) -> int:
        return len(self._ids)

    def sample(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        positions = np.asarray(positions, dtype=np.int64)
        return (np.asarray(self._ids[positions], dtype=np.int64),
                np.ascontiguousarray(self.x[positions], dtype=np.float32))

    def chunks(self, size: int = CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for s in range(0, len(self._ids), size):
            yield self._ids[s:s + size], np.ascontiguousarray(self.x[s:s + size], dtype=np.float32)

    def get(self, ids: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.x[np.searchsorted(self._ids, ids)], dtype=np.float32)


class Rows:
    """Given ids and their owning shards as a lazy array: ``rows[positions]`` fetches those
    vectors from the shards that own them (the self-queries of ``shard_build.retune_sharded``)."""

    def __init__(self, ids: np.ndarray, owner: np.ndarray, sources: Sequence[Source]) -> None:
        self.ids, self.owner, self.sources = ids, owner, sources
        self.shape = (len(ids), sources[0].dim)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), self.shape[1]), dtype=np.float32)
        own = self.owner[rows]
        for s in np.unique(own):
            m = own == s
            out[m] = self.sources[int(s)].get(self.ids[rows[m]])
        return out
