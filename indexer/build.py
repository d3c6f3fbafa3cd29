"""Build, extend, shrink and merge single index directories (their files: :mod:`indexer.index_dir`).

``indexer add/remove/repair`` reach the update functions here through :mod:`indexer.layouts`,
which reads the manifest and takes the writer lock for them."""
from __future__ import annotations

import dataclasses
import itertools
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import faiss
import numpy as np

from embedder.images import IMAGE_SUFFIXES

from . import faiss_index as fx
from . import neighbours, selection, tuning
from .errors import IndexerError
from .index_dir import MODEL_FILE, REPORT, IndexDir, now_utc
from .lmdb_env import DiskFullError
from .lock import writer_lock
from .manifest import Manifest
from .model import load_embedder, model_info
from .options import BuildOptions
from .pipeline import IngestStats, embed_missing, ingest
from .store import GalleryStore
from .walk import GalleryFile, shard_of, walk_gallery

# ---------------------------------------------------------------------------- build
def gallery_files(gallery: str | Path, shard: tuple[int, int] | None = None) -> Iterator[GalleryFile]:
    """Every build's one gallery check (``indexer build``, ``--shard``, ``--ray``): a folder
    holding at least one image-named entry (the embedder's ``IMAGE_SUFFIXES``). Returns the walk
    (shard ``i`` of ``n``'s share of it) still lazy: ingest consumes it on a helper thread,
    overlapped with embedding (for a small model, listing a big folder first costs a few
    percent of the build)."""
    gallery = Path(gallery)
    if not gallery.is_dir():
        raise IndexerError(f"{gallery}: gallery folder not found")
    files = walk_gallery(gallery)
    first = next(files, None)
    if first is None:
        raise IndexerError(f"{gallery}: empty gallery (no {'/'.join(sorted(IMAGE_SUFFIXES))} files)")
    files = itertools.chain([first], files)
    return files if shard is None else (f for f in files if shard_of(f.relpath, shard[1]) == shard[0])


def build_index(gallery: str | Path, out: str | Path, model: str | Path | None = None, *,
                options: BuildOptions | None = None, shard: tuple[int, int] | None = None,
                batch_size: int = 32, workers: int | None = None, device: str = "auto",
                progress: bool = True, embedder: Any = None,
                on_done: Callable[[int], None] | None = None, wait: bool = False,
                files: Iterable[GalleryFile] | None = None,
                dba: neighbours.DbaParams | None = None, **option_kw: Any) -> Manifest:
    """``indexer build``: ingest a gallery folder into ``out`` and (unless sharded) index it.

    Resumable: rerunning after a kill commits only what is missing and rebuilds the index.
    Holds ``out``'s writer lock (:mod:`indexer.lock`; ``wait``: wait for another writer instead
    of refusing). ``files``: the entries to ingest, already listed and checked (``indexer build
    --ray`` hands a shard task its share of the driver's one walk), instead of walking
    ``gallery``. ``dba``: also compute the gallery's neighbourhoods for DBA re-ranking at serve
    time (:mod:`indexer.neighbours`; a shard build leaves that to the merge). ``options`` (or
    its fields by name, ``option_kw``; ``max_memory`` the old name of ``index_memory``): how the
    index is chosen, checked before any work. Returns the manifest.
    """
    t0 = time.perf_counter()
    gallery, out = Path(gallery), Path(out)
    files = gallery_files(gallery, shard) if files is None else files
    opts = BuildOptions.of(options, **option_kw)        # checked before the work
    emb = embedder or load_embedder(model, device=device, batch_size=batch_size)
    with writer_lock(out, "indexer build", wait=wait):
        out.mkdir(parents=True, exist_ok=True)
        d = IndexDir(out)
        with GalleryStore(d.store_dir, readonly=False) as store:
            stats = ingest(store, files, emb, workers=workers, progress=progress, on_done=on_done)
            d.write_report(stats.skipped)
            ids, x = store.all_embeddings(emb.model_hash)
        d.copy_model(emb.path, emb.model_hash)
        extra = {"gallery": str(gallery.resolve()), "report": REPORT,
                 "ingest": {**dataclasses.asdict(stats), "skipped": len(stats.skipped)}}
        if shard is not None:
            return d.write_manifest(Manifest(
                model=model_info(emb, MODEL_FILE), dim=int(emb.dim), count=int(len(ids)), index_type=None,
                shard={"i": shard[0], "n": shard[1]}, build_seconds=round(time.perf_counter() - t0, 3),
                **extra))
        if len(ids) == 0:
            raise IndexerError(f"{gallery}: no image could be indexed ({len(stats.skipped)} skipped, "
                               f"reasons in {d.report_file})")
        index, fields = selection.build(ids, x, opts, device=device, progress=progress)
        extra["neighbours"] = _neighbours(d, ids, x, dba, progress)
        extra["build_seconds"] = round(time.perf_counter() - t0, 3)
        return _write_index_dir(d, index, fields, model_info(emb, MODEL_FILE), extra)


