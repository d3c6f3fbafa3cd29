"""Test-time DFS/MTS probes (supplementary section L, Figs. V-VI): scale the query's top-K
channels or add the difference of two gallery embeddings of one class, then search again; a
model that learnt real semantics keeps its neighbours. On numpy: serving never imports training."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from embedder.vectors import l2_normalize

DEFAULT_SCALES: tuple[float, ...] = (0.5, 0.8, 1.2, 2.0)
DEFAULT_SHIFTS: tuple[float, ...] = (0.5, 1.0)


def _as_vector(v: np.ndarray, name: str = "embedding") -> np.ndarray:
    arr = np.asarray(v, dtype=np.float32)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name}: expected a 1-d embedding vector, got shape {np.shape(v)}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: contains NaN or infinite values")
    return arr


def topk_channels(v: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest channels by signed value (as DFS counts them, no abs)."""
    v = _as_vector(v)
    if not 1 <= k <= v.size:
        raise ValueError(f"topk: expected 1 <= k <= {v.size} (embedding size), got {k}")
    idx = np.argpartition(-v, k - 1)[:k]
    return idx[np.argsort(-v[idx], kind="stable")]


def semantic_scaling(v: np.ndarray, *, topk: int = 4, scales: Sequence[float] | None = DEFAULT_SCALES,
                     n_random: int = 0, scale_range: float = 0.5, seed: int | None = 0,
                     normalize: bool = True) -> tuple[np.ndarray, list[str]]:
    """(P, d) probes scaling the query's top-K channels, by each scale (a row of Fig. V) and by
    ``n_random`` draws per channel from U[1 - scale_range, 1 + scale_range] (as DFS); P names."""
    v = _as_vector(v)
    scales = list(scales or [])
    if any((not np.isfinite(s)) or s <= 0 for s in scales):
        raise ValueError(f"scales: expected positive finite factors, got {scales}")
    if n_random < 0:
        raise ValueError(f"n_random: expected >= 0, got {n_random}")
    if n_random and not 0 < scale_range < 1:
        raise ValueError(f"scale_range: expected 0 < r_s < 1, got {scale_range}")
    if not scales and not n_random:
        raise ValueError("semantic_scaling: give at least one scale or n_random > 0")
    idx = topk_channels(v, topk)
    rng = np.random.default_rng(seed)
    rows, names = [], []
    for s in scales:
        f = np.ones_like(v)
        f[idx] = s
        rows.append(v * f)
        names.append(f"scale x{s:g}")
    for i in range(n_random):
        f = np.ones_like(v)
        f[idx] = rng.uniform(1 - scale_range, 1 + scale_range, size=idx.size)
        rows.append(v * f)
        names.append(f"scale random #{i + 1} (r_s={scale_range:g})")
    out = np.stack(rows).astype(np.float32)
    return (l2_normalize(out) if normalize else out), names


def semantic_shifting(v: np.ndarray, a: np.ndarray, b: np.ndarray, *,
                      shifts: Sequence[float] = DEFAULT_SHIFTS,
                      normalize: bool = True) -> tuple[np.ndarray, list[str]]:
    """Probe embeddings ``v + r_b * (a - b)`` for each r_b: a, b are two gallery embeddings of
    one class, so their difference is an intra-class transformation (MTS without the bank)."""
    v = _as_vector(v)
    a = _as_vector(a, "shift embedding a")
    b = _as_vector(b, "shift embedding b")
    if not v.shape == a.shape == b.shape:
        raise ValueError(f"semantic_shifting: dims differ: query {v.shape}, a {a.shape}, b {b.shape}")
    shifts = list(shifts)
    if not shifts or any(not np.isfinite(r) for r in shifts):
        raise ValueError(f"shifts: expected finite r_b values, got {shifts}")
    t = a - b
    out = np.stack([v + r * t for r in shifts]).astype(np.float32)
    return (l2_normalize(out) if normalize else out), [f"shift r_b={r:g}" for r in shifts]


def overlap_at_k(reference: Sequence[int], probe: Sequence[int], k: int) -> float:
    """|top-k(reference) ∩ top-k(probe)| / k; ids < 0 (faiss padding) never count."""
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    ref = {int(i) for i in list(reference)[:k] if int(i) >= 0}
    got = {int(i) for i in list(probe)[:k] if int(i) >= 0}
    return len(ref & got) / k


def precision_at_k(labels: Sequence[str | None], query_label: str, k: int) -> float:
    """Fraction of the top-k whose label is the query's (missing results count as misses)."""
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    return sum(1 for lab in list(labels)[:k] if lab is not None and lab == query_label) / k


@dataclass
class ProbeRow:
    """One probe's results beside the original query's."""
    name: str
    kind: str                      # "original" | "scaling" | "shifting"
    ids: list[int]
    scores: list[float]
    labels: list[str | None]
    overlap: float                 # overlap@k with the original top-k (1.0 for the original)
    precision: float | None        # precision@k when the query's label is known


def stability_rows(original_ids: Sequence[int], original_scores: Sequence[float],
                   original_labels: Sequence[str | None], probes: Sequence[tuple[str, str, Sequence[int], Sequence[float], Sequence[str | None]]],
                   k: int, query_label: str | None = None) -> list[ProbeRow]:
    def prec(labels: Sequence[str | None]) -> float | None:
        return None if query_label is None else precision_at_k(labels, query_label, k)

    rows = [ProbeRow("original", "original", [int(i) for i in original_ids[:k]],
                     [float(s) for s in original_scores[:k]], list(original_labels[:k]),
                     1.0, prec(original_labels))]
    for name, kind, ids, scores, labels in probes:
        rows.append(ProbeRow(name, kind, [int(i) for i in ids[:k]], [float(s) for s in scores[:k]],
                             list(labels[:k]), overlap_at_k(original_ids, ids, k), prec(labels)))
    return rows
