"""faiss index choice, nprobe tuning and persistence, on clustered synthetic embeddings."""
from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from indexer import faiss_index as fx
from indexer.errors import IndexerError


def clustered(n: int, d: int, centers: int = 200, spread: float = 0.35, seed: int = 0) -> np.ndarray:
    """Unit vectors around random centres: the shape real embedding galleries have."""
    rng = np.random.default_rng(seed)
    c = rng.normal(size=(centers, d)).astype(np.float32)
    x = c[rng.integers(0, centers, n)] + spread * rng.normal(size=(n, d)).astype(np.float32)
    faiss.normalize_L2(x)
    return x


def test_nlist_keeps_39_training_points_per_centroid() -> None:
    for n in (40, 100, 1_000, 10_000, 100_000, 1_000_000):
        nl = fx.nlist_for(n)
        assert n // nl >= fx.MIN_POINTS_PER_CENTROID
        assert nl & (nl - 1) == 0 or nl == n // fx.MIN_POINTS_PER_CENTROID
    assert fx.nlist_for(1_000_000) >= 1024     # grows with the gallery (4 sqrt(n))
    assert fx.nlist_for(10) == 1


def test_choose_spec() -> None:
    assert fx.choose_spec(100, 64).index_type == "flat"
    s = fx.choose_spec(100_000, 64)
    assert (s.index_type, s.factory) == ("ivf", f"IVF{fx.nlist_for(100_000)},Flat")
    assert fx.choose_spec(100, 64, flat_threshold=50).index_type == "ivf"
    assert fx.choose_spec(50_000, 128, "ivfpq").factory.endswith(f",PQ{fx.pq_m_for(128)}")
    assert fx.choose_spec(50_000, 128, "sq8").factory.endswith(",SQ8")
    with pytest.raises(IndexerError, match="ivfpq needs"):
        fx.choose_spec(500, 128, "ivfpq")
    with pytest.raises(IndexerError, match="index type"):
        fx.choose_spec(500, 128, "hnsw")
    with pytest.raises(IndexerError, match="empty"):
        fx.choose_spec(0, 128)


@pytest.mark.parametrize("target", [0.9, 0.99])
def test_tuned_nprobe_is_the_smallest_meeting_the_target(target: float) -> None:
    x = clustered(20_000, 32)
    ids = np.arange(len(x), dtype=np.int64) * 3 + 7          # ids are not row numbers
    spec = fx.choose_spec(len(x), 32, "ivf")
    rows = fx.training_sample(len(x), spec)
    index = fx.train(spec, x[rows], 32)
    fx.add(index, x, ids)
    nprobe, recall = fx.tune_nprobe(index, x, ids, target=target, n_queries=500, exclude_rows=rows)
    assert recall >= target
    assert 1 <= nprobe < spec.nlist
    # measured independently on the same self-queries: nprobe reaches the target, nprobe-1 does not
    q_rows = fx.tuning_queries(len(x), 500, rows)
    q, own = x[q_rows], ids[q_rows]

    def without_self(found: np.ndarray) -> np.ndarray:
        return np.array([[i for i in row if i != o][:10] for row, o in zip(found, own)])

    truth = without_self(ids[fx.exact_neighbours(x, q, 11)])

    def measured(p: int) -> float:
        found = index.search(q, 11, params=faiss.SearchParametersIVF(nprobe=p))[1]
        return fx.recall_vs_exact(without_self(found), truth)

    assert measured(nprobe) == pytest.approx(recall) and measured(nprobe) >= target
    if nprobe > 1:
        assert measured(nprobe - 1) < target
    # and it carries over to queries that are not gallery vectors (perturbed ones)
    noisy = x[:300] + 0.05 * np.random.default_rng(9).normal(size=(300, 32)).astype(np.float32)
    faiss.normalize_L2(noisy)
    t2 = ids[fx.exact_neighbours(x, noisy, 10)]
    got = index.search(noisy, 10, params=faiss.SearchParametersIVF(nprobe=nprobe))[1]
    assert fx.recall_vs_exact(got, t2) >= target - 0.05


def test_flat_needs_no_tuning_and_ids_roundtrip(tmp_path: Path) -> None:
    x = clustered(500, 16)
    ids = np.random.default_rng(0).choice(2 ** 53, 500, replace=False).astype(np.int64)
    spec = fx.choose_spec(500, 16)
    index = fx.train(spec, x, 16)
    fx.add(index, x, ids)
    assert fx.tune_nprobe(index, x, ids) == (0, 1.0)
    np.testing.assert_array_equal(fx.index_ids(index), np.sort(ids))
    fx.write_atomic(index, tmp_path / "i.faiss")
    back = fx.SearchableIndex(tmp_path / "i.faiss", device="cpu")
    s, i = back.search(x[:5], 3)
    np.testing.assert_array_equal(i[:, 0], ids[:5])           # every vector finds itself first
    np.testing.assert_allclose(s[:, 0], 1.0, atol=1e-5)
    assert list(tmp_path.iterdir()) == [tmp_path / "i.faiss"]  # no temporary left behind


def test_ivf_ids_merge_and_remove() -> None:
    x = clustered(4_000, 16)
    ids = np.arange(4_000, dtype=np.int64) + 10 ** 12
    spec = fx.choose_spec(4_000, 16, "ivf")
    empty = fx.train(spec, x, 16)
    a, b = faiss.clone_index(empty), faiss.clone_index(empty)
    fx.add(a, x[:2_500], ids[:2_500])
    fx.add(b, x[2_500:], ids[2_500:])
    a.merge_from(b, 0)
    np.testing.assert_array_equal(fx.index_ids(a), ids)
    a.remove_ids(ids[:10])
    np.testing.assert_array_equal(fx.index_ids(a), ids[10:])


def test_write_atomic_keeps_old_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "index.faiss"
    target.write_bytes(b"old")
    with pytest.raises(Exception):
        fx.write_atomic(object(), target)  # type: ignore[arg-type]
    assert target.read_bytes() == b"old" and list(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize("index_type", ["sq8", "ivfpq"])
def test_compressed_options_report_the_recall_they_reach(index_type: str) -> None:
    """SQ8 / IVF-PQ for large galleries: tuned like IVF-Flat, and honest when the target is out of reach."""
    from indexer.build import make_index

    x = clustered(10_000, 32, centers=100, spread=0.5)
    ids = np.arange(10_000, dtype=np.int64)
    index, fields = make_index(ids, x, index_type=index_type, target_recall=0.9, device="cpu")
    assert fields["index_type"] == index_type and index.ntotal == 10_000
    assert 1 <= fields["nprobe"] <= fields["nlist"]
    q = x[fx.tuning_queries(10_000, 1000, None)]
    truth = ids[fx.exact_neighbours(x, q, 10)]
    measured = fx.recall_vs_exact(index.search(q, 10)[1], truth)    # at the stored nprobe
    assert measured == pytest.approx(fields["recall_at_10"], abs=0.05)
    if fields["recall_at_10"] < 0.9:
        assert fields["nprobe"] == fields["nlist"] and "warning" in fields
    else:
        assert "warning" not in fields
