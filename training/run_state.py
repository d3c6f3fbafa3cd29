"""What a training run is made of, built once from the config and saved and restored whole:
`RunState` holds everything a resumed run needs to continue bit-exactly; `state_dict` is what
``last.pt`` holds, as tensors and plain lists (``torch.load(weights_only=True)`` reads it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from . import distributed
from .batching import ClassBalancedBatchSampler
from .config import TrainConfig
from .data import ImageDataset, Split, load_splits
from .skips import SkipLog
from .stages import StageSplit, split_stages
from .step import build_criterion, build_das

if TYPE_CHECKING:  # pragma: no cover
    from .losses import Criterion


def build_datasets(cfg: TrainConfig, train_split: Split | None = None,
                   test_split: Split | None = None) -> tuple[ImageDataset, ImageDataset]:
    """(train, test) datasets: the config's dataset, or the given parsed splits (a benchmark
    shares one parse between runs)."""
    if train_split is None or test_split is None:
        train_split, test_split = load_splits(cfg.dataset, cfg.root, max_classes=cfg.max_classes,
                                              test_classes=cfg.test_classes, test_images=cfg.test_images,
                                              holdout_alphabets=cfg.holdout_alphabets)
    pre = cfg.preprocessing()
    return (ImageDataset(train_split, pre.train_transform(), pre.mode, cfg.cache_images, pre.train_decode_side),
            ImageDataset(test_split, pre.eval_transform(), pre.mode, cfg.cache_images, pre.decode_side))


def balanced_sampler(cfg: TrainConfig, labels: Any) -> ClassBalancedBatchSampler:
    """The run's class-balanced batches. With ``fit_batch`` a batch is capped at every training class
    x ``per_class``: the photo recipe's 12 classes a batch on a team's ten folders (five train) would
    otherwise stop the run; the paper's configs keep the error (their batch is part of the recipe)."""
    batch = cfg.batch_size
    if cfg.fit_batch:
        batch = min(batch, len(set(np.asarray(labels).tolist())) * cfg.per_class)
    return ClassBalancedBatchSampler(labels, batch_size=batch, per_class=cfg.per_class, seed=cfg.seed,
                                     drop_last=True)


def build_model(cfg: TrainConfig, normalize: bool = True) -> nn.Module:
    """The embedder described by the config (preprocessing: `TrainConfig.preprocessing`)."""
    from embedder import Embedder, EmbedderConfig

    pre = cfg.preprocessing()
    return Embedder(EmbedderConfig(backbone=cfg.backbone, dim=cfg.dim, pooling=cfg.pooling,
                                   normalize=normalize, pretrained=cfg.pretrained,
                                   frozen_bn=cfg.frozen_bn, gem_p=cfg.gem_p,
                                   head_input=cfg.head_input, weights=cfg.weights), pre)


def build_components(cfg: TrainConfig, num_classes: int):
    """(model, criterion, das or None) -- what a config must be able to build without any data
    (the configs test walks every file through this)."""
    from .losses import loss_normalizes

    normalize = loss_normalizes(cfg.loss)     # N-pair and lifted train unnormalised embeddings
    model = build_model(cfg, normalize)
    # dim = 0 (no embedding layer): the loss and DAS work on the pooled features' width.
    sized = cfg if cfg.dim else dataclasses.replace(cfg, dim=model.dim)
    criterion = build_criterion(sized, num_classes)
    das = build_das(sized, num_classes, normalize) if cfg.das else None
    return model, criterion, das


def build_optimizer(cfg: TrainConfig, model: nn.Module, criterion: "Criterion",
                    split: StageSplit | None = None):
    """Adam over the trainable model (embedding layer at `lr`, backbone at `backbone_lr` when set;
    frozen stages in no group) plus the criterion's own groups at their rates."""
    if split is not None:
        backbone, head = split.backbone_params, split.head_params
    else:
        layer = getattr(model, "head", None)      # an Embedder's embedding layer (or Identity)
        split_lr = layer is not None and (cfg.backbone_lr > 0 or cfg.layer_decay)
        head_ids = {id(p) for p in layer.parameters()} if split_lr else set()
        head = [p for p in model.parameters() if p.requires_grad and id(p) in head_ids]
        backbone = [p for p in model.parameters() if p.requires_grad and id(p) not in head_ids]
        if not split_lr:                          # one group at lr
            head, backbone = backbone, []
    groups: list[dict] = [{"params": [p for p in head if p.requires_grad], "lr": cfg.lr,
                           "name": "model"}]
    if backbone and cfg.layer_decay:
        groups += _layer_decay_groups(cfg, model, [p for p in backbone if p.requires_grad])
    elif backbone:
        groups.append({"params": [p for p in backbone if p.requires_grad],
                       "lr": cfg.backbone_lr or cfg.lr, "name": "backbone"})
    extra = criterion.param_groups()
    groups += [{**g, "params": list(g["params"]), "name": g.get("name", f"criterion{i}")}
               for i, g in enumerate(extra)]
    # no empty group (dim = 0 has no embedding layer): the first group's lr is the one logged
    groups = [g for g in groups if g["params"]]
    opt = torch.optim.Adam(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.warmup_epochs <= 0:
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=cfg.milestones(),
                                                     gamma=cfg.lr_gamma)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _WarmupSteps(cfg))
    return opt, sched


