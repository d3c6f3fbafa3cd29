"""Choosing the faiss index by measurement, and keeping its recall promise for new queries.

Why measure: the fastest index at a recall target depends on the data (IVF-Flat on clustered
vectors; near a low-dimensional subspace, as image embeddings lie, compressed codes re-ranked
exactly). ``select`` builds a few candidates on a sample, tunes each, times queries and keeps the
fastest within the memory budget. ``build`` holds out a tuning set (the setting must clear the
target by two sigma) and a check set (the manifest's recall), both added to the index afterwards.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

import faiss
import numpy as np

from embedder.knn import exact_knn

from ..errors import IndexerError, size_text
from . import faiss_index as fx
from .options import BuildOptions
from .tuning import K, Holdout, clears, holdout, measure_qps, recalls, tune

SELECT_FROM = 10_000        # smaller galleries forced past Flat get IVF-Flat: timings would be noise
SAMPLE_CAP = 50_000         # candidates are built on at most this many gallery vectors
HNSW_UP_TO = 100_000        # HNSW is a candidate up to this size (its build grows ~n log n)
HNSW_QUANTIZER_FROM = 8_192 # nlist from which an HNSW graph finds the lists faster than a scan
TIE = 0.10                  # within 10% of the fastest counts as a tie: the earlier candidate wins


def serialized_bytes(index: faiss.Index) -> int:
    return int(faiss.serialize_index(index).size)


def predicted_bytes(spec: fx.IndexSpec, n: int, dim: int) -> int:
    """A lower bound of ``spec``'s size over ``n`` vectors from its factory string (codes by
    ``faiss.contrib.factory_tools.get_code_size``, ids, centroids by ``memory_bytes``): a
    candidate above the budget by it is never built."""
    from faiss.contrib.factory_tools import get_code_size

    key = spec.factory.removeprefix("IDMap2,").removesuffix("np")     # ids / training flags: no code
    return fx.memory_bytes(n, get_code_size(dim, key), spec.nlist or 0, dim)


# ---------------------------------------------------------------------------- candidates
def candidates(n: int, dim: int, max_memory: int | None = None) -> list[fx.IndexSpec]:
    """What to try for an ``n`` x ``dim`` gallery, in order of preference on a tie: Flat; IVF-Flat at
    the usual nlist and a quarter of it (HNSW-assigned from 8k lists); SQ8 and 4-bit fast-scan PQ
    re-ranked exactly; HNSW while affordable; under ``max_memory``, codes that replace the vectors."""
    if n < SELECT_FROM:
        return [fx.choose_spec(n, dim, "ivf")]
    nl = fx.nlist_for(n)
    coarse = max(1, nl // 4)
    pq = fx.choose_spec(n, dim, "pqfsrf", nlist=coarse)
    out = [fx.choose_spec(n, dim, "flat"),
           fx.choose_spec(n, dim, "ivf", nlist=nl),
           fx.choose_spec(n, dim, "ivf", nlist=coarse)]
    if nl >= HNSW_QUANTIZER_FROM:
        out.append(fx.choose_spec(n, dim, "ivfhnsw", nlist=nl))
    out += [fx.choose_spec(n, dim, "sq8rf", nlist=nl), pq, replace(pq, k_factor=2 * pq.k_factor)]
    if n <= HNSW_UP_TO:
        out.append(fx.choose_spec(n, dim, "hnsw"))
    if max_memory is not None and max_memory < 1.1 * n * 4 * dim:
        out += [fx.choose_spec(n, dim, "sq8", nlist=nl),
                replace(fx.choose_spec(n, dim, "pqfsr8", nlist=coarse), k_factor=2 * pq.k_factor)]
    return out


def scaled(spec: fx.IndexSpec, n_sample: int, n_full: int) -> fx.IndexSpec:
    """``spec`` for a sample: nlist shrunk in proportion, so lists hold as many vectors."""
    if not spec.nlist or n_sample >= n_full:
        return spec
    nl = max(1, round(spec.nlist * n_sample / n_full))
    return replace(spec, nlist=nl, factory=spec.factory.replace(f"IVF{spec.nlist}", f"IVF{nl}"))


@dataclass
class Selection:
    spec: fx.IndexSpec
    table: list[dict]
    index: faiss.Index | None      # the chosen candidate, when it was built on the whole gallery
    seconds: float


def select(x: np.ndarray, ids: np.ndarray, ho: Holdout, target: float, *,
           max_memory: int | None = None, seed: int = 0, device: str = "auto",
           specs: Sequence[fx.IndexSpec] | None = None, progress: bool = False) -> Selection:
    """Build, tune and time each candidate on a sample of ``ho.rows``; keep the fastest that clears
    the target on ``ho.tune`` and whose memory, extrapolated to the gallery, fits ``max_memory``."""
    t_start = time.perf_counter()
    n, dim = x.shape
    rows = ho.rows
    if len(rows) > SAMPLE_CAP:
        rng = np.random.default_rng(seed + 11)
        rows = np.sort(rng.choice(rows, SAMPLE_CAP, replace=False))
    whole = len(rows) == len(ho.rows)
    xs = np.ascontiguousarray(x[rows], dtype=np.float32)
    ids_s = ids[rows]
    q = np.ascontiguousarray(x[ho.tune], dtype=np.float32)
    k = min(K, len(rows))
    truth = exact_knn(q, xs, k, "ip", ids=ids_s)[1]
    specs = list(specs) if specs is not None else candidates(n, dim, max_memory)
    centroids: dict[int, np.ndarray] = {}
    table: list[dict] = []
    built: dict[int, faiss.Index] = {}     # sample = gallery: candidates that may be the index
    last: tuple | None = None
    from tqdm import tqdm

    for i, spec in enumerate(tqdm(specs, desc="choosing the index", unit="candidate",
                                  disable=not progress)):
        least = predicted_bytes(spec, n, dim)
        if max_memory is not None and least > max_memory:     # cannot fit: not worth building
            table.append(_unbuilt(spec, least))
            continue
        s_spec = scaled(spec, len(rows), n) if not whole else spec
        if last is not None and last[0] == s_spec.factory:     # only a search parameter differs
            index, empty, build_s = last[1:]
        else:
            t0 = time.perf_counter()
            train_rows = fx.training_sample(len(rows), s_spec, seed)
            if s_spec.nlist and s_spec.nlist not in centroids:
                centroids[s_spec.nlist] = fx.kmeans(xs[train_rows], s_spec.nlist, device=device,
                                                    seed=seed)
            index = fx.train(s_spec, xs[train_rows], dim, device=device, seed=seed,
                             centroids=centroids.get(s_spec.nlist))
            empty = serialized_bytes(index)
            fx.add(index, xs, ids_s)
            build_s = time.perf_counter() - t0
            last = (s_spec.factory, index, empty, build_s)
        value, rq = tune(index, s_spec, q, truth, target)
        qps = measure_qps(index, q, k)
        filled = serialized_bytes(index)
        per_vec = (filled - empty) / len(rows)
        fixed = empty * (spec.nlist / s_spec.nlist if s_spec.nlist else 1)
        memory = int(fixed + per_vec * n)
        rank_qps = qps * len(rows) / n if spec.index_type == "flat" else qps
        table.append({"index_type": spec.index_type, "factory": spec.factory,
                      "sample_factory": s_spec.factory, "search_params": spec.search_params(value),
                      "recall_at_10": round(float(rq.mean()), 4), "qps": round(qps, 1),
                      "rank_qps": round(rank_qps, 1), "memory_bytes": memory,
                      "build_seconds": round(build_s, 3), "meets_target": clears(rq, target),
                      "fits_memory": max_memory is None or memory <= max_memory})
        if whole and table[-1]["meets_target"] and table[-1]["fits_memory"]:
            # kept while it can still win: ``choose`` takes the first within TIE of the fastest,
            # and the fastest only grows (holding all six took 1.3 GB at 25k x 2,560)
            built[i] = index
            fastest = max(table[j]["rank_qps"] for j in built)
            built = {j: b for j, b in built.items() if table[j]["rank_qps"] >= (1 - TIE) * fastest}
    last = None         # frees the last candidate built (unless it is the one kept)
    chosen = choose(table, max_memory)
    for i, row in enumerate(table):
        row["chosen"] = i == chosen
    return Selection(specs[chosen], table, built.get(chosen), time.perf_counter() - t_start)


def _unbuilt(spec: fx.IndexSpec, least: int) -> dict:
    """The table row of a candidate whose predicted size is over the budget (never built)."""
    return {"index_type": spec.index_type, "factory": spec.factory, "sample_factory": None,
            "search_params": "", "recall_at_10": 0.0, "qps": 0.0, "rank_qps": 0.0,
            "memory_bytes": int(least), "build_seconds": 0.0, "meets_target": False,
            "fits_memory": False, "built": False}


def choose(table: list[dict], max_memory: int | None = None) -> int:
    """Row of the fastest candidate that meets the target and fits (ties within TIE: the earlier
    row); else the fitting one with the best recall; none fits: IndexerError."""
    fit = [i for i, r in enumerate(table) if r["fits_memory"]]
    if not fit:
        small = min(table, key=lambda r: r["memory_bytes"])
        raise IndexerError(f"--index-memory {size_text(max_memory or 0)}: no index type fits; the "
                           f"smallest, {small['index_type']}, needs about {size_text(small['memory_bytes'])}")
    ok = [i for i in fit if table[i]["meets_target"]]
    if not ok:
        return max(fit, key=lambda i: (table[i]["recall_at_10"], -i))
    fastest = max(table[i]["rank_qps"] for i in ok)
    return min(i for i in ok if table[i]["rank_qps"] >= (1 - TIE) * fastest)


# ---------------------------------------------------------------------------- build
def build(ids: np.ndarray, x: np.ndarray, options: BuildOptions | None = None, *, device: str = "auto",
          trained: faiss.Index | None = None, parts: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
          progress: bool = False, **option_kw: object) -> tuple[faiss.Index, dict]:
    """Choose (or take ``index_type``), train, fill and tune an index over (ids ascending, x), recall
    measured on held-out gallery vectors: (index, manifest fields). ``parts``: each fills its own copy
    of the trained index, merged with ``merge_from``; ``option_kw``: :class:`BuildOptions` fields."""
    o = BuildOptions.of(options, **option_kw)
    index_type, nlist, seed, target, max_memory = o.index_type, o.nlist, o.seed, o.target_recall, o.index_memory
    n, dim = x.shape
    if n <= 0:
        raise IndexerError("cannot build an index of an empty gallery")
    if max_memory is not None and max_memory < n * dim:
        raise IndexerError(f"--index-memory {size_text(max_memory)}: {n} x {dim} vectors need at least "
                           f"{size_text(n * dim)} even as 8-bit codes")
    if index_type == "flat" or (index_type == "auto" and n < o.flat_threshold):
        spec = fx.choose_spec(n, dim, "flat")
        need = fx.memory_bytes(n, 4 * dim, 0, dim)
        if max_memory is not None and need > max_memory:
            raise IndexerError(f"--index-memory {size_text(max_memory)}: an exact index of {n} x {dim} "
                               f"needs {size_text(need)}; use --index-type sq8 or pqfsr8")
        index = fx.train(spec, x[:0], dim)
        _fill(index, spec, x, ids, np.arange(n), parts, np.zeros(0, dtype=np.int64))
        return index, index_fields(spec, int(index.ntotal), dim, target)
    ho = holdout(n, dim, seed)
    tiny = len(ho.tune) == 0
    if tiny:                        # a handful of vectors: tune on the gallery itself
        ho = Holdout(np.arange(n), np.arange(n), np.arange(n))
    k = min(K, len(ho.rows))
    qt, qc = x[ho.tune], x[ho.check]
    truth = exact_knn(np.concatenate([qt, qc]), x, k, "ip", ids=ids, rows=ho.rows)[1]
    sel = None
    if index_type == "auto" and n >= SELECT_FROM and trained is None and not nlist:  # --nlist: IVF-Flat
        sel = select(x, ids, ho, target, max_memory=max_memory, seed=seed, device=device, progress=progress)
        spec = sel.spec
    else:                           # auto here is IVF-Flat (n >= flat_threshold)
        spec = fx.choose_spec(n, dim, index_type, o.flat_threshold, nlist)
    train_rows = ho.rows[fx.training_sample(len(ho.rows), spec, seed)]
    t_train = 0.0
    if sel is not None and sel.index is not None:
        index = sel.index       # built on the whole gallery during selection: no need to rebuild
    else:
        t0 = time.perf_counter()
        empty = trained if trained is not None else fx.train(spec, x[train_rows], dim,
                                                             device=device, seed=seed, progress=progress)
        t_train = time.perf_counter() - t0
        index = faiss.clone_index(empty)
        _fill(index, spec, x, ids, ho.rows, parts, np.zeros(0, np.int64) if tiny else ids[ho.held])
    value, rq_tune = tune(index, spec, qt, truth[:len(qt)], target)
    rq_check = recalls(index.search(np.ascontiguousarray(qc, dtype=np.float32), k)[1], truth[len(qt):])
    if not tiny:
        fx.add(index, x[ho.held], ids[ho.held])
    fields = {**index_fields(spec, int(index.ntotal), dim, target, value, rq_tune, rq_check),
              "train_points": int(len(train_rows)), "train_seconds": round(t_train, 3)}
    if trained is None:                        # which k-means found the lists (faiss_index.kmeans)
        fields.update(fx.kmeans_field(spec, len(train_rows), device))
    if max_memory is not None:
        fields["max_memory"] = int(max_memory)
        size = serialized_bytes(index) if sel is None else None
        if size is not None and size > max_memory:
            raise IndexerError(f"--index-memory {size_text(max_memory)}: the {spec.index_type} index needs "
                               f"{size_text(size)}; use --index-type auto or a larger budget")
    if sel is not None:
        fields.update(candidates=sel.table, selection_seconds=round(sel.seconds, 3))
    return index, fields


def index_fields(spec: fx.IndexSpec, n: int, dim: int, target: float, value: int = 0,
                 rq_tune: np.ndarray | None = None, rq_check: np.ndarray | None = None) -> dict:
    """The manifest fields of an index tuned to ``target`` (``rq_*``: recall@10 per tuning and
    per held-out query; None: exact Flat), shared by this build and the streaming one."""
    fields = {**spec.to_dict(), "target_recall": target, "count": n, "dim": int(dim), "metric": "inner_product"}
    if rq_check is None or rq_tune is None:
        return {**fields, "nprobe": 0, "search_params": "", "recall_at_10": 1.0, "train_points": 0,
                "train_seconds": 0.0}
    fields.update(nprobe=int(value) if spec.nlist else 0, search_params=spec.search_params(value),
                  recall_at_10=round(float(rq_check.mean()), 4), tuning_queries=int(len(rq_tune)),
                  tuning_recall_at_10=round(float(rq_tune.mean()), 4), heldout_queries=int(len(rq_check)))
    if rq_check.mean() < target:
        fields["warning"] = (f"recall@10 on held-out queries {rq_check.mean():.3f} < target {target}"
                             + (f" even at {spec.param} = its maximum ({spec.index_type} loses "
                                "precision); use --index-type ivf" if not clears(rq_tune, target) else ""))
    return fields


def _fill(index: faiss.Index, spec: fx.IndexSpec, x: np.ndarray, ids: np.ndarray, rows: np.ndarray,
          parts: Sequence[tuple[np.ndarray, np.ndarray]] | None, held: np.ndarray,
          chunk: int = 65_536) -> None:
    """Add ``x[rows]`` (or the parts' vectors whose ids are not ``held``) to ``index``."""
    if parts is not None and spec.mergeable:
        empty = faiss.clone_index(index)
        for pids, px in parts:
            keep = ~np.isin(pids, held)
            part = faiss.clone_index(empty)
            fx.add(part, px[keep], pids[keep])
            index.merge_from(part, 0)
        return
    for s in range(0, len(rows), chunk):
        r = rows[s:s + chunk]
        fx.add(index, x[r], ids[r])

