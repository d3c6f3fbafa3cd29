"""Build and merge single index directories (their files: :mod:`indexer.directory.index_dir`); updates of
either layout are :mod:`indexer.build.update`'s."""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import faiss
import numpy as np
from tqdm.auto import tqdm

from embedder.folders import GalleryFile, walk_gallery
from embedder.images import IMAGE_SUFFIXES

from ..ann import faiss_index as fx
from ..ann import neighbours, selection
from ..ann.options import BuildOptions
from ..directory.index_dir import MODEL_FILE, REPORT, IndexDir, now_utc
from ..directory.lock import writer_lock
from ..directory.manifest import DbaCheckRecord, Manifest, NeighboursRecord
from ..directory.model import load_embedder, model_info
from ..errors import IndexerError
from ..store.gallery import GalleryStore
from ..store.ingest import ingest
from ..store.walk import shard_of

# ---------------------------------------------------------------------------- build
def gallery_files(gallery: str | Path, shard: tuple[int, int] | None = None) -> Iterator[GalleryFile]:
    """Every build's one gallery check: a folder holding at least one image-named entry.
    Returns the walk (shard ``i`` of ``n``'s share) still lazy, so ingest overlaps it with
    embedding."""
    gallery = Path(gallery)
    if not gallery.is_dir():
        raise IndexerError(f"{gallery}: a file, not a folder: `indexer build` indexes a folder of images "
                           "(sub-folders are labels)" if gallery.is_file() else f"{gallery}: gallery folder not found")
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
                dba: neighbours.DbaParams | None = None, prune: bool = False, dba_verdict: bool = False,
                **option_kw: Any) -> Manifest:
    """``indexer build``: ingest a gallery folder into ``out`` and (unless a shard) index it; resumable,
    under ``out``'s writer lock. ``files``: entries already listed (a ``--ray`` task's share); ``dba``:
    also DBA's neighbourhoods; ``options`` or its fields by name (``max_memory``: old name of
    ``index_memory``), checked before any work. ``prune``: drop stored images whose file the walk
    did not find (by default kept and counted: ``ingest``). A kept index keeps the DBA check's
    record (``Manifest.dba_check``) while the labels are the same; ``dba_verdict`` (the default's
    DBA, not an asked-for one): where that check found DBA behind, it is not built."""
    t0 = time.perf_counter()
    gallery, out = Path(gallery), Path(out)
    files = gallery_files(gallery, shard) if files is None else files
    opts = BuildOptions.of(options, **option_kw)        # checked before the work
    emb = embedder or load_embedder(model, device=device, batch_size=batch_size)
    with writer_lock(out, "indexer build", wait=wait):
        out.mkdir(parents=True, exist_ok=True)
        d = IndexDir(out)
        with GalleryStore(d.store_dir, readonly=False) as store:
            stats = ingest(store, files, emb, workers=workers, progress=progress, on_done=on_done, walked=True,
                           prune=prune)
            d.write_report(stats.skipped)
            ids = store.embedded_ids(emb.model_hash)
            key = selection_key(emb.model_hash, opts, ids)
            kept, dba = (Kept(), dba) if shard is not None or not len(ids) else kept_parts(d, key, dba, store,
                                                                                         dba_verdict)
            x = None
            if shard is None and (kept.manifest is None or (dba is not None and kept.neighbours is None)):
                ids, x = store.all_embeddings(emb.model_hash)                   # the vectors, where used
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
        return write_index(d, kept, key, ids, x, opts, dba, model_info(emb, MODEL_FILE), extra, t0, device=device,
                           progress=progress)


@dataclass(frozen=True)
class Kept:
    """What a rebuild keeps of the index at its --out (nothing: all None)."""

    manifest: Manifest | None = None            # the index type chosen (kept_index)
    neighbours: NeighboursRecord | None = None  # DBA's file (kept_neighbours)
    check: DbaCheckRecord | None = None         # the DBA check's record (kept_check)


def kept_parts(d: IndexDir, key: str, dba: neighbours.DbaParams | None, store: GalleryStore, dba_verdict: bool
               ) -> tuple[Kept, neighbours.DbaParams | None]:
    """What a build or merge of ``key`` into ``d`` keeps, and the DBA it builds: none where the
    kept check found it behind and ``dba_verdict`` (the default's DBA, not an asked-for one)."""
    m = kept_index(d, key)
    check = kept_check(m, dba, store)
    dba = None if dba_verdict and check is not None and check.z < -2 else dba
    return Kept(m, kept_neighbours(d, m, dba), check), dba


def write_index(d: IndexDir, kept: Kept, key: str, ids: np.ndarray, x: np.ndarray | None, opts: BuildOptions,
                dba: neighbours.DbaParams | None, model: Any, extra: dict, t0: float, *, device: str,
                progress: bool, parts: Any = None) -> Manifest:
    """A build's and a merge's end: the index type chosen by measurement (or the kept index),
    DBA's file (or the kept one), the manifest."""
    if kept.manifest is None:
        index, fields = selection.build(ids, x, opts, device=device, parts=parts, progress=progress)
    extra = {**extra, "neighbours": kept.neighbours or _neighbours(d, ids, x, dba, progress),
             "build_seconds": round(time.perf_counter() - t0, 3)}
    if kept.manifest is not None:
        return d.write_manifest(dataclasses.replace(kept.manifest, **extra, dba_check=kept.check, built_at=now_utc()))
    extra["built_at"] = now_utc()
    extra["selected_at"] = f"{extra['built_at'][:-1]}.{time.time_ns() % 10**9:09d}Z"   # unique per choice
    return _write_index_dir(d, index, fields, model, extra, key)


