"""The streaming build's driver plan, alone, on a checkout of your choice: its peak RSS against N.

    python -m benchmarks.plan_memory --repo CHECKOUT --work DIR --nlist 256 --max-queries 100

``DIR`` holds shards made by ``scale_bench.py _child _gen DIR N 4 128`` (the low-rank
generator); the plan runs with the ``scale_bench.py`` of CHECKOUT, so that the code before a
change (e.g. ``git archive <commit> | tar -x -C /tmp/before``) and after it plan the very same
shards. ``--max-queries`` caps the held-out sets (``tuning.MAX_QUERIES``, 1,000 a set by
default) in both: their exact answers cost a pass over all N vectors per query batch, which
does not change what grows with N and took 15+ minutes a run on the loaded shared cores.
Prints the plan's JSON (seconds, peak RSS = ``ru_maxrss``, anon = sampled peak ``RssAnon``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", type=Path, required=True, help="the checkout whose indexer plans")
    ap.add_argument("--work", type=Path, required=True, help="folder of the generated shards")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--nlist", type=int, default=256)
    ap.add_argument("--max-queries", type=int, default=100)
    args = ap.parse_args()
    repo = args.repo.resolve()
    sys.path.insert(0, str(repo))
    spec = importlib.util.spec_from_file_location("scale_bench_of_repo", repo / "benchmarks" / "scale_bench.py")
    sb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sb)
    from indexer import stream, tuning

    tuning.MAX_QUERIES = args.max_queries
    if hasattr(stream, "MAX_QUERIES"):
        stream.MAX_QUERIES = args.max_queries
    out = sb._plan(str(args.work), str(args.shards), "auto", str(args.nlist))
    print(json.dumps({"repo": str(repo), **out}))


if __name__ == "__main__":
    main()
