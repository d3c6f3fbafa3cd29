"""A region query (``box=``) decodes the image no larger than the box needs, within the decode
budget: real JPEG / WebP files, EXIF rotation, the server's upload path. Until 2026-11-30 a box
made the server decode the upload whole, outside the budget (+426 MB for a 90 KB WebP)."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from embedder.images import load_image
from embedder.regions import Box, crop, load_region


@pytest.fixture(scope="module")
def photo(photo_paths) -> Image.Image:
    with Image.open(photo_paths[0]) as im:            # astronaut, 512x512 RGB
        return im.convert("RGB")


def _diff(a: Image.Image, b: Image.Image) -> float:
    assert a.size == b.size, (a.size, b.size)
    return float(np.abs(np.asarray(a, float) - np.asarray(b, float)).mean())


def test_a_box_of_a_large_jpeg_is_decoded_reduced_and_shows_the_same_region(tmp_path, photo):
    path = tmp_path / "big.jpg"
    photo.resize((4000, 3000), Image.BICUBIC).save(path, quality=92)
    box = Box(2000, 1000, 3000, 2000)                 # 1000 x 1000 pixels
    cut = load_region(path, box, 224, max_pixels=None)
    assert cut.size == (250, 250)                     # decoded at 1/4: still >= 224 a side
    whole = crop(load_image(path), box).resize(cut.size, Image.BOX)
    assert _diff(cut, whole) < 3                      # the same pixels, at a quarter of the size
    assert load_region(path, box, 2000, max_pixels=None).size == (1000, 1000)   # a box smaller than asked: whole


def test_a_box_is_in_the_pixels_as_shown_after_exif_rotation(tmp_path, photo):
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6                                  # rotate 90 CW to display: 1200 x 1600 shown
    photo.resize((1600, 1200), Image.BICUBIC).save(path, exif=exif, quality=95)
    shown = load_image(path)
    assert shown.size == (1200, 1600)
    box = Box(100, 900, 1100, 1500)
    assert _diff(load_region(path, box, 2000, max_pixels=None), crop(shown, box)) == 0
    small = load_region(path, box, 150, max_pixels=None)
    assert small.size == (250, 150) and _diff(small, crop(shown, box).resize(small.size, Image.BOX)) < 3
    with pytest.raises(ValueError, match=r"box: 0,0,1300,10 is outside rotated.jpg \(1200x1600 pixels\)"):
        load_region(path, Box(0, 0, 1300, 10), 224, max_pixels=None, name="rotated.jpg")


def test_a_box_upload_is_decoded_within_the_budget_like_any_upload():
    """The 6300x6300 WebP of RELIABILITY.md (90 KB; libwebp holds ~16 bytes a pixel: 606 MB) is
    refused 413 with a box as without one; the server decoded it whole with a box."""
    from embedder.decode_budget import BUDGET
    from serving.uploads import UploadError, decode_upload

    side = int((BUDGET.capacity / 16) ** 0.5) + 64    # just over the budget for a WebP
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (120, 60, 30)).save(buf, format="WEBP", quality=10)
    for box in (None, Box(0, 0, 300, 300)):
        with pytest.raises(UploadError) as err:
            decode_upload(buf.getvalue(), "big.webp", min_side=224, box=box)
        assert err.value.status == 413 and "budget" in err.value.message, (box, err.value.message)
