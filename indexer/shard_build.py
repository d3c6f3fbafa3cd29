"""Building, extending and shrinking a sharded index (its layout: :mod:`indexer.shards`).

``build_sharded`` is the streaming build (:mod:`indexer.stream`) over shard directories that
each hold a store: one training on a sample drawn from the stores, one part per shard (filled
here, or by Ray tasks on the shards' nodes: ``fill_parts``), tuning on the parts searched as one.
``add_sharded`` ingests into the shard whose store holds the fewest images (it keeps shards even
and touches one part), ``remove_sharded`` removes from every shard that holds the target; both
end in ``sync_parts``, which makes the parts hold exactly what the stores hold.
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import faiss
import numpy as np

from embedder.hashing import file_sha256

from . import faiss_index as fx
from . import stream
from .build import Change, check_shards, from_shards, ingest_folder, remove_targets, update_embedder
from .errors import IndexerError
from .index_dir import HELD_FILE, PART_FILE, STORE_DIR, TRAINED_FILE, IndexDir, now_utc
from .lock import writer_lock
from .manifest import Manifest
from .options import BuildOptions
from .shards import PartsIndex, claim_parts, record_owner, relative, shard_paths
from .sources import Rows, Source, StoreSource
from .store import GalleryStore
from .tuning import K, heldout_size, retuned

FillParts = Callable[[Path, list[np.ndarray]], None]   # (trained file, skip ids per shard)


def _records(out: Path, files: Sequence[Path]) -> dict:
    """Size and sha256 of each faiss file, checked on open (as ``index.faiss``'s record is)."""
    return {relative(out, f): {"bytes": f.stat().st_size, "sha256": file_sha256(f)} for f in files}


def build_sharded(shard_dirs: Sequence[str | Path], out: str | Path, *, options: BuildOptions | None = None,
                  device: str = "auto", progress: bool = True, fill_parts: FillParts | None = None,
                  sources: Sequence[Source] | None = None, wait: bool = False, **option_kw: object) -> Manifest:
    """Index shard directories where they are; ``out`` gets the manifest that lists them.
    ``sources``: the shards as the plan reads them (default: their stores, in this process;
    ``ray_build`` passes readers on the shards' nodes, ``indexer.ray_sources``), closed once the
    plan is made when ``fill_parts`` fills the parts elsewhere. Holds the writer locks of ``out``
    and of the shard folders (their part.faiss is rewritten; ``wait``: wait for other writers)."""
    t0 = time.perf_counter()
    out = Path(out)
    opts = BuildOptions.of(options, **option_kw)
    dirs = [IndexDir(d) for d in shard_dirs]
    if not dirs:
        raise IndexerError("a sharded build needs at least one shard directory")
    with ExitStack() as held:       # the shard folders too: their part.faiss is (re)written
        for d in [out, *[d.path for d in dirs if d.path.is_dir()]]:
            held.enter_context(writer_lock(d, "indexer merge --sharded", wait=wait))
        return _build_sharded(dirs, out, opts, device, progress, fill_parts, sources, t0)


def _build_sharded(dirs: list[IndexDir], out: Path, opts: BuildOptions, device: str, progress: bool,
                   fill_parts: FillParts | None, sources: Sequence[Source] | None, t0: float) -> Manifest:
    manifests = check_shards(dirs)
    claim_parts(out, [d.path for d in dirs])      # another sharded index's parts: refused
    model, dim = manifests[0].model, manifests[0].dim
    if sources is None:
        sources = [StoreSource(d.store_dir, model["hash"], dim) for d in dirs]
    try:
        p = stream.plan(sources, opts, device=device, progress=progress)
        if fill_parts is not None:         # the plan's reads are done: free the readers now
            for s in sources:
                s.close()
        out.mkdir(parents=True, exist_ok=True)
        fx.write_atomic(p.trained, out / TRAINED_FILE)
        parts = [d.path / PART_FILE for d in dirs]
        t1 = time.perf_counter()
        if fill_parts is not None:
            fill_parts(out / TRAINED_FILE, p.skip)
        else:
            from tqdm.auto import tqdm

            for i in tqdm(range(len(dirs)), desc="filling the shards' parts", unit="shard",
                          disable=not progress):
                fx.write_atomic(stream.fill(sources[i], p.trained, p.skip[i]), parts[i])
        p.seconds["fill"] = time.perf_counter() - t1
    finally:
        for s in sources:
            s.close()
    t1 = time.perf_counter()
    fields = stream.tune_and_check(p, stream.open_parts(parts, p.trained), opts.target_recall)
    fx.write_atomic(stream.held_part(p), out / HELD_FILE)
    p.seconds["tune"] = time.perf_counter() - t1
    dst = IndexDir(out)
    written = dst.write_manifest(Manifest(
        model=model, **fields, **from_shards(dst, dirs, manifests),
        sharded={"shards": [relative(out, d.path) for d in dirs], "trained": TRAINED_FILE, "held": HELD_FILE,
                 "files": _records(out, [out / TRAINED_FILE, out / HELD_FILE, *parts])},
        stage_seconds={k: round(v, 3) for k, v in p.seconds.items()},
        build_seconds=round(time.perf_counter() - t0, 3), built_at=now_utc()))
    record_owner(out, [d.path for d in dirs])
    return written


# ---------------------------------------------------------------------------- add / remove
def sync_parts(directory: Path, manifest: Manifest) -> Change:
    """Make each part hold exactly its shard's share of the stores (the first shard that holds
    an id owns it; a held-out id stays in the held part while some store has it), rewrite the
    parts that change and the manifest. Idempotent: it also repairs a crash between a store's
    commit and its part's rewrite. When a part changed, the search parameter is retuned
    (``retune_sharded``), as ``indexer add/remove`` retune a single index."""
    model_hash, sh = manifest.model_hash, manifest.sharded
    dirs = shard_paths(directory, manifest)
    stored = []
    for p in dirs:
        src = StoreSource(p / STORE_DIR, model_hash, manifest.dim)
        stored.append((src.ids(), src))
    held_file = directory / sh["held"]
    held = faiss.read_index(str(held_file))
    held_ids = fx.index_ids(held)
    everywhere = np.unique(np.concatenate([ids for ids, _ in stored])) if stored else np.zeros(0, np.int64)
    gone_held = np.setdiff1d(held_ids, everywhere)
    changed = []
    if len(gone_held):
        held.remove_ids(gone_held)
        fx.write_atomic(held, held_file)
        changed.append(held_file)
    taken = np.intersect1d(held_ids, everywhere)
    added = removed = 0
    for p, (ids, src) in zip(dirs, stored):
        want = np.setdiff1d(ids, taken)
        taken = np.union1d(taken, want)
        part_file = p / PART_FILE
        part = faiss.read_index(str(part_file))
        have = fx.index_ids(part)
        stale, new = np.setdiff1d(have, want), np.setdiff1d(want, have)
        if len(stale) or len(new):
            if len(stale):
                part.remove_ids(stale)
            if len(new):
                fx.add(part, src.get(new), new)
            fx.write_atomic(part, part_file)
            changed.append(part_file)
            added, removed = added + len(new), removed + len(stale)
        src.close()
    count = int(len(taken))             # the held-out ids still stored, and every shard's share
    old = {relative(directory, directory / k): v for k, v in sh.get("files", {}).items()}  # absolute
    files = {**old, **_records(directory, changed)}     # keys of older manifests: named as now
    fields = {}
    if changed and manifest.index_type != "flat":
        fields = retune_sharded(directory, manifest, [ids for ids, _ in stored], taken)
    m = IndexDir(directory).write_manifest(manifest.replace(
        **fields, count=count, sharded={**sh, "files": files}, updated_at=now_utc()))
    return Change(m, added=int(added), removed=int(removed + len(gone_held)))


def retune_sharded(directory: Path, manifest: Manifest, per_shard: list[np.ndarray], ids: np.ndarray,
                   seed: int = 0) -> dict:
    """``tuning.retune`` for a sharded index: self-queries drawn from the stores, their exact
    answers from one streaming pass over the shards (``stream.exact_truth``), the parts searched
    as one tuned to the target with the same margin."""
    from embedder.knn import drop_self

    n, dim = len(ids), manifest.dim
    m = max(1, heldout_size(n, dim))
    own = np.sort(np.random.default_rng(seed + 1).choice(ids, size=min(m, n), replace=False))
    sources = [StoreSource(p / STORE_DIR, manifest.model_hash, dim)
               for p in shard_paths(directory, manifest)]
    try:
        seen, dups = np.zeros(0, np.int64), []
        for s_ids in per_shard:                    # an id counts once: in the first store holding it
            dups.append(np.intersect1d(s_ids, seen))
            seen = np.union1d(seen, s_ids)
        owner = np.full(len(own), -1, dtype=np.int64)
        for i, s_ids in enumerate(per_shard):
            owner[(owner < 0) & np.isin(own, s_ids)] = i
        q = Rows(own, owner, sources)[np.arange(len(own))]
        k = min(K, n - 1) if n > 1 else 1
        truth = drop_self(stream.exact_truth(sources, q, min(k + 1, n), exclude=np.zeros(0, np.int64),
                                             dups=dups), own, k)[0]
    finally:
        for s in sources:
            s.close()
    return retuned(PartsIndex(directory, manifest).cpu_index, fx.IndexSpec.from_manifest(manifest), q, truth,
                   own, manifest.target_recall)


def add_sharded(d: IndexDir, manifest: Manifest, folder: Path, model: str | Path | None = None, *,
                prefix: str = "", batch_size: int = 32, workers: int | None = None,
                device: str = "auto", progress: bool = True) -> Change:
    """``indexer add`` on a sharded index (:func:`indexer.layouts.add_images` holds the lock):
    into the shard whose store holds the fewest images."""
    emb = update_embedder(d, manifest, model, device, batch_size)
    dirs = shard_paths(d.path, manifest)
    sizes = []
    for p in dirs:
        with GalleryStore(p / STORE_DIR) as st:
            sizes.append(len(st))
    target = dirs[int(np.argmin(sizes))]
    with GalleryStore(target / STORE_DIR, readonly=False) as store:
        stats = ingest_folder(store, folder, prefix, emb, target / PART_FILE, workers, progress)
    d.write_report(stats.skipped)
    return replace(sync_parts(d.path, manifest), stats=stats, shard=target)


def remove_sharded(d: IndexDir, manifest: Manifest, targets: Sequence[str]) -> Change:
    """``indexer remove`` on a sharded index: every target (id or relative path) is looked up in
    every shard first (an unknown one refuses the whole command, nothing removed), then removed
    from each shard that holds it."""
    with ExitStack() as opened:
        stores = [(opened.enter_context(GalleryStore(p / STORE_DIR, readonly=False)), f" from {p}")
                  for p in shard_paths(d.path, manifest)]
        msgs = remove_targets(stores, targets, d.path)
    return replace(sync_parts(d.path, manifest), messages=msgs)


def repair_sharded(d: IndexDir, manifest: Manifest, *, batch_size: int = 32, workers: int | None = None,
                   device: str = "auto", progress: bool = True) -> Change:
    """``indexer repair`` on a sharded index: embed each shard's stored images the index's model
    has not embedded, then make the parts hold exactly what the stores hold (``sync_parts``)."""
    from .pipeline import embed_missing

    emb = update_embedder(d, manifest, None, device, batch_size)
    embedded = 0
    for p in shard_paths(d.path, manifest):
        with GalleryStore(p / STORE_DIR, readonly=False) as store:
            embedded += embed_missing(store, emb, workers=workers, progress=progress)
    return replace(sync_parts(d.path, manifest), embedded=embedded)
