"""faiss index choice, nprobe tuning and persistence, on clustered synthetic embeddings."""
from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from indexer.ann import faiss_index as fx
from embedder.knn import exact_knn
from indexer.ann import tuning
from indexer.ann.served import SearchableIndex
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
    assert fx.choose_spec(50_000, 128, "ivfpq").factory.endswith(f",PQ{fx.pq_m_for(128)}np")
    assert fx.choose_spec(50_000, 128, "sq8").factory.endswith(",SQ8")
    with pytest.raises(IndexerError, match="ivfpq needs"):
        fx.choose_spec(500, 128, "ivfpq")
    with pytest.raises(IndexerError, match="index type"):
        fx.choose_spec(500, 128, "lsh")
    with pytest.raises(IndexerError, match="empty"):
        fx.choose_spec(0, 128)


@pytest.mark.parametrize("target", [0.9, 0.99])
def test_tuned_nprobe_is_the_smallest_clearing_the_target(target: float) -> None:
    x = clustered(20_000, 32)
    ids = np.arange(len(x), dtype=np.int64) * 3 + 7          # ids are not row numbers
    ho = tuning.holdout(len(x), 32)
    assert len(ho.tune) == len(ho.check) == 1000
    assert len(np.intersect1d(ho.held, ho.rows)) == 0 and len(ho.held) + len(ho.rows) == len(x)
    spec = fx.choose_spec(len(x), 32, "ivf")
    rows = ho.rows[fx.training_sample(len(ho.rows), spec)]
    index = fx.train(spec, x[rows], 32)
    fx.add(index, x[ho.rows], ids[ho.rows])
    q = x[ho.tune]
    truth = exact_knn(q, x, 10, "ip", ids=ids, rows=ho.rows)[1]
    nprobe, rq = tuning.tune(index, spec, q, truth, target)
    assert 1 <= nprobe < spec.nlist and tuning.clears(rq, target) and rq.mean() > target
    assert faiss.extract_index_ivf(index).nprobe == nprobe                # left set to it

    def measured(p: int) -> np.ndarray:      # independently: per-query recall at nprobe p
        found = index.search(q, 10, params=faiss.SearchParametersIVF(nprobe=p))[1]
        return np.array([len(set(f) & set(t)) / 10 for f, t in zip(found, truth)])

    np.testing.assert_allclose(measured(nprobe), rq)
    if nprobe > 1:
        assert not tuning.clears(measured(nprobe - 1), target)
    # the margin: a recall that only just reaches the target does not clear it
    assert not tuning.clears(np.full(1000, target) + np.r_[0.05, -0.05].repeat(500), target)
    # and the promise holds for the held-out check set, never used for tuning
    found = index.search(x[ho.check], 10, params=faiss.SearchParametersIVF(nprobe=nprobe))[1]
    check = exact_knn(x[ho.check], x, 10, "ip", ids=ids, rows=ho.rows)[1]
    assert tuning.recalls(found, check).mean() >= target


def test_flat_needs_no_tuning_and_ids_roundtrip(tmp_path: Path) -> None:
    x = clustered(500, 16)
    ids = np.random.default_rng(0).choice(2 ** 53, 500, replace=False).astype(np.int64)
    spec = fx.choose_spec(500, 16)
    index = fx.train(spec, x, 16)
    fx.add(index, x, ids)
    value, rq = tuning.tune(index, spec, x[:50], exact_knn(x[:50], x, 10, "ip", ids=ids)[1], 0.95)
    assert value == 0 and rq.tolist() == [1.0] * 50
    np.testing.assert_array_equal(fx.index_ids(index), np.sort(ids))
    fx.write_atomic(index, tmp_path / "i.faiss")
    back = SearchableIndex(tmp_path / "i.faiss", device="cpu")
    s, i, partial = back.search(x[:5], 3)
    assert partial == ()                                      # one process: always whole
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
    from indexer.ann.selection import build as make_index

    x = clustered(10_000, 32, centers=100, spread=0.5)
    ids = np.arange(10_000, dtype=np.int64)
    index, fields = make_index(ids, x, index_type=index_type, target_recall=0.9, device="cpu")
    assert fields["index_type"] == index_type and index.ntotal == 10_000
    assert 1 <= fields["nprobe"] <= fields["nlist"]
    q = x[::10]
    truth = exact_knn(q, x, 10, "ip", ids=ids)[1]
    measured = tuning.recalls(index.search(q, 10)[1], truth).mean()    # at the stored nprobe
    assert measured == pytest.approx(fields["recall_at_10"], abs=0.05)
    if fields["recall_at_10"] < 0.9:
        assert fields["nprobe"] == fields["nlist"] and "warning" in fields
    else:
        assert "warning" not in fields


