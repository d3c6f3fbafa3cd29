"""The one L2 normalisation (numpy, torch-free) indexing, search and the probes share, so every
vector faiss sees was normalised the same way (inner product on unit vectors = cosine)."""
from __future__ import annotations

import numpy as np


def l2_normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Float32 copy of ``x``, each row (last axis) at unit length; a zero row stays zero."""
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)
