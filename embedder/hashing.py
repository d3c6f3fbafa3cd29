"""File hashing without torch, so the ONNX runtime can hash its model file cheaply."""
from __future__ import annotations

import hashlib
import os


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks (checkpoints and ONNX files can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()
