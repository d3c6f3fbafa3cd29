"""The streaming build's driver plan, alone, on a checkout of your choice: its memory against N.

    python -m benchmarks.scaling.plan_memory --repo CHECKOUT --work DIR --nlist 256 --max-queries 100
    python -m benchmarks.scaling.plan_memory --repo . --work DIR --stages [--trim]

``DIR`` holds shards made by ``scale_bench.py _child _gen DIR N 4 128`` (the low-rank
generator); the plan runs with the ``stream_stages._plan`` of CHECKOUT (``scale_bench._plan`` in
checkouts before the split), so that the code before a
change (e.g. ``git archive <commit> | tar -x -C /tmp/before``) and after it plan the very same
shards. ``--max-queries`` caps the held-out sets (``tuning.MAX_QUERIES``, 1,000 a set by
default) in both: their exact answers cost a pass over all N vectors per query batch, which
does not change what grows with N and took 15+ minutes a run on the loaded shared cores.
Prints the plan's JSON (seconds, peak RSS = ``ru_maxrss``, anon = sampled peak ``RssAnon``).

``--stages`` also reports, for each step of ``stream.plan`` (census, samples, exact answers,
selection, training), the process's own memory (``RssAnon``) on entry, at its peak during the
step (sampled every 20 ms) and on exit; ``--trim`` returns freed heap to the system after each
step (glibc ``malloc_trim``), which tells memory the plan still holds from memory the allocator
kept after it was freed. The steps are wrapped where ``stream.plan`` looks them up (its module
namespace): a measurement, not a change to the plan.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

from embedder.cli import run_main

PROG = "python -m benchmarks.scaling.plan_memory"

STEPS = ("census", "draw", "Sample", "exact_truth", "select")


def rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


class StepMemory:
    """Wraps named callables of a module: per call, (name, entry, peak, exit[, after trim], s)."""

    def __init__(self, trim: bool) -> None:
        self.rows: list[dict] = []
        self.peak = 0.0
        self.trim = ctypes.CDLL("libc.so.6").malloc_trim if trim else None
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, rss_anon_mib())
            time.sleep(0.02)

    def wrap(self, module, name: str) -> None:
        f = getattr(module, name)

        @functools.wraps(f)
        def step(*a, **k):
            entry = self.peak = rss_anon_mib()
            t0 = time.perf_counter()
            out = f(*a, **k)
            row = {"step": name, "entry": round(entry), "peak": round(max(self.peak, rss_anon_mib())),
                   "exit": round(rss_anon_mib()), "seconds": round(time.perf_counter() - t0, 1)}
            if self.trim is not None:
                self.trim(0)
                row["exit_trimmed"] = round(rss_anon_mib())
            self.rows.append(row)
            return out

        setattr(module, name, step)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--repo", type=Path, required=True, help="the checkout whose indexer plans")
    ap.add_argument("--work", type=Path, required=True, help="folder of the generated shards")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--nlist", type=int, default=0, help="IVF-Flat with this many lists (0: the measured choice)")
    ap.add_argument("--max-queries", type=int, default=0, help="cap the held-out sets (0: as built)")
    ap.add_argument("--stages", action="store_true", help="memory on entry / peak / exit of each step")
    ap.add_argument("--trim", action="store_true", help="with --stages: malloc_trim after each step")
    return run_main(PROG, ap, argv, handler=run)


def run(args: argparse.Namespace) -> int | None:
    repo = args.repo.resolve()
    sys.path.insert(0, str(repo))
    # today's layout, then the flat benchmarks/ of older checkouts, then the oldest (all in scale_bench.py)
    bench = repo / "benchmarks"
    stages = next(p for p in (bench / "scaling" / "stream_stages.py", bench / "stream_stages.py",
                              bench / "scale_bench.py") if p.exists())
    spec = importlib.util.spec_from_file_location("stream_stages_of_repo", stages)
    sb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sb)
    from indexer.ann import faiss_index, stream, tuning

    if args.max_queries:
        tuning.MAX_QUERIES = args.max_queries
        if hasattr(stream, "MAX_QUERIES"):
            stream.MAX_QUERIES = args.max_queries
    steps = None
    if args.stages:
        steps = StepMemory(args.trim)
        for name in STEPS:
            if hasattr(stream, name):
                steps.wrap(stream, name)
        steps.wrap(faiss_index, "train")
    out = sb._plan(str(args.work), str(args.shards), "auto", str(args.nlist))
    if steps is not None:
        out["steps"] = [r for r in steps.rows if r["seconds"] >= 0.05 or r["peak"] - r["entry"] > 8]
    print(json.dumps({"repo": str(repo), **out}))


if __name__ == "__main__":
    sys.exit(main())
