"""What a gallery's neighbours say of a photo it does not hold: whether anything in it is close
(:func:`novelty`, a conformal p-value against the gallery's own nearest-neighbour similarities,
which DBA's neighbourhoods keep) and which label its hits vote for (:func:`suggest_label`, with
the weights the audit's kNN view uses too). Arrays in, values out; measured by
benchmarks/indexer/new_photos.py."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .neighbours import Neighbourhoods

#: a neighbour's weight exp((sim - 1) / KNN_TEMP), in a query's vote and in the audit's kNN view
KNN_TEMP = 0.05

#: a query whose p-value (:func:`novelty`) is at most this has no close match in the gallery: said
#: by the CLI and the app. New photos of the gallery's own classes are flagged at about this rate
#: (conformal: <= NOVEL_P for queries like the gallery's items; cub-val / caltech-val 0.9% / 0.0%),
#: photos of another dataset 96-100% (benchmarks/indexer/new_photos.py, docs/benchmarks/indexer.md)
NOVEL_P = 0.01


def novelty(nb: Neighbourhoods, nearest: np.ndarray) -> np.ndarray:
    """Conformal p-values of "no close match": for each query's inner product with its nearest
    gallery item, the share of gallery items whose nearest other item is at most as close,
    (1 + count) / (n + 1). Under exchangeability (a query drawn like the gallery's items) P(p <= a)
    <= a, whatever the embedder: a small p says the query is unlike anything the gallery holds
    (another domain, an unseen class), not that its hits are wrong. Why by hand: a k-NN
    out-of-distribution score (Sun et al., ICML 2022) calibrated on the gallery's own lists, which
    DBA already keeps; no library does this on a served faiss index."""
    ref = nb.nearest
    return ((1 + np.searchsorted(ref, np.asarray(nearest, np.float32), side="right"))
            / (len(ref) + 1)).astype(np.float64)


def no_close_match(p: float) -> str:
    """The one wording of a flagged query (CLI and app): its p-value and what it means."""
    return (f"no close match in the gallery (p = {p:.4f}): its nearest image is farther than for "
            f"{100 * (1 - p):.1f}% of the gallery's own images")


def knn_weights(sim: np.ndarray, temp: float = KNN_TEMP) -> np.ndarray:
    """A neighbour's vote, ``exp((sim - 1) / temp)`` (NaN, a padded slot: ~0): near-duplicates
    count fully, a neighbour 0.1 less similar e^-2 as much at the default temperature."""
    return np.exp((np.nan_to_num(np.asarray(sim, np.float64), nan=-1.0) - 1) / temp)


def suggest_label(labels: Sequence[str | None], sims: Sequence[float], novelty: float | None = None
                  ) -> tuple[str, float] | None:
    """The label a query's hits vote for, ``knn_weights`` of their scores, and its share of the
    vote; None when no hit has a label, or when the query has no close match (``novelty`` <=
    NOVEL_P: a bird in a gallery of aircraft would get "airplanes" at full share). Why not the
    first hit's label: on new photos of the validation classes the vote of 10 hits (DBA, as
    served; none for a photo with no close match) was right more often (cub-val 93.9% vs 93.7%,
    caltech-val 95.6% vs 94.1%; the test halves +0.5, +0.6), and a share >= 0.9 (77-89% of the
    photos) was right 99.4-99.8% of the time (benchmarks/indexer/new_photos.py). KNN_TEMP is the
    one the audit's kNN view was chosen with, not tuned again here."""
    if novelty is not None and novelty <= NOVEL_P:
        return None
    votes: dict[str, float] = {}
    for lab, w in zip(labels, knn_weights(np.asarray(sims, np.float64))):
        if lab is not None:
            votes[lab] = votes.get(lab, 0.0) + float(w)
    if not votes:
        return None
    best = min(votes, key=lambda lab: (-votes[lab], lab))       # a tie: the first name, not the dict's order
    return best, votes[best] / sum(votes.values())


__all__ = ["NOVEL_P", "novelty", "no_close_match", "KNN_TEMP", "knn_weights", "suggest_label"]
