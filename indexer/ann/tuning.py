"""Tuning a faiss index to a recall target on queries it does not hold, and timing it. Why held
out: a gallery vector always finds itself, in lists it helped train, which flatters the recall; so
``holdout`` keeps a tuning set (cleared by a margin) and a check set (the reported recall) out.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import faiss
import numpy as np

from embedder import knn

from . import faiss_index

K = 10                      # recall@10 is what the target is about
MAX_QUERIES = 1_000         # per held-out set (tuning, check)
GT_BUDGET = 2.6e11          # multiply-adds for the exact answers of both sets: ~4 s on 2 cores
QPS_REPEATS = 5             # timed batches per measurement; the median counts
Z = 2.0                     # margin in standard errors of the difference of two recall estimates
EF_MAX = 4_096              # HNSW efSearch ceiling


@dataclass
class Holdout:
    """Row numbers: ``tune`` and ``check`` are kept out of the index while it is tuned."""

    tune: np.ndarray
    check: np.ndarray
    rows: np.ndarray            # the rest, ascending: what the index holds during tuning

    @property
    def held(self) -> np.ndarray:
        return np.sort(np.concatenate([self.tune, self.check]))


def heldout_size(n: int, dim: int) -> int:
    """The one held-out-size rule (this build and ``stream.plan``): up to MAX_QUERIES rows a set,
    10% of a small gallery, fewer for a large, wide one (exact answers within GT_BUDGET)."""
    return min(MAX_QUERIES, n // 10, max(250, int(GT_BUDGET / (2 * max(n, 1) * dim))))


def holdout(n: int, dim: int, seed: int = 0) -> Holdout:
    """Two disjoint sets of ``heldout_size`` rows each, drawn at random."""
    m = heldout_size(n, dim)
    rng = np.random.default_rng(seed + 7)
    held = rng.permutation(n)[:2 * m]
    rest = np.setdiff1d(np.arange(n), held)
    return Holdout(np.sort(held[:m]), np.sort(held[m:]), rest)


def recalls(found: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Per query: the fraction of the exact top-k also in the approximate top-k (ids)."""
    k = truth.shape[1]
    hit = (found[:, :k, None] == truth[:, None, :]) & (found[:, :k, None] >= 0)
    return hit.any(axis=2).sum(axis=1) / k


def clears(rq: np.ndarray, target: float) -> bool:
    """Mean recall minus Z standard errors of (this estimate - an independent one) >= target."""
    if len(rq) < 2:
        return bool(rq.mean() >= target) if len(rq) else True
    return bool(rq.mean() - Z * rq.std(ddof=1) * math.sqrt(2 / len(rq)) >= target)


# ---------------------------------------------------------------------------- tuning and timing
def tune(index: faiss.Index, spec: faiss_index.IndexSpec, queries: np.ndarray, truth: np.ndarray,
         target: float, *, own: np.ndarray | None = None) -> tuple[int, np.ndarray]:
    """Smallest value of ``spec.param`` whose recall@k clears ``target``, by doubling and bisection:
    (value, per-query recall), the index left set. ``truth``: exact top-k ids; ``own``: self-queries'
    ids, dropped from both answers. Flat: (0, exact recall); out of reach: the maximum and its recall."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    k = truth.shape[1]
    cache: dict[int, np.ndarray] = {}

    def measure(v: int) -> np.ndarray:
        if v not in cache:
            faiss_index.set_search_params(index, spec.search_params(v))
            if own is None:
                found = index.search(queries, k)[1]
            else:
                found = knn.drop_self(index.search(queries, k + 1)[1], own, k)[0]
            cache[v] = recalls(found, truth)
        return cache[v]

    if not spec.param:
        return 0, measure(0)
    top = spec.nlist if spec.nlist else EF_MAX
    lo, hi = (0, 1) if spec.nlist else (k - 1, k)   # invariant: lo fails (HNSW searches >= k)
    while not clears(measure(hi), target):
        if hi >= top:
            return top, measure(top)
        lo, hi = hi, min(hi * 2, top)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if clears(measure(mid), target):
            hi = mid
        else:
            lo = mid
    rq = measure(hi)
    faiss_index.set_search_params(index, spec.search_params(hi))
    return hi, rq


def measure_qps(index: faiss.Index, queries: np.ndarray, k: int = K,
                repeats: int = QPS_REPEATS, slow: float = 0.5) -> float:
    """Queries/s for one batch of ``queries``: median of ``repeats`` timed runs after a warm-up;
    an index slower than ``slow`` s a batch is timed 3 times on a quarter of the queries."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    t0 = time.perf_counter()
    index.search(q, k)
    if time.perf_counter() - t0 > slow and len(q) >= 400:
        q, repeats = q[:len(q) // 4], min(repeats, 3)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        index.search(q, k)
        times.append(time.perf_counter() - t0)
    return len(q) / max(float(np.median(times)), 1e-9)
