"""(c) Outliers: images far from everything, and (labelled galleries) from their own class.

Score: ``knn_far`` (1 - mean cosine to the k nearest other items), plus in labelled galleries
``class_far`` (1 - cosine to the nearest class centroid, own without itself), ``own_far`` (to its
own centroid) and ``mixed`` (1 - the share of its k neighbours carrying their most common label),
summed. Why the label terms: off-domain photos in a group bigger than k, or near the middle of
everything, fool the kNN score, but carry random labels (top-2x recall on two test galleries: kNN
1.00 and 0.07, the sum 1.00 and 1.00; docs/benchmarks/audit.md). Unlabelled: ``knn_far`` alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .graph import KnnGraph
from .labels import ClassView

CLASS_WEIGHT = 1.0      # weight of class_far against knn_far


@dataclass
class OutlierScores:
    score: np.ndarray       # (n,) float32, higher = more of an outlier
    knn_far: np.ndarray     # (n,)
    class_far: np.ndarray   # (n,), NaN without labels
    own_far: np.ndarray     # (n,), NaN without labels
    mixed: np.ndarray       # (n,), NaN without labels


def outlier_scores(graph: KnnGraph, view: ClassView | None = None,
                   class_weight: float = CLASS_WEIGHT) -> OutlierScores:
    valid = graph.nbr >= 0
    s = np.where(valid, graph.sim, 0.0).sum(1) / np.maximum(valid.sum(1), 1)
    knn_far = (1 - s).astype(np.float32)
    knn_far[~valid.any(1)] = 1.0
    n = len(knn_far)
    if view is None:
        nan = np.full(n, np.nan, np.float32)
        return OutlierScores(knn_far.copy(), knn_far, nan, nan.copy(), nan.copy())
    class_far = (1 - view.best_cos).astype(np.float32)
    own_far = (1 - view.own_cos).astype(np.float32)
    mixed = 1 - purity(graph, view.given)
    score = knn_far + class_weight * (_filled(class_far) + _filled(own_far) + _filled(mixed))
    return OutlierScores(score.astype(np.float32), knn_far, class_far, own_far, mixed)


def _filled(x: np.ndarray) -> np.ndarray:
    """NaN (an unlabelled row, a class of one) as the term's worst value: not hidden by it."""
    return np.nan_to_num(x, nan=float(np.nanmax(x, initial=0)))


def purity(graph: KnnGraph, codes: np.ndarray, chunk: int = 65_536) -> np.ndarray:
    """Share of each row's k neighbours carrying their most common label (unlabelled
    neighbours count as none; NaN for a row of an unlabelled item)."""
    out = np.full(len(graph), np.nan, dtype=np.float32)
    for s in range(0, len(graph), chunk):
        nb = graph.nbr[s:s + chunk]
        nl = np.where(nb >= 0, codes[np.maximum(nb, 0)], -1)
        same = (nl[:, :, None] == nl[:, None, :]) & (nl[:, :, None] >= 0)
        out[s:s + chunk] = same.sum(2).max(1) / graph.k
    out[codes < 0] = np.nan
    return out


def ranked(scores: OutlierScores, top: int | None = None) -> np.ndarray:
    """Rows by score, highest first; equal scores in row order."""
    rows = np.lexsort((np.arange(len(scores.score)), -scores.score))
    return rows if top is None else rows[:top]


__all__ = ["OutlierScores", "outlier_scores", "ranked", "CLASS_WEIGHT"]
