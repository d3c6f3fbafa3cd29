"""``indexer add/remove/repair/info``, written once against :class:`Layout`: each update walks
the layout's (store, faiss file) parts and ends in one :func:`sync`, under the writer lock with
the manifest read once, so a library caller is as safe as the CLI."""
from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import faiss
import numpy as np

from embedder.folders import GalleryFile, one_file, walk_gallery
from embedder.hashing import file_sha256
from embedder.images import is_listed
from embedder.knn import drop_self

from ..ann import faiss_index as fx
from ..ann import neighbours, stream
from ..ann.tuning import K, heldout_size, tune
from ..directory.index_dir import IndexDir, now_utc
from ..directory.lock import writer_lock
from ..directory.manifest import Manifest, NeighboursRecord
from ..directory.model import load_embedder
from ..errors import IndexerError
from ..layouts.counts import CountCheck, check_counts, faiss_ntotal
from ..layouts.layout import Layout, Part, layout_of
from ..store.gallery import GalleryStore, id_for_sha256
from ..store.ingest import IngestStats, embed_missing, ingest
from ..store.lmdb_faults import DiskFullError
from ..store.sources import Rows, StoreSource


@dataclass
class Change:
    """What ``indexer add/remove/repair`` did to an index (either layout): the manifest written
    and the counts the CLI prints."""

    manifest: Manifest
    added: int = 0                  # faiss vectors added
    removed: int = 0                # faiss vectors dropped
    embedded: int = 0               # stored images embedded by repair
    messages: list[str] = field(default_factory=list)     # remove: one line per target
    stats: IngestStats | None = None                       # add: the ingest's counts
    shard: Path | None = None       # a sharded index's add: the shard the images went to


# ---------------------------------------------------------------------------- the library's face
def add_images(directory: str | Path, folder: str | Path, model: str | Path | None = None, *,
               prefix: str = "", batch_size: int = 32, workers: int | None = None, device: str = "auto",
               progress: bool = True, wait: bool = False) -> Change:
    """``indexer add``: ingest another folder (or one image file) into the part whose store holds
    the fewest images and sync, under the writer lock (``wait``: wait for another writer)."""
    folder = Path(folder)
    if folder.is_file() and is_listed(folder.name):
        found = [one_file(folder, prefix)]
    elif folder.is_dir():
        found = list(walk_gallery(folder, prefix=prefix))
    else:
        raise IndexerError(f"{folder}: " + ("not an image file name" if folder.is_file()
                                            else "no such folder or image"))
    with _locked(directory, "indexer add", wait):
        layout = _ready(layout_of(directory))
        emb = update_embedder(layout.d, layout.manifest, model, device, batch_size)
        target = min(layout.parts, key=_stored)
        files = not_replacing(found, layout.parts)
        with GalleryStore(target.store_dir, readonly=False) as store:
            stats = ingest_folder(store, folder, files, emb, target.faiss_file, workers, progress)
        layout.d.write_report(stats.skipped)
        return dataclasses.replace(sync(layout), stats=stats, shard=target.shard)


def remove_items(directory: str | Path, targets: Sequence[str], *, wait: bool = False) -> Change:
    """``indexer remove``: each target is an id or a stored relative path, removed from every
    part's store that holds it, under the writer lock. ``Change.messages``: one line per removal."""
    with _locked(directory, "indexer remove", wait):
        layout = _ready(layout_of(directory))
        with ExitStack() as opened:
            stores = [(opened.enter_context(GalleryStore(p.store_dir, readonly=False)),
                       f" from {p.shard}" if p.shard else "") for p in layout.parts]
            msgs = remove_targets(stores, targets, layout.d.path)
        return dataclasses.replace(sync(layout), messages=msgs)


def repair_index(directory: str | Path, *, batch_size: int = 32, workers: int | None = None,
                 device: str = "auto", progress: bool = True, wait: bool = False) -> Change:
    """``indexer repair``: embed what the model has not embedded, then :func:`sync` the faiss
    files and the manifest to the store(s), under the writer lock; needs no gallery folder."""
    with _locked(directory, "indexer repair", wait):
        layout = _ready(layout_of(directory))
        emb = update_embedder(layout.d, layout.manifest, None, device, batch_size)
        embedded = 0
        for p in layout.parts:
            with GalleryStore(p.store_dir, readonly=False) as store:
                embedded += embed_missing(store, emb, workers=workers, progress=progress)
        return dataclasses.replace(sync(layout), embedded=embedded)


