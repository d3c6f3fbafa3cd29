"""The cost of DBA's neighbour pass at build time (indexer.ann.neighbours.build), by part.

    python -m benchmarks.indexer.dba_build --index DIR [--sizes 12000 25000] [--repeats 2]

On the first N stored vectors of an index (id order), same process, the parts alternating:
  * lists     the exact k-NN of the gallery against itself (faiss.knn over blocks): O(n^2 d)
  * augment   the augmented vectors from the lists, in blocks of rows (what the build runs)
  * gather    the same vectors from one (n, k - 1, d) gather of the whole gallery (the build's way
              until 2026-11-30): the baseline, to the digit the same vectors
Prints seconds (best of --repeats) and the peak of numpy allocations (tracemalloc) per part.
"""
from __future__ import annotations

import argparse
import time
import tracemalloc
from pathlib import Path

import numpy as np

from embedder.cli import run_main

PROG = "python -m benchmarks.indexer.dba_build"
QUERY_BLOCK = 4096          # gallery rows searched at a time, as the build does


def _timed(fn, repeats: int) -> tuple[float, float, object]:
    """(best seconds, peak MiB of traced allocations, the result of the last call)."""
    best, peak, out = float("inf"), 0.0, None
    for _ in range(repeats):
        tracemalloc.start()
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
        peak = max(peak, tracemalloc.get_traced_memory()[1] / 2 ** 20)
        tracemalloc.stop()
    return best, peak, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", type=Path, required=True, help="an index directory (its stored vectors)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[12_000, 25_000], help="gallery sizes")
    ap.add_argument("--repeats", type=int, default=1, help="calls of each part (best kept; 1: cold memory, as a build)")
    return run_main(PROG, ap, argv, handler=run)


def run(args: argparse.Namespace) -> int:
    from indexer import GalleryStore, IndexDir
    from indexer.ann import neighbours as nbm

    d = IndexDir(args.index)
    with GalleryStore(d.store_dir) as s:
        all_ids, all_x = s.all_embeddings(d.read_manifest().model_hash)
    p = nbm.DbaParams()
    print(f"{len(all_ids)} stored vectors, {all_x.shape[1]}-d; k={p.k}, alpha={p.alpha}")
    for n in args.sizes:
        order = np.argsort(all_ids[:n], kind="stable")       # the build's order: ids ascending
        ids, x = all_ids[:n][order], np.ascontiguousarray(all_x[:n][order], dtype=np.float32)
        n = len(ids)

        def lists() -> tuple[np.ndarray, np.ndarray]:
            nbr, sims = np.full((n, p.k), -1, np.int64), np.zeros((n, p.k), np.float32)
            for i in range(0, n, QUERY_BLOCK):
                nbr[i:i + QUERY_BLOCK], sims[i:i + QUERY_BLOCK] = nbm.neighbour_lists(
                    ids[i:i + QUERY_BLOCK], x[i:i + QUERY_BLOCK], ids, x, p.k)
            return nbr, sims

        t_l, m_l, (nbr, sims) = _timed(lists, args.repeats)

        def gather() -> np.ndarray:
            use, s = nbr[:, :p.k - 1], sims[:, :p.k - 1].copy()
            s[use < 0] = 0.0
            return nbm.augment(x, x[np.searchsorted(ids, np.maximum(use, 0)).clip(0, n - 1)], s, p.alpha)

        t_g, m_g, old = _timed(gather, args.repeats)
        t_a, m_a, new = _timed(lambda: nbm.augment_rows(ids, x, nbr, sims, np.arange(n), p.k, p.alpha),
                               args.repeats)
        print(f"n={n:,}: lists {t_l:.1f} s ({m_l:.0f} MiB); augment {t_a:.2f} s ({m_a:.0f} MiB); "
              f"gather {t_g:.2f} s ({m_g:.0f} MiB); build {t_l + t_a:.1f} s vs {t_l + t_g:.1f} s "
              f"({(t_l + t_g) / (t_l + t_a):.2f}x); same vectors: {np.array_equal(old.astype(nbm.AUG_DTYPE), new)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