def selection_key(model_hash: str, opts: BuildOptions, ids: np.ndarray) -> str:
    """What an index type is chosen for: the model, the build options and the ids (content hashes:
    the same ids embedded by the same model are the same vectors)."""
    h = hashlib.sha256(json.dumps([model_hash, dataclasses.asdict(opts)], sort_keys=True).encode())
    h.update(np.sort(np.asarray(ids, dtype=np.int64)).tobytes())
    return h.hexdigest()


def selected_for(key: str, index_sha256: str) -> str:
    """The manifest's ``selected_for``: the choice's key bound to the index.faiss it wrote, so an
    `add` or `remove` since (which rewrites that file) never lets a rebuild keep it."""
    return hashlib.sha256(f"{key}:{index_sha256}".encode()).hexdigest()


def kept_index(d: IndexDir, key: str) -> Manifest | None:
    """The manifest of the index at ``d`` when its index type was chosen for ``key`` and its
    index.faiss is the one recorded, else None: a rebuild that changed nothing (no image new,
    gone or embedded again, the same options) keeps it instead of measuring the candidates again
    (25,348 photos, 2 cores: such a rebuild 77-86 -> 31-37 s, peak RSS 2.8 -> 1.7 GB; 2.4-2.9 s with DBA's
    file and check kept too: :func:`kept_neighbours`, :func:`kept_check`). An `add`
    or `remove` since rewrote index.faiss, so the next build chooses again, on the gallery as it
    is (unless they left the very same file)."""
    from ..directory.validate import check_faiss_file

    try:
        m = d.read_manifest()
        if m.index_file is None or m.index_file.sha256 is None or m.selected_for != selected_for(
                key, m.index_file.sha256):        # a shard or a sharded index has no index.faiss record
            return None
        check_faiss_file(d.index_file, m.index_file)            # the file is the one recorded
    except (IndexerError, OSError, ValueError):
        return None
    return m


def kept_check(kept: Manifest | None, dba: neighbours.DbaParams | None, store: GalleryStore
               ) -> DbaCheckRecord | None:
    """The kept index's record of the DBA check, when it was measured on this very index with
    these DBA parameters and labels: the same verdict without measuring again (25k photos: 7 s a
    rebuild, and 17-19 s of DBA pass where the check dropped DBA)."""
    from ..layouts.evaluate import labels_digest

    r = kept.dba_check if kept is not None and dba is not None else None
    if r is None or r.selected_for != kept.selected_for or (r.k, r.alpha, r.depth) != (dba.k, dba.alpha, dba.depth):
        return None
    return r if r.labels == labels_digest(store) else None


def with_dba_check(out: str | Path, check: DbaCheckRecord, *, wait: bool = False) -> Manifest:
    """The index at ``out`` with the DBA check's record (DBA kept), for a rebuild to keep."""
    d = IndexDir(out)
    with writer_lock(d.path, "indexer build", wait=wait):
        return d.write_manifest(dataclasses.replace(d.read_manifest(), dba_check=check))


def kept_neighbours(d: IndexDir, kept: Manifest | None, dba: neighbours.DbaParams | None
                    ) -> NeighboursRecord | None:
    """The kept index's DBA record when it was built with these DBA parameters and its
    neighbours.npz checks out: the same ids and model give the same neighbourhoods (25,348
    photos x 2,560: their exact k-NN is 17-19 s of a 36 s rebuild that changed nothing)."""
    if kept is None or dba is None or not kept.neighbours:
        return None
    try:
        if neighbours.DbaParams.from_record(kept.neighbours) != dba:
            return None
        neighbours.check(d.path, kept)
    except (IndexerError, OSError, ValueError):
        return None
    return kept.neighbours


def _neighbours(d: IndexDir, ids: np.ndarray, x: np.ndarray | None, dba: neighbours.DbaParams | None,
                progress: bool) -> dict | None:
    """Write the DBA neighbourhoods (before the manifest that records them), or remove a stale
    file when the index is built without them; the manifest's ``neighbours`` record."""
    if dba is None:
        neighbours.remove_file(d.path)
        return None
    return neighbours.write(d.path, neighbours.build(ids, x, dba, progress=progress))


def without_dba(out: str | Path, *, wait: bool = False, check: DbaCheckRecord | None = None) -> Manifest:
    """The index at ``out`` with its DBA neighbourhoods dropped: the manifest first (a reader never
    sees a record without its file), then the file. ``check``: why (kept for a rebuild)."""
    d = IndexDir(out)
    with writer_lock(d.path, "indexer build", wait=wait):
        m = d.write_manifest(dataclasses.replace(d.read_manifest(), neighbours=None, dba_check=check))
        neighbours.remove_file(d.path)
    return m


