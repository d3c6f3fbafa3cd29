"""Indexer benchmark: faiss index quality/speed on synthetic galleries, ingest throughput on real images.

Run from the repository root:

    python -m benchmarks.indexer.index_bench --out bench_out/indexer.md
    python -m benchmarks.indexer.index_bench --skip-synthetic --ingest-images 400 --out bench_out/indexer.md
    python -m benchmarks.indexer.index_bench --sizes '' --wide '' --skip-ingest \
        --autofaiss-python /tmp/afenv/bin/python --out bench_out/indexer.md

Without --out it prints only (bench_out/ is git-ignored); kept figures: docs/benchmarks/indexer.md.

The second form reruns only the ingest part and the third only the low-rank part; each replaces
only its own paragraph and tables in an existing ``--out`` file, keeping the other figures and
any hand-written notes. The Ray row
(one process vs ``indexer build --ray local --shards 2``) starts Ray, so it runs in a private
network namespace and, alone, replaces only its own section:

    unshare -n sh -c 'ip link set lo up && python -m benchmarks.indexer.index_bench --skip-synthetic \
        --skip-ingest --ray-images 400 --out bench_out/indexer.md'

Part 1 builds the index exactly as ``indexer build`` does (``indexer.ann.selection.build``: index
type chosen by measurement on a sample, search parameter tuned to recall@10 >= 0.95 vs exact on
held-out gallery vectors) on clustered synthetic unit vectors, then measures on 1000 fresh
queries (not gallery vectors): recall@10 vs exact search, and queries/s at the tuned setting
against an exact Flat index over the same vectors, searched in the same run. The low-rank part
does the same on vectors near a 16-dim subspace (harder: see ``low_rank``), at 100k and 1M x 128
and 1M x 512, with autofaiss's default index as a peer row when ``--autofaiss-python`` names a
Python that has autofaiss (a scratch environment, e.g. ``python -m venv /tmp/afenv &&
/tmp/afenv/bin/pip install autofaiss faiss-cpu numpy "pyarrow<18"``; not a project dependency). Part 2 times ``indexer build`` (walk, read, sha256, LMDB commits,
embedding, faiss) on an Omniglot subset against bare embedding of the same images with the same
onnxruntime embedder (``OnnxEmbedder.embed_iter``, same batch size and decode threads).
Ratios, not absolute numbers, are the result: the CPU here is shared.
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.inputs.low_rank import low_rank, low_rank_law
from embedder.cli import run_main

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.indexer.index_bench"


SPREAD = 1.2        # noise norm relative to the unit class centre: cosine to the centre ~0.64
CLASS_SIZE = 100    # images per class, as in a product or landmark gallery
CLASSES_PER_GROUP = 20


def class_centres(n: int, d: int, rng: np.random.Generator) -> np.ndarray:
    """Class centres grouped around coarser centres (related classes sit near each other).

    The structure does not depend on n, so 100k and 1M galleries are equally "clustered"
    and only the scale changes.
    """
    import faiss

    n_classes = max(10, n // CLASS_SIZE)
    groups = rng.normal(size=(max(2, n_classes // CLASSES_PER_GROUP), d)).astype(np.float32)
    faiss.normalize_L2(groups)
    jitter = rng.normal(size=(n_classes, d)).astype(np.float32)
    faiss.normalize_L2(jitter)
    centres = groups[rng.integers(0, len(groups), n_classes)] + 0.8 * jitter
    faiss.normalize_L2(centres)
    return centres


def clustered(n: int, d: int, seed: int, centres: np.ndarray) -> np.ndarray:
    """Unit vectors scattered around class ``centres``: embedding galleries cluster by content.

    Isotropic noise alone would make every neighbour equally far and no index could beat a scan.
    """
    import faiss

    rng = np.random.default_rng(seed)
    out = np.empty((n, d), dtype=np.float32)
    for s in range(0, n, 200_000):
        m = min(200_000, n - s)
        out[s:s + m] = centres[rng.integers(0, len(centres), m)] + rng.normal(
            scale=SPREAD / np.sqrt(d), size=(m, d)).astype(np.float32)
    faiss.normalize_L2(out)
    return out


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def qps(index, q: np.ndarray, k: int = 10, min_seconds: float = 1.0) -> float:
    done, t0 = 0, time.perf_counter()
    while True:
        index.search(q, k)
        done += len(q)
        el = time.perf_counter() - t0
        if el >= min_seconds:
            return done / el


def synthetic(n: int, d: int, seed: int = 0, nq: int = 1000) -> dict:
    import faiss

    from indexer.ann import faiss_index, selection, tuning

    rng = np.random.default_rng(seed)
    centres = class_centres(n, d, rng)
    x = clustered(n, d, seed + 1, centres)
    q = clustered(nq, d, seed + 2, centres)
    ids = np.sort(rng.choice(2 ** 53, size=n, replace=False)).astype(np.int64)
    t0 = time.perf_counter()
    index, fields = selection.build(ids, x, device="cpu")
    build = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        faiss_index.write_atomic(index, Path(tmp) / "i.faiss")
        size = (Path(tmp) / "i.faiss").stat().st_size
    flat = faiss.IndexFlatIP(d)
    flat.add(x)
    t0 = time.perf_counter()
    truth = ids[flat.search(q, 10)[1]]          # exact answers, and Flat's speed on them
    q_flat = len(q) / (time.perf_counter() - t0)
    recall = tuning.recalls(index.search(q, 10)[1], truth).mean()
    q_ivf = qps(index, q)
    row = {"n": n, "d": d, "index": f"{fields['index_type']} {fields['factory']} ({fields['search_params'] or 'exact'})",
           "build_s": build, "train_s": fields["train_seconds"], "index_mib": size / 2 ** 20,
           "rss_gib": rss_gib(), "tuned_recall": fields["recall_at_10"], "recall": recall,
           "qps": q_ivf, "flat_qps": q_flat, "speedup": q_ivf / q_flat}
    del index, flat, x
    gc.collect()
    return row


# low-rank galleries: benchmarks/inputs/low_rank.py


def timed_batches(searches: dict, rounds: int = 3, per_round: dict | None = None) -> dict:
    """Median seconds per batch for each named search, interleaved round by round so that a
    burst of load from other jobs hits all of them alike."""
    times: dict[str, list[float]] = {k: [] for k in searches}
    for _ in range(rounds):
        for name, fn in searches.items():
            for _ in range((per_round or {}).get(name, 1)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


AUTOFAISS_SCRIPT = r"""
import json, sys, time
import numpy as np, faiss
from autofaiss import build_index
faiss.omp_set_num_threads(2)
x = np.load(sys.argv[1])
t0 = time.perf_counter()
index, info = build_index(embeddings=x, save_on_disk=False, metric_type="ip", nb_cores=2, verbose=30)
build = time.perf_counter() - t0
faiss.write_index(index, sys.argv[2])
print(json.dumps({"build_s": build, "index_key": info.get("index_key"),
                  "index_param": info.get("index_param"), "version": __import__("autofaiss").__version__
                  if hasattr(__import__("autofaiss"), "__version__") else ""}))
