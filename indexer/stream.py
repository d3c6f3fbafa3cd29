"""The streaming build: train once on a sample drawn from the shards, fill each shard apart, and
combine the filled shards on disk, so that no process ever holds all the vectors.

Today's merge (``build.merge_shards``) gathers every vector on one node (about three copies of
N x d x 4 bytes). Here the driver holds counts and fixed-size samples (``indexer.shard_sample``):

1. ``plan``: the shards' counts and cross-shard duplicates (a k-way merge of their sorted id
   streams), the held-out tuning/check sets and the training sample, drawn by position in the
   shards' concatenation and read by each shard at its own positions; the type chosen by the
   measurement of a one-process build (``selection.select``, on such a sample) among the types
   whose inverted lists can be merged (IVF-Flat, IVF-HNSW, IVF-SQ8, IVF-PQ; the refine wrappers
   keep every exact vector in memory, which is what this path avoids); the exact answers of the
   held-out queries by one streaming pass over the shards. The samples are as random as a
   one-process build's but not the same rows, so the index is as good, not identical.
2. ``fill``: each shard adds its own vectors to a copy of the trained empty index (a Ray task
   on the node that holds the shard).
3. ``tune_and_check`` on the shards searched as one (``open_parts``: ``faiss.IndexShardsIVF``
   over memory-mapped shard files, one shared quantizer), then the held-out vectors become one
   more small part (``held_part``).
4. ``merge_ondisk``: optionally, one IVF index whose lists live in a file (faiss's
   ``OnDiskInvertedLists``), written list by list.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol, Sequence

import faiss
import numpy as np

from . import faiss_index as fx
from .errors import IndexerError
from .manifest import DEFAULT_TARGET_RECALL
from .selection import SAMPLE_CAP, SELECT_FROM, candidates, index_fields, select
from .shard_sample import Sample, View, census, draw
from .store import GalleryStore
from .tuning import GT_BUDGET, MAX_QUERIES, K, Holdout, clears, recalls, tune

CHUNK = 65_536


# ---------------------------------------------------------------------------- where vectors come from
class Source(Protocol):
    """One shard's vectors: its ids ascending (all at once, or in chunks, or just how many), its
    vectors in chunks, by id, and at given positions of its id order (a sample)."""

    dim: int

    def ids(self) -> np.ndarray: ...
    def id_chunks(self, size: int = CHUNK) -> Iterator[np.ndarray]: ...
    def count(self) -> int: ...
    def chunks(self, size: int = CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]: ...
    def get(self, ids: np.ndarray) -> np.ndarray: ...
    def sample(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


class StoreSource:
    """A shard's LMDB store: the embeddings of one model, read in chunks (never all at once)."""

    def __init__(self, store_dir: str | Path, model_hash: str, dim: int) -> None:
        self.store = GalleryStore(store_dir)
        self.model_hash, self.dim = model_hash, int(dim)

    def ids(self) -> np.ndarray:
        parts = list(self.id_chunks())
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def id_chunks(self, size: int = CHUNK) -> Iterator[np.ndarray]:
        """The ids ascending (LMDB keys are big-endian ids), ``size`` at a time."""
        out: list[int] = []
        with self.store._read() as txn:
            meta = self.store._db("meta")
            for k, _ in self.store._scan(txn, self.model_hash):
                if txn.get(k, db=meta) is not None:
                    out.append(int.from_bytes(k, "big"))
                    if len(out) == size:
                        yield np.array(out, dtype=np.int64)
                        out = []
        if out:
            yield np.array(out, dtype=np.int64)

    def count(self) -> int:
        return sum(len(c) for c in self.id_chunks())

    def sample(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, vectors) at ``positions`` (ascending) of the id order: one pass over the keys."""
        positions = np.asarray(positions, dtype=np.int64)
        got, at = [], 0
        for c in self.id_chunks():
            lo, hi = np.searchsorted(positions, [at, at + len(c)])
            got.append(c[positions[lo:hi] - at])
            at += len(c)
        ids = np.concatenate(got) if got else np.zeros(0, np.int64)
        return ids, self.get(ids)

    def chunks(self, size: int = CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        ids, rows = [], []
        with self.store._read() as txn:
            meta = self.store._db("meta")
            for k, v in self.store._scan(txn, self.model_hash, values=True):
                if txn.get(k, db=meta) is None:
                    continue
                ids.append(int.from_bytes(k, "big"))
                rows.append(np.frombuffer(v, dtype=np.float32))
                if len(ids) == size:
                    yield np.array(ids, dtype=np.int64), np.stack(rows)
                    ids, rows = [], []
        if ids:
            yield np.array(ids, dtype=np.int64), np.stack(rows)

    def get(self, ids: np.ndarray) -> np.ndarray:
        if len(ids) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self.store.get_embeddings(self.model_hash, [int(i) for i in ids])

    def close(self) -> None:
        self.store.close()


class ArraySource:
    """(ids ascending, vectors) already in arrays, e.g. ``np.load(..., mmap_mode="r")``: the
    benchmark's synthetic shards, and tests."""

    def __init__(self, ids: np.ndarray, x: np.ndarray) -> None:
        self._ids, self.x, self.dim = np.asarray(ids, dtype=np.int64), x, int(x.shape[1])

    def ids(self) -> np.ndarray:
        return self._ids

    def id_chunks(self, size: int = CHUNK) -> Iterator[np.ndarray]:
        for s in range(0, len(self._ids), size):
            yield np.asarray(self._ids[s:s + size], dtype=np.int64)

    def count(self) -> int:
        return len(self._ids)

    def sample(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        positions = np.asarray(positions, dtype=np.int64)
        return (np.asarray(self._ids[positions], dtype=np.int64),
                np.ascontiguousarray(self.x[positions], dtype=np.float32))

    def chunks(self, size: int = CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for s in range(0, len(self._ids), size):
            yield self._ids[s:s + size], np.ascontiguousarray(self.x[s:s + size], dtype=np.float32)

    def get(self, ids: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.x[np.searchsorted(self._ids, ids)], dtype=np.float32)

    def close(self) -> None:
        pass


class Rows:
    """Given ids and their owning shards as a lazy array: ``rows[positions]`` fetches those
    vectors from the shards that own them (the self-queries of ``shard_build.retune_sharded``)."""

    def __init__(self, ids: np.ndarray, owner: np.ndarray, sources: Sequence[Source]) -> None:
        self.ids, self.owner, self.sources = ids, owner, sources
        self.shape = (len(ids), sources[0].dim)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), self.shape[1]), dtype=np.float32)
        own = self.owner[rows]
        for s in np.unique(own):
            m = own == s
            out[m] = self.sources[int(s)].get(self.ids[rows[m]])
        return out


