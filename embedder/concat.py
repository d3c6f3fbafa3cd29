"""Several embedders as one (ranks cub-dev better than either alone): L2-normalised embeddings
concatenated, scaled by 1/sqrt(n) to keep unit length; one shared preprocessing (one ONNX input).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from .model import Embedder


@dataclass(frozen=True)
class ConcatConfig:
    """What an export records as the model's ``config``: the parts' own configs, in order."""

    parts: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    normalize: bool = True

    @property
    def backbone(self) -> str:
        return "+".join(p["backbone"] for p in self.parts)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "concat", "parts": [dict(p) for p in self.parts], "normalize": self.normalize}


class ConcatEmbedder(nn.Module):
    """``cat(e_1(x), ..., e_n(x)) / sqrt(n)`` of L2-normalised embedders sharing a preprocessing."""

    def __init__(self, parts: Sequence[Embedder]) -> None:
        super().__init__()
        if len(parts) < 2:
            raise ValueError(f"a concatenated embedder needs at least two parts, got {len(parts)}")
        pre = parts[0].preprocessing
        for p in parts:
            if not p.config.normalize:
                raise ValueError(f"every part must L2-normalise its output ({p.config.backbone} does not)")
            if p.preprocessing != pre:
                raise ValueError(f"parts must share one preprocessing: {p.config.backbone} has "
                                 f"{p.preprocessing}, the first part {pre}")
        self.parts = nn.ModuleList(parts)
        self.preprocessing = pre
        self.dim = sum(p.dim for p in parts)
        self.scale = 1.0 / math.sqrt(len(parts))
        self.config = ConcatConfig(tuple(p.config.to_dict() for p in parts))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([p(x) for p in self.parts], dim=1) * self.scale


def joined(parts: Sequence[tuple[Embedder, str]]) -> tuple[ConcatEmbedder, str]:
    """(the embedders as one, in order; the source hash its export records): each part comes with
    its own source hash (a checkpoint's file hash, a pretrained spec's weights hash), and the whole's
    is the sha256 of them joined by '+', so the same parts always export with the same source."""
    import hashlib

    model = ConcatEmbedder([p for p, _ in parts]).eval()
    return model, hashlib.sha256("+".join(h for _, h in parts).encode()).hexdigest()
