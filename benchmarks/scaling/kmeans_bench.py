"""k-means for IVF lists: exact assignment (faiss.Kmeans) against approximate assignment
(``faiss_index.kmeans_approx``): seconds, and recall@10 of IVF-Flat at equal nprobe.

Run from the repository root, under ``nice -n 10`` (the machine is shared):

    python -m benchmarks.scaling.kmeans_bench --points 1048576 --lists 16384 --methods exact,approx
    python -m benchmarks.scaling.kmeans_bench --points 262144 --lists 4096 --methods exact,approx

The data is the 10M plan's (``inputs.low_rank``, d = 128, the law of ``scale_bench``): a
k-means sample of ``--points``, a gallery of ``--gallery`` other vectors (default: as many) and
``--queries`` fresh queries (default 1,000; each row's recall difference to the first row comes
with its 95% interval over the queries: at 1,000 it is about +-0.01, so the 0.005 goal needs
~10,000). ``--features F.npy`` uses real embeddings instead (rows shuffled; the first
``--queries`` are the queries, the k-means sample is drawn from the rest, the gallery is the rest).
Each method's centroids fill one IVF-Flat over the same gallery (its quantizer an HNSW graph
from 8,192 lists, as the plan's IVF16384_HNSW32 choice, built on one thread so both indexes get
the same kind of graph); recall@10 against exact search at the same nprobe values. Centroids
and seconds are cached in ``--work`` (a rerun with another nprobe reuses them).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import faiss
import numpy as np

from indexer.ann import faiss_index as fx


def data(points: int, gallery: int, features: Path | None, d: int = 128, queries: int = 1000
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(k-means sample, gallery, queries)."""
    if features is not None:
        f = np.load(features).astype(np.float32)
        faiss.normalize_L2(f)
        f = f[np.random.default_rng(0).permutation(len(f))]
        q, rest = f[:queries], f[queries:]
        take = min(points, len(rest))
        return rest[np.sort(np.random.default_rng(1).choice(len(rest), take, replace=False))], rest, q
    from benchmarks.inputs.low_rank import low_rank, low_rank_law

    law = low_rank_law(d, 0)
    return low_rank(points, law, seed=11), low_rank(gallery or points, law, seed=12), low_rank(queries, law, seed=2)


def centroids(method: str, x: np.ndarray, lists: int, seed: int, work: Path, tag: str, refine: int
              ) -> dict[str, tuple[np.ndarray, float]]:
    """The method's centroids and seconds (cached in ``work``). "approx" gives one entry per
    refinement iteration (approx-r0 = the two-level start), seconds counted from its start."""
    names = [f"approx-r{i}" for i in range(refine + 1)] if method == "approx" else [method]
    paths = {m: work / f"{tag}-{m}-{len(x)}-{lists}-{seed}.npy" for m in names}
    if all(p.exists() for p in paths.values()):
        return {m: (np.load(p), json.loads(p.with_suffix(".json").read_text())["seconds"])
                for m, p in paths.items()}
    out: dict[str, tuple[np.ndarray, float]] = {}
    t0 = time.perf_counter()
    if method == "approx":
        def keep(i: int, c: np.ndarray) -> None:
            out[f"approx-r{i}"] = (c.copy(), time.perf_counter() - t0)

        fx.kmeans_approx(x, lists, seed=seed, refine=refine, progress=True, on_iteration=keep)
    else:
        c = fx.kmeans(x, lists, device="cpu", seed=seed, method=method, progress=True)
        out[method] = (c, time.perf_counter() - t0)
    for m, (c, sec) in out.items():
        np.save(paths[m], c)
        paths[m].with_suffix(".json").write_text(json.dumps({"seconds": sec}))
    return out


def recall(c: np.ndarray, gallery: np.ndarray, q: np.ndarray, truth: np.ndarray, nprobes: list[int]) -> dict:
    """recall@10 of an IVF-Flat with centroids ``c`` over ``gallery`` at each nprobe."""
    d, lists = gallery.shape[1], len(c)
    hnsw = lists >= 8192
    quant = faiss.IndexHNSWFlat(d, fx.HNSW_M, faiss.METRIC_INNER_PRODUCT) if hnsw else faiss.IndexFlatIP(d)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    quant.add(c)
    faiss.omp_set_num_threads(threads)
    ivf = faiss.IndexIVFFlat(quant, d, lists, faiss.METRIC_INNER_PRODUCT)
    ivf.is_trained = True                 # the quantizer holds the centroids
    if hnsw:
        quant.hnsw.efSearch = 64
    fx.add(ivf, gallery, np.arange(len(gallery)))
    out = {}
    for p in nprobes:
        ivf.nprobe = p
        if hnsw:
            quant.hnsw.efSearch = max(2 * p, 64)
        i = ivf.search(q, 10)[1]
        per = np.array([len(np.intersect1d(a, b)) / 10 for a, b in zip(i, truth)])
        out[p], out[f"per-query {p}"] = float(per.mean()), per
    sizes = np.array([ivf.get_list_size(j) for j in range(lists)])
    out["imbalance"] = float((sizes.astype(np.float64) ** 2).sum() * lists / sizes.sum() ** 2)
    return out


def diff_ci(a: np.ndarray, b: np.ndarray, n: int = 2000) -> tuple[float, float]:
    """95% interval of mean(a - b) over the queries (paired bootstrap): how much of a recall
    difference between two k-means is the queries' sampling."""
    d = a - b
    means = d[np.random.default_rng(5).integers(0, len(d), (n, len(d)))].mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def objective(c: np.ndarray, x: np.ndarray) -> float:
    """Mean cosine of 50,000 sample points to their nearest centroid (exact): k-means' own score."""
    s = x[np.random.default_rng(3).choice(len(x), min(50_000, len(x)), replace=False)]
    return float(faiss.knn(s, c, 1, metric=faiss.METRIC_INNER_PRODUCT)[0].mean())


