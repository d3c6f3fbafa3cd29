"""A region of a query image (``box=``, the page's Box field, ``indexer search --box``): ``x0,y0,x1,y1``
in the pixels of the image as shown (EXIF applied), right and bottom exclusive as PIL crops."""
from __future__ import annotations

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


def crop(img: Image.Image, box: Box, name: str = "query", field: str = "box") -> Image.Image:
    """``img`` cut to ``box``; a box not inside the image is a ValueError naming both sizes."""
    w, h = img.size
    if box.x0 < 0 or box.y0 < 0 or box.x1 > w or box.y1 > h:
        raise ValueError(f"{field}: {','.join(map(str, box))} is outside {name} ({w}x{h} pixels); "
                         f"expected 0 <= x0 < x1 <= {w} and 0 <= y0 < y1 <= {h}")
    return img.crop(tuple(box))
