"""The two layouts of an index directory, chosen from its manifest in one place (:func:`layout_of`).

- :class:`Single` (``indexer build``, ``merge``): ``DIR/store.lmdb`` and ``DIR/index.faiss``
  (:mod:`indexer.index_dir`; updates in :mod:`indexer.build`).
- :class:`Sharded` (``merge --sharded``, ``build --ray --sharded``): ``DIR/trained.faiss`` and
  ``DIR/held.faiss``, and in each shard folder it lists ``store.lmdb`` and ``part.faiss``
  (:mod:`indexer.shards`; updates in :mod:`indexer.shard_build`).

Each layout opens itself (the store and faiss index an :class:`indexer.Index` searches), adds,
removes, repairs and describes itself. The library's update functions below dispatch here and
hold the directory's writer lock (:mod:`indexer.lock`) for both layouts alike, so a library
caller is as safe as the CLI (which only calls them). Every file name is in ``index_dir``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from . import neighbours
from .build import Change, add_single, remove_single, repair_single
from .consistency import CountCheck, check_counts
from .errors import IndexerError
from .faiss_index import SearchableIndex
from .index_dir import PART_FILE, STORE_DIR, IndexDir
from .lock import writer_lock
from .manifest import Manifest
from .shard_build import add_sharded, remove_sharded, repair_sharded
from .shards import PartsIndex, ShardedStore, check_files, shard_paths
from .store import GalleryStore
from .validate import check_model_file, damaged, faiss_reason, read_faiss


class Single:
    """One store and one ``index.faiss`` in the directory (a shard, too: a store, no index yet)."""

    name = "single"

    def __init__(self, d: IndexDir, manifest: Manifest) -> None:
        self.d, self.manifest = d, manifest

    def store_dirs(self) -> list[Path]:
        return [self.d.store_dir]

    def check(self, *, model: bool = False) -> None:
        """Every file's check before anything maps one (a damaged file: one line naming it)."""
        self.d.check(self.manifest, model=model)

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

    def add(self, folder: Path, model: str | Path | None = None, **kw: Any) -> Change:
        return add_single(self.d, self.manifest, folder, model, **kw)

    def remove(self, targets: Sequence[str]) -> Change:
        return remove_single(self.d, self.manifest, targets)

    def repair(self, **kw: Any) -> Change:
        return repair_single(self.d, self.manifest, **kw)

    def info(self) -> dict:
        """``indexer info``'s facts: the store's sizes and the three counts (None for a shard)."""
        m = self.manifest
        self.check(model=not m.is_shard)
        if not m.is_shard and not m.index_file:    # no checksum recorded: let faiss read it
            read_faiss(self.d.index_file)
        with GalleryStore(self.d.store_dir) as st:
            store = {"items": len(st), "labels": len(st.labels()), "models": len(st.models())}
            counts = None if m.is_shard else check_counts(self.d.path, store=st)
        return {"store": store, "counts": counts}


class Sharded(Single):
    """The parts stay in the shard folders the manifest lists (:mod:`indexer.shards`)."""

    name = "sharded"

    def store_dirs(self) -> list[Path]:
        return [p / STORE_DIR for p in self.shards]

    @property
    def shards(self) -> list[Path]:
        return shard_paths(self.d.path, self.manifest)

    def check(self, *, model: bool = False) -> None:
        check_files(self.d.path, self.manifest)
        if model:
            check_model_file(self.d.model_file, self.manifest.model_hash)

    def open(self, *, device: str, check_model: bool, store: Any, mmap: bool,
             ray: Any = None) -> tuple[Any, Any, Any]:
        """``ray`` (an address or :class:`indexer.fanout.RayServing`): the parts are searched by
        one Ray actor per shard (:class:`indexer.fanout.Router`), not in this process."""
        self.check(model=check_model)
        if ray is not None:
            from .fanout import RayServing, Router

            fi: Any = Router(self.d.path, self.manifest, RayServing.of(ray))
        else:
            fi = PartsIndex(self.d.path, self.manifest)      # memory-mapped parts, always
        _check_count(self.d, fi, self.manifest, "its parts hold", "rerun the build to repair it")
        dirs = self.shards
        if not (isinstance(store, ShardedStore) and [s.path for s in store.stores] == [p / STORE_DIR for p in dirs]):
            store = ShardedStore(dirs)
        return store, fi, None

    def add(self, folder: Path, model: str | Path | None = None, **kw: Any) -> Change:
        self.check()
        return add_sharded(self.d, self.manifest, folder, model, **kw)

    def remove(self, targets: Sequence[str]) -> Change:
        self.check()
        return remove_sharded(self.d, self.manifest, targets)

    def repair(self, **kw: Any) -> Change:
        self.check()
        return repair_sharded(self.d, self.manifest, **kw)

    def info(self) -> dict:
        """Per shard: where it is and how many images its store and its part hold; the counts."""
        import faiss

        self.check(model=True)
        shards = []
        for p in self.shards:
            with GalleryStore(p / STORE_DIR) as st:
                items = len(st)
            part = faiss.read_index(str(p / PART_FILE), faiss.IO_FLAG_MMAP)
            shards.append({"path": str(p), "images": items, "vectors": int(part.ntotal)})
        held = faiss.read_index(str(self.d.path / self.manifest.sharded["held"]), faiss.IO_FLAG_MMAP)
        return {"shards": shards, "held": int(held.ntotal), "counts": check_counts(self.d.path)}


