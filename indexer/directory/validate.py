"""Checks of an index directory's files before anything opens them: a damaged file ends in one
line naming it and the repair, never a signal or a traceback. LMDB maps ``data.mdb`` (a file
shorter than its meta page says: SIGBUS at the first read past the end), so its meta pages are
read with plain I/O and the size compared first; ``index.faiss``'s size and sha256 and
``model.onnx``'s hash are compared with the manifest's (``IndexDir`` decides which apply).
"""
from __future__ import annotations

import shlex
import struct
from pathlib import Path

from embedder.hashing import file_sha256

from ..errors import IndexerError
from .manifest import FileRecord

REPAIR = "rebuild the index with `python -m indexer build`"

# LMDB 0.9 data file: pages 0 and 1 are meta pages. A page starts with a 16-byte header
# (pgno u64, pad u16, flags u16, lower/upper u16 u16); the meta body follows:
#   magic u32, version u32, address u64, mapsize u64, dbs[2] (48 bytes each), last_pg u64, txnid u64
# and the page size is stored in dbs[0].md_pad (the free DB's pad). Native byte order.
_PAGEHDR = 16
_META = struct.Struct("=IIQQ48s48sQQ")
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_P_META = 0x08


def damaged(path: Path | str, what: str, fix: str = REPAIR) -> IndexerError:
    """The one-line error for a damaged index file."""
    return IndexerError(f"{path}: {what}; the index is damaged: {fix}")


def rebuild_hint(gallery: str | None, out: Path | str) -> str:
    """The build command that makes an index file again from what the store holds (nothing
    embedded again), naming the gallery the manifest recorded; else the generic advice."""
    if not gallery:
        return REPAIR
    return (f"rebuild the index with `python -m indexer build {shlex.quote(gallery)} --out "
            f"{shlex.quote(str(out))}` (the stored images are not embedded again)")


def _read_meta(f, offset: int) -> tuple[int, int, int, int] | None:
    """(page size, last page, txnid, mapsize) of the meta page at ``offset``, or None."""
    f.seek(offset)
    raw = f.read(_PAGEHDR + _META.size)
    if len(raw) < _PAGEHDR + _META.size:
        return None
    flags = struct.unpack_from("=H", raw, 10)[0]
    magic, version, _addr, mapsize, free_db, _main_db, last_pg, txnid = _META.unpack_from(raw, _PAGEHDR)
    if magic != _MAGIC or version != _DATA_VERSION or not flags & _P_META:
        return None
    psize = struct.unpack_from("=I", free_db, 0)[0]
    return psize, last_pg, txnid, mapsize


def check_lmdb(store_dir: str | Path) -> None:
    """Refuse a ``data.mdb`` that LMDB would crash on: not LMDB, or shorter than the last used
    page of its newest meta page says (a writer grows the file before committing a meta page, so
    this holds while ``indexer add`` writes)."""
    path = Path(store_dir) / "data.mdb"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            first = _read_meta(f, 0)
            if first is None:
                raise damaged(path, "not an LMDB data file (bad or missing meta page)")
            psize = first[0]
            if psize < 512 or psize & (psize - 1) or psize > 1 << 16:
                raise damaged(path, f"not an LMDB data file (page size {psize})")
            second = _read_meta(f, psize)
    except FileNotFoundError:
        raise IndexerError(f"{path}: gallery store missing; {REPAIR}") from None
    except OSError as e:
        raise IndexerError(f"{path}: unreadable ({e.strerror or e})") from None
    metas = [m for m in (first, second) if m is not None and m[0] == psize]
    _, last_pg, _, _ = max(metas, key=lambda m: m[2])
    need = (last_pg + 1) * psize
    if size < need:
        raise damaged(path, f"truncated ({size} bytes, its LMDB meta page needs {need})")


def check_faiss_file(path: str | Path, rec: FileRecord, *, verify_hash: bool = True, fix: str = REPAIR) -> None:
    """``index.faiss`` exists and has the size (and sha256) the manifest recorded (``rec``);
    older manifests without checksums get existence and non-empty only. ``fix``: the advice."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise IndexerError(f"{path}: index file missing; {fix}") from None
    if size == 0:
        raise damaged(path, "empty file", fix)
    if rec.bytes is not None and size != rec.bytes:
        raise damaged(path, f"{size} bytes, the manifest recorded {rec.bytes} (truncated or "
                            f"overwritten)", fix)
    if verify_hash and rec.sha256 is not None:
        sha = file_sha256(path)
        if sha != rec.sha256:
            raise damaged(path, f"sha256 {sha[:12]} differs from the manifest's {rec.sha256[:12]}", fix)


def read_faiss(path: str | Path):
    """faiss.read_index, with faiss's multi-line C++ error turned into the one-line repair hint."""
    import faiss

    try:
        return faiss.read_index(str(path))
    except RuntimeError as e:
        raise damaged(path, f"faiss cannot read it ({faiss_reason(e)})") from None


def faiss_reason(e: BaseException) -> str:
    """The informative tail of a faiss C++ error ("Error in <signature> at <file>: Error: ...")."""
    text = " ".join(str(e).split())
    return (text.rsplit("Error: ", 1)[-1] or "unreadable")[:160]


def check_model_file(path: str | Path, want: str | None) -> None:
    """``model.onnx`` is there and is the model (hash ``want``) the index was built with."""
    path = Path(path)
    if not path.is_file():
        raise IndexerError(f"{path}: model file missing (the index's embedder; image queries need it); "
                           f"{REPAIR}")
    if want and file_sha256(path) != want:
        raise damaged(path, f"model differs from the one the index was built with ({want[:12]})")
