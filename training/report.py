"""What a run writes for people: the per-epoch log (CSV, TensorBoard, one console line) and the
final report (metrics table as Markdown + JSON, loss / R@1 curves, FRM heatmap as PNG)."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

#: Per-epoch mean loss terms logged next to "loss" when the aux loss is on.
AUX_COLUMNS = ("loss_real", "loss_all")
_TRAIN_KEYS = ("epoch", "steps", "loss", "lr", "seconds") + AUX_COLUMNS


def _metric_keys(*rows: dict[str, Any]) -> list[str]:
    """The metric names in ``rows``, in the one order every table and log uses: R@k by k, then
    NMI, F1, MAP@R."""
    keys = {k for r in rows for k in r if k.startswith("R@") or k in ("NMI", "F1", "MAP@R")}
    tail = ("NMI", "F1", "MAP@R")
    return (sorted((k for k in keys if k.startswith("R@")), key=lambda k: int(k[2:]))
            + [k for k in tail if k in keys])


def write_csv(path: Path, history: list[dict[str, Any]], cfg, aux: bool = False) -> None:
    """``log.csv``: one row per epoch; ``aux`` adds the aux loss's two terms after ``loss``."""
    cols = ["epoch", "steps", "loss"] + (list(AUX_COLUMNS) if aux else []) + ["lr", "seconds"]
    # the metrics a run with ``cfg`` evaluates, in report order
    names = [f"R@{k}" for k in cfg.eval_ks] + (["NMI", "F1"] if cfg.eval_clustering else [])
    cols += _metric_keys(dict.fromkeys(names + ["MAP@R"]))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for row in history:
            w.writerow({k: row.get(k, "") for k in cols})


class EpochLogger:
    """After each epoch: rewrite ``log.csv``, add TensorBoard scalars (when enabled and
    installed) and print one line. Only the main rank logs."""

    def __init__(self, run_dir: Path, cfg, *, aux: bool) -> None:
        self.run_dir, self.cfg, self.aux = Path(run_dir), cfg, aux
        self.tb = None
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except Exception:  # tensorboard not installed: CSV only
                return
            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, history: list[dict[str, Any]]) -> None:
        row, cfg = history[-1], self.cfg
        epoch = row["epoch"]
        write_csv(self.run_dir / "log.csv", history, cfg, aux=self.aux)
        if self.tb is not None:
            for k in ("loss", "lr", *AUX_COLUMNS):
                if k in row:
                    self.tb.add_scalar(f"train/{k}", row[k], epoch)
            for k, v in row.items():
                if k not in _TRAIN_KEYS and v != "":
                    self.tb.add_scalar(f"test/{k}", v, epoch)
        msg = f"epoch {epoch}/{cfg.epochs} loss {row['loss']:.4f}"
        if self.aux:
            msg += f" (real {row['loss_real']:.4f}, with DAS {row['loss_all']:.4f})"
        if "R@1" in row:
            msg += f" R@1 {row['R@1']:.4f}"
        if cfg.progress:
            print(msg, flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def metrics_markdown(rows: Sequence[tuple[str, dict[str, float]]]) -> str:
    """A Markdown table, one row per (name, metrics) pair, values in percent."""
    keys = _metric_keys(*(m for _, m in rows))
    lines = ["| model | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, m in rows:
        cells = [f"{100 * m[k]:.2f}" if k in m else "" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (runs have no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _saved(fig: Any, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    _pyplot().close(fig)
    return out


def plot_curves(history: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    """Training loss and test R@1 per epoch, side by side (as the paper's Fig. 4)."""
    loss = [(r["epoch"], r["loss"]) for r in history if r.get("loss") not in ("", None)]
    r1 = [(r["epoch"], 100 * r["R@1"]) for r in history if "R@1" in r]
    fig, axes = _pyplot().subplots(1, 2, figsize=(10, 3.8))
    for ax, points, ylabel, name, color in zip(axes, (loss, r1), ("training loss", "R@1 (%)"),
                                               ("training loss", "test R@1"), (None, "tab:red")):
        if points:
            ax.plot(*zip(*points), marker="o", ms=3, color=color)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return _saved(fig, out)


def normalised_frm(frm: np.ndarray, max_classes: int = 48) -> np.ndarray:
    """First `max_classes` rows, each divided by its max (an all-zero row stays zero)."""
    m = np.asarray(frm, dtype=np.float64)[:max_classes]
    peak = m.max(axis=1, keepdims=True)
    return np.divide(m, peak, out=np.zeros_like(m), where=peak > 0)


def frm_heatmap(frm: np.ndarray, out: Path, classes: Sequence[str] = (), max_classes: int = 48,
                title: str = "Frequency Recorder Matrix") -> Path:
    """FRM rows normalised by their max, first `max_classes` classes (supplementary Fig. III)."""
    m = normalised_frm(frm, max_classes)
    fig, ax = _pyplot().subplots(figsize=(max(6.0, m.shape[1] / 12), max(3.0, m.shape[0] / 5)))
    im = ax.imshow(m, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xlabel("embedding channel")
    ax.set_ylabel("training class")
    if classes and len(m) <= 48:
        ax.set_yticks(range(len(m)))
        ax.set_yticklabels([str(c)[-36:] for c in classes[:len(m)]], fontsize=5)
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="count / row max")
    return _saved(fig, out)


def write_report(run_dir: Path, cfg, history: list[dict[str, Any]], best_epoch: int,
                 best_metrics: dict[str, float], initial_metrics: dict[str, float],
                 frm: np.ndarray | None, classes: Sequence[str],
                 skipped: int = 0) -> dict[str, Path]:
    """Everything a person reads after a run, in the run directory; `skipped` counts the
    unreadable images left out (listed in skipped.jsonl)."""
    run_dir = Path(run_dir)
    last = next((r for r in reversed(history) if "R@1" in r), {})
    last_epoch = last.get("epoch", 0)
    keys = _metric_keys(best_metrics, initial_metrics, last)
    last_metrics = {k: last[k] for k in keys if k in last}
    rows = [(name, m) for name, m in (("untrained (epoch 0)", initial_metrics),
                                      (f"best (epoch {best_epoch})", best_metrics),
                                      (f"last (epoch {last_epoch})", last_metrics)) if m]
    das = "DAS" if cfg.das else "no DAS"
    title = f"{cfg.dataset}: {cfg.backbone} d={cfg.dim}, {cfg.loss}/{cfg.miner_name or '-'}, {das}"
    md = [f"# Run report: {title}", "", f"Best epoch by R@1: **{best_epoch}** of {cfg.epochs}.", "",
          metrics_markdown(rows), "", "![loss and R@1](curves.png)", ""]
    if skipped:
        md[4:4] = [f"{skipped} unreadable image(s) left out (see skipped.jsonl).", ""]
    paths = {"markdown": run_dir / "metrics.md", "json": run_dir / "metrics.json",
             "curves": plot_curves(history, run_dir / "curves.png", title)}
    if frm is not None:
        paths["frm"] = frm_heatmap(frm, run_dir / "frm.png", classes, cfg.frm_classes)
        md += ["![FRM heatmap](frm.png)", ""]
    paths["markdown"].write_text("\n".join(md))
    paths["json"].write_text(json.dumps({
        "best_epoch": best_epoch, "best": best_metrics, "initial": initial_metrics,
        "last_epoch": last_epoch, "last": last_metrics,
        "skipped": skipped, "history": history, "config": cfg.to_dict()}, indent=2))
    return paths
