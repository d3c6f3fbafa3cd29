"""`indexer build --ray --sharded` on a small Omniglot gallery: what the plan's shard readers send
the driver per stage, and the build's wall time against another checkout's, in the same session.

    unshare -n sh -c 'ip link set lo up && python -m benchmarks.scaling.ray_plan_reads \\
        --before /tmp/before --chars 60 --shards 4 --repeats 2'

``--before``: a checkout of the code before the change (``git archive <commit> | tar -x -C
/tmp/before``); its CLI and this checkout's run alternately (``python -m indexer build GALLERY
--model M --out OUT --ray local --shards S --sharded --quiet --flat-threshold 100``, a fresh OUT
each time), so both see the same load. Then one more build here, in this process, returns the
bytes each stage's reads sent the driver (``m["ray"]["plan_bytes"]``). Ray listens beyond
loopback: run it in a private network namespace (``unshare -n``), as the Ray tests do.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from embedder.cli import run_main

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.scaling.ray_plan_reads"


def small_model(out: Path, images: list[Path]) -> Path:
    """The tests' embedder: small_cnn, untrained, seeded, 64-d (the build's cost is Ray's)."""
    import torch

    from embedder import Embedder, EmbedderConfig, export_onnx

    torch.manual_seed(0)
    model = Embedder(EmbedderConfig(backbone="small_cnn", dim=64)).eval()
    return export_onnx(model, out, source_hash="untrained-small-cnn-seed0", parity_images=images[:8])


def copy_gallery(omniglot: Path, dst: Path, chars: int) -> list[Path]:
    base = omniglot / "images_background"
    if not base.is_dir():
        sys.exit(f"{base}: not found (expected the Omniglot images_background folder)")
    got = []
    for c in [c for a in sorted(base.iterdir()) for c in sorted(a.iterdir())][:chars]:
        d = dst / c.parent.name / c.name
        d.mkdir(parents=True, exist_ok=True)
        for f in sorted(c.glob("*.png"))[:20]:
            shutil.copy2(f, d / f.name)
            got.append(d / f.name)
    return got


def timed_cli(checkout: Path, gallery: Path, model: Path, out: Path, shards: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "indexer", "build", str(gallery), "--model", str(model), "--out",
           str(out), "--ray", "local", "--shards", str(shards), "--sharded", "--quiet",
           "--flat-threshold", "100", "--no-int8"]     # --model builds of >= 256 images: int8 since 2026-11-30
    for _ in range(3):      # Ray gives its raylet 30 s to start: on loaded cores it may not
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
        if "timed out during startup" not in p.stderr:
            break
        print(f"{checkout}: Ray did not start in time; trying that build again", file=sys.stderr)
    if p.returncode:
        sys.exit(f"{checkout}: {' '.join(cmd[1:])} exited {p.returncode}: {p.stderr.strip()[-500:]}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, help="a checkout of the code before the change (timed against this one)")
    ap.add_argument("--omniglot", type=Path, default=REPO.parent / "shared" / "data" / "omniglot")
    ap.add_argument("--chars", type=int, default=60, help="Omniglot characters (20 images each)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="timed builds per checkout (alternating)")
    return run_main(PROG, ap, argv, handler=run)


def run(args: argparse.Namespace) -> int | None:
    from indexer.build.ray_build import build_with_ray
    from indexer.ray.cluster import only_loopback

    if not only_loopback():
        sys.exit("Ray listens beyond loopback: run this in a private network namespace (unshare -n)")
    from tqdm.auto import tqdm

    with tempfile.TemporaryDirectory(prefix="ray-plan-reads-") as tmp:
        work = Path(tmp)
        images = copy_gallery(args.omniglot, work / "gallery", args.chars)
        model = small_model(work / "small_cnn.onnx", images)
        runs = [(r, name, path) for r in range(args.repeats)
                for name, path in ([("before", args.before), ("after", REPO)] if r % 2 == 0
                                   else [("after", REPO), ("before", args.before)]) if path]
        seconds: dict[str, list[float]] = {"before": [], "after": []}
        for r, name, path in tqdm(runs, desc="timed builds", unit="build"):
            seconds[name].append(timed_cli(path.resolve(), work / "gallery", model,
                                           work / f"out-{name}-{r}", args.shards))
        for attempt in range(3):
            try:
                m = build_with_ray(work / "gallery", work / "out-bytes", model, address="local",
                                   shards=args.shards, sharded=True, progress=False, flat_threshold=100)
                break
            except Exception as e:      # noqa: BLE001 (Ray raises a bare Exception for this)
                if "timed out during startup" not in str(e) or attempt == 2:
                    raise
        n, dim, nq = int(m["count"]), int(m["dim"]), 2 * int(m["heldout_queries"])
        result = {"images": len(images), "count": n, "dim": dim, "shards": args.shards,
                  "held_out_queries": nq, "plan_bytes": m["ray"]["plan_bytes"],
                  # what the same stages read on the driver before: every id, the sample rows
                  # (the same), every vector with its id (the exact answers' pass)
                  "driver_read_before": {"census": 8 * n, "truth": n * (4 * dim + 8)},
                  "seconds": {k: [round(v, 1) for v in s] for k, s in seconds.items() if s}}
        if seconds["before"]:
            result["after_over_before"] = round(sum(seconds["after"]) / sum(seconds["before"]), 3)
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
