"""Which training-free embedder should be the default? Retrieval of EfficientNet-Lite variants
(backbone, pooling, GeM exponent, input size) on real photos, plus ingest throughput.

Protocol (issue 23, item 2): cub-dev species sorted by name, the first half is validation (every
choice is made there), the second half is test (reported only); caltech101-dev is reported only
(its last half of sorted categories, the held-out half of frozen_table2.py, and all of it).
Retrieval is every image against the rest of its split (embedder.metrics.evaluate: R@1/2/4/8,
NMI, MAP@R). Images are embedded the way users get them: each variant is exported to ONNX by
embedder.pretrained (parity-checked) and run by embedder.runtime.OnnxEmbedder with its own
preprocessing. Embeddings are cached per (variant, image list) under --cache (outside the repo).

    python -m benchmarks.embedder.pretrained_choice --splits cub-val \\
        --variants lite0-avg-224 lite0-gem3-224 lite1-gem3-240 lite2-gem3-260
    python -m benchmarks.embedder.pretrained_choice --throughput 400 --out bench_out/embedder.md \\
        --variants lite0-avg-224 lite1-gem3-240

With --out, the section "## The default embedder (training-free)" of that file is replaced
(or appended) and a bar chart is written next to it as pretrained_choice.png. Kept figures:
docs/benchmarks/embedder.md ("The default embedder (training-free, issue 23)").
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from embedder.cli import UsageError, run_main

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.embedder.pretrained_choice"

SHARED = Path(os.environ.get("DAS_SHARED", REPO.parent / "shared")) / "data"
SPLITS = ("cub-val", "cub-test", "caltech-test", "caltech-all")
SECTION = "## The default embedder (training-free)"
EXTS = {".jpg", ".jpeg", ".png"}


def class_files(root: Path) -> list[tuple[str, list[Path]]]:
    """(class, sorted files) per class folder of ``root``, classes sorted by name."""
    if not root.is_dir():
        raise SystemExit(f"error: {root}: not a directory (expected <root>/<class>/<images>)")
    out = [(d.name, sorted(f for f in d.iterdir() if f.suffix.lower() in EXTS))
           for d in sorted(root.iterdir()) if d.is_dir()]
    if len(out) < 2:
        raise SystemExit(f"error: {root}: expected at least two class folders, found {len(out)}")
    return out


def split_files(name: str, cub: Path, caltech: Path) -> tuple[list[Path], np.ndarray]:
    """Files and integer labels of one split (sorted classes; val = first half, test = last)."""
    classes = class_files(cub if name.startswith("cub") else caltech)
    half = len(classes) // 2
    part = {"val": classes[:half], "test": classes[half:], "all": classes}[name.split("-")[1]]
    files = [f for _, fs in part for f in fs]
    labels = np.concatenate([np.full(len(fs), i) for i, (_, fs) in enumerate(part)])
    return files, labels


def model_for(tag: str, cache: Path) -> Path:
    """The variant's ONNX export (made once, with the parity check, through embedder.pretrained)."""
    from embedder.pretrained import export_pretrained, parse_spec

    spec = parse_spec(tag)
    out = cache / f"{spec.model_name}.onnx"
    if not out.is_file():
        export_pretrained(spec, out)
    return out


def embeddings(tag: str, files: list[Path], cache: Path, batch_size: int) -> np.ndarray:
    """Cached (N, d) embeddings of ``files`` by variant ``tag`` (key: model hash + file list)."""
    from embedder import OnnxEmbedder

    model = model_for(tag, cache)
    emb = OnnxEmbedder(model, batch_size=batch_size)
    key = hashlib.sha256((emb.model_hash + "\n" + "\n".join(map(str, files))).encode()).hexdigest()[:16]
    path = cache / f"emb-{tag}-{key}.npy"
    if path.is_file():
        return np.load(path)
    x = emb.embed([str(f) for f in files], progress=True)
    np.save(path, x)
    return x