@pytest.mark.parametrize("index_type", ["ivf", "ivfhnsw", "hnsw", "sq8rf", "pqfsrf"])
def test_every_type_keeps_ids_params_and_removals(index_type: str, tmp_path: Path) -> None:
    """What build, add/remove and Index.open rely on, for each type selection may pick."""
    x = clustered(3_000, 16)
    ids = np.arange(3_000, dtype=np.int64) * 5 + 2 ** 40
    spec = fx.choose_spec(3_000, 16, index_type, nlist=16)
    index = fx.train(spec, x[fx.training_sample(3_000, spec)], 16)
    fx.add(index, x, ids)
    value = 8 if spec.nlist else 32
    fx.set_search_params(index, spec.search_params(value))
    fx.write_atomic(index, tmp_path / "i.faiss")
    back = SearchableIndex(tmp_path / "i.faiss", device="cpu")
    # the tuned parameters travel in the file
    if spec.nlist:
        assert faiss.extract_index_ivf(back.cpu_index).nprobe == 8
    else:
        assert faiss.downcast_index(back.cpu_index.index).hnsw.efSearch == 32
    if spec.k_factor:
        assert faiss.downcast_index(back.cpu_index.index).k_factor == spec.k_factor
    s, i, _ = back.search(x[:20], 5)
    np.testing.assert_array_equal(i[:, 0], ids[:20])            # ids, not row numbers
    np.testing.assert_allclose(s[:, 0], 1.0, atol=1e-3)         # exact re-ranking: cosine 1
    # removal works for every type (HNSW graphs and refine wrappers are refilled)
    np.testing.assert_array_equal(fx.index_ids(index), ids)
    keep = np.ones(3_000, bool)
    keep[:100] = False
    fx.remove(index, ids[:100], lambda: (x[keep], ids[keep]))
    np.testing.assert_array_equal(fx.index_ids(index), ids[100:])
    fx.set_search_params(index, spec.search_params(value))
    assert not np.isin(index.search(x[:100], 5)[1], ids[:100]).any()
    assert (index.search(x[100:120], 5)[1][:, 0] == ids[100:120]).all()


def test_memory_mapped_ivf_lists_search_without_prefetch_threads(tmp_path: Path) -> None:
    """Reading an IVF index memory-mapped for serving (codes-only serving, merge_ondisk's index;
    sharded parts and fan-out actors too) turns faiss's per-search prefetch threads off (4.5x a single
    query's time here: benchmarks.scaling.mmap_search), and answers as the index in RAM does."""
    from benchmarks.scaling import ondisk

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4000, 32)).astype("float32")
    faiss.normalize_L2(x)
    index = faiss.index_factory(32, "IVF16,Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    index.add(x)
    index.nprobe = 4
    path = tmp_path / "ivf.faiss"
    faiss.write_index(index, str(path))
    want = index.search(x[:50], 5)

    def prefetch_threads(ix: faiss.Index) -> int:
        lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(ix).invlists)
        assert isinstance(lists, faiss.OnDiskInvertedLists), type(lists)   # what mmap reads give
        return int(lists.prefetch_nthread)

    assert prefetch_threads(faiss.read_index(str(path), faiss.IO_FLAG_MMAP)) > 0   # faiss's default
    served = SearchableIndex(path, nprobe=4, mmap=True)
    assert prefetch_threads(served.cpu_index) == 0
    ondisk.merge_ondisk(index, [path], tmp_path / "merged.faiss")
    merged = ondisk.read_ondisk(tmp_path / "merged.faiss")
    assert prefetch_threads(merged) == 0
    for ix in (served.cpu_index, merged):
        ix.nprobe = 4
        got = ix.search(x[:50], 5)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
