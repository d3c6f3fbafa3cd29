"""How much memory decoding an image costs, and a process-wide budget that bounds it.

Only JPEG can be decoded smaller than stored (``Image.draft``), so each decode first reserves its
cost from one budget shared by every thread: four 36-megapixel PNGs at once decode one after
another, and a file that alone exceeds it is refused before a pixel is decoded. Costs per pixel
are measured (benchmarks/embedder/decode_memory.py); a progressive JPEG is also charged the DCT
coefficients libjpeg keeps until its last scan (:func:`jpeg_coefficient_bytes`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from PIL import Image

# What decoding may hold at once per process. 160 MiB: a 40-megapixel RGB(A) frame (the upload
# cap) fits, so every format but WebP (10.5 MP) is accepted up to the cap; an operator with more memory
# (or less) sets DAS_DECODE_BUDGET_MB.
DEFAULT_DECODE_BUDGET = 160 * 2 ** 20
# What a batch job (`python -m indexer | training | embedder`) may hold: the user's own files, not
# concurrent uploads, so a 24 MP phone HEIC (~240 MB) or a 48 MP one (~480) is read, not refused.
BATCH_DECODE_BUDGET = 512 * 2 ** 20
SMALL_DECODE = 16 * 2 ** 20       # below this a decode is not worth a strip loop or a heap trim

_MODE_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2}
HIGH_DEPTH = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I", "F"})
# What a WebP is charged: 12 bytes a pixel measured for the decode (libwebp's two RGBA canvases +
# the frame handed over as bytes, which images._webp_first_frame reads in strips; Pillow's own
# load adds a fourth frame: 16), plus 4 of headroom: on a live server, 4 WebPs of 13.8 MP at once
# (what 12 alone would admit) peaked at +186..237 MB, over the 200 MB goal, while at 10.4 MP
# (what 16 admits, the cap before issue 28) they peak at +116..123 (RELIABILITY.md).
_WEBP_BYTES = 16
# HEIC (libheif + libde265) and AVIF (Pillow's libavif): the decode's peak, measured on 12 MP
# photos 7.9 and 9.4 bytes a pixel (24 MP HEIC 6.7), plus headroom as for WebP. A 12 MP phone
# photo fits a server's budget; a 24 MP one the batch CLIs' (BATCH_DECODE_BUDGET).
_PER_PIXEL = {"WEBP": _WEBP_BYTES, "HEIF": 10, "AVIF": 12}   # formats charged by pixels, not frames


def frame_bytes(mode: str, size: tuple[int, int]) -> int:
    """Bytes of a decoded Pillow frame (RGB is stored as 4 bytes per pixel)."""
    return size[0] * size[1] * _MODE_BYTES.get(mode, 4)


def jpeg_scans(data: bytes) -> int:
    """How many scans (SOS markers) the first JPEG frame of ``data`` has, its markers walked to the
    first EOI (entropy-coded bytes skipped by their ``FF00`` stuffing and restart markers)."""
    n, i, scans = len(data), 2, 0
    while i < n - 1:
        if data[i] != 0xFF:
            i = data.find(b"\xff", i)
            if i < 0:
                break
            continue
        m = data[i + 1]
        if m == 0xFF:                           # fill byte before a marker
            i += 1
        elif m == 0x00 or 0xD0 <= m <= 0xD8 or m == 0x01:   # stuffed byte, RSTn, SOI, TEM
            i += 2
        elif m == 0xD9:                         # EOI: the first frame ends
            break
        else:
            scans += m == 0xDA
            i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return scans


def jpeg_coefficient_bytes(im: Image.Image, data: bytes | None = None) -> int:
    """The DCT coefficients libjpeg holds for a progressive or multi-scan JPEG/MPO however small the
    output (0 for a baseline file); call before ``draft`` (it changes ``im.size``)."""
    if im.format not in ("JPEG", "MPO"):
        return 0
    progressive = bool(im.info.get("progressive") or im.info.get("progression"))
    if not progressive and (data is None or jpeg_scans(data) <= 1):
        return 0
    w, h = im.size
    layers = getattr(im, "layer", None) or [("", 1, 1, 0)] * len(im.getbands())
    hmax = max(int(c[1]) or 1 for c in layers)
    vmax = max(int(c[2]) or 1 for c in layers)
    mcu_w, mcu_h = -(-w // (8 * hmax)), -(-h // (8 * vmax))     # MCUs across and down
    return sum(mcu_w * (int(c[1]) or 1) * mcu_h * (int(c[2]) or 1) * 64 * 2 for c in layers)


def decode_bytes(im: Image.Image, file_size: int = 0) -> int:
    """What fully decoding the opened (not yet loaded) ``im`` will hold at its peak."""
    w, h = im.size
    if im.format in _PER_PIXEL:
        return w * h * _PER_PIXEL[im.format]
    need = frame_bytes(im.mode, im.size)
    if im.mode in HIGH_DEPTH:          # to_mode scales these through a float64 copy
        need += w * h * 9
    if any(t[0] == "libtiff" for t in getattr(im, "tile", ()) or ()):
        need += file_size              # libtiff reads (maps) the whole file
    return need


class DecodeBudget:
    """A counting semaphore over bytes: ``reserve(n)`` waits until ``n`` more fit; one larger
    than the whole budget runs alone (callers refuse such files first). No wake-up order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self._used = 0
        self._cond = threading.Condition()

    @property
    def used(self) -> int:
        return self._used

    def set_capacity(self, capacity: int) -> None:
        with self._cond:
            self.capacity = int(capacity)
            self._cond.notify_all()

    @contextmanager
    def reserve(self, n: int) -> Iterator[None]:
        n = max(0, min(int(n), self.capacity))
        with self._cond:
            while self._used and self._used + n > self.capacity:
                self._cond.wait()
            self._used += n
        try:
            yield
        finally:
            with self._cond:
                self._used -= n
                self._cond.notify_all()


