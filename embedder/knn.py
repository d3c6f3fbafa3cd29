"""Exact k nearest neighbours with ids and drop lists, the one copy evaluation, DBA, tuning, shards
and search share: ``faiss.knn`` over blocks, a ``faiss.ResultHeap`` across them (numpy, faiss).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import faiss
import numpy as np

METRICS = {"l2": faiss.METRIC_L2, "ip": faiss.METRIC_INNER_PRODUCT}
BLOCK = 65_536          # gallery rows per block: one block's copy in memory at a time

Chunks = Iterable[tuple[np.ndarray, np.ndarray]]    # (ids, vectors) blocks of a gallery


def exact_knn(queries: np.ndarray, gallery: np.ndarray | Chunks, k: int, metric: str = "l2", *,
              ids: np.ndarray | None = None, rows: np.ndarray | None = None,
              exclude: np.ndarray | None = None, own: np.ndarray | None = None,
              block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of each query: (scores, ids), both (nq, k), best first; id -1 where fewer than k
    are left. ``gallery``: an (N, d) array (ids ``ids``, only ``rows`` searched when given) or an
    iterable of (ids, vectors) chunks. ``exclude``: ids no query gets; ``own``: each query's own
    id(s), (nq,) or (nq, m), -1 for none, dropped by id (NaN scores, as :func:`drop_self`)."""
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r}: expected one of {sorted(METRICS)}")
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if own is not None:
        own = np.asarray(own, dtype=np.int64).reshape(len(q), -1)
    kk = k + (own.shape[1] if own is not None else 0)
    heap = faiss.ResultHeap(len(q), kk, keep_max=metric == "ip")
    chunks = _blocks(gallery, ids, rows, block) if hasattr(gallery, "shape") else gallery
    for cids, cx in chunks:
        cids = np.asarray(cids, dtype=np.int64)
        if exclude is not None and len(exclude):
            keep = ~np.isin(cids, exclude)
            if not keep.all():
                cids, cx = cids[keep], cx[keep]
        if not len(cids):
            continue
        D, I = faiss.knn(q, np.ascontiguousarray(cx, dtype=np.float32), min(kk, len(cids)),
                         metric=METRICS[metric])
        heap.add_result(D, np.where(I >= 0, cids[np.maximum(I, 0)], -1))
    heap.finalize()
    if own is None:
        return heap.D, heap.I
    found, scores = drop_self(heap.I, own, k, heap.D)
    return np.where(found >= 0, scores, np.nan), found


def _blocks(x: np.ndarray, ids: np.ndarray | None, rows: np.ndarray | None, size: int
            ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, x[rows]) of an array gallery, ``size`` rows at a time; a whole ndarray is sliced."""
    sliced = rows is None and isinstance(x, np.ndarray)
    rows = np.arange(len(x)) if rows is None else np.asarray(rows, dtype=np.int64)
    for s in range(0, len(rows), size):
        r = rows[s:s + size]
        yield (r if ids is None else np.asarray(ids)[r]), (x[s:s + size] if sliced else x[r])


def drop_self(ids: np.ndarray, own: np.ndarray, k: int,
              scores: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Each row of ``ids`` without its query's own id(s), the first ``k`` kept, padded with -1 (NaN
    scores). By id, not distance: a duplicate image under another id still counts as a neighbour."""
    ids = np.asarray(ids)
    own = np.asarray(own).reshape(len(ids), -1)
    first = np.zeros(ids.shape, dtype=bool)
    for j in range(own.shape[1]):
        is_self = ids == own[:, j:j + 1]
        first |= is_self & (np.cumsum(is_self, axis=1) == 1)
    order = np.argsort(first, axis=1, kind="stable")[:, :k]      # the others first, in rank order
    kept = ~np.take_along_axis(first, order, 1)

    def pick(a: np.ndarray, fill) -> np.ndarray:
        out = np.full((len(a), k), fill, dtype=a.dtype)
        out[:, :order.shape[1]] = np.where(kept, np.take_along_axis(a, order, 1), fill)
        return out

    return pick(ids, -1), (None if scores is None else pick(np.asarray(scores), np.nan))
