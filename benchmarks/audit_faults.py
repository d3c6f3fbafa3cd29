"""Issue 42 item 4: the gallery audit on galleries with injected faults, scored.

A gallery of symlinks to real photos (read in place, in a temp dir) with, disjoint from each
other: 2% of the labels flipped to another class; 2% of the photos copied resized (0.5x),
re-encoded (JPEG q25) or cropped (central 85%), each copy beside its original; 1% photos of
another dataset put into random classes. It is indexed with ``python -m indexer build`` (default
settings), audited with ``python -m indexer audit`` (default settings), and scored:

- mislabelled: precision among the top N flagged (N = flipped), share of flipped in the top 2N;
- near-duplicates: recall of the injected (original, copy) pairs (both in one group) and
  precision of the reported pairs (an edge joining an original and its copy);
- outliers: share of the off-domain photos in the top 2x their number.

    nice -n 10 python -m benchmarks.audit_faults --data cub --half val --grid     # choose defaults
    nice -n 10 python -m benchmarks.audit_faults --data cub --half test           # report
    nice -n 10 python -m benchmarks.audit_faults speed --n 1000000 --dim 128      # 1M x 128 synthetic
    python -m benchmarks.audit_faults copies --data cub --half val                 # indexer search --copies

``copies``: the half without 60 of its photos is indexed; the queries are 60 copies of gallery
photos (the three kinds in turn) and the 60 held out (new photos of the same classes), searched
with ``indexer search FOLDER --copies -k 5``: recall (the copy's original among its hits, marked)
and every other mark, counted as wrong (held-out queries included).

Validation classes: the first half of each dataset's classes (natural order); report: the other
half. ``--keep DIR`` leaves the gallery, the index and the audit there (``--tools`` then scores
fastdup / imagededup outputs written by ``benchmarks/audit_tools_run.py`` in their own venv).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("DAS_DATA", REPO.parent / "shared" / "data"))
OTHER = {"cub": "caltech101-dev", "caltech": "omniglot"}     # off-domain photos for each


def class_names(root: Path) -> list[str]:
    return sorted((d.name for d in root.iterdir() if d.is_dir()),
                  key=lambda s: [int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", s)])


def _images(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png") and p.is_file())


def make_gallery(data: str, half: str, out: Path, seed: int = 0, flip: float = 0.02, copies: float = 0.02,
                 offdomain: float = 0.01) -> dict:
    """Build the injected gallery in ``out``; the truth as relative paths."""
    root = DATA / {"cub": "cub-dev", "caltech": "caltech101-dev"}[data] / "images"
    names = class_names(root)
    names = names[:len(names) // 2] if half == "val" else names[len(names) // 2:]
    rng = random.Random(seed)
    files = [(c, f) for c in names for f in _images(root / c)]
    n = len(files)
    order = list(range(n))
    rng.shuffle(order)
    nf, nc, no = round(flip * n), round(copies * n), round(offdomain * n)
    flipped, copied = set(order[:nf]), order[nf:nf + nc]
    truth: dict = {"flipped": {}, "copies": [], "offdomain": [], "images": n}
    for i, (c, f) in enumerate(files):
        label = c
        if i in flipped:
            label = rng.choice([x for x in names if x != c])
        d = out / label
        d.mkdir(parents=True, exist_ok=True)
        name = f.name if label == c else f"flip_{c}_{f.name}"
        (d / name).symlink_to(f)
        if i in flipped:
            truth["flipped"][f"{label}/{name}"] = c
    kinds = ("resized", "reencoded", "cropped")
    for j, i in enumerate(copied):
        c, f = files[i]
        kind = kinds[j % 3]
        rel = f"{c}/copy_{kind}_{f.stem}.jpg"
        copy_of(f, out / rel, kind)
        truth["copies"].append([f"{c}/{f.name}", rel, kind])
    other_root = DATA / OTHER[data]
    pool = _images(other_root / ("images" if data == "cub" else "images_background"))
    for f in rng.sample(pool, no):
        label = rng.choice(names)
        rel = f"{label}/ood_{f.parent.name}_{f.name}"
        (out / rel).symlink_to(f)
        truth["offdomain"].append(rel)
    truth["classes"] = names
    return truth


def copy_of(src: Path, dst: Path, kind: str) -> None:
    """A resized (0.5x, q90), re-encoded (q25) or cropped (central 85%, q90) JPEG copy."""
    from PIL import Image

    im = Image.open(src).convert("RGB")
    if kind == "resized":
        im = im.resize((im.width // 2, im.height // 2), Image.BICUBIC)
    elif kind == "cropped":
        dx, dy = round(im.width * 0.075), round(im.height * 0.075)
        im = im.crop((dx, dy, im.width - dx, im.height - dy))
    im.save(dst, format="JPEG", quality=25 if kind == "reencoded" else 90)


def copies(args: argparse.Namespace) -> None:
    import csv

    root = DATA / {"cub": "cub-dev", "caltech": "caltech101-dev"}[args.data] / "images"
    names = class_names(root)
    names = names[:len(names) // 2] if args.half == "val" else names[len(names) // 2:]
    files = [(c, f) for c in names for f in _images(root / c)]
    rng = random.Random(args.seed)
    picked = rng.sample(range(len(files)), 2 * args.n)
    held, copied = set(picked[:args.n]), picked[args.n:]
    work = Path(tempfile.mkdtemp(prefix="copies-"))
    gal, q, idx = work / "gallery", work / "queries", work / "index"
    q.mkdir(parents=True)
    kinds = ("resized", "reencoded", "cropped")
    truth = {}
    for i, (c, f) in enumerate(files):
        if i in held:
            (q / f"new_{c}_{f.name}").symlink_to(f)
            continue
        (gal / c).mkdir(parents=True, exist_ok=True)
        (gal / c / f.name).symlink_to(f)
    for j, i in enumerate(copied):
        c, f = files[i]
        name = f"copy_{kinds[j % 3]}_{c}_{f.stem}.jpg"
        copy_of(f, q / name, kinds[j % 3])
        truth[name] = f"{c}/{f.name}"
    run([sys.executable, "-m", "indexer", "build", str(gal), "--out", str(idx), "--quiet"])
    t0 = time.perf_counter()
    run([sys.executable, "-m", "indexer", "search", str(q), "--index", str(idx), "-k", "5", "--copies",
         "--out", str(work / "r.csv"), "--quiet"])
    ts = time.perf_counter() - t0
    with open(work / "r.csv") as fh:
        rows = list(csv.DictReader(fh))
    marked = {(r["query"], r["path"]) for r in rows if r["copy"] == "True"}
    found = {k: [] for k in kinds}
    for name, orig in truth.items():
        found[name.split("_")[1]].append((name, orig) in marked)
    right = sum(v for f in found.values() for v in f)
    print(json.dumps({"data": args.data, "half": args.half, "gallery": len(files) - args.n, "queries": 2 * args.n,
                      "recall": right / len(truth), "by_kind": {k: sum(v) / len(v) for k, v in found.items()},
                      "marks": len(marked), "wrong_marks": len(marked) - right,
                      "wrong": sorted(m for m in marked if truth.get(m[0]) != m[1]),
                      "precision": right / max(len(marked), 1), "search_s": round(ts, 1)}, indent=1))


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p


def phash(path: Path) -> np.ndarray:
    """A 63-bit DCT perceptual hash (the classic pHash): the benchmark's independent judge of
    whether two photos the audit grouped that were not injected are the same photo already
    (CUB holds some: crops and frames of one shot)."""
    from PIL import Image
    from scipy.fft import dctn

    im = Image.open(path).convert("L").resize((32, 32), Image.LANCZOS)
    d = dctn(np.asarray(im, dtype=np.float64), norm="ortho")[:8, :8].ravel()[1:]
    return d > np.median(d)


PHASH_SAME = 12         # bits of 63: at most this many differ -> the same photo
#: the judge of the pairs the audit reported that were not injected, by eye (2026-11-29, each pair side
#: by side, doubtful ones at full size): per gallery, "a|b" (dataset paths, sorted) -> "same" (one
#: picture, maybe cropped, resized, recoloured, captioned or mirrored), "scene" (another frame or view of
#: one object or scene: a render turning, a burst, a plane taxiing), "different", or "unsure" (Caltech's
#: catalogue motorbikes: one studio photo recoloured, or another model in the same pose, not told apart
#: at 268 px). It holds every pair the audit, fastdup and imagededup report on the four galleries
#: (the tools' 267 catalogue-motorbike pairs set `unsure` unseen); others fall back to the pHash judge.
PAIRS = json.loads((Path(__file__).with_name("audit_pairs.json")).read_text())


def pair_key(gallery: Path, a: str, b: str) -> str:
    return "|".join(sorted("/".join(Path(os.path.realpath(gallery / x)).parts[-2:]) for x in (a, b)))


def score(audit_dir: Path, truth: dict, gallery: Path | None = None, judged: dict | None = None) -> dict:
    """The three goals' figures from the audit's JSONL files (as a user would read them).
    ``judged``: the eye labels of the gallery's pairs (``PAIRS[name]``): precision counts an
    injected pair or one labelled "same" right; ``precision_scene`` also "scene"; "unsure" pairs
    are counted wrong, and right in ``precision_unsure_right``."""
    def rows(kind: str) -> list[dict]:
        f = audit_dir / f"{kind}.jsonl"
        return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []

    out: dict = {}
    flipped = set(truth["flipped"])
    N = len(flipped)
    mis = [r["path"] for r in rows("mislabelled")]
    hit = [p in flipped for p in mis]
    sugg = {r["path"]: r.get("suggested") for r in rows("mislabelled")}
    out["mislabelled"] = {"flipped": N, "precision_at_N": sum(hit[:N]) / N, "found_in_2N": sum(hit[:2 * N]) / N,
                          "suggested_right": sum(sugg.get(p) == t for p, t in truth["flipped"].items()
                                                 if p in mis[:2 * N]) / max(1, sum(hit[:2 * N]))}
    pairs = {frozenset((a, b)) for a, b, _ in truth["copies"]}
    groups = rows("duplicates")
    group_of = {it["path"]: g["group"] for g in groups for it in g["items"]}
    id_path = {it["id"]: it["path"] for g in groups for it in g["items"]}
    found = [group_of.get(a) is not None and group_of.get(a) == group_of.get(b) for a, b, _ in truth["copies"]]
    edges = [frozenset((id_path[p["a"]], id_path[p["b"]])) for g in groups for p in g["pairs"]]
    good = [e in pairs for e in edges]
    same = [False] * len(edges)
    if gallery is not None:
        same = [not ok and int((phash(gallery / a) != phash(gallery / b)).sum()) <= PHASH_SAME
                for e, ok in zip(edges, good) for a, b in [sorted(e)]]
    eye: list[str | None] = [None] * len(edges)
    if gallery is not None and judged is not None:
        eye = [None if ok else judged.get(pair_key(gallery, *sorted(e))) for e, ok in zip(edges, good)]
    n = max(1, len(good))
    by_eye = {f"precision_{name}": sum(g or (s if lab is None else lab in ok) for g, s, lab in zip(good, same, eye)) / n
              for name, ok in (("scene", ("same", "scene")), ("unsure_right", ("same", "unsure")))}
    same = [s if lab is None else lab == "same" for s, lab in zip(same, eye)]
    out["duplicates"] = {"injected": len(pairs), "recall": sum(found) / len(pairs),
                         "precision": (sum(g or s for g, s in zip(good, same)) / len(good)) if good else 1.0,
                         **(by_eye if judged is not None else {}),
                         "eye_labels": {k: eye.count(k) for k in ("same", "scene", "different", "unsure", None)}
                         if judged is not None else None,
                         "precision_injected_only": (sum(good) / len(good)) if good else 1.0,
                         "already_in_dataset": [sorted(e) for e, s in zip(edges, same) if s],
                         "reported_pairs": len(edges),
                         "by_kind": {k: sum(f for f, (_, _, kk) in zip(found, truth["copies"]) if kk == k)
                                     / max(1, sum(kk == k for *_, kk in truth["copies"])) for k in ("resized", "reencoded", "cropped")},
                         "false_pairs": [sorted(e) for e, ok, s in zip(edges, good, same) if not ok and not s][:10]}
    ood = set(truth["offdomain"])
    ranked = [r["path"] for r in rows("outliers")]
    out["outliers"] = {"injected": len(ood), "found_in_2x": sum(p in ood for p in ranked[:2 * len(ood)]) / len(ood)}
    return out


def goals(s: dict) -> dict:
    return {"mislabelled": s["mislabelled"]["precision_at_N"] >= 0.85 and s["mislabelled"]["found_in_2N"] >= 0.90,
            "duplicates": s["duplicates"]["recall"] >= 0.95 and s["duplicates"]["precision"] >= 0.95,
            "outliers": s["outliers"]["found_in_2x"] >= 0.90}


def grid(index: Path, truth: dict, work: Path) -> list[dict]:
    """Settings tried on a validation gallery (library calls on one opened index)."""
    from indexer.audit import open_gallery, run_audit, write_audit

    g = open_gallery(index)
    res = []
    for k in (5, 10, 20):
        for share in (0.0, 0.25, 0.5, 0.75):
            for ct in (0.02, 0.05):
                for thr in (0.85, 0.9, 0.93, 0.95):
                    for cw in (0.0, 1.0, 2.0):
                        import indexer.audit.outliers as O

                        O.CLASS_WEIGHT = cw
                        a = run_audit(g, k=k, threshold=thr, centroid_share=share, centroid_temp=ct)
                        write_audit(a, work / "grid", top=100000, sheets=False)
                        s = score(work / "grid", truth, work / "gallery")
                        res.append({"k": k, "centroid_share": share, "centroid_temp": ct, "threshold": thr,
                                    "class_weight": cw, **{f"{a}.{b}": v for a in ("mislabelled", "duplicates", "outliers")
                                                           for b, v in s[a].items() if isinstance(v, float)}})
    return res


def faults(args: argparse.Namespace) -> None:
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="audit-faults-"))
    gal, idx, out = work / "gallery", work / "index", work / "audit"
    if not gal.exists():
        truth = make_gallery(args.data, args.half, gal, args.seed)
        (work / "truth.json").write_text(json.dumps(truth, indent=1))
    truth = json.loads((work / "truth.json").read_text())
    t0 = time.perf_counter()
    if not (idx / "manifest.json").exists():
        run([sys.executable, "-m", "indexer", "build", str(gal), "--out", str(idx), "--quiet"])
    tb = time.perf_counter() - t0
    t0 = time.perf_counter()
    run([sys.executable, "-m", "indexer", "audit", "--index", str(idx), "--out", str(out), "--quiet",
         "--top", "100000"])
    ta = time.perf_counter() - t0
    s = score(out, truth, gal, PAIRS.get(f"{args.data}-{args.half}"))
    res = {"data": args.data, "half": args.half, "seed": args.seed, "images": truth["images"],
           "gallery": len(_images(gal)), "build_s": round(tb, 1), "audit_s": round(ta, 1), **s, "goals": goals(s)}
    if args.grid:
        rows = grid(idx, truth, work)
        (work / "grid.json").write_text(json.dumps(rows, indent=1))
        res["grid_file"] = str(work / "grid.json")
    print(json.dumps(res, indent=1))


def speed(args: argparse.Namespace) -> None:
    """The audit of n synthetic labelled vectors (Gaussian classes on the sphere, 2% of the
    labels flipped): the graph from an IVF-Flat index with the indexer's nlist (4 sqrt(n) to a
    power of two) and the smallest nprobe reaching recall@10 >= 0.95 against exact search on
    1,000 queries (as the build tunes it). Wall and process CPU seconds of the audit alone (the
    index is the build's); on a loaded machine CPU / cores is the figure to read."""
    import faiss

    from indexer.audit import source
    from indexer.audit.run import run_audit

    rng = np.random.default_rng(0)
    n, d, C = args.n, args.dim, args.classes
    centers = rng.standard_normal((C, d)).astype(np.float32)
    true = rng.integers(0, C, n).astype(np.int32)
    x = centers[true] + args.noise * rng.standard_normal((n, d)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    codes = true.copy()
    flip = rng.choice(n, n // 50, replace=False)
    codes[flip] = (codes[flip] + rng.integers(1, C, len(flip))) % C
    ids = np.arange(n, dtype=np.int64) * 7 + 3
    t0 = time.perf_counter()
    nlist = int(2 ** round(np.log2(4 * np.sqrt(n))))
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
    ivf.train(x[rng.choice(n, min(n, 39 * nlist), replace=False)])
    ivf.add_with_ids(x, ids)
    q = x[rng.choice(n, 1000, replace=False)]
    _, exact = faiss.knn(q, x, 10, metric=faiss.METRIC_INNER_PRODUCT)
    exact = ids[exact]
    for nprobe in (4, 8, 16, 32, 64, 128):
        ivf.nprobe = nprobe
        _, got = ivf.search(q, 10)
        recall = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, exact)]))
        if recall >= 0.95:
            break
    t_index = time.perf_counter() - t0

    class Mem(source.Gallery):
        def chunks(self, size=65_536):
            for s in range(0, n, size):
                yield s, x[s:s + size]

        def search(self, q, k):
            return ivf.search(q, k)

        def identical_files(self):
            return {}                   # synthetic vectors have no files

    class FakeIndex:
        directory, dim = Path("synthetic"), d

        class manifest:
            index_type = "ivf"

    g = Mem(FakeIndex(), ids, [f"c{i}" for i in range(C)], codes, True, np.argsort(ids))
    t0, c0 = time.perf_counter(), time.process_time()
    a = run_audit(g, k=10, verify=False)        # synthetic vectors have no images to check
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    from indexer.audit.duplicates import candidates

    band = len(candidates(a.graph, a.threshold)[0])   # what the pixel check would have to check
    N = len(flip)
    top = a.mislabelled(2 * N)
    isflip = np.zeros(n, bool)
    isflip[flip] = True
    print(json.dumps({"n": n, "dim": d, "classes": C, "nlist": nlist, "nprobe": nprobe, "recall_at_10": recall,
                      "index_build_s": round(t_index, 1), "audit_wall_s": round(wall, 1), "audit_cpu_s": round(cpu, 1),
                      "stages_wall_s": {k: round(v, 1) for k, v in a.seconds.items()},
                      "threads": faiss.omp_get_max_threads(), "load_avg": os.getloadavg(),
                      "pixel_check_band": band, "flipped": N, "mislabelled_precision_at_N": float(isflip[top[:N]].mean()),
                      "mislabelled_found_in_2N": float(isflip[top].sum() / N),
                      "peak_rss_mib": _peak_rss_mib()}, indent=1))


