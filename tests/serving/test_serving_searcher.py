"""Searcher on real indexes (augmented scikit-image photos, real ONNX embedders, faiss, LMDB)."""
from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from embedder import ImageLoadError
from serving import Searcher, UnknownIdError
from serving.evaluate import evaluate_folder, evaluate_gallery, recall_figure
from serving_testlib import labelled_folder
from serving.render import probe_grid


def _first_query(demo_dirs) -> tuple[Path, str]:
    items = labelled_folder(demo_dirs[1])
    return items[0]


def test_search_upload_returns_ranked_results_with_thumbnails(searcher: Searcher, demo_dirs):
    path, label = _first_query(demo_dirs)
    res = searcher.search(path, 5, thumbnails=True)
    assert res.index == "pretrained" and len(res.results) == 5
    assert res.scores == sorted(res.scores, reverse=True)
    assert len(set(res.ids)) == 5
    for r in res.results:
        store_meta = searcher.index("pretrained").store.get_meta(r.id)
        assert r.path == store_meta["path"] and r.label == store_meta["label"]
        assert r.path.startswith(f"{r.label}/")
        assert isinstance(r.thumbnail, Image.Image) and max(r.thumbnail.size) <= searcher.thumbs.size
    # a held-out augmented view of a photo finds views of the same photo first
    assert res.labels[0] == label


def test_exact_duplicate_upload_is_top1_and_gallery_query_excludes_itself(searcher: Searcher):
    store = searcher.index().store
    label = store.labels()[0]
    gid = store.ids_for_label(label)[0]
    data = store.get_bytes(gid)
    up = searcher.search(data, 3)
    assert up.ids[0] == gid and up.scores[0] == pytest.approx(1.0, abs=1e-4)
    by_id = searcher.search(gid, 3)
    assert gid not in by_id.ids and len(by_id.ids) == 3
    assert by_id.query.label == label
    by_path = searcher.search(searcher.query(path=store.get_meta(gid)["path"]), 3)
    assert by_path.ids == by_id.ids
    # the stored embedding and a fresh embedding of the same bytes agree
    assert searcher.search(data, 4).ids[1:] == by_id.ids
    with_self = searcher.search(gid, 3, exclude_self=False)
    assert with_self.ids[0] == gid


def test_batch_matches_single_queries_and_threads_agree(searcher: Searcher, demo_dirs):
    items = labelled_folder(demo_dirs[1])[:6]
    batch = searcher.search_batch([p for p, _ in items], 4)
    single = [searcher.search(p, 4) for p, _ in items]
    assert [b.ids for b in batch] == [s.ids for s in single]
    for b, s in zip(batch, single):
        np.testing.assert_allclose(b.scores, s.scores, rtol=1e-4, atol=1e-5)
    with ThreadPoolExecutor(4) as pool:   # concurrent queries on one Searcher
        threaded = list(pool.map(lambda p: searcher.search(p, 4, index="small").ids, [p for p, _ in items] * 2))
    alone = [searcher.search(p, 4, index="small").ids for p, _ in items] * 2
    assert threaded == alone


def test_two_indexes_side_by_side(searcher: Searcher, demo_dirs):
    path, _ = _first_query(demo_dirs)
    both = searcher.search_all(path, 3)
    assert list(both) == ["pretrained", "small"]
    assert searcher.index("pretrained").dim != searcher.index("small").dim
    # same gallery, two embedders: each result is a real item of its own index
    for name, res in both.items():
        assert all(r.index == name for r in res.results)
    gid = searcher.index("pretrained").store.ids_for_label("coins")[0]
    q = searcher.query(id=gid, index="pretrained")
    # ids are content hashes: the same photo has the same id in the other index, which uses its
    # own stored embedding and leaves the query out of its results too
    small = searcher.search(q, 39, index="small")
    assert gid not in small.ids and len(small.ids) == 39
    own = searcher.index("small").embeddings([gid])[0]
    np.testing.assert_allclose(searcher.embed(q, "small"), own)
    assert gid not in searcher.search(q, 39, index="pretrained").ids


def test_bad_queries_raise_named_errors(searcher: Searcher, tmp_path):
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    with pytest.raises(ImageLoadError, match="notes.png"):
        searcher.search(bad, 3)
    with pytest.raises(UnknownIdError, match="not in index"):
        searcher.search(123, 3)
    with pytest.raises(UnknownIdError, match="unknown index"):
        searcher.search(b"x", 3, index="nope")
    with pytest.raises(UnknownIdError, match="path"):
        searcher.query(path="no/such.png")
    with pytest.raises(ValueError, match="k: expected"):
        searcher.search(searcher.index().store.ids_for_label("coins")[0], 0)
    with pytest.raises(ValueError, match="dim"):
        searcher.nearest(np.ones((1, 7), np.float32), 3)