def _layer_decay_groups(cfg: TrainConfig, model: nn.Module, params: list[nn.Parameter]
                        ) -> list[dict]:
    """The trainable backbone parameters in timm's layer-decay groups
    (``param_groups_layer_decay``), each at ``(backbone_lr or lr) x lr_scale`` (torch's
    schedulers, unlike timm's, need the scale in the group's lr)."""
    from timm.optim import param_groups_layer_decay

    net = getattr(model.backbone, "net", None)
    if net is None or not hasattr(net, "group_matcher"):
        raise ValueError(f"layer_decay: {cfg.backbone} has no timm layer groups")
    wanted = {id(p) for p in params}
    base = cfg.backbone_lr or cfg.lr
    groups, seen = [], set()
    for g in param_groups_layer_decay(net, weight_decay=cfg.weight_decay,
                                      layer_decay=cfg.layer_decay):
        ps = [p for p in g["params"] if id(p) in wanted]
        seen.update(id(p) for p in ps)
        if ps:
            groups.append({"params": ps, "lr": base * g["lr_scale"],
                           "weight_decay": g["weight_decay"],
                           "name": f"backbone x{g['lr_scale']:.4g}"})
    rest = [p for p in params if id(p) not in seen]     # none for timm models; kept if any
    if rest:
        groups.append({"params": rest, "lr": base, "name": "backbone"})
    return groups


class _WarmupSteps:
    """lr factor of epoch e: linear warm-up (e + 1) / (W + 1) for e < W, times lr_gamma per
    milestone passed (MultiStepLR's schedule). A class, not a lambda, so it pickles."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.warmup, self.milestones, self.gamma = cfg.warmup_epochs, cfg.milestones(), cfg.lr_gamma

    def __call__(self, e: int) -> float:
        warm = (e + 1) / (self.warmup + 1) if e < self.warmup else 1.0
        return warm * self.gamma ** sum(m <= e for m in self.milestones)


@dataclass
class RunState:
    """One run's moving parts plus its progress (``epoch`` = epochs completed)."""

    model: nn.Module
    criterion: "Criterion"
    das: nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    sampler: ClassBalancedBatchSampler       # the global batch sampler (not a rank's slice)
    device: torch.device
    split: StageSplit | None = None          # frozen/trainable cut (None: everything trains)
    epoch: int = 0
    global_step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    best_epoch: int = 0
    best_metrics: dict[str, float] = field(default_factory=dict)
    initial_metrics: dict[str, float] = field(default_factory=dict)
    skips: SkipLog = field(default_factory=SkipLog)    # unreadable images met so far

    @classmethod
    def build(cls, cfg: TrainConfig, train_labels: Any, num_classes: int, device: torch.device,
              autocast_dtype: torch.dtype | None) -> "RunState":
        """Everything freshly initialised from ``cfg.seed`` and placed on ``device``."""
        distributed.seed_everything(cfg.seed)
        model, criterion, das = build_components(cfg, num_classes)
        split = split_stages(model, cfg.trainable)
        model.to(device)
        if cfg.channels_last and device.type == "cuda":
            model.to(memory_format=torch.channels_last)
        criterion.to(device)
        if das is not None:
            das.to(device)
        opt, sched = build_optimizer(cfg, model, criterion, split)
        scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16)
        return cls(model, criterion, das, opt, sched, scaler, balanced_sampler(cfg, train_labels), device, split)

    def record_best(self, epoch: int, metrics: dict[str, float]) -> bool:
        """Note epoch ``epoch``'s evaluation; True when its R@1 is the best so far (save best.pt)."""
        if self.best_metrics and metrics["R@1"] <= self.best_metrics["R@1"]:
            return False
        self.best_epoch, self.best_metrics = epoch, metrics
        return True

    def state_dict(self) -> dict[str, Any]:
        """Everything but the model's weights, which ``save_checkpoint`` writes itself (with the
        embedder's config, so ``last.pt`` also loads as a plain checkpoint)."""
        return {"epoch": self.epoch, "global_step": self.global_step,
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "criterion": self.criterion.state_dict(),
                "das": self.das.state_dict() if self.das is not None else None,
                "sampler": self.sampler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                "rng": distributed.rng_state(self.device), "history": self.history,
                "best_epoch": self.best_epoch, "best_metrics": self.best_metrics,
                "initial_metrics": self.initial_metrics, "skipped": self.skips.state_dict()}

    def load_state_dict(self, ck: dict[str, Any]) -> None:
        """Restore from a ``last.pt`` dict (model weights under ``state_dict`` included)."""
        self.model.load_state_dict(ck["state_dict"])
        self.optimizer.load_state_dict(ck["optimizer"])
        self.scheduler.load_state_dict(ck["scheduler"])
        self.criterion.load_state_dict(ck["criterion"])
        if self.das is not None and ck.get("das") is not None:
            self.das.load_state_dict(ck["das"])  # includes its generator state (extra state)
        if ck.get("sampler") is not None:
            self.sampler.load_state_dict(ck["sampler"])
        if ck.get("scaler"):
            self.scaler.load_state_dict(ck["scaler"])
        self.history = list(ck["history"])
        self.best_epoch, self.best_metrics = int(ck["best_epoch"]), dict(ck["best_metrics"])
        self.initial_metrics = dict(ck.get("initial_metrics") or {})
        self.skips.load_state_dict(ck.get("skipped"))
        self.epoch, self.global_step = int(ck["epoch"]), int(ck["global_step"])
        distributed.set_rng_state(ck["rng"], self.device)
