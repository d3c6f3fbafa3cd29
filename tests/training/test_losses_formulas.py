"""Each loss of the "pml" flavour against a direct (loop) implementation of its supplementary-A
equation (the "authors" flavour: test_losses_authors.py)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from training.das import DAS
from training.losses import DEFAULTS, LOSSES, build_loss


@pytest.fixture()
def batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64).float()
    y = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3])
    return x, y


def _d(a, b):
    return (a - b).norm()


def _pairs(y):
    n = len(y)
    pos = [(i, j) for i in range(n) for j in range(n) if i != j and y[i] == y[j]]
    neg = [(i, j) for i in range(n) for j in range(n) if y[i] != y[j]]
    return pos, neg


def _triplets(y):
    n = len(y)
    return [(a, p, q) for a in range(n) for p in range(n) for q in range(n)
            if a != p and y[a] == y[p] and y[q] != y[a]]


def _mean_nonzero(terms):
    terms = torch.stack(terms)
    nz = terms[terms > 0]
    return nz.mean() if len(nz) else torch.tensor(0.0)


def test_contrastive_eq_I_distance_not_squared(batch):
    x, y = batch
    v = F.normalize(x, dim=1)
    crit = build_loss("contrastive", flavour="pml", num_classes=4, dim=5, miner="none")
    pos, neg = _pairs(y)
    ref = _mean_nonzero([_d(v[i], v[j]) for i, j in pos]) + \
        _mean_nonzero([torch.relu(1.0 - _d(v[i], v[j])) for i, j in neg])
    torch.testing.assert_close(crit(v, y), ref)
    assert crit.normalize and crit.hparams["margin"] == 1.0


def test_triplet_eq_II(batch):
    x, y = batch
    v = F.normalize(x, dim=1)
    crit = build_loss("triplet", flavour="pml", num_classes=4, dim=5, miner="none")
    ref = _mean_nonzero([torch.relu(_d(v[a], v[p]) - _d(v[a], v[n]) + 0.2)
                         for a, p, n in _triplets(y)])
    torch.testing.assert_close(crit(v, y), ref)


def test_margin_eq_III_per_class_beta(batch):
    x, y = batch
    v = F.normalize(x, dim=1)
    crit = build_loss("margin", flavour="pml", num_classes=4, dim=5, miner="none")
    assert torch.equal(crit.loss.beta.detach(), torch.full((4,), 1.2))
    with torch.no_grad():
        crit.loss.beta.copy_(torch.tensor([1.1, 1.3, 0.9, 1.2]))
    beta = crit.loss.beta.detach()
    pos_terms, neg_terms = [], []
    for a, p, n in _triplets(y):
        pos_terms.append(torch.relu(0.2 + _d(v[a], v[p]) - beta[y[a]]))
        neg_terms.append(torch.relu(0.2 + beta[y[a]] - _d(v[a], v[n])))
    divisor = sum(int(t > 0) for t in pos_terms) + sum(int(t > 0) for t in neg_terms)
    ref = (torch.stack(pos_terms).sum() + torch.stack(neg_terms).sum()) / divisor
    torch.testing.assert_close(crit(v, y), ref)
    (group,) = crit.param_groups()
    assert group["lr"] == 5e-4 and group["params"][0] is crit.loss.beta
    crit(v, y).backward()
    assert crit.loss.beta.grad is not None and crit.loss.beta.grad.abs().sum() > 0


def test_generalized_lifted_eq_IV_unnormalised(batch):
    x, y = batch
    v = 2.0 * x                                                    # not on the sphere
    crit = build_loss("lifted", flavour="pml", num_classes=4, dim=5)
    assert crit.normalize is False
    terms = []
    for a in range(len(y)):
        q = [_d(v[a], v[j]) for j in range(len(y)) if j != a and y[j] == y[a]]
        r = [1.0 - _d(v[a], v[j]) for j in range(len(y)) if y[j] != y[a]]
        lq = torch.logsumexp(torch.stack(q), 0) if q else torch.tensor(0.0)
        terms.append(torch.relu(lq + torch.logsumexp(torch.stack(r), 0)))
    ref = torch.stack(terms).mean() + 5e-3 * (v ** 2).sum(1).mean()
    torch.testing.assert_close(crit(v, y), ref)


def test_npair_eq_V_dot_product_unnormalised(batch):
    x, y = batch
    v = 1.5 * x
    crit = build_loss("npair", flavour="pml", num_classes=4, dim=5)
    assert crit.normalize is False
    pos, _ = _pairs(y)
    terms = []
    for a, p in pos:
        s = sum(torch.exp(v[a] @ v[r] - v[a] @ v[p]) for r in range(len(y)) if y[r] != y[a])
        terms.append(torch.log1p(s))
    ref = torch.stack(terms).mean() + 5e-3 * (v ** 2).sum(1).mean()
    torch.testing.assert_close(crit(v, y), ref)


def test_multisimilarity_eq_VI_with_ms_mining(batch):
    x, y = batch
    v = F.normalize(x, dim=1)
    crit = build_loss("multisimilarity", flavour="pml", num_classes=4, dim=5)
    alpha, beta, lam, eps = 2.0, 40.0, 0.5, 0.1
    s = v @ v.T
    terms = []
    for a in range(len(y)):
        P = [j for j in range(len(y)) if j != a and y[j] == y[a]]
        N = [j for j in range(len(y)) if y[j] != y[a]]
        # MS mining (Wang et al.): hard positives / negatives relative to the other set
        Q = [q for q in P if s[a, q] - eps < max(s[a, j] for j in N)]
        R = [r for r in N if s[a, r] + eps > min(s[a, i] for i in P)] if P else []
        lp = (1 / alpha) * torch.log1p(sum(torch.exp(-alpha * (s[a, q] - lam)) for q in Q)) \
            if Q else torch.tensor(0.0)
        ln = (1 / beta) * torch.log1p(sum(torch.exp(beta * (s[a, r] - lam)) for r in R)) \
            if R else torch.tensor(0.0)
        terms.append(lp + ln)
    torch.testing.assert_close(crit(v, y), torch.stack(terms).mean())
    assert crit.hparams == DEFAULTS["multisimilarity"]


def test_multisimilarity_matches_pml_miner_and_loss():
    """Same values and gradients as PML's MultiSimilarityMiner + MultiSimilarityLoss, on a
    DAS-sized batch with copies (ties included)."""
    from pytorch_metric_learning import losses as pml_losses
    from pytorch_metric_learning import miners as pml_miners

    torch.manual_seed(0)
    das = DAS(20, 16, seed=0, scale_range=0.3, shift_scale=0.3)
    v = F.normalize(torch.randn(40, 16), dim=1)
    y = torch.arange(20).repeat_interleave(2)
    e, lab = das(v, y)
    ours_x = e.clone().requires_grad_()
    pml_x = e.clone().requires_grad_()
    ours = build_loss("multisimilarity", flavour="pml", num_classes=20, dim=16)(ours_x, lab)
    miner = pml_miners.MultiSimilarityMiner(epsilon=0.1)
    ref = pml_losses.MultiSimilarityLoss(alpha=2, beta=40, base=0.5)(
        pml_x, lab, miner(pml_x.detach(), lab))
    torch.testing.assert_close(ours, ref)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(ours_x.grad, pml_x.grad)


def test_normalized_softmax_eq_VII(batch):
    x, y = batch
    crit = build_loss("softmax", flavour="pml", num_classes=4, dim=5)
    W = F.normalize(crit.loss.W.detach().T, dim=1)                 # (C, d)
    logits = F.normalize(x, dim=1) @ W.T / 0.05
    ref = -torch.log_softmax(logits, dim=1)[torch.arange(len(y)), y].mean()
    torch.testing.assert_close(crit(x, y), ref)
    assert crit.param_groups()[0]["lr"] == 1e-5
    crit = build_loss("softmax", flavour="pml", num_classes=4, dim=5, proxy_lr=2e-3)
    assert crit.param_groups()[0]["lr"] == 2e-3


def test_arcface_eq_VIII(batch):
    x, y = batch
    crit = build_loss("arcface", flavour="pml", num_classes=4, dim=5)
    with torch.no_grad():                                          # proxies near their class
        W = F.normalize(torch.randn(4, 5), dim=1)
        for c in range(4):
            W[c] = F.normalize(x[y == c].mean(0), dim=0)
        crit.loss.W.copy_(W.T)
    cos = F.normalize(x, dim=1) @ W.T
    theta = torch.acos(cos.clamp(-1, 1))
    logits = 16 * cos
    rows = torch.arange(len(y))
    assert (theta[rows, y] + 0.5 < math.pi).all()
    logits[rows, y] = 16 * torch.cos(theta[rows, y] + 0.5)
    ref = F.cross_entropy(logits, y)
    torch.testing.assert_close(crit(x, y), ref, rtol=1e-4, atol=1e-4)
    assert crit.param_groups()[0]["lr"] == 5e-4


@pytest.mark.parametrize("name", LOSSES)
def test_with_das_copies_equal_to_anchor_no_self_pair_finite_grads(name):
    """A produced copy identical to its anchor is a positive at distance 0; the anchor itself
    never is. Gradients must stay finite (sqrt at 0 is the classic trap)."""
    torch.manual_seed(0)
    v = torch.randn(6, 8, requires_grad=True)
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    crit = build_loss(name, flavour="pml", num_classes=3, dim=8, miner="default")
    das = DAS(3, 8, num_produce=2, dfs=False, mts=False, normalize=False)
    e = F.normalize(v, dim=1) if crit.normalize else v
    out, lab = das(e, y)
    assert torch.equal(out[6:12], e)                                # copies == anchors exactly
    loss = crit(out, lab)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(v.grad).all()


def test_self_is_never_a_positive_pair():
    v = F.normalize(torch.randn(3, 4), dim=1)
    e = torch.cat([v, v])                                           # copy k+3 equals anchor k
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    crit = build_loss("contrastive", flavour="pml", num_classes=3, dim=4, miner="none")
    # positives: only (k, k+3) and (k+3, k), both at distance 0: no positive loss at all;
    # if (k, k) were counted it would not change the value, so check the pair structure too
    pos, neg = _pairs(y)
    assert all(i != j for i, j in pos) and len(pos) == 6
    ref = _mean_nonzero([torch.relu(1.0 - _d(e[i], e[j])) for i, j in neg])
    torch.testing.assert_close(crit(e, y), ref, rtol=1e-4, atol=1e-5)
    for miner in ("random", "semihard", "softhard", "distance"):
        for flavour in ("authors", "pml"):
            crit = build_loss("triplet", flavour=flavour, num_classes=3, dim=4, miner=miner)
            a, p, n = crit.miner(e, y).compact()
            assert len(a) == 6 and (a != p).all() and (p == (a + 3) % 6).all()
            assert (y[a] == y[p]).all() and (y[a] != y[n]).all()


@pytest.mark.parametrize("loss, miner", [
    ("triplet", "semihard"), ("triplet", "distance"), ("triplet", "random"),
    ("triplet", "softhard"), ("contrastive", "random"), ("contrastive", "distance"),
    ("margin", "distance")])
@pytest.mark.parametrize("flavour", ["authors", "pml"])
def test_paper_pairings_train_a_step(loss, miner, flavour):
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    crit = build_loss(loss, flavour=flavour, num_classes=10, dim=8, miner=miner)
    das = DAS(10, 8, seed=0)
    opt = torch.optim.SGD([*layer.parameters()], lr=0.1)
    x, y = torch.randn(20, 16), torch.arange(10).repeat_interleave(2)
    emb, lab = das(F.normalize(layer(x), dim=1), y)
    value = crit(emb, lab)
    value.backward()
    assert torch.isfinite(value) and layer.weight.grad.abs().sum() > 0
    opt.step()
    assert crit.miner_name == miner


def test_defaults_follow_the_paper():
    assert build_loss("triplet", flavour="pml", num_classes=2, dim=4, miner="default").miner_name == "distance"
    assert build_loss("margin", flavour="pml", num_classes=2, dim=4, miner="default").miner_name == "distance"
    assert build_loss("triplet", flavour="pml", num_classes=2, dim=4).miner is None       # all triplets
    for m in (None, "none", "default"):
        crit = build_loss("multisimilarity", flavour="pml", num_classes=2, dim=4, miner=m)
        assert crit.miner_name == "multisimilarity"
    assert build_loss("lifted", flavour="pml", num_classes=2, dim=4).miner is None
    assert build_loss("triplet", flavour="pml", num_classes=2, dim=4, margin=0.3).hparams["margin"] == 0.3
    arc = build_loss("arcface", flavour="pml", num_classes=2, dim=4)
    assert math.isclose(arc.loss.margin, 0.5) and arc.loss.scale == 16


@pytest.mark.parametrize("kwargs, match", [
    ({"name": "circle"}, "unknown loss"),
    ({"name": "triplet", "miner": "hardest"}, "unknown miner"),
    ({"name": "npair", "miner": "distance"}, "takes no miner"),
    ({"name": "multisimilarity", "miner": "random"}, "own MS mining"),
    ({"name": "triplet", "temperature": 0.1}, "unknown option"),
])
def test_bad_arguments(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=match):
        build_loss(name, flavour="pml", num_classes=4, dim=8, **kwargs)


def test_bfloat16_inputs_are_computed_in_float32(batch):
    x, y = batch
    crit = build_loss("multisimilarity", flavour="pml", num_classes=4, dim=5)
    v = F.normalize(x, dim=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = crit(v.bfloat16(), y)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, crit(v.bfloat16().float(), y))


def test_pairs_helper_sanity():
    pos, neg = _pairs(torch.tensor([0, 0, 1]))
    assert pos == [(0, 1), (1, 0)] and len(neg) == 4
