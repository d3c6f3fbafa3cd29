"""The "authors" flavour of the samplers against their framework's rules (sampling/*.py of the
released DAS code), written out by hand per anchor."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from training.miners import (AuthorsDistanceMiner, AuthorsRandomMiner, SemiHardMiner,
                               SoftHardMiner, build_miner)


def test_random_draws_n_triplets_uniform_over_all_valid_triplets():
    y = torch.tensor([0, 0, 0, 1, 1, 2])
    e = torch.randn(6, 4)
    valid = [(a, p, n) for a, p, n in itertools.product(range(6), repeat=3)
             if a != p and y[a] == y[p] and y[n] != y[a]]            # 6*3 + 2*4 = 26 triplets
    miner = build_miner("random", generator=torch.Generator().manual_seed(0))
    assert isinstance(miner, AuthorsRandomMiner)
    counts = dict.fromkeys(valid, 0)
    draws = 400
    for _ in range(draws):
        a, p, n, ok = miner(e, y)
        assert len(a) == 6 and ok.all()                              # N = batch rows triplets
        for t in zip(a.tolist(), p.tolist(), n.tolist()):
            counts[t] += 1                                           # KeyError if invalid
    freq = torch.tensor(list(counts.values()), dtype=torch.float) / (draws * 6)
    assert len(counts) == 26
    assert (freq - 1 / 26).abs().max() < 0.015                      # uniform per triplet
    # anchors are drawn by their triplet count: a class-0 anchor has 2 positives x 3 negatives
    # = 6 of the 26 triplets, a class-1 anchor 1 x 4 = 4
    a_freq = torch.zeros(6)
    for (a, _, _), c in counts.items():
        a_freq[a] += c
    a_freq /= draws * 6
    assert abs(float(a_freq[0]) - 6 / 26) < 0.03 and abs(float(a_freq[3]) - 4 / 26) < 0.03
    # no triplet at all: every row invalid, nothing crashes
    assert not build_miner("random")(e[:2], torch.tensor([0, 1])).valid.any()


def _their_probs(x, y, cutoff=0.5):
    """sampling/utils.inverse_sphere_distances for every anchor, in float64 loops."""
    n, dim = x.shape
    d = torch.cdist(x.double(), x.double()).clamp(min=cutoff)
    probs = torch.zeros(n, n, dtype=torch.float64)
    for a in range(n):
        log_q = (2.0 - dim) * torch.log(d[a]) - ((dim - 3) / 2) * torch.log(1.0 - 0.25 * d[a] ** 2)
        same = y == y[a]
        log_q[same] = 0
        q = torch.exp(log_q - log_q.max())
        q[same] = 0
        probs[a] = q / q.sum()
    return probs


def test_distance_probabilities_lower_cutoff_only_and_same_label_zero():
    g = torch.Generator().manual_seed(3)
    e = F.normalize(torch.randn(12, 6, generator=g), dim=1)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
    miner = AuthorsDistanceMiner()
    dist = torch.cdist(e, e)
    ours = miner.probabilities(dist, y, dim=6).double()
    torch.testing.assert_close(ours, _their_probs(e, y), rtol=1e-4, atol=1e-6)
    far = (dist >= 1.4) & (y[:, None] != y[None, :])
    assert far.any() and (ours[far] > 0).all()          # no upper cut-off, unlike the "pml" one
    pml = build_miner("distance", "pml")
    assert (pml.probabilities(dist, y, dim=6)[far] == 0).all()


def test_distance_draws_follow_the_probabilities_and_self_is_the_fallback_positive():
    g = torch.Generator().manual_seed(4)
    e = F.normalize(torch.randn(9, 5, generator=g), dim=1)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4])           # row 8: no other positive
    miner = build_miner("distance", generator=torch.Generator().manual_seed(5))
    ref = _their_probs(e, y).float()
    neg = torch.zeros(9, 9)
    for _ in range(1500):
        a, p, n, valid = miner(e, y)
        assert valid.all() and p[8] == 8                     # their code pairs it with itself
        assert (y[p] == y[a]).all() and (p[:8] != a[:8]).all()
        neg[a, n] += 1
    assert (neg / 1500 - ref).abs().max() < 0.05


def test_distance_is_stable_at_d512():
    g = torch.Generator().manual_seed(6)
    e = F.normalize(torch.randn(40, 512, generator=g), dim=1)
    y = torch.arange(20).repeat_interleave(2)
    probs = AuthorsDistanceMiner().probabilities(torch.cdist(e, e), y, dim=512)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(1), torch.ones(40))


@pytest.mark.parametrize("name, cls", [("semihard", SemiHardMiner), ("softhard", SoftHardMiner)])
def test_semihard_and_softhard_follow_the_same_rules_in_both_flavours(name, cls):
    assert type(build_miner(name, "authors")) is cls and type(build_miner(name, "pml")) is cls


def test_invalid_rows_are_masked_not_dropped():
    e = torch.randn(5, 3)
    y = torch.tensor([0, 0, 1, 1, 2])                        # row 4 has no positive
    for name in ("semihard", "softhard"):
        t = build_miner(name)(e, y)
        assert len(t.anchors) == 5 and t.valid.tolist() == [True] * 4 + [False]
        a, _, _ = t.compact()
        assert a.tolist() == [0, 1, 2, 3]