def ingest_rates(tags: list[str], files: list[Path], cache: Path, repeats: int,
                 batch_size: int, models: dict[str, Path] | None = None,
                 bare: bool = True) -> dict[str, dict[str, float]]:
    """Throughput ratios against ``tags[0]``: bare ``embed_iter`` and ``indexer build``
    (``models``: the ONNX file of each tag, default its pretrained export; ``bare=False``: the
    build only).

    Variants run back to back within each repeat, so each ratio compares runs that saw about
    the same neighbours' load; the median over repeats of these paired ratios is reported, for
    wall time (images/s) and for the process's CPU time per image (what the work costs, less
    sensitive to a shared machine)."""
    from embedder import OnnxEmbedder
    from indexer import build_index
    from tqdm import tqdm

    tmp = Path(tempfile.mkdtemp(prefix="pretrained-choice-"))
    try:
        gallery = tmp / "gallery"
        for f in files:   # a real class-folder gallery of cub photos
            (gallery / f.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, gallery / f.parent.name / f.name)
        models = {t: (models or {}).get(t) or model_for(t, cache) for t in tags}
        embs = {t: OnnxEmbedder(m, batch_size=batch_size) for t, m in models.items()}
        for e in embs.values():   # warm up sessions and the page cache
            for _ in e.embed_iter(((i, str(f)) for i, f in enumerate(files[:64]))):
                pass
        runs: list[dict[str, dict[str, tuple[float, float]]]] = []
        with tqdm(total=repeats * len(tags) * (2 if bare else 1), desc="ingest runs") as bar:
            for r in range(repeats):
                run: dict[str, dict[str, tuple[float, float]]] = {}
                for t in (tags if r % 2 == 0 else tags[::-1]):   # alternate who goes first
                    if bare:
                        w0, c0 = time.perf_counter(), time.process_time()
                        n = sum(len(k) for k, _, _ in embs[t].embed_iter(((i, str(f)) for i, f in enumerate(files))))
                        run.setdefault(t, {})["bare"] = (n / (time.perf_counter() - w0),
                                                         (time.process_time() - c0) / n)
                        bar.update(1)
                    w0, c0 = time.perf_counter(), time.process_time()
                    m = build_index(gallery, tmp / f"idx-{t}-{r}", models[t], batch_size=batch_size,
                                    progress=False, embedder=embs[t])
                    build = (m["count"] / (time.perf_counter() - w0), (time.process_time() - c0) / m["count"])
                    run.setdefault(t, {})["build"] = build
                    bar.update(1)
                runs.append(run)
        b = tags[0]
        return {t: {f"{k}_{kind}": float(np.median([
                    (run[t][k][0] / run[b][k][0]) if kind == "wall" else (run[b][k][1] / run[t][k][1])
                    for run in runs])) for k in (("bare", "build") if bare else ("build",))
                    for kind in ("wall", "cpu")}
                for t in tags}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def plot(results: dict[str, dict[str, dict[str, float]]], splits: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tags = list(results)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(tags) * len(splits) / 2, 4.2))
    w = 0.8 / len(splits)
    for j, s in enumerate(splits):
        vals = [results[t].get(s, {}).get("R@1", np.nan) for t in tags]
        bars = ax.bar(np.arange(len(tags)) + (j - (len(splits) - 1) / 2) * w, vals, w, label=s)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    finite = [v for t in tags for s in splits if np.isfinite(v := results[t].get(s, {}).get("R@1", np.nan))]
    if finite:
        ax.set_ylim(max(0.0, min(finite) - 5), min(100.0, max(finite) + 2))
    ax.set_xticks(np.arange(len(tags)), tags, rotation=20, ha="right")
    ax.set_ylabel("R@1 (%)")
    ax.set_title("Training-free EfficientNet-Lite embedders (ONNX), R@1 per split")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(results, splits, rates, cmd, seconds, baseline: str, n_ingest: int = 0,
            repeats: int = 0, heading: str = SECTION, png: str = "pretrained_choice.png") -> list[str]:
    lines = [heading, "", f"Command: `{cmd}` ({seconds / 60:.1f} min, load average "
             f"{os.getloadavg()[0]:.1f} at the end). Splits: cub-dev species sorted by name, "
             "`cub-val` = first 25 (every choice is made there), `cub-test` = last 25 (report "
             "only); `caltech-test` = last 25 caltech101-dev categories, `caltech-all` = all 50 "
             "(report only). Each image is a query against the rest of its split; embeddings "
             "from the exported ONNX model through `OnnxEmbedder` (the users' path). Metrics "
             "from `embedder.metrics.evaluate`, in %.", "",
             "| variant | split | R@1 | R@2 | R@4 | R@8 | NMI | MAP@R | R@1 - " + baseline + " |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in [s for s in SPLITS if s in splits]:
        for t, res in results.items():
            if s not in res:
                continue
            m = res[s]
            base = results.get(baseline, {}).get(s)
            delta = f"{m['R@1'] - base['R@1']:+.2f}" if base else "-"
            lines.append(f"| {t} | {s} | {m['R@1']:.2f} | {m['R@2']:.2f} | {m['R@4']:.2f} | "
                         f"{m['R@8']:.2f} | {100 * m['NMI']:.2f} | {m['MAP@R']:.2f} | {delta} |")
    if rates:
        lines += ["", f"Throughput on {n_ingest} cub-test photos, same run, variants back to back in "
                  f"each of {repeats} repeats (order alternating); median over repeats of the paired "
                  f"ratio against {baseline}. Bare = `OnnxEmbedder.embed_iter`; build = `indexer "
                  "build` end to end (walk, LMDB, embedding, faiss), batch 32. Wall = images/s; CPU = "
                  "the inverse of process CPU seconds per image (less sensitive to neighbours' load).", "",
                  "| variant | bare, wall | bare, CPU | indexer build, wall | indexer build, CPU |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for t, r in rates.items():
            lines.append(f"| {t} | {r['bare_wall']:.2f}x | {r['bare_cpu']:.2f}x | "
                         f"{r['build_wall']:.2f}x | {r['build_cpu']:.2f}x |")
    lines += ["", f"![R@1 per variant and split]({png})"]
    return lines


def replace_section(text: str, new: list[str]) -> str:
    lines = text.rstrip("\n").split("\n")
    start = next((i for i, line in enumerate(lines) if line.strip() == new[0]), None)
    if start is None:
        return "\n".join(lines + [""] + new) + "\n"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[:start] + new + [""] + lines[end:]).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Variants: a name of embedder.pretrained.PRETRAINED or "
                                        "liteN-avg|liteN-gemP[-SIZE] (N 0..2; SIZE default native).")
    ap.add_argument("--variants", nargs="+", default=["lite0-avg-224", "lite0-gem3-224"])
    ap.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS))
    ap.add_argument("--baseline", default="lite0-avg-224", help="the variant deltas and ratios refer to")
    ap.add_argument("--cub", type=Path, default=SHARED / "cub-dev" / "images")
    ap.add_argument("--caltech", type=Path, default=SHARED / "caltech101-dev" / "images")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("DAS_CACHE") or
                                                       Path.home() / ".cache" / "das-retrieval") / "pretrained-choice",
                    help="ONNX exports and embeddings (outside the repo)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--throughput", type=int, default=0, metavar="N",
                    help="also measure ingest throughput on N cub-test photos spread over its species (0: skip)")
    ap.add_argument("--repeats", type=int, default=5, help="throughput repeats (median of paired ratios)")
    ap.add_argument("--throughput-variants", nargs="+", default=None, metavar="VARIANT",
                    help="variants whose throughput to measure (default: all; the baseline always)")
    ap.add_argument("--out", type=Path, default=None, help="Markdown file whose section to replace")
    ap.add_argument("--section", default=SECTION, help=f"heading of that section (default {SECTION!r})")
    ap.add_argument("--png", default="pretrained_choice.png", help="bar chart file name, next to --out")
    return run_main(PROG, ap, argv, handler=lambda args: run(args, argv))


