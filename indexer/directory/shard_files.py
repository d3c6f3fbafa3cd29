"""A sharded index's files: where its shards are (paths relative to the index directory), the
size and sha256 recorded for each faiss file, and which sharded index owns a shard's part."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from embedder.files import atomic_target
from embedder.hashing import file_sha256

from ..errors import IndexerError
from .index_dir import MANIFEST, OWNER_FILE, PART_FILE, STORE_DIR, IndexDir
from .manifest import FileRecord, Manifest
from .validate import check_faiss_file, check_lmdb


def shard_paths(directory: Path, manifest: Manifest) -> list[Path]:
    """The shard folders (absolute, ``..`` folded: ``relative`` may name them through it)."""
    return [Path(os.path.normpath(Path(directory).absolute() / p)) for p in manifest.sharded.shards]


def relative(directory: Path, shard: Path) -> str:
    """How the manifest names a shard (or a file in one): relative to the index directory when
    inside it, through ``..`` when both lie under one folder other than the root, else absolute."""
    d, s = Path(directory).resolve(), Path(shard).resolve()
    try:
        return s.relative_to(d).as_posix()
    except ValueError:
        pass
    common = Path(os.path.commonpath([d, s]))
    if common == Path(common.anchor):           # nothing shared but "/": keep it absolute
        return str(s)
    return Path(os.path.relpath(s, d)).as_posix()


def file_records(out: Path, files: Sequence[Path]) -> dict[str, FileRecord]:
    """Size and sha256 of each faiss file, checked on open (as ``index.faiss``'s record is)."""
    return {relative(out, f): FileRecord(bytes=f.stat().st_size, sha256=file_sha256(f)) for f in files}


def check_files(directory: Path, manifest: Manifest, verify_hash: bool = True) -> None:
    """Every store and faiss file the manifest lists, before anything maps one (one line each)."""
    recs = manifest.sharded.files or {}
    for s in shard_paths(directory, manifest):
        check_lmdb(s / STORE_DIR)
    for rel, rec in recs.items():
        check_faiss_file(directory / rel, rec, verify_hash=verify_hash)


def describe_changed(directory: Path, f: Path, size: int, recorded: int) -> str:
    """The one line for a part file that is not the one this index was built with."""
    owner = part_owner(f.parent) if f.name == PART_FILE else None
    by = (f"; the sharded index {owner} was built over the same shard folder since and rewrote it"
          if owner is not None and owner != Path(directory).resolve() else "")
    return (f"{f}: overwritten since the sharded index {directory} was built ({size} bytes, its "
            f"manifest records {recorded}){by}; rebuild with `python -m indexer merge --sharded "
            f"... --out {directory}`")


# ---------------------------------------------------------------------------- part ownership
def part_owner(shard: Path) -> Path | None:
    """The sharded index that last wrote ``shard``'s part.faiss (its resolved directory), if any."""
    try:
        return Path(json.loads((Path(shard) / OWNER_FILE).read_text())["index"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def claim_parts(out: Path, shards: Sequence[Path]) -> None:
    """Refuse, in one line, to build ``out`` over shards whose part another sharded index still
    lists (it would rewrite files that index searches); ``record_owner`` marks them once built."""
    me = Path(out).resolve()
    for s in shards:
        owner = part_owner(s)
        if owner is None or owner == me or not (owner / MANIFEST).is_file():
            continue
        try:
            m = IndexDir(owner).read_manifest()
        except IndexerError:
            continue                                    # not a readable index any more: free
        if m.is_sharded and Path(s).resolve() in [p.resolve() for p in shard_paths(owner, m)]:
            raise IndexerError(f"{s}: its {PART_FILE} belongs to the sharded index {owner}, which "
                               f"searches it; building {out} over the same shard folder would "
                               f"rewrite it under that index: merge into {owner} again, or copy "
                               "the shard folders first")


def record_owner(out: Path, shards: Sequence[Path]) -> None:
    for s in shards:
        with atomic_target(Path(s) / OWNER_FILE) as tmp:
            Path(tmp).write_text(json.dumps({"index": str(Path(out).resolve())}) + "\n")