"""


def autofaiss_build(python: str, x: np.ndarray, tmp: Path, timeout: float) -> tuple[object, dict] | dict:
    """autofaiss's default index for ``x``, built in its own environment (not a dependency of
    this project): (faiss index, info), or {"error": ...} if it could not run."""
    import subprocess

    import faiss

    np.save(tmp / "x.npy", x)
    try:
        p = subprocess.run([python, "-c", AUTOFAISS_SCRIPT, str(tmp / "x.npy"), str(tmp / "af.index")],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"autofaiss did not finish in {timeout:.0f} s"}
    except OSError as e:
        return {"error": f"{python}: {e}"}
    finally:
        (tmp / "x.npy").unlink(missing_ok=True)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]}
    info = __import__("json").loads(p.stdout.strip().splitlines()[-1])
    index = faiss.read_index(str(tmp / "af.index"))
    if info.get("index_param"):
        faiss.ParameterSpace().set_index_parameters(index, info["index_param"])
    return index, info


def lowrank(n: int, d: int, seed: int = 0, nq: int = 1000, autofaiss_python: str | None = None,
            autofaiss_timeout: float = 900) -> list[dict]:
    """Rows for one low-rank gallery: ours (``selection.build``, as ``indexer build``) and, if given,
    autofaiss's default; Flat's queries/s measured in the same rounds as each index's."""
    import faiss

    from indexer.ann import selection, tuning

    faiss.omp_set_num_threads(2)
    law = low_rank_law(d, seed)
    x = low_rank(n, law, seed + 1)
    q = low_rank(nq, law, seed + 2)          # fresh queries: not gallery vectors
    ids = np.sort(np.random.default_rng(seed).choice(2 ** 53, size=n, replace=False)).astype(np.int64)
    load0 = os.getloadavg()[0]
    truth = ids[faiss.knn(q, x, 10, metric=faiss.METRIC_INNER_PRODUCT)[1]]   # exact, no copy of x
    flat = lambda: faiss.knn(q, x, 10, metric=faiss.METRIC_INNER_PRODUCT)   # noqa: E731
    rows = []
    if autofaiss_python:
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
            res = autofaiss_build(autofaiss_python, x, Path(tmp), autofaiss_timeout)
        if isinstance(res, dict):
            rows.append({"n": n, "d": d, "who": "autofaiss default", "index": res["error"]})
        else:
            index, info = res
            found = index.search(q, 10)[1]           # autofaiss numbers vectors 0..n-1
            recall = tuning.recalls(np.where(found >= 0, ids[np.maximum(found, 0)], -1), truth).mean()
            t = timed_batches({"flat": flat, "index": lambda: index.search(q, 10)}, per_round={"index": 5})
            rows.append({"n": n, "d": d, "who": "autofaiss default",
                         "index": f"{info['index_key']} ({info['index_param']})", "build_s": info["build_s"],
                         "heldout": None, "recall": recall, "qps": nq / t["index"], "flat_qps": nq / t["flat"],
                         "speedup": t["flat"] / t["index"], "index_mib": faiss.serialize_index(index).size / 2 ** 20})
            del index
    gc.collect()
    t0 = time.perf_counter()
    index, fields = selection.build(ids, x, device="cpu", progress=False)
    build = time.perf_counter() - t0
    recall = tuning.recalls(index.search(q, 10)[1], truth).mean()
    t = timed_batches({"flat": flat, "index": lambda: index.search(q, 10)}, per_round={"index": 5})
    chosen = f"{fields['index_type']} {fields['factory']} ({fields['search_params'] or 'exact'})"
    rows.append({"n": n, "d": d, "who": "ours (indexer build)", "index": chosen, "build_s": build,
                 "selection_s": fields.get("selection_seconds"), "heldout": fields["recall_at_10"],
                 "recall": recall, "qps": nq / t["index"], "flat_qps": nq / t["flat"],
                 "speedup": t["flat"] / t["index"], "index_mib": faiss.serialize_index(index).size / 2 ** 20,
                 "rss_gib": rss_gib(), "load": f"{load0:.1f} -> {os.getloadavg()[0]:.1f}",
                 "candidates": fields.get("candidates", [])})
    del index, x
    gc.collect()
    return rows


