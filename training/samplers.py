"""The paper's four sampling methods (supplementary B) as miners returning triplets.

Each miner maps ``(embeddings, labels)`` to index triplets ``(a, p, n)`` in
pytorch-metric-learning's format, so any PML loss takes them as ``indices_tuple`` (pair
losses such as contrastive split a triplet into one positive and one negative pair).
Every anchor, real or produced by DAS, gets one positive and one negative; anchors without
a positive or a negative in the batch are skipped. A positive is always another index:
an embedding is never paired with itself, even when a DAS copy equals its anchor exactly
(that copy is a different index and a genuine positive at distance 0).

Why hand-written instead of PML's miners: these follow the per-anchor sampling of Roth et
al.'s benchmark code (which the DAS authors build on): one random positive per anchor, a
negative drawn from a candidate set, and a fall-back to any negative when the set is empty.
PML's TripletMarginMiner returns *all* semi-hard triplets, has no soft-hard mode, and its
DistanceWeightedMiner subtracts one global maximum in log space (its weights underflow to 0
at d = 512) and yields NaN rows when no negative lies under the upper cut-off.
All sampling is vectorised (inverse CDF over the rows of a weight matrix, one uniform per
anchor), so there is no Python loop over anchors.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["MINERS", "build_miner", "RandomMiner", "SemiHardMiner", "SoftHardMiner",
           "DistanceWeightedMiner", "distance_weighted_log_weights"]

MINERS = ("random", "semihard", "softhard", "distance")


def _pairwise(x: Tensor) -> Tensor:
    """Euclidean distances via the Gram matrix (only used to choose indices; the loss
    recomputes its own distances with gradients)."""
    sq = (x * x).sum(1)
    d2 = (sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)).clamp_min(0.0)
    d2.fill_diagonal_(0.0)
    return d2.sqrt()


def _any_rows(mask: Tensor) -> Tensor:
    """(N, 1) row-wise any(); `bool.any(dim)` is ~20x slower than a uint8 max on CPU."""
    return mask.view(torch.uint8).amax(dim=1, keepdim=True) > 0


def _draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One index per row from unnormalised non-negative row weights, by inverse CDF: one
    uniform per row and a search in the row's cumulative sum (several times faster than
    `torch.multinomial` on 448 x 448). Rows without any weight get index 0 (callers drop
    those anchors)."""
    cdf = probs.cumsum(dim=1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=cdf.dtype) * total
    # first column whose cumulative weight exceeds u: always a column with positive weight
    idx = torch.searchsorted(cdf, u, right=True).squeeze(1)
    return torch.where(total.squeeze(1) > 0, idx.clamp(max=probs.shape[1] - 1), 0)


def _uniform(allowed: Tensor, generator: torch.Generator | None) -> Tensor:
    return _draw(allowed.float(), generator)


def _masks(labels: Tensor) -> tuple[Tensor, Tensor]:
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(labels.shape[0], dtype=torch.bool, device=labels.device)
    return same & ~eye, ~same                       # positives exclude the index itself


def _prefer(candidates: Tensor, fallback: Tensor) -> Tensor:
    """Per row: the candidate set where it is non-empty, else the fall-back set."""
    return torch.where(_any_rows(candidates), candidates, fallback)


