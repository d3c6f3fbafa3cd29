"""`indexer build/search/info/add/remove/eval` on real Omniglot images and real photos."""
from __future__ import annotations

import json
import re
import os
import shutil
import threading
from pathlib import Path

import faiss
import numpy as np
import pytest
from PIL import Image

from indexer_testlib import REPO, copy_characters, run_cli
from knn_asserts import recall_bounds
from indexer import GalleryStore, Index, build_index, check_counts
from indexer.directory.index_dir import INDEX_FILE, STORE_DIR


def test_build_stores_every_image_and_searches_itself_first(built_index: Path, omniglot_gallery: Path) -> None:
    files = sorted(omniglot_gallery.rglob("*.png"))
    idx = Index.open(built_index)
    assert len(idx) == len(files) == idx.manifest["count"]
    probe = files[::17]
    results = idx.search(probe, k=5)
    for f, hits in zip(probe, results):
        rel = f.relative_to(omniglot_gallery).as_posix()
        assert hits[0].path == rel and hits[0].label == f.parent.relative_to(omniglot_gallery).as_posix()
        assert hits[0].score == pytest.approx(1.0, abs=1e-4)
        assert idx.store.get_bytes(hits[0].id) == f.read_bytes()     # original bytes, unchanged
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    meta = idx.store.get_meta(results[0][0].id)
    assert (meta["width"], meta["height"]) == (105, 105)
    # stored embeddings are the normalised model outputs of the original images
    emb = idx.embedder.embed(probe)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    np.testing.assert_allclose(idx.embeddings([r[0].id for r in results]), emb, atol=1e-5)


def test_manifest_contents(built_index: Path, small_onnx: Path) -> None:
    from embedder.hashing import file_sha256

    m = json.loads((built_index / "manifest.json").read_text())
    assert m["model"]["hash"] == file_sha256(small_onnx) == file_sha256(built_index / "model.onnx")
    assert m["model"]["dim"] == m["dim"] == 64 and m["model"]["backbone"] == "small_cnn"
    assert m["metric"] == "inner_product" and m["index_type"] == "flat"
    assert m["count"] == 240 and m["nprobe"] == 0 and m["recall_at_10"] == 1.0
    assert m["build_seconds"] > 0 and m["target_recall"] == 0.95
    seconds = m["ingest"].pop("seconds")             # the embedding runner's stages
    assert set(seconds) == {"read", "embed", "write", "total"} and min(seconds.values()) >= 0
    assert m["ingest"] == {"found": 240, "new": 240, "unchanged": 0, "duplicates": 0,
                           "embedded": 240, "skipped": 0, "absent": 0, "moved": 0, "pruned": 0}
    index = faiss.read_index(str(built_index / INDEX_FILE))
    assert index.ntotal == 240 and index.d == 64 and index.metric_type == faiss.METRIC_INNER_PRODUCT
    assert not list(built_index.glob("*.tmp"))
    info = run_cli("info", "--index", built_index, "--json")
    assert json.loads(info.stdout)["store"] == {"items": 240, "labels": 12, "models": 1}


def test_cli_search_prints_the_query_itself_first(built_index: Path, omniglot_gallery: Path) -> None:
    q = sorted(omniglot_gallery.rglob("*.png"))[30]
    out = run_cli("search", q, "-k", "3", "--index", built_index, "--json")
    hits = json.loads(out.stdout)
    assert len(hits) == 3 and hits[0]["path"] == q.relative_to(omniglot_gallery).as_posix()
    table = run_cli("search", q, "-k", "2", "--index", built_index).stdout.splitlines()
    assert len(table) == 3 and q.name in table[0]
    # the hits' vote: the query itself (score 1) outweighs the other drawing
    assert table[2].startswith(f"suggested label: {q.parent.relative_to(omniglot_gallery).as_posix()} (confidence ")


def test_concurrent_queries_from_threads(built_index: Path, omniglot_gallery: Path) -> None:
    idx = Index.open(built_index)
    files = sorted(omniglot_gallery.rglob("*.png"))[:40]
    emb = idx.embeddings([idx.store.id_for_path(f.relative_to(omniglot_gallery).as_posix()) for f in files])
    expected = idx.search_embeddings(emb, 10)[1]
    expected_img = [h.id for h in idx.search(files[:4], 1)[0]]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            order = np.random.default_rng(seed).permutation(len(files))
            for j in order:
                np.testing.assert_array_equal(idx.search_embeddings(emb[j], 10)[1][0], expected[j])
            assert [h.id for h in idx.search(files[:4], 1)[0]] == expected_img
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    with pytest.raises(ValueError, match="dimension mismatch"):
        idx.search_embeddings(np.zeros((1, 12), np.float32))


def test_rebuild_embeds_nothing_twice(tmp_path: Path, omniglot_root: Path, small_onnx: Path) -> None:
    gallery = tmp_path / "g"
    copy_characters(omniglot_root, gallery, 3, per_char=10)
    m1 = build_index(gallery, tmp_path / "idx", small_onnx, progress=False)
    assert m1["ingest"]["embedded"] == 30
    copy_characters(omniglot_root, gallery, 1, per_char=10, skip_chars=3)
    shutil.copy(next(gallery.rglob("*.png")), gallery / "copy_at_root.png")   # same content again
    m2 = build_index(gallery, tmp_path / "idx", small_onnx, progress=False)
    ing = m2["ingest"]          # the JSON view: a copy
    assert ing.pop("seconds")["total"] >= 0
    assert ing == {"found": 41, "new": 10, "unchanged": 30, "duplicates": 1,
                            "embedded": 10, "skipped": 0, "absent": 0, "moved": 0, "pruned": 0}
    assert m2["count"] == 40
    with GalleryStore(tmp_path / "idx" / STORE_DIR) as st:
        i = st.id_for_path("copy_at_root.png")
        assert i is not None and len(st.get_meta(i)["paths"]) == 2
    m3 = build_index(gallery, tmp_path / "idx", small_onnx, progress=False)
    assert m3["ingest"]["embedded"] == 0 and m3["ingest"]["unchanged"] == 41