def _check_count(d: IndexDir, fi: Any, m: Manifest, holds: str, fix: str) -> None:
    d.check_index_dim(fi.d, m)
    if fi.ntotal != m.count:
        raise IndexerError(f"{d.path}: {holds} {fi.ntotal} vectors but the manifest says {m.count}; {fix}")


Layout = Single     # the type of both (Sharded is a Single with other files)


def layout_of(directory: str | Path, manifest: Manifest | None = None) -> Layout:
    """The layout of ``directory``, from its manifest (read here unless given): the one place
    where single and sharded indexes are told apart."""
    d = IndexDir(directory)
    m = manifest if manifest is not None else d.read_manifest()
    return (Sharded if m.is_sharded else Single)(d, m)


# ---------------------------------------------------------------------------- the library's face
def add_images(directory: str | Path, folder: str | Path, model: str | Path | None = None, *,
               prefix: str = "", batch_size: int = 32, workers: int | None = None, device: str = "auto",
               progress: bool = True, wait: bool = False) -> Change:
    """``indexer add``: ingest another folder and add its new images to the index (either
    layout), holding the directory's writer lock throughout (``wait``: wait for another writer).
    The manifest is read once, under the lock (the latest writer's)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise IndexerError(f"{folder}: folder not found")
    with _locked(directory, "indexer add", wait):
        return layout_of(directory).add(folder, model, prefix=prefix, batch_size=batch_size,
                                        workers=workers, device=device, progress=progress)


def remove_items(directory: str | Path, targets: Sequence[str], *, wait: bool = False) -> Change:
    """``indexer remove``: each target is an id or a stored relative path (either layout), under
    the directory's writer lock. ``Change.messages``: one line per removal."""
    with _locked(directory, "indexer remove", wait):
        return layout_of(directory).remove(targets)


def repair_index(directory: str | Path, *, batch_size: int = 32, workers: int | None = None,
                 device: str = "auto", progress: bool = True, wait: bool = False) -> Change:
    """``indexer repair``: bring the faiss index(es) and the manifest in step with the store(s)
    (embed what the index's model has not embedded, add/drop vectors, retune), under the
    writer lock. What ``indexer info`` names when the counts differ; needs no gallery folder."""
    with _locked(directory, "indexer repair", wait):
        return layout_of(directory).repair(batch_size=batch_size, workers=workers, device=device,
                                           progress=progress)


def info(directory: str | Path, *, deep: bool = False) -> dict:
    """``indexer info``'s facts: ``manifest``, ``layout``, the layout's own (``store`` or
    ``shards``/``held``) and ``counts`` (a :class:`CountCheck`; None for a shard). ``deep``:
    read every record of every store first (``deep``: records per store); a page LMDB cannot
    read raises in one line naming the file."""
    layout = layout_of(directory)
    facts = {"manifest": layout.manifest, "layout": layout.name, **layout.info()}   # files checked
    if deep:
        facts["deep"] = {str(s): _walk(s) for s in layout.store_dirs()}
    return facts


def _walk(store_dir: Path) -> dict[str, int]:
    with GalleryStore(store_dir) as st:
        return st.walk()


def _locked(directory: str | Path, command: str, wait: bool) -> Any:
    """The writer lock of an index directory that exists (no index there: say so, and create
    no lock file)."""
    IndexDir(directory).require()
    return writer_lock(directory, command, wait=wait)


__all__ = ["Single", "Sharded", "Layout", "layout_of", "Change", "CountCheck", "add_images",
           "remove_items", "repair_index", "info"]
