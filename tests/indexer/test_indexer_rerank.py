"""A serving node that holds only the codes (``--max-memory``): the index files are read
memory-mapped and re-encoded, and the candidates are re-ranked with the exact vectors of the
real LMDB store(s), so that it answers as the in-RAM index does wherever the candidates contain
its answer; single and sharded indexes, the Python face, the CLI and app.py's flag."""
from __future__ import annotations

import shutil
from pathlib import Path

import faiss
import numpy as np
import pytest

from indexer_testlib import run_cli
from knn_asserts import assert_knn, vector_scorer
from indexer import Index
from indexer.ann import served as rerank
from indexer.ann import faiss_index as fx
from indexer.errors import IndexerError
from serving.searcher import Searcher



@pytest.fixture(scope="module")
def built(two_shards: Path) -> Path:
    return two_shards           # tests/indexer/conftest.py: built once per session


def ram_bytes(idx: Index) -> int:
    """What the in-RAM IVF-Flat index holds: vectors + ids, and the centroids."""
    m = idx.manifest
    return fx.memory_bytes(len(idx), 4 * idx.dim, int(m["nlist"]), idx.dim)


def gallery(idx: Index) -> tuple[np.ndarray, np.ndarray]:
    """(ids ascending, vectors) of every image of a single or sharded index's store(s)."""
    stores = getattr(idx.store, "stores", [idx.store])
    parts = [s.all_embeddings(idx.model_hash) for s in stores]
    ids, x = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    ids, first = np.unique(ids, return_index=True)
    return ids, x[first]