def time_only(x: np.ndarray, lists: int, seed: int, refine: int, rounds: int = 2) -> list[str]:
    """Seconds alone, alternating: one exact iteration (faiss.Kmeans, niter=1; ten cost ten
    times that, both linear in the points) and the approximate k-means stage by stage."""
    rows = []
    for r in range(rounds):
        t0 = time.perf_counter()
        faiss.Kmeans(x.shape[1], lists, niter=1, seed=seed, spherical=True).train(x)
        one = time.perf_counter() - t0
        marks = [time.perf_counter()]
        fx.kmeans_approx(x, lists, seed=seed, refine=refine,
                         on_iteration=lambda i, c: marks.append(time.perf_counter()))
        steps = np.diff(marks)
        rows.append(f"| {r} | {one:.1f} | {10 * one:.0f} | {steps[0]:.1f} | "
                    f"{', '.join(f'{v:.1f}' for v in steps[1:])} | {marks[-1] - marks[0]:.0f} | "
                    f"{10 * one / (marks[-1] - marks[0]):.1f}x | {os.getloadavg()[0]:.1f} |")
        print(rows[-1], flush=True)
    return ["| round | exact: 1 iteration s | exact: 10 iterations s (10x) | approx: two-level start s "
            "| approx: each refinement s | approx total s | exact / approx | load |",
            "|---:|---:|---:|---:|---|---:|---:|---:|", *rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", type=int, default=1_048_576, help="k-means sample size")
    ap.add_argument("--lists", type=int, default=16_384, help="nlist (k)")
    ap.add_argument("--gallery", type=int, default=0, help="gallery size (default: --points)")
    ap.add_argument("--methods", default="exact,approx", help=f"comma-separated, of {fx.KMEANS_METHODS}")
    ap.add_argument("--nprobe", default="8,16,32,64")
    ap.add_argument("--queries", type=int, default=1000, help="recall queries (default 1,000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--refine", type=int, default=fx.KMEANS_REFINE,
                    help="approx: refinement iterations (each one a row: approx-r0 ... approx-rN)")
    ap.add_argument("--time-only", action="store_true",
                    help="no recall: alternate one exact iteration (x10) and the approximate k-means")
    ap.add_argument("--only", default="", help="rows to evaluate (e.g. exact,approx-r4; default: all)")
    ap.add_argument("--features", type=Path, default=None, help="real embeddings (.npy, n x d) instead")
    ap.add_argument("--work", type=Path, default=Path("/tmp/kmeans-bench"), help="centroid cache")
    a = ap.parse_args()
    faiss.omp_set_num_threads(2)
    a.work.mkdir(parents=True, exist_ok=True)
    tag = a.features.stem if a.features else "lowrank"
    if a.time_only:
        x = data(a.points, 1000, a.features)[0]
        print(f"\nk-means of {len(x):,} x {x.shape[1]} into {a.lists:,} lists, seconds. Command: "
              f"`python -m benchmarks.scaling.kmeans_bench {shlex.join(sys.argv[1:])}`.\n")
        print("\n".join(time_only(x, a.lists, a.seed, a.refine)))
        return
    x, gallery, q = data(a.points, a.gallery, a.features, queries=a.queries)
    truth = faiss.knn(q, gallery, 10, metric=faiss.METRIC_INNER_PRODUCT)[1]
    nprobes = [int(v) for v in a.nprobe.split(",")]
    rows = []
    for method in a.methods.split(","):
        for m, (c, sec) in centroids(method, x, a.lists, a.seed, a.work, tag, a.refine).items():
            if a.only and m not in a.only.split(","):
                continue
            r = {"method": m, "seconds": sec, "objective": objective(c, x), **recall(c, gallery, q, truth, nprobes)}
            print(json.dumps(public(r)), flush=True)
            rows.append(r)
    base = rows[0]
    print(f"\nk-means of {len(x):,} x {x.shape[1]} ({tag}) into {a.lists:,} lists, IVF-Flat over "
          f"{len(gallery):,}, {len(q):,} queries; load average {os.getloadavg()[0]:.1f}. Command: "
          f"`python -m benchmarks.scaling.kmeans_bench {shlex.join(sys.argv[1:])}`.\n")
    print("| k-means | seconds | vs " + base["method"] + " | mean cosine to centroid | list imbalance | "
          + " | ".join(f"recall@10 nprobe {p}" for p in nprobes) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(nprobes))

    def cell(r: dict, p: int) -> str:
        if r is base:
            return f"{r[p]:.4f}"
        lo, hi = diff_ci(r[f"per-query {p}"], base[f"per-query {p}"])
        return f"{r[p]:.4f} ({r[p] - base[p]:+.4f} [{lo:+.4f}, {hi:+.4f}])"
    for r in rows:
        print(f"| {r['method']} | {r['seconds']:.0f} | {base['seconds'] / r['seconds']:.1f}x faster | "
              f"{r['objective']:.4f} | {r['imbalance']:.2f} | " + " | ".join(cell(r, p) for p in nprobes) + " |")
    print(f"(in brackets: the difference to {base['method']} and its 95% interval over the queries, "
          "paired bootstrap)")
    print(json.dumps([public(r) for r in rows]))


def public(r: dict) -> dict:
    """A row without its per-query arrays (what is printed as JSON)."""
    return {k: v for k, v in r.items() if not str(k).startswith("per-query")}


if __name__ == "__main__":
    main()