def _budget_from_env() -> int:
    raw = os.environ.get("DAS_DECODE_BUDGET_MB", "").strip()
    try:
        return int(float(raw) * 2 ** 20) if raw else DEFAULT_DECODE_BUDGET
    except ValueError:
        raise ValueError(f"DAS_DECODE_BUDGET_MB={raw!r}: expected a number of megabytes") from None


BUDGET = DecodeBudget(_budget_from_env())


def _libc(name: str, *argtypes: type) -> Any:
    """glibc's int function ``name``, or None (musl, macOS: nothing to do there)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn


_TRIM = _libc("malloc_trim", ctypes.c_size_t)
_MALLOPT = _libc("mallopt", ctypes.c_int, ctypes.c_int)
# glibc's mallopt parameter numbers (malloc.h) and the default a server restores
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
GLIBC_MMAP_MAX = 65536
SERVING_MMAP_THRESHOLD = 4 * 2 ** 20


def pin_mmap_threshold(nbytes: int = SERVING_MMAP_THRESHOLD) -> bool:
    """Serve every allocation of ``nbytes`` or more with its own mmap (False without glibc). Why:
    glibc raises its threshold as mmapped blocks are freed, then big blocks come from heaps that
    keep their high-water mark (four WebP searches: +177..214 MB, +114..122 pinned, issue 28).
    The heap's free top is trimmed above twice that (glibc's own rule when it moves the threshold):
    at its 128 KB floor every query gave its ~3 MB of working memory back and faulted it in again
    (~700 page faults, +1 ms a search). Servers only; it also undoes :func:`keep_freed_memory`."""
    return _MALLOPT is not None and all([_MALLOPT(M_MMAP_MAX, GLIBC_MMAP_MAX),
                                         _MALLOPT(M_TRIM_THRESHOLD, 2 * int(nbytes)),
                                         _MALLOPT(M_MMAP_THRESHOLD, int(nbytes))])


def keep_freed_memory() -> bool:
    """Every allocation from the heap, and freed memory kept for the next one (False without
    glibc): for a batch job that allocates the same large tensors step after step (training).
    Otherwise each tensor above glibc's 32 MB mmap ceiling is mapped anew, and every page of it
    faulted in and zeroed by the kernel: an EfficientNet-Lite1 forward pass at batch 32 on 2
    cores ran 2.28x slower, 0.77M page faults (benchmarks/training/malloc_policy.py). The process
    keeps its peak size until it exits, so servers pin the opposite (:func:`pin_mmap_threshold`)."""
    return _MALLOPT is not None and all([_MALLOPT(M_MMAP_MAX, 0),
                                         _MALLOPT(M_TRIM_THRESHOLD, 2 ** 31 - 1)])


def release_freed_memory() -> None:
    """``malloc_trim(0)``: glibc would keep a freed frame's 16 MB blocks in its heaps (0.6-2.9 GB)."""
    if _TRIM is not None:
        _TRIM(0)


def use_batch_budget() -> int:
    """This process's budget raised to :data:`BATCH_DECODE_BUDGET` unless ``DAS_DECODE_BUDGET_MB``
    chose one; the capacity now. Called by the batch CLIs' ``__main__`` blocks only, so a server
    (app.py) and a process that imports them (the tests) keep the default."""
    if not os.environ.get("DAS_DECODE_BUDGET_MB", "").strip():
        BUDGET.set_capacity(BATCH_DECODE_BUDGET)
    return BUDGET.capacity
