"""Where DAS puts its copies, measured: copy-to-source distances against the embedding's own
intra-/inter-class distances, and what the distance-weighted sampler then draws.

    python -m benchmarks.training.das_geometry --root ../shared/data/caltech101-dev/images

Embeddings: the frozen EfficientNet-Lite0 features of the training classes through the
untrained PCA head (d = 128, L2), i.e. a realistic point cloud; class-balanced batches (2 per
class) go through DAS exactly as in training (bank and FRM warmed on `--warmup` batches first).
For each DAS setting it prints: the median distance of a copy to its source, the median
distance between the two real members of a class (intra) and from an embedding to its nearest
other-class embedding in the batch (inter); how often a copy lies nearer to another class than
to its own source's class partner; and, for the authors' distance-weighted sampler, the share
of drawn positives that are the anchor's own copies, of drawn negatives that are copies, and
the median anchor-negative distance with and without DAS. A figure (PNG) shows the distances.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from embedder.cli import run_main

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.training.das_geometry"

SETTINGS = {
    "paper (r_s = r_b = 0.01)": {},
    "r_s = 0.5": {"das_scale_range": 0.5},
    "r_b = 1": {"das_shift_scale": 1.0},
    "factors U[0.5, 2], r_b = 0.1 (SOP scripts)": {"das_scale_bounds": [0.5, 2.0],
                                                   "das_shift_scale": 0.1},
    "factors U[0.5, 2], r_b = 1": {"das_scale_bounds": [0.5, 2.0], "das_shift_scale": 1.0},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--root", required=True, help="class-folder dataset or Omniglot root")
    p.add_argument("--batches", type=int, default=40, help="measured batches")
    p.add_argument("--warmup", type=int, default=40, help="batches that fill bank and FRM first")
    p.add_argument("--out", default=str(REPO / "bench_out" / "das_geometry"))
    return p


def measure(emb_all, labels_all, das_opts: dict, batches: int, warmup: int, seed: int = 0) -> dict:
    import numpy as np
    import torch

    from training import ClassBalancedBatchSampler, build_miner, load_config
    from training.step import build_das

    n_cls = int(labels_all.max()) + 1
    cfg = load_config(None, {"dim": emb_all.shape[1], "seed": seed, **das_opts})
    das = build_das(cfg, n_cls, True)
    sampler = ClassBalancedBatchSampler(labels_all, batch_size=2 * min(56, n_cls), per_class=2,
                                        seed=seed)
    miner = build_miner("distance", "authors", generator=torch.Generator().manual_seed(seed))
    stats: dict[str, list] = {k: [] for k in ("copy", "intra", "inter", "nearer_other",
                                              "own_pos", "copy_neg", "d_an_das", "d_an_base")}
    done = 0
    for epoch in range(1000):
        sampler.set_epoch(epoch)
        for batch in sampler:
            idx = torch.as_tensor(batch)
            v, y = emb_all[idx], labels_all[idx]
            out, lab = das(v, y)
            done += 1
            if done <= warmup:
                continue
            b = len(idx)
            origin = torch.arange(len(lab)) % b
            d = torch.cdist(out, out)
            same = lab[:, None] == lab[None, :]
            real = torch.arange(len(lab)) < b
            copy_d = d[torch.arange(b, len(lab)), origin[b:]]
            stats["copy"] += copy_d.tolist()
            partner = (same & ~torch.eye(len(lab), dtype=torch.bool) & real[None, :])[:b]
            stats["intra"] += d[:b][partner].tolist()
            other = (~same & real[None, :])[:b]
            nearest_other = torch.where(other, d[:b], torch.inf).amin(1)
            stats["inter"] += nearest_other.tolist()
            # a copy nearer to some other class's real embedding than to its own class partner
            d_copy = d[b:]
            own_partner = torch.where(same[b:] & real[None, :] & (origin[None, :] != origin[b:, None]),
                                      d_copy, torch.inf).amin(1)
            other_real = torch.where(~same[b:] & real[None, :], d_copy, torch.inf).amin(1)
            stats["nearer_other"] += (other_real < own_partner).float().tolist()
            t = miner(out, lab)
            stats["own_pos"] += (origin[t.anchors] == origin[t.positives])[real].float().tolist()
            stats["copy_neg"] += (t.negatives >= b).float().tolist()
            stats["d_an_das"] += d[t.anchors, t.negatives][real].tolist()
            tb = miner(v, y)
            stats["d_an_base"] += torch.cdist(v, v)[tb.anchors, tb.negatives].tolist()
            if done >= warmup + batches:
                return {k: np.asarray(x) for k, x in stats.items()}
    raise RuntimeError("not enough batches")


def main(argv=None) -> int:
    return run_main(PROG, build_parser(), argv, handler=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from benchmarks.training.frozen_features import frozen_splits, pca_head

    torch.set_num_threads(1)
    train, _ = frozen_splits(args.root, progress=False)
    head = pca_head(train, 128)
    with torch.no_grad():
        emb = head(torch.from_numpy(train.features))
    labels = torch.from_numpy(train.labels)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, results = [], {}
    for name, opts in SETTINGS.items():
        s = measure(emb, labels, opts, args.batches, args.warmup)
        results[name] = s
        rows.append(f"| {name} | {np.median(s['copy']):.4f} | {np.median(s['intra']):.3f} | "
                    f"{np.median(s['inter']):.3f} | {100 * s['nearer_other'].mean():.1f}% | "
                    f"{100 * s['own_pos'].mean():.1f}% | {100 * s['copy_neg'].mean():.1f}% | "
                    f"{np.median(s['d_an_das']):.3f} | {np.median(s['d_an_base']):.3f} |")
    text = "\n".join([
        f"DAS geometry on {args.root} (training classes, PCA-128 head on frozen features, "
        f"{args.batches} batches after {args.warmup} warm-up batches):", "",
        "| DAS setting | copy-source median | intra-class median | nearest other class median | "
        "copies nearer another class | own-copy positives | copy negatives | d(a, n) DAS | "
        "d(a, n) base |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, ""])
    print(text)
    (out / "geometry.md").write_text(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    bins = np.linspace(0, 1.6, 81)
    first = next(iter(results.values()))
    ax.hist(first["intra"], bins, alpha=0.4, label="intra-class (real pairs)", density=True)
    ax.hist(first["inter"], bins, alpha=0.4, label="nearest other class", density=True)
    for name, s in results.items():
        ax.hist(s["copy"], bins, histtype="step", lw=1.5, label=f"copy-source: {name}", density=True)
    ax.set_xlabel("Euclidean distance on the unit sphere")
    ax.set_yscale("log")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "geometry.png", dpi=110)
    print(f"figure: {out / 'geometry.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
