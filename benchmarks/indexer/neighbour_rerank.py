"""Neighbourhood re-ranking at serve time: database-side augmentation (DBA, indexer.ann.neighbours)
and alpha query expansion, chosen on cub-dev validation species, reported on its test species and
on caltech101-dev (issue 30, item 3).

    python -m benchmarks.indexer.neighbour_rerank --splits cub-val            # the grid; choose here
    python -m benchmarks.indexer.neighbour_rerank --splits cub-val --seeds 10 \
        --grid-k 3 4 5 6 8 10 12 --grid-alpha 3 5 7 10 15                   # finer, 10 splits
    python -m benchmarks.indexer.neighbour_rerank --splits cub-val cub-test caltech-all caltech-test \
        --chosen --seeds 10 -k 8 --alpha 5                                  # report

Splits as benchmarks.embedder.pretrained_choice (species sorted by name: first half validation, second
half test; caltech101-dev all categories). Embeddings: the shipped default embedder, computed
once and cached under --cache (outside the repo). Two protocols per split:

* held-out: each class's photos shuffled (3 seeds) and halved; one half queries, the other half is
  the gallery (the DBA vectors are made from the gallery only); queries are never in the gallery;
* leave-one-out: every photo queries all the others; DBA vectors made from the whole split, with
  the guard of indexer.ann.neighbours.rerank (neighbours' augmented vectors rebuilt without the query)
  and, to show the inflation the guard removes, without it.

DBA is measured served as indexer serves it (plain top-``depth`` candidates re-ordered by their
augmented vectors) and as a full search over the augmented vectors; both are the code the index
runs (indexer.ann.neighbours). Alpha-QE (query + sim^alpha-weighted top-m gallery vectors, searched
again) is computed here: it is not shipped unless it pays on validation.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from embedder.cli import run_main

PROG = "python -m benchmarks.indexer.neighbour_rerank"

import numpy as np

from benchmarks.embedder.pretrained_choice import SHARED, split_files

SEEDS = (0, 1, 2)


def embed_split(name: str, cache: Path, batch_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings, labels) of a split by the default embedder, cached per file list."""
    import hashlib

    from embedder import OnnxEmbedder
    from embedder.pretrained import default_model_path

    files, labels = split_files(name, SHARED / "cub-dev" / "images", SHARED / "caltech101-dev" / "images")
    emb = OnnxEmbedder(default_model_path(), batch_size=batch_size)
    key = hashlib.sha256((emb.model_hash + "\n" + "\n".join(map(str, files))).encode()).hexdigest()[:16]
    path = cache / f"emb-default-{key}.npy"
    if path.is_file():
        return np.load(path), labels
    cache.mkdir(parents=True, exist_ok=True)
    x = emb.embed([str(f) for f in files], progress=True)
    np.save(path, x)
    return x, labels


# ---------------------------------------------------------------------------- rankings
def _ranked(scores: np.ndarray, depth: int) -> np.ndarray:
    """Columns of the top ``depth`` scores per row, best first."""
    depth = min(depth, scores.shape[1])
    part = np.argpartition(-scores, depth - 1, axis=1)[:, :depth]
    return np.take_along_axis(part, np.argsort(-np.take_along_axis(scores, part, 1), 1, kind="stable"), 1)


def metrics(ranked_labels: np.ndarray, q_labels: np.ndarray, r: np.ndarray) -> dict[str, float]:
    from embedder.metrics import map_at_r, recall_at_k

    rec = recall_at_k(ranked_labels, q_labels, [1, 2, 4, 8])
    return {**{f"R@{k}": 100 * float(v) for k, v in rec.items()},
            "MAP@R": 100 * map_at_r(ranked_labels, q_labels, r)}


def alpha_qe(q: np.ndarray, g: np.ndarray, m: int, alpha: float) -> np.ndarray:
    """q + sum of its top-m gallery vectors weighted sim^alpha, normalised."""
    s = q @ g.T
    top = _ranked(s, m)
    w = np.maximum(np.take_along_axis(s, top, 1), 0) ** alpha
    out = q + np.einsum("nm,nmd->nd", w, g[top])
    return (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)