def test_ivf_path_meets_the_recall_target(tmp_path: Path, omniglot_gallery: Path, small_onnx: Path) -> None:
    out = tmp_path / "ivf"
    run_cli("build", omniglot_gallery, "--model", small_onnx, "--out", out, "--quiet", "--no-dba",
            "--flat-threshold", "100", "--target-recall", "0.97")
    m = json.loads((out / "manifest.json").read_text())
    assert m["index_type"] == "ivf" and m["nlist"] == 240 // 39
    assert 1 <= m["nprobe"] <= m["nlist"] and m["recall_at_10"] >= 0.97
    # independent check: recall@10 of the stored index vs exact search over all gallery vectors
    idx = Index.open(out)
    with GalleryStore(out / STORE_DIR) as st:
        ids, x = st.all_embeddings(m["model"]["hash"])
    exact = faiss.IndexFlatIP(x.shape[1])
    exact.add(x)
    truth = ids[exact.search(x, 10)[1]]
    got = idx.search_embeddings(x, 10)[1]
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, truth)])
    assert recall >= 0.97 - 0.02


def test_add_and_remove(tmp_path: Path, omniglot_root: Path, small_onnx: Path) -> None:
    g1, g2 = tmp_path / "g1", tmp_path / "g2"
    copy_characters(omniglot_root, g1, 2, per_char=10)
    new_files = copy_characters(omniglot_root, g2, 1, per_char=10, skip_chars=50)
    out = tmp_path / "idx"
    run_cli("build", g1, "--model", small_onnx, "--out", out, "--quiet")
    res = run_cli("add", g2, "--index", out, "--prefix", "more", "--quiet")
    assert "added 10 vectors" in res.stdout
    idx = Index.open(out)
    assert len(idx) == 30
    rel = "more/" + new_files[0].relative_to(g2).as_posix()
    hit = idx.search([new_files[0]], 1)[0][0]
    assert hit.path == rel and hit.label == str(Path(rel).parent)
    # remove one by path and one by id
    other = idx.store.id_for_path("more/" + new_files[1].relative_to(g2).as_posix())
    idx.close()
    run_cli("remove", rel, str(other), "--index", out)
    idx = Index.open(out)
    assert len(idx) == 28 and idx.store.id_for_path(rel) is None and other not in idx.store
    assert all(h.path != rel for h in idx.search([new_files[0]], 5)[0])
    kept = int(idx.store.ids()[0])
    idx.close()
    bad = run_cli("remove", str(kept), "no/such.png", "--index", out, check=False)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "no/such.png" in bad.stderr
    # an unknown target refuses the whole command: the known one before it stays (store and index)
    idx = Index.open(out)
    assert kept in idx.store and len(idx) == 28 and check_counts(out).ok
    idx.close()


def test_eval_excludes_the_query_itself(built_index: Path, omniglot_gallery: Path) -> None:
    from embedder.metrics import knn, recall_at_k

    out = run_cli("eval", "--queries", omniglot_gallery, "--index", built_index, "-k", "1", "4", "--json")
    res = json.loads(out.stdout)
    assert res["queries"] == 240 and res["self_matches"] == 240 and res["skipped"] == []
    assert re.search(r"embedding: 100%\|\S+\| 240/240 ", out.stderr), out.stderr[-300:]   # a bar with its total
    # the same number computed directly: exact neighbours of the stored embeddings, self excluded
    idx = Index.open(built_index)
    ids, x = idx.store.all_embeddings(idx.model_hash)
    labels = np.array([idx.store.get_meta(int(i))["label"] for i in ids])
    _, nn = knn(x, x, 4, exclude_self=True)
    expected = recall_at_k(labels[nn], labels, [1, 4])
    # up to float ties at rank k (the index ranks by inner product, knn by distance: look-alike
    # glyphs of the untrained embedder are 1e-7 apart, and either of two may come k-th)
    for k in (1, 4):
        lo, hi = recall_bounds(x, labels, k, atol=1e-6)
        assert lo - 1e-9 <= expected[k] <= hi + 1e-9 and lo - 1e-9 <= res["recall"][str(k)] <= hi + 1e-9
    assert res["recall"]["1"] < 1.0     # a self-match would have given exactly 1.0


def test_default_pretrained_embedder_on_photos(tmp_path: Path, photo_paths: list[Path],
                                               pretrained_onnx: Path) -> None:
    """No --model: the offline ImageNet embedder, so a build works before any training. A gallery
    this small (under 17 images) gets the fp32 model without DBA, each said in one line."""
    from embedder.hashing import file_sha256

    gallery = tmp_path / "photos"
    for i, p in enumerate(photo_paths):
        (gallery / ("even" if i % 2 == 0 else "odd")).mkdir(parents=True, exist_ok=True)
        shutil.copy(p, gallery / ("even" if i % 2 == 0 else "odd") / p.name)
    out = tmp_path / "idx"
    p = run_cli("build", gallery, "--out", out, "--quiet")
    assert f"fp32 embedder: the gallery holds {len(photo_paths)} images, int8 calibration needs 256" in p.stderr
    assert f"no DBA: the gallery holds {len(photo_paths)} images, DBA with k=8 needs 17" in p.stderr
    idx = Index.open(out)
    assert idx.manifest["model"]["hash"] == file_sha256(pretrained_onnx) and idx.dim == 1280
    assert not idx.has_dba
    for p, hits in zip(photo_paths, idx.search(photo_paths, 3)):
        assert hits[0].path.endswith("/" + p.name) and hits[0].score == pytest.approx(1.0, abs=1e-4)
        assert hits[1].score < 0.99     # different photos are not confused