# ---------------------------------------------------------------------------- 1. plan
@dataclass
class Plan:
    """What the driver decided: the spec, the trained empty index, the held-out queries. It
    holds counts and samples only (``indexer.shard_sample``), nothing per gallery vector."""

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


def _heldout_size(n: int, dim: int) -> int:
    """``tuning.holdout``'s size rule (up to MAX_QUERIES a set, 10% of a small gallery, fewer
    for a large wide one), without its permutation of all n rows."""
    return min(MAX_QUERIES, n // 10, max(250, int(GT_BUDGET / (2 * max(n, 1) * dim))))


def _train_size(spec: fx.IndexSpec) -> int:
    """How many points ``faiss_index.training_sample`` trains ``spec`` on (same rule)."""
    return max(spec.nlist * fx.TRAIN_POINTS_PER_CENTROID,
               (fx.PQFS_TRAIN_POINTS if spec.k_factor else fx.PQ_TRAIN_POINTS) if spec.pq_m else 0)


def plan(sources: Sequence[Source], *, index_type: str = "auto",
         flat_threshold: int = fx.DEFAULT_FLAT_THRESHOLD, nlist: int | None = None,
         target: float = DEFAULT_TARGET_RECALL, max_memory: int | None = None, device: str = "auto", seed: int = 0,
         progress: bool = False) -> Plan:
    """Step 1, on the driver: ``selection.build``'s steps up to the trained empty index (held-out
    sets, exact answers, choice by measurement, training), on samples each shard reads at its
    own positions, so the driver's memory is the samples' and does not grow with N."""
    t = {"census": time.perf_counter()}
    counts, dups = census(sources)
    total, dim = sum(counts), sources[0].dim
    n = total - sum(len(d) for d in dups)
    if n == 0:
        raise IndexerError("the shards hold no images")
    t["census"] = time.perf_counter() - t["census"]
    fields: dict = {}
    if index_type == "flat" or (index_type == "auto" and n < flat_threshold):
        spec = fx.choose_spec(n, dim, "flat")
        empty = np.zeros(0, np.int64)
        return Plan(spec, fx.train(spec, np.zeros((0, dim), np.float32), dim), n, list(dups), empty,
                    np.zeros((0, dim), np.float32), np.zeros((0, dim), np.float32),
                    np.zeros((0, K), np.int64), True, fields, t)
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed + 7)
    m = _heldout_size(n, dim)
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
    if index_type == "auto":
        if measure:
            specs = [s for s in candidates(n, dim, max_memory) if streamable(s)]
            # select() measures on ho.rows (a sample of SAMPLE_CAP of them when longer): handing
            # it SAMPLE_CAP + 1 sampled rows of a View of n rows keeps its scaling to n
            ho = Holdout(tune_pos, check_pos, sel_pos)
            sel = select(View(sam, n), View(sam, n, ids=True), ho, target, max_memory=max_memory,
                         seed=seed, device=device, specs=specs, progress=progress)
            spec = sel.spec
            fields.update(candidates=sel.table, selection_seconds=round(sel.seconds, 3))
        else:
            spec = fx.choose_spec(n, dim, "ivf", nlist=nlist)
    else:
        spec = fx.choose_spec(n, dim, index_type, flat_threshold, nlist)
        if not streamable(spec):
            raise IndexerError(f"index type {index_type}: its shards cannot be filled apart "
                               "(refine wrappers and HNSW graphs hold every vector in one "
                               "process); use ivf, ivfhnsw, sq8 or ivfpq")
    t["select"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    del sam
    t_rng, want = np.random.default_rng(seed), _train_size(spec)
    train = Sample(sources, counts, dups, draw(t_rng, total, want + ndup,
                                               exclude=np.zeros(0, np.int64) if tiny else held_pos))
    x_train = train.x if len(train.x) <= want else train.x[np.sort(t_rng.choice(len(train.x), want, replace=False))]
    trained = fx.train(spec, x_train, dim, device=device, seed=seed)
    t["train"] = time.perf_counter() - t0
    fields.update(train_points=int(len(x_train)), train_seconds=round(t["train"], 3))
    owner = train.shard_of(np.concatenate([tune_pos, check_pos]))
    skip = [d if tiny else np.union1d(d, held[owner == i]) for i, d in enumerate(dups)]
    return Plan(spec, trained, n, skip, held, qt, qc, truth, tiny, fields, t)


def exact_truth(sources: Sequence[Source], q: np.ndarray, k: int, *, exclude: np.ndarray,
                dups: Sequence[np.ndarray]) -> np.ndarray:
    """Exact top-k ids of ``q`` over every shard's vectors but ``exclude`` and duplicates, in
    one streaming pass (faiss's ResultHeap keeps the best k across chunks)."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    heap = faiss.ResultHeap(len(q), k, keep_max=True)
    for s, src in enumerate(sources):
        drop = np.union1d(exclude, dups[s])
        for cids, cx in src.chunks():
            keep = ~np.isin(cids, drop)
            if not keep.all():
                cids, cx = cids[keep], cx[keep]
            if not len(cids):
                continue
            D, I = faiss.knn(q, cx, min(k, len(cids)), metric=faiss.METRIC_INNER_PRODUCT)
            heap.add_result(D, np.where(I >= 0, cids[np.maximum(I, 0)], -1))
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
    """Shard index files searched as one index: ``IndexShardsIVF`` (one shared coarse quantizer,
    so a query is assigned to its lists once, not once per shard) for IVF types, ``IndexShards``
    for Flat. Files are memory-mapped: the page cache, not this process, holds the lists."""
    flags = faiss.IO_FLAG_MMAP if mmap else 0
    parts = [faiss.read_index(str(p), flags) for p in paths]
    return as_one(parts, trained)


def as_one(parts: Sequence[faiss.Index], trained: faiss.Index) -> faiss.Index:
    if fx._is_ivf(trained):
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


# ---------------------------------------------------------------------------- 4. one index on disk
def merge_ondisk(trained: faiss.Index, part_files: Sequence[str | Path], out_index: str | Path,
                 params: str = "") -> int:
    """Combine filled parts into one IVF index whose lists live in ``out_index`` + ``.ivfdata``
    (faiss's ``OnDiskInvertedLists``); read it back with ``read_ondisk``. Returns the count.

    Hand-written rather than ``faiss.contrib.ondisk.merge_ondisk``: that one maps every part and
    the output into the merging process and copies through the maps, so its peak RSS is about
    twice the index (measured: 1,056 MiB for a 498 MiB index at 1M x 128), which grows with N on
    one node. Here faiss allocates the lists (``resize``, in one pre-sized file), the codes and
    ids go in with ``os.pwrite`` (the page cache, not this process, holds them) and one part is
    mapped at a time, so the peak is about the largest part, not the index.
    """
    out_index = Path(out_index)
    data = out_index.with_suffix(".ivfdata")
    data.unlink(missing_ok=True)
    if not fx._is_ivf(trained):
        raise IndexerError(f"{trained}: only IVF indexes merge on disk")
    index = faiss.clone_index(trained)
    ivf = faiss.extract_index_ivf(index)
    nlist, code_size = ivf.nlist, ivf.code_size
    sizes = np.zeros(nlist, dtype=np.int64)
    for f in part_files:                     # list sizes only: the lists stay on disk
        part = faiss.read_index(str(f), faiss.IO_FLAG_MMAP)     # (owns inv: keep it alive)
        inv = faiss.extract_index_ivf(part).invlists
        sizes += np.array([inv.list_size(l) for l in range(nlist)], dtype=np.int64)
        del part, inv
    cap = np.where(sizes > 0, 2 ** np.ceil(np.log2(np.maximum(sizes, 1))).astype(np.int64), 0)
    il = faiss.OnDiskInvertedLists(nlist, code_size, str(data))
    il.update_totsize(int(max(32, (cap * (code_size + 8)).sum())))   # one file, one map
    for l in np.nonzero(sizes)[0]:
        il.resize(int(l), int(sizes[l]))     # faiss picks the slot (capacity: a power of two)
    where = [(il.lists.at(int(l)).offset, il.lists.at(int(l)).capacity) for l in range(nlist)]
    done = np.zeros(nlist, dtype=np.int64)
    fd = os.open(data, os.O_WRONLY)
    try:
        for f in part_files:
            part = faiss.read_index(str(f), faiss.IO_FLAG_MMAP)
            inv = faiss.extract_index_ivf(part).invlists
            for l in range(nlist):
                n = inv.list_size(l)
                if not n:
                    continue
                off, capacity = where[l]
                codes = faiss.rev_swig_ptr(inv.get_codes(l), n * code_size)
                ids = faiss.rev_swig_ptr(inv.get_ids(l), n)
                os.pwrite(fd, codes, off + int(done[l]) * code_size)
                os.pwrite(fd, ids, off + capacity * code_size + int(done[l]) * 8)
                done[l] += n
            del part, inv                    # unmapped: its pages leave this process
        os.fsync(fd)
    finally:
        os.close(fd)
    ivf.replace_invlists(il, True)
    il.this.disown()
    index.ntotal = ivf.ntotal = int(sizes.sum())
    fx.set_search_params(index, params)
    fx.write_atomic(index, out_index)
    return int(index.ntotal)


def read_ondisk(path: str | Path) -> faiss.Index:
    """An index written by ``merge_ondisk``: its ``.ivfdata`` is found beside it (wherever the
    directory has moved) and memory-mapped."""
    return faiss.read_index(str(path), faiss.IO_FLAG_ONDISK_SAME_DIR)


def build_in_process(sources: Sequence[Source], workdir: str | Path, *, target: float = DEFAULT_TARGET_RECALL,
                     progress: bool = False, **plan_opts) -> tuple[faiss.Index, dict, list[Path]]:
    """Steps 1-3 in this process (the Ray build runs step 2 as tasks): the part files
    ``workdir/part-<i>.faiss`` (and ``held.faiss``), and the parts opened as one, tuned."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    p = plan(sources, target=target, progress=progress, **plan_opts)
    files = []
    for i, src in enumerate(sources):
        files.append(workdir / f"part-{i}.faiss")
        fx.write_atomic(fill(src, p.trained, p.skip[i]), files[-1])
    index = open_parts(files, p.trained)
    fields = tune_and_check(p, index, target)
    files.append(workdir / "held.faiss")
    fx.write_atomic(held_part(p), files[-1])
    index = open_parts(files, p.trained)
    fx.set_search_params(index, fields["search_params"])
    return index, fields, files
