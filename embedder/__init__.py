"""embedder: the model, its preprocessing, image loading, checkpoints, ONNX export and runtime.
Names are imported lazily (PEP 562): ``from embedder import OnnxEmbedder`` does not import torch.
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Embedder": "model", "EmbedderConfig": "model", "Preprocessing": "preprocess",
    "preprocessing_for": "preprocess", "load_image": "images", "ImageLoadError": "images",
    "ImageTooLargeError": "images", "open_image": "containers", "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint", "file_sha256": "hashing", "export_onnx": "export",
    "default_parity_images": "export", "OnnxEmbedder": "runtime", "default_model_path": "pretrained",
    "pretrained_embedder": "pretrained", "PretrainedWeightsUnavailable": "errors",
    "CheckpointError": "errors", "ParityError": "errors", "ModelLoadError": "errors",
    "keep_freed_memory": "decode_budget", "use_batch_budget": "decode_budget", "out_of_place": "export",
    "walk_gallery": "folders",
}
PUBLIC_MODULES = ("cli", "knn", "metrics", "pretrained", "quantize", "regions")   # `from embedder import metrics`
__all__ = sorted([*_EXPORTS, *PUBLIC_MODULES])

if TYPE_CHECKING:  # pragma: no cover
    from .checkpoint import load_checkpoint, save_checkpoint
    from .containers import open_image
    from .decode_budget import keep_freed_memory, use_batch_budget
    from .errors import CheckpointError, ModelLoadError, ParityError, PretrainedWeightsUnavailable
    from .export import default_parity_images, export_onnx, out_of_place
    from .folders import walk_gallery
    from .hashing import file_sha256
    from .images import ImageLoadError, ImageTooLargeError, load_image
    from .model import Embedder, EmbedderConfig
    from .preprocess import Preprocessing, preprocessing_for
    from .pretrained import default_model_path, pretrained_embedder
    from .runtime import OnnxEmbedder


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
