"""The "authors" flavour against the formulas as the DAS authors' framework computes them.

Each reference below is written by hand, per anchor / per triplet in Python loops, after the
released code (lizhaoliu-Lec/DAS loss/*.py, i.e. Roth et al.'s criteria/*.py); values and
gradients are compared in float64 on small hand-made batches. Sampled losses get hand-made
`Triplets` (with one invalid row, which must not count), so no randomness is involved.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from training.losses import build_loss
from training.miners import Triplets

EPS = 1e-6   # torch.nn.PairwiseDistance adds it to the difference


@pytest.fixture()
def batch():
    g = torch.Generator().manual_seed(0)
    x = F.normalize(torch.randn(8, 5, generator=g, dtype=torch.float64), dim=1)
    y = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3])
    return x, y


def _triplets():
    a = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    p = torch.tensor([1, 0, 3, 4, 2, 6, 5, 7])
    n = torch.tensor([2, 5, 0, 7, 6, 1, 3, 0])
    valid = torch.tensor([True] * 7 + [False])          # class 3 has no positive
    return Triplets(a, p, n, valid)


def _check(crit, x, y, ref_fn, t=None):
    """Value and input gradient of `crit.loss` against `ref_fn(x)` (both float64)."""
    ours_x = x.clone().requires_grad_()
    ref_x = x.clone().requires_grad_()
    ours = crit.loss(ours_x, y, t)
    ref = ref_fn(ref_x)
    torch.testing.assert_close(ours, ref)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(ours_x.grad, ref_x.grad)


def _valid(t):
    return [(int(a), int(p), int(n)) for a, p, n, v in zip(*t) if v]


def test_triplet_squared_distances_mean_over_all_sampled(batch):
    x, y = batch
    crit = build_loss("triplet", num_classes=4, dim=5, miner="distance").double()
    t = _triplets()

    def ref(v):
        terms = [F.relu((v[a] - v[p]).pow(2).sum() - (v[a] - v[n]).pow(2).sum() + 0.2)
                 for a, p, n in _valid(t)]
        return torch.stack(terms).mean()                 # zeros included
    _check(crit, x, y, ref, t)
    # an own copy as positive gives a vanishing, not a unit, gradient on the anchor: the
    # triplet is then (nearly) a pure push away from the negative
    a0 = torch.tensor([1.0, 0, 0, 0, 0], dtype=torch.float64)
    n0 = F.normalize(a0 + torch.tensor([0, 0.2, 0, 0, 0], dtype=torch.float64), dim=0)
    v = torch.stack([a0, a0 + 1e-3, n0]).requires_grad_()     # anchor, own copy, negative
    crit.loss(v, torch.tensor([0, 0, 1]), Triplets(torch.tensor([0]), torch.tensor([1]),
                                                   torch.tensor([2]), torch.tensor([True]))
              ).backward()
    torch.testing.assert_close(v.grad[0], 2 * (n0 - a0), atol=1e-2, rtol=0)


def test_contrastive_means_over_sampled_pairs_with_pdist_eps(batch):
    x, y = batch
    crit = build_loss("contrastive", num_classes=4, dim=5, miner="random").double()
    t = _triplets()

    def ref(v):
        pos = torch.stack([(v[a] - v[p] + EPS).norm() for a, p, _ in _valid(t)]).mean()
        neg = torch.stack([F.relu(1.0 - (v[a] - v[n] + EPS).norm()) for a, _, n in _valid(t)]).mean()
        return pos + neg
    _check(crit, x, y, ref, t)


def test_margin_plain_distances_nonzero_divisor_and_beta(batch):
    x, y = batch
    crit = build_loss("margin", num_classes=4, dim=5, miner="distance").double()
    with torch.no_grad():
        crit.loss.beta.copy_(torch.tensor([1.1, 1.3, 0.9, 1.2]))
    t = _triplets()

    def ref(v):
        beta = crit.loss.beta
        pos, neg = [], []
        for a, p, n in _valid(t):
            pos.append(F.relu(((v[a] - v[p]).pow(2).sum() + 1e-8).sqrt() - beta[y[a]] + 0.2))
            neg.append(F.relu(beta[y[a]] - ((v[a] - v[n]).pow(2).sum() + 1e-8).sqrt() + 0.2))
        count = sum(int(q > 0) for q in pos) + sum(int(q > 0) for q in neg)
        return (torch.stack(pos).sum() + torch.stack(neg).sum()) / count
    _check(crit, x, y, ref, t)
    assert crit.param_groups()[0]["lr"] == 5e-4


def test_lifted_is_per_channel_as_their_pairwise_distance_broadcast(batch):
    x, y = batch
    v0 = 2.0 * x                                          # unnormalised, as DAS leaves it
    crit = build_loss("lifted", num_classes=4, dim=5).double()
    assert crit.normalize is False

    def ref(v):
        terms = []
        for a in range(len(y)):
            q = [j for j in range(len(y)) if j != a and y[j] == y[a]]
            r = [j for j in range(len(y)) if y[j] != y[a]]
            if not q:
                continue
            # their code: PairwiseDistance((1, d, 1), (1, d, |Q|)) = a norm over the SET per channel
            pos_c = torch.stack([torch.stack([(v[a, c] - v[j, c] + EPS) ** 2 for j in q]).sum().sqrt()
                                 for c in range(v.shape[1])])
            neg_c = torch.stack([torch.stack([(v[a, c] - v[j, c] + EPS) ** 2 for j in r]).sum().sqrt()
                                 for c in range(v.shape[1])])
            terms.append(F.relu(torch.logsumexp(pos_c, 0) + torch.logsumexp(1.0 - neg_c, 0)))
        return torch.stack(terms).mean() + 5e-3 * v.norm(dim=1).mean()
    _check(crit, v0, y, ref)
    # the same numbers as their expression, literally
    a, q = v0[2].view(1, -1), v0[[3, 4]].view(1, 2, -1)
    theirs = torch.nn.PairwiseDistance(p=2)(a[:, :, None], q.permute(0, 2, 1))
    mine = torch.stack([((v0[2, c] - v0[[3, 4], c] + EPS) ** 2).sum().sqrt() for c in range(5)])
    torch.testing.assert_close(theirs.squeeze(0), mine)


def test_npair_quarter_scale_one_positive_norm_regulariser():
    g = torch.Generator().manual_seed(1)
    x = 3.0 * torch.randn(8, 5, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])              # one positive each: no randomness
    crit = build_loss("npair", num_classes=4, dim=5).double()

    def ref(v):
        z = v / 4
        terms = []
        for a in range(len(y)):
            (p,) = [j for j in range(len(y)) if j != a and y[j] == y[a]]
            s = sum(torch.exp(z[a] @ z[r] - z[a] @ z[p]) for r in range(len(y)) if y[r] != y[a])
            terms.append(torch.log(s + 1))
        return torch.stack(terms).mean() + 5e-3 * z.norm(dim=1).mean()
    _check(crit, x, y, ref)


def test_multisimilarity_skips_anchors_without_mined_pairs():
    # anchor 4 (class 2) has an easy negative set: no negative passes s + eps > min pos,
    # so their code skips it entirely (no positive term either)
    # classes 0 and 1 overlap (hard pairs); class 2 sits far away (anchors 4, 5 skipped)
    x = F.normalize(torch.tensor([[1.0, 0.1, 0], [0.7, 0.7, 0], [0.75, 0.65, 0.1], [0.2, 1, 0],
                                  [0, 0, 1], [0.05, -0.05, 1]], dtype=torch.float64), dim=1)
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    crit = build_loss("multisimilarity", num_classes=3, dim=3).double()
    alpha, beta, lam, eps = 2.0, 40.0, 0.5, 0.1

    def ref(v):
        s = v @ v.T
        terms = []
        for a in range(len(y)):
            pos = [j for j in range(len(y)) if j != a and y[j] == y[a]]
            neg = [j for j in range(len(y)) if y[j] != y[a]]
            keep_n = [j for j in neg if s[a, j] + eps > min(s[a, i] for i in pos)]
            keep_p = [j for j in pos if s[a, j] - eps < max(s[a, i] for i in neg)]
            if not keep_n or not keep_p:
                continue
            lp = torch.log(1 + sum(torch.exp(-alpha * (s[a, j] - lam)) for j in keep_p)) / alpha
            ln = torch.log(1 + sum(torch.exp(beta * (s[a, j] - lam)) for j in keep_n)) / beta
            terms.append(lp + ln)
        assert 0 < len(terms) < len(y)                    # some anchors really are skipped
        return torch.stack(terms).mean()
    _check(crit, x, y, ref)


def test_softmax_normalised_proxies_over_temperature(batch):
    x, y = batch
    crit = build_loss("softmax", num_classes=4, dim=5).double()
    bound = 1 / math.sqrt(5)
    assert crit.loss.W.shape == (4, 5) and crit.loss.W.abs().max() <= bound

    def ref(v):
        w = crit.loss.W / crit.loss.W.norm(dim=1, keepdim=True)
        return torch.stack([-torch.log_softmax(v[i] @ w.T / 0.05, 0)[y[i]]
                            for i in range(len(y))]).mean()
    _check(crit, x, y, ref)
    assert crit.param_groups()[0]["lr"] == 1e-5


def test_arcface_shifts_every_logit_so_the_margin_cancels(batch):
    x, y = batch
    crit = build_loss("arcface", num_classes=4, dim=5).double()

    def ref(v):
        w = crit.loss.W / crit.loss.W.norm(dim=1, keepdim=True)
        out = []
        for i in range(len(y)):
            c = (v[i] @ w.T).clamp(1e-10, 1 - 1e-10)
            delta = torch.cos(torch.acos(c[y[i]]) + 0.5) - c[y[i]]
            out.append(-torch.log_softmax(16 * (c + delta), 0)[y[i]])
        return torch.stack(out).mean()
    _check(crit, x, y, ref)
    # the per-row shift cancels in the softmax: the same as a margin-free scaled cosine softmax
    w = F.normalize(crit.loss.W, dim=1)
    plain = F.cross_entropy(16 * (x @ w.T).clamp(1e-10, 1 - 1e-10), y)
    torch.testing.assert_close(crit.loss(x, y, None), plain)


def test_authors_flavour_needs_a_sampler_for_triplet_losses():
    with pytest.raises(ValueError, match="needs a sampler"):
        build_loss("triplet", num_classes=2, dim=4, miner=None)
    with pytest.raises(ValueError, match="flavour"):
        build_loss("triplet", num_classes=2, dim=4, miner="distance", flavour="roth")
    assert build_loss("triplet", num_classes=2, dim=4, miner="distance").flavour == "authors"


@pytest.mark.parametrize("flavour", ["authors", "pml"])
@pytest.mark.parametrize("loss, miner", [
    ("triplet", "random"), ("triplet", "semihard"), ("triplet", "softhard"),
    ("triplet", "distance"), ("contrastive", "distance"), ("margin", "distance"),
    ("lifted", None), ("npair", None), ("multisimilarity", None), ("softmax", None),
    ("arcface", None)])
def test_no_host_sync_in_miner_and_loss(loss, miner, flavour, host_syncs):
    """The authors' flavour (miners, losses, backward) and the hand-written PML-flavour N-pair
    and MS never make a GPU wait for the host: no nonzero / item / boolean indexing."""
    from training.das import DAS

    torch.manual_seed(0)
    v = F.normalize(torch.randn(24, 16), dim=1).requires_grad_()
    y = torch.arange(12).repeat_interleave(2)
    emb, lab = DAS(12, 16, seed=0)(v, y)
    crit = build_loss(loss, num_classes=12, dim=16, miner=miner, flavour=flavour)
    with host_syncs() as rec:
        crit(emb, lab).backward()
    if flavour == "authors" or loss in ("npair", "multisimilarity"):
        assert rec.syncs == []
    assert v.grad is not None and torch.isfinite(v.grad).all()
