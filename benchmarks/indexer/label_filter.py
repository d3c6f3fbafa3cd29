"""A search within labels (``Index.answer(labels=...)``, indexer.ann.subset) against the plain
search of the same index, same process, the settings alternating query by query.

    python -m benchmarks.indexer.label_filter --index DIR [--n 200] [-k 10]

Queries: stored vectors of the index's own images (each left out of its own row). Settings:
  * plain      the whole gallery (the baseline of every ratio);
  * one label  the query's own label and its neighbour in label order: the exact pass over the
               two classes' stored vectors (LMDB reads + one matrix product);
  * half       every other label, the exact budget set just below their vectors (as a larger
               gallery would be): the index's own search fetched deeper and filtered (rows its
               IVF lists leave short answered exactly, in blocks of that budget), then exact
               (what the default budget does for them);
and the recall@k of the plain and the filtered half against exact answers (over the whole gallery,
within the same labels: the exact pass with an unbounded budget).
Prints p50 / p99 latency (ms) per setting and the p50 ratios to plain.

    python -m benchmarks.indexer.label_filter --synthetic 300000 [--dim 128]

At scale, no store: low-rank vectors (benchmarks.inputs.low_rank) labelled by groups of 10 of
their 1,000 clusters (100 labels that occupy regions, as classes do), IVF1024,Flat at nprobe 16,
500 fresh queries; 1, 10 and 50 labels, each filtered at widen 1, 2, 4 and exact (recall@10
against the exact answer within the labels, ms a query in batches of 500).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from embedder.cli import run_main

PROG = "python -m benchmarks.indexer.label_filter"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--index", type=Path, help="a labelled index directory")
    src.add_argument("--synthetic", type=int, metavar="N", help="N synthetic labelled vectors instead")
    ap.add_argument("--dim", type=int, default=128, help="with --synthetic: their dimension (default 128)")
    ap.add_argument("--n", type=int, default=200, help="queries (default 200)")
    ap.add_argument("-k", "--k", type=int, default=10)
    ap.add_argument("--no-dba", action="store_true", help="search without DBA re-ranking (default: as built)")
    ap.add_argument("--widen", type=float, default=None,
                    help="indexer.ann.subset.WIDEN for the filtered search (default: the shipped one)")
    return run_main(PROG, ap, argv, handler=run)


def synthetic(n: int, dim: int) -> None:
    import faiss

    from benchmarks.inputs.low_rank import low_rank_labelled, low_rank_law
    from indexer.ann import subset
    from indexer.ann.faiss_index import search_wider
    from indexer.searchable import Answer

    law = low_rank_law(dim)
    x, cluster = low_rank_labelled(n, law, 1)
    q = low_rank_labelled(500, law, 2)[0]
    label = cluster // 10
    index = faiss.index_factory(dim, "IVF1024,Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(x[:100_000])
    index.add(x)
    index.nprobe = 16

    def search(qq: np.ndarray, k: int, widen: float = 1.0) -> Answer:
        return Answer(*search_wider(index, qq, k, widen))

    def recall(got: np.ndarray, want: np.ndarray) -> float:
        return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(got.tolist(), want.tolist())]))

    def timed(fn) -> tuple[float, np.ndarray]:
        t = time.perf_counter()
        ids = fn()
        return (time.perf_counter() - t) / len(q) * 1e3, ids

    ms, got = timed(lambda: index.search(q, 10)[1])
    print(f"synthetic {n} x {dim}, IVF1024,Flat nprobe 16; plain: recall@10 "
          f"{recall(got, np.argsort(-(q @ x.T), axis=1)[:, :10]):.4f}, {ms:.2f} ms a query")
    rng = np.random.default_rng(0)
    budget, widen = subset.EXACT_BYTES, subset.WIDEN
    for m in (1, 10, 50):
        allowed = np.nonzero(np.isin(label, rng.choice(100, m, replace=False)))[0]
        want = allowed[np.argsort(-(q @ x[allowed].T), axis=1)[:, :10]]
        for w in (1.0, 2.0, 4.0, None):
            subset.EXACT_BYTES, subset.WIDEN = (0, w) if w else (1 << 62, widen)
            ms, got = timed(lambda: subset.subset_search(search, lambda ids: x[ids], allowed, q, 10, n).ids)
            print(f"  {m:3d} labels ({len(allowed) / n:.3f} of the gallery), "
                  f"{f'widen {w:g}' if w else 'exact':8s}: recall@10 {recall(got, want):.4f}, {ms:.2f} ms a query")
    subset.EXACT_BYTES, subset.WIDEN = budget, widen


def run(args: argparse.Namespace) -> int | None:
    from tqdm import tqdm

    if args.synthetic:
        return synthetic(args.synthetic, args.dim)

    from indexer import Index
    from indexer.ann import subset

    idx = Index.open(args.index)
    labels = idx.labels()
    if len(labels) < 4:
        raise SystemExit(f"error: {args.index}: {len(labels)} labels; this needs at least 4")
    rng = np.random.default_rng(0)
    pairs = [(lab, int(i)) for lab in labels for i in idx.ids_for_label(lab)]
    pick = rng.choice(len(pairs), size=min(args.n, len(pairs)), replace=False)
    half = labels[::2]
    below = 4 * idx.dim * (len(idx.label_ids(half)) - 1)      # the half's vectors just miss the budget
    times: dict[str, list[float]] = {"plain": [], "one label": [], "half (filtered)": [], "half (exact)": []}
    found = {"plain": [0, 0], "half (filtered)": [0, 0]}
    budget, dba = subset.EXACT_BYTES, False if args.no_dba else None
    subset.WIDEN = subset.WIDEN if args.widen is None else args.widen
    for j in tqdm(pick, desc="queries", unit="q"):
        lab, gid = pairs[j]
        q = idx.embeddings([gid])
        two = [lab, labels[(labels.index(lab) + 1) % len(labels)]]
        for name, only, exact_bytes in (("plain", None, budget), ("one label", two, budget),
                                        ("half (filtered)", half, below), ("half (exact)", half, 1 << 62)):
            subset.EXACT_BYTES = exact_bytes
            t = time.perf_counter()
            ids = idx.answer(q, args.k, exclude=[gid], labels=only, dba=dba).ids
            times[name].append(time.perf_counter() - t)
            if name in found:
                subset.EXACT_BYTES = 1 << 62
                want = idx.answer(q, args.k, exclude=[gid], labels=only or labels, dba=dba).ids   # exact
                w = set(want[0][want[0] >= 0].tolist())
                found[name][0] += len(w & set(ids[0].tolist()))
                found[name][1] += len(w)
    subset.EXACT_BYTES = budget
    base = float(np.median(times["plain"]))
    print(f"{args.index}: {len(idx)} images, {len(labels)} labels, dim {idx.dim}, "
          f"{idx.manifest.index_type}, DBA {'on' if idx.has_dba and dba is None else 'off'}; "
          f"{len(pick)} queries, k={args.k}, widen {subset.WIDEN:g}")
    for name, ts in times.items():
        p50, p99 = np.median(ts) * 1e3, np.percentile(ts, 99) * 1e3
        print(f"  {name:16s} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  p50 / plain {np.median(ts) / base:5.2f}x")
    for name, (hit, total) in found.items():
        print(f"  {name} recall@{args.k} vs exact: {hit / max(total, 1):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