def heldout(x: np.ndarray, y: np.ndarray, methods: dict, depth_out: int, seeds=SEEDS) -> dict:
    """Mean metrics over ``seeds`` of each method on half/half splits of every class."""
    from indexer.ann import neighbours as nbm

    out: dict[str, list[dict]] = {m: [] for m in methods}
    for seed in seeds:
        rng = np.random.default_rng(seed)
        qi, gi = [], []
        for c in np.unique(y):
            idx = rng.permutation(np.nonzero(y == c)[0])
            h = len(idx) // 2
            qi += idx[:h].tolist()
            gi += idx[h:].tolist()
        qi, gi = np.array(qi), np.array(gi)
        q, g, ql, gl = x[qi], x[gi], y[qi], y[gi]
        r = (gl[None, :] == ql[:, None]).sum(1)
        gids = np.arange(len(gi), dtype=np.int64)
        nbs: dict = {}
        for name, spec in methods.items():
            kind = spec["kind"]
            if kind == "plain":
                ranked = _ranked(q @ g.T, depth_out)
            elif kind == "qe":
                ranked = _ranked(alpha_qe(q, g, spec["m"], spec["alpha"]) @ g.T, depth_out)
            else:
                key = (spec["k"], spec["alpha"])
                if key not in nbs:
                    nbs[key] = nbm.build(gids, g, nbm.DbaParams(spec["k"], spec["alpha"]))
                nb = nbs[key]
                qq = alpha_qe(q, nb.aug, spec["m"], spec["alpha_qe"]) if spec.get("m") else q
                if kind == "dba-full":
                    ranked = _ranked(qq @ nb.aug.T, depth_out)
                else:       # served: plain top-depth candidates re-ordered
                    cand = _ranked(q @ g.T, spec["depth"])
                    ranked = nbm.rerank(nb, qq, cand, depth_out)[1]
            out[name].append(metrics(gl[ranked], ql, r))
    base = [v["R@1"] for v in out["plain"]]
    return {m: {**{k: float(np.mean([v[k] for v in vs])) for k in vs[0]},
                "R@1 - plain per split": [round(v["R@1"] - b, 2) for v, b in zip(vs, base)]}
            for m, vs in out.items()}


def leave_one_out(x: np.ndarray, y: np.ndarray, k: int, alpha: float, depth: int,
                  depth_out: int) -> dict:
    """Every item queries the rest: plain, DBA with the guard, DBA without it (inflated)."""
    from embedder.knn import drop_self
    from indexer.ann import neighbours as nbm

    ids = np.arange(len(x), dtype=np.int64)
    r = np.array([(y == c).sum() - 1 for c in y])
    plain = _ranked(x @ x.T, depth_out + 1)
    plain = drop_self(plain, ids, depth_out)[0]
    nb = nbm.build(ids, x, nbm.DbaParams(k, alpha, depth))
    cand = drop_self(_ranked(x @ x.T, depth + 1), ids, depth)[0]
    guarded = nbm.rerank(nb, x, cand, depth_out, exclude=ids.tolist(), vectors=lambda i: x[i])[1]
    unguarded = nbm.rerank(nb, x, cand, depth_out)[1]
    return {"plain": metrics(y[plain], y, r), "dba (guarded)": metrics(y[guarded], y, r),
            "dba (no guard: the query inside its neighbours' vectors)": metrics(y[unguarded], y, r)}


def grid(ks=(2, 3, 4, 5, 6, 8), alphas=(0.0, 1.0, 3.0, 5.0, 10.0), extras: bool = True) -> dict[str, dict]:
    """The methods tried on validation species."""
    g: dict[str, dict] = {"plain": {"kind": "plain"}}
    for k in ks:
        for a in alphas:
            g[f"dba k={k} a={a:g} full"] = {"kind": "dba-full", "k": k, "alpha": a}
    if not extras:
        return g
    for depth in (20, 50, 100):
        g[f"dba k=3 a=3 served depth={depth}"] = {"kind": "dba", "k": 3, "alpha": 3.0, "depth": depth}
    for m in (1, 2, 3, 5):
        for a in (1.0, 3.0):
            g[f"qe m={m} a={a:g}"] = {"kind": "qe", "m": m, "alpha": a}
    for m in (1, 2):
        g[f"dba k=3 a=3 + qe m={m} a=3 full"] = {"kind": "dba-full", "k": 3, "alpha": 3.0, "m": m, "alpha_qe": 3.0}
    return g


