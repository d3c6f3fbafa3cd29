"""Building a sharded index: the streaming build (:mod:`indexer.ann.stream`) over shard
directories that each hold a store: one training on a sample of the stores, one part per shard
(filled here, or by Ray tasks: ``fill_parts``), tuning on the parts searched as one.
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..ann import faiss_index as fx
from ..ann import stream
from ..ann.options import BuildOptions
from ..directory.index_dir import HELD_FILE, PART_FILE, TRAINED_FILE, IndexDir, now_utc
from ..directory.lock import writer_lock
from ..directory.manifest import Manifest
from ..directory.shard_files import claim_parts, file_records, record_owner, relative
from ..errors import IndexerError
from ..store.sources import Source, StoreSource
from .single import check_shards, from_shards

FillParts = Callable[[Path, list[np.ndarray]], None]   # (trained file, skip ids per shard)


def build_sharded(shard_dirs: Sequence[str | Path], out: str | Path, *, options: BuildOptions | None = None,
                  device: str = "auto", progress: bool = True, fill_parts: FillParts | None = None,
                  sources: Sequence[Source] | None = None, wait: bool = False, **option_kw: object) -> Manifest:
    """Index shard directories where they are; ``out`` gets the manifest that lists them.
    ``sources``: the shards as the plan reads them (default: their stores here; Ray readers from
    ``ray_build``). Holds the writer locks of ``out`` and the shard folders (``wait``)."""
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
        sources = [StoreSource(d.store_dir, model.hash, dim) for d in dirs]
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
                 "files": file_records(out, [out / TRAINED_FILE, out / HELD_FILE, *parts])},
        stage_seconds={k: round(v, 3) for k, v in p.seconds.items()},
        build_seconds=round(time.perf_counter() - t0, 3), built_at=now_utc()))
    record_owner(out, [d.path for d in dirs])
    return written
