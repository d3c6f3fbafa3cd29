"""Checkpoints: a plain dict (state dict, model config, preprocessing) that ``torch.load(weights_only=True)``
reads, so the eval preprocessing travels with the weights to export, indexing and serving."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .files import atomic_target
from .hashing import file_sha256
from .model import Embedder, EmbedderConfig
from .preprocess import Preprocessing

FORMAT = "das-embedder/1"
_RESERVED = ("format", "config", "preprocessing", "state_dict")

__all__ = ["FORMAT", "CheckpointError", "save_checkpoint", "load_checkpoint", "file_sha256"]


def save_checkpoint(path: str | os.PathLike, model: Embedder, **extra: Any) -> Path:
    """Write atomically (temp file + rename): a crash mid-save never leaves a half checkpoint."""
    clash = set(extra) & set(_RESERVED)
    if clash:
        raise ValueError(f"save_checkpoint: extra keys {sorted(clash)} are reserved")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ckpt = {"format": FORMAT, "config": model.config.to_dict(),
            "preprocessing": model.preprocessing.to_dict(),
            "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}, **extra}
    with atomic_target(path) as tmp, open(tmp, "wb") as f:
        torch.save(ckpt, f)
    return path


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> tuple[Embedder, dict]:
    """(model in eval mode, raw checkpoint dict). Never downloads: the weights are in the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(path, "checkpoint file not found")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # pickle/zip errors come in many types
        raise CheckpointError(path, f"not a readable PyTorch checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        got = ckpt.get("format") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(path, f"not a das-embedder checkpoint (format {got!r}, expected {FORMAT!r})")
    try:
        config = EmbedderConfig.from_dict(dict(ckpt["config"]))
        pre = Preprocessing.from_dict(dict(ckpt["preprocessing"]))
        # Build without fetching pretrained weights or reading the weights file it started from
        # (which need not exist here): the state dict below overrides them anyway.
        model = Embedder(EmbedderConfig(**{**config.to_dict(), "pretrained": False, "weights": ""}),
                         pre)
        model.config = config
        model.load_state_dict(ckpt["state_dict"])
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(path, f"inconsistent checkpoint ({type(e).__name__}: {e})") from e
    return model.eval(), ckpt
