"""Validation of client-supplied images, for the UI and the API alike: size limit first, then a
real decode, no larger than the embedders need (``load_image(min_side=...)``) and at most
``MAX_CONCURRENT_DECODES`` at a time, so a burst of large uploads cannot pile up bitmaps.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from PIL import Image

from embedder import ImageLoadError, ImageTooLargeError, load_image
from embedder.containers import ACCEPTED_TEXT
from embedder.images import BY_SIDE
from embedder.regions import Box, load_region

from .results import RequestError

# A phone's 48-50 MP JPEG is 8-20 MB, a 108 MP one 14-30 MB: 10 MB refused the first in most cases.
DEFAULT_MAX_UPLOAD_BYTES = 32 * 1024 * 1024
# Uploads have no pixel cap of their own (until 2026-11-30 40 MP: phones' 48 MP mode was refused):
# decoded at the model's side, a decompression bomb cannot cost more than the decode budget (a JPEG
# drafted at 1/8: a 108 MP phone photo +16 MB, 0.2 s CPU), and one whose decode would not fit is a
# 413 before any pixel is read; the header cap is load_image's (embedder.images.REDUCED_MAX_PIXELS).
MAX_CONCURRENT_DECODES = max(2, min(4, os.cpu_count() or 2))
_DECODES = threading.BoundedSemaphore(MAX_CONCURRENT_DECODES)


class UploadError(RequestError):
    """A rejected upload; ``status`` is the HTTP code the API answers with."""


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def too_large(size: int | None, max_bytes: int) -> str:
    """"upload is 2.5 MB, larger than the limit of 2.0 MB"; exact bytes when both would read the
    same, and no size at all when only "more than the limit" is known (a chunked body)."""
    if size is None:
        return f"upload is larger than the limit of {human_bytes(max_bytes)}"
    a, b = human_bytes(size), human_bytes(max_bytes)
    if a == b:
        a, b = f"{size:,} bytes", f"{max_bytes:,} bytes ({b})"
    return f"upload is {a}, larger than the limit of {b}"


def check_size(size: int, name: str, max_bytes: int = DEFAULT_MAX_UPLOAD_BYTES) -> None:
    if size > max_bytes:
        raise UploadError(f"{name}: {too_large(size, max_bytes)}", status=413)


def bounded_decode(source: bytes | str | Path | Image.Image, *, name: str | None = None,
                   min_side: int | None = None, max_pixels: int | None | str = BY_SIDE,
                   stored: bool = False) -> Image.Image:
    """``load_image`` to RGB, at most MAX_CONCURRENT_DECODES at once; raises ImageLoadError.
    ``stored``: gallery bytes (``load_image``'s ``stored``), never a client's upload."""
    with _DECODES:
        return load_image(source, mode="RGB", max_pixels=max_pixels, name=name, min_side=min_side, stored=stored)


def decode_upload(data: bytes, name: str = "upload", *, max_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
                  max_pixels: int | None | str = BY_SIDE, min_side: int | None = None,
                  box: Box | None = None) -> Image.Image:
    """Client bytes -> RGB image no larger than ``min_side`` needs, or UploadError (413, 415);
    ``box``: that region of it (in its own pixels; one outside it: RequestError, 400)."""
    if not data:
        raise UploadError(f"{name}: the upload is empty; expected an image file", status=400)
    check_size(len(data), name, max_bytes)
    try:
        if box is not None:
            with _DECODES:
                return load_region(data, box, min_side or 1, max_pixels=max_pixels, name=name)
        return bounded_decode(data, name=name, min_side=min_side, max_pixels=max_pixels)
    except ImageTooLargeError as e:  # a readable image that needs more memory than decoding may use
        raise UploadError(str(e), status=413) from None
    except ImageLoadError as e:     # the accepted formats listed once (a refusal's reason has them)
        expected = "" if ACCEPTED_TEXT in e.reason else f"; expected a {ACCEPTED_TEXT} file"
        raise UploadError(f"{name}: not a readable image ({e.reason}){expected}", status=415) from None
    except ValueError as e:         # the box is not inside the image
        raise RequestError(str(e)) from None
