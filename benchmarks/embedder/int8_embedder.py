"""int8 vs fp32 embedders, and the two-backbone embedder: retrieval on held-out species and
ingest speed, in one run (issue 30, items 1, 2 and the embedder rows of item 4's grid).

Protocol (the one of benchmarks/embedder/pretrained_choice.py, which chose the default): cub-dev species
sorted by name, first half = validation (``cub-val``: every choice is made there), second half =
test (``cub-test``, reported only); caltech101-dev reported only (``caltech-all``; its last 25
categories, ``caltech-test``, are sliced from it). Each image is a query against the rest of its
split (embedder.metrics.evaluate: R@1, MAP@R in %).

For each pretrained variant (``--variants``, names of embedder.pretrained) the fp32 export and
its int8 version (``python -m embedder quantize``'s code, embedder.quantize, calibrated on
``--calibration`` images spread over the cub-val species: validation data, never test) are
evaluated. All variants share one preprocessing, so each split is decoded and preprocessed once
(embedder's own ``OnnxEmbedder.prepare``, cached as float32 .npy under --cache) and every
model runs on the same arrays (``OnnxEmbedder.embed_arrays``: the users' path less the
decoding).

Speed (``--throughput N``): ``indexer build`` end to end on N cub-test photos, every model back
to back in each repeat, order alternating, median of paired ratios against the first variant's
fp32 model (benchmarks.embedder.pretrained_choice.ingest_rates); plus onnxruntime alone, 1 thread,
calls alternating (the network only; readable under a neighbours' load that blurs the build).

    python -m benchmarks.embedder.int8_embedder --variants lite1-gem4-224 lite0+lite1-gem4 \\
        --throughput 200 --repeats 3 --out bench_out/embedder.md

Without --out it prints only; kept figures: docs/benchmarks/embedder.md ("int8 and two-backbone
embedders").
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import sys
import time
from pathlib import Path

from embedder.cli import run_main

PROG = "python -m benchmarks.embedder.int8_embedder"

import numpy as np

from benchmarks.embedder.pretrained_choice import SHARED, ingest_rates, model_for, replace_section, split_files

SECTION = "## int8 and two-backbone embedders (issue 30)"
SPLITS = ("cub-val", "cub-test", "caltech-all")


def int8_model(tag: str, cache: Path, calibration: list[Path]) -> Path:
    """The int8 version of variant ``tag``, calibrated on ``calibration`` (made once)."""
    from embedder.quantize import quantize_embedder

    fp32 = model_for(tag, cache)
    from embedder.quantize import DEFAULT_RECIPE, QUANT_FORMAT, QUANTIZED_OPS

    recipe = f"{QUANT_FORMAT} {' '.join(QUANTIZED_OPS)}\n"
    if DEFAULT_RECIPE.tag != "minmax-pc-stem-256":   # issue 41's recipe: a new file (old caches kept)
        recipe += DEFAULT_RECIPE.tag + "\n"
    key = hashlib.sha256((recipe + "\n".join(map(str, calibration))).encode()).hexdigest()[:10]
    out = cache / f"{fp32.stem}-int8-{key}.onnx"
    if not out.is_file():
        r = quantize_embedder(fp32, calibration, out, progress=True)
        print(f"{tag}: int8 written, {r.calibration_images} calibration images, cosine to fp32 "
              f"mean {r.mean_cosine:.4f} min {r.min_cosine:.4f}", file=sys.stderr)
    return out


def arrays(split: str, files: list[Path], model: Path, cache: Path) -> np.ndarray:
    """Preprocessed (N, 3, H, W) float32 arrays of ``files`` (cached per split and preprocessing)."""
    from embedder import OnnxEmbedder
    from tqdm import tqdm

    emb = OnnxEmbedder(model)
    key = hashlib.sha256((emb.metadata["preprocessing"] + "\n".join(map(str, files))).encode()).hexdigest()[:12]
    path = cache / f"arrays-{split}-{key}.npy"
    if path.is_file():
        return np.load(path, mmap_mode="r")
    x = np.lib.format.open_memmap(str(path) + ".tmp.npy", mode="w+", dtype=np.float32,
                                  shape=(len(files), emb.preprocessing.channels(),
                                         emb.preprocessing.input_size, emb.preprocessing.input_size))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        for i, a in enumerate(tqdm(pool.map(lambda f: emb.prepare(str(f)), files), total=len(files),
                                   desc=f"preprocessing {split}")):
            x[i] = a
    x.flush()
    del x
    os.replace(str(path) + ".tmp.npy", path)
    return np.load(path, mmap_mode="r")


def embed(model: Path, x: np.ndarray, split: str, cache: Path) -> np.ndarray:
    """Embeddings of preprocessed ``x`` by ``model`` (cached per model hash and split)."""
    from embedder import OnnxEmbedder
    from tqdm import tqdm

    emb = OnnxEmbedder(model, batch_size=32)
    path = cache / f"emb-{emb.model_hash[:16]}-{split}-{len(x)}.npy"
    if path.is_file():
        return np.load(path)
    out = np.concatenate([emb.embed_arrays(np.asarray(x[i:i + 32]))
                          for i in tqdm(range(0, len(x), 32), desc=f"{model.name[:40]} {split}")])
    np.save(path, out)
    return out


def ort_rates(models: dict[str, Path], x: np.ndarray, repeats: int = 7) -> dict[str, float]:
    """Images/s of onnxruntime alone, 1 intra-op thread, one batch of 16, calls alternating;
    ratio of median call times against the first model."""
    import onnxruntime as ort

    sess = {}
    for name, m in models.items():
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        sess[name] = ort.InferenceSession(str(m), so, providers=["CPUExecutionProvider"])
    batch = np.ascontiguousarray(x[:16])
    times: dict[str, list[float]] = {n: [] for n in sess}
    for s in sess.values():
        s.run(None, {"x": batch})
    for r in range(repeats):
        for n in (list(sess) if r % 2 == 0 else list(sess)[::-1]):
            t0 = time.perf_counter()
            sess[n].run(None, {"x": batch})
            times[n].append(time.perf_counter() - t0)
    base = float(np.median(times[next(iter(sess))]))
    return {n: base / float(np.median(t)) for n, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["lite1-gem4-224", "lite0+lite1-gem4"],
                    help="pretrained embedders (embedder.pretrained names); the first is the baseline")
    ap.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS))
    ap.add_argument("--no-int8", action="store_true", help="fp32 models only")
    ap.add_argument("--calibration", type=int, default=256,
                    help="cub-val images the int8 models are calibrated on (default 256)")
    ap.add_argument("--cub", type=Path, default=SHARED / "cub-dev" / "images")
    ap.add_argument("--caltech", type=Path, default=SHARED / "caltech101-dev" / "images")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("DAS_CACHE") or
                                                       Path.home() / ".cache" / "das-retrieval") / "pretrained-choice")
    ap.add_argument("--throughput", type=int, default=0, metavar="N",
                    help="also measure `indexer build` images/s on N cub-test photos (0: skip)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="Markdown file whose section to replace")
    return run_main(PROG, ap, argv, handler=lambda args: run(args, argv))


def run(args: argparse.Namespace, argv: list[str] | None) -> int | None:
    from embedder.metrics import evaluate
    from embedder.pretrained import parse_spec

    for t in args.variants:
        parse_spec(t)
    args.cache.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    val_files, _ = split_files("cub-val", args.cub, args.caltech)
    calib = val_files[:: max(1, len(val_files) // args.calibration)][:args.calibration]
    models: dict[str, Path] = {}
    for t in args.variants:
        models[t] = model_for(t, args.cache)
        if not args.no_int8:
            models[f"{t} int8"] = int8_model(t, args.cache, calib)
    results: dict[str, dict[str, dict[str, float]]] = {m: {} for m in models}
    for s in args.splits:
        files, labels = split_files(s, args.cub, args.caltech)
        x = arrays(s, files, models[args.variants[0]], args.cache)
        for name, path in models.items():
            e = embed(path, x, s, args.cache)
            parts = [(s, e, labels)]
            if s == "caltech-all":   # its last half of categories, as pretrained_choice reports
                test_files, test_labels = split_files("caltech-test", args.cub, args.caltech)
                pos = {f: i for i, f in enumerate(files)}
                parts.append(("caltech-test", e[[pos[f] for f in test_files]], test_labels))
            for split, emb, lab in parts:
                m = evaluate(emb, lab, map_r=True, clustering=False)
                results[name][split] = {k: 100 * v for k, v in m.items()}
                print(f"{name} {split}: R@1 {100 * m['R@1']:.2f} MAP@R {100 * m['MAP@R']:.2f}",
                      file=sys.stderr, flush=True)
    rates, ort_r = {}, {}
    if args.throughput:
        files, _ = split_files("cub-test", args.cub, args.caltech)
        pick = files[:: max(1, len(files) // args.throughput)][:args.throughput]
        x = arrays("cub-test", files, models[args.variants[0]], args.cache)
        ort_r = ort_rates(models, x)
        rates = ingest_rates(list(models), pick, args.cache, args.repeats, 32, models=models, bare=False)
    seconds = time.perf_counter() - t_start
    cmd = "python -m benchmarks.embedder.int8_embedder " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    base = args.variants[0]
    splits = [s for s in ("cub-val", "cub-test", "caltech-test", "caltech-all")
              if any(s in r for r in results.values())]
    lines = [SECTION, "", f"Command: `{cmd}` ({seconds / 60:.1f} min, load average "
             f"{os.getloadavg()[0]:.1f} at the end). R@1 / MAP@R in % (each image a query against "
             "the rest of its split); int8 = embedder.quantize calibrated on "
             f"{len(calib)} cub-val images; deltas against the same variant's fp32.", "",
             "| model | " + " | ".join(f"{s} R@1 | MAP@R" for s in splits) + " |",
             "| --- |" + " ---: | ---: |" * len(splits)]
    for name, res in results.items():
        fp = results.get(name.removesuffix(" int8"), {})
        cells = []
        for s in splits:
            if s not in res:
                cells += ["-", "-"]
                continue
            d = "" if name == name.removesuffix(" int8") else \
                (f" ({res[s]['R@1'] - fp[s]['R@1']:+.2f})", f" ({res[s]['MAP@R'] - fp[s]['MAP@R']:+.2f})")
            cells += [f"{res[s]['R@1']:.2f}{d[0] if d else ''}", f"{res[s]['MAP@R']:.2f}{d[1] if d else ''}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if rates:
        lines += ["", f"Speed against {base} fp32 (same run; `indexer build` on {args.throughput} "
                  f"cub-test photos, {args.repeats} repeats, order alternating, median of paired "
                  "ratios; wall = images/s, CPU = inverse CPU seconds per image; ORT 1 thread = "
                  "onnxruntime alone on a batch of 16 preprocessed images, calls alternating):", "",
                  "| model | `indexer build`, wall | `indexer build`, CPU | ORT alone, 1 thread |",
                  "| --- | ---: | ---: | ---: |"]
        for name, r in rates.items():
            lines.append(f"| {name} | {r['build_wall']:.2f}x | {r['build_cpu']:.2f}x | {ort_r[name]:.2f}x |")
    print("\n".join(lines))
    if args.out is not None:
        text = args.out.read_text() if args.out.is_file() else ""
        args.out.write_text(replace_section(text, lines))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
