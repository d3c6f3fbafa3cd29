"""Recall@k of an open index, for the Evaluate tab: on a labelled query folder (through the
indexer's eval function), or leave-one-out on the gallery itself (each gallery image queries the
rest, the paper's protocol).

The metric is embedder.metrics' Recall@k, the same function training and the indexer use, so
the number here matches theirs for the same embeddings.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from .searcher import Searcher

DEFAULT_KS: tuple[int, ...] = (1, 2, 4, 8)


@dataclass
class EvalResult:
    index: str
    source: str
    recall: dict[int, float]
    queries: int
    skipped: list[str] = field(default_factory=list)

    def row(self) -> dict[str, object]:
        return {"index": self.index, "queries": self.source, "n": self.queries,
                **{f"R@{k}": round(100 * v, 2) for k, v in self.recall.items()}}


def evaluate_folder(searcher: Searcher, folder: str | Path, *, index: str | None = None,
                    ks: Sequence[int] = DEFAULT_KS, source: str | None = None) -> EvalResult:
    """Recall@k on a labelled query folder, by the indexer's own ``indexer eval`` function (so the
    app and the CLI report the same number; a query whose exact bytes are in the gallery is
    left out of its own results there). Unreadable files are skipped and listed."""
    from indexer.evaluate import evaluate_queries

    index = index or searcher.default
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"ks: expected positive integers, got {ks}")
    out = evaluate_queries(searcher.index(index), Path(folder), ks)
    skipped = [f"{s.get('path')}: {s.get('reason')}" for s in out.get("skipped", [])]
    return EvalResult(index, source or Path(folder).name, out["recall"], int(out["queries"]), skipped)


def evaluate_gallery(searcher: Searcher, *, index: str | None = None, ks: Sequence[int] = DEFAULT_KS,
                     max_queries: int = 2000, seed: int = 0) -> EvalResult:
    """Leave-one-out Recall@k: each (sampled) labelled gallery image queries the rest."""
    index = index or searcher.default
    ks = sorted({int(k) for k in ks})
    from embedder.metrics import recall_at_k_of_labels

    idx = searcher.index(index)
    ids = [i for lab in idx.labels() for i in idx.ids_for_label(lab)]
    if not ids:
        raise ValueError(f"index {index!r}: the gallery has no labels to evaluate against")
    rng = np.random.default_rng(seed)
    if len(ids) > max_queries:
        ids = sorted(rng.choice(ids, size=max_queries, replace=False).tolist())
    rows = searcher.nearest(idx.embeddings(ids), max(ks), index=index, exclude=ids)
    recall = recall_at_k_of_labels([[r.label for r in row] for row in rows],
                                   [idx.meta(i).get("label") for i in ids], ks)
    return EvalResult(index, f"gallery leave-one-out ({len(ids)} queries)",
                      {int(k): float(v) for k, v in recall.items()}, len(ids))


def recall_figure(results: Sequence[EvalResult]) -> bytes:
    """A PNG of Recall@k curves, one line per index (Agg backend, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
    for r in results:
        ks = sorted(r.recall)
        ax.plot(ks, [100 * r.recall[k] for k in ks], marker="o", label=f"{r.index} ({r.queries} q)")
    ax.set_xscale("log", base=2)
    ks_all = sorted({k for r in results for k in r.recall})
    ax.set_xticks(ks_all, [str(k) for k in ks_all])
    ax.set_xlabel("k")
    ax.set_ylabel("Recall@k (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(results[0].source if results else "Recall@k", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