def _neighbours(d: IndexDir, ids: np.ndarray, x: np.ndarray, dba: neighbours.DbaParams | None,
                progress: bool) -> dict | None:
    """Write the DBA neighbourhoods (before the manifest that records them), or remove a stale
    file when the index is built without them; the manifest's ``neighbours`` record."""
    if dba is None:
        neighbours.remove_file(d.path)
        return None
    return neighbours.write(d.path, neighbours.build(ids, x, dba, progress=progress))


def _write_index_dir(d: IndexDir, index: faiss.Index, fields: dict, model: dict, extra: dict) -> Manifest:
    fx.write_atomic(index, d.index_file)
    return d.write_manifest(Manifest(model=model, **fields, **extra, index_file=d.index_record(),
                                     built_at=now_utc()))


# ---------------------------------------------------------------------------- incremental
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


def update_embedder(d: IndexDir, manifest: Manifest, model: str | Path | None, device: str,
                    batch_size: int) -> Any:
    """The embedder of an update: ``model`` (default the index's copy), refused in one line
    unless it is the model the index was built with."""
    path = Path(model) if model is not None else d.model_file
    emb = load_embedder(path, device=device, batch_size=batch_size)
    d.check_embedder(emb, manifest, path)
    return emb


def sync_index(d: IndexDir, manifest: Manifest, store: GalleryStore, *, seed: int = 0) -> Change:
    """Make index.faiss hold exactly the store's ids (adds new, drops removed), retune, write.

    Idempotent, so it also repairs a directory whose store and index a crash left out of step.
    """
    index = d.read_index(manifest)
    ids, x = store.all_embeddings(manifest.model_hash)
    have = fx.index_ids(index)
    stale = np.setdiff1d(have, ids)
    new_rows = np.nonzero(~np.isin(ids, have))[0]
    if len(ids) == 0:
        raise IndexerError(f"{d.path}: the index would be empty; rebuild it with `indexer build`")
    if len(stale):
        fx.remove(index, stale, x[np.isin(ids, have)], ids[np.isin(ids, have)])
    if len(new_rows):
        fx.add(index, x[new_rows], ids[new_rows])
    fields: dict = {"count": int(index.ntotal)}
    if (len(stale) or len(new_rows)) and manifest.index_type != "flat":
        fields.update(tuning.retune(index, manifest, x, ids, manifest.target_recall, seed=seed))
    if manifest.neighbours:
        fields["neighbours"] = _sync_neighbours(d, manifest, ids, x)
    fx.write_atomic(index, d.index_file)
    written = d.write_manifest(manifest.replace(**fields, index_file=d.index_record(), updated_at=now_utc()))
    return Change(written, added=int(len(new_rows)), removed=int(len(stale)))


def _sync_neighbours(d: IndexDir, manifest: Manifest, ids: np.ndarray, x: np.ndarray) -> dict:
    """The DBA neighbourhoods brought to the store's items: the lists that an added or removed
    item can change are searched again (:func:`indexer.neighbours.update`; equal to a fresh
    build's); a missing or damaged file is rebuilt whole."""
    rec = manifest.neighbours
    try:
        nb = neighbours.read(d.path, manifest)
    except IndexerError:                    # missing / damaged: what `repair` is for
        nb = None
    if nb is None:
        nb = neighbours.build(ids, x, neighbours.DbaParams.from_record(rec))
    else:
        nb, redone = neighbours.update(nb, ids, x)
        if not redone and rec.get("sha256"):
            return rec
    return neighbours.write(d.path, nb)


