"""Training-free embedders from any timm backbone (``embedder pretrained --backbone timm:NAME``):
pooled features, no head, L2-normalised; the cached file name encodes the weights' origin too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .hashing import file_sha256
from .preprocess import Preprocessing, timm_preprocessing
from .timm_backbone import check_weights_file, is_timm, model_name


@dataclass(frozen=True)
class TimmSpec:
    """A training-free embedder from a timm backbone: hub (``weights=""``) or local weights, a
    pooling (``model``: its own head-less output), an input size (0: the model's own)."""

    backbone: str                 # "timm:<model name>"
    weights: str = ""             # local weights file ("" = timm's source, the hub)
    pooling: str = "model"        # model | cls | mean | gem (ViTs); model | avg | avgmax | gem | mean (CNNs)
    gem_p: float = 3.0
    input_size: int = 0           # 0 = the pretrained config's

    def __post_init__(self) -> None:
        if not is_timm(self.backbone):
            raise ValueError(f"--backbone must be timm:<model name>, got {self.backbone!r}")
        model_name(self.backbone)                  # one line on an unknown name
        if self.weights:
            check_weights_file(self.weights)
        if self.input_size and not 32 <= int(self.input_size) <= 1024:
            raise ValueError(f"input_size must be 0 (the model's own) or in [32, 1024], got "
                             f"{self.input_size!r}")

    @cached_property
    def _weights_sha(self) -> str:
        return file_sha256(Path(self.weights).expanduser()) if self.weights else ""

    def preprocessing(self) -> Preprocessing:
        pre = timm_preprocessing(self.backbone)
        return pre.at_size(self.input_size) if self.input_size else pre

    @property
    def model_name(self) -> str:
        """File stem of the cached export."""
        pool = f"gem{self.gem_p:g}" if self.pooling == "gem" else self.pooling
        src = f"w{self._weights_sha[:12]}" if self.weights else "hub"
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", model_name(self.backbone))
        return f"timm-{name}-{pool}-{self.preprocessing().input_size}px-{src}-l2"

    def source_hash(self) -> str:
        """The weights file's SHA-256, or the hub model it came from."""
        return self._weights_sha or f"timm-hub:{model_name(self.backbone)}"

    def embedder(self):
        """The torch embedder (pooled features, L2-normalised), in eval mode."""
        from .model import Embedder, EmbedderConfig

        cfg = EmbedderConfig(backbone=self.backbone, dim=0, pooling=self.pooling, normalize=True,
                             pretrained=True, gem_p=float(self.gem_p), weights=self.weights)
        return Embedder(cfg, preprocessing=self.preprocessing()).eval()
