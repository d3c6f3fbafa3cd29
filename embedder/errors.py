"""Exception types, without torch (the CLI and serving catch them cheaply)."""
from __future__ import annotations

import os


class PathError(ValueError):
    """A bad file: ``str(e) == f"{path}: {reason}"``, a CLI's one-line message (kept when pickled)."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path, self.reason = str(path), reason
        super().__init__(f"{self.path}: {reason}")

    def __reduce__(self):
        return (type(self), (self.path, self.reason))


class CheckpointError(PathError):
    """A file that is not a loadable das-embedder checkpoint."""


class ModelLoadError(PathError):
    """Missing file, not an ONNX model, or an ONNX model that is not a das embedder."""


class ParityError(RuntimeError):
    """The exported ONNX graph does not reproduce the torch model."""


class PretrainedWeightsUnavailable(RuntimeError):
    """ImageNet weights were requested but could not be fetched (typically: no internet)."""