def run(args: argparse.Namespace, argv: list[str] | None) -> int | None:
    from embedder.pretrained import parse_spec

    try:
        for t in args.variants + [args.baseline]:
            parse_spec(t)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.baseline not in args.variants:
        args.variants.insert(0, args.baseline)
    if args.batch_size < 1 or args.throughput < 0 or args.repeats < 1:
        raise UsageError("--batch-size and --repeats must be >= 1, --throughput >= 0")
    args.cache.mkdir(parents=True, exist_ok=True)
    from embedder.metrics import evaluate

    t_start = time.perf_counter()
    results: dict[str, dict[str, dict[str, float]]] = {t: {} for t in args.variants}
    done: dict[tuple[str, str], tuple[list[Path], np.ndarray]] = {}
    order = sorted(args.splits, key=lambda s: not s.endswith("-all"))   # "all" first: others slice it
    for s in order:
        files, labels = split_files(s, args.cub, args.caltech)
        for t in args.variants:
            print(f"{t} on {s} ({len(files)} images) ...", file=sys.stderr, flush=True)
            whole = done.get((t, s.split("-")[0] + "-all"))
            if whole is not None:   # a part of a split already embedded: no second pass
                pos = {f: i for i, f in enumerate(whole[0])}
                x = whole[1][[pos[f] for f in files]]
            else:
                x = embeddings(t, files, args.cache, args.batch_size)
            done[(t, s)] = (files, x)
            m = evaluate(x, labels, map_r=True)
            results[t][s] = {k: (100 * v if k.startswith(("R@", "MAP")) else v) for k, v in m.items()}
            print(f"  {t} {s}: " + ", ".join(f"{k} {v:.4g}" for k, v in results[t][s].items()),
                  file=sys.stderr, flush=True)
    rates = {}
    if args.throughput:
        files, _ = split_files("cub-test", args.cub, args.caltech)
        tv = [args.baseline] + [t for t in (args.throughput_variants or args.variants) if t != args.baseline]
        rates = ingest_rates(tv, files[:: max(1, len(files) // args.throughput)][:args.throughput],
                             args.cache, args.repeats, args.batch_size)
    seconds = time.perf_counter() - t_start
    cmd = "python -m benchmarks.embedder.pretrained_choice " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    lines = section(results, args.splits, rates, cmd, seconds, args.baseline, args.throughput,
                    args.repeats, args.section, args.png)
    print("\n".join(lines))
    if args.out is not None:
        text = args.out.read_text() if args.out.is_file() else ""
        args.out.write_text(replace_section(text, lines))
        plot(results, args.splits, args.out.parent / args.png)
        print(f"wrote {args.out} and {args.out.parent / args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
