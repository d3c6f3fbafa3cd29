"""How far int8 R@1 can be trusted (issue 41, item 2): the same recipe calibrated on cub-val photos
(int8_calibration's protocol) and on the gallery it embeds (what `indexer build` does), against the
R@1 that fp32 embeddings lose to random errors of the int8 model's own size.

For each set and recipe: R@1 of the int8 embeddings minus fp32's (queries that gained / lost their
first hit), without and with DBA (the build's defaults); then the noise floor: the int8 model's
own error vectors (int8 - fp32, per image) added to the fp32 embeddings of *other* images,
``--draws`` random shuffles: the R@1 change an error of exactly that size and direction
distribution causes when it is not tied to the image (mean, 5th-95th percentile). An int8 delta
inside that band is as much where near-ties fall as what the recipe does.

    python -m benchmarks.embedder.int8_noise --recipes minmax-pc-stem-256-rr minmax-pc-stem-256-rr-bc
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from benchmarks.embedder.int8_calibration import int8_model, parse_recipe
from benchmarks.embedder.int8_embedder import arrays, embed
from benchmarks.embedder.pretrained_choice import SHARED, model_for, split_files
from embedder.cli import run_main
from embedder.quantize import spread

PROG = "python -m benchmarks.embedder.int8_noise"
SETS = ("cub-val", "cub-test", "caltech-test", "caltech-all")


def first_hits(x: np.ndarray, y: np.ndarray, dba: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """Per query: is the first leave-one-out neighbour of its class, plain and after DBA."""
    from embedder.knn import exact_knn
    from indexer.ann import neighbours as nbm

    ids = np.arange(len(x), dtype=np.int64)
    cand = exact_knn(x, x, nbm.DEFAULT_DEPTH if dba else 1, "ip", own=ids)[1]
    plain = cand[:, 0]
    if not dba:
        return y[plain] == y, None
    nb = nbm.build(ids, x, nbm.DbaParams(nbm.DEFAULT_K, nbm.DEFAULT_ALPHA, nbm.DEFAULT_DEPTH))
    dba = nbm.rerank(nb, x, cand, 1, exclude=ids.tolist(), vectors=lambda i: x[i])[1][:, 0]
    return y[plain] == y, y[dba] == y


def unit(a: np.ndarray) -> np.ndarray:
    return (a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float32)


def run(args: argparse.Namespace) -> int:
    cub, cal = args.cub, args.caltech
    fp32 = model_for("lite1-gem4-224", args.cache)
    val_files, _ = split_files("cub-val", cub, cal)
    rng = np.random.default_rng(0)
    lines = [f"`{PROG} --recipes {' '.join(args.recipes)} --draws {args.draws}` (Lite1 GeM4; R@1 "
             "minus fp32's, queries up / down; noise floor: the own errors shuffled over images, "
             "mean [5th, 95th percentile])", "",
             "| set | fp32 R@1 (+DBA) | recipe | calibrated on | cosine | int8 - fp32 | noise floor | +DBA: int8 - fp32 |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    for s in args.sets:
        src = "caltech-all" if s == "caltech-test" else s          # caltech-test: a part of all
        files, labels = split_files(s, cub, cal)
        src_files, _ = split_files(src, cub, cal)
        pick = np.array([{f: i for i, f in enumerate(src_files)}[f] for f in files])
        y = np.asarray(labels)
        x = arrays(src, src_files, fp32, args.cache)
        f = unit(embed(fp32, x, src, args.cache)[pick])
        h0, d0 = first_hits(f, y)
        for tag in args.recipes:
            r = parse_recipe(tag)
            for where, calib in (("cub-val", val_files[:: max(1, len(val_files) // r.images)][:r.images]),
                                 (src + " (the gallery)", spread(sorted(src_files), r.images))):
                e = unit(embed(int8_model(fp32, r, calib, args.cache)[0], x, src, args.cache)[pick])
                h, d = first_hits(e, y)
                err = e - f
                floor = [100 * (first_hits(unit(f + err[rng.permutation(len(f))]), y, dba=False)[0].mean() - h0.mean())
                         for _ in range(args.draws)]
                lines.append(f"| {s} | {100 * h0.mean():.2f} ({100 * d0.mean():.2f}) | {tag} | {where} | "
                             f"{float((e * f).sum(1).mean()):.4f} | {100 * (h.mean() - h0.mean()):+.2f} "
                             f"({int((h > h0).sum())} / {int((h < h0).sum())}) | {np.mean(floor):+.2f} "
                             f"[{np.percentile(floor, 5):+.2f}, {np.percentile(floor, 95):+.2f}] | "
                             f"{100 * (d.mean() - d0.mean()):+.2f} |")
                print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=["minmax-pc-stem-256-rr", "minmax-pc-stem-256-rr-bc"])
    ap.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS))
    ap.add_argument("--draws", type=int, default=20, help="shuffles of the error vectors a row")
    ap.add_argument("--cub", type=Path, default=SHARED / "cub-dev" / "images")
    ap.add_argument("--caltech", type=Path, default=SHARED / "caltech101-dev" / "images")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("DAS_CACHE") or
                                                       Path.home() / ".cache" / "das-retrieval") / "pretrained-choice")
    return run_main(PROG, ap, argv, handler=run)


if __name__ == "__main__":
    sys.exit(main())
