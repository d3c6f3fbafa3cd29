"""File hashing without torch, so the ONNX runtime can hash its model file cheaply."""
from __future__ import annotations

import hashlib
import os


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in chunks (checkpoints and ONNX files can be large)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
