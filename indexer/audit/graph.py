"""The gallery's k-nearest-neighbour graph from the index's own faiss search (tuned nprobe; a
sharded index's parts as one): each stored vector queries it, its own id dropped (a copy under
another id stays), rows as :class:`~.source.Gallery` row numbers. Cosines recomputed from the stored
vectors where the index scores codes, so thresholds mean the same for every type. Memory: (n, k)
int32 + float32 plus one chunk of vectors.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedder.knn import drop_self

from .source import Gallery

CHUNK = 16_384          # queries per faiss call


@dataclass
class KnnGraph:
    """``nbr[i]``: the rows of row i's k nearest other items, best first (-1: none, e.g. IVF
    lists too short); ``sim[i]``: their cosine similarities (NaN where ``nbr`` is -1)."""

    nbr: np.ndarray             # (n, k) int32
    sim: np.ndarray             # (n, k) float32

    @property
    def k(self) -> int:
        return int(self.nbr.shape[1])

    def __len__(self) -> int:
        return int(self.nbr.shape[0])


def build_graph(g: Gallery, k: int, *, progress: bool = False) -> KnnGraph:
    """The kNN graph of every gallery item (k others each), searched with the index's own faiss."""
    n = len(g.ids)
    if k >= n:
        raise ValueError(f"-k {k}: the gallery holds only {n} images, so each has at most {n - 1} "
                         f"others; use -k {max(1, n - 1)} or less")
    nbr = np.full((n, k), -1, dtype=np.int32)
    sim = np.full((n, k), np.nan, dtype=np.float32)
    bar = _bar(n, progress)
    for start, x in g.chunks(CHUNK):
        for s in range(0, len(x), CHUNK):
            q = x[s:s + CHUNK]
            r0 = start + s
            own = g.ids[r0:r0 + len(q)]
            scores, ids = g.search(q, min(k + 1, n))
            ids, scores = drop_self(ids, own, k, scores)
            rows = g.rows_of(ids)
            rows[ids < 0] = -1
            if not g.exact_scores:
                scores = _rescore(g, q, rows)
            scores = np.where(rows >= 0, scores, np.nan).astype(np.float32)
            order = np.argsort(np.where(rows >= 0, -scores, np.inf), axis=1, kind="stable")
            nbr[r0:r0 + len(q)] = np.take_along_axis(rows, order, 1)
            sim[r0:r0 + len(q)] = np.take_along_axis(scores, order, 1)
            if bar is not None:
                bar.update(len(q))
    if bar is not None:
        bar.close()
    return KnnGraph(nbr, sim)


def _rescore(g: Gallery, q: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Exact cosine of each query with its candidates, read from the stored vectors."""
    flat = rows.ravel()
    valid = flat >= 0
    vec = np.zeros((len(flat), q.shape[1]), dtype=np.float32)
    if valid.any():
        vec[valid] = g.vectors(flat[valid])
    return np.einsum("nkd,nd->nk", vec.reshape(rows.shape[0], rows.shape[1], -1), q)


def _bar(n: int, on: bool):
    if not on:
        return None
    from tqdm import tqdm

    return tqdm(total=n, desc="kNN graph", unit="img", mininterval=1.0)


def pairs_above(graph: KnnGraph, threshold: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(a, b, sim) of the graph's edges with sim >= threshold, each unordered pair once (a < b;
    the higher of its two directions' scores, which are equal up to rounding)."""
    i, j = np.nonzero(graph.sim >= threshold)
    a, b = graph.nbr[i, j].astype(np.int64), i.astype(np.int64)
    s = graph.sim[i, j]
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    key = lo * len(graph) + hi
    order = np.lexsort((-s, key))
    key, lo, hi, s = key[order], lo[order], hi[order], s[order]
    first = np.ones(len(key), dtype=bool)
    first[1:] = key[1:] != key[:-1]
    return lo[first], hi[first], s[first]


__all__ = ["KnnGraph", "build_graph", "pairs_above"]
