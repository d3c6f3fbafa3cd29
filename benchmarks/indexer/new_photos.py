"""What the engine says of photos a gallery does not hold: "no close match" (``Index.answer(...)
.novelty``, indexer.ann.new_photos.novelty) and the suggested label (indexer.suggest_label).
A gallery of 70% of each class of one half of a set, built by ``indexer build`` (the default: DBA
from 256 photos), queried with three kinds of photo:

- **held**: the other 30% of the same classes (new photos of known classes: a flag is a false
  alarm; the p-value's promise is P(p <= a) <= a for them; the suggested label should be theirs);
- **unseen**: photos of the set's other half (classes the gallery lacks: birds among birds);
- **off-domain**: photos of another set (Caltech for CUB, CUB for Caltech).

    python -m benchmarks.indexer.new_photos --data cub --half val      # settings chosen on the val halves
    python -m benchmarks.indexer.new_photos --data caltech --half test  # reported on the others

Prints the share flagged at p <= 0.01 / 0.05 per kind, the AUROC of the nearest cosine (held vs
each other kind), the held photos' label accuracy (first hit's label, the vote of 10 hits; the
vote at a share >= 0.9: coverage, accuracy), and writes a PNG of the three kinds' nearest
cosines against the threshold.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.audit_faults import DATA, _images, class_names
from embedder.cli import run_main

SETS = {"cub": "cub-dev", "caltech": "caltech101-dev"}
OTHER = {"cub": "caltech", "caltech": "cub"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.indexer.new_photos", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", choices=sorted(SETS), default="cub")
    p.add_argument("--half", choices=("val", "test"), default="val", help="the classes the gallery holds")
    p.add_argument("--queries", type=int, default=400, help="unseen and off-domain photos, each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, default=None,
                   help="an ONNX embedder for the build (default: indexer build's own choice)")
    p.add_argument("--out", type=Path, default=Path("bench_out/new_photos"), help="JSON and PNG go here")
    return p


def auroc(neg: np.ndarray, pos: np.ndarray) -> float:
    """P(a pos score < a neg score) + half the ties: pos are the novel ones, lower is more novel."""
    from scipy.stats import mannwhitneyu

    return float(mannwhitneyu(neg, pos).statistic / (len(neg) * len(pos)))


def run(args: argparse.Namespace) -> int:
    from indexer import NOVEL_P, Index, suggest_label

    root = DATA / SETS[args.data] / "images"
    names = class_names(root)
    mine, others = (names[:len(names) // 2], names[len(names) // 2:]) if args.half == "val" else \
        (names[len(names) // 2:], names[:len(names) // 2])
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="new-photos-"))
    held: list[Path] = []
    for c in mine:
        fs = _images(root / c)
        rng.shuffle(fs)
        cut = int(0.7 * len(fs))
        (work / "gallery" / c).mkdir(parents=True)
        for f in fs[:cut]:
            (work / "gallery" / c / f.name).symlink_to(f)
        held += fs[cut:]
    unseen = [f for c in others for f in _images(root / c)]
    oroot = DATA / SETS[OTHER[args.data]] / "images"
    off = [f for c in class_names(oroot) for f in _images(oroot / c)]
    kinds = {"held": held, "unseen": rng.sample(unseen, min(args.queries, len(unseen))),
             "off-domain": rng.sample(off, min(args.queries, len(off)))}
    subprocess.run([sys.executable, "-m", "indexer", "build", str(work / "gallery"), "--out", str(work / "index"),
                    *(["--model", str(args.model)] if args.model else [])],
                   check=True, stdout=sys.stderr)
    res: dict = {"data": args.data, "half": args.half, "NOVEL_P": NOVEL_P}
    near: dict[str, np.ndarray] = {}
    with Index.open(work / "index") as idx:
        if not idx.has_dba:
            raise SystemExit("the gallery was built without DBA neighbourhoods: no novelty")
        res["gallery"] = len(idx)
        for kind, files in kinds.items():
            found = idx.answer(idx.embed([str(f) for f in files]), 1, dba=False)
            near[kind], p = found.scores[:, 0], found.novelty
            res[kind] = {"queries": len(files), "flagged@0.01": float(np.mean(p <= 0.01)),
                         "flagged@0.05": float(np.mean(p <= 0.05)), "median_nearest": float(np.median(near[kind]))}
        ref = idx.neighbours.nearest
        found = idx.answer(idx.embed([str(f) for f in held]), 10)      # as served: DBA, 10 hits
        truth = [f.parent.name for f in held]
        first, votes = [], []
        for s, i, p in zip(found.scores, found.ids, found.novelty):
            hits = idx.hits(s, i)
            first.append(hits[0].label)
            votes.append(suggest_label([h.label for h in hits], [h.score for h in hits], p))
        right = np.array([v is not None and v[0] == t for v, t in zip(votes, truth)])
        sure = np.array([v is not None and v[1] >= 0.9 for v in votes])
        res["labels"] = {"first_hit": float(np.mean([a == t for a, t in zip(first, truth)])),
                         "vote": float(right.mean()), "vote>=0.9_coverage": float(sure.mean()),
                         "vote>=0.9_accuracy": float(right[sure].mean())}
    for kind in ("unseen", "off-domain"):
        res[kind]["auroc"] = auroc(near["held"], near[kind])
    print(json.dumps(res, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (f"new-photos-{args.data}-{args.half}" + ("" if args.model is None else f"-{args.model.stem}"))
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    bins = np.linspace(min(float(v.min()) for v in near.values()), 1.0, 50)
    ax.hist(ref, bins, density=True, histtype="step", color="k", label="gallery's own nearest (reference)")
    for kind, v in near.items():
        ax.hist(v, bins, density=True, alpha=0.45, label=f"{kind}: {100 * res[kind]['flagged@0.01']:.1f}% flagged")
    ax.axvline(float(np.quantile(ref, NOVEL_P)), color="r", ls="--", label=f"p = {NOVEL_P:g}")
    ax.set_xlabel("cosine to the nearest gallery image")
    ax.set_title(f"no close match: {args.data}-{args.half} gallery of {res['gallery']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    print(f"-> {stem}.json, {stem}.png", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main("python -m benchmarks.indexer.new_photos", build_parser(), argv, handler=run)


if __name__ == "__main__":
    sys.exit(main())
