"""embedder.knn: the one exact kNN (with ids and drop lists) and the one "drop the query from its
own list" that evaluation, DBA, index tuning, the streaming build's shards and search share
(issues 22 and 31). Checked on real embeddings (Omniglot drawings through the small embedder)
against a float64 brute force, in every form its callers use."""
from __future__ import annotations

import numpy as np
import pytest

from embedder.knn import drop_self, exact_knn
from knn_asserts import assert_knn, vector_scorer


@pytest.fixture(scope="module")
def real(small_onnx, omniglot_root) -> np.ndarray:
    from embedder import OnnxEmbedder

    files = sorted((omniglot_root / "images_background").rglob("*.png"))[:400:2]
    return OnnxEmbedder(small_onnx, device="cpu", threads=1).embed(files)


def brute(q: np.ndarray, g: np.ndarray, ids: np.ndarray, k: int, metric: str,
          own: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Best-first (scores, ids) by a float64 full sort; ``own``: each query's own id left out."""
    q64, g64 = q.astype(np.float64), g.astype(np.float64)
    s = (((q64[:, None] - g64[None]) ** 2).sum(-1) if metric == "l2" else -(q64 @ g64.T))
    if own is not None:
        s[ids[None, :] == own[:, None]] = np.inf
    order = np.argsort(s, axis=1, kind="stable")[:, :k]
    best = np.take_along_axis(s, order, 1)
    return (best if metric == "l2" else -best), ids[order]


def test_every_gallery_form_gives_the_brute_force_answer(real):
    q, g = real[:40], real
    ids = np.sort(np.random.default_rng(1).choice(2 ** 53, len(g), replace=False)).astype(np.int64)
    rows = np.arange(0, len(g), 3)
    for metric in ("l2", "ip"):
        # the untrained embedder puts some drawings within 1e-7 of each other: ids up to ties
        by_row, by_id = vector_scorer(q, g, metric=metric), vector_scorer(q, g, ids, metric)

        def check(got, want, scorer, scores=None):
            assert_knn(got, want, scorer, larger_is_better=metric == "ip", ordered=True,
                       got_scores=scores)

        want_s, want_rows = brute(q, g, np.arange(len(g)), 7, metric)
        got = exact_knn(q, g, 7, metric)                                  # row numbers
        check(got[1], want_rows, by_row, got[0])
        np.testing.assert_allclose(got[0], want_s, rtol=1e-4, atol=1e-4)
        check(exact_knn(q, g, 7, metric, block=33)[1], want_rows, by_row)
        check(exact_knn(q, g, 7, metric, ids=ids)[1], ids[want_rows], by_id)
        chunks = [(ids[s:s + 50], g[s:s + 50]) for s in range(0, len(g), 50)]
        check(exact_knn(q, chunks, 7, metric)[1], ids[want_rows], by_id)
        _, sub = brute(q, g[rows], ids[rows], 5, metric)                  # only ``rows`` searched
        check(exact_knn(q, g, 5, metric, ids=ids, rows=rows, block=16)[1], sub, by_id)
    with pytest.raises(ValueError, match="metric='cosine'"):
        exact_knn(q, g, 3, "cosine")


def test_exclude_and_own_drop_by_id_and_a_duplicate_still_counts(real):
    g = np.concatenate([real, real[:5]])              # rows 200..204 repeat rows 0..4, other ids
    ids = np.arange(len(g), dtype=np.int64) * 10
    q, own = g[:30], ids[:30]
    _, want = brute(q, g, ids, 6, "ip", own=own)
    s, got = exact_knn(q, g, 6, "ip", ids=ids, own=own)
    by_id = vector_scorer(q, g, ids)
    assert_knn(got, want, by_id, ordered=True, got_scores=s)   # copies tie: either at the k-th place
    assert (got[:5, 0] == ids[200:205]).all()          # the duplicate: first, at its query's score
    assert (np.diff(s, axis=1) <= 1e-6).all()
    np.testing.assert_allclose(s[:5, 0], (q[:5] * q[:5]).sum(1), rtol=1e-5)
    drop = ids[100:150]                                # the same ids left out of every list
    keep = ~np.isin(ids, drop)
    _, want = brute(q, g[keep], ids[keep], 6, "ip", own=own)
    chunks = [(ids[s:s + 64], g[s:s + 64]) for s in range(0, len(g), 64)]
    got = exact_knn(q, chunks, 6, "ip", exclude=drop, own=own)[1]
    assert_knn(got, want, by_id)
    assert not np.isin(got, drop).any()
    two = np.stack([own, ids[170:200]], 1)             # two ids dropped per query
    got2 = exact_knn(q, g, 6, "ip", ids=ids, own=two)[1]
    assert not (got2[:, :, None] == two[:, None, :]).any()


def test_a_gallery_smaller_than_k_is_padded(real):
    s, i = exact_knn(real[:3], real[:2], 4, "ip", ids=np.array([7, 9]))
    assert (i[:, 2:] == -1).all() and set(i[:, :2].ravel()) == {7, 9}
    s, i = exact_knn(real[:2], real[:2], 3, "ip", own=np.array([0, 1]))
    np.testing.assert_array_equal(i, [[1, -1, -1], [0, -1, -1]])
    assert np.isnan(s[:, 1:]).all()


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
