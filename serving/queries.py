"""The query kinds beyond one whole image: a region (:mod:`embedder.regions`) and several images
searched as one by the normalised mean of their embeddings (average query expansion, Chum et al.
2007, on the query side): one result list, ranked by the mean cosine.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from embedder import regions
from embedder.images import ImageLoadError
from embedder.regions import Box

from .results import RequestError

#: Most images one fused query may hold (each is decoded and embedded in the request).
MAX_QUERY_IMAGES = 16


def parse_box(value: Any, field: str = "box") -> Box | None:
    """:func:`embedder.regions.parse_box`, its ValueError a RequestError (HTTP 400)."""
    try:
        return regions.parse_box(value, field)
    except ValueError as e:
        raise RequestError(str(e)) from None


def crop(img: Image.Image, box: Box, name: str = "query", field: str = "box") -> Image.Image:
    """:func:`embedder.regions.crop`, its ValueError a RequestError (HTTP 400)."""
    try:
        return regions.crop(img, box, name, field)
    except ValueError as e:
        raise RequestError(str(e)) from None


def load_region(source: Any, box: Box, min_side: int, **kw: Any) -> Image.Image:
    """:func:`embedder.regions.load_region`, a box outside the image a RequestError (HTTP 400);
    an unreadable image stays an ImageLoadError (the caller's 413 / 415)."""
    try:
        return regions.load_region(source, box, min_side, **kw)
    except ImageLoadError:
        raise
    except ValueError as e:
        raise RequestError(str(e)) from None


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
