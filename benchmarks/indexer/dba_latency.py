"""Search latency with and without DBA re-ranking (indexer.ann.neighbours), same process, same run.

    python -m benchmarks.indexer.dba_latency --index DIR [--queries FOLDER] [--n 100] [--rounds 4] [-k 10]

DIR must be built with ``indexer build --dba``. Two levels, each query timed alone (one request
at a time, as a user's search), the two settings alternating query by query so both see the
same load:
  * vector   Index.search_embeddings of one embedding (what DBA adds to: faiss search, plus
             the re-ranking of the top ``depth`` candidates);
  * request  Searcher.search of one image file (decode, embed, search, hits): what a user of
             the API or the UI waits for, less HTTP.
Queries: the images of --queries (a held-out folder), else images from the index's own store
passed as uploads. Prints p50/p99 per setting and the p50 ratio DBA/plain (the goal: <= 1.5).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from embedder.cli import run_main

PROG = "python -m benchmarks.indexer.dba_latency"

import numpy as np


def _pct(v: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(v) * 1e3, p))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", type=Path, required=True, help="an index directory built with --dba")
    ap.add_argument("--queries", type=Path, default=None, help="query images (default: the store's)")
    ap.add_argument("--n", type=int, default=100, help="queries per round (default 100)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("-k", "--k", type=int, default=10)
    return run_main(PROG, ap, argv, handler=run)


def run(args: argparse.Namespace) -> int | None:

    from benchmarks.embedder.pretrained_choice import EXTS
    from indexer import Index
    from serving import Searcher

    idx = Index.open(args.index, check_model=True)
    if not idx.has_dba:
        raise SystemExit(f"error: {args.index}: built without --dba; rebuild with `indexer build --dba`")
    searcher = Searcher({"i": idx})
    if args.queries:
        images = sorted(p for p in args.queries.rglob("*") if p.suffix.lower() in EXTS)[:args.n]
        data = [p.read_bytes() for p in images]
    else:
        ids, _ = idx.store.all_embeddings(idx.model_hash)
        data = [idx.image_bytes(int(i)) for i in ids[:: max(1, len(ids) // args.n)][:args.n]]
    embs = idx.embedder.embed(data)
    for v in embs[:5]:                                              # warm up both paths
        idx.search_embeddings(v, args.k, dba=False), idx.search_embeddings(v, args.k, dba=True)
    searcher.search(data[0], args.k, dba=True), searcher.search(data[0], args.k, dba=False)
    t: dict[tuple[str, bool], list[float]] = {(lvl, d): [] for lvl in ("vector", "request") for d in (False, True)}
    for r in range(args.rounds):
        for j, (v, b) in enumerate(zip(embs, data)):
            order = (False, True) if (r + j) % 2 == 0 else (True, False)    # alternate who goes first
            for d in order:
                t0 = time.perf_counter()
                idx.search_embeddings(v, args.k, dba=d)
                t[("vector", d)].append(time.perf_counter() - t0)
            for d in order:
                t0 = time.perf_counter()
                searcher.search(b, args.k, dba=d)
                t[("request", d)].append(time.perf_counter() - t0)
    nb = idx.neighbours.params
    print(f"index {args.index}: {len(idx)} x {idx.dim}, {idx.manifest.get('index_type')}, DBA k={nb.k} "
          f"alpha={nb.alpha:g} depth={nb.depth}; {len(data)} queries x {args.rounds} rounds, k={args.k}; "
          f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("| level | plain p50 ms | plain p99 ms | DBA p50 ms | DBA p99 ms | p50 DBA / plain |")
    print("| --- | --- | --- | --- | --- | --- |")
    for lvl in ("vector", "request"):
        p, d = t[(lvl, False)], t[(lvl, True)]
        print(f"| {lvl} | {_pct(p, 50):.3f} | {_pct(p, 99):.3f} | {_pct(d, 50):.3f} | {_pct(d, 99):.3f} | "
              f"{_pct(d, 50) / _pct(p, 50):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
