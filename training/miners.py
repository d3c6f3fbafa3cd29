"""The paper's four sampling methods (supplementary B) as miners returning fixed-size `Triplets`:
one candidate per row plus a validity mask, so shapes never depend on the data and no
``nonzero``/``.item()`` syncs the GPU (tests record the dispatched ops); all draw by inverse CDF
over the rows of a weight matrix. ``"authors"``: as the DAS authors' framework (Roth et al.'s
``batchminer/``) samples; ``"pml"``: this project's first miners, one triplet per anchor. Not PML's
own: TripletMarginMiner has no soft-hard mode and returns *all* semi-hard triplets, and its
DistanceWeightedMiner underflows to 0 at d = 512 (NaN rows). A positive is always another index
than its anchor (but the authors' self fall-back): a DAS copy equal to its anchor is a positive.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import LOSS_FLAVOURS

__all__ = ["MINERS", "Triplets", "build_miner", "RandomMiner", "SemiHardMiner",
           "SoftHardMiner", "DistanceWeightedMiner", "AuthorsRandomMiner",
           "AuthorsDistanceMiner", "distance_weighted_log_weights", "pair_masks", "draw_uniform"]

MINERS = ("random", "semihard", "softhard", "distance")


class Triplets(NamedTuple):
    """Fixed-size mined triplets: index tensors (M,) and a bool (M,) mask of the real ones."""

    anchors: Tensor
    positives: Tensor
    negatives: Tensor
    valid: Tensor

    def compact(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(a, p, n)`` of the valid rows only (a boolean index: one host sync)."""
        v = self.valid
        return self.anchors[v], self.positives[v], self.negatives[v]


def _pairwise(x: Tensor) -> Tensor:
    """Euclidean distances via the Gram matrix, as both frameworks compute them (only used to
    choose indices; the loss recomputes its own distances with gradients)."""
    sq = (x * x).sum(1)
    d2 = (sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)).clamp_min(0.0)
    d2.fill_diagonal_(0.0)
    return d2.sqrt()


def _any_rows(mask: Tensor) -> Tensor:
    """(N, 1) row-wise any(); `bool.any(dim)` is ~20x slower than a uint8 max on CPU."""
    return mask.view(torch.uint8).amax(dim=1, keepdim=True) > 0


def _draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One index per row from non-negative row weights by inverse CDF (faster than
    `torch.multinomial`, no host sync); a row without weight gets 0 (marked invalid)."""
    cdf = probs.cumsum(dim=1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=cdf.dtype) * total
    # first column whose cumulative weight exceeds u: always a column with positive weight
    idx = torch.searchsorted(cdf, u, right=True).squeeze(1)
    return torch.where(total.squeeze(1) > 0, idx.clamp(max=probs.shape[1] - 1), 0)


def draw_uniform(allowed: Tensor, generator: torch.Generator | None) -> Tensor:
    """One index per row, uniform over the row's True columns (0 for an all-False row)."""
    return _draw(allowed.float(), generator)


def pair_masks(labels: Tensor) -> tuple[Tensor, Tensor]:
    """(positives, negatives) (N, N) bool masks of a batch's labels; no row is its own positive."""
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

    def __call__(self, embeddings: Tensor, labels: Tensor, origin: Tensor | None = None
                 ) -> Triplets:
        """Triplets of the batch. ``origin`` (N,): the real embedding each row was produced
        from; when given, rows of one origin are never each other's positives
        (``das_exclude_own_copies``, off by default as in the spec and the authors' code)."""
        if embeddings.dim() != 2 or labels.shape != embeddings.shape[:1]:
            raise ValueError(f"expected embeddings (N, d) and labels (N,), got "
                             f"{tuple(embeddings.shape)} and {tuple(labels.shape)}")
        if origin is not None and origin.shape != labels.shape:
            raise ValueError(f"origin: expected shape {tuple(labels.shape)}, got {tuple(origin.shape)}")
        with torch.no_grad(), torch.autocast(embeddings.device.type, enabled=False):
            x = embeddings.detach().float()
            if self.needs_normalized:
                x = F.normalize(x, dim=1)
            pos, neg = pair_masks(labels)
            if origin is not None:
                pos = pos & (origin[:, None] != origin[None, :])
            return self.mine(_pairwise(x), pos, neg, x.shape[1])

    def mine(self, dist: Tensor, pos: Tensor, neg: Tensor, dim: int) -> Triplets:
        """One triplet per anchor, valid where it has a positive and a negative."""
        p, n = self.choose(dist, pos, neg, dim)
        a = torch.arange(dist.shape[0], device=dist.device)
        return Triplets(a, p, n, (_any_rows(pos) & _any_rows(neg)).squeeze(1))

    def choose(self, dist: Tensor, pos: Tensor, neg: Tensor, dim: int) -> tuple[Tensor, Tensor]:
        raise NotImplementedError


