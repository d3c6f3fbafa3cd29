"""Which image formats the decoder opens, decided from the first bytes, before Pillow's open.

Why: ``Image.open`` is lazy for most formats (so :mod:`embedder.decode_budget` can size a decode
first), not for all: ICO decodes its largest frame inside ``open`` (a 420 KB icon holding a
12000x12000 PNG cost 550 MB), FLI too, EPS runs Ghostscript. So only :data:`ACCEPTED` formats are
opened, others are refused unopened (named by Pillow's ``_accept`` sniffers), and an ICO frame
larger than its directory says is refused from its own header before decoding.
"""
from __future__ import annotations

import io
import os
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import BinaryIO, Union

import pillow_heif
from PIL import Image, features

# HEIC/HEIF (phones' default photo format) through pillow-heif's opener, lazy like Pillow's own:
# the size (rotation applied) is read from the header, libheif decodes on load
pillow_heif.register_heif_opener()
# Pillow warns at open above 89 MP; every decode here checks the size from the header against its
# own limit (embedder.images: max_pixels) and skips or refuses in one line: the warning was noise
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
#: whether this Pillow decodes AVIF (its own plugin: the pinned Pillow 12.3's wheels have it)
AVIF = bool(features.check("avif"))

# Pillow format names the decoder opens. MPO (multi-picture JPEG) opens through the JPEG plugin.
ACCEPTED: tuple[str, ...] = ("JPEG", "MPO", "PNG", "WEBP", "HEIF", *(("AVIF",) if AVIF else ()), "GIF", "BMP",
                             "TIFF", "ICO", "CUR")
ACCEPTED_TEXT = f"JPEG, PNG, WebP, HEIC, {'AVIF, ' if AVIF else ''}GIF, BMP, TIFF or ICO"
_PREFIX = 16                       # what Image.open hands each plugin's sniffer


class FormatRefused(ValueError):
    """A file the decoder will not open; ``str(e)`` is the reason (without the file name)."""


def sniff(prefix: bytes) -> str | None:
    """The Pillow format whose own sniffer accepts ``prefix`` (the first 16 bytes), or None."""
    Image.init()
    for fmt in Image.ID:
        factory, accept = Image.OPEN[fmt]
        try:
            if accept is not None and accept(prefix):
                return fmt
        except Exception:  # noqa: BLE001 - a sniffer choking on a short prefix means "not mine"
            continue
    return None


def _icon_frame(fp: BinaryIO) -> tuple[str, tuple[int, int], tuple[int, int]]:
    """(frame kind, real size, size the directory claims) of the frame Pillow's ICO ``open``
    decodes (the first entry after its own sort: the largest claimed). Headers only."""
    from PIL import BmpImagePlugin, IcoImagePlugin, PngImagePlugin

    ico = IcoImagePlugin.IcoFile(fp)                 # reads the directory, nothing else
    entry = ico.entry[0]
    fp.seek(entry.offset)
    magic = fp.read(8)
    fp.seek(entry.offset)
    if magic == PngImagePlugin._MAGIC:
        frame = PngImagePlugin.PngImageFile(fp)       # chunks up to the first IDAT
        return "PNG", frame.size, entry.dim
    frame = BmpImagePlugin.DibImageFile(fp)           # the bitmap header
    return "bitmap", (frame.size[0], frame.size[1] // 2), entry.dim   # XOR image + AND mask


def check_icon(fp: BinaryIO) -> None:
    """Raise :class:`FormatRefused` if the ICO in ``fp`` holds a frame larger than its directory says."""
    start = fp.tell()
    try:
        kind, (w, h), (dw, dh) = _icon_frame(fp)
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, KeyError, TypeError) as e:
        raise FormatRefused(f"ICO file with an unreadable frame header ({type(e).__name__}: {e})") from e
    finally:
        fp.seek(start)
    if w > dw or h > dh or w <= 0 or h <= 0:
        raise FormatRefused(
            f"ICO frame is a {w}x{h} {kind} but the icon's directory says {dw}x{dh}; an icon "
            "frame is decoded whole as it is opened, so one larger than its directory entry is "
            "refused before decoding")


def open_image(fp: Union[str, os.PathLike, io.BytesIO]) -> Image.Image:
    """``Image.open(fp)`` limited to :data:`ACCEPTED`, after the checks above (FormatRefused)."""
    with open(fp, "rb") if isinstance(fp, (str, os.PathLike)) else nullcontext(fp) as f:
        start = f.tell()
        fmt = sniff(f.read(_PREFIX))
        f.seek(start)
        if fmt == "ICO":
            check_icon(f)
    if fmt is not None and fmt not in ACCEPTED:
        raise FormatRefused(f"{fmt} image: not an accepted format (expected {ACCEPTED_TEXT}); "
                            "refused unopened")
    opened_by = [f for f in ACCEPTED if f in Image.OPEN]     # MPO has no opener of its own
    return Image.open(Path(fp) if isinstance(fp, (str, os.PathLike)) else fp, formats=opened_by)
