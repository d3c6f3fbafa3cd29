"""DBA re-ranking (indexer.ann.neighbours, ``indexer build --dba``): the augmented vectors are what
their definition says, stay equal to a fresh build's under ``indexer add``/``remove``, are
recorded and checked like index.faiss, switch per search, and a query that is a gallery item is
answered as if the gallery did not hold it (the leave-one-out guard). Real Omniglot images, a
real ONNX embedder, LMDB store and faiss index, the CLI in subprocesses."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from indexer import Index, IndexDir
from indexer.ann import neighbours
from indexer.errors import IndexerError
from indexer_testlib import copy_characters, run_cli


@pytest.fixture(scope="module")
def gallery8(tmp_path_factory: pytest.TempPathFactory, omniglot_root: Path) -> Path:
    """8 characters x 10 drawings; the last two characters are also kept apart as ``extra``."""
    root = tmp_path_factory.mktemp("nb-gallery")
    copy_characters(omniglot_root, root / "all", 8, per_char=10)
    copy_characters(omniglot_root, root / "first6", 6, per_char=10)
    copy_characters(omniglot_root, root / "extra", 2, per_char=10, skip_chars=6)
    return root


@pytest.fixture(scope="module")
def dba_index(tmp_path_factory: pytest.TempPathFactory, gallery8: Path, small_onnx: Path) -> Path:
    """A Flat index of all 8 characters built with --dba (module-scoped: tests copy it first)."""
    out = tmp_path_factory.mktemp("nb-built") / "idx"
    run_cli("build", gallery8 / "all", "--model", small_onnx, "--out", out, "--dba", "--quiet")
    return out


def _state(directory: Path) -> neighbours.Neighbourhoods:
    return neighbours.read(directory, IndexDir(directory).read_manifest())


def _same(a: neighbours.Neighbourhoods, b: neighbours.Neighbourhoods) -> None:
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.nbr, b.nbr)
    np.testing.assert_allclose(a.sims, b.sims, atol=1e-6)
    np.testing.assert_allclose(a.aug, b.aug, rtol=1e-3, atol=1e-6)    # float16: one step apart at most


def test_augmented_vectors_follow_the_definition() -> None:
    """aug_i = normalise(sum over i's k nearest gallery vectors, i included, of sim^alpha x_j),
    computed here by brute force with numpy."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 8)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ids = rng.choice(2 ** 40, size=60, replace=False).astype(np.int64)
    nb = neighbours.build(ids, x, neighbours.DbaParams(k=4, alpha=3.0))
    order = np.argsort(ids)
    xs = x[order]
    s = xs @ xs.T
    want = np.zeros_like(xs)
    for i in range(len(xs)):
        top = np.argsort(-s[i])[:4]             # itself first (sim 1), then its 3 nearest
        assert top[0] == i
        want[i] = (np.maximum(s[i, top], 0) ** 3) @ xs[top]
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    np.testing.assert_array_equal(nb.ids, ids[order])
    assert nb.aug.dtype == np.float16                    # half of DBA's memory (AUG_DTYPE)
    np.testing.assert_allclose(nb.aug, want, rtol=1e-3, atol=1e-5)


def test_add_and_remove_keep_the_fresh_build_state(tmp_path: Path, gallery8: Path, dba_index: Path,
                                                   small_onnx: Path) -> None:
    """Built on 6 characters, `indexer add` of 2 more gives exactly the neighbour lists and
    augmented vectors of a build of all 8; `indexer remove` of some items gives those of a
    build without them."""
    idx = tmp_path / "idx"
    run_cli("build", gallery8 / "first6", "--model", small_onnx, "--out", idx, "--dba", "--quiet")
    before = _state(idx)
    run_cli("add", gallery8 / "extra", "--index", idx, "--quiet")
    after_add = _state(idx)
    _same(after_add, _state(dba_index))
    assert not np.array_equal(before.aug, after_add.aug[np.isin(after_add.ids, before.ids)]), \
        "the added items changed no old item's neighbourhood: the test would not notice a stale file"

    files = sorted((gallery8 / "all").rglob("*.png"))
    gone = [files[3], files[25], files[71]]
    rels = [str(f.relative_to(gallery8 / "all")) for f in gone]
    run_cli("remove", *rels, "--index", idx)
    fresh_gallery = tmp_path / "rest"
    shutil.copytree(gallery8 / "all", fresh_gallery)
    for r in rels:
        (fresh_gallery / r).unlink()
    fresh = tmp_path / "fresh"
    run_cli("build", fresh_gallery, "--model", small_onnx, "--out", fresh, "--dba", "--quiet")
    _same(_state(idx), _state(fresh))
    info = run_cli("info", "--index", idx).stdout
    assert f"rerank:   DBA, k={neighbours.DEFAULT_K}" in info and "counts agree" in info


def test_a_rebuild_that_changes_nothing_keeps_the_neighbourhoods(tmp_path: Path, dba_index: Path, gallery8: Path,
                                                                small_onnx: Path) -> None:
    """A kept index (same images, model and options) keeps neighbours.npz and the DBA check's record
    when DBA's parameters are the same (25k photos: the k-NN was 17-19 s of a 36 s rebuild, the
    check 7 s); other parameters, or a damaged file, compute them again."""
    idx = tmp_path / "idx"
    shutil.copytree(dba_index, idx)
    nb = idx / neighbours.NEIGHBOURS_FILE

    def build(*extra: str) -> str:
        return run_cli("build", gallery8 / "all", "--model", small_onnx, "--out", idx, "--dba", "--quiet",
                       *extra).stdout

    def manifest() -> dict:
        return json.loads((idx / "manifest.json").read_text())

    st, check = nb.stat(), manifest()["dba_check"]          # the DBA check's record, on this index
    assert check["selected_for"] == manifest()["selected_for"] and check["k"] == neighbours.DEFAULT_K
    assert "kept: chosen" in build()
    assert (nb.stat().st_ino, nb.stat().st_mtime_ns) == (st.st_ino, st.st_mtime_ns)      # not rewritten
    assert manifest()["dba_check"] == check                                              # nor measured
    assert "kept: chosen" in build("--dba-k", "4")
    assert manifest()["neighbours"]["k"] == 4 == _state(idx).nbr.shape[1] == manifest()["dba_check"]["k"]
    k4 = _state(idx)
    data = bytearray(nb.read_bytes())
    data[-100] ^= 0xFF
    nb.write_bytes(bytes(data))
    build("--dba-k", "4")
    _same(_state(idx), k4)                          # computed again (``_state`` checks the file)


def test_manifest_records_and_checks_the_file(tmp_path: Path, dba_index: Path, gallery8: Path) -> None:
    idx = tmp_path / "idx"
    shutil.copytree(dba_index, idx)
    m = json.loads((idx / "manifest.json").read_text())
    rec = m["neighbours"]
    assert (rec["method"], rec["k"], rec["alpha"], rec["depth"]) == \
        ("dba", neighbours.DEFAULT_K, neighbours.DEFAULT_ALPHA, neighbours.DEFAULT_DEPTH)
    assert rec["bytes"] == (idx / neighbours.NEIGHBOURS_FILE).stat().st_size
    data = bytearray((idx / neighbours.NEIGHBOURS_FILE).read_bytes())
    data[-100] ^= 0xFF                                          # one flipped byte
    (idx / neighbours.NEIGHBOURS_FILE).write_bytes(bytes(data))
    with pytest.raises(IndexerError, match="neighbours.npz.*sha256"):
        Index.open(idx)
    p = run_cli("search", next((gallery8 / "all").rglob("*.png")), "--index", idx, check=False)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "neighbours.npz" in p.stderr


def test_rebuild_without_dba_drops_it(tmp_path: Path, gallery8: Path, dba_index: Path, small_onnx: Path) -> None:
    idx = tmp_path / "idx"
    shutil.copytree(dba_index, idx)
    run_cli("build", gallery8 / "all", "--model", small_onnx, "--out", idx, "--quiet", "--no-dba")
    assert "neighbours" not in json.loads((idx / "manifest.json").read_text())
    assert not (idx / neighbours.NEIGHBOURS_FILE).exists()
    with pytest.raises(ValueError, match="built without DBA"):
        Index.open(idx).search_embeddings(np.ones((1, 64), np.float32), 3, dba=True)
    img = next((gallery8 / "all").rglob("*.png"))
    p = run_cli("search", img, "--index", idx, "--dba", "on", check=False)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "built without DBA" in p.stderr
    assert run_cli("search", img, "--index", idx, "--dba", "off", "-k", "2").stdout.count("label=") == 2
    p = run_cli("build", gallery8 / "all", "--out", idx, "--dba-k", "4", "--no-dba", check=False)
    assert p.returncode == 2 and "need --dba" in p.stderr                 # DBA's parameters without DBA
    p = run_cli("build", gallery8 / "all", "--out", idx, "--dba", "--dba-k", "1", check=False)
    assert p.returncode == 1 and "DBA k=1" in p.stderr


def test_switch_per_search(dba_index: Path) -> None:
    """dba=False is the plain faiss answer; dba=True (the default of a DBA index) re-orders the
    plain top-depth candidates by their augmented vectors."""
    idx = Index.open(dba_index)
    ids, x = idx.store.all_embeddings(idx.model_hash)
    q = x[:20] + 0.05 * np.random.default_rng(1).normal(size=x[:20].shape).astype(np.float32)
    s_plain, i_plain = idx.search_embeddings(q, 5, dba=False)
    s_faiss, i_faiss, _ = idx.faiss.search(q / np.linalg.norm(q, axis=1, keepdims=True), 5)
    np.testing.assert_array_equal(i_plain, i_faiss)
    s_dba, i_dba = idx.search_embeddings(q, 5, dba=True)
    np.testing.assert_array_equal(idx.search_embeddings(q, 5)[1], i_dba)         # the default
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    nb = idx.neighbours
    full = qn @ nb.aug.T                                      # depth 100 > 80 items: exact DBA
    np.testing.assert_allclose(s_dba, -np.sort(-full, axis=1)[:, :5], atol=1e-5)  # (near-ties may swap)
    np.testing.assert_allclose(s_dba, np.take_along_axis(full, nb.rows(i_dba), 1), atol=1e-5)
    assert not np.array_equal(i_dba, i_plain)


def test_leave_one_out_guard_answers_as_without_the_query(tmp_path: Path, dba_index: Path) -> None:
    """A gallery item as query (exclude=[its id]) gets exactly the ranking and scores that the
    same vector gets from the index with that item removed (`indexer remove`); unguarded, its
    own vector inside its neighbours' augmented vectors changes the answer."""
    idx = Index.open(dba_index)
    ids, x = idx.store.all_embeddings(idx.model_hash)
    checked = 0
    for r in range(0, len(ids), 7):
        e = int(ids[r])
        if not (idx.neighbours.nbr[:, :idx.neighbours.params.k - 1] == e).any():
            continue
        copy = tmp_path / f"wo{r}"
        shutil.copytree(dba_index, copy)
        run_cli("remove", str(e), "--index", copy)
        s_g, i_g = idx.search_embeddings(x[r:r + 1], 10, exclude=[e])
        s_w, i_w = Index.open(copy).search_embeddings(x[r:r + 1], 10)
        np.testing.assert_array_equal(i_g, i_w)
        np.testing.assert_allclose(s_g, s_w, atol=1e-5)
        s_u, i_u = idx.search_embeddings(x[r:r + 1], 11)
        assert i_u[0, 0] == e                                   # itself, first, unguarded
        assert not np.allclose(np.sort(s_u[0, 1:])[::-1], s_g[0], atol=1e-5)
        checked += 1
        if checked == 2:
            break
    assert checked == 2


def test_eval_reports_both_settings(tmp_path: Path, dba_index: Path, gallery8: Path, monkeypatch) -> None:
    """`indexer eval --leave-one-out` and `--queries` print DBA and plain figures; for the same
    photos, the query folder (each query in the gallery, excluded and guarded) and
    leave-one-out agree exactly."""
    loo = json.loads(run_cli("eval", "--index", dba_index, "--leave-one-out", "--json").stdout)
    folder = json.loads(run_cli("eval", "--index", dba_index, "--queries", gallery8 / "all", "--json").stdout)
    assert loo["dba"] is True and loo["queries"] == 80 and set(loo["recall_plain"]) == {"1", "2", "4", "8"}
    assert folder["self_matches"] == 80
    assert loo["recall"] == folder["recall"] and loo["recall_plain"] == folder["recall_plain"]
    off = json.loads(run_cli("eval", "--index", dba_index, "--leave-one-out", "--dba", "off", "--json").stdout)
    assert off["dba"] is False and off["recall"] == loo["recall_plain"] and off["recall_dba"] == loo["recall"]
    # McNemar's z of DBA against plain at R@1 on the same queries, whichever setting leads
    assert loo["dba_z"] == folder["dba_z"] == off["dba_z"]
    assert (loo["dba_z"] > 0) == (loo["recall"]["1"] > loo["recall_plain"]["1"]) or loo["dba_z"] == 0
    shown = run_cli("eval", "--index", dba_index, "--leave-one-out")
    text = shown.stdout
    assert "Recall@1 (DBA):" in text and "Recall@1 (plain):" in text
    assert f"DBA vs plain at Recall@1, same queries: McNemar z {loo['dba_z']:+.2f}" in text
    assert re.search(r"searching: 100%\|\S+\| 80/80 ", shown.stderr), shown.stderr[-300:]   # both settings a block
    # the queries go in blocks (a million 2,560-d vectors were one array): blocks of 7, the same figures
    from indexer import Index
    from indexer.layouts import evaluate

    monkeypatch.setattr(evaluate, "BLOCK", 7)
    with Index.open(dba_index) as idx:
        small = evaluate.evaluate_gallery(idx)
    assert {str(k): v for k, v in small["recall"].items()} == loo["recall"] and small["dba_z"] == loo["dba_z"]
    assert {str(k): v for k, v in small["recall_plain"].items()} == loo["recall_plain"]


def test_labels_of_one_image_are_no_leave_one_out_queries(tmp_path: Path, gallery8: Path, omniglot_paths: list[Path],
                                                          small_onnx: Path) -> None:
    """The only image of its label cannot find its label: it is left out of leave-one-out (and of
    the build's DBA check) and counted; a gallery of such labels (one photo a product) builds with
    the default DBA and `eval` says why it has no figure. Until 2026-11-30 such images counted as
    misses (R@1 0.0000 for a gallery of them) and that gallery's build failed after indexing."""
    gal = tmp_path / "g"
    shutil.copytree(gallery8 / "first6", gal)
    (gal / "lone").mkdir()
    shutil.copy(omniglot_paths[-1], gal / "lone" / "only.png")
    for p in omniglot_paths[-3:-1]:                 # files at the root: no label, candidates only
        shutil.copy(p, gal / p.name)
    run_cli("build", gal, "--model", small_onnx, "--out", tmp_path / "idx", "--quiet")
    loo = json.loads(run_cli("eval", "--index", tmp_path / "idx", "--leave-one-out", "--json").stdout)
    assert (loo["queries"], loo["lone"], loo["unlabelled"]) == (60, 1, 2)
    assert "; 1 more are the only image of their label: no query; 2 unlabelled" in run_cli(
        "eval", "--index", tmp_path / "idx", "--leave-one-out").stdout
    beyond = run_cli("eval", "--index", tmp_path / "idx", "--leave-one-out", "-k", "1", "1000")
    assert "Recall@1" in beyond.stdout and "Recall@1000" not in beyond.stdout          # no figure, said
    assert "Recall@1000 not measured: the index holds 63 images" in beyond.stderr, beyond.stderr
    q = tmp_path / "queries"        # a query folder: a label the gallery lacks is skipped, and so is
    shutil.copytree(gallery8 / "extra", q)          # a query that is its label's only gallery image
    shutil.copytree(gal / "lone", q / "lone")
    known = sorted(p for p in gal.rglob("*.png") if p.parent != gal)[0]
    (q / known.relative_to(gal)).parent.mkdir(parents=True)
    shutil.copy(known, q / known.relative_to(gal))
    folder = json.loads(run_cli("eval", "--index", tmp_path / "idx", "--queries", q, "--json").stdout)
    assert (folder["queries"], folder["self_matches"], len(folder["skipped"])) == (1, 1, 21)
    why = sorted({x["reason"].split(" '")[0] for x in folder["skipped"]})
    assert why == ["it is the gallery's only image of its label", "no gallery image has its label"], why
    one_each = tmp_path / "products"
    for i, p in enumerate(omniglot_paths[:20]):
        (one_each / f"p{i:02d}").mkdir(parents=True)
        shutil.copy(p, one_each / f"p{i:02d}" / p.name)
    run_cli("build", one_each, "--model", small_onnx, "--out", tmp_path / "p", "--quiet")
    with Index.open(tmp_path / "p") as idx:
        assert idx.has_dba
    bad = run_cli("eval", "--index", tmp_path / "p", "--leave-one-out", check=False)
    assert bad.returncode == 1 and "each of its 20 labels holds one image" in bad.stderr
