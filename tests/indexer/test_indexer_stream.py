"""The streaming build (train once on samples each shard draws, fill each shard apart, search the
parts as one, merge them on disk) gives an index as good as a one-process build's without the
driver ever listing every id; and its on-disk merge reads back from wherever it is moved."""
from __future__ import annotations

import shutil
from pathlib import Path

import faiss
import numpy as np
import pytest

from benchmarks.inputs.low_rank import low_rank, low_rank_law
from benchmarks.scaling.ondisk import merge_ondisk, read_ondisk
from indexer.ann import faiss_index as fx
from indexer.ann import selection, sample as shard_sample, stream, tuning
from indexer.errors import IndexerError
from indexer.store.sources import ArraySource, Source


N, D = 14_000, 32


@pytest.fixture(scope="module")
def gallery() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    law = low_rank_law(D, 0)
    x = low_rank(N, law, 1)
    ids = np.sort(np.random.default_rng(0).choice(2 ** 53, size=N, replace=False)).astype(np.int64)
    return ids, x, low_rank(300, law, 2)


def shards_of(ids: np.ndarray, x: np.ndarray, n: int = 3, dup: int = 0) -> list[ArraySource]:
    """``n`` shards by a random cut; ``dup`` vectors of shard 0 also in shard 1 (same content
    under two paths lands in two shards: it must be indexed once)."""
    cut = np.random.default_rng(5).integers(0, n, len(ids))
    parts = [(ids[cut == i], x[cut == i]) for i in range(n)]
    if dup:
        i1 = np.concatenate([parts[1][0], parts[0][0][:dup]])
        x1 = np.concatenate([parts[1][1], parts[0][1][:dup]])
        o = np.argsort(i1)
        parts[1] = (i1[o], x1[o])
    return [ArraySource(i, v) for i, v in parts]


class NoListing(ArraySource):
    """A shard that refuses to hand over all its ids at once: the driver's plan must get by with
    counts, a streaming pass and samples (its memory must not grow with the gallery)."""

    def ids(self) -> np.ndarray:
        raise AssertionError("the plan listed every id of a shard")


def build_parts(sources: list[Source], workdir: Path, **opts) -> tuple[faiss.Index, dict, list[Path]]:
    """The steps ``shard_build.build_sharded`` runs (plan, fill each part, tune on the parts
    searched as one, the held-out part), on shards held in memory: the part files
    ``workdir/part-<i>.faiss`` and ``held.faiss``, and the parts opened as one, tuned."""
    workdir.mkdir(parents=True, exist_ok=True)
    p = stream.plan(sources, **opts)
    files = [workdir / f"part-{i}.faiss" for i in range(len(sources))]
    for src, f, skip in zip(sources, files, p.skip):
        fx.write_atomic(stream.fill(src, p.trained, skip), f)
    fields = stream.tune_and_check(p, stream.open_parts(files, p.trained), 0.95)
    files.append(workdir / "held.faiss")
    fx.write_atomic(stream.held_part(p), files[-1])
    index = stream.open_parts(files, p.trained)
    fx.set_search_params(index, fields["search_params"])
    return index, fields, files


def fresh_recall(index: faiss.Index, ids: np.ndarray, x: np.ndarray, q: np.ndarray) -> float:
    truth = ids[faiss.knn(q, x, 10, metric=faiss.METRIC_INNER_PRODUCT)[1]]
    return float(tuning.recalls(index.search(q, 10)[1], truth).mean())


