"""Image loading shared by training, indexing and serving.

Every package decodes images through :func:`load_image` so that a photo looks the same to the
model whether it was seen during evaluation, indexing or a search request: EXIF orientation is
applied, transparency is composited on white (not black, which is what a bare ``convert`` does),
16-bit and float images are scaled into 0..255 instead of being clipped, and every way a file
can be bad surfaces as one exception type, :class:`ImageLoadError`, so callers (the indexer's
skip report, the HTTP API's 400 answer) only need to catch one thing.

This module needs PIL and numpy only, never torch: serving imports it.
"""
from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

# File suffixes every package treats as images (gallery walks, dataset folders, query folders).
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})

DEFAULT_MAX_PIXELS: int = 64_000_000
MODES = ("RGB", "L")

ImageSource = Union[str, os.PathLike, bytes, bytearray, memoryview, Image.Image]


class ImageLoadError(ValueError):
    """A source that cannot be turned into a model-ready image; ``str(e) == f"{path}: {reason}"``."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")

    def __reduce__(self):  # keep (path, reason) across process boundaries (multiprocessing)
        return (type(self), (self.path, self.reason))


def _source_name(source: object, name: str | None) -> str:
    if name is not None:
        return name
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    if isinstance(source, Image.Image):
        return getattr(source, "filename", "") or "<PIL image>"
    return "<bytes>"


def _scale_to_uint8(arr: np.ndarray) -> np.ndarray:
    """Map integer/float pixels to 0..255 by their nominal range, never by clipping.

    Integer data above 255 is treated as 16-bit (0..65535, divided by 257 so 65535 -> 255);
    float data in 0..1 is multiplied by 255. Deciding from the values is a compromise: PIL's
    "I" and "F" modes do not record the bit depth the file was written with.
    """
    a = np.nan_to_num(arr.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    hi = float(a.max()) if a.size else 0.0
    if np.issubdtype(arr.dtype, np.floating) and hi <= 1.0:
        a = a * 255.0
    elif hi > 255.0:
        a = np.clip(a, 0.0, 65535.0) / 257.0
    return np.clip(np.rint(a), 0, 255).astype(np.uint8)


def to_mode(img: Image.Image, mode: str = "RGB") -> Image.Image:
    """Convert any PIL mode to ``mode`` ("RGB" or "L") the way the model expects.

    Returns a new image (never the argument itself), so the caller may close its source.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    src = img.mode
    if src in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        # Pillow's own convert("L") clips these to 0..255 instead of scaling them.
        img = Image.fromarray(_scale_to_uint8(np.asarray(img)), mode="L")
    elif src == "1":
        img = img.convert("L")
    elif src in ("RGBA", "LA", "PA", "RGBa", "La") or (src == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba).convert("RGB")
    elif src == "L" and "transparency" in img.info:
        img = img.convert("LA")
        return to_mode(img, mode)
    elif src not in ("RGB", "L"):
        img = img.convert("RGB")  # P, CMYK, YCbCr, LAB, HSV, ...
    return img.convert(mode) if img.mode != mode else img.copy()


def load_image(
    source: ImageSource,
    mode: str = "RGB",
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    name: str | None = None,
    min_side: int | None = None,
) -> Image.Image:
    """Decode ``source`` (path, encoded bytes or PIL image) into a fully loaded ``mode`` image.

    ``max_pixels`` is checked from the header, before any pixel is decoded, so a decompression
    bomb costs nothing; ``None`` disables the check (PIL's own limit still applies).
    ``name`` labels bytes sources in error messages (e.g. the uploaded file name).

    ``min_side``: the model only needs this many pixels on the shorter side, so a larger image
    is decoded smaller, by the largest integer factor that keeps the shorter side >= min_side:
    JPEG through libjpeg's DCT scaling while decoding (``Image.draft``: a 36-megapixel photo
    never exists in memory at full size), other formats by ``Image.reduce`` (box averaging)
    right after decoding. An image whose shorter side is below ``2 * min_side`` is returned
    exactly as with ``min_side=None``. ``None``: full size (training, export parity).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    label = _source_name(source, name)
    if isinstance(source, Image.Image):
        _check_pixels(source, max_pixels, label)
        try:
            source.load()
            return _reduced(to_mode(ImageOps.exif_transpose(source) or source, mode), min_side)
        except (OSError, ValueError, SyntaxError) as e:
            raise ImageLoadError(label, f"cannot decode image: {e}") from e

    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
            fp: object = io.BytesIO(data)
            empty = not data
        elif isinstance(source, (str, os.PathLike)):
            fp = Path(source)
            if fp.is_dir():
                raise ImageLoadError(label, "is a directory, expected an image file")
            empty = fp.stat().st_size == 0   # FileNotFoundError / PermissionError: below
        else:
            raise ImageLoadError(label, f"unsupported source type {type(source).__name__}, "
                                 "expected a path, bytes or a PIL image")
        if empty:
            raise ImageLoadError(label, "empty file (0 bytes)")
        with Image.open(fp) as im:
            _check_pixels(im, max_pixels, label)
            if min_side and im.format == "JPEG" and min(im.size) >= 2 * min_side:
                im.draft(im.mode, (min_side, min_side))   # scale 1/2, 1/4 or 1/8, >= min_side
            im.load()  # full decode here, so truncated files fail inside this function
            oriented = ImageOps.exif_transpose(im)
            return _reduced(to_mode(oriented if oriented is not None else im, mode), min_side)
    except ImageLoadError:
        raise
    except UnidentifiedImageError as e:
        raise ImageLoadError(label, "not an image (unrecognised format)") from e
    except Image.DecompressionBombError as e:
        # PIL refuses above 2 * Image.MAX_IMAGE_PIXELS inside Image.open, before our own check
        # can see the size; report it in the same words.
        m = re.search(r"\((\d+) pixels\)", str(e))
        n = m.group(1) if m else "too many"
        limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        if max_pixels is not None:
            limit = min(limit, max_pixels)
        raise ImageLoadError(label, f"image too large: {n} pixels exceeds the limit of {limit} "
                                    "(possible decompression bomb)") from e
    except FileNotFoundError as e:
        raise ImageLoadError(label, "file not found") from e
    except PermissionError as e:
        raise ImageLoadError(label, "permission denied") from e
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, KeyError, TypeError) as e:
        # Pillow signals truncated or corrupt data with OSError mostly, but some plugins raise
        # SyntaxError/ValueError/EOFError/IndexError on malformed headers.
        raise ImageLoadError(label, f"truncated or corrupt image data ({type(e).__name__}: {e})") from e


def _reduced(img: Image.Image, min_side: int | None) -> Image.Image:
    """``img`` shrunk by the largest integer factor keeping its shorter side >= ``min_side``."""
    factor = min(img.size) // min_side if min_side else 1
    return img.reduce(factor) if factor >= 2 else img


def _check_pixels(img: Image.Image, max_pixels: int | None, label: str) -> None:
    w, h = img.size
    if w <= 0 or h <= 0:
        raise ImageLoadError(label, f"image has no pixels ({w}x{h})")
    if max_pixels is not None and w * h > max_pixels:
        raise ImageLoadError(
            label, f"image too large: {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} "
                   "(possible decompression bomb; raise max_pixels to accept it)")
