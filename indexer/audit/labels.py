"""(b) Likely mislabelled images and (d) the most confused class pairs; the per-class figures
the outliers (c) use too.

cleanlab's recipe on the index's graph (not its Datalab: a fitted classifier, ~30 packages, and
outliers by kNN distance alone: docs/benchmarks/audit.md). Out-of-sample class probabilities
(each item left out of its neighbourhood and its class centroid; the k nearest items' labels,
weights ``exp((sim - 1) / KNN_TEMP)``, mixed with a softmax over the centroid cosines,
``CENTROID_TEMP``: robust where the kNN view is noisy) give the SUGGESTED label and the margin
(``normalized_margin``); the RANKING is

    score = cos(x, centroid[suggested]) - cos(x, centroid[label] without x) - max(0, m - best)

``best`` the cosine to the nearest centroid, ``m`` its gallery median: off-domain photos are the
outlier list's business and sink here. On cub-dev with 2% flipped labels and 1% off-domain photos
0.90 of the flips were in the top N (the margin alone: 0.77-0.80). Listed: score > 0, margin > 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ann.new_photos import KNN_TEMP, knn_weights
from .graph import KnnGraph
from .source import Gallery

CENTROID_TEMP = 0.02    # softmax temperature over the cosines to the class centroids
#: share of the centroid view in the mixed probabilities: 0.25 gives a top-N precision of 0.85 or
#: more (0.87-0.90) on both validation galleries with either default embedder (Lite1, the
#: two-backbone one; 0.5 lost one flip of 30 on three of the four: docs/benchmarks/audit.md)
CENTROID_SHARE = 0.25
CHUNK = 8_192


@dataclass
class ClassView:
    """Per-row figures of the labelled audit (NaN / -1 where a row has no label)."""

    given: np.ndarray          # (n,) int32 label code, -1 none
    suggested: np.ndarray      # (n,) int32 most likely other label (-1: none)
    p_given: np.ndarray        # (n,) float32 mixed probability of the given label
    p_suggested: np.ndarray    # (n,) float32 of the suggested one
    knn_agree: np.ndarray      # (n,) float32 weighted share of neighbours with the given label
    own_cos: np.ndarray        # (n,) float32 cosine to the own class centroid (self left out)
    best_cos: np.ndarray       # (n,) float32 cosine to the nearest class centroid (own: self left out)
    suggested_cos: np.ndarray  # (n,) float32 cosine to the suggested label's centroid
    counts: np.ndarray         # (C,) images per label

    @property
    def score(self) -> np.ndarray:
        """The mislabelled ranking (module docstring); NaN without a label."""
        typ = np.maximum(0, np.nanmedian(self.best_cos) - self.best_cos) if np.isfinite(self.best_cos).any() else 0
        return self.suggested_cos - self.own_cos - typ

    @property
    def margin(self) -> np.ndarray:
        """p_suggested - p_given: > 0 when the neighbourhood and the centroids prefer another
        label; the mislabelled ranking (NaN: no label)."""
        return self.p_suggested - self.p_given


def class_view(g: Gallery, graph: KnnGraph, *, knn_temp: float = KNN_TEMP,
               centroid_temp: float = CENTROID_TEMP, centroid_share: float = CENTROID_SHARE) -> ClassView:
    """Two streaming passes over the stored vectors: class sums, then per-row probabilities."""
    codes, C, n = g.codes, len(g.label_names), len(g.ids)
    counts = np.bincount(codes[codes >= 0], minlength=C).astype(np.int64)
    sums = np.zeros((C, g.dim), dtype=np.float64)
    for start, x in g.chunks(CHUNK * 8):
        c = codes[start:start + len(x)]
        m = c >= 0
        if m.any():
            order = np.argsort(c[m], kind="stable")
            cs, xs = c[m][order], x[m][order]
            cut = np.flatnonzero(np.r_[True, cs[1:] != cs[:-1]])
            sums[cs[cut]] += np.add.reduceat(xs.astype(np.float64), cut, axis=0)
    sq = (sums ** 2).sum(1)
    cent = (sums / np.sqrt(np.maximum(sq, 1e-24))[:, None]).astype(np.float32)

    out = ClassView(codes.copy(), np.full(n, -1, np.int32), *(np.full(n, np.nan, np.float32) for _ in range(6)),
                    counts)
    for start, x in g.chunks(CHUNK):
        r = slice(start, start + len(x))
        y = codes[r]
        lab = y >= 0
        ar = np.arange(len(x))
        cos = x @ cent.T                                            # (b, C)
        own = np.full(len(x), np.nan, np.float32)
        if lab.any():                                               # own centroid without the row
            dot = (x[lab].astype(np.float64) * sums[y[lab]]).sum(1)
            rest = sq[y[lab]] - 2 * dot + 1
            ok = (counts[y[lab]] > 1) & (rest > 1e-12)
            own[lab] = np.where(ok, (dot - 1) / np.sqrt(np.maximum(rest, 1e-24)), np.nan)
            cos[ar[lab], y[lab]] = np.where(ok, own[lab], -1.0)
        out.own_cos[r] = own
        out.best_cos[r] = cos.max(1)
        # the centroid view: softmax over classes
        z = (cos - cos.max(1, keepdims=True)) / centroid_temp
        q = np.exp(z)
        q /= q.sum(1, keepdims=True)
        # the kNN view: neighbours' labels weighted by similarity
        nb, sim = graph.nbr[r], graph.sim[r]
        nl = np.where(nb >= 0, codes[np.maximum(nb, 0)], -1)
        w = np.where(nl >= 0, knn_weights(sim, knn_temp), 0.0)
        p = np.zeros_like(q)
        rows = np.broadcast_to(ar[:, None], nl.shape)
        np.add.at(p, (rows[nl >= 0], nl[nl >= 0]), w[nl >= 0])
        tot = p.sum(1, keepdims=True)
        knn_ok = tot[:, 0] > 0
        p = np.where(knn_ok[:, None], p / np.where(tot > 0, tot, 1), q)
        mix = (1 - centroid_share) * p + centroid_share * q
        if lab.any():
            out.knn_agree[r] = np.where(lab & knn_ok, p[ar, np.maximum(y, 0)], np.nan)
            pg = mix[ar, np.maximum(y, 0)]
            other = mix.copy()
            other[ar[lab], y[lab]] = -1.0
            s = other.argmax(1).astype(np.int32)
            ps = other[ar, s]
            out.p_given[r] = np.where(lab, pg, np.nan)
            out.p_suggested[r] = np.where(lab, ps, np.nan)
            out.suggested[r] = np.where(lab & (C > 1), s, -1)
            out.suggested_cos[r] = np.where(lab, cos[ar, s], np.nan)
    return out


def mislabelled(view: ClassView, top: int | None = None) -> np.ndarray:
    """Rows nearer another label than their own (score > 0) whose probabilities prefer it
    (margin > 0), highest score first; ties (equal scores) in row order."""
    sc = view.score
    rows = np.flatnonzero((np.nan_to_num(sc, nan=-np.inf) > 0) & (np.nan_to_num(view.margin, nan=-1) > 0))
    rows = rows[np.lexsort((rows, -sc[rows]))]
    return rows if top is None else rows[:top]


@dataclass
class ConfusedPair:
    a: int
    b: int
    edges: int          # kNN edges between the two classes (either direction)
    rate: float         # edges / (k x (n_a + n_b)): the share of the pair's neighbourhoods
    suggested: int      # items of one labelled as the other flagged as likely mislabelled


def confused_pairs(view: ClassView, graph: KnnGraph, top: int = 50) -> list[ConfusedPair]:
    """Class pairs whose images are most often each other's neighbours, by rate (then edges,
    then names' codes: no float tie decides the order)."""
    codes = view.given
    C = len(view.counts)
    src = np.repeat(codes, graph.k)
    dst = np.where(graph.nbr.ravel() >= 0, codes[np.maximum(graph.nbr.ravel(), 0)], -1)
    m = (src >= 0) & (dst >= 0) & (src != dst)
    lo, hi = np.minimum(src[m], dst[m]).astype(np.int64), np.maximum(src[m], dst[m]).astype(np.int64)
    keys, edges = np.unique(lo * C + hi, return_counts=True)
    flagged = np.zeros(len(codes), dtype=bool)
    flagged[mislabelled(view)] = True
    fl, fs = codes[flagged].astype(np.int64), view.suggested[flagged].astype(np.int64)
    sk, sc = np.unique(np.minimum(fl, fs) * C + np.maximum(fl, fs), return_counts=True)
    sug = dict(zip(sk.tolist(), sc.tolist()))
    a, b = keys // C, keys % C
    rate = edges / (graph.k * (view.counts[a] + view.counts[b]))
    order = np.lexsort((keys, -edges, -rate))[:top]
    return [ConfusedPair(int(a[i]), int(b[i]), int(edges[i]), float(rate[i]), int(sug.get(int(keys[i]), 0)))
            for i in order]


__all__ = ["ClassView", "class_view", "mislabelled", "ConfusedPair", "confused_pairs", "KNN_TEMP",
           "CENTROID_TEMP", "CENTROID_SHARE"]
