"""Bad input: bad files are skipped with a reason; bad setups stop with one line and exit 1."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import faiss
import numpy as np
import pytest
from PIL import Image

from indexer_testlib import copy_characters, run_cli
from embedder import OnnxEmbedder
from indexer import GalleryStore
from indexer.directory.index_dir import STORE_DIR


def _one_line_error(p, *needles: str) -> None:
    assert p.returncode == 1, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture()
def bad_gallery(tmp_path: Path, omniglot_root: Path, photo_paths: list[Path]) -> tuple[Path, dict]:
    g = tmp_path / "gallery"
    copy_characters(omniglot_root, g, 2, per_char=8)
    bad = g / "bad"
    bad.mkdir()
    real_png = next(g.rglob("*.png")).read_bytes()
    jpg = next(p for p in photo_paths if p.suffix == ".jpg").read_bytes()
    corrupt = bytearray(real_png)                                   # valid header, scrambled data
    corrupt[60:-12] = bytes(b ^ 0x5A for b in corrupt[60:-12])
    (bad / "corrupt.png").write_bytes(bytes(corrupt))
    (bad / "garbage.gif").write_bytes(os.urandom(500))
    (bad / "truncated.jpg").write_bytes(jpg[: len(jpg) // 3])
    (bad / "empty.PNG").write_bytes(b"")
    (bad / "notes.jpeg").write_text("this is not an image\n")
    (bad / "folder.jpg").mkdir()
    (bad / "dangling.webp").symlink_to(bad / "does-not-exist.webp")
    Image.new("1", (14000, 14000)).save(bad / "bomb.png")          # 196 Mpx in a few kB
    (bad / "readme.txt").write_text("not an image name: ignored, not reported")
    # a phone photo that is not one; photo formats the decoder does not open, reported by name
    (bad / "IMG_0001.HEIC").write_bytes(b"\x00\x00\x00\x18ftypheic" + os.urandom(200))
    (bad / "DSC_0002.NEF").write_bytes(b"MM\x00*" + os.urandom(200))
    (bad / "photo.jxl").write_bytes(b"\xff\x0a" + os.urandom(200))
    # JPEG's other names are indexed like .jpg, and so is a JPEG named .heic (three more photos)
    other = g / "other-names"
    other.mkdir()
    pngs = [p for p in photo_paths if p.suffix == ".png"]
    Image.open(pngs[0]).convert("RGB").save(other / "download.jfif", "JPEG")
    Image.open(pngs[1]).convert("RGB").save(other / "scan.JPE", "JPEG")
    Image.open(pngs[2]).convert("RGB").save(other / "converted.heic", "JPEG")   # by content: a JPEG
    reasons = {"bad/corrupt.png": "corrupt", "bad/garbage.gif": "not an image",
               "bad/truncated.jpg": "truncated",
               "bad/empty.PNG": "empty", "bad/notes.jpeg": "not an image",
               "bad/folder.jpg": "directory", "bad/dangling.webp": "dangling",
               "bad/bomb.png": "decompression bomb", "bad/IMG_0001.HEIC": "not an image",
               "bad/DSC_0002.NEF": "camera raw", "bad/photo.jxl": "jpeg xl"}
    return g, reasons


def test_bad_files_are_skipped_with_reasons(tmp_path: Path, bad_gallery: tuple[Path, dict],
                                            small_onnx: Path) -> None:
    g, reasons = bad_gallery
    out = tmp_path / "idx"
    p = run_cli("build", g, "--model", small_onnx, "--out", out, "--quiet")
    assert "19 new" in p.stdout and f"{len(reasons)} skipped" in p.stdout
    report = [json.loads(line) for line in (out / "report.jsonl").read_text().splitlines()]
    got = {r["path"]: r["reason"] for r in report}
    assert set(got) == set(reasons)                 # readme.txt passed over, not reported
    for path, word in reasons.items():
        assert word in got[path].lower(), (path, got[path])
    assert "convert it to JPEG" in got["bad/DSC_0002.NEF"]
    # the same photo as a query: one line that says what it is
    _one_line_error(run_cli("search", g / "bad" / "DSC_0002.NEF", "--index", out, check=False),
                    "DSC_0002.NEF", "camera raw file")
    m = json.loads((out / "manifest.json").read_text())
    assert m["count"] == 19 and m["ingest"]["skipped"] == len(reasons)
    with GalleryStore(out / STORE_DIR) as store:     # the .jfif, .JPE and JPEG .heic are in the index
        assert all(store.id_for_path(f"other-names/{n}") is not None
                   for n in ("download.jfif", "scan.JPE", "converted.heic"))


def test_gallery_of_only_bad_files_fails_cleanly(tmp_path: Path, bad_gallery: tuple[Path, dict],
                                                 small_onnx: Path) -> None:
    g, _ = bad_gallery
    only_bad = tmp_path / "only-bad"
    shutil.move(str(g / "bad"), only_bad)
    p = run_cli("build", only_bad, "--model", small_onnx, "--out", tmp_path / "idx", "--quiet",
                check=False)
    _one_line_error(p, "no image could be indexed", "report.jsonl")


def test_empty_gallery_and_missing_model(tmp_path: Path, small_onnx: Path) -> None:
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "sub" / "notes.txt").write_text("no images here")
    _one_line_error(run_cli("build", empty, "--model", small_onnx, "--out", tmp_path / "i", check=False),
                    "empty gallery", str(empty))
    _one_line_error(run_cli("build", tmp_path / "nope", "--model", small_onnx, check=False), "not found")
    g = tmp_path / "g"
    g.mkdir()
    Image.new("RGB", (32, 32), "red").save(g / "red.png")
    _one_line_error(run_cli("build", g, "--model", tmp_path / "missing.onnx", "--out", tmp_path / "i",
                            check=False), "missing.onnx", "not found")
    (tmp_path / "garbage.onnx").write_bytes(b"not onnx")
    _one_line_error(run_cli("build", g, "--model", tmp_path / "garbage.onnx", "--out", tmp_path / "i",
                            check=False), "garbage.onnx")
    _one_line_error(run_cli("search", g / "red.png", "--index", tmp_path / "no-index", check=False),
                    "no index here")
    _one_line_error(run_cli("build", g, "--model", small_onnx, "--shard", "2/2", check=False), "--shard")


def _variant(src: Path, dst: Path, **meta: str) -> Path:
    """The same network with changed metadata: a different model file (different hash)."""
    import onnx

    proto = onnx.load(str(src))
    for k, v in meta.items():
        for p in proto.metadata_props:
            if p.key == k:
                p.value = v
                break
        else:
            proto.metadata_props.add(key=k, value=v)
    onnx.save(proto, str(dst))
    return dst


def test_rebuild_with_another_model_counts_the_stored_images_it_embeds_again(
        tmp_path: Path, omniglot_root: Path, small_onnx: Path) -> None:
    """`indexer build` of the same gallery into the same index with another model (as the
    default does when a gallery grows past int8's 256 photos): the stored images are embedded
    again, and the summary line counts them (they are neither new nor unchanged)."""
    g = tmp_path / "g"
    copy_characters(omniglot_root, g, 1, per_char=10)
    out = tmp_path / "idx"
    first = run_cli("build", g, "--model", small_onnx, "--out", out, "--quiet").stdout
    assert "10 files: 10 new, 0 unchanged, 0 duplicate content, 0 skipped; 10 embedded" in first, first
    other = _variant(small_onnx, tmp_path / "other.onnx", source_hash="another-training-run")
    again = run_cli("build", g, "--model", other, "--out", out, "--quiet").stdout
    assert ("10 files: 0 new, 0 unchanged, 0 duplicate content, 0 skipped; 10 embedded (10 of them stored "
            "before: the model is another)") in again, again
    m = json.loads((out / "manifest.json").read_text())
    assert m["model"]["hash"] == OnnxEmbedder(other).model_hash and m["count"] == 10


def test_add_with_another_model_or_dimension_is_refused(tmp_path: Path, omniglot_root: Path,
                                                         small_onnx: Path) -> None:
    g = tmp_path / "g"
    copy_characters(omniglot_root, g, 1, per_char=10)
    more = tmp_path / "more"
    copy_characters(omniglot_root, more, 1, per_char=5, skip_chars=5)
    out = tmp_path / "idx"
    run_cli("build", g, "--model", small_onnx, "--out", out, "--quiet")
    other = _variant(small_onnx, tmp_path / "other.onnx", source_hash="another-training-run")
    _one_line_error(run_cli("add", more, "--index", out, "--model", other, "--quiet", check=False),
                    "other.onnx", "differs from the model this index was built with")
    # a model whose embeddings do not have the dimension it declares
    liar = _variant(small_onnx, tmp_path / "liar.onnx", dim="32")
    _one_line_error(run_cli("build", g, "--model", liar, "--out", tmp_path / "idx2", "--quiet",
                            check=False),
                    "liar.onnx", "dim 32")
    # an index file of another dimension in the directory
    wrong = faiss.IndexIDMap2(faiss.IndexFlatIP(32))
    wrong.add_with_ids(np.zeros((10, 32), np.float32), np.arange(10, dtype=np.int64))
    faiss.write_index(wrong, str(out / "index.faiss"))
    # the manifest's checksum of index.faiss notices first...
    _one_line_error(run_cli("search", next(g.rglob("*.png")), "--index", out, check=False),
                    "index.faiss", "indexer build")
    # ...and without one (a manifest from before checksums) the dimension check does
    m = json.loads((out / "manifest.json").read_text())
    del m["index_file"]
    (out / "manifest.json").write_text(json.dumps(m))
    _one_line_error(run_cli("search", next(g.rglob("*.png")), "--index", out, check=False),
                    "dimension mismatch")
    _one_line_error(run_cli("add", more, "--index", out, "--quiet", check=False), "dimension mismatch")


def test_every_command_has_help() -> None:
    for cmd in ("build", "add", "remove", "search", "eval", "info", "merge"):
        p = run_cli(cmd, "--help")
        assert p.stdout.startswith("usage: python -m indexer " + cmd)
    p = run_cli("search", check=False)
    assert p.returncode == 2 and "usage" in p.stderr


def test_another_gallery_into_an_index_of_a_folder_is_refused_unless_pruned(tmp_path: Path, omniglot_root: Path,
                                                                           small_onnx: Path) -> None:
    """`indexer build a/` then `indexer build b/` into the same index (both without --out): until
    2026-11-30 the second kept a's images, searchable under a's labels, with one line. Now it is
    refused in one line naming both; --prune replaces them; the first gallery moved elsewhere
    (its paths found under the new root) builds on, nothing embedded."""
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "idx"
    copy_characters(omniglot_root, a, 2, per_char=5)
    copy_characters(omniglot_root, b, 2, per_char=5, skip_chars=2)
    run_cli("build", a, "--model", small_onnx, "--out", out, "--quiet")
    p = run_cli("build", b, "--model", small_onnx, "--out", out, "--quiet", check=False)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith(
        f"indexer build: error: --out {out} holds an index of {a} (10 images, none found in {b})"), p.stderr
    assert json.loads((out / "manifest.json").read_text())["count"] == 10
    moved = tmp_path / "moved"
    a.rename(moved)
    p = run_cli("build", moved, "--model", small_onnx, "--out", out, "--quiet")
    assert "10 files: 0 new, 10 unchanged" in p.stdout and "0 embedded" in p.stdout, p.stdout
    p = run_cli("build", b, "--model", small_onnx, "--out", out, "--quiet", "--prune")
    assert "10 files: 10 new" in p.stdout and json.loads((out / "manifest.json").read_text())["count"] == 10
    with GalleryStore(out / STORE_DIR) as store:
        assert sorted(store.labels()) == sorted(str(d.relative_to(b)) for d in b.glob("*/*"))