class _TripletMiner:
    """Base: subclasses choose positives/negatives from (distances, pos mask, neg mask)."""

    needs_normalized = False

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, embeddings: Tensor, labels: Tensor,
                 origin: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Triplets ``(a, p, n)``. ``origin`` (N,), optional: the real embedding each row was
        produced from (DAS copies share their anchor's origin). When given, rows of the same
        origin are never each other's positives: an anchor's own near-identical copies make
        triplets whose ||a - p|| gradient is a unit vector along the random DAS perturbation.
        Off by default, as the spec (and the authors' code) treat copies as ordinary positives."""
        if embeddings.dim() != 2 or labels.shape != embeddings.shape[:1]:
            raise ValueError(f"expected embeddings (N, d) and labels (N,), got "
                             f"{tuple(embeddings.shape)} and {tuple(labels.shape)}")
        if origin is not None and origin.shape != labels.shape:
            raise ValueError(f"origin: expected shape {tuple(labels.shape)}, got {tuple(origin.shape)}")
        with torch.no_grad(), torch.autocast(embeddings.device.type, enabled=False):
            x = embeddings.detach().float()
            if self.needs_normalized:
                x = F.normalize(x, dim=1)
            pos, neg = _masks(labels)
            if origin is not None:
                pos = pos & (origin[:, None] != origin[None, :])
            dist = _pairwise(x)
            p, n = self.choose(dist, pos, neg, x.shape[1])
            ok = (_any_rows(pos) & _any_rows(neg)).squeeze(1)
            a = torch.arange(x.shape[0], device=x.device)[ok]
            return a, p[ok], n[ok]

    def choose(self, dist: Tensor, pos: Tensor, neg: Tensor, dim: int) -> tuple[Tensor, Tensor]:
        raise NotImplementedError


class RandomMiner(_TripletMiner):
    """Random sampling: positive and negative uniformly from their sets."""

    def choose(self, dist, pos, neg, dim):
        return _uniform(pos, self.generator), _uniform(neg, self.generator)


class SemiHardMiner(_TripletMiner):
    """Semi-hard (Schroff et al.), as in Roth et al.'s code: random positive p, negative from
    ``d_ap < d_an < d_ap + margin`` (eq. IX plus FaceNet's margin window), else any negative."""

    def __init__(self, margin: float = 0.2, generator: torch.Generator | None = None) -> None:
        super().__init__(generator)
        self.margin = float(margin)

    def choose(self, dist, pos, neg, dim):
        p = _uniform(pos, self.generator)
        d_ap = dist.gather(1, p[:, None])
        semi = neg & (dist > d_ap) & (dist < d_ap + self.margin)
        return p, _uniform(_prefer(semi, neg), self.generator)


class SoftHardMiner(_TripletMiner):
    """Soft-hard (Roth et al., eq. X-XI): positive from those farther than the closest
    negative, negative from those closer than the farthest positive; each falls back to its
    whole set when that is empty."""

    def choose(self, dist, pos, neg, dim):
        inf = torch.full_like(dist, math.inf)
        min_neg = torch.where(neg, dist, inf).min(dim=1, keepdim=True).values
        max_pos = torch.where(pos, dist, -inf).max(dim=1, keepdim=True).values
        p = _uniform(_prefer(pos & (dist > min_neg), pos), self.generator)
        n = _uniform(_prefer(neg & (dist < max_pos), neg), self.generator)
        return p, n


def distance_weighted_log_weights(dist: Tensor, dim: int, cutoff: float = 0.5) -> Tensor:
    """log q(D)^-1 for unit vectors in R^dim (supp. eq. XII), with D clipped below at `cutoff`.

    q(D) ~ D^(d-2) (1 - D^2/4)^((d-3)/2); the lower clip is the lambda cut-off of eq. XIII
    (Wu et al.'s code): it caps the weight of very close negatives. Log space avoids the
    overflow of D^-(d-2) at d = 512.
    """
    d = dist.clamp(min=cutoff, max=2.0 - 1e-4)
    return (2.0 - dim) * torch.log(d) - ((dim - 3) / 2.0) * torch.log(1.0 - 0.25 * d * d)


class DistanceWeightedMiner(_TripletMiner):
    """Distance-weighted sampling (Wu et al., eq. XII-XIII): random positive; negative with
    P(n|a) ~ q(D_an)^-1, D clipped at `cutoff` (0.5), zero weight at D >= `nonzero_loss_cutoff`
    (1.4, "largest distance"); uniform over negatives when none is under that distance.
    Distances are taken on L2-normalised embeddings, the hypersphere the formula assumes."""

    needs_normalized = True

    def __init__(self, cutoff: float = 0.5, nonzero_loss_cutoff: float = 1.4,
                 generator: torch.Generator | None = None) -> None:
        super().__init__(generator)
        if not 0.0 <= cutoff < nonzero_loss_cutoff:
            raise ValueError(f"cutoff={cutoff}, nonzero_loss_cutoff={nonzero_loss_cutoff}: "
                             "expected 0 <= cutoff < nonzero_loss_cutoff")
        self.cutoff, self.nonzero_loss_cutoff = float(cutoff), float(nonzero_loss_cutoff)

    def probabilities(self, dist: Tensor, labels: Tensor, dim: int) -> Tensor:
        """(N, N) negative-sampling distribution per anchor (rows sum to 1 where any negative)."""
        _, neg = _masks(labels)
        w = self._weights(dist, neg, dim)
        return w / w.sum(dim=1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)

    def _weights(self, dist: Tensor, neg: Tensor, dim: int) -> Tensor:
        """Unnormalised weights. Each row's own maximum is subtracted in log space, so nothing
        underflows at d = 512, where the weights span hundreds of orders of magnitude; ratios
        below e^-80 are floored there (exp's denormal path is 100x slower, and such a
        negative is never drawn in practice)."""
        log_w, allowed = self._log_weights(dist, neg, dim)
        # q^-1 decreases with D on [cutoff, 1.4], so the row maximum sits at the nearest
        # allowed point; masks go through arithmetic (torch.where on random masks is slow).
        a = allowed.float()
        top_d = (dist + (1.0 - a) * 4.0).amin(dim=1, keepdim=True).clamp_max(2.0 - 1e-4)
        top = distance_weighted_log_weights(top_d, dim, self.cutoff)
        top = torch.where(_any_rows(self._near(dist, neg)), top, torch.zeros_like(top))
        return torch.exp((log_w - top).clamp(min=-80.0, max=0.0)) * a

    def _near(self, dist: Tensor, neg: Tensor) -> Tensor:
        return neg & (dist < self.nonzero_loss_cutoff)

    def _log_weights(self, dist: Tensor, neg: Tensor, dim: int) -> tuple[Tensor, Tensor]:
        log_w = distance_weighted_log_weights(dist, dim, self.cutoff)
        near = self._near(dist, neg)
        use_near = _any_rows(near)
        allowed = torch.where(use_near, near, neg)
        log_w = torch.where(use_near, log_w, torch.zeros_like(log_w))   # uniform fall-back
        return log_w, allowed

    def choose(self, dist, pos, neg, dim):
        return _uniform(pos, self.generator), _draw(self._weights(dist, neg, dim), self.generator)


def build_miner(name: str | None, **kw) -> _TripletMiner | None:
    """Miner by name: "random" | "semihard" | "softhard" | "distance" | None (whole batch).

    Keyword arguments go to the miner: ``margin`` (semihard), ``cutoff`` and
    ``nonzero_loss_cutoff`` (distance), ``generator`` (all; default: torch's global RNG).
    """
    if name is None or name in ("none", "all"):
        if kw:
            raise ValueError(f"miner None takes no options, got {sorted(kw)}")
        return None
    classes = {"random": RandomMiner, "semihard": SemiHardMiner, "softhard": SoftHardMiner,
               "distance": DistanceWeightedMiner}
    if name not in classes:
        raise ValueError(f"unknown miner {name!r}: expected one of {MINERS} or None")
    try:
        return classes[name](**kw)
    except TypeError as e:
        raise ValueError(f"miner {name!r}: bad options {sorted(kw)} ({e})") from None
