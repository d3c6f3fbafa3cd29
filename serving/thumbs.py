"""Thumbnails made from gallery bytes (LMDB) by id, never from a client-named path, cached, plus
the green/red match frame."""
from __future__ import annotations

import io
import threading
from collections import OrderedDict
from typing import Callable

from PIL import Image, ImageDraw

from embedder import load_image

MATCH = (22, 163, 74)      # green: same label as the query
MISMATCH = (220, 38, 38)   # red: different label


def png_thumbnail(data: bytes, size: int = 160) -> bytes:
    """Gallery bytes -> PNG of an RGB thumbnail within size x size (a large photo is decoded at
    reduced size, never at full size: ``load_image(min_side=...)``)."""
    im = load_image(data, mode="RGB", max_pixels=None, min_side=size, stored=True)
    im.thumbnail((size, size))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def framed(img: Image.Image, match: bool | None, width: int = 6) -> Image.Image:
    """Draw the Fig. V-style frame into the image: green for a match, red otherwise, none when
    the query's label is unknown (so the frame survives any front end)."""
    if match is None:
        return img
    out = img.convert("RGB").copy()
    draw = ImageDraw.Draw(out)
    w, h = out.size
    width = max(1, min(width, w // 4, h // 4))
    draw.rectangle([0, 0, w - 1, h - 1], outline=MATCH if match else MISMATCH, width=width)
    return out


class ThumbnailCache:
    """Thread-safe LRU of PNG thumbnails by (index name, id): a read, a decode and an encode saved."""

    def __init__(self, capacity: int = 4096, size: int = 160):
        self.capacity, self.size = capacity, size
        self._data: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.misses = 0

    def get(self, key: tuple[str, int], load: Callable[[], bytes]) -> bytes:
        with self._lock:
            png = self._data.get(key)
            if png is not None:
                self._data.move_to_end(key)
                return png
            self.misses += 1
        png = png_thumbnail(load(), self.size)
        with self._lock:
            self._data[key] = png
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)
        return png
