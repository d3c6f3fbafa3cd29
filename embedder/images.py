"""Image loading (PIL and numpy, never torch) through which every package decodes, so a photo looks
the same to the model in evaluation, indexing and search: EXIF orientation applied, transparency
on white, 16-bit and float scaled into 0..255, and every bad file one :class:`ImageLoadError`.
"""
from __future__ import annotations

import functools
import io
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from . import decode_budget as budget
from .containers import ACCEPTED_TEXT, AVIF, FormatRefused, open_image
from .errors import PathError

if TYPE_CHECKING:  # pragma: no cover
    from PIL import ImageFont

# File suffixes every package treats as images (gallery walks, dataset folders, query folders):
# the usual names of the formats embedder.containers opens (.jfif and .jpe are JPEG's other names,
# what some browsers save downloads as).
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".heic", ".heif", ".hif", ".bmp",
                            ".gif", ".tif", ".tiff", *((".avif",) if AVIF else ())})

# Photo formats galleries hold that the decoder does not open (no reader in Pillow, or one it does
# not trust). Walks list them like images (``is_listed``) so that such photos are skipped with
# :func:`not_decoded`'s reason, never missing in silence (other names: notes, sidecars, videos,
# are passed over); a file with such a name that holds a JPEG is read like one. Raw files are refused
# by name: they are TIFF containers, which Pillow would open as their small preview.
_RAW = (".dng", ".cr2", ".cr3", ".nef", ".arw", ".orf", ".rw2", ".raf", ".srw", ".pef")
_NOT_DECODED = {**({} if AVIF else {".avif": "an AVIF image"}), ".jxl": "a JPEG XL image",
                **dict.fromkeys(_RAW, "a camera raw file")}

#: The header cap of a full-size decode (``min_side=None``: the whole bitmap in memory).
DEFAULT_MAX_PIXELS: int = 64_000_000
#: The header cap of a decode at a model's side (``min_side``: galleries, query files, uploads,
#: training photos), whose memory the decode budget bounds (a JPEG drafted at 1/8): 108 MP phone
#: photos and panoramas are read. Pillow's own refusal inside ``Image.open`` (2 x its
#: MAX_IMAGE_PIXELS): 200 MP is over. (Until 2026-11-30 each caller chose a cap: uploads 40 MP.)
REDUCED_MAX_PIXELS: int = 178_956_970
#: ``load_image``'s default ``max_pixels``: :data:`REDUCED_MAX_PIXELS` with ``min_side``, else
#: :data:`DEFAULT_MAX_PIXELS`
BY_SIDE: Literal["by-side"] = "by-side"


def not_decoded(name: str) -> str | None:
    """Why the file ``name`` cannot be read when its suffix is a photo format the decoder does not
    open (HEIC, AVIF, JPEG XL, camera raw), else None."""
    kind = _NOT_DECODED.get(os.path.splitext(name)[1].lower())
    return None if kind is None else (f"{kind}, not decoded here (expected {ACCEPTED_TEXT}); "
                                      "convert it to JPEG first")


def is_listed(name: str) -> bool:
    """Whether folder walks (galleries, queries, class folders) take the file ``name``: an image
    suffix, or a photo format to report as unreadable."""
    suffix = os.path.splitext(name)[1].lower()
    return suffix in IMAGE_SUFFIXES or suffix in _NOT_DECODED


MODES = ("RGB", "L")


def label_font(size: int = 10, text: str = "") -> "ImageFont.FreeTypeFont":
    """The font of a label this project draws into a PNG (audit contact sheets, the probe grid):
    DejaVu Sans from matplotlib's own files (a dependency), so a label in a Latin, Greek or
    Cyrillic script is legible and looks the same on every machine (Pillow's default font holds
    ASCII only: "été" came out as boxes). A ``text`` with characters DejaVu lacks (Chinese,
    Japanese, Korean, Thai, ... class folders) is drawn in the installed font that holds the most
    of them (Pillow has no font fallback of its own); with none installed, DejaVu's boxes."""
    missing = frozenset(c for c in text if c.isprintable()) - _font_chars(_dejavu())
    path, index = (_dejavu(), 0) if not missing else _fallback(missing)
    return _font(path, index, size)


@functools.lru_cache(maxsize=32)
def _font(path: str, index: int, size: int) -> "ImageFont.FreeTypeFont":
    from PIL import ImageFont

    return ImageFont.truetype(path, size, index=index)


@functools.lru_cache(maxsize=None)
def _font_chars(path: str, index: int = 0) -> frozenset[str]:
    """The characters a font file (one face of a collection) maps; read once per process."""
    from fontTools.ttLib import TTFont     # matplotlib's dependency

    try:
        with TTFont(path, fontNumber=index, lazy=True) as font:
            return frozenset(map(chr, font.getBestCmap() or {}))
    except Exception:                       # noqa: BLE001 - an unreadable system font is no candidate
        return frozenset()


