"""How the int8 calibration moves retrieval (issue 41, item 2): calibration image count, method
(onnxruntime's min/max, entropy, percentile), per-channel weights, which nodes stay float.

Protocol: benchmarks/embedder/int8_embedder.py's (cub-dev species sorted by name, first half = validation
``cub-val``, where every choice is made; second half ``cub-test`` and caltech101-dev, all 50
categories and their last 25, reported only). Calibration images are spread over cub-val
(validation, never test). Each split is decoded and preprocessed once (cached under --cache), and
every model runs on the same arrays. For each variant the fp32 export and its int8 versions, one
per ``--recipes`` entry (embedder.quantize.QuantRecipe tags: ``METHOD-pc|pt-FLOATS-IMAGES``, e.g.
``minmax-pc-stem-256``, ``entropy-pc-stem+head-256``, ``pct99.99-pc-stem-256``), are evaluated
(R@1, MAP@R in %; deltas against the variant's fp32) and timed with onnxruntime alone (1 thread,
a batch of 16, calls alternating over every model of the variant; ratio against its fp32).

    python -m benchmarks.embedder.int8_calibration --variants lite1-gem4-224 --splits cub-val \\
        --recipes minmax-pc-stem-256 minmax-pc-stem-64 minmax-pc-stem-512 entropy-pc-stem-256 \\
                  pct99.999-pc-stem-256 minmax-pt-stem-256 minmax-pc-none-256 minmax-pc-stem+head-256
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.embedder.int8_embedder import arrays, embed, ort_rates
from benchmarks.embedder.pretrained_choice import SHARED, model_for, split_files
from embedder.cli import run_main

PROG = "python -m benchmarks.embedder.int8_calibration"
SPLITS = ("cub-val", "cub-test", "caltech-all")
_TAG = re.compile(r"^(minmax|entropy|pct([\d.]+))-(pc|pt)-(none|stem|head|stem\+head|stem\+adds|full-res)-(\d+)(-rr)?(-bc)?$")


def parse_recipe(tag: str):
    """A QuantRecipe from its tag (``QuantRecipe.tag`` reads back)."""
    from embedder.quantize import QuantRecipe

    m = _TAG.match(tag)
    if not m:
        raise SystemExit(f"error: recipe {tag!r}: expected METHOD-pc|pt-none|stem|head|stem+head|stem+adds|full-res-IMAGES[-rr][-bc], "
                         "METHOD minmax, entropy or pctNN.N")
    method = "percentile" if m.group(2) else m.group(1)
    r = QuantRecipe(method=method, per_channel=m.group(3) == "pc", float_nodes=m.group(4),
                    images=int(m.group(5)), reduce_range=bool(m.group(6)), bias_correction=bool(m.group(7)), **({"percentile": float(m.group(2))} if m.group(2) else {}))
    assert r.tag == tag, (r.tag, tag)
    return r


def int8_model(fp32: Path, recipe, calibration: list[Path], cache: Path) -> tuple[Path, dict]:
    """``fp32`` quantised with ``recipe`` on ``calibration`` (made once; the report's figures
    are kept beside it)."""
    import json

    from embedder.quantize import quantize_embedder

    key = hashlib.sha256((recipe.tag + "\n" + "\n".join(map(str, calibration))).encode()).hexdigest()[:10]
    out = cache / f"{fp32.stem}-int8-{recipe.tag}-{key}.onnx"
    info = out.with_suffix(".json")
    if not out.is_file() or not info.is_file():
        t = time.perf_counter()
        r = quantize_embedder(fp32, calibration, out, recipe=recipe)
        info.write_text(json.dumps({"seconds": time.perf_counter() - t, "mean_cosine": r.mean_cosine,
                                    "min_cosine": r.min_cosine, "images": r.calibration_images}))
    return out, json.loads(info.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["lite1-gem4-224"])
    ap.add_argument("--recipes", nargs="+", default=["minmax-pc-stem-256"])
    ap.add_argument("--splits", nargs="+", choices=SPLITS, default=["cub-val"])
    ap.add_argument("--cub", type=Path, default=SHARED / "cub-dev" / "images")
    ap.add_argument("--caltech", type=Path, default=SHARED / "caltech101-dev" / "images")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("DAS_CACHE") or
                                                       Path.home() / ".cache" / "das-retrieval") / "pretrained-choice")
    ap.add_argument("--ort-repeats", type=int, default=9, help="alternating onnxruntime calls per model (0: skip)")
    ap.add_argument("--out", type=Path, default=None, help="append the table to this Markdown file")
    return run_main(PROG, ap, argv, handler=lambda args: run(args, argv))


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    from embedder.metrics import evaluate
    from embedder.quantize import QuantizationError

    recipes = [parse_recipe(t) for t in args.recipes]
    t0 = time.perf_counter()
    val_files, _ = split_files("cub-val", args.cub, args.caltech)
    lines: list[str] = []
    for variant in args.variants:
        fp32 = model_for(variant, args.cache)
        models: dict[str, Path] = {"fp32": fp32}
        infos: dict[str, dict] = {}
        refused: dict[str, str] = {}
        for r in recipes:
            calib = val_files[:: max(1, len(val_files) // r.images)][:r.images]
            try:
                models[r.tag], infos[r.tag] = int8_model(fp32, r, calib, args.cache)
            except QuantizationError as e:   # quantize_embedder's own check refused it
                refused[r.tag] = str(e).split("(", 1)[-1].split(")")[0]
                print(f"{variant} {r.tag}: refused: {e}", file=sys.stderr, flush=True)
                continue
            print(f"{variant} {r.tag}: cosine {infos[r.tag]['mean_cosine']:.4f} / "
                  f"{infos[r.tag]['min_cosine']:.4f}, {infos[r.tag]['seconds']:.0f} s", file=sys.stderr, flush=True)
        res: dict[str, dict[str, dict[str, float]]] = {m: {} for m in models}
        for s in args.splits:
            files, labels = split_files(s, args.cub, args.caltech)
            x = arrays(s, files, fp32, args.cache)
            for name, path in models.items():
                e = embed(path, x, s, args.cache)
                if s == args.splits[0]:   # int8 vs fp32 cosine on every photo of the first split
                    f32 = embed(fp32, x, s, args.cache)
                    cos = (e * f32).sum(1) / (np.linalg.norm(e, axis=1) * np.linalg.norm(f32, axis=1))
                    infos.setdefault(name, {}).update(cos_mean=float(cos.mean()), cos_p1=float(np.percentile(cos, 1)))
                parts = [(s, e, labels)]
                if s == "caltech-all":
                    tf, tl = split_files("caltech-test", args.cub, args.caltech)
                    pos = {f: i for i, f in enumerate(files)}
                    parts.append(("caltech-test", e[[pos[f] for f in tf]], tl))
                for split, emb, lab in parts:
                    m = evaluate(emb, lab, map_r=True, clustering=False)
                    res[name][split] = {k: 100 * v for k, v in m.items()}
                    print(f"{variant} {name} {split}: R@1 {100 * m['R@1']:.2f} MAP@R {100 * m['MAP@R']:.2f}",
                          file=sys.stderr, flush=True)
        speed = {}
        if args.ort_repeats:
            files, _ = split_files("cub-val", args.cub, args.caltech)
            speed = ort_rates(models, arrays("cub-val", files, fp32, args.cache), repeats=args.ort_repeats)
        splits = [s for s in ("cub-val", "cub-test", "caltech-test", "caltech-all") if s in res["fp32"]]
        lines += [f"**{variant}** (int8 deltas against its fp32; cosine = int8 vs fp32 embeddings "
                  f"of every {args.splits[0]} photo, mean / 1st percentile; ORT = onnxruntime alone, 1 thread, vs fp32)", "",
                  "| recipe | " + " | ".join(f"{s} R@1 | MAP@R" for s in splits)
                  + " | cosine to fp32 | calibration s (loaded) | ORT |",
                  "| --- |" + " ---: | ---: |" * len(splits) + " ---: | ---: | ---: |"]
        for name in models:
            cells = []
            for s in splits:
                v, f = res[name][s], res["fp32"][s]
                if name == "fp32":
                    cells += [f"{v['R@1']:.2f}", f"{v['MAP@R']:.2f}"]
                else:
                    cells += [f"{v['R@1']:.2f} ({v['R@1'] - f['R@1']:+.2f})",
                              f"{v['MAP@R']:.2f} ({v['MAP@R'] - f['MAP@R']:+.2f})"]
            i = infos[name]
            cells += [f"{i['cos_mean']:.4f} / {i['cos_p1']:.4f}" if name != "fp32" else "-",
                      f"{i['seconds']:.0f}" if name != "fp32" else "-"]
            cells.append(f"{speed[name]:.2f}x" if speed else "-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        for tag, why in refused.items():
            lines.append(f"| {tag} | refused by quantize_embedder's check: {why} |")
        lines.append("")
    cmd = PROG + " " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    lines = [f"`{cmd}` ({(time.perf_counter() - t0) / 60:.1f} min, load average "
             f"{os.getloadavg()[0]:.1f} at the end)", ""] + lines
    print("\n".join(lines))
    if args.out is not None:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