def exact_top(x: np.ndarray, ids: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    return ids[np.argsort(-(q @ x.T), axis=1, kind="stable")[:, :k]]


def tie_recall(found: np.ndarray, x: np.ndarray, ids: np.ndarray, q: np.ndarray, k: int) -> float:
    """recall@k against exact search, counting an image whose score ties the k-th (within float
    error) as found: untrained embeddings of look-alike glyphs tie, and which of two tied images
    comes 10th depends on the order of a sum."""
    s = q @ x.T
    kth = -np.sort(-s, axis=1)[:, k - 1]
    got = np.take_along_axis(s, np.searchsorted(ids, np.where(found >= 0, found, ids[0])), axis=1)
    return float(np.minimum(((got >= kth[:, None] - 1e-6) & (found >= 0)).sum(axis=1), k).mean() / k)


def check_against_exact(codes: Index, ram: Index, k: int = 10, as_good: bool = True) -> float:
    """Every gallery image as a query: the answer is the exact top-k of its candidates; where
    they hold the exact top-k of the gallery (or the in-RAM index's top-k), it is that; recall@k
    vs exact >= the in-RAM index's at the same nprobe. Returns the share of queries whose
    candidates held the in-RAM index's answer."""
    ids, x = gallery(ram)
    q = x / np.linalg.norm(x, axis=1, keepdims=True)
    _, got = codes.search_embeddings(x, k)
    _, in_ram = ram.search_embeddings(x, k)
    cand = codes.faiss.candidates(np.ascontiguousarray(q), k)
    assert cand.shape[1] == rerank.RERANK_FACTOR * k
    exact = exact_top(x, ids, q, k)
    held = same = 0
    for r in range(len(q)):
        c = cand[r][cand[r] >= 0]
        xc = x[np.searchsorted(ids, c)]
        score = lambda found: np.sort(x[np.searchsorted(ids, found)] @ q[r])  # noqa: E731
        best = c[np.argsort(-(xc @ q[r]), kind="stable")[:k]]       # up to ties in score:
        np.testing.assert_allclose(score(got[r]), score(best), atol=1e-6, err_msg=str(r))
        assert set(got[r]) <= set(c)
        if set(exact[r]) <= set(c):             # the same k images as exact search
            held += 1
            np.testing.assert_allclose(score(got[r]), score(exact[r]), atol=1e-6, err_msg=str(r))
        if set(in_ram[r]) <= set(c):            # the same k images as the in-RAM index
            same += 1
            np.testing.assert_allclose(score(got[r]), score(in_ram[r]), atol=1e-6, err_msg=str(r))
    assert held > 0
    if as_good:
        assert tie_recall(got, x, ids, q, k) >= tie_recall(in_ram, x, ids, q, k)
    return same / len(q)


def test_codes_only_index_answers_as_exact_search(built: Path) -> None:
    ram = Index.open(built / "merged")
    budget = ram_bytes(ram) - 1                       # the vectors do not fit: codes
    codes = Index.open(built / "merged", max_memory=budget)
    assert isinstance(codes.faiss, rerank.ReRanked) and codes.max_memory == budget
    s = codes.faiss.summary
    assert s["codes"] == "SQ8" and s["nprobe"] == ram.manifest["nprobe"]
    assert s["memory_bytes"] <= budget and s["memory_bytes"] < 0.4 * ram_bytes(ram)
    assert check_against_exact(codes, ram) >= 0.9
    # a budget that holds the whole index serves it whole (exact lists, nothing re-ranked)
    assert not isinstance(Index.open(built / "merged", max_memory=ram_bytes(ram)).faiss, rerank.ReRanked)
    # SQ4 (what a budget of d/2 bytes a vector picks; PQ needs 256 points a codebook, 240 here):
    # coarser, so its top 10 k miss more of the in-RAM answers (measured: recall 0.972 against
    # 0.998 here), but where they hold them the answer is the same
    sq4 = Index.open(built / "merged", max_memory=fx.memory_bytes(len(ram), 32, ram.manifest["nlist"], ram.dim))
    assert sq4.faiss.summary["codes"] == "SQ4"
    assert check_against_exact(sq4, ram, as_good=False) >= 0.5
    with pytest.raises(IndexerError, match="the smallest codes .* need about"):
        Index.open(built / "merged", max_memory=1024)


def test_pq_codes_answer_as_the_in_ram_index_where_their_candidates_hold_it(tmp_path: Path) -> None:
    """PQ (d/4 bytes a vector, the codes a tight budget picks) on a gallery large enough to
    train it: low-rank vectors in a real IVF-Flat file read memory-mapped, exact vectors by id."""
    from benchmarks.inputs.low_rank import low_rank, low_rank_law

    law = low_rank_law(32, 0)
    x, q = low_rank(20_000, law, 1), low_rank(300, law, 2)
    ids = np.arange(len(x), dtype=np.int64) * 3 + 1
    index = faiss.index_factory(32, "IVF64,Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    index.add_with_ids(x, ids)
    index.nprobe = 4
    faiss.write_index(index, str(tmp_path / "i.faiss"))
    mapped = faiss.read_index(str(tmp_path / "i.faiss"), faiss.IO_FLAG_MMAP)
    mapped.nprobe = 4
    budget = fx.memory_bytes(len(x), 8, 64, 32)
    r = rerank.codes_only(mapped, lambda i: (i, x[(i - 1) // 3]), budget)
    assert r.summary["codes"] == "PQ8" and r.memory_bytes <= budget
    got = r.search(q, 10).ids
    _, ram = index.search(q, 10)
    cand = r.candidates(q, 10)
    held = [i for i in range(len(q)) if set(ram[i]) <= set(cand[i])]
    assert len(held) >= 0.9 * len(q)
    for i in held:
        np.testing.assert_array_equal(np.sort(got[i]), np.sort(ram[i]))


def test_codes_only_sharded_index_reads_every_shard_store(built: Path, tmp_path: Path) -> None:
    ram = Index.open(built / "sharded")
    codes = Index.open(built / "sharded", max_memory=ram_bytes(ram) // 2)
    assert isinstance(codes.faiss, rerank.ReRanked) and len(codes) == len(ram) == 240
    assert check_against_exact(codes, ram) >= 0.9
    # through the Searcher (what app.py serves): same results, thumbnails from the shard stores
    a = Searcher.open([built / "sharded"], names=["ram"])
    b = Searcher.open([built / "sharded"], names=["codes"], max_memory=ram_bytes(ram) // 2)
    assert b.describe("codes")["memory"]["codes"] == "SQ8" and a.describe("ram")["memory"] is None
    ids, x = gallery(ram)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    for j in ids[::13]:
        ra, rb = a.search(int(j), 5), b.search(int(j), 5, thumbnails=True)
        # faiss scores the in-RAM lists, numpy the re-ranked candidates: look-alike glyphs
        # within 1e-7 of each other may swap (up to ties, scores checked)
        assert_knn([[r.id for r in rb.results]], [[r.id for r in ra.results]],
                   vector_scorer(xn[ids == j], xn, ids), ordered=True,
                   got_scores=[[r.score for r in rb.results]], score_atol=1e-5)
        assert rb.results[0].thumbnail is not None


def test_an_image_removed_from_the_store_is_not_answered(built: Path, tmp_path: Path) -> None:
    shutil.copytree(built / "merged", tmp_path / "idx")
    ram = Index.open(tmp_path / "idx")
    codes = Index.open(tmp_path / "idx", max_memory=ram_bytes(ram) // 2)
    ids, x = ram.store.all_embeddings(ram.model_hash)
    gone = int(codes.search_embeddings(x[:1], 1)[1][0, 0])
    # removed by another process: this one's codes still hold it until it reloads the index
    run_cli("remove", str(gone), "--index", tmp_path / "idx", fresh=True)
    assert gone in codes.faiss.candidates(x[:1] / np.linalg.norm(x[:1]), 10)[0]
    scores, found = codes.search_embeddings(x[:1], 10)
    assert gone not in found[0] and (found[0] >= 0).all()
    # what the server's watcher does next: the new state, codes only again
    new = codes.reopen()
    assert isinstance(new.faiss, rerank.ReRanked) and new.max_memory == codes.max_memory
    assert len(new) == len(ram) - 1 and gone not in new.faiss.candidates(x[:1] / np.linalg.norm(x[:1]), 10)[0]


def test_cli_search_and_eval_with_max_memory(built: Path, omniglot_gallery: Path) -> None:
    import json

    idx = built / "merged"
    budget = str(ram_bytes(Index.open(idx)) // 2)
    a = json.loads(run_cli("eval", "--queries", omniglot_gallery, "--index", idx, "--json").stdout)
    b = json.loads(run_cli("eval", "--queries", omniglot_gallery, "--index", idx, "--json",
                           "--max-memory", budget).stdout)
    assert b["queries"] == a["queries"] == 240 and b["recall"].keys() == a["recall"].keys()
    # equal but where a query's k-th and next neighbours tie within float error (faiss and numpy
    # score them; look-alike glyphs are 1e-7 apart): each such query may count either way
    ids, x = gallery(Index.open(idx))
    xn = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float64)
    s = xn @ xn.T
    np.fill_diagonal(s, -np.inf)                       # each query left out of its own list
    top = -np.sort(-s, axis=1)
    for k, r in a["recall"].items():
        tied = int((top[:, int(k) - 1] - top[:, int(k)] <= 1e-6).sum())
        assert abs(b["recall"][k] - r) <= tied / 240 + 1e-9, (k, b["recall"][k], r, tied)
    img = next(omniglot_gallery.rglob("*.png"))
    sa = json.loads(run_cli("search", img, "--index", idx, "--json").stdout)
    sb = json.loads(run_cli("search", img, "--index", idx, "--json", "--max-memory", budget).stdout)
    q = Index.open(idx).store.id_for_path(img.relative_to(omniglot_gallery).as_posix())
    assert_knn([[h["id"] for h in sb]], [[h["id"] for h in sa]], vector_scorer(xn[ids == q], xn, ids),
               ordered=True, got_scores=[[h["score"] for h in sb]], score_atol=1e-5)   # up to ties
    # the budget in a unit that shows it (not "0 MiB"), and the smallest codes it could have had
    # (PQ needs 256 points a codebook: 240 vectors get SQ codes only)
    for bad, why in (("1K", "--max-memory 1.0 KiB: the smallest codes (SQ4, 32 bytes a vector) of 240 "
                            "vectors need about"),
                     ("lots", "argument --max-memory: invalid memory size value: 'lots'")):
        p = run_cli("eval", "--queries", omniglot_gallery, "--index", idx, "--max-memory", bad, check=False)
        code = 2 if bad == "lots" else 1        # a size that does not parse is a usage error
        assert p.returncode == code and why in p.stderr.strip().splitlines()[-1], p.stderr


def test_app_refuses_a_bad_max_memory(built: Path, capsys: pytest.CaptureFixture) -> None:
    import app

    assert app.parse_args(["--index", str(built / "merged"), "--max-memory", "64M"]).max_memory == 64 * 2 ** 20
    with pytest.raises(SystemExit) as e:
        app.parse_args(["--index", str(built / "merged"), "--max-memory", "0"])
    assert e.value.code == 2 and "--max-memory: invalid memory size value: '0'" in capsys.readouterr().err
