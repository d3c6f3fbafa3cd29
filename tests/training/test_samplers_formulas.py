"""The four samplers (supplementary B), "pml" flavour, against their definitions on hand-made
points (the "authors" flavour: test_samplers_authors.py)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from training.miners import (DistanceWeightedMiner, build_miner,
                               distance_weighted_log_weights)


def _points_on_line(xs):
    """1-D points embedded in 2-D: distances are |x_i - x_j| exactly."""
    return torch.tensor([[float(x), 0.0] for x in xs])


def _count(miner, e, y, draws=400):
    """How often each (anchor -> positive) and (anchor -> negative) index is drawn."""
    n = len(y)
    pos, neg = torch.zeros(n, n), torch.zeros(n, n)
    for _ in range(draws):
        a, p, q = miner(e, y).compact()
        pos[a, p] += 1
        neg[a, q] += 1
    return pos / draws, neg / draws


def test_random_sampler_uniform_over_valid_sets():
    g = torch.Generator().manual_seed(0)
    miner = build_miner("random", "pml", generator=g)
    e = torch.randn(7, 3)
    y = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    pos, neg = _count(miner, e, y, draws=600)
    same = y[:, None] == y[None, :]
    eye = torch.eye(7, dtype=torch.bool)
    assert (pos[eye] == 0).all() and (pos[~same] == 0).all() and (neg[same] == 0).all()
    assert torch.allclose(pos[0, 1:4], torch.full((3,), 1 / 3), atol=0.07)
    assert torch.allclose(neg[4, [0, 1, 2, 3, 6]], torch.full((5,), 1 / 5), atol=0.06)
    a, _, _ = miner(e, y).compact()
    assert 6 not in a.tolist()                 # class 2 has no positive: no triplet


def test_semihard_picks_inside_the_margin_window():
    # anchor 0 at x=0, its positive at 0.3; negatives at 0.25 (hard), 0.35 and 0.45
    # (semi-hard: 0.3 < d < 0.5), 0.9 (easy)
    e = _points_on_line([0.0, 0.3, 0.25, 0.35, 0.45, 0.9])
    y = torch.tensor([0, 0, 1, 2, 3, 4])
    miner = build_miner("semihard", "pml", margin=0.2, generator=torch.Generator().manual_seed(1))
    _, neg = _count(miner, e, y, draws=300)
    assert set(torch.nonzero(neg[0]).flatten().tolist()) == {3, 4}
    # no negative inside the window (0.1, 0.3): falls back to any negative
    e2 = _points_on_line([0.0, 0.1, 2.0, 3.0])
    y2 = torch.tensor([0, 0, 1, 2])
    _, neg2 = _count(miner, e2, y2, draws=200)
    assert (neg2[0, 2:] > 0.3).all()           # fallback: uniform over the negatives


def test_softhard_sets():
    # anchor 0 at 0; positives at 0.2 and 1.0; negatives at 0.5 and 1.5
    e = _points_on_line([0.0, 0.2, 1.0, 0.5, 1.5])
    y = torch.tensor([0, 0, 0, 1, 2])
    miner = build_miner("softhard", "pml", generator=torch.Generator().manual_seed(2))
    pos, neg = _count(miner, e, y, draws=60)
    # positives farther than the closest negative (0.5): only index 2
    assert pos[0].tolist() == [0, 0, 1, 0, 0]
    # negatives closer than the farthest positive (1.0): only index 3
    assert neg[0].tolist() == [0, 0, 0, 1, 0]
    # anchor 3 (class 1) has no positive and no triplet
    a, _, _ = miner(e, y).compact()
    assert 3 not in a.tolist() and 4 not in a.tolist()


def _direct_probs(e, y, cutoff=0.5, top=1.4):
    """Eq. XII-XIII in float64, no logs: w = q(D)^-1, D clipped at the cut-off,
    zero beyond the largest distance and for same-class points."""
    n, d = e.shape
    x = F.normalize(e.double(), dim=1)
    probs = torch.zeros(n, n, dtype=torch.float64)
    for a in range(n):
        for j in range(n):
            if y[j] == y[a]:
                continue
            dist = (x[a] - x[j]).norm()
            if dist >= top:
                continue
            dc = max(dist, torch.tensor(cutoff, dtype=torch.float64))
            q = dc ** (d - 2) * (1 - dc ** 2 / 4) ** ((d - 3) / 2)
            probs[a, j] = 1 / q
        if probs[a].sum() > 0:
            probs[a] /= probs[a].sum()
    return probs


def test_distance_weighted_probabilities_match_eq_XII_XIII():
    g = torch.Generator().manual_seed(3)
    e = torch.randn(12, 6, generator=g)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
    miner = DistanceWeightedMiner()
    x = F.normalize(e, dim=1)
    dist = torch.cdist(x, x)
    ours = miner.probabilities(dist, y, dim=6).double()
    ref = _direct_probs(e, y)
    rows = ref.sum(1) > 0
    torch.testing.assert_close(ours[rows], ref[rows], rtol=1e-4, atol=1e-6)
    assert (ref[:, :] >= 0).all() and rows.sum() >= 8


def test_distance_weighted_draws_follow_the_probabilities():
    g = torch.Generator().manual_seed(4)
    e = torch.randn(8, 5, generator=g)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    miner = build_miner("distance", "pml", generator=torch.Generator().manual_seed(5))
    _, neg = _count(miner, e, y, draws=1500)
    ref = _direct_probs(e, y).float()
    for a in range(8):
        if ref[a].sum() > 0:
            assert (neg[a] - ref[a]).abs().max() < 0.05
        assert (neg[a][y == y[a]] == 0).all()


def test_distance_weighted_is_stable_at_d512_and_falls_back():
    g = torch.Generator().manual_seed(6)
    e = torch.randn(40, 512, generator=g)
    y = torch.arange(20).repeat_interleave(2)
    x = F.normalize(e, dim=1)
    dist = torch.cdist(x, x)
    probs = DistanceWeightedMiner().probabilities(dist, y, dim=512)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(1), torch.ones(40))
    near = (y[:, None] != y[None, :]) & (dist < 1.4)
    assert near.any(1).all()
    assert torch.equal(probs > 0, near)        # no weight underflows to 0 in log space
    # log weights: monotone decreasing in D on [0.5, 1.4) and capped below the cut-off
    d = torch.tensor([0.1, 0.5, 0.8, 1.2, 1.39])
    lw = distance_weighted_log_weights(d, 512)
    assert lw[0] == lw[1] and (lw[1:].diff() < 0).all()
    expected = (2 - 512) * math.log(0.8) - (509 / 2) * math.log(1 - 0.16)
    assert math.isclose(float(lw[2]), expected, rel_tol=1e-5)
    # all negatives beyond 1.4 (antipodal classes): uniform fall-back, no NaN
    far = torch.tensor([[1.0, 0.0], [1.0, 0.0], [-1.0, 0.0], [-1.0, 0.0]])
    a, p, n = build_miner("distance", "pml")(far, torch.tensor([0, 0, 1, 1])).compact()
    assert len(a) == 4 and ((a < 2) == (n >= 2)).all()


def test_build_miner_errors_and_none():
    assert build_miner(None) is None and build_miner("none") is None
    with pytest.raises(ValueError, match="unknown miner 'hard'"):
        build_miner("hard")
    with pytest.raises(ValueError, match="bad options"):
        build_miner("random", margin=0.3)
    with pytest.raises(ValueError, match="cutoff"):
        build_miner("distance", "pml", cutoff=2.0)
    with pytest.raises(ValueError, match="cutoff"):
        build_miner("distance", cutoff=2.0)
    with pytest.raises(ValueError, match="flavour"):
        build_miner("distance", "roth")
    with pytest.raises(ValueError, match="expected embeddings"):
        build_miner("random")(torch.randn(4, 3), torch.tensor([0, 1]))


@pytest.mark.parametrize("flavour", ["authors", "pml"])
@pytest.mark.parametrize("name", ["random", "semihard", "softhard", "distance"])
def test_origin_keeps_an_anchors_own_das_copies_out_of_its_positives(name, flavour):
    """With `origin` (the trainer's das_exclude_own_copies), no triplet pairs a row with a copy
    of the same real embedding; without it, own copies are ordinary positives (the spec)."""
    from training.das import DAS

    torch.manual_seed(0)
    v = F.normalize(torch.randn(8, 16), dim=1)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    emb, lab = DAS(4, 16, seed=0)(v, y)                      # 8 real + 3 x 8 copies
    origin = torch.arange(len(lab)) % len(y)
    miner = build_miner(name, flavour, generator=torch.Generator().manual_seed(1))
    own_with, own_without = 0, 0
    for _ in range(50):
        a, p, _, valid = miner(emb, lab, origin)
        assert len(a) == len(lab) and valid.all()             # every row still has a positive
        own_with += int((origin[a] == origin[p]).sum())
        a, p, _, _ = miner(emb, lab)
        own_without += int((origin[a] == origin[p]).sum())
    assert own_with == 0
    if name != "softhard":   # soft-hard draws positives farther than the nearest negative: never a copy
        assert own_without > 0
    with pytest.raises(ValueError, match="origin"):
        miner(emb, lab, origin[:-1])
