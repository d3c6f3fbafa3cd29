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
    """``recall`` as the index serves by default (``dba``); an index with DBA also has ``other``
    (the other setting, same queries) and ``dba_z`` (McNemar's z of DBA against plain at R@1):
    DBA's sign flips between galleries, so the tab shows both, as `indexer eval` does."""

    index: str
    source: str
    recall: dict[int, float]
    queries: int
    skipped: list[str] = field(default_factory=list)
    dba: bool = False
    other: dict[int, float] | None = None
    dba_z: float | None = None
    weakest: list[tuple[str, float, int]] = field(default_factory=list)   # (label, R@1, queries)
    suggested: dict | None = None     # how often the suggested label was right (indexer eval's "suggested")

    @classmethod
    def of(cls, index: str, source: str, out: dict, skipped: Sequence[str] = ()) -> "EvalResult":
        """From ``indexer.layouts.evaluate``'s answer."""
        from indexer.layouts.evaluate import weakest

        return cls(index, source, out["recall"], int(out["queries"]), list(skipped), bool(out["dba"]),
                   out.get("recall_plain" if out["dba"] else "recall_dba"), out.get("dba_z"),
                   weakest(out["per_label"]), out.get("suggested"))

    def rows(self) -> list[dict[str, object]]:
        """A row per DBA setting measured, the served one first."""
        settings = [(self.dba, self.recall)] + ([] if self.other is None else [(not self.dba, self.other)])
        return [{"index": self.index, "DBA": "on" if dba else "off", "queries": self.source, "n": self.queries,
                 **{f"R@{k}": round(100 * v, 2) for k, v in rec.items()}} for dba, rec in settings]


def evaluate_folder(searcher: Searcher, folder: str | Path, *, index: str | None = None,
                    ks: Sequence[int] = DEFAULT_KS, source: str | None = None) -> EvalResult:
    """Recall@k on a labelled query folder (``indexer eval --queries``); unreadable files listed."""
    from indexer.layouts.evaluate import evaluate_queries

    snap = searcher.snapshot(index)
    out = evaluate_queries(snap.index, Path(folder), ks)
    skipped = [f"{s.get('path')}: {s.get('reason')}" for s in out.get("skipped", [])]
    return EvalResult.of(snap.name, source or Path(folder).name, out, skipped)


def evaluate_gallery(searcher: Searcher, *, index: str | None = None, ks: Sequence[int] = DEFAULT_KS,
                     max_queries: int = 2000, seed: int = 0) -> EvalResult:
    """Leave-one-out Recall@k (``indexer eval`` without queries), with the stored vectors."""
    from indexer.layouts.evaluate import evaluate_gallery as leave_one_out

    snap = searcher.snapshot(index)
    out = leave_one_out(snap.index, ks, max_queries=max_queries, seed=seed)
    left = [f"{out[k]} {what}" for k, what in (("lone", "alone in their label"), ("unlabelled", "unlabelled"))
            if out.get(k)]
    return EvalResult.of(snap.name, f"gallery leave-one-out ({out['queries']} queries"
                         + (f"; not queried: {', '.join(left)})" if left else ")"), out)


def dba_line(results: Sequence[EvalResult]) -> str:
    """McNemar's z of DBA against plain at R@1 for each index with DBA, in words; "" if none."""
    from indexer.layouts.evaluate import dba_verdict

    z = [(r.index, r.dba_z) for r in results if r.dba_z is not None]
    return ("DBA against plain at R@1, same queries: " + "; ".join(
        f"{name} McNemar z {v:+.2f} ({dba_verdict(v)})" for name, v in z)) if z else ""


def recall_figure(results: Sequence[EvalResult]) -> bytes:
    """A PNG of Recall@k curves, one line per index (Agg backend, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
    for r in results:
        ks = sorted(r.recall)
        line, = ax.plot(ks, [100 * r.recall[k] for k in ks], marker="o",
                        label=f"{r.index} ({r.queries} q)" + (f", DBA {'on' if r.dba else 'off'}" if r.other else ""))
        if r.other:                                       # the other DBA setting: dashed, same colour
            ax.plot(ks, [100 * r.other[k] for k in ks], marker="o", ls="--", color=line.get_color(),
                    label=f"{r.index}, DBA {'off' if r.dba else 'on'}")
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
