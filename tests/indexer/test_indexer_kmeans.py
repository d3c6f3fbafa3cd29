"""k-means for the IVF lists: which one runs for which nlist, and approximate k-means against
exact on a small clustered set (the threshold forced low so that it runs here)."""
from __future__ import annotations

import faiss
import numpy as np
import pytest

from indexer.ann import faiss_index as fx
from indexer.ann import stream
from indexer.errors import IndexerError
from indexer.store.sources import ArraySource

D, NLIST = 32, 128


def clustered(n: int, d: int, centers: int, seed: int, spread: float = 0.35) -> np.ndarray:
    """Unit vectors around random centres (as test_indexer_faiss's galleries)."""
    rng = np.random.default_rng(seed)
    c = rng.normal(size=(centers, d)).astype(np.float32)
    x = c[rng.integers(0, centers, n)] + spread * rng.normal(size=(n, d)).astype(np.float32)
    faiss.normalize_L2(x)
    return x


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(k-means sample, gallery, fresh queries) from one clustered law."""
    x = clustered(22_000, D, centers=300, seed=3)
    return x[:NLIST * fx.TRAIN_POINTS_PER_CENTROID], x[:20_000], x[20_000:20_500]


def ivf_recall(c: np.ndarray, gallery: np.ndarray, q: np.ndarray, nprobe: int) -> float:
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(D), D, len(c), faiss.METRIC_INNER_PRODUCT)
    index.quantizer.add(c)
    index.is_trained = True
    index.add(gallery)
    index.nprobe = nprobe
    truth = faiss.knn(q, gallery, 10, metric=faiss.METRIC_INNER_PRODUCT)[1]
    got = index.search(q, 10)[1]
    return float(np.mean([len(np.intersect1d(a, b)) / 10 for a, b in zip(got, truth)]))


def test_the_switch_picks_exact_below_the_threshold_approx_above_and_gpu_when_seen() -> None:
    assert fx.kmeans_method(1024) == fx.kmeans_method(fx.KMEANS_APPROX_FROM - 1) == "exact"
    assert fx.kmeans_method(fx.KMEANS_APPROX_FROM) == fx.kmeans_method(65_536) == "approx"
    assert fx.kmeans_method(16_384, gpus=1) == fx.kmeans_method(64, gpus=2) == "gpu"
    assert fx.kmeans_method(NLIST, approx_from=NLIST) == "approx"
    # the 10M plan's nlist (16,384 lists) is above it, 1M's (4,096) below: 1M keeps its results
    assert fx.kmeans_method(fx.nlist_for(10_000_000)) == "approx"
    assert fx.kmeans_method(fx.nlist_for(1_000_000)) == "exact"


def test_below_the_threshold_kmeans_is_todays_exact_kmeans(data) -> None:
    x = data[0]
    km = faiss.Kmeans(D, NLIST, niter=fx.KMEANS_ITERATIONS, seed=0, spherical=True)
    km.train(x)
    np.testing.assert_array_equal(fx.kmeans(x, NLIST, device="cpu"), km.centroids)


def test_approx_kmeans_is_deterministic_and_close_to_exact_at_equal_nprobe(data) -> None:
    x, gallery, q = data
    exact = fx.kmeans(x, NLIST, device="cpu", method="exact")
    approx = fx.kmeans(x, NLIST, device="cpu", method="approx")
    np.testing.assert_array_equal(approx, fx.kmeans(x, NLIST, device="cpu", method="approx"))
    assert not np.array_equal(approx, fx.kmeans(x, NLIST, device="cpu", method="approx", seed=1))
    assert approx.shape == (NLIST, D) and np.allclose(np.linalg.norm(approx, axis=1), 1, atol=1e-5)
    for nprobe in (2, 4, 8):
        r_exact, r_approx = ivf_recall(exact, gallery, q, nprobe), ivf_recall(approx, gallery, q, nprobe)
        assert r_approx >= r_exact - 0.02, (nprobe, r_exact, r_approx)
    # its refinement is what brings it there: the two-level start alone is further off
    start = fx.kmeans_approx(x, NLIST, refine=0)
    score = lambda c: float(faiss.knn(x, c, 1, metric=faiss.METRIC_INNER_PRODUCT)[0].mean())  # noqa: E731
    assert score(start) < score(approx) <= score(exact) + 0.002


def test_an_unknown_method_is_refused(data) -> None:
    with pytest.raises(IndexerError, match="k-means method 'fast'"):
        fx.kmeans(data[0], NLIST, device="cpu", method="fast")


def test_the_plan_records_which_kmeans_ran(data, monkeypatch) -> None:
    x = data[1][:8_000]
    ids = np.arange(len(x), dtype=np.int64) * 3
    src = [ArraySource(ids[:4_000], x[:4_000]), ArraySource(ids[4_000:], x[4_000:])]
    opts = dict(index_type="ivf", nlist=64, flat_threshold=1_000, device="cpu")
    assert stream.plan(src, **opts).fields["kmeans"] == "exact"
    monkeypatch.setattr(fx, "KMEANS_APPROX_FROM", 64)           # forced low: the approx path
    p = stream.plan(src, **opts)
    assert p.fields["kmeans"] == "approx" and faiss.extract_index_ivf(p.trained).quantizer.ntotal == 64


def test_the_record_says_what_ran_for_small_samples_and_flat(data) -> None:
    """A sample no larger than nlist is clustered exactly (kmeans' own guard), and the record
    says so; an index without lists records no k-means at all."""
    assert fx.kmeans_method(16_384, points=16_384) == "exact"
    assert fx.kmeans_method(16_384, points=16_385) == "approx"
    ivf, flat = fx.choose_spec(100_000, 32, "ivf", nlist=16_384), fx.choose_spec(100, 32, "flat")
    assert fx.kmeans_field(ivf, 16_000, "cpu") == {"kmeans": "exact"}
    assert fx.kmeans_field(flat, 100, "cpu") == {}
    x = data[1][:2_000]
    src = [ArraySource(np.arange(len(x), dtype=np.int64), x)]
    assert "kmeans" not in stream.plan(src, index_type="flat", device="cpu").fields
