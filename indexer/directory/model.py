"""Loading the embedder an index is built or searched with (both sides of the indexer use it)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import IndexerError

if TYPE_CHECKING:
    from embedder import OnnxEmbedder


def load_embedder(model: str | Path | None, *, device: str = "auto", batch_size: int = 32,
                  threads: int | None = None) -> OnnxEmbedder:
    """An OnnxEmbedder for ``model`` (default: the offline pretrained embedder)."""
    from embedder import OnnxEmbedder

    if model is None:
        from embedder import default_model_path

        model = default_model_path()
    path = Path(model)
    if not path.is_file():
        raise IndexerError(f"{path}: model not found (expected an .onnx file exported by "
                           "`python -m embedder export`)")
    try:
        return OnnxEmbedder(path, device=device, threads=threads, batch_size=batch_size)
    except (ValueError, RuntimeError) as e:   # embedder's ModelLoadError is a ValueError
        raise IndexerError(str(e).splitlines()[0]) from None


def model_info(embedder: OnnxEmbedder, file: str) -> dict:
    """What the manifest records about the embedder (``file``: its copy in the directory)."""
    return {"hash": embedder.model_hash, "file": file, "source": str(Path(embedder.path).resolve()),
            "dim": int(embedder.dim), "normalized": bool(embedder.normalized),
            "backbone": embedder.backbone,
            "metadata": dict(embedder.metadata)}