@functools.lru_cache(maxsize=64)
def _fallback(missing: frozenset[str]) -> tuple[str, int]:
    """The installed font (file, face) that holds the most of ``missing``; DejaVu when none holds
    any. Only searched for labels DejaVu cannot draw, so most runs never scan the system fonts."""
    best, held = (_dejavu(), 0), 0
    for path in _system_fonts():
        n = len(missing & _font_chars(path))
        if n > held:
            best, held = (path, 0), n
        if held == len(missing):
            break
    return best


@functools.lru_cache(maxsize=1)
def _system_fonts() -> list[str]:
    from matplotlib import font_manager

    return sorted(font_manager.findSystemFonts())     # fc-list or a walk of the font folders: once


@functools.lru_cache(maxsize=1)
def _dejavu() -> str:
    import matplotlib

    return str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf")

ImageSource = Union[str, os.PathLike, bytes, bytearray, memoryview, Image.Image]


class ImageLoadError(PathError):
    """A source that cannot be turned into a model-ready image; ``str(e) == f"{path}: {reason}"``."""


class ImageTooLargeError(ImageLoadError):
    """A readable image over the pixel cap or whose decode would cost more than the decode budget,
    told from its header; a server answers 413 (not 415: the format is fine)."""


def _source_name(source: object, name: str | None) -> str:
    if name is not None:
        return name
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    if isinstance(source, Image.Image):
        return getattr(source, "filename", "") or "<PIL image>"
    return "<bytes>"


def _scale_to_uint8(arr: np.ndarray) -> np.ndarray:
    """Map integer/float pixels to 0..255 by their nominal range, never by clipping: integers
    above 255 as 16-bit (/ 257), floats in 0..1 times 255 (PIL's "I"/"F" keep no bit depth)."""
    a = np.nan_to_num(arr.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    hi = float(a.max()) if a.size else 0.0
    if np.issubdtype(arr.dtype, np.floating) and hi <= 1.0:
        a = a * 255.0
    elif hi > 255.0:
        a = np.clip(a, 0.0, 65535.0) / 257.0
    return np.clip(np.rint(a), 0, 255).astype(np.uint8)


def to_mode(img: Image.Image, mode: str = "RGB") -> Image.Image:
    """Any PIL mode to ``mode`` ("RGB" or "L") as the model expects, a new image (the source may close)."""
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
    max_pixels: int | None | Literal["by-side"] = BY_SIDE,
    name: str | None = None,
    min_side: int | None = None,
    *,
    stored: bool = False,
) -> Image.Image:
    """Decode ``source`` into a fully loaded ``mode`` image; ``max_pixels`` checked from the header.
    ``min_side``: decode smaller, by the largest integer factor keeping the shorter side >=
    min_side, bounded in memory (:mod:`embedder.decode_budget`); ``None``: full size (training,
    export parity). ``stored``: bytes of a gallery store, which a batch build decoded under its
    larger budget (``use_batch_budget``): one over this process's budget (a server's) is decoded
    alone, once every other decode has finished, instead of refused, so that what was indexed
    can be shown and searched by id."""
    if max_pixels == BY_SIDE:
        max_pixels = REDUCED_MAX_PIXELS if min_side else DEFAULT_MAX_PIXELS
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
    if os.path.splitext(label)[1].lower() in _RAW:      # not opened: Pillow would read its preview
        raise ImageLoadError(label, str(not_decoded(label)))

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
        with open_image(fp) as im:      # only accepted formats; icons sized by their real frame
            _check_pixels(im, max_pixels, label)
            full = im.size
            coeffs = 0
            if min_side and im.format in ("JPEG", "MPO"):   # progressive: libjpeg's full buffer
                coeffs = budget.jpeg_coefficient_bytes(
                    im, data if isinstance(fp, io.BytesIO) else Path(fp).read_bytes())
            if min_side and im.format in ("JPEG", "MPO") and min(im.size) >= 2 * min_side:
                im.draft(im.mode, (min_side, min_side))   # scale 1/2, 1/4 or 1/8, >= min_side
            if min_side:
                size = len(data) if isinstance(fp, io.BytesIO) else fp.stat().st_size
                return _bounded(im, mode, min_side, label, size, extra=coeffs, full_size=full, stored=stored)
            im.load()  # full decode here, so truncated files fail inside this function
            return _reduced(to_mode(ImageOps.exif_transpose(im) or im, mode), min_side)
    except ImageLoadError:
        raise
    except FormatRefused as e:
        raise ImageLoadError(label, str(e)) from e
    except UnidentifiedImageError as e:
        raise ImageLoadError(label, not_decoded(label) or "not an image (unrecognised format)") from e
    except Image.DecompressionBombError as e:
        # PIL refuses above 2 * Image.MAX_IMAGE_PIXELS inside Image.open, before our own check
        # can see the size; report it in the same words.
        m = re.search(r"\((\d+) pixels\)", str(e))
        n = m.group(1) if m else "too many"
        limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        if max_pixels is not None:
            limit = min(limit, max_pixels)
        raise ImageTooLargeError(label, f"image too large: {n} pixels exceeds the limit of {limit} "
                                    "(a guard against decompression bombs)") from e
    except FileNotFoundError as e:
        raise ImageLoadError(label, "file not found") from e
    except PermissionError as e:
        raise ImageLoadError(label, "permission denied") from e
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, KeyError, TypeError) as e:
        # Pillow signals truncated or corrupt data with OSError mostly, but some plugins raise
        # SyntaxError/ValueError/EOFError/IndexError on malformed headers.
        raise ImageLoadError(label, f"truncated or corrupt image data ({type(e).__name__}: {e})") from e