def test_build_defaults_policy() -> None:
    """indexer.ann.options.resolve_defaults, the one place the build's default is decided (issue 41)."""
    from dataclasses import replace

    from indexer.ann.options import resolve_defaults as r

    big, mid, tiny = 10_000, 100, 10
    d = r(None, None, model_given=False, images=big)
    assert (d.int8, d.dba, d.notes) == (True, True, ())
    d = r(None, None, model_given=False, images=256)
    assert (d.int8, d.dba, d.notes) == (True, True, ())
    d = r(None, None, model_given=False, images=mid)
    assert (d.int8, d.dba) == (False, True) and len(d.notes) == 1 and "holds 100 images" in d.notes[0]
    d = r(None, None, model_given=False, images=tiny)
    assert (d.int8, d.dba) == (False, False) and len(d.notes) == 2
    assert r(None, None, model_given=False, images=17).dba and not r(None, None, model_given=False, images=16).dba
    assert r(None, None, model_given=False, images=9, dba_k=4).dba           # 2k + 1 of the given k
    for n in (tiny, mid, big):                     # --model: the same, DBA only where labels measure it
        assert r(None, None, model_given=True, images=n) == replace(r(None, None, model_given=False, images=n),
                                                                    embedder=None)
        d = r(None, None, model_given=True, images=n, labelled=False)
        assert (d.int8, d.dba) == (n >= 256, False) and d.notes[-1].startswith("no DBA: ")
    assert "has none (--dba forces it)" in r(None, None, model_given=True, images=big, labelled=False).notes[0]
    assert r(None, None, model_given=False, images=big, labelled=False).dba   # validated for the default
    for backbone, int8 in (("efficientnet_lite0+efficientnet_lite1", True), ("resnet50", True), ("small_cnn", True),
                           ("timm:vit_small_patch16_224", False), ("efficientnet_lite1+timm:convnext_atto", False)):
        d = r(None, None, model_given=True, images=big, backbone=backbone)     # int8 leaves MatMul float
        assert d.int8 is int8 and d.dba and (int8 or f"--model's backbone {backbone} is not" in d.notes[0])
    assert r(True, None, model_given=True, images=big, backbone="timm:vit_small_patch16_224").int8   # asked for
    d = r(False, False, model_given=False, images=big)                        # --no-int8 --no-dba
    assert (d.int8, d.dba, d.notes) == (False, False, ())
    d = r(True, True, model_given=True, images=tiny)                          # explicit: kept as today
    assert (d.int8, d.dba) == (True, True)
    from indexer.ann.options import DBA_MAX_IMAGES, dba_max_images   # an n^2 d pass: off above, one line

    pair = r(None, None, model_given=False, images=DBA_MAX_IMAGES, int8_dot="avx512_vnni")   # 2,560-d
    assert pair.dba and pair.embedder == "lite0+lite1-gem4"
    d = r(None, None, model_given=False, images=DBA_MAX_IMAGES + 1, int8_dot="avx512_vnni")
    assert (d.int8, d.dba) == (True, False) and d.notes[0].startswith("no DBA: the gallery holds over 100,000 "
                                                                        "images of 2560-d")
    assert r(None, True, model_given=False, images=DBA_MAX_IMAGES + 1).dba     # --dba: computed anyway
    # the same cost for narrower embeddings: Lite1 (1,280-d, the default without int8 dot products)
    # to 141,421 images, a 128-d --model to 447,213
    assert dba_max_images(1280) == 141_421 and dba_max_images(128) == 447_213 and dba_max_images(None) == 100_000
    assert r(None, None, model_given=False, images=141_421, int8_dot=None).dba
    assert not r(None, None, model_given=False, images=141_422, int8_dot=None).dba
    assert r(None, None, model_given=True, images=447_213, dim=128).dba
    assert not r(None, None, model_given=True, images=447_214, dim=128).dba
    assert not r(None, None, model_given=False, images=141_421, dim=2560).dba    # a merge of pair shards
    for mode in ("shard", "parts"):                                         # DBA: the merge's, not there (yet)
        d = r(None, None, model_given=False, images=big, mode=mode)
        assert (d.int8, d.dba) == (True, False) and len(d.notes) == 1
    # a rerun (same gallery, same count) decides the same
    assert r(None, None, model_given=False, images=300) == r(None, None, model_given=False, images=300)
    # the embedder: Lite1, in int8 the two-backbone one where the CPU has int8 dot products
    # (one line says so), except for --shard builds; an index's own one is kept; --model: none
    from indexer.ann.options import EMBEDDER, EMBEDDER_INT8_DOT

    assert r(None, None, model_given=False, images=big).embedder == EMBEDDER
    d = r(None, None, model_given=False, images=big, int8_dot="avx512_vnni")
    assert (d.int8, d.dba, d.embedder) == (True, True, EMBEDDER_INT8_DOT)
    assert d.notes == (f"two-backbone embedder {EMBEDDER_INT8_DOT} in int8: this CPU has int8 dot "
                       "products (avx512_vnni)",)
    assert r(None, None, model_given=False, images=mid, int8_dot="amx_int8").embedder == EMBEDDER
    assert r(False, None, model_given=False, images=big, int8_dot="avx_vnni").embedder == EMBEDDER
    assert r(True, None, model_given=False, images=tiny, int8_dot="avx_vnni").embedder == EMBEDDER_INT8_DOT
    assert r(None, None, model_given=False, images=big, int8_dot="avx_vnni", mode="parts").embedder == EMBEDDER_INT8_DOT
    assert r(None, None, model_given=False, images=big, int8_dot="avx_vnni", mode="shard").embedder == EMBEDDER
    d = r(None, None, model_given=False, images=big, int8_dot="avx512_vnni", kept=EMBEDDER, kept_int8=True)
    assert d.embedder == EMBEDDER and d.notes == ()
    assert r(None, None, model_given=False, images=big, kept=EMBEDDER_INT8_DOT, kept_int8=True).embedder == \
        EMBEDDER_INT8_DOT
    # an index of Lite1 in fp32 (built when its gallery held under 256 images) grown past 256: its
    # images are embedded again in int8 whatever the model, so by the default a fresh build takes
    d = r(None, None, model_given=False, images=big, int8_dot="avx512_vnni", kept=EMBEDDER, kept_int8=False)
    assert (d.int8, d.embedder) == (True, EMBEDDER_INT8_DOT) and "two-backbone" in d.notes[-1]
    assert r(False, None, model_given=False, images=big, int8_dot="avx512_vnni", kept=EMBEDDER).embedder == EMBEDDER
    assert r(None, None, model_given=True, images=big, int8_dot="avx512_vnni").embedder is None


