"""Which configuration should `python -m indexer build GALLERY` use by default? (issue 41, item 1)

Candidates: what exists: pretrained variants (embedder.pretrained names: ``lite1-gem4-224``,
``lite0-gem4-224``, the two-backbone ``lite0+lite1-gem4``), each fp32 or int8
(``VARIANT:RECIPE``, RECIPE an embedder.quantize.QuantRecipe tag as benchmarks/embedder/int8_calibration.py
reads them, calibrated on cub-val photos), each with DBA re-ranking off and on (indexer.ann.neighbours,
default k/alpha/depth; leave-one-out with its guard, benchmarks.indexer.neighbour_rerank.leave_one_out).

Protocol: benchmarks/embedder/int8_embedder.py's: cub-dev species sorted by name, first half = validation
(``cub-val``: the choice is made there), second half ``cub-test`` and caltech101-dev (all 50
categories and the last 25) reported only. The rule: the highest cub-val R@1 among candidates whose
`indexer build` images/s is >= the first candidate's (today's default, fp32, DBA off) and which are
never lower than it by more than 0.3 R@1 on any set.

Speed (``--throughput N``): `indexer build` end to end on N cub-test photos (with ``--dba``
for the DBA rows' models: DBA's neighbour lists are computed at build time), every candidate back
to back in each repeat, order alternating, median of paired ratios against the first.

    python -m benchmarks.embedder.default_choice --candidates lite1-gem4-224 lite1-gem4-224:minmax-pc-stem-256 \\
        lite0+lite1-gem4 lite0+lite1-gem4:minmax-pc-stem-256 --throughput 200 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.embedder.int8_calibration import int8_model, parse_recipe
from benchmarks.embedder.int8_embedder import arrays, embed
from benchmarks.embedder.pretrained_choice import SHARED, model_for, split_files
from embedder.cli import run_main

PROG = "python -m benchmarks.embedder.default_choice"
SETS = ("cub-val", "cub-test", "caltech-test", "caltech-all")


def candidate_model(cand: str, cache: Path, val_files: list[Path]) -> Path:
    variant, _, recipe = cand.partition(":")
    fp32 = model_for(variant, cache)
    if not recipe:
        return fp32
    r = parse_recipe(recipe)
    calib = val_files[:: max(1, len(val_files) // r.images)][:r.images]
    return int8_model(fp32, r, calib, cache)[0]


def build_rates(models: dict[str, Path], dba: dict[str, bool], files: list[Path], repeats: int,
                batch_size: int = 32) -> dict[str, dict[str, float]]:
    """`indexer build` images/s and CPU per image, ratios against the first entry (paired per
    repeat, order alternating, median)."""
    from embedder import OnnxEmbedder
    from indexer import build_index
    from indexer.ann.neighbours import DbaParams

    tmp = Path(tempfile.mkdtemp(prefix="default-choice-"))
    try:
        gallery = tmp / "gallery"
        for f in files:
            (gallery / f.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, gallery / f.parent.name / f.name)
        embs = {t: OnnxEmbedder(m, batch_size=batch_size) for t, m in models.items()}
        for e in embs.values():   # warm the sessions and the page cache
            for _ in e.embed_iter(((i, str(f)) for i, f in enumerate(files[:32]))):
                pass
        runs = []
        names = list(models)
        for r in range(repeats):
            run = {}
            for t in (names if r % 2 == 0 else names[::-1]):
                w0, c0 = time.perf_counter(), time.process_time()
                m = build_index(gallery, tmp / f"idx-{r}-{len(run)}", models[t], batch_size=batch_size,
                                progress=False, embedder=embs[t], dba=DbaParams() if dba[t] else None)
                run[t] = (m["count"] / (time.perf_counter() - w0), (time.process_time() - c0) / m["count"])
                print(f"build {t} repeat {r}: {run[t][0]:.1f} images/s", file=sys.stderr, flush=True)
            runs.append(run)
        b = names[0]
        return {t: {"wall": float(np.median([run[t][0] / run[b][0] for run in runs])),
                    "cpu": float(np.median([run[b][1] / run[t][1] for run in runs])),
                    "ips": float(np.median([run[t][0] for run in runs]))} for t in names}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--candidates", nargs="+", required=True,
                    help="VARIANT or VARIANT:RECIPE (int8); the first is today's default")
    ap.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS))
    ap.add_argument("--no-dba", action="store_true", help="DBA off rows only")
    ap.add_argument("--cub", type=Path, default=SHARED / "cub-dev" / "images")
    ap.add_argument("--caltech", type=Path, default=SHARED / "caltech101-dev" / "images")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("DAS_CACHE") or
                                                       Path.home() / ".cache" / "das-retrieval") / "pretrained-choice")
    ap.add_argument("--throughput", type=int, default=0, metavar="N")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="append the tables to this Markdown file")
    return run_main(PROG, ap, argv, handler=lambda args: run(args, argv))


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    from benchmarks.indexer.neighbour_rerank import leave_one_out
    from embedder.metrics import evaluate
    from indexer.ann.neighbours import DEFAULT_ALPHA, DEFAULT_DEPTH, DEFAULT_K

    t0 = time.perf_counter()
    val_files, _ = split_files("cub-val", args.cub, args.caltech)
    models = {c: candidate_model(c, args.cache, val_files) for c in args.candidates}
    first = model_for(args.candidates[0].partition(":")[0], args.cache)
    rows: dict[str, dict[str, dict[str, float]]] = {}
    for s in [s for s in ("cub-val", "cub-test", "caltech-all") if s in args.sets or
              (s == "caltech-all" and "caltech-test" in args.sets)]:
        files, labels = split_files(s, args.cub, args.caltech)
        x = arrays(s, files, first, args.cache)
        for c, path in models.items():
            e = np.asarray(embed(path, x, s, args.cache), dtype=np.float32)
            parts = [(s, e, labels)]
            if s == "caltech-all":
                tf, tl = split_files("caltech-test", args.cub, args.caltech)
                pos = {f: i for i, f in enumerate(files)}
                parts.append(("caltech-test", e[[pos[f] for f in tf]], tl))
            for split, emb, lab in parts:
                if split not in args.sets:
                    continue
                m = evaluate(emb, lab, map_r=True, clustering=False)
                rows.setdefault(c, {})[split] = {"R@1": 100 * m["R@1"], "MAP@R": 100 * m["MAP@R"]}
                if not args.no_dba:
                    d = leave_one_out(emb, lab, DEFAULT_K, DEFAULT_ALPHA, DEFAULT_DEPTH, 100)["dba (guarded)"]
                    rows.setdefault(c + " +DBA", {})[split] = {"R@1": d["R@1"], "MAP@R": d["MAP@R"]}
                print(f"{c} {split}: R@1 {100 * m['R@1']:.2f}" + (
                    f", +DBA {d['R@1']:.2f}" if not args.no_dba else ""), file=sys.stderr, flush=True)
    names = [n for c in args.candidates for n in (c, c + " +DBA") if n in rows]
    rates = {}
    if args.throughput:
        files, _ = split_files("cub-test", args.cub, args.caltech)
        pick = files[:: max(1, len(files) // args.throughput)][:args.throughput]
        rates = build_rates({n: models[n.removesuffix(" +DBA")] for n in names},
                            {n: n.endswith("+DBA") for n in names}, pick, args.repeats)
    base = args.candidates[0]
    sets = [s for s in SETS if s in args.sets]
    ok = {}
    for n in names:
        worst = min(rows[n][s]["R@1"] - rows[base][s]["R@1"] for s in sets)
        ok[n] = worst >= -0.3 and (not rates or rates[n]["wall"] >= 1.0)
    cmd = PROG + " " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    lines = [f"`{cmd}` ({(time.perf_counter() - t0) / 60:.1f} min, load average "
             f"{os.getloadavg()[0]:.1f} at the end)", "",
             "| candidate | " + " | ".join(f"{s} R@1 | MAP@R" for s in sets)
             + " | `indexer build` images/s vs first (CPU) | passes |",
             "| --- |" + " ---: | ---: |" * len(sets) + " ---: | :---: |"]
    for n in names:
        cells = []
        for s in sets:
            v, b = rows[n][s], rows[base][s]
            cells += [f"{v['R@1']:.2f}" + ("" if n == base else f" ({v['R@1'] - b['R@1']:+.2f})"),
                      f"{v['MAP@R']:.2f}"]
        sp = f"{rates[n]['wall']:.2f}x ({rates[n]['cpu']:.2f}x)" if rates else "-"
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {sp} | {'yes' if ok[n] else 'no'} |")
    if rates:
        lines += ["", f"`indexer build` of {args.throughput} cub-test photos, {args.repeats} repeats, "
                  f"median images/s of the first: {rates[base]['ips']:.1f}"]
    print("\n".join(lines))
    if args.out is not None:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
