"""What the baseline-vs-DAS benchmarks share: the 95% Student-t interval of paired differences,
the ``--variant NAME:KEY=VALUE,...`` syntax for extra DAS runs, and the paired table itself
(per-seed runs summarised per method and variant, each row's cells, the forest plot of the R@1
differences) that benchmarks/training/frozen_table2.py and benchmarks/training/finetune_table2.py both write."""
from __future__ import annotations

import math
import re
from pathlib import Path

METRICS = ("R@1", "NMI", "MAP@R")


def t_interval(diffs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of paired differences (e.g. DAS - baseline per seed); low/high are NaN
    for fewer than 2 values."""
    from scipy import stats

    n = len(diffs)
    if n == 0:
        raise ValueError("t_interval: no differences given")
    mean = sum(diffs) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def fmt_interval(t: tuple[float, float, float]) -> str:
    mean, lo, hi = t
    if math.isnan(lo):
        return f"{mean:+.2f}"
    return f"{mean:+.2f} [{lo:+.2f}, {hi:+.2f}]"


def parse_variants(items: list[str], default: str = "DAS") -> dict[str, list[str]]:
    """``NAME:KEY=VALUE,KEY=VALUE`` -> {NAME: ["KEY=VALUE", ...]} (commas inside [..] kept);
    nothing given -> {default: []}."""
    out: dict[str, list[str]] = {}
    for item in items:
        name, _, rest = item.partition(":")
        if not name or name in ("off", "base"):
            raise ValueError(f"--variant {item!r}: expected NAME:KEY=VALUE[,KEY=VALUE]")
        out[name] = [kv for kv in re.split(r",(?![^\[]*\])", rest) if kv]
    return out or {default: []}


# ------------------------------------------------------------------------- the paired table
def split_method(method: str) -> tuple[str, str]:
    """``"triplet:semihard"`` -> (loss, sampler); a pytorch-metric-learning loss keeps its
    prefix: ``"pml:ProxyAnchorLoss:none"`` -> ``("pml:ProxyAnchorLoss", "none")``."""
    head = "pml:" if method.startswith("pml:") else ""
    loss, _, miner = method[len(head):].partition(":")
    return head + loss, miner


def method_label(method: str) -> str:
    """``"triplet:semihard"`` -> ``"triplet [semihard]"`` (``"loss:none"`` -> ``"loss"``)."""
    loss, miner = split_method(method)
    return f"{loss} [{miner}]" if miner and miner != "none" else loss


def variant_label(variant: str) -> str:
    if variant.startswith("sweep:"):
        _, key, val = variant.split(":")
        return f"DAS, {key} = {val}"
    return {"base": "-", "dfs_only": "DFS only", "mts_only": "MTS only"}.get(variant, variant)


def summarise(runs: list[dict]) -> list[dict]:
    """Per (method, variant): mean metrics, and paired differences to the method's baseline."""
    by: dict[tuple[str, str], dict[int, dict]] = {}
    for r in runs:
        by.setdefault((r["method"], r["variant"]), {})[r["seed"]] = r
    rows = []
    for (method, variant), seeds in by.items():
        row = {"method": method, "variant": variant, "n": len(seeds),
               "seconds": sum(r["seconds"] for r in seeds.values()) / len(seeds)}
        for m in METRICS:
            row[m] = 100 * sum(r["metrics"][m] for r in seeds.values()) / len(seeds)
        base = by.get((method, "base"), {})
        common = sorted(set(seeds) & set(base))
        if variant != "base" and common:
            for m in METRICS:
                diffs = [100 * (seeds[s]["metrics"][m] - base[s]["metrics"][m]) for s in common]
                row[f"d{m}"] = t_interval(diffs)
            row["wins"] = sum(seeds[s]["metrics"]["R@1"] > base[s]["metrics"]["R@1"]
                              for s in common)
            row["paired"] = len(common)
        rows.append(row)
    return rows


def row_cells(row: dict, seconds: str = ".0f") -> list[str]:
    """A `summarise` row's cells after its label columns: the mean of each metric, its DAS -
    base interval, "wins/paired" and seconds per run (formatted with `seconds`)."""
    diff = [fmt_interval(row[f"d{m}"]) if f"d{m}" in row else "" for m in METRICS]
    wins = f"{row['wins']}/{row['paired']}" if "wins" in row else ""
    return [f"{row[m]:.2f}" for m in METRICS] + diff + [wins, format(row["seconds"], seconds)]


def table_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def plot(rows: list[dict], path: Path, title: str) -> None:
    """The R@1 differences (mean and 95% interval) of the rows that have a baseline, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "dR@1" in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(rows) + 1.2))
    for i, r in enumerate(rows):
        mean, lo, hi = r["dR@1"]
        color = "tab:green" if lo > 0 else ("tab:red" if hi < 0 else "tab:gray")
        if not math.isnan(lo):
            ax.plot([lo, hi], [i, i], color=color, lw=3)
        ax.plot([mean], [i], "o", color="black")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{method_label(r['method'])}, {variant_label(r['variant'])}"
                        for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("R@1 difference DAS - baseline (points, mean and 95% t-interval)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