def _bounded(im: Image.Image, mode: str, min_side: int, label: str, file_size: int, *,
             extra: int = 0, full_size: tuple[int, int] | None = None, stored: bool = False) -> Image.Image:
    """:func:`load_image` with ``min_side``; ``extra``: what the decoder holds besides the frame."""
    factor = max(1, min(im.size) // min_side)
    need = budget.decode_bytes(im, file_size) + extra
    layout = _raw_layout(im)
    if layout is not None and (frame_too_big(im) or need > budget.BUDGET.capacity):
        orientation = im.getexif().get(0x0112, 1)      # BMP / TIFF: read without a decode
        out = _strips(im, mode, factor, lambda y0, y1: _raw_rows(im, layout, y0, y1))
        return _orient(out, orientation)
    if need > budget.BUDGET.capacity and not stored:     # stored: reserve() takes all of it, alone
        w, h = full_size if extra and full_size else im.size
        kind = f"progressive {im.format}" if extra else im.format
        cap = budget.BUDGET.capacity / (need / (w * h)) / 1e6
        raise ImageTooLargeError(
            label, f"image too large to decode within the memory budget: {w}x{h} {kind} "
                   f"({w * h / 1e6:.1f} MP, mode {im.mode}) needs about {need / 2 ** 20:.0f} MB, the "
                   f"decode budget is {budget.BUDGET.capacity / 2 ** 20:.0f} MB, so {kind} "
                   f"{im.mode} images are accepted up to {cap:.1f} MP (DAS_DECODE_BUDGET_MB raises it)")
    with budget.BUDGET.reserve(need):
        if im.format == "WEBP" and hasattr(im, "_decoder"):
            try:
                out, orientation = _webp_first_frame(im, mode, factor)
            finally:
                im.close()
            if need > budget.SMALL_DECODE:
                budget.release_freed_memory()
            return _orient(out, orientation)
        try:
            im.load()                  # full decode here, so truncated files fail inside this function
            orientation = im.getexif().get(0x0112, 1)   # after load: PNG may keep EXIF after IDAT
            if not frame_too_big(im) or im.mode in budget.HIGH_DEPTH:
                out = _reduced(to_mode(im, mode), min_side)
            else:
                out = _strips(im, mode, factor, lambda y0, y1: im.crop((0, y0, im.size[0], y1)))
        finally:
            im.close()                 # frees the frame before the reservation ends
    if need > budget.SMALL_DECODE:
        budget.release_freed_memory()
    return _orient(out, orientation)


def _webp_first_frame(im: Image.Image, mode: str, factor: int) -> tuple[Image.Image, int]:
    """A WebP's first frame, converted and shrunk a strip at a time, and its EXIF orientation:
    Pillow's own path holds three RGBA frames (16 bytes a pixel), the decoder's frame 12."""
    orientation = im.getexif().get(0x0112, 1)
    got = im._decoder.get_next()
    del im._decoder                                  # libwebp's canvases are freed here
    if got is None:
        raise OSError("failed to decode the first frame of the WebP file")
    data = got[0]
    rawmode = im.rawmode                             # "RGBA" or "RGBX"
    frame = Image.frombuffer(rawmode, im.size, data, "raw", rawmode, 0, 1)
    frame.info = dict(im.info)
    def rows(y0: int, y1: int) -> Image.Image:
        strip = frame.crop((0, y0, frame.size[0], y1))
        return strip.convert("RGB") if rawmode == "RGBX" else strip

    return _strips(frame, mode, factor, rows), orientation


def frame_too_big(im: Image.Image) -> bool:
    """Whether ``im``'s full frame is worth a strip loop (small images take the plain path)."""
    return budget.frame_bytes(im.mode, im.size) > budget.SMALL_DECODE


_STRIP_PIXELS = 1 << 20     # pixels per strip: a few MB per strip whatever the width


def _strips(im: Image.Image, mode: str, factor: int, rows) -> Image.Image:
    """Convert and shrink ``im`` a strip at a time (``rows(y0, y1)``: the strip in ``im``'s mode);
    heights are multiples of ``factor``, so it equals ``to_mode(...).reduce(factor)``."""
    w, h = im.size
    step = max(factor, _STRIP_PIXELS // max(w, 1) // factor * factor)
    out = Image.new(mode, (-(-w // factor), -(-h // factor)))
    for y in range(0, h, step):
        strip = to_mode(rows(y, min(h, y + step)), mode)
        out.paste(strip.reduce(factor) if factor >= 2 else strip, (0, y // factor))
    return out


# Raw (uncompressed) tiles: bytes per pixel of the raw modes whose row length Pillow leaves to
# the decoder (stride 0). Anything else takes the budgeted full decode.
_RAW_BYTES = {"RGB": 3, "BGR": 3, "RGBA": 4, "RGBX": 4, "BGRA": 4, "BGRX": 4, "RGBa": 4,
              "L": 1, "P": 1, "LA": 2, "CMYK": 4}


def _raw_layout(im: Image.Image) -> list[tuple[int, int, int, str, int, int]] | None:
    """(y0, y1, offset, rawmode, stride, ystep) per tile, when every tile is an uncompressed
    full-width band of rows (BMP, uncompressed TIFF) that can be read a strip at a time."""
    tiles = getattr(im, "tile", None)
    w, h = im.size
    # Pillow's AVIF plugin decodes in load() and labels the frame a raw tile at offset 0
    if not tiles or im.mode in budget.HIGH_DEPTH or getattr(im, "fp", None) is None or im.format == "AVIF":
        return None
    out = []
    for t in tiles:
        codec, (x0, y0, x1, y1), offset, args = t[0], t[1], t[2], t[3]
        if codec != "raw" or (x0, x1) != (0, w):
            return None
        args = (args, 0, 1) if isinstance(args, str) else tuple(args) + (0, 1)[len(args) - 1:]
        rawmode, stride, ystep = args[0], int(args[1] or 0), int(args[2] or 1)
        if not isinstance(rawmode, str) or ystep not in (1, -1):
            return None
        if stride == 0:
            if rawmode not in _RAW_BYTES:
                return None
            stride = w * _RAW_BYTES[rawmode]
        out.append((y0, y1, int(offset), rawmode, stride, ystep))
    out.sort()
    if out[0][0] != 0 or out[-1][1] != h or any(a[1] != b[0] for a, b in zip(out, out[1:])):
        return None
    if len(out) > 1 and any(t[5] == -1 for t in out):
        return None
    return out


def _raw_rows(im: Image.Image, layout, y0: int, y1: int) -> Image.Image:
    """Rows ``y0:y1`` of a raw-tiled image, read from its file without decoding the rest."""
    w = im.size[0]
    strip = Image.new(im.mode, (w, y1 - y0))
    for ty0, ty1, offset, rawmode, stride, ystep in layout:
        a, b = max(y0, ty0), min(y1, ty1)
        if a >= b:
            continue
        # bottom-up files (BMP) store image row r of the tile at file row (ty1 - 1 - r)
        im.fp.seek(offset + ((a - ty0) if ystep == 1 else (ty1 - b)) * stride)
        data = im.fp.read((b - a) * stride)
        strip.paste(Image.frombytes(im.mode, (w, b - a), data, "raw", rawmode, stride, ystep), (0, a - y0))
    if im.palette is not None and im.mode in ("P", "PA"):
        rawmode, pal = im.palette.getdata()
        strip.putpalette(pal, rawmode)
    strip.info = dict(im.info)
    return strip


_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
              4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
              6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}


def _orient(img: Image.Image, orientation: int) -> Image.Image:
    """``ImageOps.exif_transpose`` of an already shrunk image, at the cost of the small one."""
    method = _TRANSPOSE.get(orientation)
    return img.transpose(method) if method is not None else img


def _reduced(img: Image.Image, min_side: int | None) -> Image.Image:
    """``img`` shrunk by the largest integer factor keeping its shorter side >= ``min_side``."""
    factor = min(img.size) // min_side if min_side else 1
    return img.reduce(factor) if factor >= 2 else img


def _check_pixels(img: Image.Image, max_pixels: int | None, label: str) -> None:
    w, h = img.size
    if w <= 0 or h <= 0:
        raise ImageLoadError(label, f"image has no pixels ({w}x{h})")
    if max_pixels is not None and w * h > max_pixels:
        raise ImageTooLargeError(
            label, f"image too large: {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} "
                   "(a guard against decompression bombs)")
