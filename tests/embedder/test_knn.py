"""embedder.knn: the one exact kNN and the one "drop the query from its own list" that
evaluation, index tuning and search share (issue 22)."""
from __future__ import annotations

import numpy as np
import pytest

from embedder.knn import drop_self, exact_knn


def test_exact_knn_matches_brute_force_in_both_metrics_and_any_blocking():
    rng = np.random.default_rng(0)
    g = rng.standard_normal((300, 12)).astype(np.float32)
    q = rng.standard_normal((40, 12)).astype(np.float32)
    l2 = ((q[:, None, :] - g[None]) ** 2).sum(-1)
    ip = q @ g.T
    for metric, truth in (("l2", np.argsort(l2, 1, kind="stable")[:, :7]),
                          ("ip", np.argsort(-ip, 1, kind="stable")[:, :7])):
        whole = exact_knn(q, [g], 7, metric)
        blocked = exact_knn(q, [g[:100], g[100:101], g[101:]], 7, metric)
        np.testing.assert_array_equal(whole[1], truth)
        np.testing.assert_array_equal(blocked[1], truth)      # row numbers run across blocks
        ref = l2 if metric == "l2" else ip
        np.testing.assert_allclose(whole[0], np.take_along_axis(ref, truth, 1), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="metric='cosine'"):
        exact_knn(q, [g], 3, "cosine")


def test_drop_self_by_id_keeps_duplicates_and_rank_order():
    ids = np.array([[5, 7, 9, 2],      # the query (7) second: dropped, the rest move up
                    [3, 4, 8, 1],      # the query (6) pushed out by ties: the first k stay
                    [8, 6, 6, 0]])     # only its first occurrence goes
    scores = ids.astype(np.float32) / 10
    out, s = drop_self(ids, np.array([7, 6, 6]), 3, scores)
    np.testing.assert_array_equal(out, [[5, 9, 2], [3, 4, 8], [8, 6, 0]])
    np.testing.assert_allclose(s, out / 10)


def test_drop_self_pads_short_rows_and_minus_one_drops_nothing():
    ids = np.array([[4, 1], [2, -1]])
    out, s = drop_self(ids, np.array([1, -1]), 3, np.array([[0.9, 0.8], [0.7, 0.0]], np.float32))
    # row 0: its own id goes, one left, padded; row 1 has no query to drop: -1 drops only a pad
    np.testing.assert_array_equal(out, [[4, -1, -1], [2, -1, -1]])
    assert s[0, 0] == pytest.approx(0.9) and np.isnan(s[0, 1:]).all() and np.isnan(s[1, 1:]).all()
    assert drop_self(ids, np.array([1, -1]), 1)[1] is None
