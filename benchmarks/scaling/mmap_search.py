"""Single-query search on a memory-mapped IVF index: faiss's on-disk lists' prefetch threads on
(faiss's default) and off (``indexer.ann.faiss_index.no_prefetch``), beside the same index in RAM.

    python -m benchmarks.scaling.mmap_search                       # 100k x 128, IVF256,Flat, nprobe 16

Why: ``IO_FLAG_MMAP`` (codes-only serving, ``--max-memory``; sharded parts; ``merge_ondisk``'s
index) gives ``OnDiskInvertedLists``, which start ``prefetch_nthread`` threads on every
``search``. One thread per search (as a serving thread), alternating rounds, same answers asserted.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

from embedder.cli import run_main
from indexer.ann.faiss_index import no_prefetch

PROG = "python -m benchmarks.scaling.mmap_search"


def _ms(index: faiss.Index, q: np.ndarray, k: int) -> float:
    index.search(q[:1], k)
    t = time.perf_counter()
    for i in range(len(q)):
        index.search(q[i:i + 1], k)
    return (time.perf_counter() - t) / len(q) * 1000


def run(args: argparse.Namespace) -> None:
    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.n, args.dim)).astype("float32")
    faiss.normalize_L2(x)
    q = x[: args.queries] + 0.01
    index = faiss.index_factory(args.dim, f"IVF{args.nlist},Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(x[: min(args.n, 64 * args.nlist)])
    index.add(x)
    index.nprobe = args.nprobe
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "ivf.faiss")
        faiss.write_index(index, path)
        sides = {"in RAM": index, "mmap, prefetch on (faiss default)": faiss.read_index(path, faiss.IO_FLAG_MMAP),
                 "mmap, prefetch off (no_prefetch)": no_prefetch(faiss.read_index(path, faiss.IO_FLAG_MMAP))}
        for ix in sides.values():
            ix.nprobe = args.nprobe
        want = index.search(q, 10)[1]
        for name, ix in sides.items():
            assert np.array_equal(ix.search(q, 10)[1], want), name
        times: dict[str, list[float]] = {n: [] for n in sides}
        for _ in range(args.rounds):
            for name, ix in sides.items():
                times[name].append(_ms(ix, q, 10))
    base = float(np.median(times["in RAM"]))
    print(f"{args.n:,} x {args.dim}, IVF{args.nlist},Flat, nprobe {args.nprobe}, k 10, one thread, "
          f"{args.queries} single queries x {args.rounds} rounds (median); same answers asserted")
    print("| side | ms per query | vs in RAM |\n| --- | ---: | ---: |")
    for name, ts in times.items():
        m = float(np.median(ts))
        print(f"| {name} | {m:.3f} | {m / base:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--nlist", type=int, default=256)
    ap.add_argument("--nprobe", type=int, default=16)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    return run_main(PROG, ap, argv, handler=run)


if __name__ == "__main__":
    raise SystemExit(main())
