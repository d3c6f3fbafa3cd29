"""A search restricted to some labels (``labels=``, ``indexer search --label``) on the shared
Omniglot indexes (real LMDB stores, real faiss Flat and sharded IVF, a real DBA build): only
those labels' images answer, and they are the exact top-k among them, by the exact pass over
stored vectors and by the deeper filtered search alike; a label the index lacks is one line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from indexer import Index
from indexer.ann import subset
from indexer_testlib import run_cli
from knn_asserts import assert_knn, vector_scorer


def brute(idx: Index, q: np.ndarray, allowed: np.ndarray, k: int) -> np.ndarray:
    """The reference: float64 inner products with the stored vectors of ``allowed``."""
    s = np.asarray(q, np.float64) @ np.asarray(idx.embeddings(allowed), np.float64).T
    top = np.argsort(-s, axis=1, kind="stable")[:, :k]
    out = np.full((len(q), k), -1, np.int64)
    out[:, :top.shape[1]] = allowed[top]
    return out


@pytest.fixture(params=["exact", "filtered"])
def path(request, monkeypatch) -> str:
    """Both ways of answering: the exact pass over stored vectors, and (no byte budget) the
    index's own search fetched deeper and filtered."""
    if request.param == "filtered":
        monkeypatch.setattr(subset, "EXACT_BYTES", 0)
    return request.param


def test_only_the_labels_images_answer_the_exact_top_k_among_them(built_index, path):
    with Index.open(built_index) as idx:
        labels = idx.labels()
        only = [labels[3], labels[7]]
        allowed = idx.label_ids(only)
        assert len(allowed) == 40
        qids = [idx.ids_for_label(lab)[0] for lab in labels]        # queries of every label
        q = idx.embeddings(qids)
        scores, ids, partial, _ = idx.answer(q, 5, labels=only)
        assert partial == ()
        assert set(ids.ravel().tolist()) <= set(allowed.tolist())
        assert_knn(ids, brute(idx, q, allowed, 5), vector_scorer(q, idx.embeddings(allowed), allowed),
                   ordered=True, got_scores=scores)
        plain = idx.answer(q, 5).ids                 # unfiltered, most rows answer from other labels
        assert not set(plain.ravel().tolist()) <= set(allowed.tolist())


def test_a_gallery_query_is_left_out_and_a_small_label_answers_short(built_index, path):
    with Index.open(built_index) as idx:
        lab = idx.labels()[0]
        own = idx.ids_for_label(lab)[0]
        q = idx.embeddings([own])
        scores, ids = idx.search_embeddings(q, 30, exclude=[own], labels=[lab])
        got = ids[0][ids[0] >= 0]
        assert own not in got.tolist() and len(got) == 19           # the label's other 19 drawings
        assert (ids[0][19:] == -1).all() and np.isnan(scores[0][19:]).all()
        assert sorted(got.tolist()) == sorted(i for i in idx.ids_for_label(lab) if i != own)
        assert (np.diff(scores[0][:19]) <= 1e-6).all()              # best first


def test_a_sharded_ivf_index_filters_across_its_shards(two_shards, path):
    with Index.open(two_shards / "sharded") as idx:
        labels = idx.labels()
        only = labels[:2]
        allowed = idx.label_ids(only)
        q = idx.embeddings([idx.ids_for_label(lab)[1] for lab in labels])
        scores, ids, _, _ = idx.answer(q, 6, labels=only)
        assert set(ids.ravel().tolist()) - {-1} <= set(allowed.tolist())
        if path == "exact":          # the exact pass over both shards' stores
            assert_knn(ids, brute(idx, q, allowed, 6), vector_scorer(q, idx.embeddings(allowed), allowed),
                       got_scores=scores)
        else:    # IVF: approximate; a row its probed lists leave short is answered exactly
            assert (ids >= 0).all() and (np.diff(scores, axis=1) <= 1e-6).all()


