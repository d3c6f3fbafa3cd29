"""One training step's loss, shared by the trainer and the frozen-feature benchmark: ``emb =
model(x)``, gathered in DDP, ``emb, lab = das(emb, y)`` with DAS, ``loss = criterion(emb, lab)``
(plus the authors' aux loss); both call `compute_loss`, so a benchmark measures the trainer's step.
"""
from __future__ import annotations

import torch
from torch import nn

from . import distributed
from .config import TrainConfig

__all__ = ["aux_weight", "build_criterion", "build_das", "compute_loss", "step_seed"]


def build_criterion(cfg: TrainConfig, num_classes: int):
    from .losses import build_loss

    return build_loss(cfg.loss, num_classes=num_classes, dim=cfg.dim, miner=cfg.miner_name,
                      flavour=cfg.loss_flavour, **cfg.loss_options)


def build_das(cfg: TrainConfig, num_classes: int, normalize: bool):
    from .das import DAS

    return DAS(num_classes, cfg.dim, num_produce=cfg.das_num_produce, topk=cfg.das_topk,
               bank_size=cfg.das_bank_size, scale_range=cfg.das_scale_range,
               shift_scale=cfg.das_shift_scale, scale_bounds=cfg.das_scale_bounds_tuple,
               normalize=normalize, detach=cfg.das_detach, dfs=cfg.das_dfs, mts=cfg.das_mts,
               bank_dtype=getattr(torch, cfg.das_bank_dtype), seed=cfg.seed)


def aux_weight(cfg: TrainConfig) -> float | None:
    """The weight w of L(real + produced) when the authors' aux loss is on, else None: without
    DAS nothing is produced, and the plain loss keeps a baseline run the paper's baseline."""
    return float(cfg.das_aux_weight) if cfg.das and cfg.das_aux_loss else None


def step_seed(cfg: TrainConfig, global_step: int) -> int:
    """The seed of one step's miner/loss RNGs (`distributed.seeded_rng`), equal on every rank;
    primes, so runs with other seeds never replay a step's draws, and an offset that keeps off
    `seed_everything`'s stream. Changing any constant changes every run's draws."""
    return (cfg.seed * 1_000_003 + global_step * 7_919 + 17) % (2**62)


def compute_loss(model: nn.Module, criterion: nn.Module, das: nn.Module | None, x: torch.Tensor,
                 y: torch.Tensor, *, info: distributed.DistInfo, seed: int,
                 autocast_dtype: torch.dtype | None = None, aux_weight: float | None = None,
                 parts: dict[str, torch.Tensor] | None = None,
                 exclude_own_copies: bool = False) -> torch.Tensor:
    """One step's loss on the (gathered) global batch, identical on every rank (per-step seeded
    RNGs). `aux_weight` = w: ``L(real) + w * L(real + produced)``; the loss on everything runs
    first, so its draws are a run's without the aux loss. `parts` receives the detached terms."""
    dev = x.device
    with torch.autocast(device_type=dev.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        emb = model(x)
    emb, lab = distributed.gather_batch(emb.float(), y, info)
    n_real = emb.shape[0]
    origin = None
    if das is not None:
        emb, lab = das(emb, lab)
        if exclude_own_copies:  # row r of cat([v, v'_1..v'_T]) comes from real row r % n_real
            origin = torch.arange(emb.shape[0], device=emb.device) % n_real
    with distributed.seeded_rng(seed, dev):
        loss = criterion(emb, lab) if origin is None else criterion(emb, lab, origin)
        if parts is not None:
            parts["all"] = loss.detach()
        if aux_weight is not None:
            real = criterion(emb[:n_real], lab[:n_real])
            if parts is not None:
                parts["real"] = real.detach()
            loss = real + aux_weight * loss
    return loss
