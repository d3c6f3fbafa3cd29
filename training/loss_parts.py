"""What a loss is made of besides its formula: a distance and a reducer, as data.

Most differences between the DAS authors' framework and pytorch-metric-learning are one of
these two (triplet: squared vs plain distances; mean over all sampled terms vs over the non-zero
ones), so the losses of training/losses_authors.py and training/losses.py take them as
arguments, in pytorch-metric-learning's shape (a loss = a small class over a distance and a
reducer). Hand-written rather than PML's `LpDistance` / `MeanReducer` / `AvgNonZeroReducer`:
those work on whole distance matrices or index lists and select the non-zero terms by boolean
indexing (a host sync and data-dependent shapes); these take fixed-size term tensors with a
validity mask, so the authors' flavour never syncs with the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PairDistance", "MeanReducer", "NonZeroMeanReducer", "Reducer"]


@dataclass(frozen=True)
class PairDistance:
    """Row-wise ``(|a - b + shift|^2 + floor)^(power / 2)`` of two (M, d) tensors.

    ``shift`` is torch's ``PairwiseDistance`` eps (added to the difference, as the authors'
    contrastive loss computes it); ``floor`` keeps the root's gradient finite at 0 (Wu et al.'s
    ``sqrt(d^2 + 1e-8)``); ``power`` 2 skips the root (the authors' triplet loss).
    """

    power: int = 1          # 1 or 2
    shift: float = 0.0
    floor: float = 0.0

    def __post_init__(self) -> None:
        if self.power not in (1, 2):
            raise ValueError(f"PairDistance power={self.power}: expected 1 or 2")

    def __call__(self, a: Tensor, b: Tensor) -> Tensor:
        diff = a - b + self.shift if self.shift else a - b
        if self.power == 1 and not self.floor:
            return diff.norm(dim=1)    # a norm's gradient at 0 is 0, a sqrt's is not finite
        squared = diff.pow(2).sum(1) + self.floor if self.floor else diff.pow(2).sum(1)
        return squared if self.power == 2 else squared.sqrt()


def _weights(terms: Tensor, mask: Tensor | None) -> Tensor:
    """The 0/1 weight of each term: the mask (broadcast over the terms), or all ones."""
    if mask is None:
        return torch.ones_like(terms)
    return mask.to(terms.dtype).expand_as(terms)


class MeanReducer:
    """Mean over the terms that count (``mask``; all when None), zero terms included; 0 when
    none counts. The authors' framework's reduction (PML's ``MeanReducer``)."""

    def __call__(self, terms: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is None:
            return terms.mean()
        w = _weights(terms, mask)
        return (w * terms).sum() / w.sum().clamp(min=1.0)


class NonZeroMeanReducer:
    """Sum of the terms that count divided by how many of them are > 0 (0 when none is): Wu et
    al.'s margin loss divisor, PML's ``AvgNonZeroReducer``."""

    def __call__(self, terms: Tensor, mask: Tensor | None = None) -> Tensor:
        w = _weights(terms, mask)
        count = (w * (terms > 0).to(terms.dtype)).sum()
        return (w * terms).sum() / torch.where(count > 0, count, torch.ones_like(count))


#: Either reduction; a loss calls it as ``reducer(terms, mask)``.
Reducer = MeanReducer | NonZeroMeanReducer
