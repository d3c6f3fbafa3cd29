"""One training step's loss, shared by the trainer and the frozen-feature benchmark.

``emb = model(x)``; in DDP the global batch is gathered; ``emb, lab = das(emb, y)`` when DAS
is on; ``loss = criterion(emb, lab)`` (with the authors' aux loss,
``criterion(real rows) + w * criterion(emb, lab)``). training/trainer.py runs it on images
through the embedder, benchmarks/frozen_table2.py on cached features through a small head:
both call `compute_loss`, so a benchmark figure measures exactly the trainer's step.
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
    """The weight w of L(real + produced) when the authors' aux loss is on, else None.

    The aux loss needs produced embeddings to differ from the real ones, so it only applies
    when DAS is on; with ``das = false`` the plain loss is used (a baseline run of an aux-loss
    config is then exactly the paper's baseline, not (1 + w) times it).
    """
    return float(cfg.das_aux_weight) if cfg.das and cfg.das_aux_loss else None


def step_seed(cfg: TrainConfig, global_step: int) -> int:
    """The seed of one step's miner/loss RNGs (`distributed.seeded_rng`), equal on every rank.

    ``seed * 1_000_003 + step * 7_919 + 17``, primes both: two (seed, step) pairs meet only if
    their steps differ by a multiple of 1_000_003, longer than any run, so runs with other seeds
    never replay a step's draws. The offset keeps step 0 of seed 0 off seed 0 itself, the stream
    `seed_everything` used to initialise the model; ``% 2**62`` stays inside the 64-bit seeds
    torch takes. Changing any constant changes every run's draws.
    """
    return (cfg.seed * 1_000_003 + global_step * 7_919 + 17) % (2**62)


def compute_loss(model: nn.Module, criterion: nn.Module, das: nn.Module | None, x: torch.Tensor,
                 y: torch.Tensor, *, info: distributed.DistInfo, seed: int,
                 autocast_dtype: torch.dtype | None = None, aux_weight: float | None = None,
                 parts: dict[str, torch.Tensor] | None = None,
                 exclude_own_copies: bool = False) -> torch.Tensor:
    """One step's loss on the (gathered) global batch; identical on every rank (miner and loss
    run under per-step seeded RNGs, so 2 ranks and 1 rank draw the same numbers).

    `aux_weight` = w (the authors' ``--aux_loss``, with DAS): ``L(real) + w * L(real +
    produced)``; DAS puts the real rows first, and the loss on everything runs first, so its
    draws are those of a run without the aux loss. `parts` receives the detached terms.
    """
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