LOWRANK_HEAD = "Low-rank synthetic unit vectors"
CLUSTERED_END = "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"


def replace_clustered_section(text: str, section: list[str]) -> str:
    """``text`` with its heading, command and clustered table replaced by ``section``."""
    lines = text.rstrip("\n").split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith("## Indexer")), None)
    if start is None:
        return "\n".join(section + [""] + lines) + "\n"
    end = next(i for i in range(start, len(lines)) if lines[i] == CLUSTERED_END) + 1
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + section + lines[end:]) + "\n"


def replace_lowrank_section(text: str, section: list[str]) -> str:
    """``text`` with its low-rank paragraph and tables replaced by ``section`` (inserted before
    the ingest paragraph if absent); everything else is kept."""
    lines = text.rstrip("\n").split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(LOWRANK_HEAD)), None)
    if start is None:
        at = next((i for i, line in enumerate(lines) if line.startswith((INGEST_HEAD, "Notes"))),
                  len(lines))
        return "\n".join(lines[:at] + section + [""] + lines[at:]) + "\n"
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].startswith((INGEST_HEAD, "Notes", "## "))), len(lines))
    return "\n".join(lines[:start] + section + [""] + lines[end:]) + "\n"


def lowrank_section(rows: list[dict], cmd: str, seconds: float) -> list[str]:
    """The low-rank table (ours vs autofaiss, each against Flat in the same rounds) and, per
    gallery, the candidates our selection measured on its sample."""
    from indexer.ann.selection import SAMPLE_CAP

    lines = [LOWRANK_HEAD + " (near a 16-dim subspace: 1000 overlapping clusters there, "
             "noise off it; see `low_rank`); 1000 fresh queries in one batch; recall@10 against exact "
             "search; 2 threads (`faiss.omp_set_num_threads(2)`); queries/s the median of interleaved "
             "batches, Flat's measured in the same rounds. Command: "
             f"`{cmd}` ({seconds / 60:.1f} min).", "",
             "| n | d | who | index (search parameters) | build s | recall@10 held-out / fresh "
             "| queries/s | Flat queries/s | speed-up | index MiB | load avg |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "qps" not in r:
            lines.append(f"| {r['n']:,} | {r['d']} | {r['who']} | {r['index']} | - | - | - | - | - | - | - |")
            continue
        held = f"{r['heldout']:.3f}" if r.get("heldout") is not None else "-"
        build = f"{r['build_s']:.1f}" + (f" (choice {r['selection_s']:.1f})" if r.get("selection_s") else "")
        lines.append(f"| {r['n']:,} | {r['d']} | {r['who']} | {r['index']} | {build} | {held} / "
                     f"{r['recall']:.3f} | {r['qps']:,.0f} | {r['flat_qps']:,.0f} | {r['speedup']:.1f}x | "
                     f"{r['index_mib']:.0f} | {r.get('load', '')} |")
    for r in rows:
        if r.get("candidates"):
            lines += ["", f"Candidates measured for {r['n']:,} x {r['d']} (on a sample of at most "
                      f"{SAMPLE_CAP // 1000}k; Flat's queries/s scaled to the gallery for the ranking):", "",
                      "| type | factory (sample) | search parameters | recall@10 | queries/s | MiB (gallery) | build s | |",
                      "|---|---|---|---:|---:|---:|---:|---|"]
            for c in r["candidates"]:
                mark = "chosen" if c["chosen"] else ("misses target" if not c["meets_target"] else "")
                lines.append(f"| {c['index_type']} | {c['sample_factory']} | {c['search_params'] or 'exact'} | "
                             f"{c['recall_at_10']:.3f} | {c['rank_qps']:,.0f} | {c['memory_bytes'] / 2 ** 20:,.0f} | "
                             f"{c['build_seconds']:.1f} | {mark} |")
    return lines


def copy_omniglot(n_images: int, gallery: Path) -> Path:
    """The first ``n_images`` Omniglot glyphs (sorted) copied into ``gallery``, folders kept."""
    root = Path(os.environ.get("DAS_OMNIGLOT", REPO.parent / "shared" / "data" / "omniglot")) / "images_background"
    for f in sorted(root.rglob("*.png"))[:n_images]:
        dst = gallery / f.relative_to(root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst)
    return gallery


def ingest(n_images: int, model: Path, label: str, batch_size: int = 32, workers: int = 2,
           repeats: int = 2) -> dict:
    """Best-of-``repeats`` throughput: indexer build vs bare embedding of the same files."""
    from embedder import OnnxEmbedder

    from indexer import build_index

    tmp = Path(tempfile.mkdtemp(prefix="index-bench-"))
    try:
        gallery = copy_omniglot(n_images, tmp / "gallery")
        files = sorted(gallery.rglob("*.png"))
        emb = OnnxEmbedder(model, batch_size=batch_size)
        for _ in emb.embed_iter(((i, f) for i, f in enumerate(files[:64])), workers=workers):
            pass   # warm up the session and the page cache
        bare, built = [], []
        for r in range(repeats):
            t0 = time.perf_counter()
            n = sum(len(k) for k, _, _ in emb.embed_iter(((i, f) for i, f in enumerate(files)), workers=workers))
            bare.append(n / (time.perf_counter() - t0))
            out = tmp / f"idx{r}"
            t0 = time.perf_counter()
            m = build_index(gallery, out, model, batch_size=batch_size, workers=workers, progress=False,
                            embedder=emb)
            built.append(m["count"] / (time.perf_counter() - t0))
        return {"model": label, "images": len(files), "bare_ips": max(bare), "build_ips": max(built),
                "ratio": max(built) / max(bare)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ray_vs_single(n_images: int, model: Path, label: str, shards: int = 2, repeats: int = 2) -> dict:
    """Best-of-``repeats`` wall time: `indexer build` in one process vs `indexer build --ray
    local --shards 2` (Ray tasks + merge) on the same Omniglot files, fresh output each time.

    Ray starts once (its start-up is reported apart); the first Ray run also pays for starting
    the worker processes, which later runs reuse, as a long build on a cluster would.
    Must run inside a private network namespace (Ray listens beyond loopback).
    """
    import ray

    from indexer import build_index
    from indexer.build.ray_build import build_with_ray
    from indexer.ray.cluster import connect, only_loopback

    if not only_loopback():
        raise SystemExit("--ray-images starts Ray, which listens beyond loopback: run inside a private "
                         "network namespace, e.g. unshare -n sh -c 'ip link set lo up && python "
                         "benchmarks/indexer/index_bench.py ...'")
    tmp = Path(tempfile.mkdtemp(prefix="ray-bench-"))
    try:
        gallery = copy_omniglot(n_images, tmp / "gallery")
        t0 = time.perf_counter()
        connect("local", num_cpus=os.cpu_count())
        t_init = time.perf_counter() - t0
        single, distributed, attempts = [], [], []
        try:
            for r in range(repeats):
                t0 = time.perf_counter()
                m1 = build_index(gallery, tmp / f"single{r}", model, workers=2, progress=False)
                single.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                m2 = build_with_ray(gallery, tmp / f"ray{r}", model, address=None, shards=shards,
                                    progress=False)
                distributed.append(time.perf_counter() - t0)
                attempts.append(m2["ray"]["attempts"])
                assert m1["count"] == m2["count"], (m1["count"], m2["count"])
        finally:
            ray.shutdown()
        return {"model": label, "images": m1["count"], "shards": shards, "single_s": min(single),
                "ray_s": min(distributed), "ratio": min(single) / min(distributed),
                "ray_first_s": distributed[0], "init_s": t_init, "per_task_cpus": m2["ray"]["num_cpus"],
                "single_ips": m1["count"] / min(single), "ray_ips": m2["count"] / min(distributed)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


RAY_HEAD = "Ray build: `indexer build --ray local --shards"


def ray_section(rows: list[dict], cmd: str, seconds: float, repeats: int) -> list[str]:
    """The Ray paragraph and table (replaced on its own by a rerun with only --ray-images)."""
    lines = [RAY_HEAD + f" {rows[0]['shards']}` (one Ray task per shard, each `--shard i/n` on "
             f"{rows[0]['per_task_cpus']} CPU, then `merge`) vs one `indexer build` process (2 decode "
             f"threads, onnxruntime on all cores), same Omniglot files, fresh output each run; best of "
             f"{repeats}, runs interleaved, inside `unshare -n`. Command: `{cmd}` ({seconds / 60:.1f} min, "
             f"load average {os.getloadavg()[0]:.1f} at the end).", "",
             "| embedder | images | single process s (img/s) | Ray s (img/s) | single / Ray | first Ray run s "
             "| Ray start-up s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['images']} | {r['single_s']:.1f} ({r['single_ips']:.0f}) | "
                     f"{r['ray_s']:.1f} ({r['ray_ips']:.0f}) | {r['ratio']:.2f}x | {r['ray_first_s']:.1f} | "
                     f"{r['init_s']:.1f} |")
    return lines


def replace_section(text: str, head: str, section: list[str]) -> str:
    """``text`` with the paragraph starting ``head`` and its table replaced (appended if absent)."""
    lines = text.rstrip("\n").split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(head)), None)
    if start is None:
        return "\n".join(lines + [""] + section) + "\n"
    end = start + 1
    while end < len(lines) and not lines[end].startswith("|"):
        end += 1
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + section + lines[end:]) + "\n"