def _write_index_dir(d: IndexDir, index: faiss.Index, fields: dict, model: dict, extra: dict,
                     key: str | None = None) -> Manifest:
    fx.write_atomic(index, d.index_file)
    rec = d.index_record()
    chosen = {"selected_for": selected_for(key, rec.sha256)} if key else {}
    return d.write_manifest(Manifest(model=model, **fields, **{"built_at": now_utc(), **extra}, **chosen,
                                     index_file=rec))


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
    seen = [(m.shard.i, m.shard.n) for m in manifests if m.is_shard]
    if len(set(seen)) != len(seen):
        raise IndexerError(f"the same shard is given twice: {seen}")
    return manifests


def from_shards(dst: IndexDir, dirs: Sequence[IndexDir], manifests: Sequence[Manifest], *,
                gone: int | None = None, prune: bool = False) -> dict:
    """What a merged or sharded index takes from its shards: their model and skip reports
    (written into ``dst``), and the manifest's ``shards``, ``ingest`` and ``report``. ``gone``: a
    merge's stored paths that no shard holds, ``prune``: dropped, else kept; either way its own
    count, not the shards' prunes (their copies stayed in the merged store until now)."""
    dst.copy_model(dirs[0].model_file, manifests[0].model_hash)
    dst.write_report([r for d in dirs for r in d.read_report()])
    ingests = [m.ingest for m in manifests if m.ingest]
    counts = {k: sum(getattr(i, k) or 0 for i in ingests) for k in ("absent", "pruned")}
    if gone is not None:
        counts = {"absent": counts["absent"] + (0 if prune else gone), "pruned": gone if prune else 0}
    return {"shards": [[m.shard.i, m.shard.n] for m in manifests if m.is_shard],
            "ingest": {"skipped": sum(i.skipped for i in ingests), **{k: n for k, n in counts.items() if n}},
            "report": REPORT}


def _union(parts: Sequence[tuple[np.ndarray, np.ndarray]]
           ) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """Parts without an id met in an earlier part (the same content in two shards under two
    paths: one vector), and all their ids and vectors in id order."""
    kept, have = [], np.zeros(0, dtype=np.int64)
    for pids, px in parts:
        m = ~np.isin(pids, have)
        kept.append((pids[m], px[m]))
        have = np.concatenate([have, pids[m]])
    all_ids = np.concatenate([p[0] for p in kept])
    order = np.argsort(all_ids, kind="stable")
    return kept, all_ids[order], np.concatenate([p[1] for p in kept])[order]


def merge_shards(shard_dirs: Sequence[str | Path], out: str | Path, *, options: BuildOptions | None = None,
                 device: str = "auto", progress: bool = True, wait: bool = False,
                 dba: neighbours.DbaParams | None = None, dba_verdict: bool = False, prune: bool = False,
                 **option_kw: Any) -> Manifest:
    """``indexer merge``: one quantizer trained over all shards (the sample picked by position in
    the id-sorted union, as a single build picks it, so the result equals one), their inverted
    lists merged. Holds ``out``'s writer lock; ``options``, ``dba_verdict`` and what a merge of the
    same shards keeps as ``build_index``. Stored paths no shard holds (added by `indexer add`, or
    pruned from their shard since the last merge) are kept and counted (``ingest.absent``), or
    with ``prune`` dropped (``ingest.pruned``), as a build's walk does."""
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
    parts, all_ids, x = _union(parts)
    with writer_lock(out, "indexer merge", wait=wait):
        out.mkdir(parents=True, exist_ok=True)
        dst_dir = IndexDir(out)
        with GalleryStore(dst_dir.store_dir, readonly=False) as dst:
            held: set[str] = set()
            with tqdm(total=sum(m.count for m in manifests), desc="copying the shards' images", unit="img",
                      disable=not progress, mininterval=1.0) as bar:
                for d in dirs:
                    with GalleryStore(d.store_dir) as s:
                        dst.copy_from(s, model_hash, bar.update)
                        held.update(s.paths())
            gone = [p for p in dst.paths() if p not in held]
            del held
            if prune and gone:
                dst.remove_paths(gone)
            # images `indexer add`ed to the merged index since its last merge: indexed too, as a
            # rebuild keeps what its store holds (until 2026-11-30 left out: counts differed, 503)
            added = np.setdiff1d(dst.embedded_ids(model_hash), all_ids)
            if len(added):
                parts, all_ids, x = _union([*parts, (added, dst.get_embeddings(model_hash, added))])
            key = selection_key(model_hash, opts, all_ids)
            kept, dba = kept_parts(dst_dir, key, dba, dst, dba_verdict)
        extra = {"merged_from": [str(d.path.resolve()) for d in dirs],
                 **from_shards(dst_dir, dirs, manifests, gone=len(gone), prune=prune)}
        return write_index(dst_dir, kept, key, all_ids, x, opts, dba, manifests[0].model, extra, t0, device=device,
                           progress=progress, parts=parts)
