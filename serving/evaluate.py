"""Recall@k for the Evaluate tab through ``indexer eval``'s own functions: the same numbers."""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

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
    """Recall@k on a labelled query folder (``indexer eval --queries``); unreadable files listed."""
    from indexer.layouts.evaluate import evaluate_queries

    snap = searcher.snapshot(index)
    out = evaluate_queries(snap.index, Path(folder), ks)
    skipped = [f"{s.get('path')}: {s.get('reason')}" for s in out.get("skipped", [])]
    return EvalResult(snap.name, source or Path(folder).name, out["recall"], int(out["queries"]), skipped)


def evaluate_gallery(searcher: Searcher, *, index: str | None = None, ks: Sequence[int] = DEFAULT_KS,
                     max_queries: int = 2000, seed: int = 0) -> EvalResult:
    """Leave-one-out Recall@k (``indexer eval`` without queries), with the stored vectors."""
    from indexer.layouts.evaluate import evaluate_gallery as leave_one_out

    snap = searcher.snapshot(index)
    out = leave_one_out(snap.index, ks, max_queries=max_queries, seed=seed)
    return EvalResult(snap.name, f"gallery leave-one-out ({out['queries']} queries)", out["recall"],
                      int(out["queries"]))


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
    ax.set(xlabel="k", ylabel="Recall@k (%)", ylim=(0, 102))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(results[0].source if results else "Recall@k", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