class RandomMiner(_TripletMiner):
    """Random sampling ("pml"): per anchor, positive and negative uniformly from their sets."""

    def choose(self, dist, pos, neg, dim):
        return draw_uniform(pos, self.generator), draw_uniform(neg, self.generator)


class AuthorsRandomMiner(_TripletMiner):
    """Random sampling as the authors' framework does it: N triplets (N = batch rows), each
    uniform over all valid (a, p, n) triplets (anchor with probability |P_a| |N_a| / sum), with
    replacement (theirs without: a rare repeat at N = 448)."""

    def mine(self, dist, pos, neg, dim):
        n_rows = dist.shape[0]
        counts = pos.float().sum(1) * neg.float().sum(1)                   # triplets per anchor
        cdf = counts.cumsum(0)
        u = torch.rand(n_rows, generator=self.generator, device=dist.device) * cdf[-1]
        a = torch.searchsorted(cdf, u, right=True).clamp_(max=n_rows - 1)
        p = draw_uniform(pos.index_select(0, a), self.generator)
        n = draw_uniform(neg.index_select(0, a), self.generator)
        return Triplets(a, p, n, (cdf[-1] > 0).expand(n_rows))


class SemiHardMiner(_TripletMiner):
    """Semi-hard (Schroff et al.), as both frameworks do it: random positive p, negative from
    ``d_ap < d_an < d_ap + margin`` (eq. IX plus FaceNet's margin window), else any negative."""

    def __init__(self, margin: float = 0.2, generator: torch.Generator | None = None) -> None:
        super().__init__(generator)
        self.margin = float(margin)

    def choose(self, dist, pos, neg, dim):
        p = draw_uniform(pos, self.generator)
        d_ap = dist.gather(1, p[:, None])
        semi = neg & (dist > d_ap) & (dist < d_ap + self.margin)
        return p, draw_uniform(_prefer(semi, neg), self.generator)


class SoftHardMiner(_TripletMiner):
    """Soft-hard (Roth et al., eq. X-XI): positive among those farther than the closest negative,
    negative among those closer than the farthest positive, each else its whole set."""

    def choose(self, dist, pos, neg, dim):
        inf = torch.full_like(dist, math.inf)
        min_neg = torch.where(neg, dist, inf).min(dim=1, keepdim=True).values
        max_pos = torch.where(pos, dist, -inf).max(dim=1, keepdim=True).values
        return (draw_uniform(_prefer(pos & (dist > min_neg), pos), self.generator),   # p, then n
                draw_uniform(_prefer(neg & (dist < max_pos), neg), self.generator))


def distance_weighted_log_weights(dist: Tensor, dim: int, cutoff: float = 0.5) -> Tensor:
    """log q(D)^-1 for unit vectors in R^dim (supp. eq. XII), D clipped below at `cutoff` (eq.
    XIII's lambda: caps very close negatives); log space, as D^-(d-2) overflows at d = 512."""
    d = dist.clamp(min=cutoff, max=2.0 - 1e-4)
    return (2.0 - dim) * torch.log(d) - ((dim - 3) / 2.0) * torch.log(1.0 - 0.25 * d * d)


