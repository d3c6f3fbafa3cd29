"""A region of a query image (``box=``, the page's Box field, ``indexer search --box``): ``x0,y0,x1,y1``
in the pixels of the image as shown (EXIF applied), right and bottom exclusive as PIL crops."""
from __future__ import annotations

import io
import math
from typing import Any, NamedTuple

import numpy as np
from PIL import Image


class Box(NamedTuple):
    """A region in pixels: left, top, right, bottom (right and bottom exclusive)."""
    x0: int
    y0: int
    x1: int
    y1: int


def parse_box(value: Any, field: str = "box") -> Box | None:
    """"x0,y0,x1,y1" (or a 4-sequence) -> Box; None or "" -> None. Integers with x0 < x1 and
    y0 < y1, else ValueError naming ``field``. Whether it lies inside an image is :func:`crop`'s."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    parts = value.replace(";", ",").split(",") if isinstance(value, str) else list(value)
    try:
        nums = [float(p) for p in parts]
    except (TypeError, ValueError):
        nums = []
    if len(nums) != 4 or not all(np.isfinite(nums)) or any(n != int(n) for n in nums):
        raise ValueError(f"{field}: expected four integers x0,y0,x1,y1 (pixels), got {value!r}")
    box = Box(*(int(n) for n in nums))
    if box.x0 >= box.x1 or box.y0 >= box.y1:
        raise ValueError(f"{field}: expected x0 < x1 and y0 < y1, got {','.join(map(str, box))}")
    return box


def check_inside(box: Box, w: int, h: int, name: str = "query", field: str = "box") -> None:
    """A box not inside a ``w`` x ``h`` image is a ValueError naming both sizes."""
    if box.x0 < 0 or box.y0 < 0 or box.x1 > w or box.y1 > h:
        raise ValueError(f"{field}: {','.join(map(str, box))} is outside {name} ({w}x{h} pixels); "
                         f"expected 0 <= x0 < x1 <= {w} and 0 <= y0 < y1 <= {h}")


def crop(img: Image.Image, box: Box, name: str = "query", field: str = "box") -> Image.Image:
    """``img`` cut to ``box`` (:func:`check_inside` first)."""
    check_inside(box, *img.size, name, field)
    return img.crop(tuple(box))


def load_region(source: Any, box: Box, min_side: int, *, mode: str = "RGB", max_pixels: int | None | str = "by-side",
                name: str | None = None, stored: bool = False, field: str = "box") -> Image.Image:
    """The region ``box`` of an image file or bytes, no smaller than ``min_side`` on its shorter
    side where the region allows: the whole image is decoded reduced by the largest integer factor
    that keeps the box that large, within the decode budget like any other decode
    (``load_image(min_side=...)``). A whole decode first (until 2026-11-30) bypassed the budget: a
    90 KB 6300x6300 WebP with a box cost a server +426 MB, without one it is refused (413).
    A box not inside the image (as shown: EXIF applied) is a ValueError naming both sizes."""
    from .containers import open_image
    from .images import ImageLoadError, load_image

    label = name or str(source)
    if isinstance(source, Image.Image):           # decoded already: its own pixels
        return crop(load_image(source, mode=mode, max_pixels=max_pixels, name=name), box, label, field)
    try:
        with open_image(io.BytesIO(bytes(source)) if isinstance(source, (bytes, bytearray, memoryview))
                        else source) as im:
            header = im.size
    except (OSError, ValueError, SyntaxError, EOFError, IndexError, KeyError, TypeError,
            Image.DecompressionBombError):
        # unreadable: load_image says why, in its own words (the same checks, the same order)
        load_image(source, mode=mode, max_pixels=max_pixels, name=name, min_side=min_side, stored=stored)
        raise ImageLoadError(label, "unreadable image header") from None
    if min(header) <= 0:
        raise ImageLoadError(label, f"image has no pixels ({header[0]}x{header[1]})")
    factor = max(1, min(box.x1 - box.x0, box.y1 - box.y0) // max(1, min_side))
    img = load_image(source, mode=mode, max_pixels=max_pixels, name=name, stored=stored,
                     min_side=max(1, min(header) // factor))
    # the full size as shown: the header's sides in the order the decode (EXIF applied) has them
    w, h = header
    if abs(img.width / w - img.height / h) > abs(img.width / h - img.height / w):
        w, h = h, w
    check_inside(box, w, h, label, field)
    rx, ry = img.width / w, img.height / h
    x0, y0 = int(box.x0 * rx), int(box.y0 * ry)
    return img.crop((x0, y0, min(max(x0 + 1, math.ceil(box.x1 * rx)), img.width),
                     min(max(y0 + 1, math.ceil(box.y1 * ry)), img.height)))
