"""The paper's eight losses (supplementary A) behind one `Criterion`, in two flavours; `REGISTRY`
holds each loss's module per flavour, its defaults and its miner policy. ``"authors"`` (default;
the paper's configs): each loss and sampler as the DAS authors' framework computes it, since that
code produced the paper's numbers (training/losses_authors.py, training/miners.py). ``"pml"``:
pytorch-metric-learning's formulas and reductions (tests check each against its equation), but
two written here: N-pair, because PML's NPairsLoss keeps one pair per class while eq. (V) takes
every different-class embedding (DAS's too) as a negative; multi-similarity, because PML's miner
sorts the N x N matrix twice and round-trips index lists (several times the step at N = 448);
the mask form gives the same values and gradients, no sync. Any other loss of
pytorch-metric-learning is taken by its class name, ``"pml:ProxyAnchorLoss"`` (`PML_PREFIX`), with
DAS in front of it as of the eight.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from pytorch_metric_learning import distances, losses, regularizers
from torch import Tensor, nn

from . import losses_authors as authors
from .config import LOSS_FLAVOURS
from .loss_parts import MeanReducer
from .miners import MINERS, Triplets, build_miner, draw_uniform, pair_masks

__all__ = ["REGISTRY", "LossSpec", "LOSSES", "DEFAULTS", "PML_PREFIX", "Criterion", "MultiSimilarityLoss",
           "NPairLoss", "build_loss"]

_MEAN = MeanReducer()


class NPairLoss(nn.Module):
    """Eq. (V): for every ordered positive pair (a, p),
    ``log(1 + sum_{r: y_r != y_a} exp(v_a.v_r - v_a.v_p)) + nu * ||v_a||^2``, averaged (with DAS
    each copy is used). The authors' flavour: ``v * scale`` (their 1/4), `one_positive` (ONE
    drawn positive per anchor; mean over anchors with one) and ``reg_power`` 1 (a norm)."""

    def __init__(self, reg_weight: float = 5e-3, scale: float = 1.0, one_positive: bool = False,
                 reg_power: int = 2, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.reg_weight, self.scale, self.reg_power = float(reg_weight), float(scale), reg_power
        self.one_positive, self.generator = one_positive, generator

    def forward(self, embeddings: Tensor, labels: Tensor, indices_tuple=None) -> Tensor:
        z = embeddings * self.scale if self.scale != 1.0 else embeddings
        sim = z @ z.T
        pos, neg = pair_masks(labels)
        norms = z.norm(dim=1) if self.reg_power == 1 else z.pow(2).sum(dim=1)
        reg = self.reg_weight * norms.mean()
        # A large finite fill (not -inf) keeps gradients finite for anchors without negatives.
        lse_neg = torch.logsumexp(torch.where(neg, sim, torch.full_like(sim, -1e9)), 1, keepdim=True)
        s_ap = sim                                # (N, N): every positive pair counts
        if self.one_positive:                     # (N, 1): one drawn positive per anchor
            s_ap = sim.gather(1, draw_uniform(pos, self.generator)[:, None])
            pos = pos.any(1, keepdim=True)
            reg = pos.any().to(z.dtype) * reg
        return _MEAN(F.softplus(lse_neg - s_ap), pos) + reg   # log(1 + sum_r exp(s_ar - s_ap))


class MultiSimilarityLoss(nn.Module):
    """Eq. (VI) with MS mining (Wang et al.), on masks over the similarity matrix (no sync).
    Mining on detached S: positive q kept if ``S_aq - eps < max_r S_ar``, negative r if
    ``S_ar + eps > min_q S_aq``; per anchor ``1/alpha log(1 + sum_q exp(-alpha (S_aq - lambda)))
    + 1/beta log(1 + sum_r exp(beta (S_ar - lambda)))``, mean over all anchors (PML). The
    authors' flavour: ``normalize=False`` and ``skip_unmined=True`` (unmined anchors left out)."""

    def __init__(self, alpha: float = 2.0, beta: float = 40.0, base: float = 0.5,
                 epsilon: float = 0.1, normalize: bool = True, skip_unmined: bool = False) -> None:
        super().__init__()
        self.alpha, self.beta, self.base, self.epsilon = alpha, beta, base, epsilon
        self.normalize, self.skip_unmined = normalize, skip_unmined

    @staticmethod
    def mine(sim: Tensor, labels: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
        """(keep_pos, keep_neg) after MS mining of a similarity matrix."""
        pos, neg = pair_masks(labels)
        inf = torch.full_like(sim, math.inf)
        max_neg = torch.where(neg, sim, -inf).amax(dim=1, keepdim=True)
        min_pos = torch.where(pos, sim, inf).amin(dim=1, keepdim=True)
        return pos & (sim - epsilon < max_neg), neg & (sim + epsilon > min_pos)

    @staticmethod
    def log1p_sum_exp(z: Tensor, keep: Tensor) -> Tensor:
        """Row-wise ``log(1 + sum_{keep} exp(z))``, stable and exactly 0 for an empty row."""
        z = torch.where(keep, z, torch.full_like(z, -math.inf))
        return torch.logsumexp(torch.cat([z, z.new_zeros(len(z), 1)], dim=1), dim=1)

    def forward(self, embeddings: Tensor, labels: Tensor, indices_tuple=None) -> Tensor:
        x = F.normalize(embeddings, dim=1) if self.normalize else embeddings
        sim = x @ x.T
        keep_pos, keep_neg = self.mine(sim.detach(), labels, self.epsilon)
        pos = self.log1p_sum_exp(-self.alpha * (sim - self.base), keep_pos) / self.alpha
        neg = self.log1p_sum_exp(self.beta * (sim - self.base), keep_neg) / self.beta
        return _MEAN(pos + neg, keep_pos.any(1) & keep_neg.any(1) if self.skip_unmined else None)


class Criterion(nn.Module):
    """A loss with its sampler and its extra learnable parameters. `forward(embeddings, labels)`
    mines on the detached embeddings and returns the scalar loss; `normalize`: whether embedder
    and DAS L2-normalise; `param_groups()`: betas / proxies with the paper's learning rates."""

    def __init__(self, name: str, loss: nn.Module, miner: Any, normalize: bool,
                 lrs: dict[str, float], hparams: dict[str, float], miner_name: str | None,
                 flavour: str = "authors"):
        super().__init__()
        self.name, self.loss, self.miner = name, loss, miner
        self.normalize, self.hparams, self.miner_name = normalize, hparams, miner_name
        self.flavour, self._lrs = flavour, lrs

    def forward(self, embeddings: Tensor, labels: Tensor, origin: Tensor | None = None) -> Tensor:
        """Loss of the batch. ``origin`` (optional, rows' source embedding) reaches the miner, which
        then never pairs a row with a copy of itself as positive; losses without a miner ignore it."""
        if embeddings.dim() != 2 or labels.shape != embeddings.shape[:1]:
            raise ValueError(f"{self.name}: expected embeddings (N, d) and labels (N,), got "
                             f"{tuple(embeddings.shape)} and {tuple(labels.shape)}")
        # Losses run in float32: exp(40 * s) in MS or 1/T = 20 in softmax overflow bf16/fp16.
        with torch.autocast(embeddings.device.type, enabled=False):
            x = embeddings.float()
            mined: Triplets | None = (None if self.miner is None
                                      else self.miner(x.detach(), labels, origin))
            if self.flavour == "pml" and mined is not None:
                # PML's losses take index lists (and sync internally anyway)
                return self.loss(x, labels, mined.compact())
            return self.loss(x, labels, mined)

    def param_groups(self) -> list[dict]:
        """Extra parameters with their own lr, e.g. ``[{"params": [beta], "lr": 5e-4}]``."""
        params = dict(self.loss.named_parameters())
        return [{"params": [params[attr]], "lr": lr, "name": f"{self.name}.{attr}"}
                for attr, lr in self._lrs.items()]

    def extra_repr(self) -> str:
        return f"name={self.name!r}, flavour={self.flavour!r}, miner={self.miner_name!r}, " \
               f"normalize={self.normalize}, hparams={self.hparams}"


@dataclass(frozen=True)
class LossSpec:
    """One loss of the paper: everything `build_loss` needs to know about it."""

    defaults: dict[str, float]     # supplementary A, named as the modules' keywords
    #: the paper's pairing (Table 2), what ``miner="default"`` picks: a `MINERS` name (then any
    #: may be chosen), "multisimilarity" (its own MS mining only) or None (whole batch, no miner)
    miner: str | None
    #: flavour -> (hyper-parameters but the lrs, num_classes, dim) -> loss module
    builds: dict[str, Callable[[dict[str, float], int, int], nn.Module]]
    normalize: bool = True         # whether the embedder and DAS L2-normalise for it
    lrs: dict[str, str] = field(default_factory=dict)   # parameter -> hyper-parameter of its lr


#: The paper's eight losses. "pml" modules are pytorch-metric-learning's where it has the
#: formula (N-pair and MS are written above: see the module docstring), "authors" ones are
#: training/losses_authors.py's.
REGISTRY: dict[str, LossSpec] = {
    "contrastive": LossSpec({"margin": 1.0}, "distance", {
        "authors": lambda hp, c, d: authors.AuthorsContrastive(**hp),
        # pos_margin 0: positives are pulled by D itself (eq. I), not D^2.
        "pml": lambda hp, c, d: losses.ContrastiveLoss(pos_margin=0.0, neg_margin=hp["margin"])}),
    "triplet": LossSpec({"margin": 0.2}, "distance", {
        "authors": lambda hp, c, d: authors.AuthorsTriplet(**hp),
        "pml": lambda hp, c, d: losses.TripletMarginLoss(**hp)}),
    "margin": LossSpec({"margin": 0.2, "beta": 1.2, "beta_lr": 5e-4, "nu": 0.0}, "distance", {
        "authors": lambda hp, c, d: authors.AuthorsMargin(c, **hp),
        "pml": lambda hp, c, d: losses.MarginLoss(**hp, learn_beta=True, num_classes=c)},
        lrs={"beta": "beta_lr"}),
    "lifted": LossSpec({"margin": 1.0, "reg_weight": 5e-3}, None, {
        "authors": lambda hp, c, d: authors.AuthorsLifted(**hp),
        "pml": lambda hp, c, d: losses.GeneralizedLiftedStructureLoss(
            neg_margin=hp["margin"], pos_margin=0.0,
            distance=distances.LpDistance(normalize_embeddings=False),
            embedding_regularizer=regularizers.LpRegularizer(p=2, power=2),
            embedding_reg_weight=hp["reg_weight"])}, normalize=False),
    "npair": LossSpec({"reg_weight": 5e-3}, None, {
        "authors": lambda hp, c, d: NPairLoss(**hp, scale=0.25, one_positive=True, reg_power=1),
        "pml": lambda hp, c, d: NPairLoss(**hp)}, normalize=False),
    "multisimilarity": LossSpec(
        {"alpha": 2.0, "beta": 40.0, "base": 0.5, "epsilon": 0.1}, "multisimilarity", {
        "authors": lambda hp, c, d: MultiSimilarityLoss(**hp, normalize=False, skip_unmined=True),
        "pml": lambda hp, c, d: MultiSimilarityLoss(**hp)}),
    "softmax": LossSpec({"temperature": 0.05, "proxy_lr": 1e-5}, None, {   # proxy_lr 2e-3 on SOP
        "authors": lambda hp, c, d: authors.AuthorsSoftmax(c, d, **hp),
        "pml": lambda hp, c, d: losses.NormalizedSoftmaxLoss(c, d, **hp)}, lrs={"W": "proxy_lr"}),
    "arcface": LossSpec({"margin": 0.5, "scale": 16.0, "proxy_lr": 5e-4}, None, {   # radians
        "authors": lambda hp, c, d: authors.AuthorsArcFace(c, d, **hp),
        "pml": lambda hp, c, d: losses.ArcFaceLoss(   # PML takes the margin in degrees
            c, d, margin=math.degrees(hp["margin"]), scale=hp["scale"])}, lrs={"W": "proxy_lr"}),
}
#: Views of the registry: the loss names, and each loss's default hyper-parameters.
LOSSES = tuple(REGISTRY)
DEFAULTS: dict[str, dict[str, float]] = {name: spec.defaults for name, spec in REGISTRY.items()}


#: ``loss = "pml:<class>"``: any loss of ``pytorch_metric_learning.losses`` by its class name
PML_PREFIX = "pml:"
#: the learning rate of such a loss's own parameters (proxies, centres) unless ``proxy_lr`` is
#: given: Proxy-Anchor's (Kim et al. 2020: 100x the network's 1e-4)
PML_PROXY_LR = 1e-2


def loss_normalizes(name: str) -> bool:
    """Whether the loss ``name`` trains L2-normalised embeddings (N-pair and lifted do not), known
    before anything is built: the embedder is made with it."""
    return REGISTRY[name].normalize if name in REGISTRY else True


def build_loss(name: str, *, num_classes: int, dim: int, miner: str | None = None,
               flavour: str = "authors", **overrides: Any) -> Criterion:
    """The paper's loss `name` with its hyper-parameters (`DEFAULTS`, overridable by keyword) and
    the sampler its `LossSpec.miner` allows (``miner="default"``: the paper's pairing; with "pml",
    None uses every pair/triplet); ``miner_options`` go to `build_miner`. ``"pml:<class>"``:
    :func:`pml_loss`."""
    if num_classes < 1 or dim < 1:
        raise ValueError(f"num_classes={num_classes}, dim={dim}: expected both >= 1")
    if name.startswith(PML_PREFIX):
        return pml_loss(name, num_classes=num_classes, dim=dim, miner=miner, **overrides)
    if name not in REGISTRY:
        raise ValueError(f"unknown loss {name!r}: expected one of {LOSSES}, or {PML_PREFIX}<a "
                         f"pytorch-metric-learning loss class>, e.g. {PML_PREFIX}ProxyAnchorLoss")
    if flavour not in LOSS_FLAVOURS:
        raise ValueError(f"flavour={flavour!r}: expected one of {LOSS_FLAVOURS}")
    spec = REGISTRY[name]
    miner_options = dict(overrides.pop("miner_options", None) or {})
    unknown = set(overrides) - set(spec.defaults)
    if unknown:
        raise ValueError(f"loss {name!r}: unknown option(s) {sorted(unknown)}; "
                         f"expected some of {sorted(spec.defaults)}")
    hp = {**spec.defaults, **{k: float(v) for k, v in overrides.items()}}
    miner_name, miner_obj = _miner(name, spec, miner, flavour, miner_options)
    lrs = {attr: hp[key] for attr, key in spec.lrs.items()}
    module_hp = {k: v for k, v in hp.items() if k not in spec.lrs.values()}
    loss = spec.builds[flavour](module_hp, num_classes, dim)
    return Criterion(name, loss, miner_obj, spec.normalize, lrs, hp, miner_name, flavour)


def _miner(name: str, spec: LossSpec, miner: str | None, flavour: str,
           options: dict[str, Any]) -> tuple[str | None, Any]:
    """(the miner's name, the miner) of `build_loss`'s ``miner`` under the loss's mining."""
    miner_name = spec.miner if miner == "default" else miner
    if miner_name in ("none", "all"):
        miner_name = None
    if spec.miner == "multisimilarity":
        if miner_name not in (None, "multisimilarity", "ms"):
            raise ValueError(f"loss {name!r} uses its own MS mining (miner None or "
                             f"'multisimilarity'), got {miner!r}")
        return miner_name or spec.miner, None              # MS mining is part of the loss
    if spec.miner is None:
        if miner_name is not None:
            raise ValueError(f"loss {name!r} uses the whole batch; it takes no miner "
                             f"(got {miner!r})")
        return None, None
    if miner_name is not None and miner_name not in MINERS:
        raise ValueError(f"loss {name!r}: unknown miner {miner!r}; expected one of "
                         f"{MINERS} or 'none'")
    if miner_name is None and flavour == "authors":
        raise ValueError(f"loss {name!r} with flavour 'authors' needs a sampler (one of "
                         f"{MINERS}): the authors' framework always samples; use "
                         f"flavour 'pml' for all pairs/triplets of the batch")
    return miner_name, build_miner(miner_name, flavour, **options)


def pml_loss(name: str, *, num_classes: int, dim: int, miner: str | None = None,
             **options: Any) -> Criterion:
    """``"pml:<class>"``: that pytorch-metric-learning loss, built with ``options`` (its own
    keywords; ``num_classes`` and ``embedding_size`` given where it takes them), on L2-normalised
    embeddings, the whole batch or a `MINERS` sampler's triplets (PML's flavour), its parameters
    at ``proxy_lr`` (:data:`PML_PROXY_LR`). Tried on a small batch here, so a loss that cannot
    train on (embeddings, labels) (VICReg needs a second view) is refused before any data loads.
    Why not a registry entry each: the paper's eight need their flavours; these are PML's own."""
    cls = getattr(losses, name[len(PML_PREFIX):], None)
    if not (inspect.isclass(cls) and issubclass(cls, losses.BaseMetricLossFunction)) or \
            cls is losses.BaseMetricLossFunction:
        raise ValueError(f"unknown loss {name!r}: expected {PML_PREFIX} and a loss class of "
                         f"pytorch_metric_learning.losses, e.g. {PML_PREFIX}ProxyAnchorLoss")
    proxy_lr = options.pop("proxy_lr", PML_PROXY_LR)
    if isinstance(proxy_lr, bool) or not isinstance(proxy_lr, (int, float)) or not proxy_lr > 0:
        raise ValueError(f"loss {name!r}: proxy_lr must be a positive number, got {proxy_lr!r}")
    miner_options = dict(options.pop("miner_options", None) or {})
    takes = inspect.signature(cls).parameters
    sized = {k: v for k, v in (("num_classes", num_classes), ("embedding_size", dim)) if k in takes}
    miner_name = None if miner in (None, "none", "all", "default") else miner
    try:
        loss = cls(**sized, **options)
        miner_obj = build_miner(miner_name, "pml", **miner_options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"loss {name!r}: {e}") from None
    criterion = Criterion(name, loss, miner_obj, True, {p: float(proxy_lr) for p, _ in loss.named_parameters()},
                          dict(options), miner_name, "pml")
    x = F.normalize(torch.randn(8, dim, generator=torch.Generator().manual_seed(0)), dim=1)
    try:
        with torch.random.fork_rng(devices=[]):     # a miner's draws leave the run's RNG as it was
            criterion(x, torch.arange(8) % min(4, max(num_classes, 1)))
    except Exception as e:                 # noqa: BLE001 - any failure of the loss is the user's answer
        raise ValueError(f"loss {name!r} does not train on a batch of embeddings and labels: "
                         f"{type(e).__name__}: {e}") from None
    return criterion