class DistanceWeightedMiner(_TripletMiner):
    """Distance-weighted sampling ("pml"; Wu et al., eq. XII-XIII) on L2-normalised embeddings:
    random positive; negative with P(n|a) ~ q(D_an)^-1, D clipped at `cutoff`, zero weight from
    `nonzero_loss_cutoff` (1.4), uniform when no negative is nearer."""

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
        _, neg = pair_masks(labels)
        w = self._weights(dist, neg, dim)
        return w / w.sum(dim=1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)

    def _weights(self, dist: Tensor, neg: Tensor, dim: int) -> Tensor:
        """Unnormalised weights, each row's maximum subtracted in log space (no underflow at
        d = 512); ratios below e^-80 floored (exp's denormal path is 100x slower)."""
        near = neg & (dist < self.nonzero_loss_cutoff)
        use_near = _any_rows(near)
        allowed = torch.where(use_near, near, neg)
        log_w = distance_weighted_log_weights(dist, dim, self.cutoff)
        log_w = torch.where(use_near, log_w, torch.zeros_like(log_w))   # uniform fall-back
        # q^-1 decreases with D on [cutoff, 1.4], so the row maximum sits at the nearest
        # allowed point; masks go through arithmetic (torch.where on random masks is slow).
        a = allowed.float()
        top_d = (dist + (1.0 - a) * 4.0).amin(dim=1, keepdim=True).clamp_max(2.0 - 1e-4)
        top = distance_weighted_log_weights(top_d, dim, self.cutoff)
        top = torch.where(use_near, top, torch.zeros_like(top))
        return torch.exp((log_w - top).clamp(min=-80.0, max=0.0)) * a

    def choose(self, dist, pos, neg, dim):
        return draw_uniform(pos, self.generator), _draw(self._weights(dist, neg, dim), self.generator)


class AuthorsDistanceMiner(_TripletMiner):
    """Distance-weighted sampling as the authors' framework does it: the batch's distances as
    given, clamped below at `cutoff`, log-weights minus the row maximum, no upper cut-off (theirs
    is commented out), same-label rows weight 0, positive uniform (else the anchor itself). Kept
    differences: weights below e^-87 flushed to 0, D capped at 2 - 1e-4 (theirs: NaN)."""

    def __init__(self, cutoff: float = 0.5, generator: torch.Generator | None = None) -> None:
        super().__init__(generator)
        if not 0.0 <= cutoff < 2.0:
            raise ValueError(f"cutoff={cutoff}: expected 0 <= cutoff < 2")
        self.cutoff = float(cutoff)

    def probabilities(self, dist: Tensor, labels: Tensor, dim: int) -> Tensor:
        """(N, N) negative-sampling distribution per anchor, as their code normalises it."""
        w = self._weights(dist, labels[:, None] == labels[None, :], dim)
        return w / w.sum(dim=1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)

    def _weights(self, dist: Tensor, same: Tensor, dim: int) -> Tensor:
        log_w = distance_weighted_log_weights(dist, dim, self.cutoff)
        log_w = torch.where(same, torch.zeros_like(log_w), log_w)
        z = log_w - log_w.amax(dim=1, keepdim=True)
        w = torch.exp(z.clamp(min=-87.0))
        return torch.where(same | (z < -87.0), torch.zeros_like(w), w)

    def mine(self, dist, pos, neg, dim):
        a = torch.arange(dist.shape[0], device=dist.device)
        n = _draw(self._weights(dist, ~neg, dim), self.generator)
        p = torch.where(_any_rows(pos).squeeze(1), draw_uniform(pos, self.generator), a)
        return Triplets(a, p, n, _any_rows(neg).squeeze(1))


_CLASSES = {
    "pml": {"random": RandomMiner, "semihard": SemiHardMiner, "softhard": SoftHardMiner,
            "distance": DistanceWeightedMiner},
    "authors": {"random": AuthorsRandomMiner, "semihard": SemiHardMiner,
                "softhard": SoftHardMiner, "distance": AuthorsDistanceMiner},
}


def build_miner(name: str | None, flavour: str = "authors", **kw) -> _TripletMiner | None:
    """Miner by name: "random" | "semihard" | "softhard" | "distance" | None (whole batch), of
    ``flavour`` "authors" or "pml". Keyword arguments go to the miner (``margin``, ``cutoff``,
    ``nonzero_loss_cutoff``, ``generator``: default torch's global RNG)."""
    if flavour not in LOSS_FLAVOURS:
        raise ValueError(f"flavour={flavour!r}: expected one of {LOSS_FLAVOURS}")
    if name is None or name in ("none", "all"):
        if kw:
            raise ValueError(f"miner None takes no options, got {sorted(kw)}")
        return None
    classes = _CLASSES[flavour]
    if name not in classes:
        raise ValueError(f"unknown miner {name!r}: expected one of {MINERS} or None")
    try:
        return classes[name](**kw)
    except TypeError as e:
        raise ValueError(f"miner {name!r} ({flavour}): bad options {sorted(kw)} ({e})") from None
