"""(a) Near-duplicate groups: the kNN graph's pairs whose similarity stands out, grouped by
union-find (a copy of a copy is one group), best pair first.

Identical bytes are one item already (ids are the content's sha256), so what is found here is
what a byte comparison cannot: resized, re-encoded, cropped copies.

A pair's score is its cosine plus how far it stands above both items' neighbourhoods:
``2 * cos(i, j) - max(d_i, d_j)``, ``d_i`` the mean cosine of i's 3rd..k-th neighbours (the
first two left out, so that a group of three copies does not raise its own baseline). Why not
the cosine alone: an embedder trained for categories puts two different photos of one bird
species in a crowded class as close (0.91 on cub-dev) as a photo and its cropped copy (0.90);
the copy stands out of its neighbourhood, the crowd does not. On cub-dev validation species
with injected copies, cosine alone reaches recall 0.67 at precision 0.95, this score 0.93 at
1.0 (docs/benchmarks/audit.md). The threshold (1.0) was chosen there.

Below the threshold, the score cannot tell a cropped copy (a photo and its central 85% crop:
cosine 0.79-0.90) from another photo of the same species; the images can. :func:`candidates`
are the pairs in an uncertain band (one of each other's ``VERIFY_TOP`` nearest, score >=
``VERIFY_LOWER``), best first; :mod:`.verify` matches their pixels (ORB + RANSAC), and those
with enough inliers join the groups as pairs of their own (``extra``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .graph import KnnGraph, pairs_above

#: pair score (above) from which two images are near-duplicates (chosen on validation classes)
DEFAULT_THRESHOLD = 1.0
#: the uncertain band verified by pixels: pairs among each other's VERIFY_TOP nearest neighbours
#: scoring >= VERIFY_LOWER (and below the threshold); chosen on validation
VERIFY_TOP = 2
VERIFY_LOWER = 0.8


@dataclass
class DuplicateGroup:
    rows: list[int]                      # ascending
    # the edges that joined it (a, b, cosine, score, RANSAC inliers: None when the score alone did)
    pairs: list[tuple[int, int, float, float, int | None]]

    @property
    def max_sim(self) -> float:
        return max(p[2] for p in self.pairs)

    @property
    def max_score(self) -> float:
        return max(p[3] for p in self.pairs)


def baselines(graph: KnnGraph) -> np.ndarray:
    """Each row's neighbourhood cosine ``d_i``: the mean of its 3rd..k-th neighbours' (the
    last one alone for k <= 3)."""
    lo = min(2, graph.k - 1)
    sim = graph.sim[:, lo:]
    valid = ~np.isnan(sim)
    return (np.where(valid, sim, 0).sum(1) / np.maximum(valid.sum(1), 1)).astype(np.float32)


def candidates(graph: KnnGraph, threshold: float = DEFAULT_THRESHOLD, *, lower: float = VERIFY_LOWER,
               top: int = VERIFY_TOP) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(a, b, cos, score) of the pairs to verify by pixels: b among a's ``top`` nearest (or a
    among b's), ``lower <= score < threshold``, each unordered pair once (a < b), best score
    first (then by rows)."""
    d = baselines(graph)
    top = min(top, graph.k)
    i = np.repeat(np.arange(len(graph), dtype=np.int64), top)
    j = graph.nbr[:, :top].ravel().astype(np.int64)
    cos = graph.sim[:, :top].ravel()
    ok = j >= 0
    i, j, cos = i[ok], j[ok], cos[ok]
    score = 2 * cos - np.maximum(d[i], d[j])
    ok = (score >= lower) & (score < threshold)
    a, b, cos, score = np.minimum(i, j)[ok], np.maximum(i, j)[ok], cos[ok], score[ok]
    order = np.lexsort((b, a, -score))
    a, b, cos, score = a[order], b[order], cos[order], score[order]
    key = a * len(graph) + b
    _, first = np.unique(key, return_index=True)       # the best-scored direction of each pair
    first.sort()
    return a[first], b[first], cos[first].astype(np.float32), score[first].astype(np.float32)


def near_duplicates(graph: KnnGraph, threshold: float = DEFAULT_THRESHOLD,
                    extra: tuple[np.ndarray, ...] | None = None) -> list[DuplicateGroup]:
    """Groups of rows joined by pairs scoring >= ``threshold``, and by the ``extra`` pairs
    ``(a, b, cos, score, inliers)`` (verified below it), ordered by their best pair (then by
    first row: no order depends on a float tie)."""
    d = baselines(graph)
    # score >= t needs 2 cos - d >= t, d <= 1: cos >= (t - 1) / 2 + ... ; prefilter by cos >= t - 1
    a, b, cos = pairs_above(graph, max(-1.0, (threshold + float(d.min(initial=1.0))) / 2 - 1e-6))
    score = 2 * cos - np.maximum(d[a], d[b])
    keep = score >= threshold
    a, b, cos, score = a[keep], b[keep], cos[keep], score[keep]
    inl: list[int | None] = [None] * len(a)
    if extra is not None and len(extra[0]):
        ea, eb, ec, es, ei = extra
        a, b = np.concatenate([a, np.asarray(ea, np.int64)]), np.concatenate([b, np.asarray(eb, np.int64)])
        cos, score = np.concatenate([cos, ec]), np.concatenate([score, es])
        inl += [int(x) for x in ei]
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(x, x) != root:             # path compression
            parent[x], x = root, parent[x]
        return root

    for x, y in zip(a.tolist(), b.tolist()):
        rx, ry = find(x), find(y)
        if rx != ry:
            parent[max(rx, ry)] = min(rx, ry)
    groups: dict[int, DuplicateGroup] = {}
    for x, y, v, sc, n in zip(a.tolist(), b.tolist(), cos.tolist(), score.tolist(), inl):
        grp = groups.setdefault(find(x), DuplicateGroup([], []))
        grp.pairs.append((x, y, float(v), float(sc), n))
    for grp in groups.values():
        grp.rows = sorted({r for p in grp.pairs for r in p[:2]})
        grp.pairs.sort(key=lambda p: (-p[3], p[0], p[1]))
    return sorted(groups.values(), key=lambda g: (-g.max_score, g.rows[0]))


__all__ = ["DuplicateGroup", "near_duplicates", "candidates", "DEFAULT_THRESHOLD", "VERIFY_TOP", "VERIFY_LOWER"]