def info(directory: str | Path, *, deep: bool = False) -> dict:
    """``indexer info``'s facts: ``manifest``, ``layout``, ``store``, ``parts`` (shard folder or
    None, images, vectors), ``held``, ``checksums`` and ``counts`` (None for a shard). ``deep``:
    read every record of every store first (an unreadable page: one line naming the file)."""
    layout = layout_of(directory)
    m = layout.manifest
    layout.check(model=not m.is_shard)
    parts, labels, models, items, walked = [], set(), set(), 0, {}
    for p in layout.parts:
        with GalleryStore(p.store_dir) as st:
            if deep:
                walked[str(p.store_dir)] = st.walk()
            items += len(st)
            labels.update(st.labels())
            models.update(st.models())
            parts.append({"shard": p.shard and str(p.shard), "images": len(st),
                          "vectors": None if m.is_shard else faiss_ntotal(p.faiss_file)})
    held = layout.held_file
    facts = {"manifest": m, "layout": layout.name, "parts": parts,
             "store": {"items": items, "labels": len(labels), "models": len(models)},
             "held": None if held is None else faiss_ntotal(held), "checksums": layout.checksums,
             "counts": None if m.is_shard else check_counts(layout.d.path)}
    return {**facts, "deep": walked} if deep else facts


def _ready(layout: Layout) -> Layout:
    """A layout an update may touch: not a shard, every file checked (a damaged one refused in
    one line before any store is written)."""
    layout.d.refuse_shard(layout.manifest)
    layout.check()
    return layout


def _stored(part: Part) -> int:
    with GalleryStore(part.store_dir) as st:
        return len(st)


def _locked(directory: str | Path, command: str, wait: bool) -> Any:
    """The writer lock of an index directory that exists (no index there: say so, and create
    no lock file)."""
    IndexDir(directory).require()
    return writer_lock(directory, command, wait=wait)


# ---------------------------------------------------------------------------- the steps
def update_embedder(d: IndexDir, manifest: Manifest, model: str | Path | None, device: str,
                    batch_size: int) -> Any:
    """The embedder of an update: ``model`` (default the index's copy), refused in one line
    unless it is the model the index was built with."""
    path = Path(model) if model is not None else d.model_file
    emb = load_embedder(path, device=device, batch_size=batch_size)
    d.check_embedder(emb, manifest, path)
    return emb


def not_replacing(files: list[GalleryFile], parts: Sequence[Part]) -> list[GalleryFile]:
    """``files`` with those whose path the index holds with other content set aside as problems:
    ``add`` never replaces an image (a build does, for a gallery file that changed), since two
    folders' ``dogs/IMG_0001.jpg`` are two photos; before 2026-11-30 the second one silently took
    the first one's place. A path whose size and mtime are the stored ones is the same file."""
    taken: dict[str, list[tuple[int, int, int]]] = {}
    for p in parts:
        with GalleryStore(p.store_dir) as st:
            for f in files:
                rec = None if f.problem else st.path_record(f.relpath)
                if rec is not None:
                    taken.setdefault(f.relpath, []).append(rec)
    out = []
    for f in files:
        recs = taken.get(f.relpath)
        if recs:
            try:
                st_ = f.abspath.stat()
                same = any(r[1:] == (st_.st_size, st_.st_mtime_ns) for r in recs) or \
                    id_for_sha256(file_sha256(f.abspath)) in {r[0] for r in recs}
            except OSError:
                same = True             # unreadable: the reader reports it
            if not same:
                f = dataclasses.replace(f, problem=(
                    f"not added: the index holds another image at {f.relpath}; add the folder with --prefix NAME "
                    f"(stored as NAME/...), or run `indexer remove {f.relpath}` first (a gallery file that changed: "
                    "`indexer build` updates it)"))
        out.append(f)
    return out