def test_streamed_index_is_as_good_as_the_one_process_build(gallery, tmp_path: Path) -> None:
    ids, x, q = gallery
    shards = [NoListing(s._ids, s.x) for s in shards_of(ids, x, dup=50)]
    index, fields, files = build_parts(shards, tmp_path / "parts", flat_threshold=5_000, device="cpu")
    # chosen by measurement among the candidates whose lists merge (which one wins depends on
    # timings); the samples are drawn per shard, so a one-process build of the chosen type is as
    # good on fresh queries, not the very same index
    only = [s.factory for s in selection.candidates(N, D) if stream.streamable(s)]
    assert [c["factory"] for c in fields["candidates"]] == only and fields["factory"] in only
    one, f1 = selection.build(ids, x, target_recall=0.95, flat_threshold=5_000, device="cpu",
                              index_type=fields["index_type"], nlist=fields["nlist"])
    for key in ("factory", "train_points", "count", "tuning_queries", "heldout_queries"):
        assert fields[key] == f1[key], key
    assert fields["recall_at_10"] >= 0.95 - 0.02 and fields["tuning_recall_at_10"] >= 0.95
    assert index.ntotal == one.ntotal == N                 # the 50 duplicates indexed once
    held = fx.index_ids(faiss.read_index(str(files[-1])))
    assert len(held) == fields["tuning_queries"] + fields["heldout_queries"]
    every = np.concatenate([fx.index_ids(faiss.read_index(str(f))) for f in files])
    np.testing.assert_array_equal(np.sort(every), ids)     # each id in exactly one part
    r_stream, r_one = fresh_recall(index, ids, x, q), fresh_recall(one, ids, x, q)
    assert abs(r_stream - r_one) <= 0.015, (r_stream, r_one)
    # merged on disk, then moved: the lists are found beside the index file
    (tmp_path / "m").mkdir()
    merge_ondisk(index.referenced_objects[-1], files, tmp_path / "m" / "merged.faiss",
                        fields["search_params"])
    shutil.move(tmp_path / "m", tmp_path / "moved")
    merged = read_ondisk(tmp_path / "moved" / "merged.faiss")
    assert isinstance(faiss.downcast_InvertedLists(faiss.extract_index_ivf(merged).invlists),
                      faiss.OnDiskInvertedLists)
    d3, i3 = merged.search(q, 10)
    d2, i2 = index.search(q, 10)
    np.testing.assert_array_equal(i3, i2)


def test_census_finds_the_duplicates_without_the_union(gallery) -> None:
    ids, x, _ = gallery
    shards = shards_of(ids, x, dup=50)
    counts, dups = shard_sample.census(shards, size=1_000)     # many windows
    assert counts == [len(s.ids()) for s in shards]
    assert [len(d) for d in dups] == [0, 50, 0]
    np.testing.assert_array_equal(dups[1], np.intersect1d(shards[0].ids(), shards[1].ids()))
    rng = np.random.default_rng(0)
    got = shard_sample.draw(rng, 1_000_000, 5_000, exclude=np.arange(0, 1_000_000, 2))
    assert len(got) == 5_000 == len(np.unique(got)) and (got % 2 == 1).all()


def test_exact_truth_streams_over_shards(gallery) -> None:
    ids, x, q = gallery
    truth = stream.exact_truth(shards_of(ids, x), q, 10, exclude=ids[:100], dups=[np.zeros(0, np.int64)] * 3)
    keep = ~np.isin(ids, ids[:100])
    want = ids[keep][faiss.knn(q, x[keep], 10, metric=faiss.METRIC_INNER_PRODUCT)[1]]
    np.testing.assert_array_equal(truth, want)


def test_unmergeable_types_are_refused(gallery) -> None:
    ids, x, _ = gallery
    with pytest.raises(IndexerError, match="cannot be filled apart"):
        stream.plan(shards_of(ids, x), index_type="pqfsrf", device="cpu")


def test_the_fanout_benchmarks_index_is_a_sharded_index_the_product_reads(tmp_path: Path) -> None:
    """benchmarks/scaling/fanout_bench.py writes a sharded index's files by hand (it measures the
    Ray fan-out, which the suite cannot afford): its manifest must stay the shape the product
    reads (it went stale once, unnoticed, when the manifest became typed)."""
    from benchmarks.scaling.fanout_bench import make_index
    from indexer.directory.shard_files import shard_paths

    manifest = make_index(tmp_path, 4000, 2, 16, 32)
    parts = [p / "part.faiss" for p in shard_paths(tmp_path, manifest)]
    assert [p.parent.name for p in parts] == ["s0", "s1"]
    both = stream.open_parts(parts + [tmp_path / manifest.sharded.held],
                             faiss.read_index(str(tmp_path / manifest.sharded.trained)))
    assert both.ntotal == 4000
    _, ids = both.search(np.eye(16, dtype=np.float32)[:2], 5)
    assert ((ids >= 0) & (ids < 4000)).all()
