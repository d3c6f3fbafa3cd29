"""Search among some gallery ids only (a search's ``labels=``): exact over the subset's stored
vectors while they fit :data:`EXACT_BYTES`, else the index's own search, its IVF lists widened by
the subset's rarity (``Searchable.search``'s ``widen``), fetched deeper and filtered.

Why not faiss's ``IDSelector``: an IVF search under a selective selector scans only its nprobe
lists, so a small class gets fewer than k hits or none, where an exact pass over its few thousand
stored vectors is complete and cheaper; and a selector reaches neither the Ray fan-out's remote
shards nor the codes-only wrapper, while ``widen`` and the over-fetch go through the one
``Searchable.search`` every serving mode answers."""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from embedder.knn import exact_knn

from ..searchable import Answer

#: the most stored vectors (float32 bytes) an exact subset search reads per call: 64 MiB is
#: 6,550 vectors of the two-backbone default's 2,560 dims, 131,072 of 128
EXACT_BYTES = 64 << 20
#: over-fetch rounds (each 4x deeper) before an answer is returned short, -1 padded, as IVF's are
ROUNDS = 3
#: lists probed: this times the index's nprobe over the labels' share of the gallery. They are not
#: spread evenly (near a query its own class fills the lists): 1x kept recall@10 at 0.91 where the
#: plain search's is 0.97, 2x 0.98 (cub-dev; caltech101-dev in docs/benchmarks/indexer.md)
WIDEN = 2.0


def subset_search(search: Callable[..., Answer], vectors: Callable[[np.ndarray], np.ndarray],
                  allowed: np.ndarray, q: np.ndarray, k: int, ntotal: int, need: int | None = None) -> Answer:
    """Each row of ``q``'s top-``k`` among the ids ``allowed``: (n, k) scores and ids, NaN / -1
    padded. ``search``: the index's own; ``vectors(ids)``: stored vectors (KeyError: one is missing,
    and the filtered answer stands); ``ntotal``: how many vectors ``search`` holds; ``need``: the
    fewest a filtered row may hold before it is answered exactly (default ``k``; DBA asks ``depth``
    candidates but needs only the k it returns)."""
    allowed = np.unique(np.asarray(allowed, dtype=np.int64))
    if len(allowed) * q.shape[1] * 4 <= EXACT_BYTES:
        try:
            return Answer(*exact(vectors, allowed, q, k))
        except KeyError:        # an id the store holds without this model's vector: filter instead
            pass
    # a fraction f of the gallery: each list holds about f of what it did, so f^-1 times the
    # lists and the depth would keep the plain search's recall were the labels spread evenly
    rarity = ntotal / max(len(allowed), 1)
    fetch = min(ntotal, math.ceil(2 * k * rarity))
    for _ in range(ROUNDS):
        scores, ids, partial = search(q, fetch, widen=WIDEN * rarity)
        keep = np.isin(ids, allowed)
        if keep.sum(1).min() >= k or fetch >= ntotal:
            break
        fetch = min(ntotal, 4 * fetch)
    order = np.argsort(~keep, axis=1, kind="stable")[:, :k]     # the allowed first, in rank order
    kept = np.take_along_axis(keep, order, 1)
    out_s, out_i = _padded(np.where(kept, np.take_along_axis(scores, order, 1), np.nan),
                           np.where(kept, np.take_along_axis(ids, order, 1), -1), k)
    # Rows still short (the label's images lie outside the lists an IVF search probes): exact,
    # reading the subset's vectors a block at a time (complete, slower; rare by construction).
    short = np.nonzero((out_i >= 0).sum(1) < min(k if need is None else need, len(allowed)))[0]
    if len(short):
        try:
            out_s[short], out_i[short] = exact(vectors, allowed, q[short], k)
        except KeyError:
            pass
    return Answer(out_s, out_i, tuple(partial))


def exact(vectors: Callable[[np.ndarray], np.ndarray], allowed: np.ndarray, q: np.ndarray,
          k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-``k`` of ``q`` among ``allowed`` (:func:`embedder.knn.exact_knn` over the stored
    vectors, read :data:`EXACT_BYTES` at a time), NaN / -1 padded."""
    block = max(1, EXACT_BYTES // (4 * q.shape[1]))
    chunks = ((ids, vectors(ids)) for ids in (allowed[lo:lo + block] for lo in range(0, len(allowed), block)))
    scores, ids = exact_knn(q, chunks, k, "ip")
    return np.where(ids >= 0, scores, np.nan).astype(np.float32), ids


def _padded(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    n, have = ids.shape
    out_s, out_i = np.full((n, k), np.nan, np.float32), np.full((n, k), -1, np.int64)
    out_s[:, :have], out_i[:, :have] = scores, ids
    return out_s, out_i


__all__ = ["EXACT_BYTES", "exact", "subset_search"]
