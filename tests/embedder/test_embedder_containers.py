"""Containers whose frame is another format, or whose frames may differ from what their header
says (issue 28): each is sized from the frame that is really decoded, before decoding, or
refused unopened.

The files are real ones made here: an ICO whose directory says 256x256 around a 12000x12000
PNG (written a row at a time, 140 KB; the frame never exists in the test), MPO, a GIF whose
logical screen is smaller than its first frame, APNG, animated WebP, JPEG-in-TIFF. No memory is
measured (that is ``benchmarks/embedder/decode_memory.py``): the tests pin what the decoder does, that a
refusal comes before any decoder runs.
"""
from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import IcoImagePlugin, Image, ImageFile

from benchmarks.inputs.container_files import ico_around, multi_frame, png_rows
from embedder import decode_budget, open_image
from embedder.images import ImageLoadError, ImageTooLargeError, load_image

MIN_SIDE = 160


@pytest.fixture(scope="module")
def lying_icon() -> bytes:
    return ico_around(png_rows(12000, 12000))


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    from skimage import data

    return Image.fromarray(data.astronaut()).resize((1500, 1000), Image.BICUBIC)


@pytest.fixture
def no_decoding(monkeypatch):
    """Any pixel decoder run (Pillow's ImageFile.load, which every plugin's load ends in, and
    the ICO plugin's own load, which its open calls) fails the test."""
    def refuse(self, *a, **k):
        raise AssertionError(f"{type(self).__name__}: pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)
    monkeypatch.setattr(IcoImagePlugin.IcoImageFile, "load", refuse)


def test_an_icon_around_a_huge_png_is_refused_before_decoding(lying_icon, no_decoding, tmp_path: Path):
    assert len(lying_icon) < 200_000
    gallery_file = tmp_path / "looks-like.png"                       # what `indexer build` meets
    gallery_file.write_bytes(lying_icon)
    for source, name in ((lying_icon, "icon.ico"), (gallery_file, None)):
        for min_side in (MIN_SIDE, None):                               # serving/indexing, training
            with pytest.raises(ImageLoadError) as e:
                load_image(source, name=name, min_side=min_side)
            msg = str(e.value)
            assert msg.startswith(f"{name or gallery_file}: ICO frame is a 12000x12000 PNG but the "
                                  "icon's directory says 256x256"), msg
            assert "refused before decoding" in msg and "\n" not in msg
    from indexer.store.reader import header_size                             # the indexer's header peek

    assert header_size(lying_icon) == (0, 0)


def test_truthful_icons_still_decode():
    small_png = Image.new("RGB", (48, 48), (200, 30, 30))
    for frame in ("PNG", "bitmap"):
        buf = io.BytesIO()
        small_png.save(buf, "ICO", sizes=[(48, 48)], bitmap_format="bmp" if frame == "bitmap" else "png")
        img = load_image(buf.getvalue(), name=f"{frame}.ico")
        assert img.size == (48, 48) and img.getpixel((5, 5)) == (200, 30, 30), frame
    # a PNG frame smaller than the directory says costs less than claimed: accepted
    assert load_image(ico_around(png_rows(100, 80)), name="small.ico").size == (100, 80)


@pytest.mark.parametrize("fmt", ["PPM", "TGA", "PCX", "SGI", "ICNS"])
def test_formats_nobody_measured_are_refused_unopened(fmt, no_decoding, monkeypatch):
    """Formats outside the accepted list are named (by Pillow's own sniffer) and refused before
    their plugin's open runs, so no unmeasured decoder (or Ghostscript for EPS) ever starts."""
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buf, fmt)
    Image.init()
    plugin = Image.OPEN[fmt][0]

    def opened(self, *a, **k):
        raise AssertionError(f"{fmt}: its plugin opened the file")

    monkeypatch.setattr(plugin, "_open", opened)
    with pytest.raises(ImageLoadError) as e:
        load_image(buf.getvalue(), name=f"x.{fmt.lower()}")
    named = (f"x.{fmt.lower()}: {fmt} image: not an accepted format (expected JPEG, PNG, WebP, HEIC, "
             "AVIF, GIF, BMP, TIFF or ICO); refused unopened")
    # TGA has no magic number, so no sniffer names it: refused all the same
    assert str(e.value) == (named if fmt != "TGA" else "x.tga: not an image (unrecognised format)")