def pixels(args: argparse.Namespace) -> None:
    """The pixel check of an index's uncertain band on one thread and on ``--workers`` (default:
    the CPUs), alternating ``--repeats`` times: wall seconds each, their ratio, and that the
    verdicts are the same."""
    from indexer.audit import open_gallery
    from indexer.audit.duplicates import candidates, verify_pairs
    from indexer.audit.graph import build_graph

    g = open_gallery(args.index)
    a, b, _, _ = candidates(build_graph(g, 10))
    a, b = a[:args.max_pairs], b[:args.max_pairs]
    secs: dict[str, list[float]] = {"1 thread": [], "threads": []}
    verdicts = {}
    for _ in range(args.repeats):
        for name, workers in (("1 thread", 1), ("threads", args.workers)):
            t0 = time.perf_counter()
            verdicts[name] = verify_pairs(a, b, g.image_bytes, workers=workers)
            secs[name].append(time.perf_counter() - t0)
    same = all(np.array_equal(getattr(verdicts["1 thread"], f), getattr(verdicts["threads"], f), equal_nan=True)
               for f in ("inliers", "overlap", "differ", "same"))
    ratios = [x / y for x, y in zip(secs["1 thread"], secs["threads"])]
    print(json.dumps({"index": str(args.index), "pairs": len(a), "workers": args.workers or os.cpu_count(),
                      "wall_s": {k: [round(v, 1) for v in vs] for k, vs in secs.items()},
                      "speedup_median": round(float(np.median(ratios)), 2), "same_verdicts": same,
                      "confirmed": int(verdicts["threads"].same.sum()), "load_avg": os.getloadavg()}, indent=1))


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    from embedder.cli import run_main

    p = argparse.ArgumentParser(prog="python -m benchmarks.audit_faults", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    f = sub.add_parser("faults")
    f.add_argument("--data", choices=("cub", "caltech"), default="cub")
    f.add_argument("--half", choices=("val", "test"), default="val")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--keep", default=None, help="work folder (kept; reused when it exists)")
    f.add_argument("--grid", action="store_true", help="also try settings (validation half only)")
    f.set_defaults(func=faults)
    s = sub.add_parser("speed")
    s.add_argument("--n", type=int, default=1_000_000)
    s.add_argument("--dim", type=int, default=128)
    s.add_argument("--classes", type=int, default=1000)
    s.add_argument("--noise", type=float, default=1.0, help="per-dimension noise around the class centres")
    s.set_defaults(func=speed)
    x = sub.add_parser("pixels", help="the pixel check on 1 thread vs several (same verdicts)")
    x.add_argument("--index", type=Path, required=True)
    x.add_argument("--workers", type=int, default=None)
    x.add_argument("--repeats", type=int, default=3)
    x.add_argument("--max-pairs", type=int, default=5000)
    x.set_defaults(func=pixels)
    c = sub.add_parser("copies", help="indexer search --copies: injected copies and new photos as queries")
    c.add_argument("--data", choices=("cub", "caltech"), default="cub")
    c.add_argument("--half", choices=("val", "test"), default="val")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--n", type=int, default=60, help="copies, and as many new photos (default 60)")
    c.set_defaults(func=copies)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("faults", "speed", "pixels", "copies", "-h", "--help"):
        argv = ["faults", *argv]
    return run_main("audit_faults", p, argv)


if __name__ == "__main__":
    sys.exit(main())
