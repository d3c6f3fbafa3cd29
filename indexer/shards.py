"""A sharded index: the shards stay where they were built, one manifest lists them, and they
are searched as one.

Layout (``indexer build --ray --sharded`` or ``indexer merge --sharded``)::

    OUT/manifest.json     the index's manifest, plus "sharded": {"shards": [...], "trained", "held"}
    OUT/trained.faiss     the trained empty index: the coarse quantizer all parts share
    OUT/held.faiss        the held-out tuning/check vectors (a small part of their own)
    OUT/model.onnx
    SHARD/store.lmdb      each shard's gallery store, where its task wrote it
    SHARD/part.faiss      its vectors in a copy of the trained index (``stream.fill``)

Shard paths are stored relative to OUT (``relative``: through ``..`` for shards beside it, so
the directory and its shards can move together and the manifest holds no server path), absolute
only when they share nothing with OUT but the root; ``serving.redact`` cuts those from answers.
``Index.open`` opens such a directory (:class:`indexer.layouts.Sharded`) as an
:class:`indexer.Index` whose faiss index is the parts as one (:class:`PartsIndex`,
``stream.as_one``: one shared quantizer, so results equal one merged index's) and whose store
reads each id from the shard that holds it (:class:`ShardedStore`), so serving, ``indexer
search`` and ``eval`` need nothing else.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import faiss
import numpy as np

from embedder.files import atomic_target
from embedder.hashing import file_sha256

from . import faiss_index as fx
from . import stream
from .errors import IndexerError
from .index_dir import MANIFEST, OWNER_FILE, PART_FILE, STORE_DIR, IndexDir
from .manifest import Manifest
from .searchable import Answer
from .store import GalleryStore
from .validate import check_faiss_file, check_lmdb, damaged, faiss_reason


def shard_paths(directory: Path, manifest: Manifest) -> list[Path]:
    """The shard folders (absolute, ``..`` folded: ``relative`` may name them through it)."""
    return [Path(os.path.normpath(Path(directory).absolute() / p)) for p in manifest.sharded["shards"]]


def relative(directory: Path, shard: Path) -> str:
    """How the manifest names a shard (or a file in one): relative to the index directory when
    inside it; relative through ``..`` when both lie under one folder other than the root (shards
    beside the index move with it, and the manifest names no server path); else absolute."""
    d, s = Path(directory).resolve(), Path(shard).resolve()
    try:
        return s.relative_to(d).as_posix()
    except ValueError:
        pass
    common = Path(os.path.commonpath([d, s]))
    if common == Path(common.anchor):           # nothing shared but "/": keep it absolute
        return str(s)
    return Path(os.path.relpath(s, d)).as_posix()


def file_records(out: Path, files: Sequence[Path]) -> dict:
    """Size and sha256 of each faiss file, checked on open (as ``index.faiss``'s record is)."""
    return {relative(out, f): {"bytes": f.stat().st_size, "sha256": file_sha256(f)} for f in files}


def check_files(directory: Path, manifest: Manifest, verify_hash: bool = True) -> None:
    """Every store and faiss file the manifest lists, before anything maps one (one line each)."""
    recs = manifest.sharded.get("files", {})
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
    """Refuse to build ``out`` over shards whose part belongs to another sharded index that
    still lists them (filling the parts again would rewrite the files that index searches and
    checks), in one line; otherwise nothing. ``record_owner`` marks them once built."""
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


# ---------------------------------------------------------------------------- reading
class ShardedStore:
    """The read side of ``GalleryStore`` over several shard stores: an id is read from the first
    shard that holds it (content in two shards is indexed once, by the first: ``stream.union``)."""

    def __init__(self, dirs: Sequence[Path]) -> None:
        self.stores = [GalleryStore(d / STORE_DIR) for d in dirs]
        self.path = dirs[0] / STORE_DIR if dirs else None

    def _owner(self, id: int) -> GalleryStore:
        for s in self.stores:
            if id in s:
                return s
        raise KeyError(f"id {id} is not in any shard store ({len(self.stores)} shards)")

    def __len__(self) -> int:
        return sum(len(s) for s in self.stores)

    def __contains__(self, id: object) -> bool:
        return any(id in s for s in self.stores)

    def get_meta(self, id: int) -> dict:
        return self._owner(int(id)).get_meta(int(id))

    def get_bytes(self, id: int) -> bytes:
        return self._owner(int(id)).get_bytes(int(id))

    def get_embeddings(self, model_hash: str, ids: Sequence[int]) -> np.ndarray:
        rows = [self._owner(int(i)).get_embeddings(model_hash, [int(i)])[0] for i in ids]
        return np.stack(rows) if rows else np.zeros((0, 0), dtype=np.float32)

    def id_for_path(self, rel_path: str) -> int | None:
        for s in self.stores:
            i = s.id_for_path(rel_path)
            if i is not None:
                return i
        return None

    def labels(self) -> list[str]:
        return sorted({lab for s in self.stores for lab in s.labels()})

    def ids_for_label(self, label: str) -> list[int]:
        seen: dict[int, None] = {}
        for s in self.stores:
            seen.update(dict.fromkeys(s.ids_for_label(label)))
        return list(seen)

    def models(self) -> list[str]:
        return sorted({m for s in self.stores for m in s.models()})

    def probe(self) -> None:
        for s in self.stores:
            s.probe()

    def close(self) -> None:
        for s in self.stores:
            s.close()


class PartsIndex:
    """The parts searched as one in this process (a :class:`indexer.searchable.Searchable`)."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        sh = manifest.sharded
        try:
            self.trained = faiss.read_index(str(directory / sh["trained"]))
            files = [p / PART_FILE for p in shard_paths(directory, manifest)] + [directory / sh["held"]]
            self.cpu_index = stream.open_parts(files, self.trained)
        except RuntimeError as e:
            raise damaged(directory, f"faiss cannot read a part ({faiss_reason(e)})") from None
        fx.set_search_params(self.cpu_index, manifest.search_params or "")
        self.d, self.ntotal = self.cpu_index.d, int(self.cpu_index.ntotal)

    summary = None                      # the whole index in RAM (memory-mapped parts)

    def missing(self) -> list[int]:
        return []

    def search(self, q: np.ndarray, k: int) -> Answer:
        q = np.ascontiguousarray(q, dtype=np.float32)
        return Answer(*self.cpu_index.search(q, max(1, min(int(k), max(1, self.ntotal)))))