def _mpo(photo: Image.Image) -> bytes:
    return multi_frame(photo, "MPO")


def _gif_with_small_screen(photo: Image.Image) -> bytes:
    """A GIF whose logical screen says 100x80 but whose first frame is 1500x1000."""
    buf = io.BytesIO()
    photo.quantize(256).save(buf, "GIF")
    data = bytearray(buf.getvalue())
    data[6:10] = struct.pack("<HH", 100, 80)
    return bytes(data)


def _apng(photo: Image.Image) -> bytes:
    return multi_frame(photo, "APNG")


def _animated_webp(photo: Image.Image) -> bytes:
    return multi_frame(photo, "WebP")


def _jpeg_tiff(photo: Image.Image) -> bytes:
    buf = io.BytesIO()
    photo.save(buf, "TIFF", compression="jpeg", save_all=True, append_images=[photo.resize((150, 100))])
    return buf.getvalue()


CONTAINERS = {"MPO": _mpo, "GIF small screen": _gif_with_small_screen, "APNG": _apng,
              "animated WebP": _animated_webp, "JPEG-in-TIFF": _jpeg_tiff}


@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_containers_are_sized_by_the_frame_that_is_decoded(photo, kind):
    """What the decode budget reads (the opened, not yet loaded image) is the size of the frame
    the decoder then produces: the first frame, 1500x1000, whatever else the file holds."""
    data = CONTAINERS[kind](photo)
    with open_image(io.BytesIO(data)) as im:
        assert im.size == (1500, 1000), (kind, im.size)
        if kind != "JPEG-in-TIFF":
            assert getattr(im, "n_frames", 1) == 2 or kind == "GIF small screen", kind
    assert load_image(data, name=kind).size == (1500, 1000)
    img = load_image(data, name=kind, min_side=MIN_SIDE)
    assert MIN_SIDE <= min(img.size) < 2 * MIN_SIDE and img.size[0] > img.size[1]


@pytest.mark.parametrize("kind", [k for k in CONTAINERS if k != "MPO"])
def test_over_budget_containers_are_refused_before_decoding(photo, kind, monkeypatch):
    """Under a 1 MB budget the 1500x1000 first frame is refused from the header (a GIF from its
    frame, not its 100x80 screen), and no decoder ran."""
    monkeypatch.setattr(decode_budget.BUDGET, "capacity", 2 ** 20)
    data = CONTAINERS[kind](photo)

    def refuse(self, *a, **k):
        raise AssertionError(f"{kind}: pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)
    with pytest.raises(ImageTooLargeError, match=r"image too large to decode within the memory budget: 1500x1000"):
        load_image(data, name=kind, min_side=MIN_SIDE)


def test_mpo_is_decoded_small_like_jpeg(photo, monkeypatch):
    """An MPO's first frame is a JPEG: it takes the JPEG path (DCT scaling while decoding), so a
    1 MB budget that refuses the 6 MB full frame is no obstacle, and the pixels are the JPEG's."""
    monkeypatch.setattr(decode_budget.BUDGET, "capacity", 2 ** 20)
    data = _mpo(photo)
    img = load_image(data, name="x.mpo", min_side=MIN_SIDE)
    assert MIN_SIDE <= min(img.size) < 2 * MIN_SIDE
    first = io.BytesIO()
    photo.save(first, "JPEG", quality=90)
    ref = load_image(first.getvalue(), min_side=MIN_SIDE)
    assert img.size == ref.size
    assert np.abs(np.asarray(img, float) - np.asarray(ref, float)).mean() < 1.0
