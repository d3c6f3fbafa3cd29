"""Two checkouts of the project, same gallery, alternating: `indexer build` images/s and in-process
search p50, as new/old ratios per round (a refactor's "no slower" check, e.g. issue 31).

    git archive BASE | tar -x -C /tmp/old
    python -m benchmarks.indexer.tree_speed --old /tmp/old --new . --gallery GALLERY --rounds 3

Each tree runs in its own processes (PYTHONPATH = the tree), so one import cache never serves both.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from embedder.cli import run_main

# Run inside the tree being measured: open the index, search 60 gallery photos (5 warm-up), p50 ms.
_SEARCH = """
import sys, time, statistics, pathlib
from serving import Searcher
s = Searcher.open([sys.argv[1]])
data = [f.read_bytes() for f in sorted(pathlib.Path(sys.argv[2]).rglob("*.jpg"))[:60]]
for d in data[:5]:
    s.search(d, k=10)
ts = []
for d in data:
    t0 = time.perf_counter(); s.search(d, k=10); ts.append(time.perf_counter() - t0)
print(statistics.median(ts) * 1e3)
"""


def one_round(tree: Path, gallery: Path, out: Path) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "indexer", "build", str(gallery), "--out", str(out), "--quiet"],
                   cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    m = json.loads((out / "manifest.json").read_text())
    p50 = subprocess.run([sys.executable, "-c", _SEARCH, str(out), str(gallery)], cwd=tree, env=env,
                         check=True, capture_output=True, text=True, timeout=3600).stdout.split()[-1]
    return {"images/s": m["count"] / m["build_seconds"], "search p50 ms": float(p50),
            "build CPU s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.indexer.tree_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, required=True, help="the baseline checkout")
    p.add_argument("--new", type=Path, default=Path("."), help="the checkout measured (default .)")
    p.add_argument("--gallery", type=Path, required=True, help="a labelled image folder (e.g. 400 photos)")
    p.add_argument("--rounds", type=int, default=3)

    def run(a: argparse.Namespace) -> None:
        trees = {"old": a.old.resolve(), "new": a.new.resolve()}
        got: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(a.rounds):
                for name in (("old", "new") if r % 2 == 0 else ("new", "old")):   # alternate who goes first
                    got[name].append(one_round(trees[name], a.gallery.resolve(), Path(tmp) / name))
                    print(f"round {r} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in got[name][-1].items())
                          + f" (load {os.getloadavg()[0]:.1f})", flush=True)
        for key in got["old"][0]:
            ratios = [n[key] / o[key] for n, o in zip(got["new"], got["old"])]
            print(f"{key}: new/old {', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}")

    return run_main("python -m benchmarks.indexer.tree_speed", p, argv, handler=run)


if __name__ == "__main__":
    sys.exit(main())
