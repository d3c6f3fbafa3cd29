"""The two layouts of an index directory behind one :class:`Layout` protocol, chosen from its
manifest in one place (:func:`layout_of`): :class:`Single` (``store.lmdb``, ``index.faiss``: one
part) and :class:`Sharded` (a part per listed shard, ``store.lmdb`` + ``part.faiss``, and a
held-out part). Why parts: add, remove, repair, sync, retune, counts, describe and redact are one
walk over (store, faiss file) pairs, written once; nothing outside tells the layouts apart.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, Sequence

import faiss

from ..ann import neighbours
from ..ann.served import SearchableIndex
from ..directory.index_dir import PART_FILE, STORE_DIR, IndexDir
from ..directory.manifest import Manifest
from ..directory.shard_files import check_files, describe_changed, file_records, relative, shard_paths
from ..directory.validate import check_model_file, damaged, faiss_reason, read_faiss
from ..errors import IndexerError
from ..store.gallery import GalleryStore
from .shards import PartsIndex, ShardedStore


@dataclass(frozen=True)
class Part:
    """One store and the faiss file that indexes it: a single index's only part, or a shard
    (``shard``: its folder, which messages name; None for a single index's part)."""

    store_dir: Path
    faiss_file: Path
    shard: Path | None = None


class Layout(Protocol):
    """What every update, count and description of an index directory needs of its layout."""

    name: str
    d: IndexDir
    manifest: Manifest
    faiss_name: str                 # how count messages name the faiss side

    @property
    def parts(self) -> list[Part]: ...

    @property
    def held_file(self) -> Path | None: ...

    @property
    def checksums(self) -> str: ...

    def check(self, *, model: bool = False) -> None: ...

    def check_sizes(self) -> None: ...

    def open(self, *, device: str, check_model: bool, store: Any, mmap: bool,
             ray: Any = None) -> tuple[Any, Any, Any]: ...

    def as_one(self) -> faiss.Index: ...

    def records(self, changed: Sequence[Path]) -> dict: ...

    def store_counts(self, faiss_n: int, store: Any) -> tuple[int, int]: ...


class Single:
    """One store and one ``index.faiss`` in the directory (a shard, too: a store, no index yet)."""

    name = "single"
    faiss_name = "index.faiss"
    held_file = None

    def __init__(self, d: IndexDir, manifest: Manifest) -> None:
        self.d, self.manifest = d, manifest

    @property
    def parts(self) -> list[Part]:
        return [Part(self.d.store_dir, self.d.index_file)]

    @property
    def checksums(self) -> str:
        """``indexer info``'s line on the faiss file's recorded size and sha256."""
        rec = self.manifest.index_file
        return (f"index.faiss {rec.bytes} bytes, sha256 {rec.sha256[:16]} verified" if rec
                else "not recorded (built before checksums; rebuild to add one)")

    def check(self, *, model: bool = False) -> None:
        """Every file's check before anything maps one (a damaged file: one line naming it); an
        index.faiss without a recorded checksum (older manifests) is read by faiss instead."""
        m = self.manifest
        self.d.check(m, model=model)
        if not m.is_shard and not m.index_file:      # its dimension too: an add must not write the store first
            self.d.check_index_dim(read_faiss(self.d.index_file).d, m)

    def check_sizes(self) -> None:
        """Nothing to stat: index.faiss's count is read from its header by the caller."""

    def open(self, *, device: str, check_model: bool, store: Any, mmap: bool,
             ray: Any = None) -> tuple[Any, Any, Any]:
        """(store, faiss index, DBA neighbourhoods) of an :class:`indexer.Index`. ``ray``: only
        a sharded index is served over Ray (one actor per shard): here, one line saying so."""
        d, m = self.d, self.manifest
        d.refuse_shard(m)
        if ray is not None:
            raise IndexerError(f"{d.path}: --ray serves a sharded index (one Ray actor per shard); "
                               "this is a single index: serve it without --ray (or build it with "
                               "`indexer build --ray --sharded`)")
        self.check(model=check_model)
        try:
            fi = SearchableIndex(d.index_file, int(m.nprobe or 0), device, m.search_params or "", mmap=mmap)
        except RuntimeError as e:           # faiss's reader: a multi-line C++ message
            raise damaged(d.index_file, f"faiss cannot read it ({faiss_reason(e)})") from None
        _check_count(d, fi, m, "index holds", "rerun `indexer build` to repair it")
        nb = neighbours.read(d.path, m)      # checked like index.faiss: one line if damaged
        if not isinstance(store, GalleryStore):     # none, or a sharded index's before a rebuild
            store = GalleryStore(d.store_dir)
        return store, fi, nb

    def as_one(self) -> faiss.Index:
        return read_faiss(self.d.index_file)

    def records(self, changed: Sequence[Path]) -> dict:
        return {"index_file": self.d.index_record()} if changed else {}

    def store_counts(self, faiss_n: int, store: Any) -> tuple[int, int]:
        """(images stored, of them embedded by the index's model; counted only when the store's
        count differs from faiss's: a health check stays cheap). ``store``: the server's, kept open."""
        with nullcontext(store) if store is not None else GalleryStore(self.d.store_dir) as st:
            n = len(st)
            return n, (n if n == faiss_n else n - len(st.missing_embeddings(self.manifest.model_hash)))


class Sharded:
    """The parts stay in the shard folders the manifest lists (:mod:`indexer.layouts.shards`)."""

    name = "sharded"
    faiss_name = "its parts"

    def __init__(self, d: IndexDir, manifest: Manifest) -> None:
        self.d, self.manifest = d, manifest

    @property
    def parts(self) -> list[Part]:
        return [Part(p / STORE_DIR, p / PART_FILE, p) for p in shard_paths(self.d.path, self.manifest)]

    @property
    def checksums(self) -> str:
        return f"{len(self.manifest.sharded.files or {})} faiss files, sizes and sha256 verified"

    @property
    def held_file(self) -> Path:
        return self.d.path / self.manifest.sharded.held

    def check(self, *, model: bool = False) -> None:
        check_files(self.d.path, self.manifest)
        if model:
            check_model_file(self.d.model_file, self.manifest.model_hash)

    def check_sizes(self) -> None:
        """Each faiss file has the size its manifest records (a ``stat`` each: cheap for every health
        request; the sha256 is compared on open). A part rewritten by another ``merge --sharded`` over
        the same shard folder is named as such, not as a count mismatch that ``repair`` would not mend."""
        directory = self.d.path
        for rel, rec in (self.manifest.sharded.files or {}).items():
            f = directory / rel
            try:
                size = f.stat().st_size
            except FileNotFoundError:
                raise IndexerError(f"{f}: missing (the sharded index {directory} lists it); rebuild "
                                   "with `python -m indexer merge --sharded`") from None
            if rec.bytes is not None and size != rec.bytes:
                raise IndexerError(describe_changed(directory, f, size, rec.bytes))

    def open(self, *, device: str, check_model: bool, store: Any, mmap: bool,
             ray: Any = None) -> tuple[Any, Any, Any]:
        """``ray`` (an address or :class:`indexer.ray.fanout.RayServing`): the parts are searched by
        one Ray actor per shard (:class:`indexer.ray.fanout.Router`), not in this process."""
        self.check(model=check_model)
        if ray is not None:
            from ..ray.fanout import RayServing, Router

            fi: Any = Router(self.d.path, self.manifest, RayServing.of(ray))
        else:
            fi = PartsIndex(self.d.path, self.manifest)      # memory-mapped parts, always
        _check_count(self.d, fi, self.manifest, "its parts hold", "rerun the build to repair it")
        dirs = [p.shard for p in self.parts]
        if not (isinstance(store, ShardedStore) and [s.path for s in store.stores] == [p / STORE_DIR for p in dirs]):
            store = ShardedStore(dirs)
        return store, fi, None

    def as_one(self) -> faiss.Index:
        return PartsIndex(self.d.path, self.manifest).cpu_index

    def records(self, changed: Sequence[Path]) -> dict:
        """The manifest's ``sharded`` record with the changed files' sizes and sha256 (keys of
        older manifests, absolute, named as now)."""
        sh, d = self.manifest.sharded, self.d.path
        old = {relative(d, d / k): v for k, v in (sh.files or {}).items()}
        return {"sharded": replace(sh, files={**old, **file_records(d, changed)})}

    def store_counts(self, faiss_n: int, store: Any) -> tuple[int, int]:
        """The parts' count for both: content stored in two shards is indexed once, so the
        stores' total may exceed it legitimately, and counting distinct ids would read every
        key of every shard on each health check."""
        return faiss_n, faiss_n


def _check_count(d: IndexDir, fi: Any, m: Manifest, holds: str, fix: str) -> None:
    d.check_index_dim(fi.d, m)
    if fi.ntotal != m.count:
        raise IndexerError(f"{d.path}: {holds} {fi.ntotal} vectors but the manifest says {m.count}; {fix}")


def layout_of(directory: str | Path, manifest: Manifest | None = None) -> Layout:
    """The layout of ``directory``, from its manifest (read here unless given): the one place
    where single and sharded indexes are told apart."""
    d = IndexDir(directory)
    m = manifest if manifest is not None else d.read_manifest()
    return Sharded(d, m) if m.is_sharded else Single(d, m)


__all__ = ["Layout", "Part", "Single", "Sharded", "layout_of"]
