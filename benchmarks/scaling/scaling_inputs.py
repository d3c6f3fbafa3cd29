"""Per-image figures that docs/SCALING.md extrapolates to a 100M-image gallery.

Run from the repository root:

    python -m benchmarks.scaling.scaling_inputs --out bench_out/scaling.md

(without --out it prints only; kept figures: docs/benchmarks/scaling.md, "Per-image inputs")

On the same cores and in the same run (so the ratios hold under load), with the default
embedder (EfficientNet-Lite0, 224 px, 1280-d):

1. ``indexer build`` throughput on real photos (Caltech-101 JPEGs) against tiny glyphs
   (Omniglot PNGs, the gallery of docs/benchmarks/indexer.md's ingest): what photo decoding costs;
2. decode + resize + normalise alone (``OnnxEmbedder.prepare``, one thread) on the same photos:
   the per-core ceiling a GPU node's CPUs must feed, whatever the GPU does;
3. bytes per image on disk: the LMDB store (image bytes, metadata, embedding) and the faiss file.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from embedder.cli import run_main

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.scaling.scaling_inputs"
DATA = REPO.parent / "shared" / "data"


def copy_gallery(files: list[Path], root: Path, dst: Path) -> Path:
    for f in files:
        out = dst / f.relative_to(root)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, out)
    return dst


def du(path: Path) -> int:
    """Bytes actually allocated (LMDB's map is sparse: st_size would overstate it)."""
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def run(n: int, repeats: int) -> dict:
    from embedder import OnnxEmbedder, default_model_path

    from indexer import build_index

    model = default_model_path()
    caltech_root = Path(os.environ.get("DAS_CALTECH", DATA / "caltech101-dev" / "images"))
    omni_root = Path(os.environ.get("DAS_OMNIGLOT", DATA / "omniglot")) / "images_background"
    photos = sorted(caltech_root.rglob("*.jpg"))[:n]
    glyphs = sorted(omni_root.rglob("*.png"))[:n]
    tmp = Path(tempfile.mkdtemp(prefix="scaling-"))
    try:
        galleries = {"caltech": copy_gallery(photos, caltech_root, tmp / "caltech"),
                     "omniglot": copy_gallery(glyphs, omni_root, tmp / "omniglot")}
        emb = OnnxEmbedder(model, batch_size=32)
        rates: dict[str, list[float]] = {k: [] for k in galleries}
        sizes: dict[str, dict] = {}
        for r in range(repeats):                      # interleaved: load hits both alike
            for name, g in galleries.items():
                out = tmp / f"{name}-idx{r}"
                t0 = time.perf_counter()
                m = build_index(g, out, model, workers=2, progress=False, embedder=emb)
                rates[name].append(m["count"] / (time.perf_counter() - t0))
                if r == 0:
                    files = sorted(g.rglob("*.*"))
                    sizes[name] = {"count": m["count"], "file_bytes": sum(f.stat().st_size for f in files),
                                   "store_bytes": du(out / "store.lmdb"),
                                   "index_bytes": (out / "index.faiss").stat().st_size,
                                   "dim": m["dim"], "index_type": m["index_type"]}
                shutil.rmtree(out)
        datas = [p.read_bytes() for p in sorted(galleries["caltech"].rglob("*.jpg"))]
        emb.prepare(datas[0])
        t0 = time.perf_counter()
        for d in datas:
            emb.prepare(d)
        decode = len(datas) / (time.perf_counter() - t0)
        return {"n": n, "repeats": repeats, "rates": {k: max(v) for k, v in rates.items()},
                "decode_per_core": decode, "sizes": sizes, "load": os.getloadavg()[0]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(r: dict, cmd: str, seconds: float) -> str:
    c, o = r["sizes"]["caltech"], r["sizes"]["omniglot"]
    lines = ["## Scaling inputs (`benchmarks/scaling/scaling_inputs.py`)", "",
             f"Command: `{cmd}` ({seconds / 60:.1f} min, 2 shared CPU cores, load average "
             f"{r['load']:.1f} at the end). Default embedder (EfficientNet-Lite0, 224 px, "
             f"{c['dim']}-d); `indexer build` with 2 decode threads, best of {r['repeats']}, the two "
             "galleries interleaved.", "",
             "| gallery | images | mean file KiB | indexer build img/s | store bytes / image | "
             "of which image bytes | faiss bytes / image |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s, label in (("caltech", c, "Caltech-101 JPEG photos"), ("omniglot", o, "Omniglot PNG glyphs")):
        lines.append(f"| {label} | {s['count']} | {s['file_bytes'] / s['count'] / 1024:.1f} | "
                     f"{r['rates'][name]:.0f} | {s['store_bytes'] / s['count']:,.0f} | "
                     f"{s['file_bytes'] / s['count']:,.0f} | {s['index_bytes'] / s['count']:,.0f} "
                     f"({s['index_type']}) |")
    lines += ["", f"Photos / glyphs build rate: **{r['rates']['caltech'] / r['rates']['omniglot']:.2f}x**. "
              f"Decode + resize + normalise alone (`OnnxEmbedder.prepare`, 1 thread) on the photos: "
              f"**{r['decode_per_core']:.0f} img/s per core**."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=600, help="images of each gallery (default 600)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the Markdown section here")
    return run_main(PROG, ap, argv, handler=lambda args: run(args, argv))


def run(args: argparse.Namespace, argv: list[str] | None) -> int | None:
    t0 = time.perf_counter()
    r = run(args.images, args.repeats)
    text = report(r, "python -m benchmarks.scaling.scaling_inputs " + " ".join(sys.argv[1:]), time.perf_counter() - t0)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