def test_thumbnails_are_cached_pngs_from_lmdb(searcher: Searcher):
    store = searcher.index("small").store
    gid = store.ids_for_label("rocket")[0]
    before = searcher.thumbs.misses
    png = searcher.thumbnail_png("small", gid)
    png2 = searcher.thumbnail_png("small", gid)
    assert png is png2 and searcher.thumbs.misses == before + 1
    img = Image.open(io.BytesIO(png))
    assert img.format == "PNG"
    orig = Image.open(io.BytesIO(store.get_bytes(gid)))
    assert img.size[0] / img.size[1] == pytest.approx(orig.size[0] / orig.size[1], rel=0.05)
    red = np.asarray(searcher.thumbnail("small", gid, match=False))
    green = np.asarray(searcher.thumbnail("small", gid, match=True))
    assert tuple(red[0, 0]) == (220, 38, 38) and tuple(green[0, 0]) == (22, 163, 74)


def test_probes_keep_identity_scale_and_report_stability(searcher: Searcher):
    store = searcher.index().store
    gid = store.ids_for_label("astronaut")[0]
    rep = searcher.probe(gid, 4, scales=(1.0, 0.5, 3.0), n_random=1, shifts=(0.0, 1.0))
    names = [r.name for r in rep.rows]
    assert names[:4] == ["original", "scale x1", "scale x0.5", "scale x3"]
    assert len(rep.rows) == 1 + 3 + 1 + 2
    by = {r.name: r for r in rep.rows}
    assert by["scale x1"].ids == by["original"].ids and by["scale x1"].overlap == 1.0
    shift0 = next(r for r in rep.rows if r.name.startswith("shift r_b=0 "))
    assert shift0.ids == by["original"].ids             # r_b = 0 is no shift at all
    for r in rep.rows:
        assert 0.0 <= r.overlap <= 1.0 and r.precision is not None and gid not in r.ids
        assert r.precision == pytest.approx(sum(lab == "astronaut" for lab in r.labels) / 4)
    assert any("difference of gallery images" in n for n in rep.notes)
    # a pretrained embedder keeps most of its neighbours under mild scaling
    assert by["scale x0.5"].overlap >= 0.5
    img = probe_grid(searcher, rep)
    assert img.size[1] > 7 * 100


def test_probes_on_upload_need_a_class_for_shifting(searcher: Searcher, demo_dirs):
    path, label = _first_query(demo_dirs)
    rep = searcher.probe(path, 3, scales=(2.0,), shifts=(1.0,))
    assert [r.kind for r in rep.rows] == ["original", "scaling"]
    assert rep.rows[0].precision is None
    assert any("label is unknown" in n for n in rep.notes)
    rep2 = searcher.probe(path, 3, scales=(2.0,), shifts=(1.0,), shift_label=label)
    assert [r.kind for r in rep2.rows] == ["original", "scaling", "shifting"]
    all_reports = searcher.probe_all(searcher.query(path, label=label), 3, scales=(0.5,))
    assert list(all_reports) == ["pretrained", "small"]
    assert [r.name for r in all_reports["pretrained"].rows] == [r.name for r in all_reports["small"].rows]


def test_recall_pretrained_beats_chance_and_is_monotone(searcher: Searcher, demo_dirs):
    items = labelled_folder(demo_dirs[1])
    n_classes = len({lab for _, lab in items})
    res = evaluate_folder(searcher, demo_dirs[1], index="pretrained", ks=(1, 2, 4, 8))
    assert res.queries == len(items)
    r = res.recall
    assert r[1] <= r[2] <= r[4] <= r[8] <= 1.0
    # ImageNet features retrieve views of the same photo far above chance (1 / classes)
    assert r[1] >= 0.75 > 1 / n_classes
    loo = evaluate_gallery(searcher, index="pretrained", ks=(1, 4))
    assert loo.queries == len(searcher.index("pretrained")) and loo.recall[1] >= 0.75
    png = recall_figure([res, evaluate_folder(searcher, demo_dirs[1], index="small", ks=(1, 2, 4, 8))])
    assert Image.open(io.BytesIO(png)).format == "PNG"
