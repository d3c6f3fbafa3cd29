"""Do the store, ``index.faiss`` and the manifest agree on how many images the index holds? Each
file can be intact while together they are out of step (a writer stopped between the store commit
and ``index.faiss``): stored images no search returns. :func:`check_counts` is the one comparison
(``indexer info``, ``/api/health``), cheap enough per request (faiss's 16-byte header, LMDB's stat).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from ..directory.index_dir import IndexDir, manifest_stamp
from ..directory.lock import is_locked
from ..directory.manifest import Manifest
from ..directory.validate import damaged
from ..errors import IndexerError
from ..store.gallery import GalleryStore
from .layout import layout_of

_HEADER = struct.Struct("<4siq")   # fourcc, d (int32), ntotal (int64): every faiss index starts so


def repair_command(directory: str | Path) -> str:
    return f"python -m indexer repair --index {directory}"


@dataclass
class CountCheck:
    """The three counts of one index directory (``busy``: a writer works on it right now, so
    the counts are not compared; they are expected to differ until it finishes)."""

    directory: Path
    store: int = 0          # images in the gallery store
    embedded: int = 0       # of them, embedded by the index's model (what faiss should hold)
    faiss: int = 0          # vectors in index.faiss
    manifest: int = 0       # the manifest's "count"
    busy: bool = False
    faiss_name: str = "index.faiss"     # a sharded index: "its parts"

    @property
    def ok(self) -> bool:
        return self.busy or self.embedded == self.faiss == self.manifest

    @property
    def message(self) -> str:
        if self.busy:
            return f"index {self.directory} is being written; counts not compared"
        if self.ok:
            extra = (f" ({self.store - self.embedded} stored images have no embedding by this "
                     "model)" if self.store != self.embedded else "")
            return f"counts agree: {self.faiss} images in the store, {self.faiss_name} and the manifest{extra}"
        lost = self.embedded - self.faiss
        what = (f"; {lost} stored images can never be found" if lost > 0 else
                f"; {-lost} vectors in {self.faiss_name} have no stored image" if lost < 0 else "")
        return (f"index {self.directory}: counts differ: the store holds {self.store} images "
                f"({self.embedded} embedded by the index's model), {self.faiss_name} {self.faiss} "
                f"vectors, the manifest says {self.manifest}{what}; repair with "
                f"`{repair_command(self.directory)}`")


def faiss_ntotal(path: str | Path) -> int:
    """The vector count recorded in an index file's header, without loading the index."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except FileNotFoundError:
        raise IndexerError(f"{path}: index file missing; rebuild the index with "
                           "`python -m indexer build`") from None
    if len(raw) < _HEADER.size:
        raise damaged(path, "shorter than a faiss header")
    _, d, ntotal = _HEADER.unpack(raw)
    if d <= 0 or ntotal < 0:
        raise damaged(path, f"not a faiss index header (d={d}, ntotal={ntotal})")
    return int(ntotal)


def check_counts(directory: str | Path, store: GalleryStore | None = None) -> CountCheck:
    """Compare store, ``index.faiss`` and manifest counts of ``directory`` as on disk (``store``:
    an open one, else opened read-only); a writer at work makes the result ``busy``."""
    d = IndexDir(directory)
    if is_locked(d.path):
        return CountCheck(d.path, busy=True)
    stamp = manifest_stamp(d.path)
    layout = layout_of(d.path, d.read_manifest())
    d.refuse_shard(layout.manifest)
    if _neighbours_busy(d, layout.manifest, stamp):
        return CountCheck(d.path, busy=True)
    layout.check_sizes()
    held = [] if layout.held_file is None else [layout.held_file]
    n = sum(faiss_ntotal(f) for f in [p.faiss_file for p in layout.parts] + held)
    stored, embedded = layout.store_counts(n, store)
    if is_locked(d.path) or manifest_stamp(d.path) != stamp:
        return CountCheck(d.path, busy=True)
    return CountCheck(d.path, store=stored, embedded=embedded, faiss=n, manifest=layout.manifest.count,
                      faiss_name=layout.faiss_name)


def _neighbours_busy(d: IndexDir, manifest: Manifest, stamp: object) -> bool:
    """DBA's ``neighbours.npz`` checked as an open checks it, so ``indexer info`` and
    ``/api/health`` see what the next open would refuse; True: a writer was at work meanwhile."""
    from ..ann import neighbours

    try:
        neighbours.check(d.path, manifest, verify_hash=None)
    except IndexerError:
        if is_locked(d.path) or manifest_stamp(d.path) != stamp:
            return True
        raise
    return False
