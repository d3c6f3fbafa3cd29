"""A loss's distance and reducer as objects, in pytorch-metric-learning's shape: most differences
between the DAS authors' framework and PML are one of these two. Not PML's own classes: they
pick non-zero terms by boolean indexing (a host sync); these take fixed-size terms with a mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PairDistance", "MeanReducer", "NonZeroMeanReducer"]


@dataclass(frozen=True)
class PairDistance:
    """Row-wise ``(|a - b + shift|^2 + floor)^(power / 2)``, power 1 or 2: ``shift`` is torch's
    ``PairwiseDistance`` eps (the authors' contrastive loss), ``floor`` keeps a root's gradient
    finite at 0 (Wu et al.'s ``sqrt(d^2 + 1e-8)``), power 2 skips the root (their triplet)."""

    power: int = 1
    shift: float = 0.0
    floor: float = 0.0

    def __call__(self, a: Tensor, b: Tensor) -> Tensor:
        diff = a - b + self.shift if self.shift else a - b
        if self.power == 1 and not self.floor:
            return diff.norm(dim=1)    # a norm's gradient at 0 is 0, a sqrt's is not finite
        squared = diff.pow(2).sum(1) + self.floor if self.floor else diff.pow(2).sum(1)
        return squared if self.power == 2 else squared.sqrt()


class MeanReducer:
    """Mean over the terms that count (``mask``, broadcast to the terms; all when None), zero
    terms included, 0 when none counts: the authors' framework's reduction."""

    def __call__(self, terms: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is None:
            return terms.mean()
        w = mask.to(terms.dtype).expand_as(terms)
        return (w * terms).sum() / w.sum().clamp(min=1.0)


class NonZeroMeanReducer:
    """Sum of the terms that count over how many of them are > 0 (0 when none is): Wu et al.'s
    margin-loss divisor, PML's ``AvgNonZeroReducer``."""

    def __call__(self, terms: Tensor, mask: Tensor) -> Tensor:
        w = mask.to(terms.dtype).expand_as(terms)
        count = (w * (terms > 0).to(terms.dtype)).sum()
        return (w * terms).sum() / torch.where(count > 0, count, torch.ones_like(count))
