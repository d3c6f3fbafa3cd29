"""A rebuild that changed nothing: the index kept (indexer.build.single.kept_index) against the
index type chosen again by measurement, on the same gallery, alternating.

    python -m benchmarks.indexer.rebuild_kept --gallery DIR --index DIR [--rounds 2]

Works on a copy of --index (its store: nothing is embedded). Each round runs `python -m indexer
build GALLERY --out COPY --quiet` with a --seed the copy was not chosen for (it measures every
candidate again: the baseline), then the same build again (kept); the rounds alternate seeds 0
and 1. Prints wall seconds and peak RSS of each build (/usr/bin/time's) and the ratio, per round.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from embedder.cli import run_main

PROG = "python -m benchmarks.indexer.rebuild_kept"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--gallery", type=Path, required=True, help="the gallery the index was built from")
    ap.add_argument("--index", type=Path, required=True, help="an index of that gallery (copied, not changed)")
    ap.add_argument("--rounds", type=int, default=2)
    return run_main(PROG, ap, argv, handler=_run)


def _build(gallery: Path, out: Path, seed: int) -> tuple[float, float, bool]:
    """(wall seconds, peak RSS MiB, whether the index was kept) of one `indexer build`."""
    cmd = ["/usr/bin/time", "-f", "RSS %M", sys.executable, "-m", "indexer", "build", str(gallery),
           "--out", str(out), "--quiet", "--seed", str(seed)]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t
    rss = float(re.findall(r"RSS (\d+)", p.stderr)[-1]) / 1024
    return wall, rss, "kept: chosen" in p.stdout


def _run(a: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="rebuild-kept-") as tmp:
        out = Path(tmp) / "index"
        shutil.copytree(a.index, out)
        seed = 1
        _build(a.gallery, out, seed)                 # chosen for seed 1: the rounds start from there
        for r in range(a.rounds):
            seed = 1 - seed                          # not what the copy was chosen for: measured again
            again = _build(a.gallery, out, seed)
            kept = _build(a.gallery, out, seed)
            assert kept[2] and not again[2], (again, kept)
            print(f"round {r + 1}: chosen again {again[0]:.1f} s ({again[1]:.0f} MiB), kept {kept[0]:.1f} s "
                  f"({kept[1]:.0f} MiB): {again[0] / kept[0]:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