def ingest_folder(store: GalleryStore, folder: Path, files: list[GalleryFile], emb: Any, rewritten: Path,
                  workers: int | None, progress: bool) -> IngestStats:
    """``indexer add``'s ingest of ``folder``'s ``files``; a full disk is told with what the whole
    command needs (:func:`space_needed`; ``rewritten``: the faiss file the add rewrites beside itself)."""
    if not files:
        raise IndexerError(f"{folder}: no images to add")
    try:
        return ingest(store, files, emb, workers=workers, progress=progress)
    except DiskFullError as e:
        raise e.needing(space_needed(files, emb.dim, rewritten)) from None


def space_needed(files: Sequence[GalleryFile], dim: int, index_file: Path | None = None) -> int:
    """About what adding ``files`` takes on disk (an upper bound): their bytes, an embedding and
    ~1 KB of keys each, and a second copy of ``index_file`` (rewritten beside itself)."""
    total = 0
    for f in files:
        if f.problem is None:
            try:
                total += f.abspath.stat().st_size + 4 * dim + 1024
            except OSError:
                pass
    if index_file is not None and index_file.exists():
        total += index_file.stat().st_size + len(files) * (4 * dim + 8)
    return int(total)


def remove_targets(stores: Sequence[tuple[GalleryStore, str]], targets: Sequence[str], where: Path) -> list[str]:
    """Remove each target (a stored path, a folder "dogs/": every path under it, else an id) from
    every store that holds it, one line each; all are looked up first, so an unknown one refuses
    the command and nothing goes."""
    def holds(store: GalleryStore, t: str) -> bool:
        if t.endswith("/"):
            return bool(store.paths_under(t))
        return store.id_for_path(t) is not None or (t.isdigit() and int(t) in store)

    for t in targets:
        if not any(holds(s, t) for s, _ in stores):
            under = 0 if t.endswith("/") else sum(len(s.paths_under(t.rstrip("/\\") + "/")) for s, _ in stores)
            raise IndexerError(f"{t}: no such id or path in {where}" + (
                " (a folder: no stored path under it)" if t.endswith("/") else
                f"; the folder {t}/ holds {under} stored images: write {t}/ to remove them all" if under else ""))
    msgs = []
    for t in targets:
        for store, suffix in stores:
            if t.endswith("/"):
                paths = store.paths_under(t)
                if paths:
                    gone = store.remove_paths(paths)
                    msgs.append(f"removed {len(paths)} paths under {t}{suffix} ({gone} images left the index)")
            elif store.id_for_path(t) is not None:
                i, gone = store.remove_path(t)  # type: ignore[misc]
                msgs.append(f"removed {t} (id {i}){suffix}" if gone else
                            f"removed path {t}{suffix}; its content (id {i}) stays under another path")
            elif t.isdigit() and int(t) in store:
                store.remove_id(int(t))
                msgs.append(f"removed id {t}{suffix}")
    return msgs


def sync(layout: Layout, *, seed: int = 0) -> Change:
    """Make each part's faiss file hold exactly its share of the stores (the first part whose
    store holds an id owns it), rewrite what changes, retune if any did, write the manifest.
    Idempotent: it also repairs a crash between a commit and a faiss rewrite."""
    m, d = layout.manifest, layout.d
    sources = [StoreSource(p.store_dir, m.model_hash, m.dim) for p in layout.parts]
    try:
        stored = [s.ids() for s in sources]
        everywhere = np.unique(np.concatenate(stored))
        if len(everywhere) == 0:
            raise IndexerError(f"{d.path}: the index would be empty; rebuild it with `indexer build`")
        changed: list[Path] = []
        taken, added, removed = np.zeros(0, np.int64), 0, 0
        if layout.held_file is not None:
            held = faiss.read_index(str(layout.held_file))
            held_ids = fx.index_ids(held)
            gone = np.setdiff1d(held_ids, everywhere)
            if len(gone):
                held.remove_ids(gone)
                fx.write_atomic(held, layout.held_file)
                changed.append(layout.held_file)
            taken, removed = np.intersect1d(held_ids, everywhere), len(gone)
        wants = []
        for part, ids, src in zip(layout.parts, stored, sources):
            want = np.setdiff1d(ids, taken)
            taken = np.union1d(taken, want)
            wants.append(want)
            new, stale = _sync_part(part.faiss_file, want, src)
            if new or stale:
                changed.append(part.faiss_file)
                added, removed = added + new, removed + stale
        fields: dict = {"count": int(len(taken))}
        if changed and m.index_type != "flat":
            fields.update(retune(layout, stored, taken, sources, seed=seed))
        if m.neighbours:
            fields["neighbours"] = _sync_neighbours(d, m, wants, sources)
    finally:
        for s in sources:
            s.close()
    written = d.write_manifest(m.replace(**fields, **layout.records(changed), updated_at=now_utc()))
    return Change(written, added=int(added), removed=int(removed))


