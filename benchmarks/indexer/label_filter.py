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
    ap.add_argument("--index", type=Path, required=True, help="a labelled index directory")
    ap.add_argument("--n", type=int, default=200, help="queries (default 200)")
    ap.add_argument("-k", "--k", type=int, default=10)
    ap.add_argument("--no-dba", action="store_true", help="search without DBA re-ranking (default: as built)")
    ap.add_argument("--widen", type=float, default=None,
                    help="indexer.ann.subset.WIDEN for the filtered search (default: the shipped one)")
    return run_main(PROG, ap, argv, handler=run)


def run(args: argparse.Namespace) -> int | None:
    from tqdm import tqdm

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
            _, ids, _ = idx.answer(q, args.k, exclude=[gid], labels=only, dba=dba)
            times[name].append(time.perf_counter() - t)
            if name in found:
                subset.EXACT_BYTES = 1 << 62
                _, want, _ = idx.answer(q, args.k, exclude=[gid], labels=only or labels, dba=dba)   # exact
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
