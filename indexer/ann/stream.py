"""The streaming build: train once on a sample drawn from the shards, fill each shard apart, so
that no process holds all the vectors (``build.merge_shards`` gathers ~3 x N x d x 4 bytes).

1. ``plan``: counts and cross-shard duplicates, held-out tuning/check sets and the training
   sample (by position in the shards' concatenation: as random as a one-process build's, not the
   same rows), the type as ``selection.select`` measures it among streamable types, and the
   held-out queries' exact answers merged from each shard's ``Source.knn`` (under Ray, the
   sources are :mod:`indexer.ray.readers`).
2. ``fill``: each shard adds its vectors to a copy of the trained empty index.
3. ``tune_and_check`` on the parts searched as one (``open_parts``: ``IndexShardsIVF`` over
   memory-mapped files, one quantizer); the held-out vectors become one more part (``held_part``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import faiss
import numpy as np

from ..errors import IndexerError
from ..store.sources import Source, answers
from . import faiss_index as fx
from .options import BuildOptions
from .sample import Sample, View, census, draw
from .selection import SAMPLE_CAP, SELECT_FROM, candidates, index_fields, select
from .tuning import K, Holdout, heldout_size, recalls, tune


# ---------------------------------------------------------------------------- 1. plan
@dataclass
class Plan:
    """What the driver decided: the spec, the trained empty index, the held-out queries. It
    holds counts and samples only (``indexer.ann.sample``), nothing per gallery vector."""

    spec: fx.IndexSpec
    trained: faiss.Index
    count: int                      # vectors in the index: every shard's, duplicates once
    skip: list[np.ndarray]          # per shard: held-out ids it owns + duplicates it must skip
    held_query_ids: np.ndarray      # ids of [qt; qc]
    qt: np.ndarray                  # tuning queries (vectors)
    qc: np.ndarray                  # check queries
    truth: np.ndarray               # exact top-k ids of [qt; qc] among the non-held vectors
    tiny: bool
    fields: dict                    # manifest fields known so far (selection table, train)
    seconds: dict


def streamable(spec: fx.IndexSpec) -> bool:
    """Types whose shards fill apart and search (or merge) as one: IVF lists, or exact Flat."""
    return spec.mergeable and spec.index_type in ("flat", "ivf", "ivfhnsw", "sq8", "ivfpq")


def plan(sources: Sequence[Source], options: BuildOptions | None = None, *, device: str = "auto",
         progress: bool = False, **option_kw: object) -> Plan:
    """Step 1, on the driver: ``selection.build``'s steps up to the trained empty index, on
    samples each shard reads at its own positions (the driver's memory does not grow with N).
    ``option_kw``: :class:`BuildOptions` fields by name."""
    o = BuildOptions.of(options, **option_kw)
    index_type, nlist, seed, target, max_memory = o.index_type, o.nlist, o.seed, o.target_recall, o.index_memory
    t = {"census": time.perf_counter()}
    counts, dups = census(sources)
    total, dim = sum(counts), sources[0].dim
    n = total - sum(len(d) for d in dups)
    if n == 0:
        raise IndexerError("the shards hold no images")
    t["census"] = time.perf_counter() - t["census"]
    fields: dict = {}
    if index_type == "flat" or (index_type == "auto" and n < o.flat_threshold):
        spec = fx.choose_spec(n, dim, "flat")
        empty = np.zeros(0, np.int64)
        return Plan(spec, fx.train(spec, np.zeros((0, dim), np.float32), dim), n, list(dups), empty,
                    np.zeros((0, dim), np.float32), np.zeros((0, dim), np.float32),
                    np.zeros((0, K), np.int64), True, fields, t)
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed + 7)
    m = heldout_size(n, dim)
    tiny = m == 0
    ndup = total - n                  # positions of duplicates are dropped: draw that many more
    held_pos = draw(rng, total, total if tiny else 2 * m + ndup)
    rest = total - len(held_pos)
    measure = index_type == "auto" and n >= SELECT_FROM and not nlist
    sel_pos = held_pos if tiny or not measure else draw(rng, total, min(rest, SAMPLE_CAP + 1),
                                                        exclude=held_pos)
    sam = Sample(sources, counts, dups, np.union1d(held_pos, sel_pos))
    held_pos, sel_pos = sam.kept(held_pos), sam.kept(sel_pos)
    if not tiny and len(held_pos) > 2 * m:
        held_pos = np.sort(rng.choice(held_pos, 2 * m, replace=False))
    if tiny:
        tune_pos = check_pos = held_pos
    else:
        split = rng.permutation(len(held_pos))
        tune_pos, check_pos = np.sort(held_pos[split[:m]]), np.sort(held_pos[split[m:]])
    qt, qc = sam.x[sam.rows(tune_pos)], sam.x[sam.rows(check_pos)]
    held = (np.zeros(0, np.int64) if tiny else          # in the order of [qt; qc]
            np.concatenate([sam.ids[sam.rows(tune_pos)], sam.ids[sam.rows(check_pos)]]))
    k = min(K, n - len(held))
    truth = exact_truth(sources, np.concatenate([qt, qc]), k, exclude=held, dups=dups)
    t["truth"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if measure:
        specs = [s for s in candidates(n, dim, max_memory) if streamable(s)]
        # select() measures on ho.rows (a sample of SAMPLE_CAP of them when longer): handing
        # it SAMPLE_CAP + 1 sampled rows of a View of n rows keeps its scaling to n
        ho = Holdout(tune_pos, check_pos, sel_pos)
        sel = select(View(sam, n), View(sam, n, ids=True), ho, target, max_memory=max_memory,
                     seed=seed, device=device, specs=specs, progress=progress)
        spec = sel.spec
        fields.update(candidates=sel.table, selection_seconds=round(sel.seconds, 3))
    else:                           # auto here is IVF-Flat (n >= flat_threshold): streamable
        spec = fx.choose_spec(n, dim, index_type, o.flat_threshold, nlist)
        if not streamable(spec):
            raise IndexerError(f"index type {index_type}: its shards cannot be filled apart "
                               "(refine wrappers and HNSW graphs hold every vector in one "
                               "process); use ivf, ivfhnsw, sq8 or ivfpq")
    t["select"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    del sam
    t_rng, want = np.random.default_rng(seed), fx.train_size(spec)
    train = Sample(sources, counts, dups, draw(t_rng, total, want + ndup,
                                               exclude=np.zeros(0, np.int64) if tiny else held_pos))
    x_train = train.x if len(train.x) <= want else train.x[np.sort(t_rng.choice(len(train.x), want, replace=False))]
    trained = fx.train(spec, x_train, dim, device=device, seed=seed, progress=progress)
    t["train"] = time.perf_counter() - t0
    fields.update(train_points=int(len(x_train)), train_seconds=round(t["train"], 3),
                  **fx.kmeans_field(spec, len(x_train), device))
    owner = train.shard_of(np.concatenate([tune_pos, check_pos]))
    skip = [d if tiny else np.union1d(d, held[owner == i]) for i, d in enumerate(dups)]
    return Plan(spec, trained, n, skip, held, qt, qc, truth, tiny, fields, t)


def exact_truth(sources: Sequence[Source], q: np.ndarray, k: int, *, exclude: np.ndarray,
                dups: Sequence[np.ndarray]) -> np.ndarray:
    """Exact top-k ids of ``q`` over every shard's vectors but ``exclude`` and duplicates: each
    shard answers nq x k where it is (``Source.knn``), merged here with faiss's ResultHeap."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    heap = faiss.ResultHeap(len(q), k, keep_max=True)
    asks = [(q, k, np.union1d(exclude, dups[s])) for s in range(len(sources))]
    for D, I in answers(sources, "knn", asks):
        heap.add_result(np.ascontiguousarray(D, dtype=np.float32), np.ascontiguousarray(I, dtype=np.int64))
    heap.finalize()
    return heap.I


# ---------------------------------------------------------------------------- 2. fill
def fill(source: Source, trained: faiss.Index, skip: np.ndarray) -> faiss.Index:
    """Step 2, per shard: its vectors (but ``skip``) in a copy of the trained empty index."""
    index = faiss.clone_index(trained)
    for cids, cx in source.chunks():
        keep = ~np.isin(cids, skip)
        if keep.any():
            fx.add(index, cx[keep], cids[keep])
    return index


def held_part(p: Plan) -> faiss.Index:
    """The held-out vectors (tuning + check queries) in a copy of the trained index: one more
    part, added after tuning (a one-process build adds them to its index at the same point)."""
    index = faiss.clone_index(p.trained)
    if len(p.held_query_ids):
        fx.add(index, np.concatenate([p.qt, p.qc]), p.held_query_ids)
    return index


# ---------------------------------------------------------------------------- 3. search as one
def open_parts(paths: Sequence[str | Path], trained: faiss.Index, mmap: bool = True) -> faiss.Index:
    """Shard index files searched as one: ``IndexShardsIVF`` (one shared quantizer, lists
    assigned once) for IVF types, ``IndexShards`` for Flat; memory-mapped files."""
    flags = faiss.IO_FLAG_MMAP if mmap else 0
    parts = [fx.no_prefetch(faiss.read_index(str(p), flags)) for p in paths]
    return as_one(parts, trained)


def as_one(parts: Sequence[faiss.Index], trained: faiss.Index) -> faiss.Index:
    if fx.is_ivf(trained):
        ivf = faiss.extract_index_ivf(trained)
        sh = faiss.IndexShardsIVF(ivf.quantizer, ivf.nlist, False, False)
    else:
        sh = faiss.IndexShards(trained.d, False, False)
    sh.metric_type = trained.metric_type
    for part in parts:
        sh.add_shard(part)
    sh.referenced_objects = [*parts, trained]     # faiss's own way to keep what C++ does not own
    return sh


def tune_and_check(p: Plan, index: faiss.Index, target: float) -> dict:
    """Step 3: ``selection.build``'s tuning on the shards searched as one (held-out vectors not
    in it yet), and its manifest fields. Returns the fields; the index is left tuned."""
    spec, n, dim = p.spec, p.count, p.trained.d
    if spec.index_type == "flat":
        return index_fields(spec, n, dim, target)
    nt = len(p.qt)
    value, rq_tune = tune(index, spec, p.qt, p.truth[:nt], target)
    rq_check = recalls(index.search(np.ascontiguousarray(p.qc), p.truth.shape[1])[1], p.truth[nt:])
    return {**index_fields(spec, n, dim, target, value, rq_tune, rq_check), **p.fields}