def small_model(path: Path) -> Path:
    import torch

    from embedder import Embedder, EmbedderConfig, export_onnx

    torch.manual_seed(0)
    return export_onnx(Embedder(EmbedderConfig(backbone="small_cnn", dim=64)).eval(), path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100000,1000000", help="synthetic gallery sizes at d=128")
    ap.add_argument("--wide", default="100000", help="sizes also run at d=512 ('' to skip)")
    ap.add_argument("--ingest-images", type=int, default=800, help="Omniglot images for the ingest part")
    ap.add_argument("--ingest-repeats", type=int, default=2,
                    help="best of this many interleaved bare/build runs per embedder (the CPU is shared)")
    ap.add_argument("--skip-ingest", action="store_true")
    ap.add_argument("--skip-synthetic", action="store_true",
                    help="run only the ingest part; with --out, replace only the ingest section of "
                         "an existing file")
    ap.add_argument("--ray-images", type=int, default=0, metavar="N",
                    help="also time `indexer build --ray local --shards 2` against one process on N "
                         "Omniglot images (EfficientNet-Lite0; small_cnn on 4N); needs Ray and a private "
                         "network namespace. Alone (with --skip-synthetic --skip-ingest) and --out, it "
                         "replaces only its section of an existing file")
    ap.add_argument("--lowrank", default="100000x128,1000000x128,1000000x512",
                    help="low-rank synthetic galleries, NxD comma-separated ('' to skip)")
    ap.add_argument("--autofaiss-python", default=None, metavar="PYTHON",
                    help="python of a scratch environment with autofaiss installed (not a project "
                         "dependency), e.g. /tmp/afenv/bin/python: adds autofaiss's default as a peer row")
    ap.add_argument("--autofaiss-timeout", type=float, default=900, help="seconds per autofaiss build")
    ap.add_argument("--out", type=Path, default=None, help="write the Markdown section here")
    return run_main(PROG, ap, argv, handler=lambda args: run(args, argv))


def run(args: argparse.Namespace, argv: list[str] | None) -> int | None:
    try:
        import torch

        torch.set_num_threads(2)
    except ImportError:
        pass
    t_start = time.perf_counter()
    rows = []
    plan = [(int(s), 128) for s in args.sizes.split(",") if s] + [(int(s), 512) for s in args.wide.split(",") if s]
    if args.skip_synthetic:
        plan = []
    for n, d in sorted(plan, key=lambda p: p[0] * p[1]):
        print(f"synthetic {n} x {d} ...", flush=True)
        rows.append(synthetic(n, d))
        print("  ", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    lr_rows: list[dict] = []
    for spec in ([] if args.skip_synthetic else [p for p in args.lowrank.split(",") if p]):
        n, d = (int(v) for v in spec.lower().split("x"))
        print(f"low-rank {n} x {d} ...", flush=True)
        lr_rows += lowrank(n, d, autofaiss_python=args.autofaiss_python,
                           autofaiss_timeout=args.autofaiss_timeout)
        for r in lr_rows[-2:]:
            print("  ", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                         if k != "candidates"}, flush=True)
    ing = []
    if not args.skip_ingest:
        from embedder import default_model_path

        with tempfile.TemporaryDirectory() as tmp:
            small = small_model(Path(tmp) / "small.onnx")
            print("ingest small_cnn ...", flush=True)
            ing.append(ingest(args.ingest_images * 4, small, "small_cnn 64-d (28 px)",
                              repeats=args.ingest_repeats))
            print("  ", ing[-1], flush=True)
        print("ingest default EfficientNet-Lite0 ...", flush=True)
        ing.append(ingest(args.ingest_images, default_model_path(), default_label(),
                          repeats=args.ingest_repeats))
        print("  ", ing[-1], flush=True)
    ray_rows = ray_rows_for(args.ray_images, args.ingest_repeats) if args.ray_images else []
    total = time.perf_counter() - t_start

    cmd = "python -m benchmarks.indexer.index_bench " + shlex.join(sys.argv[1:])
    if ray_rows and not rows and not ing:
        text = "\n".join(ray_section(ray_rows, cmd, total, args.ingest_repeats)) + "\n"
        if args.out and args.out.exists():
            text = replace_section(args.out.read_text(), RAY_HEAD, ray_section(ray_rows, cmd, total,
                                                                               args.ingest_repeats))
        print(text)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        return
    lines = ["## Indexer (`benchmarks/indexer/index_bench.py`)", "", f"Command: `{cmd}` "
             f"({total / 60:.1f} min, 2 shared CPU cores, faiss {__import__('faiss').__version__}).", "",
             "Clustered synthetic unit vectors; 1000 fresh queries (not gallery vectors); recall@10 "
             "against exact search; queries/s for batches of 1000 queries, same run, same cores.", "",
             "| n | d | index | build s (k-means s) | index MiB | peak RSS GiB | recall@10 (held-out / fresh queries) "
             "| queries/s | Flat queries/s | speed-up |",
             CLUSTERED_END]
    for r in rows:     # (the table's last header line is CLUSTERED_END)
        lines.append(f"| {r['n']:,} | {r['d']} | {r['index']} | {r['build_s']:.1f} ({r['train_s']:.1f}) | "
                     f"{r['index_mib']:.0f} | {r['rss_gib']:.1f} | {r['tuned_recall']:.3f} / {r['recall']:.3f} | "
                     f"{r['qps']:,.0f} | {r['flat_qps']:,.0f} | {r['speedup']:.1f}x |")
    if lr_rows:
        lines += [""] + lowrank_section(lr_rows, cmd, total)
    if ing:
        lines += [""] + ingest_section(ing, cmd if not rows else None, total, args.ingest_repeats)
    if ray_rows:
        lines += [""] + ray_section(ray_rows, cmd, total, args.ingest_repeats)
    text = "\n".join(lines) + "\n"
    partial = not (rows and lr_rows and ing)
    if partial and (rows or ing or lr_rows) and args.out and args.out.exists():
        text = args.out.read_text()         # a partial run replaces only its own sections
        if rows:
            text = replace_clustered_section(text, lines[:lines.index(CLUSTERED_END) + 1 + len(rows)])
        if lr_rows:
            text = replace_lowrank_section(text, lowrank_section(lr_rows, cmd, total))
        if ing:
            text = replace_ingest_section(text, ingest_section(ing, cmd, total, args.ingest_repeats))
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


def default_label() -> str:
    """How the tables name the default pretrained embedder (it changed in issue 23)."""
    from embedder.pretrained import DEFAULT, PRETRAINED

    return f"default embedder {DEFAULT} ({PRETRAINED[DEFAULT].backbone}, 1280-d)"


def ray_rows_for(n_images: int, repeats: int) -> list[dict]:
    """The Ray rows: EfficientNet-Lite0 on ``n_images``, small_cnn on 4x as many."""
    from embedder import default_model_path

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        small = small_model(Path(tmp) / "small.onnx")
        print("ray vs single, small_cnn ...", flush=True)
        out.append(ray_vs_single(n_images * 4, small, "small_cnn 64-d (28 px)", repeats=repeats))
        print("  ", out[-1], flush=True)
    print("ray vs single, EfficientNet-Lite0 ...", flush=True)
    out.append(ray_vs_single(n_images, default_model_path(), default_label(),
                             repeats=repeats))
    print("  ", out[-1], flush=True)
    return out


INGEST_HEAD = "Ingest: `indexer build` end to end"


def ingest_section(ing: list[dict], cmd: str | None, seconds: float, repeats: int = 2) -> list[str]:
    """The ingest paragraph and table (with its own command line when run on its own)."""
    run = f" Command: `{cmd}` ({seconds / 60:.1f} min)." if cmd else ""
    lines = [INGEST_HEAD + " (walk, read + sha256 + header + decode from the same bytes, LMDB "
             "commits, embedding, faiss, manifest) vs bare `OnnxEmbedder.embed_iter` on the same "
             f"Omniglot files, same batch size (32) and decode threads (2); best of {repeats}, "
             "bare and build runs interleaved." + run, "",
             "| embedder | images | bare embedding img/s | indexer build img/s | ratio |",
             "|---|---:|---:|---:|---:|"]
    for r in ing:
        lines.append(f"| {r['model']} | {r['images']} | {r['bare_ips']:.0f} | {r['build_ips']:.0f} | "
                     f"{100 * r['ratio']:.0f}% |")
    return lines


def replace_ingest_section(text: str, section: list[str]) -> str:
    """``text`` with its ingest paragraph + table replaced by ``section`` (appended if absent).

    Everything else (the synthetic table, notes written by hand) is kept as it is.
    """
    lines = text.rstrip("\n").split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(INGEST_HEAD)), None)
    if start is None:
        return "\n".join(lines + [""] + section) + "\n"
    end = start + 1
    while end < len(lines) and not lines[end].startswith("|"):      # blank line(s) before the table
        end += 1
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + section + lines[end:]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
