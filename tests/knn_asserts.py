"""Neighbour lists compared up to float ties at the k boundary (issue 38).

Two gallery vectors whose scores for a query are equal within float error (a duplicate image
under another id, two drawings an untrained embedder puts within 1e-7 of each other) can swap
places, and when they sit at the k-th place either may be kept: which one is float rounding
(BLAS kernel, block size, thread count), not a bug. :func:`assert_knn` accepts either tied id
and nothing else: per query row, the neighbours clearly better than the k-th score are exactly
the expected ones, every other slot holds an id whose true score (float64, from the vectors by
id) equals the k-th score within ``atol``, no id twice, pads (-1) where the expected list has
them, and the reported scores are the expected scores and the returned ids' own. A search that
misses a neighbour, returns a wrong or repeated id, or a wrong score still fails.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

Scorer = Callable[[int, np.ndarray], np.ndarray]    # (query row, gallery ids) -> float64 scores


def vector_scorer(queries: np.ndarray, gallery: np.ndarray, ids: np.ndarray | None = None,
                  metric: str = "ip") -> Scorer:
    """True scores by id, in float64: inner product ("ip") or squared Euclidean ("l2") of
    ``queries[row]`` with the gallery rows whose ids (default: row numbers) are asked for."""
    if metric not in ("ip", "l2"):
        raise ValueError(f"metric={metric!r}")
    q64, g64 = np.asarray(queries, np.float64), np.asarray(gallery, np.float64)
    ids = np.arange(len(g64)) if ids is None else np.asarray(ids)
    row_of = {int(v): j for j, v in enumerate(ids)}

    def score(r: int, sel: np.ndarray) -> np.ndarray:
        x = g64[[row_of[int(v)] for v in sel]].reshape(len(sel), -1)
        return x @ q64[r] if metric == "ip" else ((x - q64[r]) ** 2).sum(1)

    return score


def assert_knn(got: np.ndarray, want: np.ndarray, true_score: Scorer, *,
               larger_is_better: bool = True, atol: float = 1e-5, ordered: bool = False,
               got_scores: np.ndarray | None = None, score_atol: float = 1e-4) -> None:
    """``got`` (nq, k) ids from the search under test equal ``want`` (the reference answer, e.g.
    a float64 brute force) up to ties at the k boundary (see the module). ``true_score(r, ids)``:
    query ``r``'s float64 scores for gallery ids (:func:`vector_scorer`). ``larger_is_better``:
    True for inner product, False for distances. ``atol``: scores closer than this are a tie.
    ``ordered``: ``got`` must also be best first (up to ties). ``got_scores``: the scores the
    search reported with ``got``, checked (within ``score_atol``) against the true scores of
    ``got``'s ids and, sorted, against ``want``'s."""
    got, want = np.atleast_2d(got), np.atleast_2d(want)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    sign = 1.0 if larger_is_better else -1.0
    for r, (g_row, w_row) in enumerate(zip(got, want)):
        where = f"query row {r}: got {g_row.tolist()}, want {w_row.tolist()}"
        w = w_row[w_row >= 0]
        n = len(w)
        assert (g_row[:n] >= 0).all() and (g_row[n:] == -1).all(), f"{where}: pads differ"
        g = g_row[:n]
        assert len(set(g.tolist())) == n, f"{where}: an id twice"
        if not n:
            continue
        sw, sg = sign * true_score(r, w), sign * true_score(r, g)
        kth = sw.min()
        clear = {int(v) for v, s in zip(w, sw) if s > kth + atol}
        missing = clear - set(g.tolist())
        assert not missing, f"{where}: misses {sorted(missing)}, better than the k-th score {sign * kth:.7g}"
        for v, s in zip(g, sg):
            if int(v) not in clear:
                assert abs(s - kth) <= atol, (f"{where}: id {int(v)} scores {sign * s:.7g}, not "
                                              f"tied with the k-th {sign * kth:.7g} (atol {atol})")
        if ordered:
            assert (np.diff(sg) <= atol).all(), f"{where}: not best first: {(sign * sg).tolist()}"
        if got_scores is not None:
            gs = np.asarray(got_scores[r][:n], np.float64)
            np.testing.assert_allclose(gs, sign * sg, atol=score_atol, rtol=0,
                                       err_msg=f"{where}: scores are not their ids'")
            np.testing.assert_allclose(np.sort(gs), np.sort(sign * sw), atol=score_atol, rtol=0,
                                       err_msg=f"{where}: scores are not the expected ones")


def recall_bounds(x: np.ndarray, labels: np.ndarray, k: int, *, atol: float = 1e-5
                  ) -> tuple[float, float]:
    """(lowest, highest) recall@k of ``x`` as queries and gallery (each query left out of its own
    list; squared Euclidean in float64, as :func:`embedder.metrics.evaluate` ranks) over every
    way float ties at rank k can be broken: a query is a sure hit if one of its neighbours clearly
    inside the k-th distance has its label, or the neighbours tied with the k-th (within
    ``atol``) are too few of other labels to fill the places left; a possible hit if any of
    those has its label. For a metric computed elsewhere from the same images (embedded in
    other batches: the same vectors up to float rounding), that figure must lie in between."""
    x = np.asarray(x, np.float64)
    labels = np.asarray(labels)
    d = (x * x).sum(1)[:, None] + (x * x).sum(1)[None] - 2 * x @ x.T
    np.fill_diagonal(d, np.inf)
    sure = possible = 0
    for r in range(len(x)):
        kth = np.sort(d[r])[k - 1]
        inside, tied = d[r] < kth - atol, np.abs(d[r] - kth) <= atol
        same = labels == labels[r]
        left = k - int(inside.sum())
        hit_in = bool((inside & same).any())
        sure += hit_in or (bool((tied & same).any()) and int((tied & ~same).sum()) < left)
        possible += hit_in or bool((tied & same).any())
    return sure / len(x), possible / len(x)