def _sync_part(faiss_file: Path, want: np.ndarray, src: StoreSource) -> tuple[int, int]:
    """(added, dropped): ``faiss_file`` rewritten to hold exactly ``want`` (read from ``src``)."""
    index = faiss.read_index(str(faiss_file))
    have = fx.index_ids(index)
    stale, new = np.setdiff1d(have, want), np.setdiff1d(want, have)
    if len(stale):
        kept = np.intersect1d(have, want)
        fx.remove(index, stale, lambda: (src.get(kept), kept))
    if len(new):
        fx.add(index, src.get(new), new)
    if len(stale) or len(new):
        fx.write_atomic(index, faiss_file)
    return len(new), len(stale)


def retune(layout: Layout, per_part: list[np.ndarray], ids: np.ndarray, sources: Sequence[StoreSource],
           seed: int = 0) -> dict:
    """After an update: the search parameter retuned to the target with the build's margin on
    self-queries drawn from the stores (own id dropped; no held-out set), exact answers from one
    pass over the stores (``stream.exact_truth``)."""
    m = layout.manifest
    n = len(ids)
    own = np.sort(np.random.default_rng(seed + 1).choice(ids, size=min(max(1, heldout_size(n, m.dim)), n),
                                                         replace=False))
    seen, dups = np.zeros(0, np.int64), []
    for s_ids in per_part:                     # an id counts once: in the first store holding it
        dups.append(np.intersect1d(s_ids, seen))
        seen = np.union1d(seen, s_ids)
    owner = np.full(len(own), -1, dtype=np.int64)
    for i, s_ids in enumerate(per_part):
        owner[(owner < 0) & np.isin(own, s_ids)] = i
    q = Rows(own, owner, sources)[np.arange(len(own))]
    k = min(K, n - 1) if n > 1 else 1
    truth = drop_self(stream.exact_truth(sources, q, min(k + 1, n), exclude=np.zeros(0, np.int64), dups=dups),
                      own, k)[0]
    spec = fx.IndexSpec.from_manifest(m)
    value, rq = tune(layout.as_one(), spec, q, truth, m.target_recall, own=own)
    recall = round(float(rq.mean()), 4)
    return {"nprobe": int(value) if spec.nlist else 0, "search_params": spec.search_params(value),
            "recall_at_10": recall, "tuning_recall_at_10": recall, "tuning_queries": int(len(own)),
            "heldout_queries": 0}


def _sync_neighbours(d: IndexDir, manifest: Manifest, wants: list[np.ndarray],
                     sources: Sequence[StoreSource]) -> NeighboursRecord:
    """The DBA neighbourhoods brought to the store's items (:func:`neighbours.update`, equal to a
    fresh build's); a missing or damaged file is rebuilt whole."""
    rec = manifest.neighbours
    ids = np.concatenate(wants)
    order = np.argsort(ids, kind="stable")
    ids, x = ids[order], np.concatenate([s.get(w) for s, w in zip(sources, wants)])[order]
    try:
        nb = neighbours.read(d.path, manifest)
    except IndexerError:                    # missing / damaged: what `repair` is for
        nb = None
    if nb is None:
        nb = neighbours.build(ids, x, neighbours.DbaParams.from_record(rec))
    else:
        nb, redone = neighbours.update(nb, ids, x)
        if not redone and rec.sha256:
            return rec
    return neighbours.write(d.path, nb)


__all__ = ["Change", "CountCheck", "add_images", "remove_items", "repair_index", "info", "sync", "retune"]