def test_merge_knows_a_default_embedder_by_its_weights(pretrained_onnx: Path, small_onnx: Path) -> None:
    """`indexer merge` gives shards of a default embedder the rule of a build without --model:
    known by the hash of its weights (exports record it; int8 versions keep it)."""
    from embedder.pretrained import resolve_spec
    from embedder.runtime import read_metadata
    from indexer.ann.options import EMBEDDER, EMBEDDER_INT8_DOT, default_embedder_of

    assert default_embedder_of(read_metadata(pretrained_onnx)["source_hash"]) == EMBEDDER
    assert default_embedder_of(resolve_spec(EMBEDDER_INT8_DOT).source_hash()) == EMBEDDER_INT8_DOT
    assert default_embedder_of(read_metadata(small_onnx).get("source_hash")) is None
    assert default_embedder_of(None) is None


def test_int8_dot_product_reads_the_cpu_flags(tmp_path: Path) -> None:
    from embedder.quantize import int8_dot_product

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n")
    assert int8_dot_product(info) is None                               # AVX2 alone
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16\n")
    assert int8_dot_product(info) == "avx512_vnni"
    info.write_text("flags\t\t: avx2 avx_vnni amx_bf16 amx_int8 amx_tile\n")
    assert int8_dot_product(info) == "amx_int8"
    assert int8_dot_product(tmp_path / "none") is None                  # not Linux


