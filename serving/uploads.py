"""Validation of client-supplied images: size limit first, then a real decode.

Both the Gradio UI and the HTTP API go through here so that a too-large upload or a file that
is not an image gets the same clear message (and HTTP status) everywhere, never a stack trace.
"""
from __future__ import annotations

from PIL import Image

from embedder import ImageLoadError, load_image

DEFAULT_MAX_UPLOAD_BYTES = 10 * 1024 * 1024
# Decoded-size cap for uploads: far below embedder's 64 MP default, because a small compressed
# file can still decode to a huge bitmap (decompression bomb) and uploads come from strangers.
DEFAULT_MAX_UPLOAD_PIXELS = 40_000_000


class UploadError(ValueError):
    """A rejected upload; ``status`` is the HTTP code the API answers with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def check_size(size: int, name: str, max_bytes: int = DEFAULT_MAX_UPLOAD_BYTES) -> None:
    if size > max_bytes:
        raise UploadError(f"{name}: upload is {human_bytes(size)}, larger than the limit of "
                          f"{human_bytes(max_bytes)}", status=413)


def decode_upload(data: bytes, name: str = "upload", *, max_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
                  max_pixels: int = DEFAULT_MAX_UPLOAD_PIXELS) -> Image.Image:
    """Bytes from a client -> RGB image, or UploadError (413 too large, 415 not an image)."""
    if not data:
        raise UploadError(f"{name}: the upload is empty; expected an image file", status=400)
    check_size(len(data), name, max_bytes)
    try:
        return load_image(data, mode="RGB", max_pixels=max_pixels, name=name)
    except ImageLoadError as e:
        raise UploadError(f"{name}: not a readable image ({e.reason}); expected a PNG, JPEG, "
                          f"WebP, BMP or GIF file", status=415) from None
