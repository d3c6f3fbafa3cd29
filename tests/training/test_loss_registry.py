"""The loss registry (one table: module per flavour, defaults, miner policy), the distance and
reducer objects the losses are made of, and the import structure of the loss modules."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from training.config import LOSS_FLAVOURS
from training.loss_parts import MeanReducer, NonZeroMeanReducer, PairDistance
from training.losses import REGISTRY, build_loss, loss_normalizes
from training.miners import MINERS

TRAINING = Path(__file__).resolve().parents[2] / "training"
#: Table 2's losses with the paper's pairing (miner="default").
TABLE_2 = {"contrastive": "distance", "triplet": "distance", "margin": "distance",
           "lifted": None, "npair": None, "multisimilarity": "multisimilarity",
           "softmax": None, "arcface": None}


def test_registry_lists_table_2_with_both_flavours():
    assert set(REGISTRY) == set(TABLE_2)
    for name, spec in REGISTRY.items():
        assert set(spec.builds) == set(LOSS_FLAVOURS), name
        assert spec.miner == TABLE_2[name], name
        assert set(spec.lrs.values()) <= set(spec.defaults), name


@pytest.mark.parametrize("flavour", LOSS_FLAVOURS)
@pytest.mark.parametrize("name", list(TABLE_2))
def test_every_loss_builds_and_trains_a_step(name, flavour):
    torch.manual_seed(0)
    v = torch.randn(12, 8, requires_grad=True)
    y = torch.arange(4).repeat_interleave(3)
    crit = build_loss(name, flavour=flavour, num_classes=4, dim=8, miner="default")
    assert crit.miner_name == TABLE_2[name] and crit.flavour == flavour
    assert crit.hparams == REGISTRY[name].defaults
    assert crit.normalize == loss_normalizes(name)       # what the embedder is built with, first
    # the parameters with their own lr are the module's, at the registry's lr
    for group in crit.param_groups():
        attr = group["name"].split(".")[1]
        assert group["params"][0] is getattr(crit.loss, attr)
        assert group["lr"] == REGISTRY[name].defaults[REGISTRY[name].lrs[attr]]
    e = F.normalize(v, dim=1) if crit.normalize else v
    loss = crit(e, y)
    loss.backward()
    assert torch.isfinite(loss) and loss > 0 and torch.isfinite(v.grad).all()
    assert v.grad.abs().sum() > 0


def test_sampler_losses_take_every_sampler_and_the_others_none():
    for name, spec in REGISTRY.items():
        for miner in MINERS:
            if spec.miner == "distance":
                assert build_loss(name, num_classes=3, dim=4, miner=miner).miner_name == miner
            else:
                with pytest.raises(ValueError, match=name):
                    build_loss(name, num_classes=3, dim=4, miner=miner)


def test_pair_distance_power_shift_floor():
    a, b = torch.tensor([[3.0, 4.0], [1.0, 1.0]]), torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    assert torch.equal(PairDistance()(a, b), torch.tensor([5.0, 0.0]))
    assert torch.equal(PairDistance(power=2)(a, b), torch.tensor([25.0, 0.0]))
    torch.testing.assert_close(PairDistance(floor=1e-8)(a, b), torch.tensor([5.0, 1e-4]))
    torch.testing.assert_close(PairDistance(shift=0.5)(a, b),
                               torch.tensor([(3.5 ** 2 + 4.5 ** 2) ** 0.5, 0.5 ** 0.5]))
    # a plain norm has a finite (zero) gradient where a and b meet
    x = a.clone().requires_grad_()
    PairDistance()(x, b).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.equal(x.grad[1], torch.zeros(2))


def test_reducers_mean_over_counted_terms_and_over_non_zero_terms():
    terms = torch.tensor([0.0, 2.0, 4.0, 6.0])
    mask = torch.tensor([True, True, True, False])
    assert MeanReducer()(terms) == 3.0                        # all four
    assert MeanReducer()(terms, mask) == 2.0                  # (0 + 2 + 4) / 3, zero included
    assert NonZeroMeanReducer()(terms, mask) == 3.0           # (2 + 4) / 2
    nothing = torch.zeros(4, dtype=torch.bool)
    assert MeanReducer()(terms, nothing) == 0.0 and NonZeroMeanReducer()(terms, nothing) == 0.0
    # a per-row mask broadcasts over several terms per row
    two = torch.tensor([[1.0, 0.0], [3.0, 5.0]])
    assert NonZeroMeanReducer()(two, torch.tensor([[True], [False]])) == 1.0
    assert MeanReducer()(two, torch.tensor([[True], [False]])) == 0.5


def _relative_imports(module: str) -> list[tuple[str, bool]]:
    """(imported training module, at module level?) for each relative import of `module`."""
    tree = ast.parse((TRAINING / f"{module}.py").read_text())
    top = {id(node) for node in tree.body}
    return [(node.module or "", id(node) in top) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1]


def test_loss_modules_import_one_way_at_module_level():
    """losses -> losses_authors -> (loss_parts, miners), never back, and no import hidden in
    a function (the old cycle lived in one)."""
    graph = {m: _relative_imports(m) for m in ("losses", "losses_authors", "loss_parts", "miners")}
    assert all(top for imports in graph.values() for _, top in imports)
    assert "losses" not in {m for m, _ in graph["losses_authors"]}
    for low in ("loss_parts", "miners"):
        assert not {m for m, _ in graph[low]} & {"losses", "losses_authors"}


def test_any_pml_loss_by_class_name_with_its_proxies_at_their_own_rate():
    """`loss = "pml:<class>"`: PML's own loss, sized for the run, its values PML's, its parameters
    in their own optimizer group; a sampler's triplets reach it."""
    from pytorch_metric_learning import losses as pml_losses

    torch.manual_seed(0)
    x, y = F.normalize(torch.randn(12, 8), dim=1), torch.arange(4).repeat_interleave(3)
    crit = build_loss("pml:ProxyAnchorLoss", num_classes=4, dim=8, margin=0.2)
    ref = pml_losses.ProxyAnchorLoss(4, 8, margin=0.2)
    ref.load_state_dict(crit.loss.state_dict())
    assert crit.normalize and crit.miner is None and crit.hparams == {"margin": 0.2}
    assert crit(x, y).item() == pytest.approx(ref(x, y).item())
    [group] = crit.param_groups()
    assert group["params"][0] is crit.loss.proxies and group["params"][0].shape == (4, 8)
    assert group["lr"] == 1e-2 and build_loss("pml:ProxyAnchorLoss", num_classes=4, dim=8,
                                             proxy_lr=3e-3).param_groups()[0]["lr"] == 3e-3
    circle = build_loss("pml:CircleLoss", num_classes=4, dim=8, miner="semihard")
    v = x.clone().requires_grad_(True)
    circle(v, y).backward()
    assert circle.miner_name == "semihard" and circle.param_groups() == [] and v.grad.abs().sum() > 0


@pytest.mark.parametrize("name, options, match", [
    ("pml:Nope", {}, "unknown loss 'pml:Nope': expected pml: and a loss class"),
    ("pml:BaseMetricLossFunction", {}, "unknown loss"),
    ("pml:CircleLoss", {"q": 1}, "loss 'pml:CircleLoss': .*unexpected keyword argument 'q'"),
    ("pml:VICRegLoss", {}, "'pml:VICRegLoss' does not train on a batch of embeddings and labels"),
    ("pml:ProxyAnchorLoss", {"proxy_lr": "fast"}, "proxy_lr must be a positive number, got 'fast'"),
    ("arcfase", {}, r"unknown loss 'arcfase': expected one of .* or pml:<a pytorch-metric-learning"),
])
def test_a_loss_that_cannot_be_built_is_refused_with_its_name(name, options, match):
    with pytest.raises(ValueError, match=match):
        build_loss(name, num_classes=4, dim=8, **options)
