"""Exact k nearest neighbours, and a query dropped from its own list: the one copy that
evaluation (:mod:`embedder.metrics`), index tuning (``indexer.tuning``, ``indexer.shard_build``)
and search (``serving.searcher``) share.

numpy and faiss only (no sklearn, no torch), so the serving process imports it cheaply. The
search itself is faiss.contrib's ``knn_ground_truth`` (blocks of gallery rows, a result heap),
not a hand-written loop.
"""
from __future__ import annotations

from collections.abc import Iterable

import faiss
import numpy as np
from faiss.contrib.exhaustive_search import knn_ground_truth

METRICS = {"l2": faiss.METRIC_L2, "ip": faiss.METRIC_INNER_PRODUCT}


def exact_knn(queries: np.ndarray, gallery_blocks: Iterable[np.ndarray], k: int,
              metric: str = "l2") -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of each query over a gallery given as consecutive blocks of rows:
    (distances or inner products, row numbers), both (N, k), best first.

    Blocks let a caller leave rows out of a 1M x 512 gallery without copying the other 2 GB.
    ``metric``: "l2" (squared Euclidean, smallest first) or "ip" (inner product, largest first).
    """
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r}: expected one of {sorted(METRICS)}")
    blocks = (np.ascontiguousarray(b, dtype=np.float32) for b in gallery_blocks)
    return knn_ground_truth(np.ascontiguousarray(queries, dtype=np.float32), blocks, k, METRICS[metric])


def drop_self(ids: np.ndarray, own: np.ndarray, k: int,
              scores: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Each row of ``ids`` without its query's own id ``own[r]`` (its first occurrence), the first
    ``k`` kept, padded with -1 (``scores``, aligned with ``ids``, with NaN): (ids, scores or None).

    By id, not by distance, so a duplicate image (another id at distance 0) still counts as a
    neighbour; a row without its query (ties pushed it out; ``own[r]`` -1: none to drop) keeps
    its first k.
    """
    ids = np.asarray(ids)
    is_self = ids == np.asarray(own).reshape(-1, 1)
    first = is_self & (np.cumsum(is_self, axis=1) == 1)
    order = np.argsort(first, axis=1, kind="stable")[:, :k]      # the others first, in rank order
    kept = ~np.take_along_axis(first, order, 1)

    def pick(a: np.ndarray, fill) -> np.ndarray:
        out = np.full((len(a), k), fill, dtype=a.dtype)
        out[:, :order.shape[1]] = np.where(kept, np.take_along_axis(a, order, 1), fill)
        return out

    return pick(ids, -1), (None if scores is None else pick(np.asarray(scores), np.nan))
