"""The query kinds beyond one whole image (issue 42 item 3): a region of the image, and several
images searched as one.

A region is a box in the pixels of the image as it is shown (after its EXIF orientation), so a
crop drawn in a browser and ``box=x0,y0,x1,y1`` typed by hand mean the same pixels. Several
images are fused the standard way for L2-normalised embeddings: the normalised mean of their
embeddings (the "average query expansion" of Chum et al. 2007 applied to the query side), which
ranks by the mean cosine to the query images; one result list comes back.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from .results import RequestError

#: Most images one fused query may hold (each is decoded and embedded in the request).
MAX_QUERY_IMAGES = 16


class Box(NamedTuple):
    """A region in pixels: left, top, right, bottom (right and bottom exclusive, as PIL crops)."""
    x0: int
    y0: int
    x1: int
    y1: int


def parse_box(value: Any, field: str = "box") -> Box | None:
    """The one parse of a region (API form text "x0,y0,x1,y1", the CLI's --box, the UI's field,
    or a 4-sequence): None or "" -> no region; integers with x0 < x1 and y0 < y1, else a
    RequestError naming ``field``. Whether it lies inside the image is :func:`crop`'s check."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    parts = value.replace(";", ",").split(",") if isinstance(value, str) else list(value)
    try:
        nums = [float(p) for p in parts]
    except (TypeError, ValueError):
        nums = []
    if len(nums) != 4 or not all(np.isfinite(nums)) or any(n != int(n) for n in nums):
        raise RequestError(f"{field}: expected four integers x0,y0,x1,y1 (pixels), got {value!r}")
    box = Box(*(int(n) for n in nums))
    if box.x0 >= box.x1 or box.y0 >= box.y1:
        raise RequestError(f"{field}: expected x0 < x1 and y0 < y1, got {','.join(map(str, box))}")
    return box


def crop(img: Image.Image, box: Box, name: str = "query", field: str = "box") -> Image.Image:
    """``img`` cut to ``box``; a box not inside the image is a RequestError naming both sizes."""
    w, h = img.size
    if box.x0 < 0 or box.y0 < 0 or box.x1 > w or box.y1 > h:
        raise RequestError(f"{field}: {','.join(map(str, box))} is outside {name} ({w}x{h} pixels); "
                           f"expected 0 <= x0 < x1 <= {w} and 0 <= y0 < y1 <= {h}")
    return img.crop(tuple(box))


def check_count(n: int, field: str = "image") -> None:
    """0 images is "no query" (the caller's message); more than MAX_QUERY_IMAGES is refused."""
    if n > MAX_QUERY_IMAGES:
        raise RequestError(f"{field}: at most {MAX_QUERY_IMAGES} query images at once, got {n}")


def fuse(embeddings: np.ndarray) -> np.ndarray:
    """One unit vector for (n, d) L2-normalised embeddings: their normalised mean."""
    v = np.asarray(embeddings, dtype=np.float32).mean(axis=0)
    norm = float(np.linalg.norm(v))
    if norm < 1e-6:      # opposite images cancel: nothing is near "both"
        raise RequestError("image: the query images' embeddings cancel out (their mean is ~0); "
                           "search them one at a time")
    return v / norm
