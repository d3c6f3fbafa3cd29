"""The run report: metrics table (Markdown + JSON), loss / R@1 curves, FRM heatmap (PNG)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

METRIC_ORDER = ("R@1", "R@2", "R@4", "R@8", "R@10", "R@100", "R@1000", "NMI", "F1", "MAP@R")


def _metric_keys(*rows: dict[str, Any]) -> list[str]:
    keys = {k for r in rows for k in r if k.startswith("R@") or k in ("NMI", "F1", "MAP@R")}
    ordered = [k for k in METRIC_ORDER if k in keys]
    extra = sorted(keys - set(ordered), key=lambda k: (len(k), k))
    return ordered + extra


def metrics_markdown(rows: Sequence[tuple[str, dict[str, float]]]) -> str:
    """A Markdown table, one row per (name, metrics) pair, values in percent."""
    keys = _metric_keys(*(m for _, m in rows))
    lines = ["| model | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, m in rows:
        cells = [f"{100 * m[k]:.2f}" if k in m else "" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_curves(history: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    """Training loss and test R@1 per epoch, side by side (as the paper's Fig. 4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = [(r["epoch"], r["loss"]) for r in history if r.get("loss") not in ("", None)]
    r1 = [(r["epoch"], 100 * r["R@1"]) for r in history if "R@1" in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    if loss:
        a.plot(*zip(*loss), marker="o", ms=3)
    a.set_xlabel("epoch")
    a.set_ylabel("training loss")
    a.set_title("training loss")
    a.grid(alpha=0.3)
    if r1:
        b.plot(*zip(*r1), marker="o", ms=3, color="tab:red")
    b.set_xlabel("epoch")
    b.set_ylabel("R@1 (%)")
    b.set_title("test R@1")
    b.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def normalised_frm(frm: np.ndarray, max_classes: int = 48) -> np.ndarray:
    """First `max_classes` rows, each divided by its max (an all-zero row stays zero)."""
    m = np.asarray(frm, dtype=np.float64)[:max_classes]
    peak = m.max(axis=1, keepdims=True)
    return np.divide(m, peak, out=np.zeros_like(m), where=peak > 0)


def frm_heatmap(frm: np.ndarray, out: Path, classes: Sequence[str] = (), max_classes: int = 48,
                title: str = "Frequency Recorder Matrix") -> Path:
    """FRM rows normalised by their max, first `max_classes` classes (supplementary Fig. III)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = normalised_frm(frm, max_classes)
    fig, ax = plt.subplots(figsize=(max(6.0, m.shape[1] / 12), max(3.0, m.shape[0] / 5)))
    im = ax.imshow(m, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xlabel("embedding channel")
    ax.set_ylabel("training class")
    if classes and len(m) <= 48:
        ax.set_yticks(range(len(m)))
        ax.set_yticklabels([str(c)[-36:] for c in classes[:len(m)]], fontsize=5)
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="count / row max")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def write_report(run_dir: Path, cfg, history: list[dict[str, Any]], best_epoch: int,
                 best_metrics: dict[str, float], initial_metrics: dict[str, float],
                 frm: np.ndarray | None, classes: Sequence[str]) -> dict[str, Path]:
    """Everything a person reads after a run, in the run directory."""
    run_dir = Path(run_dir)
    last = next((r for r in reversed(history) if "R@1" in r), {})
    last_epoch = last.get("epoch", 0)
    keys = _metric_keys(best_metrics, initial_metrics, last)
    rows = []
    if initial_metrics:
        rows.append(("untrained (epoch 0)", initial_metrics))
    if best_metrics:
        rows.append((f"best (epoch {best_epoch})", best_metrics))
    if last:
        rows.append((f"last (epoch {last_epoch})", {k: last[k] for k in keys if k in last}))
    das = "DAS" if cfg.das else "no DAS"
    title = f"{cfg.dataset}: {cfg.backbone} d={cfg.dim}, {cfg.loss}/{cfg.miner_name or '-'}, {das}"
    md = [f"# Run report: {title}", "", f"Best epoch by R@1: **{best_epoch}** of {cfg.epochs}.", "",
          metrics_markdown(rows), "", "![loss and R@1](curves.png)", ""]
    paths = {"markdown": run_dir / "metrics.md", "json": run_dir / "metrics.json",
             "curves": plot_curves(history, run_dir / "curves.png", title)}
    if frm is not None:
        paths["frm"] = frm_heatmap(frm, run_dir / "frm.png", classes, cfg.frm_classes)
        md += ["![FRM heatmap](frm.png)", ""]
    paths["markdown"].write_text("\n".join(md))
    paths["json"].write_text(json.dumps({
        "best_epoch": best_epoch, "best": best_metrics, "initial": initial_metrics,
        "last_epoch": last_epoch, "last": {k: last[k] for k in keys if k in last},
        "history": history, "config": cfg.to_dict()}, indent=2))
    return paths
