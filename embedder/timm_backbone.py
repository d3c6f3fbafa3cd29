"""Any timm image model, CNN or ViT, as the embedder's backbone: ``backbone = "timm:<model name>"``.
Everything model-specific comes from timm: the network, its weights (``weights = PATH``: checked
by :mod:`embedder.timm_weights`, then timm's ``load_pretrained``) and its preprocessing.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import PretrainedWeightsUnavailable

PREFIX = "timm:"
#: Weight file suffixes timm's loader reads (safetensors by suffix; the rest through torch.load).
WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")


def is_timm(backbone: str) -> bool:
    return isinstance(backbone, str) and backbone.startswith(PREFIX)


def model_name(backbone: str) -> str:
    """``timm:NAME`` -> ``NAME`` (checked: timm knows the architecture and the tag)."""
    name = backbone[len(PREFIX):] if is_timm(backbone) else backbone
    check_model_name(name)
    return name


def _how_to_list(name: str) -> str:
    arch = re.split(r"[._]", name)[0] or "vit"
    return (f"list names with python -c \"import timm; print(timm.list_models('*{arch}*', "
            "pretrained=True))\"")


def check_model_name(name: str) -> None:
    """Raise ValueError (one line, with how to find names) unless timm knows ``name``."""
    import timm
    from timm.models import get_pretrained_cfg

    if not name or not timm.is_model(name):
        raise ValueError(f"unknown timm model {name!r} in backbone 'timm:{name}'; "
                         f"{_how_to_list(name)}")
    if "." in name:
        try:
            get_pretrained_cfg(name)
        except RuntimeError as e:   # "Invalid pretrained tag (x) for arch."
            raise ValueError(f"timm model {name!r}: {e}; {_how_to_list(name)}") from None


def _pretrained_cfg(name: str) -> dict:
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name)
    return cfg.to_dict() if cfg is not None else {}


def timm_data_config(backbone: str) -> dict:
    """What timm's pretrained config says a model's input is (``resolve_data_config``)."""
    from timm.data import resolve_data_config

    name = model_name(backbone)
    dc = resolve_data_config({}, pretrained_cfg=_pretrained_cfg(name))
    chans = int(dc["input_size"][0])
    if chans not in (1, 3):
        raise ValueError(f"timm model {name!r} takes {chans} input channels; expected 1 or 3")
    return dc


def hub_hint(name: str) -> str:
    """Which file to fetch on a machine with internet, and where it goes on this one."""
    cfg = _pretrained_cfg(name)
    hub_id, url = cfg.get("hf_hub_id"), cfg.get("url")
    if hub_id:
        fname = cfg.get("hf_hub_filename") or "model.safetensors"
        cache = Path(os.environ.get("HF_HUB_CACHE") or Path(
            os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub")
        folder = cache / f"models--{hub_id.replace('/', '--')}"
        return (f"download https://huggingface.co/{hub_id}/resolve/main/{fname} elsewhere and "
                f"pass it as weights = \"PATH/{fname}\" (--weights PATH), or copy that machine's "
                f"hub cache folder {folder.name} into {cache}")
    if url:
        return (f"download {url} elsewhere and pass it as weights = \"PATH\" (--weights PATH)")
    return "timm lists no pretrained weights for it: give weights = \"PATH\" or pretrained = false"


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def check_weights_file(weights: str | os.PathLike) -> Path:
    path = Path(weights).expanduser()
    if not path.is_file():
        raise PretrainedWeightsUnavailable(f"{path}: weights file not found")
    if path.suffix.lower() not in WEIGHT_SUFFIXES:
        raise PretrainedWeightsUnavailable(
            f"{path}: expected a weights file ending in {', '.join(WEIGHT_SUFFIXES)}")
    return path


def create_timm_model(backbone: str, *, pretrained: bool = False, weights: str = "",
                      input_size: int | None = None, in_chans: int = 3):
    """The timm model without its classifier (``num_classes=0``), weights loaded by timm; another
    ``input_size`` goes as ``img_size`` to models that take one (ViTs resample positions)."""
    import timm

    name = model_name(backbone)
    path = check_weights_file(weights) if weights else None
    # a weights file: the model is made bare and the file loaded by embedder.timm_weights
    # (unwrapped, checked to fit: timm's own file loading is not strict once the classifier goes)
    kw: dict = dict(num_classes=0, in_chans=in_chans, pretrained=bool(pretrained) and path is None)
    native = (_pretrained_cfg(name).get("input_size") or (3, 224, 224))[-1]
    if input_size and int(input_size) != int(native):
        kw["img_size"] = int(input_size)
    try:
        try:
            net = timm.create_model(name, **kw)
        except TypeError as e:      # a CNN: no img_size argument, any input size works
            if "img_size" not in kw or "img_size" not in str(e):
                raise
            del kw["img_size"]
            net = timm.create_model(name, **kw)
        if path is not None:
            from .timm_weights import load_weights_file

            load_weights_file(net, path, in_chans=in_chans)
        return net
    except PretrainedWeightsUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - hub/network/file errors come in many types
        if weights:
            raise PretrainedWeightsUnavailable(
                f"{weights}: cannot load into timm model {name} ({type(e).__name__}: "
                f"{_one_line(e)})") from e
        if not pretrained:
            raise
        raise PretrainedWeightsUnavailable(
            f"cannot get the weights of timm model {name} ({type(e).__name__}; offline or "
            f"HF_HUB_OFFLINE=1?): {hub_hint(name)}") from e


def is_token_model(net) -> bool:
    """A ViT-like model: ``forward_features`` returns (B, N, C) tokens (prefix tokens first)."""
    return hasattr(net, "num_prefix_tokens") and hasattr(net, "blocks")
