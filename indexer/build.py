"""Build, extend, shrink and merge index directories.

An index directory holds ``store.lmdb/`` (the gallery), ``index.faiss``, ``manifest.json``,
``report.jsonl`` (skipped files) and ``model.onnx`` (a copy of the embedder, so the directory is
self-contained and ``Index.open`` needs nothing else).
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import faiss
import numpy as np

from . import faiss_index as fx
from . import selection, tuning
from .errors import IndexerError
from .manifest import (INDEX_FILE, MODEL_FILE, REPORT, STORE_DIR, read_manifest, write_manifest,
                       write_report)
from .pipeline import IngestStats, ingest
from .store import GalleryStore
from .validate import check_faiss_file, index_file_record, read_faiss
from .walk import GalleryFile, shard_of, walk_gallery

DEFAULT_TARGET_RECALL = 0.95


# ---------------------------------------------------------------------------- model
def load_embedder(model: str | Path | None, *, device: str = "auto", batch_size: int = 32,
                  threads: int | None = None) -> Any:
    """An OnnxEmbedder for ``model`` (default: the offline pretrained embedder)."""
    from embedder import OnnxEmbedder

    if model is None:
        from embedder import default_model_path

        model = default_model_path()
    path = Path(model)
    if not path.is_file():
        raise IndexerError(f"{path}: model not found (expected an .onnx file exported by "
                           "`python -m embedder export`)")
    try:
        return OnnxEmbedder(path, device=device, threads=threads, batch_size=batch_size)
    except (ValueError, RuntimeError) as e:   # embedder's ModelLoadError is a ValueError
        raise IndexerError(str(e).splitlines()[0]) from None


def _copy_model(embedder: Any, directory: Path) -> None:
    dst = directory / MODEL_FILE
    if dst.exists():
        from embedder.hashing import file_sha256

        if file_sha256(dst) == embedder.model_hash:
            return
    fd, tmp = tempfile.mkstemp(prefix=MODEL_FILE + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    shutil.copyfile(embedder.path, tmp)
    os.replace(tmp, dst)


def model_info(embedder: Any) -> dict:
    return {"hash": embedder.model_hash, "file": MODEL_FILE, "source": str(Path(embedder.path).resolve()),
            "dim": int(embedder.dim), "normalized": bool(embedder.normalized),
            "backbone": getattr(embedder, "backbone", embedder.metadata.get("backbone", "")),
            "metadata": dict(embedder.metadata)}


# ---------------------------------------------------------------------------- faiss from a store
def make_index(ids: np.ndarray, x: np.ndarray, *, index_type: str = "auto",
               flat_threshold: int = fx.DEFAULT_FLAT_THRESHOLD, nlist: int | None = None,
               target_recall: float = DEFAULT_TARGET_RECALL, device: str = "auto",
               seed: int = 0, trained: faiss.Index | None = None,
               parts: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
               max_memory: int | str | None = None, progress: bool = False) -> tuple[faiss.Index, dict]:
    """Choose, train, fill and tune an index over (ids ascending, x). Returns (index, manifest fields).

    See ``selection.build``: the type is chosen by measurement above ``flat_threshold`` (unless
    ``index_type`` forces one), and the recall reported is measured on held-out gallery vectors.
    With ``parts`` (shards' (ids, x)), each part is added to its own copy of the trained empty
    index and the copies are merged with ``merge_from``: the path ``indexer merge`` takes.
    """
    return selection.build(ids, x, index_type=index_type, flat_threshold=flat_threshold,
                           nlist=nlist, target=target_recall,
                           max_memory=selection.parse_memory(max_memory), device=device,
                           seed=seed, trained=trained, parts=parts, progress=progress)


def _write_index_dir(directory: Path, index: faiss.Index, fields: dict, model: dict, extra: dict) -> dict:
    fx.write_atomic(index, directory / INDEX_FILE)
    manifest = {"model": model, **fields, **extra, "index_file": index_file_record(directory),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_manifest(directory, manifest)
    return read_manifest(directory)


# ---------------------------------------------------------------------------- build
def build_index(gallery: str | Path, out: str | Path, model: str | Path | None = None, *,
                index_type: str = "auto", flat_threshold: int = fx.DEFAULT_FLAT_THRESHOLD,
                nlist: int | None = None, target_recall: float = DEFAULT_TARGET_RECALL,
                shard: tuple[int, int] | None = None, batch_size: int = 32,
                workers: int | None = None, device: str = "auto", seed: int = 0,
                progress: bool = True, embedder: Any = None,
                max_memory: int | str | None = None,
                on_done: Callable[[int], None] | None = None) -> dict:
    """``indexer build``: ingest a gallery folder into ``out`` and (unless sharded) index it.

    Resumable: rerunning after a kill commits only what is missing and rebuilds the index.
    Returns the manifest.
    """
    t0 = time.perf_counter()
    gallery, out = Path(gallery), Path(out)
    if not gallery.is_dir():
        raise IndexerError(f"{gallery}: gallery folder not found")
    if not 0 < target_recall <= 1:
        raise IndexerError(f"target recall {target_recall}: expected 0 < target <= 1")
    max_memory = selection.parse_memory(max_memory)     # refuse a bad size before the work
    # The walk stays lazy: ingest consumes it on a helper thread, overlapped with embedding
    # (for a small model, listing a big folder first costs a few percent of the build).
    files: Iterable[GalleryFile] = walk_gallery(gallery)
    if shard is not None:
        files = (f for f in files if shard_of(f.relpath, shard[1]) == shard[0])
    else:
        first = next(iter(files), None)
        if first is None:
            raise IndexerError(f"{gallery}: empty gallery (no .jpg/.jpeg/.png/.webp/.bmp/.gif/.tiff files)")
        files = itertools.chain([first], files)
    emb = embedder or load_embedder(model, device=device, batch_size=batch_size)
    out.mkdir(parents=True, exist_ok=True)
    with GalleryStore(out / STORE_DIR, readonly=False) as store:
        stats = ingest(store, files, emb, workers=workers, progress=progress, on_done=on_done)
        write_report(out, stats.skipped)
        ids, x = store.all_embeddings(emb.model_hash)
    _copy_model(emb, out)
    extra = {"gallery": str(gallery.resolve()), "ingest": _stats_dict(stats), "report": REPORT}
    if shard is not None:
        extra["shard"] = {"i": shard[0], "n": shard[1]}
        write_manifest(out, {"model": model_info(emb), "dim": int(emb.dim), "count": int(len(ids)),
                             "index_type": None, "build_seconds": round(time.perf_counter() - t0, 3),
                             **extra})
        return read_manifest(out)
    if len(ids) == 0:
        raise IndexerError(f"{gallery}: no image could be indexed ({len(stats.skipped)} skipped, "
                           f"reasons in {out / REPORT})")
    index, fields = make_index(ids, x, index_type=index_type, flat_threshold=flat_threshold,
                               nlist=nlist, target_recall=target_recall, device=device, seed=seed,
                               max_memory=max_memory, progress=progress)
    extra["build_seconds"] = round(time.perf_counter() - t0, 3)
    return _write_index_dir(out, index, fields, model_info(emb), extra)


def _stats_dict(stats: IngestStats) -> dict:
    return {"found": stats.found, "new": stats.new, "unchanged": stats.unchanged,
            "duplicates": stats.duplicates, "embedded": stats.embedded, "skipped": len(stats.skipped)}


# ---------------------------------------------------------------------------- incremental
def _open_for_update(directory: Path, model: str | Path | None, device: str, batch_size: int
                     ) -> tuple[dict, Any]:
    manifest = read_manifest(directory)
    if manifest.get("shard"):
        raise IndexerError(f"{directory}: is shard {manifest['shard']['i']}/{manifest['shard']['n']}, "
                           "not an index; run `indexer merge` first")
    path = Path(model) if model is not None else directory / MODEL_FILE
    emb = load_embedder(path, device=device, batch_size=batch_size)
    want = manifest["model"]["hash"]
    if emb.model_hash != want:
        raise IndexerError(f"{path}: model {emb.model_hash[:12]} differs from the model this index was "
                           f"built with ({want[:12]}, {manifest['model'].get('source')}); "
                           "use that model or rebuild with `indexer build`")
    if emb.dim != manifest["dim"]:
        raise IndexerError(f"{path}: dimension mismatch: model gives {emb.dim}-d embeddings, "
                           f"index holds {manifest['dim']}-d")
    return manifest, emb


def _read_index(directory: Path, manifest: dict) -> faiss.Index:
    path, dim = directory / INDEX_FILE, int(manifest["dim"])
    check_faiss_file(directory, manifest)
    index = read_faiss(path)
    if index.d != dim:
        raise IndexerError(f"{path}: dimension mismatch: index holds {index.d}-d vectors, "
                           f"manifest says {dim}-d")
    return index


def sync_index(directory: Path, manifest: dict, store: GalleryStore, *, seed: int = 0) -> dict:
    """Make index.faiss hold exactly the store's ids (adds new, drops removed), retune, write.

    Idempotent, so it also repairs a directory whose store and index a crash left out of step.
    """
    model_hash = manifest["model"]["hash"]
    index = _read_index(directory, manifest)
    ids, x = store.all_embeddings(model_hash)
    have = fx.index_ids(index)
    stale = np.setdiff1d(have, ids)
    new_rows = np.nonzero(~np.isin(ids, have))[0]
    if len(ids) == 0:
        raise IndexerError(f"{directory}: the index would be empty; rebuild it with `indexer build`")
    if len(stale):
        fx.remove(index, stale, x[np.isin(ids, have)], ids[np.isin(ids, have)])
    if len(new_rows):
        fx.add(index, x[new_rows], ids[new_rows])
    fields = {"count": int(index.ntotal)}
    if (len(stale) or len(new_rows)) and manifest.get("index_type") != "flat":
        target = float(manifest.get("target_recall", DEFAULT_TARGET_RECALL))
        fields.update(tuning.retune(index, manifest, x, ids, target, seed=seed))
    fx.write_atomic(index, directory / INDEX_FILE)
    manifest = {**manifest, **fields, "index_file": index_file_record(directory),
                "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    manifest.pop("format", None)
    write_manifest(directory, manifest)
    return {**read_manifest(directory), "added": int(len(new_rows)), "removed": int(len(stale))}


def add_images(directory: str | Path, folder: str | Path, model: str | Path | None = None, *,
               prefix: str = "", batch_size: int = 32, workers: int | None = None,
               device: str = "auto", progress: bool = True) -> tuple[dict, IngestStats]:
    """``indexer add``: ingest another folder and add its new images to the existing index."""
    directory, folder = Path(directory), Path(folder)
    if not folder.is_dir():
        raise IndexerError(f"{folder}: folder not found")
    manifest, emb = _open_for_update(directory, model, device, batch_size)
    _read_index(directory, manifest)     # refuse before touching the store
    files = list(walk_gallery(folder, prefix=prefix))
    if not files:
        raise IndexerError(f"{folder}: no images to add")
    with GalleryStore(directory / STORE_DIR, readonly=False) as store:
        stats = ingest(store, files, emb, workers=workers, progress=progress)
        write_report(directory, stats.skipped)
        return sync_index(directory, manifest, store), stats


def remove_items(directory: str | Path, targets: Sequence[str]) -> tuple[dict, list[str]]:
    """``indexer remove``: each target is an id or a relative path. Returns (manifest, messages)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    msgs = []
    with GalleryStore(directory / STORE_DIR, readonly=False) as store:
        for t in targets:
            if store.id_for_path(t) is not None:
                i, gone = store.remove_path(t)  # type: ignore[misc]
                msgs.append(f"removed {t} (id {i})" if gone else
                            f"removed path {t}; its content (id {i}) stays under another path")
            elif t.isdigit() and int(t) in store:
                store.remove_id(int(t))
                msgs.append(f"removed id {t}")
            else:
                raise IndexerError(f"{t}: no such id or path in {directory}")
        return sync_index(directory, manifest, store), msgs


# ---------------------------------------------------------------------------- merge
def merge_shards(shard_dirs: Sequence[str | Path], out: str | Path, *, index_type: str = "auto",
                 flat_threshold: int = fx.DEFAULT_FLAT_THRESHOLD, nlist: int | None = None,
                 target_recall: float = DEFAULT_TARGET_RECALL, device: str = "auto",
                 seed: int = 0, progress: bool = True, max_memory: int | str | None = None) -> dict:
    """``indexer merge``: one quantizer trained over all shards, their inverted lists merged.

    The training sample is picked by position in the id-sorted union of all shards, exactly as
    a single-process build picks it, so the merged index equals a single build's.
    """
    t0 = time.perf_counter()
    out = Path(out)
    dirs = [Path(d) for d in shard_dirs]
    if not dirs:
        raise IndexerError("merge needs at least one shard directory")
    manifests = [read_manifest(d) for d in dirs]
    first = manifests[0]
    for d, m in zip(dirs, manifests):
        if m["model"]["hash"] != first["model"]["hash"]:
            raise IndexerError(f"{d}: built with model {m['model']['hash'][:12]}, but {dirs[0]} with "
                               f"{first['model']['hash'][:12]}; shards must share one model")
        if m["dim"] != first["dim"]:
            raise IndexerError(f"{d}: dimension mismatch ({m['dim']} vs {first['dim']})")
    shards = [(m.get("shard") or {}) for m in manifests]
    seen = [(s["i"], s["n"]) for s in shards if s]
    if len(set(seen)) != len(seen):
        raise IndexerError(f"the same shard is given twice: {seen}")
    model_hash = first["model"]["hash"]
    stores = [GalleryStore(d / STORE_DIR) for d in dirs]
    parts = [s.all_embeddings(model_hash) for s in stores]
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
    out.mkdir(parents=True, exist_ok=True)
    with GalleryStore(out / STORE_DIR, readonly=False) as dst:
        for d, s in zip(dirs, stores):
            dst.copy_from(s, model_hash)
            s.close()
    src_model = dirs[0] / MODEL_FILE
    tmp = out / (MODEL_FILE + ".tmp")
    shutil.copyfile(src_model, tmp)
    os.replace(tmp, out / MODEL_FILE)
    index, fields = make_index(all_ids, x, index_type=index_type, flat_threshold=flat_threshold,
                               nlist=nlist, target_recall=target_recall, device=device, seed=seed,
                               parts=parts, max_memory=max_memory, progress=progress)
    skipped = sum(int(m.get("ingest", {}).get("skipped", 0)) for m in manifests)
    reports = []
    for d in dirs:
        r = d / REPORT
        if r.exists():
            reports += [json.loads(line) for line in r.read_text().splitlines() if line.strip()]
    write_report(out, reports)
    extra = {"merged_from": [str(d.resolve()) for d in dirs], "shards": seen,
             "ingest": {"skipped": skipped}, "report": REPORT,
             "build_seconds": round(time.perf_counter() - t0, 3)}
    return _write_index_dir(out, index, fields, first["model"], extra)