def three_classes(g: Path, paths: list[Path]) -> Path:
    """12 drawings copied into c0/, c1/, c2/ (00.png .. 11.png, round robin)."""
    for i, p in enumerate(paths[:12]):
        (g / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        shutil.copy(p, g / f"c{i % 3}" / f"{i:02d}.png")
    return g


def test_a_build_with_the_default_embedder_imports_neither_torch_nor_sklearn(
        tmp_path: Path, cub_root: Path, pretrained_onnx: Path) -> None:
    """`indexer build` (the default embedder cached, its DBA check run) imports neither: torch came
    with the cached export's weights-hash check and sklearn with the metrics module (~1.3 s and
    ~1 s of a build; 320 photos: 5.2 -> 3.7 s)."""
    import subprocess
    import sys

    g = tmp_path / "g"
    for d in sorted(p for p in cub_root.iterdir() if p.is_dir())[:2]:     # 20 photos: DBA, checked
        (g / d.name).mkdir(parents=True)
        for f in sorted(d.glob("*.jpg"))[:10]:
            (g / d.name / f.name).symlink_to(f)
    code = ("import sys; from indexer.__main__ import main; rc = main(sys.argv[1:]); "
            "print('heavy:', sorted(m for m in ('torch', 'sklearn') if m in sys.modules)); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, "build", str(g), "--out", str(tmp_path / "idx"), "--quiet"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0 and "heavy: []" in p.stdout, (p.stdout, p.stderr[-2000:])
    assert json.loads((tmp_path / "idx" / "manifest.json").read_text())["model"]["metadata"]["source_hash"]


def test_a_rebuild_keeps_the_default_embedder_the_index_was_built_with(
        tmp_path: Path, cub_root: Path, pretrained_onnx: Path) -> None:
    """An index of Lite1 in int8 (what a CPU without int8 dot products builds) rebuilt with
    --int8 and no --model, on any CPU: it keeps Lite1 and its int8 model, nothing embedded again
    (the default on a CPU with int8 dot products would have re-embedded every image)."""
    g = tmp_path / "g"
    for d in sorted(p for p in cub_root.iterdir() if p.is_dir())[:2]:     # 20 photos, read in place
        (g / d.name).mkdir(parents=True)
        for f in sorted(d.glob("*.jpg"))[:10]:
            (g / d.name / f.name).symlink_to(f)
    out = tmp_path / "idx"
    run_cli("build", g, "--model", pretrained_onnx, "--int8", "--out", out, "--quiet")
    model = json.loads((out / "manifest.json").read_text())["model"]
    p = run_cli("build", g, "--int8", "--out", out, "--quiet")
    assert "20 files: 0 new, 20 unchanged, 0 duplicate content, 0 skipped; 0 embedded" in p.stdout, p.stdout
    assert "two-backbone" not in p.stderr
    assert json.loads((out / "manifest.json").read_text())["model"]["hash"] == model["hash"]


def test_a_rebuild_without_model_keeps_the_model_the_index_was_built_with(
        tmp_path: Path, omniglot_root: Path, small_onnx: Path) -> None:
    """An index built with --model (a fine-tuned network) rebuilt without it: it resumes with its
    own model (one line says so), nothing embedded again; before, the default embedder replaced
    it and every image was embedded again."""
    from indexer_testlib import copy_characters

    g = tmp_path / "g"
    copy_characters(omniglot_root, g, 2)                                   # 40 drawings
    out = tmp_path / "idx"
    run_cli("build", g, "--model", small_onnx, "--out", out, "--quiet")
    model = json.loads((out / "manifest.json").read_text())["model"]
    p = run_cli("build", g, "--out", out, "--quiet")
    assert "40 files: 0 new, 40 unchanged, 0 duplicate content, 0 skipped; 0 embedded" in p.stdout, p.stdout
    assert f"indexer build: the embedder {out} was built with (its model.onnx; --model changes it)" in p.stderr
    assert json.loads((out / "manifest.json").read_text())["model"]["hash"] == model["hash"]


def test_default_on_100_images_is_fp32_with_dba_and_opts_out(tmp_path: Path, omniglot_root: Path,
                                                            pretrained_onnx: Path) -> None:
    """100 images, no --model: fp32 (too few to calibrate int8) with DBA; built, searched. The
    same gallery rebuilt with --no-int8 --no-dba (an old-style fp32 index) resumes with the same
    model, drops DBA, reopens and searches with its own model, and `indexer add` keeps it."""
    from embedder.hashing import file_sha256

    g = tmp_path / "g"
    files = copy_characters(omniglot_root, g, 5, per_char=20)
    out = tmp_path / "idx"
    p = run_cli("build", g, "--out", out, "--quiet")
    assert "int8 calibration needs 256" in p.stderr and "no DBA" not in p.stderr
    fp32 = file_sha256(pretrained_onnx)
    m = json.loads((out / "manifest.json").read_text())
    assert m["model"]["hash"] == fp32 and m["neighbours"]["k"] == 8 and m["count"] == 100
    q = files[7]
    s = json.loads(run_cli("search", q, "--index", out, "-k", "3", "--json").stdout)
    assert len(s) == 3 and s[0]["label"] == q.parent.relative_to(g).as_posix()

    p = run_cli("build", g, "--out", out, "--quiet", "--no-int8", "--no-dba")
    assert "0 new, 100 unchanged" in p.stdout and p.stderr == ""
    m = json.loads((out / "manifest.json").read_text())
    assert m["model"]["hash"] == fp32 and "neighbours" not in m
    idx = Index.open(out, check_model=True)
    assert not idx.has_dba and idx.search([q], 1)[0][0].path == q.relative_to(g).as_posix()
    idx.close()
    more = tmp_path / "more"
    copy_characters(omniglot_root, more, 1, per_char=5, skip_chars=50)
    p = run_cli("add", more, "--index", out, "--prefix", "more", "--quiet")
    assert "added 5 vectors" in p.stdout and "int8 default" not in p.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["model"]["hash"] == fp32 and m["count"] == 105 and "neighbours" not in m
    # an `add` that takes such an index past 256 images says once how to get the int8 default
    from dataclasses import replace

    from indexer.cli.write import int8_hint
    from indexer.directory.manifest import Manifest

    man = Manifest.read(out / "manifest.json")
    hint = int8_hint(replace(man, count=260), 10, out)
    assert hint and f"`python -m indexer build {g.resolve()} --out {out}`" in hint
    assert int8_hint(replace(man, count=300), 10, out) is None          # past it before this add
    int8 = replace(man.model, metadata={**man.model.metadata, "quantization": "{}"})
    assert int8_hint(replace(man, count=260, model=int8), 10, out) is None
    # and that command counts the images the index holds (a rebuild keeps the added ones), not
    # only the folder's 100: past 256, int8 (before: fp32 again, the hint's command did nothing)
    from indexer.cli.parser import parser
    from indexer.cli.defaults import resolve_build_defaults

    replace(man, count=300).write(out / "manifest.json")
    d = resolve_build_defaults(parser().parse_args(["build", str(g), "--out", str(out)]))
    assert d.int8 and "int8 calibration needs" not in " ".join(d.notes)


def test_int8_rebuild_after_photos_were_added_keeps_the_index_int8_model(
        tmp_path: Path, omniglot_root: Path, small_onnx: Path) -> None:
    """`indexer build --int8` again once photos were added: the index keeps its own int8 model
    (calibrating again on the changed list would give another model and embed everything again),
    so only the new photos are embedded; with another fp32 model it is not kept."""
    g = tmp_path / "g"
    copy_characters(omniglot_root, g, 2, per_char=10)
    out = tmp_path / "idx"
    run_cli("build", g, "--model", small_onnx, "--int8", "--out", out, "--quiet")
    model = json.loads((out / "manifest.json").read_text())["model"]
    assert "quantization" in model["metadata"]
    copy_characters(omniglot_root, g, 1, per_char=3, skip_chars=2)
    p = run_cli("build", g, "--model", small_onnx, "--int8", "--out", out, "--quiet")
    assert "23 files: 3 new, 20 unchanged, 0 duplicate content, 0 skipped; 3 embedded" in p.stdout, p.stdout
    assert json.loads((out / "manifest.json").read_text())["model"]["hash"] == model["hash"]
    import onnx

    other = onnx.load(str(small_onnx))                  # the same network, another fp32 file
    other.metadata_props.add(key="source_hash", value="another-training-run")
    onnx.save(other, str(tmp_path / "other.onnx"))
    p = run_cli("build", g, "--model", tmp_path / "other.onnx", "--int8", "--out", out, "--quiet")
    assert "; 23 embedded" in p.stdout, p.stdout
    assert json.loads((out / "manifest.json").read_text())["model"]["hash"] != model["hash"]


@pytest.mark.slow
def test_default_on_a_cub_gallery_is_int8_with_dba(tmp_path: Path, cub_root: Path) -> None:
    """The measured default (issue 41, docs/benchmarks/quality-round5.md): no --model on >= 256
    photos gives the default embedder (two-backbone where the CPU has int8 dot products) in int8 (DEFAULT_RECIPE, calibrated on the gallery) with
    DBA. A rerun of the same command resumes (same int8 file, nothing embedded again); `indexer
    add` keeps the index's int8 model. The one test that quantises (cached in $DAS_CACHE/int8)."""
    from embedder import default_model_path
    from embedder.hashing import file_sha256
    from embedder.quantize import DEFAULT_RECIPE, int8_dot_product
    from indexer.ann.options import EMBEDDER, EMBEDDER_INT8_DOT

    g = tmp_path / "birds"
    species = sorted(p for p in cub_root.iterdir() if p.is_dir())
    for d in species[:26]:                          # 26 x 10 = 260 photos (symlinks, read in place)
        (g / d.name).mkdir(parents=True)
        for f in sorted(d.glob("*.jpg"))[:10]:
            (g / d.name / f.name).symlink_to(f)
    out = tmp_path / "idx"
    p = run_cli("build", g, "--out", out, "--quiet", timeout=900)
    dot = int8_dot_product()                        # the embedder hangs on this machine's CPU
    fp32 = default_model_path(EMBEDDER_INT8_DOT if dot else EMBEDDER)
    assert p.stderr == ("" if dot is None else      # nothing turned off: no note but the CPU's
                        f"indexer build: two-backbone embedder {EMBEDDER_INT8_DOT} in int8: this CPU "
                        f"has int8 dot products ({dot})\n"), p.stderr
    m = json.loads((out / "manifest.json").read_text())
    q = json.loads(m["model"]["metadata"]["quantization"])
    assert q["fp32_sha256"] == file_sha256(fp32) and q["calibration_images"] == 256
    assert q["reduce_range"] == DEFAULT_RECIPE.reduce_range
    assert m["count"] == 260 and m["neighbours"]["k"] == 8 and m["model"]["dim"] == (2560 if dot else 1280)
    photo = sorted((g / species[3].name).glob("*.jpg"))[2]
    s = json.loads(run_cli("search", photo, "--index", out, "-k", "3", "--json").stdout)
    assert s[0]["label"] == species[3].name
    p = run_cli("build", g, "--out", out, "--quiet", timeout=900)
    assert "0 new, 260 unchanged" in p.stdout
    assert json.loads((out / "manifest.json").read_text())["model"]["hash"] == m["model"]["hash"]
    more = tmp_path / "more"
    (more / species[30].name).mkdir(parents=True)
    for f in sorted((cub_root / species[30].name).glob("*.jpg"))[:3]:
        (more / species[30].name / f.name).symlink_to(f)
    run_cli("add", more, "--index", out, "--quiet")
    m2 = json.loads((out / "manifest.json").read_text())
    assert m2["model"]["hash"] == m["model"]["hash"] and m2["count"] == 263 and m2["neighbours"]


def test_default_dba_is_dropped_where_the_gallerys_own_labels_say_it_hurts(tmp_path: Path, omniglot_root: Path,
                                                                          pretrained_onnx: Path) -> None:
    """DBA's sign flips between sets (issue 41): a default build measures it on the gallery's own
    labels (leave-one-out, itself guarded, as `indexer eval`) and builds without it where it loses
    beyond the noise. 240 Armenian letters (12 x 20 drawings; under 256: Lite1 fp32, no
    quantising): R@1 ~69 with DBA, ~77 without -> no DBA, one line naming both and `--dba`,
    and `indexer eval` finds the figure printed; the same network given as `--model` is measured
    alike; `--dba` asked for keeps it, with a warning (the photo galleries keep the default's DBA:
    test_default_on_a_cub_gallery_is_int8_with_dba)."""
    import re

    g = tmp_path / "letters"
    for c in sorted((omniglot_root / "images_background" / "Armenian").iterdir())[:12]:
        (g / c.name).mkdir(parents=True)
        for f in sorted(c.glob("*.png")):
            (g / c.name / f.name).symlink_to(f)
    out = tmp_path / "idx"
    p = run_cli("build", g, "--out", out, "--quiet")
    lines = [ln for ln in p.stderr.splitlines() if "DBA" in ln]
    assert len(lines) == 1 and lines[0].startswith("indexer build: no DBA: leave-one-out R@1 of 240 "
                                                   "labelled images") and "(--dba keeps it)" in lines[0], p.stderr
    with_dba, without = map(float, re.search(r"([\d.]+) with it, ([\d.]+) without", lines[0]).groups())
    assert with_dba + 3 < without                          # far beyond the noise, not a tie
    assert json.loads((out / "manifest.json").read_text()).get("neighbours") is None
    assert not (out / "neighbours.npz").exists()
    e = json.loads(run_cli("eval", "--index", out, "--leave-one-out", "-k", "1", "--json").stdout)
    assert e["dba"] is False and abs(100 * e["recall"]["1"] - without) < 0.01
    p = run_cli("build", g, "--out", out, "--model", pretrained_onnx, "--quiet")   # --model: measured alike;
    figures = lines[0].split("no DBA: ")[1].split(" (")[0]           # the same index: the verdict kept
    assert "0 new, 240 unchanged" in p.stdout and f"no DBA: {figures} (measured " in p.stderr, p.stderr
    assert not (out / "neighbours.npz").exists()
    first = sorted(g.iterdir())
    moved = sorted(first[0].iterdir())[0]
    moved.rename(first[1] / moved.name)                      # an image filed under another label:
    p = run_cli("build", g, "--out", out, "--prune", "--quiet")      # the same ids, measured again
    assert "kept: chosen" in p.stdout and "no DBA: leave-one-out R@1 of 240" in p.stderr
    assert "(measured" not in p.stderr and not (out / "neighbours.npz").exists()
    p = run_cli("build", g, "--out", out, "--dba", "--quiet")      # asked for: kept, nothing embedded
    assert "0 new, 240 unchanged" in p.stdout
    assert "warning: DBA, asked for, is behind on this gallery: leave-one-out R@1 of 240" in p.stderr, p.stderr
    assert json.loads((out / "manifest.json").read_text())["neighbours"]["k"] == 8



def test_model_whose_int8_misses_the_check_is_built_in_fp32_by_default(tmp_path: Path, omniglot_root: Path,
                                                                       small_onnx: Path) -> None:
    """`--model` on >= 256 images is quantised by default, as the default embedder is; a network
    whose int8 version misses the int8/fp32 check even bias-corrected is built in fp32 with one
    line (asked-for `--int8` refuses it). Here small_cnn with one input channel of its last conv
    always 0 (negative weights on ReLU outputs, then ReLU) but weighted 1e4 (7-bit per-channel weights round every other one of that conv
    to 0) and its head centred (fp32 embeddings point every way): mean cosine ~0.1. The gallery has
    no labels: a --model gets no DBA (nothing to measure it on), said in one line."""
    import re

    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from embedder.hashing import file_sha256
    from embedder.runtime import OnnxEmbedder

    g = tmp_path / "unlabelled"
    g.mkdir()
    files = sorted((omniglot_root / "images_background").rglob("*.png"))[:260]
    for i, f in enumerate(files):
        (g / f"{i:03d}.png").symlink_to(f)
    m = onnx.load(str(small_onnx))
    w = {i.name: i for i in m.graph.initializer}

    def edit(name: str, change) -> None:
        a = numpy_helper.to_array(w[name]).copy()
        change(a)
        w[name].CopyFrom(numpy_helper.from_array(a, name))

    edit("backbone.body.8.weight", lambda k: k.__setitem__(0, -np.abs(k[0]) - 0.1))   # of ReLU'd inputs: <= 0
    edit("backbone.body.12.weight", lambda k: k.__setitem__((slice(None), 0), 1e4))
    m.graph.output.append(onnx.helper.make_tensor_value_info("view", onnx.TensorProto.FLOAT, None))
    x = np.stack([OnnxEmbedder(small_onnx, device="cpu").prepare(f) for f in files[:64]])
    pooled = ort.InferenceSession(m.SerializeToString()).run(["view"], {"x": x})[0].mean(0)
    edit("head.bias", lambda b: b.__setitem__(slice(None), -numpy_helper.to_array(w["head.weight"]) @ pooled))
    m.graph.output.pop()
    bad = tmp_path / "bad.onnx"
    onnx.save(m, str(bad))

    out = tmp_path / "idx"
    p = run_cli("build", g, "--model", bad, "--out", out, "--quiet")
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 3 and "correcting the int8 convolutions' biases" in lines[0], p.stderr
    assert lines[1].startswith(f"indexer build: fp32 embedder: {bad}: the int8 model's embeddings differ "
                               "from fp32") and lines[1].endswith("not written (--int8 insists)"), p.stderr
    assert float(re.search(r"mean cosine ([\d.]+)", lines[1]).group(1)) < 0.5      # far off, not a near miss
    assert lines[2] == ("indexer build: no DBA: a --model embedder's DBA is measured on the gallery's labels, "
                        "and it has none (--dba forces it)")
    man = json.loads((out / "manifest.json").read_text())
    assert man["count"] == 260 and man["model"]["hash"] == file_sha256(bad) and not man.get("neighbours")
    p = run_cli("build", g, "--model", bad, "--out", tmp_path / "asked", "--int8", "--quiet", check=False)
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith("indexer build: error: ")
    assert "not written" in p.stderr and not (tmp_path / "asked" / "manifest.json").exists()


def test_a_rebuild_counts_the_stored_files_gone_from_the_gallery_and_prune_drops_them(
        tmp_path: Path, omniglot_paths: list[Path], small_onnx: Path) -> None:
    """Photos deleted from the gallery stayed searchable after a rebuild without a word (a rebuild
    keeps what `add` brought from other folders too): now one line counts them, `--prune` drops
    them."""
    g = three_classes(tmp_path / "g", omniglot_paths)
    out = tmp_path / "idx"
    run_cli("build", g, "--model", small_onnx, "--out", out, "--quiet")
    gone = sorted(g.rglob("*.png"))[:2]
    for f in gone:
        f.unlink()
    kept = run_cli("build", g, "--model", small_onnx, "--out", out, "--quiet")
    assert "indexer build: 2 stored files are not in" in kept.stderr and "--prune drops them" in kept.stderr
    assert json.loads((out / "manifest.json").read_text())["count"] == 12
    pruned = run_cli("build", g, "--model", small_onnx, "--out", out, "--quiet", "--prune")
    assert "2 stored files not in" in pruned.stdout and "dropped (--prune)" in pruned.stdout
    m = json.loads((out / "manifest.json").read_text())
    assert m["count"] == 10 and m["ingest"]["pruned"] == 2
    from indexer import GalleryStore

    with GalleryStore(out / "store.lmdb") as st:
        assert all(st.id_for_path(f.relative_to(g).as_posix()) is None for f in gone) and len(st) == 10
    again = run_cli("build", g, "--model", small_onnx, "--out", out, "--quiet")
    assert "stored files" not in again.stderr + again.stdout


def test_prune_reaches_a_merged_index_through_its_shards(tmp_path: Path, omniglot_paths: list[Path],
                                                          small_onnx: Path) -> None:
    """`--prune` was refused for `--shard` and `--ray` builds ("a merge keeps what its shards
    hold"), so a sharded gallery kept its deleted photos for good. Now a shard's build --prune
    drops its own; the merge counts what no shard holds any more, and `merge --prune` drops it."""
    g = three_classes(tmp_path / "g", omniglot_paths)
    shards = [tmp_path / "s0", tmp_path / "s1"]

    def shard_builds(*flags: str) -> None:
        for i, s in enumerate(shards):
            run_cli("build", g, "--model", small_onnx, "--out", s, "--shard", f"{i}/2", "--quiet", *flags)

    def merge(*flags: str, check: bool = True):
        return run_cli("merge", *shards, "--out", tmp_path / "m", "--no-dba", "--quiet", *flags, check=check)

    def merged() -> dict:
        return json.loads((tmp_path / "m" / "manifest.json").read_text())

    shard_builds()
    first = run_cli("merge", *shards, "--out", tmp_path / "m", "--no-dba")       # with its progress bars
    assert re.search(r"copying the shards' images: 100%\|\S+\| 12/12 ", first.stderr), first.stderr[-300:]
    gone = sorted(g.rglob("*.png"))[:3]
    for f in gone:
        f.unlink()
    shard_builds()                                   # the shards keep (and count) their deleted files
    kept = merge()
    assert "indexer merge: 3 stored files are not in the gallery or its shards any more" in kept.stderr
    assert merged()["count"] == 12 and merged()["ingest"]["absent"] == 3
    shard_builds("--prune")                          # each shard drops its own
    assert sum(json.loads((s / "manifest.json").read_text())["ingest"]["pruned"] for s in shards) == 3
    again = merge()                                  # the merged store's copies: kept, counted
    assert again.stderr.count("3 stored files") == 1 and "dropped" not in again.stdout
    assert merged()["count"] == 12 and "pruned" not in merged()["ingest"]
    pruned = merge("--prune")
    assert "indexer merge: 3 stored files not in the gallery or its shards any more: dropped (--prune)" in pruned.stdout
    assert merged()["count"] == 9 and merged()["ingest"]["pruned"] == 3
    from indexer import GalleryStore

    with GalleryStore(tmp_path / "m" / "store.lmdb") as st:
        assert all(st.id_for_path(f.relative_to(g).as_posix()) is None for f in gone) and len(st) == 9
    refused = merge("--prune", "--sharded", check=False)
    assert refused.returncode == 2 and "--prune with --sharded" in refused.stderr


def test_a_rebuild_that_changes_nothing_keeps_the_chosen_index(tmp_path: Path, omniglot_paths: list[Path],
                                                               small_onnx: Path) -> None:
    """Choosing the index type measures every candidate (a rebuild of 25k photos that changed
    nothing: 77-86 s, 31-37 s kept): the same images, model and options keep index.faiss; anything
    else (other options, an `add` since that rewrote index.faiss) chooses again."""
    g = three_classes(tmp_path / "g", omniglot_paths)
    out = tmp_path / "idx"

    def build(*extra: str) -> tuple[str, dict]:
        p = run_cli("build", g, "--model", small_onnx, "--out", out, "--quiet", *extra)
        return p.stdout, json.loads((out / "manifest.json").read_text())

    first, m1 = build()
    files = sorted(g.rglob("*.png"))
    for f in files:                       # a copied or remounted gallery: new times, same content
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    again, m2 = build()
    assert "kept: chosen" not in first and f"kept: chosen {m1['selected_at'][:19]}Z" in again, again
    assert "12 files: 0 new, 12 unchanged" in again and m2["selected_for"] == m1["selected_for"]
    assert m2["index_file"] == m1["index_file"]
    with GalleryStore(out / STORE_DIR) as store:          # the new times recorded: not hashed again
        snap = store.snapshot(m2["model"]["hash"], [f.relative_to(g).as_posix() for f in files])
        assert sorted(v[2] for v in snap.paths.values()) == sorted(f.stat().st_mtime_ns for f in files)
    other, m3 = build("--target-recall", "0.9")
    assert "kept" not in other and m3["selected_for"] != m1["selected_for"] and m3["target_recall"] == 0.9
    extra = tmp_path / "more" / "c0"
    extra.mkdir(parents=True)
    shutil.copy(omniglot_paths[20], extra / "new.png")
    run_cli("add", tmp_path / "more", "--index", out, "--prefix", "more", "--quiet")
    run_cli("remove", "more/c0/new.png", "--index", out)       # the same ids as before the add again
    same, _ = build("--target-recall", "0.9")
    assert "kept: chosen" in same
    run_cli("add", tmp_path / "more", "--index", out, "--prefix", "more", "--quiet")
    grown, m4 = build("--target-recall", "0.9", "--prune")
    assert "kept" not in grown and m4["count"] == 12


def test_a_class_folder_renamed_is_relabelled_by_a_rebuild(tmp_path: Path, omniglot_paths: list[Path],
                                                            small_onnx: Path) -> None:
    """Rename dogs/ to Dogs/ and rebuild: the same images under new paths. Until 2026-11-30 the
    old paths stayed (as "absent", kept) and search kept showing "dogs/..." under the old label;
    now a stored path whose image the walk found elsewhere is dropped as moved. A deleted file
    stays counted as absent, kept; nothing is embedded and the chosen index is kept."""
    g = three_classes(tmp_path / "g", omniglot_paths)
    out = tmp_path / "idx"
    run_cli("build", g, "--model", small_onnx, "--out", out, "--quiet")
    (g / "c0").rename(g / "renamed")
    (g / "c1" / "01.png").unlink()
    p = run_cli("build", g, "--model", small_onnx, "--out", out, "--quiet")
    assert "11 files: 0 new, 7 unchanged, 4 duplicate content" not in p.stdout
    assert "11 files: 0 new, 7 unchanged, 0 duplicate content, 0 skipped; 0 embedded" in p.stdout, p.stdout
    assert "4 stored files were moved or renamed" in p.stdout and "kept: chosen" in p.stdout
    assert "1 stored files are not in" in p.stderr, p.stderr
    ingest = json.loads((out / "manifest.json").read_text())["ingest"]
    assert (ingest["moved"], ingest["absent"]) == (4, 1)
    with GalleryStore(out / STORE_DIR) as store:
        assert sorted(store.labels()) == ["c1", "c2", "renamed"]
        assert sorted(store.paths_under("renamed/")) == [f"renamed/{i:02d}.png" for i in (0, 3, 6, 9)]
        assert store.paths_under("c0/") == [] and store.id_for_path("c1/01.png") is not None
    assert check_counts(out).ok


def test_eval_per_label_recall(built_index: Path, tmp_path: Path) -> None:
    """Each label's Recall@1 (`--per-label`, JSON `per_label`): the labels' share of the R@1 of
    the same searches, the five weakest printed, every label in the CSV weakest first."""
    import csv

    out = tmp_path / "labels.csv"
    p = run_cli("eval", "--leave-one-out", "--index", built_index, "-k", "1", "--per-label", out)
    res = json.loads(run_cli("eval", "--leave-one-out", "--index", built_index, "-k", "1", "--json").stdout)
    idx = Index.open(built_index)
    ids = [i for lab in idx.labels() for i in idx.ids_for_label(lab)]
    _, nn = idx.search_embeddings(idx.embeddings(ids), 1, exclude=ids)     # the eval's own search
    got: dict[str, list[bool]] = {}
    for i, n in zip(ids, nn[:, 0]):
        lab = idx.meta(i)["label"]
        got.setdefault(lab, []).append(idx.meta(int(n))["label"] == lab)
    assert res["per_label"] == {lab: {"queries": 20, "recall@1": float(np.mean(v))} for lab, v in got.items()}
    assert sum(v["recall@1"] * v["queries"] for v in res["per_label"].values()) / 240 == \
        pytest.approx(res["recall"]["1"], abs=1e-12)
    with out.open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["label"] for r in rows] == sorted(got, key=lambda lab: (np.mean(got[lab]), lab))
    with Image.open(out.with_suffix(".png")) as png:          # the figure beside the table
        assert png.format == "PNG" and png.width > 300 and png.height > 200
    weakest = rows[0]
    assert f"Weakest labels at Recall@1 (of 12): {weakest['label']} {float(weakest['recall@1']):.2f} (20)" in p.stdout
    bad = run_cli("eval", "--leave-one-out", "--index", built_index, "--per-label", tmp_path / "x.txt", check=False)
    assert bad.returncode != 0 and "expected a .csv file" in bad.stderr
