"""load_image on real photos turned into every kind of awkward file."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from embedder.images import DEFAULT_MAX_PIXELS, ImageLoadError, load_image


@pytest.fixture(scope="module")
def photo(photo_paths: list[Path]) -> Image.Image:
    with Image.open(photo_paths[0]) as im:  # astronaut, 512x512 RGB
        return im.convert("RGB").resize((96, 64))


def _expect_error(source, fragment: str, **kw) -> ImageLoadError:
    with pytest.raises(ImageLoadError) as info:
        load_image(source, **kw)
    err = info.value
    assert fragment in err.reason
    assert str(err) == f"{err.path}: {err.reason}"
    return err


def test_real_photo_and_omniglot_modes(photo_paths, omniglot_paths):
    img = load_image(photo_paths[0])
    assert img.mode == "RGB" and img.size == (512, 512)
    glyph = load_image(omniglot_paths[0], mode="L")  # 1-bit PNG
    a = np.asarray(glyph)
    assert glyph.mode == "L" and a.shape == (105, 105)
    assert set(np.unique(a)) == {0, 255}  # strokes black, paper white, nothing clipped away


def test_truncated_file(tmp_path, photo_paths):
    data = Path(photo_paths[0]).read_bytes()
    bad = tmp_path / "truncated.png"
    bad.write_bytes(data[: len(data) // 2])
    err = _expect_error(bad, "truncated or corrupt")
    assert err.path == str(bad)


def test_empty_missing_directory_and_text(tmp_path):
    (tmp_path / "empty.jpg").write_bytes(b"")
    _expect_error(tmp_path / "empty.jpg", "empty file")
    _expect_error(b"", "empty file")
    _expect_error(tmp_path / "nope.png", "file not found")
    _expect_error(tmp_path, "is a directory")
    txt = tmp_path / "notes.jpg"
    txt.write_text("this is not a jpeg\n" * 20)
    _expect_error(txt, "not an image")
    err = _expect_error(b"plain text bytes", "not an image", name="upload.jpg")
    assert err.path == "upload.jpg"


def test_rgba_composited_on_white(tmp_path, photo):
    rgba = photo.convert("RGBA")
    alpha = np.full(rgba.size[::-1], 255, np.uint8)
    alpha[:, :48] = 0  # left half fully transparent
    rgba.putalpha(Image.fromarray(alpha))
    path = tmp_path / "transparent.png"
    rgba.save(path)
    out = np.asarray(load_image(path))
    assert out.shape == (64, 96, 3)
    assert (out[:, :48] == 255).all()  # white, not the black a bare convert("RGB") gives
    np.testing.assert_array_equal(out[:, 48:], np.asarray(photo)[:, 48:])
    la = np.asarray(load_image(rgba.convert("LA"), mode="L"))
    assert (la[:, :48] == 255).all()


def test_cmyk_jpeg(tmp_path, photo):
    path = tmp_path / "cmyk.jpg"
    photo.convert("CMYK").save(path, quality=95)
    with Image.open(path) as im:
        assert im.mode == "CMYK"
    out = np.asarray(load_image(path)).astype(float)
    assert out.shape == (64, 96, 3)
    assert np.abs(out - np.asarray(photo, float)).mean() < 12  # same picture, JPEG noise aside


def test_16bit_scaled_not_clipped(tmp_path, photo):
    gray8 = np.asarray(photo.convert("L"))
    gray16 = gray8.astype(np.uint16) * 257  # full 16-bit range
    path = tmp_path / "deep.png"
    Image.fromarray(gray16).save(path)
    with Image.open(path) as im:
        assert im.mode.startswith("I")
    out = np.asarray(load_image(path, mode="L"))
    np.testing.assert_array_equal(out, gray8)  # clipping would have made it all 255
    rgb = np.asarray(load_image(path))
    assert rgb.shape == (64, 96, 3) and (rgb[..., 0] == gray8).all()


def test_float_and_int32_modes(photo):
    gray = np.asarray(photo.convert("L"))
    f = Image.fromarray(gray.astype(np.float32) / 255.0, mode="F")
    np.testing.assert_allclose(np.asarray(load_image(f, mode="L")), gray, atol=1)
    i = Image.fromarray(gray.astype(np.int32) * 257, mode="I")
    np.testing.assert_array_equal(np.asarray(load_image(i, mode="L")), gray)


def test_exif_rotation_applied(tmp_path, photo):
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW to display
    photo.save(path, exif=exif, quality=95)
    with Image.open(path) as raw:
        assert raw.size == (96, 64)
    out = load_image(path)
    assert out.size == (64, 96)
    expected = np.asarray(photo.transpose(Image.Transpose.ROTATE_270), float)
    assert np.abs(np.asarray(out, float) - expected).mean() < 8


def test_pixel_limit_checked_from_header(tmp_path):
    # 20000 x 20000 1-bit PNG: tiny on disk, 400 M pixels once decoded.
    path = tmp_path / "bomb.png"
    Image.new("1", (20000, 20000)).save(path)
    assert path.stat().st_size < 200_000
    err = _expect_error(path, "exceeds the limit")
    assert str(DEFAULT_MAX_PIXELS) in err.reason and "400000000" in err.reason
    # below PIL's own limit, our header check is what refuses it
    small = tmp_path / "wide.png"
    Image.new("1", (5000, 5000)).save(small)
    _expect_error(small, "5000x5000 = 25000000 pixels exceeds the limit of 1000000", max_pixels=1_000_000)
    assert load_image(small, mode="L", max_pixels=None).size == (5000, 5000)
    _expect_error(path.read_bytes(), "exceeds the limit", max_pixels=1000, name="bomb-bytes")


def test_sources_agree_and_palette(tmp_path, photo_paths, photo):
    p = photo_paths[1]
    a = np.asarray(load_image(p))
    np.testing.assert_array_equal(a, np.asarray(load_image(Path(p).read_bytes())))
    with Image.open(p) as im:
        np.testing.assert_array_equal(a, np.asarray(load_image(im)))
    pal = photo.convert("P", palette=Image.Palette.ADAPTIVE)
    assert load_image(pal).mode == "RGB"
    with pytest.raises(ValueError, match="mode must be one of"):
        load_image(p, mode="CMYK")


def test_labels_in_latin_greek_and_cyrillic_scripts_are_drawn_not_boxed() -> None:
    """Contact sheets and the probe grid draw labels with `label_font`: Pillow's default font drew
    "été" as boxes (its .notdef glyph, what U+FFFF gets) until 2026-11-30."""
    from PIL import ImageDraw

    from embedder.images import label_font

    def glyph(c: str) -> bytes:
        im = Image.new("L", (40, 20))
        ImageDraw.Draw(im).text((2, 2), c, font=label_font(10), fill=255)
        return im.tobytes()

    notdef = glyph("\uffff")
    assert any(notdef) and [c for c in "aéüßжωñç" if glyph(c) == notdef] == []


def test_cjk_labels_are_drawn_in_an_installed_font_and_wrapped_by_width(tmp_path: Path, photo_paths) -> None:
    """Class folders named in Chinese or Japanese came out as rows of identical boxes (DejaVu has no
    CJK glyphs, Pillow no font fallback). `.ci/run` installs a CJK font (fonts-wqy-microhei); the
    audit's contact sheets wrap captions by pixels, so two-pixel-wide characters stay under their
    thumbnail."""
    from PIL import ImageDraw

    from ci_gate import skip_or_fail
    from embedder.images import label_font
    from indexer.audit.report import THUMB, _wrap, contact_sheet

    if label_font(10, "鳥").path == label_font(10).path:
        skip_or_fail("no installed font holds CJK characters (Debian: apt-get install fonts-wqy-microhei)")

    def glyph(c: str) -> bytes:
        im = Image.new("L", (40, 20))
        ImageDraw.Draw(im).text((2, 2), c, font=label_font(10, c), fill=255)
        return im.tobytes()

    drawn = {c: glyph(c) for c in "鳥類猫犬花"}
    assert glyph("\uffff") not in drawn.values() and len(set(drawn.values())) == 5
    assert label_font(10, "Vögel").path == label_font(10).path       # Latin labels keep DejaVu

    caption = "鳥類の写真とその近傍の画像です"                          # 15 characters, ~150 px at 10 px
    font = label_font(10, caption)
    lines = _wrap(caption, font, THUMB)
    assert "".join(lines) == caption and len(lines) == 2
    assert max(font.getlength(line) for line in lines) <= THUMB
    sheet = tmp_path / "sheet.png"
    assert contact_sheet(sheet, [[(photo_paths[0].read_bytes(), caption)]], "近重複 near-duplicates")
    assert Image.open(sheet).size[0] > THUMB