def add_single(d: IndexDir, manifest: Manifest, folder: Path, model: str | Path | None = None, *,
               prefix: str = "", batch_size: int = 32, workers: int | None = None,
               device: str = "auto", progress: bool = True) -> Change:
    """``indexer add`` on a single index (:func:`indexer.layouts.add_images` holds the lock):
    ingest another folder and add its new images to the existing index."""
    d.refuse_shard(manifest)
    emb = update_embedder(d, manifest, model, device, batch_size)
    d.read_index(manifest)               # refuse before touching the store
    with GalleryStore(d.store_dir, readonly=False) as store:
        stats = ingest_folder(store, folder, prefix, emb, d.index_file, workers, progress)
        d.write_report(stats.skipped)
        return dataclasses.replace(sync_index(d, manifest, store), stats=stats)


def ingest_folder(store: GalleryStore, folder: Path, prefix: str, emb: Any, rewritten: Path,
                  workers: int | None, progress: bool) -> IngestStats:
    """``indexer add``'s ingest (both layouts); a full disk is told with what the whole command
    needs (:func:`space_needed`; ``rewritten``: the faiss file the add rewrites beside itself)."""
    files = list(walk_gallery(folder, prefix=prefix))
    if not files:
        raise IndexerError(f"{folder}: no images to add")
    try:
        return ingest(store, files, emb, workers=workers, progress=progress)
    except DiskFullError as e:
        raise e.needing(space_needed(files, emb.dim, rewritten)) from None


def space_needed(files: Sequence[GalleryFile], dim: int, index_file: Path | None = None) -> int:
    """About what adding ``files`` takes on disk: their bytes (the store keeps each image), an
    embedding and ~1 KB of keys and page slack each, and a second copy of ``index_file`` (the
    index is rewritten beside itself, then renamed). An upper bound where content repeats."""
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
    """Remove each target (a stored path, else an id) from every store that holds it: one line
    each (the stores' ``(store, " from SHARD")`` suffix names the shard). Every target is looked
    up first, so an unknown one refuses the whole command and nothing is removed."""
    def holds(store: GalleryStore, t: str) -> bool:
        return store.id_for_path(t) is not None or (t.isdigit() and int(t) in store)

    for t in targets:
        if not any(holds(s, t) for s, _ in stores):
            raise IndexerError(f"{t}: no such id or path in {where}")
    msgs = []
    for t in targets:
        for store, suffix in stores:
            if store.id_for_path(t) is not None:
                i, gone = store.remove_path(t)  # type: ignore[misc]
                msgs.append(f"removed {t} (id {i}){suffix}" if gone else
                            f"removed path {t}{suffix}; its content (id {i}) stays under another path")
            elif t.isdigit() and int(t) in store:
                store.remove_id(int(t))
                msgs.append(f"removed id {t}{suffix}")
    return msgs


def remove_single(d: IndexDir, manifest: Manifest, targets: Sequence[str]) -> Change:
    """``indexer remove`` on a single index: each target is an id or a relative path."""
    d.refuse_shard(manifest)
    with GalleryStore(d.store_dir, readonly=False) as store:
        msgs = remove_targets([(store, "")], targets, d.path)
        return dataclasses.replace(sync_index(d, manifest, store), messages=msgs)


def repair_single(d: IndexDir, manifest: Manifest, *, batch_size: int = 32, workers: int | None = None,
                  device: str = "auto", progress: bool = True) -> Change:
    """``indexer repair``: bring index.faiss and the manifest in step with the store (embed
    stored images the index's model has not embedded, then :func:`sync_index`). What ``indexer
    info`` names when the counts differ; needs no gallery folder."""
    d.refuse_shard(manifest)
    emb = update_embedder(d, manifest, None, device, batch_size)
    with GalleryStore(d.store_dir, readonly=False) as store:
        embedded = embed_missing(store, emb, workers=workers, progress=progress)
        return dataclasses.replace(sync_index(d, manifest, store), embedded=embedded)