def test_a_codes_only_index_filters_its_re_ranked_answer(two_shards, path):
    from indexer.ann import served
    from indexer.ann.faiss_index import memory_bytes

    ram = Index.open(two_shards / "merged")
    budget = memory_bytes(len(ram), 4 * ram.dim, int(ram.manifest.nlist), ram.dim) - 1
    with Index.open(two_shards / "merged", max_memory=budget) as idx:
        assert isinstance(idx.faiss, served.ReRanked)        # codes in RAM, exact vectors re-rank
        only = idx.labels()[4:6]
        allowed = idx.label_ids(only)
        q = idx.embeddings([idx.ids_for_label(lab)[2] for lab in idx.labels()])
        scores, ids = idx.search_embeddings(q, 6, labels=only)
        assert (ids >= 0).all() and set(ids.ravel().tolist()) <= set(allowed.tolist())
        if path == "exact":
            assert_knn(ids, brute(idx, q, allowed, 6), vector_scorer(q, idx.embeddings(allowed), allowed),
                       got_scores=scores)


def test_dba_reranks_the_labels_images(tmp_path, omniglot_gallery, small_onnx, path):
    out = tmp_path / "dba"
    run_cli("build", omniglot_gallery, "--model", small_onnx, "--out", out, "--dba", "--quiet")
    with Index.open(out) as idx:
        assert idx.has_dba and idx.neighbours.params.depth >= 40
        only = idx.labels()[2:4]
        allowed = idx.label_ids(only)
        q = idx.embeddings([idx.ids_for_label(lab)[0] for lab in idx.labels()])
        scores, ids = idx.search_embeddings(q, 5, dba=True, labels=only)
        # depth >= the 40 images: every one re-ranked, so the answer is the exact top-5 of
        # their augmented vectors
        aug = idx.neighbours.aug[idx.neighbours.rows(allowed)].astype(np.float32)
        want = allowed[np.argsort(-(q @ aug.T), axis=1, kind="stable")[:, :5]]
        assert_knn(ids, want, vector_scorer(q, aug, allowed), ordered=True, got_scores=scores)


