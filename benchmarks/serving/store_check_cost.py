"""What the per-read store check (indexer.store.lmdb_env: fstat/stat before each LMDB read, so a
data.mdb truncated under a running server is refused instead of killing it with SIGBUS) costs
on search latency, against the same searches with the check switched off in the same process.

    python -m benchmarks.serving.store_check_cost [--index DIR] [--rounds 6] [--seconds 4] [-k 10]
                                          [--http-baseline CHECKOUT]

Two query kinds: a gallery id (no embedding: store reads and faiss only, where the check weighs
most) and an uploaded image (decode + embed + search: what /api/search does). Rounds alternate
check on / off so both see the same background load; reports p50/p99 per kind and the p50 ratio
on/off (goal: <= 1.2), and the check's own cost per call. Prints a markdown table.

``--http-baseline CHECKOUT`` adds the whole request path: POST /api/search (1 client, uploads)
against `app.py` of this checkout and of another one (say a `git worktree` of the previous
main), both serving the index at once, rounds alternating.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from embedder.cli import UsageError, run_main

from benchmarks.serving.serve_load import run_load, start_app, stop_app, wait_healthy

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.serving.store_check_cost"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", type=Path, default=None,
                    help="index directory (default: the demo index, built once under indexes/demo)")
    ap.add_argument("--rounds", type=int, default=6, help="on/off alternations (default 6)")
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds per kind, round and setting (default 4)")
    ap.add_argument("-k", "--k", type=int, default=10, help="results per query (default 10)")
    ap.add_argument("--http-baseline", type=Path, default=None, metavar="CHECKOUT",
                    help="also time POST /api/search against app.py of this other checkout (same run)")
    return run_main(PROG, ap, argv, handler=run)


def run(args: argparse.Namespace) -> int | None:
    if args.http_baseline is not None and not (args.http_baseline / "app.py").is_file():
        raise UsageError(f"--http-baseline {args.http_baseline}: no app.py there")
    if args.rounds < 1 or args.seconds <= 0 or not 1 <= args.k <= 1000:
        raise UsageError("--rounds >= 1, --seconds > 0, 1 <= -k <= 1000 expected")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from serving import Searcher, ensure_demo_index

    index_dir = args.index or ensure_demo_index(REPO / "indexes" / "demo")
    searcher = Searcher.open([index_dir])
    store = searcher.index().store
    ids = [int(i) for i in store.ids()[:32]]
    images = [store.get_bytes(i) for i in ids]

    def set_check(on: bool) -> None:
        store.check_reads = on          # the per-read file check (indexer/store/lmdb_env.py) on or off

    def search(q) -> bool:
        searcher.search(q, args.k)
        return True

    kinds = {"gallery id": ids, "uploaded image": images}
    for queries in kinds.values():
        for q in queries[:4]:
            search(q)                                       # warm-up
    lat: dict[tuple[str, bool], list[float]] = {(k, on): [] for k in kinds for on in (True, False)}
    for r in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            set_check(on)
            for kind, queries in kinds.items():
                lat[(kind, on)] += run_load(search, queries, 1, args.seconds)["lat_ms"]
    set_check(True)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        store.check_file()
    per_call_us = 1e6 * (time.perf_counter() - t0) / n
    rows = []
    for kind in kinds:
        on, off = np.array(lat[(kind, True)]), np.array(lat[(kind, False)])
        rows.append(f"| {kind} | {len(off)} / {len(on)} | {np.percentile(off, 50):.2f} | {np.percentile(on, 50):.2f} | "
                    f"{np.percentile(off, 99):.2f} | {np.percentile(on, 99):.2f} | "
                    f"**{np.percentile(on, 50) / np.percentile(off, 50):.3f}** |")
    if args.http_baseline is not None:
        rows += http_rows(index_dir, args.http_baseline, images, args)
    print(f"Command: `python -m benchmarks.serving.store_check_cost{' --index ' + str(args.index) if args.index else ''} "
          f"--rounds {args.rounds} --seconds {args.seconds} -k {args.k}"
          f"{' --http-baseline ' + str(args.http_baseline) if args.http_baseline else ''}`  \n"
          f"Index: {len(searcher.index())} images; bare `Searcher.search` in one process, check on/off "
          f"alternating; the check alone: {per_call_us:.1f} us per call; load average "
          f"{os.getloadavg()[0]:.1f} at the end (2 shared cores).\n\n"
          "| query | searches off / on | p50 off ms | p50 on ms | p99 off ms | p99 on ms | p50 on/off |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n" + "\n".join(rows))
    return 0


def http_rows(index_dir: Path, baseline: Path, images: list[bytes], args: argparse.Namespace) -> list[str]:
    """p50 of POST /api/search (1 client) on this checkout's app.py vs the baseline checkout's."""
    import httpx

    started = {name: start_app(index_dir, root) for name, root in (("this checkout", REPO),
                                                                     ("baseline", baseline.resolve()))}
    try:
        for proc, url in started.values():
            if (why := wait_healthy(proc, url)) is not None:
                raise RuntimeError(f"store_check_cost: {why} ({url})")
        lat: dict[str, list[float]] = {n: [] for n in started}
        with httpx.Client(timeout=60) as c:
            for r in tqdm(range(args.rounds), desc="http rounds", file=sys.stderr):
                for name in (list(started) if r % 2 == 0 else list(started)[::-1]):
                    url = started[name][1]
                    lat[name] += run_load(lambda im: c.post(f"{url}/api/search", files={"image": ("q.jpg", im)},
                                                            data={"k": str(args.k)}).status_code == 200,
                                          images, 1, args.seconds)["lat_ms"]
    finally:
        for proc, _ in started.values():
            stop_app(proc)
    new, old = np.array(lat["this checkout"]), np.array(lat["baseline"])
    return [f"| POST /api/search, upload (HTTP; off = baseline checkout) | {len(old)} / {len(new)} | "
            f"{np.percentile(old, 50):.2f} | {np.percentile(new, 50):.2f} | {np.percentile(old, 99):.2f} | "
            f"{np.percentile(new, 99):.2f} | **{np.percentile(new, 50) / np.percentile(old, 50):.3f}** |"]


if __name__ == "__main__":
    sys.exit(main())
