"""What the baseline-vs-DAS benchmarks share: the 95% Student-t interval of paired differences
and the ``--variant NAME:KEY=VALUE,...`` syntax for extra DAS runs."""
from __future__ import annotations

import math
import re


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
