"""Phone photos: HEIC (iPhones' default; pillow-heif) and AVIF (Pillow's own plugin) are read like
JPEG, upright by the file's own rotation, inside the decode budget, and a gallery of them is
indexed and searched. Real Caltech photos (landscape) re-encoded, a real index, the shipped embedder."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from embedder import decode_budget
from embedder.containers import AVIF
from embedder.images import ImageTooLargeError, load_image
from indexer_testlib import run_cli

pytestmark = pytest.mark.skipif(not AVIF, reason="this Pillow has no AVIF plugin")
FORMATS = {"heic": {"quality": 85}, "avif": {"quality": 75}}


def _save(im: Image.Image, out: Path, **kw) -> Path:
    """HEIC through pillow-heif's own writer, so that what Pillow can open is the product's doing."""
    if out.suffix == ".heic":
        import pillow_heif

        pillow_heif.from_pillow(im).save(out, **kw)
    else:
        im.save(out, **kw)
    return out


def _sideways(src: Path, out: Path, **kw) -> Path:
    """``src`` stored turned a quarter (as a phone's sensor records it) with EXIF orientation 6,
    so a reader that honours the file's rotation shows it upright."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return _save(Image.open(src).convert("RGB").transpose(Image.Transpose.ROTATE_90), out, exif=exif.tobytes(), **kw)


@pytest.fixture(scope="module")
def phone(tmp_path_factory, caltech_root) -> dict:
    """gallery/: 3 categories x 4 photos, one each as JPEG, HEIC, AVIF and JPEG again; queries/: a
    fourth photo of each category re-encoded as HEIC and AVIF, upright and stored sideways."""
    tmp = tmp_path_factory.mktemp("phone")
    gallery, queries = tmp / "gallery", tmp / "queries"
    queries.mkdir()
    originals = {}
    for s in (caltech_root / name for name in ("Leopards", "Motorbikes", "airplanes")):
        (gallery / s.name).mkdir(parents=True)
        photos = sorted(s.glob("*.jpg"))[:4]
        for i, (f, ext) in enumerate(zip(photos, ("jpg", "heic", "avif", "jpg"))):
            target = gallery / s.name / f"{f.stem}.{ext}"
            if ext == "jpg":
                target.write_bytes(f.read_bytes())
            else:
                _save(Image.open(f).convert("RGB"), target, **FORMATS[ext])
        originals[s.name] = photos[3]
        for ext, kw in FORMATS.items():
            _save(Image.open(photos[3]).convert("RGB"), queries / f"{s.name}.{ext}", **kw)
            _sideways(photos[3], queries / f"{s.name}-sideways.{ext}", **kw)
    return {"gallery": gallery, "queries": queries, "originals": originals}


def test_phone_formats_decode_like_the_jpeg_and_upright(phone) -> None:
    for label, jpeg in phone["originals"].items():
        want = load_image(jpeg, min_side=256)
        for name in (f"{label}.heic", f"{label}.avif", f"{label}-sideways.heic", f"{label}-sideways.avif"):
            got = load_image(phone["queries"] / name, min_side=256)
            assert (got.size[0] > got.size[1]) == (want.size[0] > want.size[1]), name   # not turned
            diff = np.abs(np.asarray(got.resize(want.size), float) - np.asarray(want, float)).mean()
            assert diff < 8, (name, diff)      # compression only (a quarter turn differs by ~60)


def test_a_gallery_of_phone_photos_is_indexed_and_searched(phone, pretrained_onnx, tmp_path) -> None:
    out = tmp_path / "idx"
    p = run_cli("build", phone["gallery"], "--model", pretrained_onnx, "--no-dba", "--out", out, "--quiet")
    assert "12 new" in p.stdout and "0 skipped" in p.stdout, p.stdout
    res = tmp_path / "results.csv"
    run_cli("search", phone["queries"], "--index", out, "-k", "1", "--out", res, "--quiet")
    rows = [line.split(",") for line in res.read_text().splitlines()[1:]]
    assert len(rows) == 12
    for r in rows:      # query, rank, id, score, label, path: the category's own photos come first
        assert r[4] == r[0].split("-sideways")[0].rsplit(".", 1)[0] and float(r[3]) > 0.5, r


def test_a_phone_photo_over_the_budget_is_refused_from_its_header(phone, monkeypatch) -> None:
    """HEIC is charged 10 bytes a pixel (libheif's peak measured at 7.9 on a 12 MP photo): at a
    4 MB budget a 0.2 MP photo decodes, a 0.5 MP one is refused before libheif runs."""
    monkeypatch.setattr(decode_budget, "BUDGET", decode_budget.DecodeBudget(4 * 2 ** 20))
    small = phone["queries"] / f"{next(iter(phone['originals']))}.heic"
    assert load_image(small, min_side=64).size[0] > 0
    big = phone["queries"].parent / "big.heic"
    _save(load_image(small).resize((900, 600)), big, quality=80)
    with pytest.raises(ImageTooLargeError) as e:
        load_image(big, min_side=256)
    assert "HEIF" in str(e.value) and "accepted up to 0.4 MP" in str(e.value), str(e.value)


def test_batch_commands_read_what_a_server_refuses(tmp_path, small_onnx, phone) -> None:
    """`python -m indexer` (the user's own files) decodes within 512 MB, a server within 160: a
    45 MP picture (182 MB to decode, as a 24 MP phone HEIC needs 240) is refused by the server's
    budget, indexed by `indexer build`; DAS_DECODE_BUDGET_MB still chooses for both."""
    import os
    import subprocess
    import sys

    gallery = tmp_path / "gallery"
    (gallery / "big").mkdir(parents=True)
    big = gallery / "big" / "panorama.png"
    Image.new("RGB", (7000, 6500), (120, 90, 60)).save(big, compress_level=1)
    for f in sorted(phone["gallery"].rglob("*.jpg"))[:2]:
        (gallery / "big" / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ImageTooLargeError, match="decode budget is 160 MB"):
        load_image(big, min_side=256)                  # this process: the default (a server's)
    env = {k: v for k, v in os.environ.items() if k != "DAS_DECODE_BUDGET_MB"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    for budget, indexed in ((None, 3), ("160", 2)):
        out = tmp_path / f"idx-{budget}"
        run_env = env if budget is None else {**env, "DAS_DECODE_BUDGET_MB": budget}
        p = subprocess.run([sys.executable, "-m", "indexer", "build", str(gallery), "--model", str(small_onnx),
                            "--out", str(out), "--quiet"], capture_output=True, text=True, env=run_env, timeout=600)
        assert p.returncode == 0 and f"{indexed} new" in p.stdout, (p.stdout, p.stderr)
    # served with a server's budget: what the build indexed is still shown and searched by path
    from serving import Searcher

    searcher = Searcher.open([tmp_path / "idx-None"], names=["batch"])
    q = searcher.query(path="big/panorama.png")
    assert Image.open(io.BytesIO(searcher.thumbnail_png("batch", q.id))).size == (160, 149)
    assert min(searcher.query_image(q).size) >= searcher.decode_side
    res = searcher.search(q, k=2, thumbnails=True)        # the others, framed thumbnails included
    assert len(res.results) == 2 and all(r.thumbnail is not None for r in res.results)