def test_cli_label_filter_and_a_label_the_index_lacks(tmp_path, built_index, omniglot_gallery):
    lab = Index.open(built_index).labels()[5]
    img = sorted(omniglot_gallery.rglob("*.png"))[0]              # another label's drawing
    hits = json.loads(run_cli("search", img, "--index", built_index, "-k", "4", "--label", lab,
                              "--json").stdout)
    assert len(hits) == 4 and {h["label"] for h in hits} == {lab}
    folder = tmp_path / "q"
    folder.mkdir()
    (folder / img.name).write_bytes(img.read_bytes())
    out = tmp_path / "r.jsonl"
    run_cli("search", folder, "--index", built_index, "-k", "3", "--label", lab, "--out", out)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert [h["label"] for h in row["results"]] == [lab] * 3
    p = run_cli("search", img, "--index", built_index, "--label", "Nowhere/character99", check=False)
    assert p.returncode != 0 and "'Nowhere/character99': no image has it" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_exact_in_blocks_equals_one_pass(monkeypatch):
    """The exact pass merges blocks of stored vectors: one block, blocks of 7 or of 1, the same answer."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 16)).astype(np.float32)
    x[30] = x[3]                                  # a duplicate: a tie at the same score
    q = rng.standard_normal((4, 16)).astype(np.float32)
    allowed = np.arange(0, 100, 2, dtype=np.int64)      # ids, not row numbers
    vectors = lambda ids: x[ids // 2]              # noqa: E731
    want = allowed[np.argsort(-(q.astype(np.float64) @ x.T.astype(np.float64)), axis=1)[:, :9]]
    for block in (50, 7, 1):
        monkeypatch.setattr(subset, "EXACT_BYTES", 4 * 16 * block)
        s, i = subset.exact(vectors, allowed, q, 9)
        assert_knn(i, want, vector_scorer(q, x, allowed), ordered=True, got_scores=s)
    s, i = subset.exact(vectors, allowed[:5], q, 9)       # fewer than k: padded
    assert (i[:, 5:] == -1).all() and np.isnan(s[:, 5:]).all() and (i[:, :5] >= 0).all()


@pytest.mark.parametrize("spec,params,widened", [
    ("IVF16,Flat", "nprobe=1", "exact"), ("IDMap2,IVF16,Flat", "nprobe=1", "exact"),
    ("IVF16_HNSW32,Flat", "nprobe=1", "exact"), ("IDMap2,IVF16,SQ8,RFlat", "nprobe=1,k_factor_rf=4", "near"),
    ("IDMap2,IVF16,PQ4x4fsr,Refine(SQ8)", "nprobe=1,k_factor_rf=4", "better"), ("IVF16,PQ4np", "nprobe=1", "better"),
    ("IDMap2,HNSW32,Flat", "", "same")])
def test_a_wider_search_probes_more_lists_for_this_call_only(spec, params, widened):
    """``search_wider`` on every index type the selection may choose: widen 1 is the index's own
    search; widened to every list an IVF-Flat (behind an id map, with an HNSW quantizer) answers
    as exact search, a refine stage keeps its k_factor, PQ codes find more; no lists (HNSW): the
    same search. The shared index's nprobe is never changed."""
    import faiss

    from indexer.ann.faiss_index import search_wider

    rng = np.random.default_rng(1)
    x = rng.standard_normal((4000, 16)).astype(np.float32)
    faiss.normalize_L2(x)
    q = x[:40] + 0.3 * rng.standard_normal((40, 16)).astype(np.float32)
    index = faiss.index_factory(16, spec, faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    index.add_with_ids(x, np.arange(len(x))) if spec.startswith("IDMap") else index.add(x)
    if params:
        faiss.ParameterSpace().set_index_parameters(index, params)
    own = index.search(q, 10)
    np.testing.assert_array_equal(search_wider(index, q, 10, 1.0)[1], own[1])
    want = np.argsort(-(q.astype(np.float64) @ x.T.astype(np.float64)), axis=1)[:, :10]
    d, i = search_wider(index, q, 10, 16.0)

    def recall(ids: np.ndarray) -> float:
        return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids.tolist(), want.tolist())]))

    if widened == "same":
        np.testing.assert_array_equal(i, own[1])
        return
    assert faiss.extract_index_ivf(index).nprobe == 1 and recall(own[1]) < 0.9      # nprobe 1 misses
    if widened == "exact":
        assert_knn(i, want, vector_scorer(q, x), ordered=True, got_scores=d)
    elif widened == "near":      # candidates from the SQ8 codes of every list, refined exactly
        assert recall(i) >= 0.99
    else:
        assert recall(i) > recall(own[1]) + 0.1


def test_a_sharded_index_searched_wider_answers_as_exact_search(two_shards):
    """The parts searched as one (``PartsIndex``, IVF lists) widened past every list: the exact
    answer over both shards' stored vectors."""
    with Index.open(two_shards / "sharded") as idx:
        ids = np.concatenate([np.asarray(idx.ids_for_label(lab), np.int64) for lab in idx.labels()])
        x = idx.embeddings(ids)
        q = x[::5]
        d, i, _ = idx.faiss.search(q, 8, widen=float(idx.manifest.nlist))
        want = ids[np.argsort(-(q.astype(np.float64) @ x.T.astype(np.float64)), axis=1)[:, :8]]
        assert_knn(i, want, vector_scorer(q, x, ids), ordered=True, got_scores=d)
        own = idx.faiss.search(q, 8).ids             # nprobe 3 of 6 lists: some neighbours missed
        assert sum(len(set(a) - set(b)) for a, b in zip(want.tolist(), own.tolist())) > 0