def chosen(k: int, alpha: float, depth: int) -> dict[str, dict]:
    return {"plain": {"kind": "plain"},
            f"dba k={k} a={alpha:g} served depth={depth}": {"kind": "dba", "k": k, "alpha": alpha, "depth": depth},
            f"dba k={k} a={alpha:g} full": {"kind": "dba-full", "k": k, "alpha": alpha},
            "qe m=1 a=3": {"kind": "qe", "m": 1, "alpha": 3.0},
            "qe m=2 a=3": {"kind": "qe", "m": 2, "alpha": 3.0}}


def table(title: str, res: dict, base: str = "plain") -> list[str]:
    split = any("R@1 - plain per split" in v for v in res.values())
    lines = [f"**{title}**", "", "| method | R@1 | R@2 | R@4 | R@8 | MAP@R | R@1 - plain | MAP@R - plain |"
             + (" R@1 - plain: splits better / worse, min .. max |" if split else ""),
             "| --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if split else "")]
    b = res[base]
    for m, v in res.items():
        d = v.get("R@1 - plain per split")
        extra = (f" {sum(x > 0 for x in d)} / {sum(x < 0 for x in d)}, {min(d):+.2f} .. {max(d):+.2f} |"
                 if d is not None else "")
        lines.append(f"| {m} | {v['R@1']:.2f} | {v['R@2']:.2f} | {v['R@4']:.2f} | {v['R@8']:.2f} | "
                     f"{v['MAP@R']:.2f} | {v['R@1'] - b['R@1']:+.2f} | {v['MAP@R'] - b['MAP@R']:+.2f} |" + extra)
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--splits", nargs="+", default=["cub-val"],
                    choices=["cub-val", "cub-test", "caltech-test", "caltech-all"])
    ap.add_argument("--grid", action="store_true", help="the whole grid (default on cub-val only)")
    ap.add_argument("--chosen", action="store_true",
                    help="only plain, the chosen -k/--alpha (served and full) and QE, on every split")
    ap.add_argument("-k", "--k", type=int, default=3)
    ap.add_argument("--alpha", type=float, default=3.0)
    ap.add_argument("--depth", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=len(SEEDS), help="held-out splits (default 3)")
    ap.add_argument("--grid-k", type=int, nargs="+", default=None, metavar="K",
                    help="only a DBA grid over these k (and --grid-alpha), full search")
    ap.add_argument("--grid-alpha", type=float, nargs="+", default=[0.0, 1.0, 3.0, 5.0, 10.0])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/das-neighbour-rerank"))
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return run_main(PROG, ap, argv, handler=lambda args: run(args, argv))


def run(args: argparse.Namespace, argv: list[str] | None) -> int | None:
    t0 = time.time()
    all_res: dict = {}
    lines: list[str] = []
    for s in args.splits:
        x, y = embed_split(s, args.cache)
        if args.grid_k:
            methods = grid(args.grid_k, args.grid_alpha, extras=False)
        else:
            methods = grid() if (args.grid or (s == "cub-val" and not args.chosen)) \
                else chosen(args.k, args.alpha, args.depth)
        depth_out = int(max(np.bincount(y))) + 8           # deep enough for MAP@R
        h = heldout(x, y, methods, depth_out, seeds=tuple(range(args.seeds)))
        loo = leave_one_out(x, y, args.k, args.alpha, args.depth, depth_out)
        all_res[s] = {"heldout": h, "leave_one_out": loo, "n": len(y), "classes": int(len(np.unique(y)))}
        lines += table(f"{s}: held-out halves ({len(y)} photos, {len(np.unique(y))} classes, "
                       f"mean of {args.seeds} splits)", h)
        lines += table(f"{s}: leave-one-out (DBA k={args.k}, alpha={args.alpha:g}, depth {args.depth})", loo)
    print("\n".join(lines))
    print(f"({time.time() - t0:.0f} s; command: python -m benchmarks.indexer.neighbour_rerank {' '.join(sys.argv[1:] if argv is None else argv)})")
    if args.json:
        args.json.write_text(json.dumps(all_res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
