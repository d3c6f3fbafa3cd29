"""A sharded index (shards left where they were built, one manifest listing them, searched as one)
answers exactly as its parts merged into one index, as well as today's merge of the same shards,
and add / remove / info / eval work on it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from indexer_testlib import copy_characters, run_cli
from knn_asserts import assert_knn, vector_scorer
from indexer import Index
from indexer import Sharded
from serving.searcher import Searcher

FLAGS = ["--quiet", "--flat-threshold", "100"]          # IVF: where "searched as one" can go wrong


@pytest.fixture(scope="module")
def built(two_shards: Path) -> Path:
    return two_shards           # tests/indexer/conftest.py: built once per session


def sharded_copy(built: Path, tmp: Path) -> tuple[Path, Path]:
    """Fresh shard directories (add/remove change them) and their sharded index."""
    for i in range(2):
        shutil.copytree(built / f"s{i}", tmp / f"s{i}")
    run_cli("merge", "--sharded", tmp / "s0", tmp / "s1", "--out", tmp / "idx", *FLAGS)
    return tmp / "idx", tmp


def test_sharded_index_answers_as_the_merged_one(built: Path, tmp_path: Path, omniglot_gallery: Path) -> None:
    out, _ = sharded_copy(built, tmp_path)
    m = json.loads((out / "manifest.json").read_text())
    assert m["sharded"]["shards"] == ["../s0", "../s1"]      # beside the index: relative, no server path
    assert not (out / "store.lmdb").exists() and not (out / "index.faiss").exists()   # nothing copied
    merged, sharded = Index.open(built / "merged"), Index.open(out, check_model=True)
    assert isinstance(sharded.layout, Sharded) and not isinstance(merged.layout, Sharded)
    mm, ms = merged.manifest, sharded.manifest
    assert ms["index_type"] == mm["index_type"] == "ivf"
    for key in ("count", "nlist", "dim"):
        assert ms[key] == mm[key], key
    ids, x = merged.store.all_embeddings(merged.model_hash)
    assert len(sharded) == len(ids) == 240
    # the parts searched as one answer exactly as the one index they merge into (on disk) ...
    import faiss

    from benchmarks.scaling.ondisk import merge_ondisk, read_ondisk

    sh = ms["sharded"]
    parts = [out / p / "part.faiss" for p in sh["shards"]] + [out / sh["held"]]
    trained = faiss.read_index(str(out / sh["trained"]))
    merge_ondisk(trained, parts, tmp_path / "one.faiss", ms["search_params"])
    one = read_ondisk(tmp_path / "one.faiss")
    q = x / np.linalg.norm(x, axis=1, keepdims=True)
    s2, i2 = sharded.search_embeddings(x, 10)                # every gallery image as a query
    s1, i1 = one.search(q, 10)
    # up to float ties: look-alike glyphs of the untrained embedder score within 1e-7, and the
    # parts' heaps merge them in another order than the one index's lists (2 of 2,400 swapped)
    assert_knn(i2, i1, vector_scorer(q, x, ids), ordered=True, got_scores=s2)
    np.testing.assert_allclose(s2, s1, atol=1e-5)
    # ... and as well as today's merge (trained on other samples: the plan draws them per shard)
    exact = ids[np.argsort(-(q @ x.T), axis=1, kind="stable")[:, :10]]
    rec = lambda found: float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, exact)]))  # noqa: E731
    assert rec(i2) >= rec(merged.search_embeddings(x, 10)[1]) - 0.03
    for j in ids[::7]:                                       # metadata and bytes from the shard
        assert sharded.meta(int(j)) == merged.meta(int(j))
        assert sharded.image_bytes(int(j)) == merged.image_bytes(int(j))
    assert sharded.labels() == merged.labels() and sharded.stored() == merged.stored()
    # the same through serving: Searcher opens it as it opens any index directory
    a = Searcher.open([built / "merged"], names=["m"])
    b = Searcher.open([out], names=["s"], check_model=True)
    pos = {int(i): r for r, i in enumerate(ids)}
    for j in ids[::11]:
        rb = b.search(int(j), 5, thumbnails=True)
        want = [int(i) for i in i2[pos[int(j)]] if i != j][:5]
        assert [r.id for r in rb.results] == want
        for r in rb.results:
            assert (r.path, r.label) == (merged.meta(r.id)["path"], merged.meta(r.id)["label"])
        assert b.thumbnail_png("s", rb.results[0].id) == a.thumbnail_png("m", rb.results[0].id)
    # eval through the CLI: about the same recall as today's merge
    ea = json.loads(run_cli("eval", "--queries", omniglot_gallery, "--index", built / "merged", "--json").stdout)
    eb = json.loads(run_cli("eval", "--queries", omniglot_gallery, "--index", out, "--json").stdout)
    assert eb["queries"] == 240
    for k, v in ea["recall"].items():
        assert abs(eb["recall"][k] - v) <= 0.03, (k, v, eb["recall"][k])
    info = run_cli("info", "--index", out).stdout
    assert "sharded: 2 shards" in info and info.count("images stored") == 2, info


def test_add_and_remove_on_a_sharded_index(built: Path, tmp_path: Path, omniglot_root: Path) -> None:
    out, tmp = sharded_copy(built, tmp_path)
    with Index.open(out) as idx:              # closed: a writer needs this process's stores shut
        sizes = [len(idx.store.stores[i]) for i in range(2)]
    smallest = tmp / f"s{int(np.argmin(sizes))}"
    extra = tmp / "extra"
    new_files = copy_characters(omniglot_root, extra, 2, skip_chars=40)
    p = run_cli("add", extra, "--index", out, "--prefix", "new")
    assert f"added 40 vectors to shard {smallest.resolve()}" in p.stdout, p.stdout
    idx = Index.open(out)
    assert len(idx) == 280 and idx.manifest["count"] == 280
    # retuned on self-queries (as `indexer add` on one index): no held-out set any more
    assert idx.manifest["heldout_queries"] == 0 and idx.manifest["tuning_queries"] > 0
    assert f"retuned to {idx.manifest['search_params']}" in p.stdout
    # and info says so (it used to print "on 0 held-out queries"), as it does for one index
    recall = next(ln for ln in run_cli("info", "--index", out).stdout.splitlines() if ln.startswith("recall:"))
    assert f"on {idx.manifest['tuning_queries']} self-queries (retuned after add/remove)" in recall, recall
    rel = "new/" + new_files[0].relative_to(extra).as_posix()
    i = idx.id_for_path(rel)
    assert i is not None and idx.meta(i)["path"] == rel
    s, found = idx.search_embeddings(idx.embeddings([i]), 1)
    assert found[0, 0] == i                                  # the new image finds itself
    # remove one path and one id; an unknown target refuses the whole command
    other = int(idx.ids_for_label(idx.labels()[0])[0])
    idx.close()
    bad = run_cli("remove", rel, "no/such.png", "--index", out, check=False)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        f"indexer remove: error: no/such.png: no such id or path in {out}"], bad.stderr
    bare = run_cli("remove", "new", "--index", out, check=False)     # a folder without its "/"
    assert bare.returncode == 1 and bare.stderr.strip().splitlines()[-1].endswith(
        "the folder new/ holds 40 stored images: write new/ to remove them all"), bare.stderr
    with Index.open(out) as idx:
        assert len(idx) == 280
    run_cli("remove", rel, str(other), "--index", out)
    idx = Index.open(out)
    assert len(idx) == 278 and idx.id_for_path(rel) is None and other not in idx
    _, x = Index.open(built / "merged").store.all_embeddings(idx.model_hash)
    found = idx.search_embeddings(x, 20)[1]
    assert i not in found and other not in found


def test_sharded_index_is_healthy_and_has_one_writer(built: Path, tmp_path: Path, omniglot_root: Path) -> None:
    """The count check (indexer info / /api/health) understands a sharded index (its parts
    against the manifest, not a missing index.faiss), and its writers take the directory's lock
    like every other writer: a second one is refused naming the holder."""
    from indexer import check_counts, writer_lock

    out, tmp = sharded_copy(built, tmp_path)
    c = check_counts(out)
    assert c.ok and c.faiss == c.manifest == 240, c.message
    assert Searcher.open([out], names=["s"]).health() == {}
    extra = tmp / "extra"
    copy_characters(omniglot_root, extra, 1, skip_chars=40)
    with writer_lock(out, "test holder"):
        p = run_cli("add", extra, "--index", out, check=False, fresh=True)      # another process
        q = run_cli("remove", "nothing", "--index", out, check=False, fresh=True)
    for r in (p, q):
        assert r.returncode == 1 and "is being written by pid" in r.stderr, r.stderr
    assert len(Index.open(out)) == 240


def test_a_shard_that_received_no_file_is_valid(tmp_path: Path, omniglot_root: Path, small_onnx: Path) -> None:
    """`--ray --shards 8` on a small gallery leaves some shards with no file: their (empty)
    store and part must not stop the sharded index from building, opening, searching, adding."""
    from embedder.folders import walk_gallery
    from indexer.store.walk import shard_of

    gallery = tmp_path / "g"
    copy_characters(omniglot_root, gallery, 1, per_char=3)
    got = {shard_of(f.relpath, 8) for f in walk_gallery(gallery)}
    full, empty = min(got), min(set(range(8)) - got)
    for i in (full, empty):
        run_cli("build", gallery, "--model", small_onnx, "--shard", f"{i}/8", "--out", tmp_path / f"s{i}", "--quiet")
    out = tmp_path / "idx"
    run_cli("merge", "--sharded", tmp_path / f"s{empty}", tmp_path / f"s{full}", "--out", out, "--quiet")
    idx = Index.open(out, check_model=True)
    n = sum(1 for f in walk_gallery(gallery) if shard_of(f.relpath, 8) == full)
    assert len(idx) == idx.manifest["count"] == n
    ids, x = idx.store.stores[1].all_embeddings(idx.model_hash)
    assert idx.search_embeddings(x, 1)[1][:, 0].tolist() == ids.tolist()
    info = run_cli("info", "--index", out).stdout
    assert f"shard 0:  {(tmp_path / f's{empty}').resolve()}: 0 images stored, 0 vectors" in info, info
    # `indexer add` goes to the emptiest shard: the one that had no file
    extra = tmp_path / "extra"
    copy_characters(omniglot_root, extra, 1, per_char=2, skip_chars=3)
    p = run_cli("add", extra, "--index", out)
    assert f"added 2 vectors to shard {(tmp_path / f's{empty}').resolve()}" in p.stdout, p.stdout
    assert len(Index.open(out)) == n + 2
