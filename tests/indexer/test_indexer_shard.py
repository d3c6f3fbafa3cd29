"""Two shard workers + merge give the same index as one process."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from indexer_testlib import run_cli
from knn_asserts import assert_knn, vector_scorer
from indexer import GalleryStore, Index
from indexer.ann.faiss_index import index_ids
from indexer.directory.index_dir import STORE_DIR
from indexer.store.walk import shard_of


def dba_lines(stderr: str, command: str) -> list[str]:
    """The lines a build or a merge printed about DBA, without the command's name."""
    return [line.removeprefix(f"indexer {command}: ") for line in stderr.splitlines() if "DBA" in line]


def test_two_shards_merged_equal_a_single_build(tmp_path: Path, omniglot_gallery: Path, small_onnx: Path) -> None:
    """Both at their defaults: the merge takes the build's DBA rule (240 labelled drawings, a
    --model: DBA, then measured on the labels), so it decides the same and holds the same
    neighbourhoods; the plain searches are one index's."""
    flags = ["--model", small_onnx, "--quiet", "--flat-threshold", "100"]
    b = run_cli("build", omniglot_gallery, "--out", tmp_path / "single", *flags)
    for i in range(2):
        p = run_cli("build", omniglot_gallery, "--shard", f"{i}/2", "--out", tmp_path / f"s{i}", *flags)
        assert dba_lines(p.stderr, "build") == ["no DBA: --shard builds leave it to `indexer merge`"]
    counts = []
    for i in range(2):
        with GalleryStore(tmp_path / f"s{i}" / STORE_DIR) as st:
            ids = st.ids()
            counts.append(len(ids))
            assert all(shard_of(st.get_meta(int(j))["path"], 2) == i for j in ids)
    assert all(c > 0 for c in counts) and sum(counts) == 240
    p = run_cli("search", next(omniglot_gallery.rglob("*.png")), "--index", tmp_path / "s0", check=False)
    assert p.returncode == 1 and "indexer merge" in p.stderr

    m = run_cli("merge", tmp_path / "s0", tmp_path / "s1", "--out", tmp_path / "merged", "--quiet",
                "--flat-threshold", "100")
    assert dba_lines(m.stderr, "merge") == dba_lines(b.stderr, "build"), (m.stderr, b.stderr)
    single, merged = Index.open(tmp_path / "single"), Index.open(tmp_path / "merged")
    assert merged.has_dba == single.has_dba
    if single.has_dba:          # the same neighbours' similarities (which neighbour wins a tie aside)
        got, want = merged.neighbours, single.neighbours
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_allclose(got.sims, want.sims, atol=1e-5)
    ms, mm = single.manifest, merged.manifest
    assert mm["index_type"] == ms["index_type"] == "ivf"
    for key in ("count", "nlist", "nprobe", "recall_at_10", "dim"):
        assert mm[key] == ms[key], key
    np.testing.assert_array_equal(index_ids(merged.faiss.cpu_index), index_ids(single.faiss.cpu_index))
    # same quantizer (one training over the union, same sample)
    q_single = single.faiss.cpu_index.quantizer.reconstruct_n(0, ms["nlist"])
    q_merged = merged.faiss.cpu_index.quantizer.reconstruct_n(0, mm["nlist"])
    np.testing.assert_allclose(q_merged, q_single, atol=1e-6)
    # same answers for every gallery image, at the tuned nprobe
    ids, x = single.store.all_embeddings(single.model_hash)
    s1, i1 = single.search_embeddings(x, 10, dba=False)
    s2, i2 = merged.search_embeddings(x, 10, dba=False)
    np.testing.assert_allclose(s2, s1, atol=1e-5)
    # ids up to float ties: the same vector sits elsewhere in the merged lists, where another
    # CPU's SIMD kernel may round its score another way, and look-alike glyphs tie within 1e-8
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    assert_knn(i2, i1, vector_scorer(xn, xn, ids), ordered=True, got_scores=s2, score_atol=1e-5)
    # and the merged store serves the same metadata and bytes
    for j in ids[::20]:
        assert merged.store.get_meta(int(j)) == single.store.get_meta(int(j))
        assert merged.store.get_bytes(int(j)) == single.store.get_bytes(int(j))
    assert json.loads((tmp_path / "merged" / "manifest.json").read_text())["shards"] == [[0, 2], [1, 2]]
    p = run_cli("merge", "--sharded", tmp_path / "s0", tmp_path / "s1", "--out", tmp_path / "sharded", "--quiet")
    assert dba_lines(p.stderr, "merge") == ["no DBA: sharded indexes do not compute it yet"]


def test_a_merge_of_the_same_shards_keeps_the_chosen_index_and_the_dba_verdict(two_shards: Path,
                                                                               tmp_path: Path) -> None:
    """`indexer merge` (and so `indexer build --ray`) of shards that changed nothing keeps the
    merged index as a rebuild does: its type, DBA's file and the DBA check's verdict, measured once."""
    out = tmp_path / "m"
    flags = ["--quiet", "--flat-threshold", "100"]
    first = run_cli("merge", two_shards / "s0", two_shards / "s1", "--out", out, *flags)
    m1 = json.loads((out / "manifest.json").read_text())
    assert "kept: chosen" not in first.stdout and m1["selected_for"] and m1["dba_check"]["k"] == 8
    again = run_cli("merge", two_shards / "s0", two_shards / "s1", "--out", out, *flags)
    m2 = json.loads((out / "manifest.json").read_text())
    assert f"kept: chosen {m1['selected_at'][:19]}Z" in again.stdout, again.stdout
    assert m2["index_file"] == m1["index_file"] and m2["dba_check"] == m1["dba_check"]
    assert dba_lines(again.stderr, "merge") == [line.replace(" (--dba keeps it)", f" (measured {m1['dba_check']['at']} "
                                                             "on the same index and labels; --dba keeps it)")
                                                for line in dba_lines(first.stderr, "merge")]


def test_a_merge_again_keeps_what_add_put_into_the_merged_index(two_shards: Path, tmp_path: Path,
                                                                omniglot_paths: list[Path]) -> None:
    """`indexer add` into a merged index, then `indexer merge` of the same shards into it again:
    the added image stays indexed (a rebuild keeps what its store holds). Until 2026-11-30 the
    merge indexed the shards' images only: the store held one more than index.faiss, `info`
    said the counts differ and the app answered 503."""
    from indexer import check_counts

    out = tmp_path / "m"
    flags = ["--quiet", "--flat-threshold", "100", "--no-dba"]
    run_cli("merge", two_shards / "s0", two_shards / "s1", "--out", out, *flags)
    before = json.loads((out / "manifest.json").read_text())["count"]
    run_cli("add", omniglot_paths[-1], "--index", out, "--prefix", "extra", "--quiet")
    run_cli("merge", two_shards / "s0", two_shards / "s1", "--out", out, *flags)
    assert json.loads((out / "manifest.json").read_text())["count"] == before + 1 and check_counts(out).ok
    with Index.open(out) as idx:
        i = idx.id_for_path(f"extra/{omniglot_paths[-1].name}")
        assert i is not None and int(idx.search_embeddings(idx.embeddings([i]), 1)[1][0][0]) == i
