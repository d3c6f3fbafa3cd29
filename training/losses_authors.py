"""The paper's losses as the DAS authors' framework computes them (``loss_flavour = "authors"``):
the code that produced the paper's numbers (lizhaoliu-Lec/DAS ``loss/``, itself Roth et al.'s
``criteria/``). No library ships them, and several differ from both supplementary A and
pytorch-metric-learning (``"pml"``), as each class says; tests compare each with a loop over its
formula. N-pair and multi-similarity are training/losses.py's classes with other arguments. Sampled
losses weight `Triplets`' invalid rows 0 and divide by the valid count (no host sync).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .loss_parts import MeanReducer, NonZeroMeanReducer, PairDistance
from .miners import Triplets, pair_masks

__all__ = ["AuthorsTriplet", "AuthorsContrastive", "AuthorsMargin", "AuthorsLifted",
           "AuthorsSoftmax", "AuthorsArcFace"]

_PDIST_EPS = 1e-6      # torch.nn.PairwiseDistance's default eps (added to the difference)
_MEAN = MeanReducer()


def _gather(x: Tensor, t: Triplets) -> tuple[Tensor, Tensor, Tensor]:
    return x.index_select(0, t.anchors), x.index_select(0, t.positives), x.index_select(0, t.negatives)


class AuthorsTriplet(nn.Module):
    """``reducer_t relu(D(a, p) - D(a, n) + margin)`` over the sampled triplets; the authors':
    D = squared distance, mean over all valid triplets (PML: plain distance, non-zero mean)."""

    def __init__(self, margin: float = 0.2, distance: PairDistance = PairDistance(power=2),
                 reducer: MeanReducer | NonZeroMeanReducer = _MEAN) -> None:
        super().__init__()
        self.margin, self.distance, self.reducer = float(margin), distance, reducer

    def forward(self, x: Tensor, labels: Tensor, t: Triplets) -> Tensor:
        a, p, n = _gather(x, t)
        per = F.relu(self.distance(a, p) - self.distance(a, n) + self.margin)
        return self.reducer(per, t.valid)


class AuthorsContrastive(nn.Module):
    """``reducer relu(D(a, p) - pos_margin) + reducer relu(neg_margin - D(a, n))``; the authors':
    ``D = |a - b + eps|`` (torch's PairwiseDistance), means over all valid triplets' pairs, zeros
    included (PML: over the non-zero pairs)."""

    def __init__(self, margin: float = 1.0, pos_margin: float = 0.0,
                 distance: PairDistance = PairDistance(shift=_PDIST_EPS),
                 reducer: MeanReducer | NonZeroMeanReducer = _MEAN) -> None:
        super().__init__()
        self.neg_margin, self.pos_margin = float(margin), float(pos_margin)
        self.distance, self.reducer = distance, reducer

    def forward(self, x: Tensor, labels: Tensor, t: Triplets) -> Tensor:
        a, p, n = _gather(x, t)
        pos = self.reducer(F.relu(self.distance(a, p) - self.pos_margin), t.valid)
        return pos + self.reducer(F.relu(self.neg_margin - self.distance(a, n)), t.valid)


class AuthorsMargin(nn.Module):
    """Wu et al.'s margin loss on ``d = sqrt(|x-y|^2 + 1e-8)``: ``relu(d_ap - beta + m)`` and
    ``relu(beta - d_an + m)``, a learnable beta per class, over the non-zero terms (+ nu sum beta)."""

    def __init__(self, num_classes: int, margin: float = 0.2, beta: float = 1.2,
                 nu: float = 0.0, distance: PairDistance = PairDistance(floor=1e-8),
                 reducer: MeanReducer | NonZeroMeanReducer = NonZeroMeanReducer()) -> None:
        super().__init__()
        self.margin, self.nu = float(margin), float(nu)
        self.distance, self.reducer = distance, reducer
        self.beta = nn.Parameter(torch.full((num_classes,), float(beta)))

    def forward(self, x: Tensor, labels: Tensor, t: Triplets) -> Tensor:
        a, p, n = _gather(x, t)
        beta = self.beta.index_select(0, labels.index_select(0, t.anchors)).to(x.dtype)
        terms = torch.stack([F.relu(self.distance(a, p) - beta + self.margin),
                             F.relu(beta - self.distance(a, n) + self.margin)], dim=1)
        loss = self.reducer(terms, t.valid[:, None])
        if self.nu:
            loss = loss + self.nu * (t.valid.to(x.dtype) * beta).sum()
        return loss


class AuthorsLifted(nn.Module):
    """Their generalised lifted structure loss, NOT eq. (IV) (kept: the paper's GenLifted rows ran
    it): PairwiseDistance broadcasting takes, per anchor and CHANNEL, the norm across the set:
    ``relu(LSE_c sqrt(sum_q (a_c - q_c + eps)^2) + LSE_c (margin - sqrt(sum_r (a_c - r_c + eps)^2)))``,
    mean over anchors with a positive, + ``reg_weight * mean_i ||x_i||``. The per-channel sums
    are expanded (``|Q| u_c^2 - 2 u_c sum_q q_c + sum_q q_c^2``, ``u = a + eps``): two matrix
    products instead of an (N, N, d) tensor; the cancellation is harmless (tested)."""

    def __init__(self, margin: float = 1.0, reg_weight: float = 5e-3) -> None:
        super().__init__()
        self.margin, self.reg_weight = float(margin), float(reg_weight)

    @staticmethod
    def _set_norms(x: Tensor, members: Tensor) -> Tensor:
        """(N, d): ``sqrt(sum_{j in set(a)} (x_ac - x_jc + eps)^2)`` per anchor a and channel c."""
        m = members.to(x.dtype)
        u = x + _PDIST_EPS
        s = m.sum(1, keepdim=True) * u * u - 2 * u * (m @ x) + m @ (x * x)
        # an empty set gives 0, whose sqrt has an infinite gradient: such anchors are dropped
        # (positives) or impossible in class-balanced batches (negatives); keep sqrt finite
        return s.clamp_min(1e-30).sqrt()

    def forward(self, x: Tensor, labels: Tensor, t: Triplets | None = None) -> Tensor:
        pos, neg = pair_masks(labels)
        term = F.relu(torch.logsumexp(self._set_norms(x, pos), 1)
                      + torch.logsumexp(self.margin - self._set_norms(x, neg), 1))
        return _MEAN(term, pos.any(1)) + self.reg_weight * x.norm(dim=1).mean()


def _proxies(num_classes: int, dim: int) -> nn.Parameter:
    bound = 1.0 / math.sqrt(dim)
    return nn.Parameter(torch.empty(num_classes, dim).uniform_(-bound, bound))


class AuthorsSoftmax(nn.Module):
    """Normalised softmax: ``CE(x . normalize(W)^T / temperature)``, mean over the batch."""

    def __init__(self, num_classes: int, dim: int, temperature: float = 0.05) -> None:
        super().__init__()
        self.temperature = float(temperature)
        self.W = _proxies(num_classes, dim)

    def forward(self, x: Tensor, labels: Tensor, t: Triplets | None = None) -> Tensor:
        return F.cross_entropy(x @ F.normalize(self.W, dim=1).T / self.temperature, labels)


class AuthorsArcFace(nn.Module):
    """Their ArcFace: ``c = clamp(x . normalize(W)^T, 1e-10, 1 - 1e-10)``,
    ``logits = s * (c + (cos(acos(c_y) + m) - c_y)[:, None])``, CE mean: EVERY logit of the row is
    shifted, so the margin has no effect (it trains ``CE(s * c)``). Kept (README)."""

    def __init__(self, num_classes: int, dim: int, margin: float = 0.5, scale: float = 16.0) -> None:
        super().__init__()
        self.margin, self.scale = float(margin), float(scale)
        self.W = _proxies(num_classes, dim)

    def forward(self, x: Tensor, labels: Tensor, t: Triplets | None = None) -> Tensor:
        cos = (x @ F.normalize(self.W, dim=1).T).clamp(min=1e-10, max=1 - 1e-10)
        c_y = cos.gather(1, labels[:, None]).squeeze(1)
        shifted = torch.cos(torch.acos(c_y) + self.margin)
        return F.cross_entropy(self.scale * (cos + (shifted - c_y)[:, None]), labels)
