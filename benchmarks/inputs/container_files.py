"""Real container files for the decode probes and tests: an icon whose directory lies about its
PNG frame, and multi-frame files (MPO, GIF, APNG, animated WebP) made from a photo.

``png_rows`` writes a PNG a row at a time through zlib, so a 12000 x 12000 frame (144 MP) costs
the maker nothing: the point of the file is that only a decoder ever holds that frame.
"""
from __future__ import annotations

import io
import struct
import zlib

from PIL import Image

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_rows(w: int, h: int, grey: int = 0) -> bytes:
    """A real w x h 8-bit greyscale PNG, compressed a row at a time (never a w x h frame)."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    z = zlib.compressobj(9)
    row = b"\0" + bytes([grey]) * w                        # filter byte + w grey pixels
    idat = b"".join(z.compress(row) for _ in range(h)) + z.flush()
    return (PNG_MAGIC + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def ico_around(frame: bytes, claim: tuple[int, int] = (256, 256), cursor: bool = False) -> bytes:
    """An ICO (or CUR) with one directory entry saying ``claim`` whose data is ``frame``."""
    head = struct.pack("<HHH", 0, 2 if cursor else 1, 1)
    entry = struct.pack("<BBBBHHII", claim[0] % 256, claim[1] % 256, 0, 0, 1, 32, len(frame), 6 + 16)
    return head + entry + frame


def multi_frame(photo: Image.Image, kind: str, **save) -> bytes:
    """``photo`` and its 180-degree turn as a two-frame MPO, GIF, APNG or animated WebP."""
    buf = io.BytesIO()
    second = photo.rotate(180)
    if kind == "MPO":
        photo.save(buf, "MPO", save_all=True, append_images=[second], quality=90, **save)
    elif kind == "GIF":
        photo.quantize(256).save(buf, "GIF", save_all=True, append_images=[second.quantize(256)],
                                 duration=100, **save)
    elif kind == "APNG":
        photo.save(buf, "PNG", save_all=True, append_images=[second], duration=100, **save)
    elif kind == "WebP":
        photo.save(buf, "WEBP", save_all=True, append_images=[second], duration=100, quality=80,
                   method=0, **save)
    else:
        raise ValueError(f"kind must be MPO, GIF, APNG or WebP, got {kind!r}")
    return buf.getvalue()
