"""Training: DAS, losses, miners, class-balanced batches, datasets, trainer, configs, reports.

Nothing here is imported at serving time; the serving side only reads what training exports
(checkpoints and ONNX files through ``embedder``).
"""
from __future__ import annotations

from .config import TrainConfig, load_config

__all__ = ["DAS", "build_loss", "build_miner", "ClassBalancedBatchSampler", "TrainConfig",
           "TrainResult", "load_config", "train"]

_LAZY = {"DAS": ".das", "build_loss": ".losses", "build_miner": ".miners",
         "ClassBalancedBatchSampler": ".batching", "train": ".runs", "TrainResult": ".trainer"}


def __getattr__(name: str):
    # Lazy so `python -m training --help` and config errors answer without importing torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
