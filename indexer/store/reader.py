"""Ingest's reader: gallery files -> per-file outcomes and preprocessed arrays, read ahead. Each
file is read once (sha256, header size, decode from the same bytes) in a decode thread,
checked against a one-pass store :class:`~indexer.store.gallery.Snapshot`; :func:`prefetch` runs
the walk in a thread, so walking overlaps decoding and inference.
"""
from __future__ import annotations

import hashlib
import io
import os
import queue
import struct
import threading
import warnings
from typing import Any, Iterator, Sequence

import numpy as np

from embedder.folders import GalleryFile

from .gallery import NewItem, Snapshot, id_for_sha256

_PNG_SIG = b"\x89PNG\r\n\x1a\n"
_PNG_IHDR = struct.Struct(">4sII")


def header_size(data: bytes) -> tuple[int, int]:
    """Width and height from the header only: PNG's IHDR read directly, others through the
    guarded lazy open (embedder.containers); (0, 0) when unreadable (the decode names why)."""
    if len(data) >= 24 and data[:8] == _PNG_SIG:
        tag, w, h = _PNG_IHDR.unpack_from(data, 12)
        if tag == b"IHDR" and w > 0 and h > 0:
            return w, h
    from embedder import open_image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # the decoder's own open: refused formats and lying icons are never opened (Pillow's
            # ICO plugin decodes its frame inside Image.open)
            with open_image(io.BytesIO(data)) as im:
                return im.size
    except Exception:  # noqa: BLE001 - the embedder's load_image names the real reason
        return (0, 0)


# Outcome kinds of reading one file in a decode thread (plain ints: compared per image).
SKIP, UNCHANGED, TOUCH, KNOWN, DECODED, FAILED = range(6)


def read_chunk(chunk: Sequence[GalleryFile], snap: Snapshot, embedder: Any
               ) -> tuple[list[tuple[int, GalleryFile, Any, Any]], list[np.ndarray]]:
    """Read, hash, size and decode one chunk of files (in a decode thread): per-file ``(kind,
    file, item-or-reason, stat)`` in input order and the ``DECODED`` ones' arrays."""
    from embedder.images import ImageLoadError

    out: list[tuple[int, GalleryFile, Any, Any]] = []
    arrays: list[np.ndarray] = []
    paths, embedded = snap.paths, snap.embedded
    for f in chunk:
        if f.problem:
            out.append((SKIP, f, f.problem, None))
            continue
        rec = paths.get(f.relpath)
        try:
            if rec is not None and rec[0] in embedded:     # resume: the quick check needs no read
                st = os.stat(f.abspath)
                if rec[1] == st.st_size and rec[2] == st.st_mtime_ns:
                    out.append((UNCHANGED, f, None, None))
                    continue
            with open(f.abspath, "rb") as fh:   # one open: fstat + read on the same file
                st = os.fstat(fh.fileno())
                data = fh.read()
        except OSError as e:
            out.append((SKIP, f, f"unreadable: {e.strerror or e}", None))
            continue
        sha = hashlib.sha256(data).hexdigest()
        i = id_for_sha256(sha)
        if i in embedded and rec is not None and rec[0] == i:
            out.append((TOUCH, f, i, st))
            continue
        w, h = header_size(data)
        item = NewItem(f.relpath, f.label, data, sha, w, h, st.st_size, st.st_mtime_ns)
        if i in embedded:                       # content stored + embedded before this run
            out.append((KNOWN, f, item, None))
            continue
        try:
            arrays.append(embedder.prepare(data, name=f.relpath))
        except ImageLoadError as e:
            out.append((FAILED, f, (item, e.reason), None))
            continue
        except Exception as e:  # noqa: BLE001 - a decoder bug must not stop indexing
            out.append((FAILED, f, (item, f"{type(e).__name__}: {e}"), None))
            continue
        out.append((DECODED, f, item, None))
    return out, arrays


def prefetch(gen: Iterator[Any], depth: int) -> Iterator[Any]:
    """Run a generator in its own thread, ``depth`` items ahead (exceptions re-raised in the
    consumer)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def put(x: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in gen:
                if not put((None, item)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put((e, None))
            return
        put((None, done))

    t = threading.Thread(target=run, name="indexer-walk", daemon=True)
    t.start()
    try:
        while True:
            err, item = q.get()
            if err is not None:
                raise err
            if item is done:
                return
            yield item
    finally:
        stop.set()
        t.join(timeout=5)
