"""`indexer build` over a gallery holding images too large to decode within the memory budget:
they are skipped and reported with the reason, the rest (large uncompressed files included,
decoded a strip at a time) is indexed, and the build exits 0. The indexer's decode threads call
the same ``load_image(min_side=...)`` as the server, so the budget is lowered through the
environment (DAS_DECODE_BUDGET_MB=2) to let 1.5-megapixel photos stand in for 36-megapixel ones."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from indexer import GalleryStore
from indexer_testlib import copy_characters, run_cli


def test_build_skips_over_budget_images_and_indexes_the_rest(tmp_path: Path, omniglot_root: Path,
                                                             small_onnx: Path):
    from skimage import data

    gallery = tmp_path / "gallery"
    copy_characters(omniglot_root, gallery, 2)                        # 40 ordinary images
    big = gallery / "big"
    big.mkdir()
    photo = Image.fromarray(data.astronaut()).resize((1500, 1000), Image.BICUBIC)
    rgba = photo.copy()
    rgba.putalpha(Image.fromarray((np.add.outer(np.arange(1000), np.arange(1500)) % 256).astype(np.uint8)))
    rgba.save(big / "rgba.png")                  # 6 MB frame: over a 2 MB budget
    photo.save(big / "photo.webp")               # 24 MB by WebP's measured cost: over
    photo.save(big / "photo.bmp")                # uncompressed: read in strips, never whole
    photo.quantize(256).save(big / "palette.png")   # 1.5 MB frame: within
    out = tmp_path / "idx"
    p = run_cli("build", gallery, "--model", small_onnx, "--out", out, "--quiet",
                env={"DAS_DECODE_BUDGET_MB": "2"})
    assert "42 new" in p.stdout and "2 skipped" in p.stdout, p.stdout
    report = {r["path"]: r["reason"] for r in map(json.loads, (out / "report.jsonl").read_text().splitlines())}
    assert set(report) == {"big/rgba.png", "big/photo.webp"}, report
    for path, reason in report.items():
        assert "image too large to decode within the memory budget: 1500x1000" in reason, reason
        assert "the decode budget is 2 MB" in reason
    with GalleryStore(out / "store.lmdb") as st:
        assert st.id_for_path("big/photo.bmp") is not None and st.id_for_path("big/palette.png") is not None
    assert run_cli("info", "--index", out).returncode == 0


def test_build_skips_an_icon_wrapping_a_huge_png_named_png(tmp_path: Path, omniglot_root: Path, small_onnx: Path):
    """Issue 28: four 140 KB ICO files named .png whose directory says 256x256 around a
    12000x12000 PNG (Pillow's ICO plugin decodes its frame inside Image.open: 550 MB each) are
    skipped with the reason, from the headers; the rest is indexed and the build exits 0."""
    from benchmarks.inputs.container_files import ico_around, png_rows

    gallery = tmp_path / "gallery"
    copy_characters(omniglot_root, gallery, 1)                        # 20 ordinary images
    (gallery / "icons").mkdir()
    icon = ico_around(png_rows(12000, 12000))
    for i in range(4):
        (gallery / "icons" / f"icon{i}.png").write_bytes(icon)
    out = tmp_path / "idx"
    p = run_cli("build", gallery, "--model", small_onnx, "--out", out, "--quiet")
    assert p.returncode == 0 and "20 new" in p.stdout and "4 skipped" in p.stdout, p.stdout + p.stderr
    report = {r["path"]: r["reason"] for r in map(json.loads, (out / "report.jsonl").read_text().splitlines())}
    assert set(report) == {f"icons/icon{i}.png" for i in range(4)}, report
    for reason in report.values():
        assert reason.startswith("ICO frame is a 12000x12000 PNG but the icon's directory says 256x256"), reason


def test_a_90_megapixel_photo_is_indexed_and_a_196_megapixel_png_skipped(tmp_path: Path, omniglot_root: Path,
                                                                          small_onnx: Path):
    """108 MP phone photos and panoramas were skipped as "possible decompression bombs" (the 64 MP
    cap of a full decode), with Pillow's own DecompressionBombWarning on stderr. A gallery's files
    are decoded small within the decode budget (a JPEG drafted at 1/8): up to Pillow's own refusal
    (179 MP) they are indexed; above it, one reason in the report; no warning either way."""
    gallery = tmp_path / "gallery"
    copy_characters(omniglot_root, gallery, 1)                        # 20 ordinary images
    (gallery / "big").mkdir()
    Image.new("L", (10000, 9000), 90).save(gallery / "big" / "pano.jpg", quality=30)   # 90 MP: Pillow warns
    Image.new("1", (14000, 14000)).save(gallery / "big" / "bomb.png")                  # 196 MP in a few kB
    out = tmp_path / "idx"
    p = run_cli("build", gallery, "--model", small_onnx, "--out", out, "--quiet",
                env={"PYTHONWARNINGS": "default"})         # a subprocess, every warning shown
    assert "21 new" in p.stdout and "1 skipped" in p.stdout, p.stdout + p.stderr
    assert "Warning" not in p.stderr, p.stderr
    report = {r["path"]: r["reason"] for r in map(json.loads, (out / "report.jsonl").read_text().splitlines())}
    assert list(report) == ["big/bomb.png"]
    assert "196000000 pixels exceeds the limit of 178956970" in report["big/bomb.png"]
    with GalleryStore(out / "store.lmdb") as st:
        assert st.id_for_path("big/pano.jpg") is not None
    q = run_cli("search", gallery / "big" / "pano.jpg", "--index", out, "-k", "1")   # as a query file too
    assert "big/pano.jpg" in q.stdout, q.stdout