# ---------------------------------------------------------------------------- merge
def check_shards(dirs: Sequence[IndexDir]) -> list[Manifest]:
    """The shards' manifests, refusing shards of different models or widths and a shard given
    twice (one line each); `indexer merge` and the sharded index (shard_build) both start here."""
    manifests = [d.read_manifest() for d in dirs]
    first = manifests[0]
    for d, m in zip(dirs, manifests):
        if m.model_hash != first.model_hash:
            raise IndexerError(f"{d.path}: built with model {m.model_hash[:12]}, but {dirs[0].path} with "
                               f"{first.model_hash[:12]}; shards must share one model")
        if m.dim != first.dim:
            raise IndexerError(f"{d.path}: dimension mismatch ({m.dim} vs {first.dim})")
    seen = [(m.shard["i"], m.shard["n"]) for m in manifests if m.is_shard]
    if len(set(seen)) != len(seen):
        raise IndexerError(f"the same shard is given twice: {seen}")
    return manifests


def from_shards(dst: IndexDir, dirs: Sequence[IndexDir], manifests: Sequence[Manifest]) -> dict:
    """What a merged or sharded index takes from its shards: their model and skip reports
    (written into ``dst``), and its manifest's ``shards`` ([i, n] of each shard's), ``ingest``
    (the files their builds skipped, together) and ``report``."""
    dst.copy_model(dirs[0].model_file, manifests[0].model_hash)
    dst.write_report([r for d in dirs for r in d.read_report()])
    return {"shards": [[m.shard["i"], m.shard["n"]] for m in manifests if m.is_shard],
            "ingest": {"skipped": sum(int((m.ingest or {}).get("skipped", 0)) for m in manifests)},
            "report": REPORT}


def merge_shards(shard_dirs: Sequence[str | Path], out: str | Path, *, options: BuildOptions | None = None,
                 device: str = "auto", progress: bool = True, wait: bool = False,
                 dba: neighbours.DbaParams | None = None, **option_kw: Any) -> Manifest:
    """``indexer merge``: one quantizer trained over all shards, their inverted lists merged.

    The training sample is picked by position in the id-sorted union of all shards, exactly as
    a single-process build picks it, so the merged index equals a single build's. Holds
    ``out``'s writer lock (``wait``: wait for another writer). ``options``: as ``build_index``.
    """
    t0 = time.perf_counter()
    out = Path(out)
    opts = BuildOptions.of(options, **option_kw)
    dirs = [IndexDir(d) for d in shard_dirs]
    if not dirs:
        raise IndexerError("merge needs at least one shard directory")
    manifests = check_shards(dirs)
    model_hash = manifests[0].model_hash
    with ExitStack() as opened:
        parts = [opened.enter_context(GalleryStore(d.store_dir)).all_embeddings(model_hash) for d in dirs]
    parts = [p for p in parts if len(p[0])]
    if not parts:
        raise IndexerError("the shards hold no images")
    kept, have = [], np.zeros(0, dtype=np.int64)
    for pids, px in parts:          # same content in two shards (two paths): keep one vector
        m = ~np.isin(pids, have)
        kept.append((pids[m], px[m]))
        have = np.concatenate([have, pids[m]])
    parts = kept
    all_ids = np.concatenate([p[0] for p in parts])
    order = np.argsort(all_ids, kind="stable")
    all_ids = all_ids[order]
    x = np.concatenate([p[1] for p in parts])[order]
    with writer_lock(out, "indexer merge", wait=wait):
        out.mkdir(parents=True, exist_ok=True)
        dst_dir = IndexDir(out)
        with GalleryStore(dst_dir.store_dir, readonly=False) as dst:
            for d in dirs:
                with GalleryStore(d.store_dir) as s:
                    dst.copy_from(s, model_hash)
        index, fields = selection.build(all_ids, x, opts, device=device, parts=parts, progress=progress)
        extra = {"merged_from": [str(d.path.resolve()) for d in dirs], **from_shards(dst_dir, dirs, manifests),
                 "neighbours": _neighbours(dst_dir, all_ids, x, dba, progress),
                 "build_seconds": round(time.perf_counter() - t0, 3)}
        return _write_index_dir(dst_dir, index, fields, manifests[0].model, extra)
