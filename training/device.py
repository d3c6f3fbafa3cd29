"""Which device a run trains on, and in which precision. Two traps: ``torch.cuda.set_device``
refuses an index-less ``torch.device("cuda")``, and under torchrun every rank must take the GPU
``LOCAL_RANK`` names, or all ranks pile onto one card.
"""
from __future__ import annotations

import warnings

import torch

from .distributed import DistInfo

__all__ = ["resolve_device", "amp_dtype"]


def resolve_device(name: str, info: DistInfo | None = None) -> torch.device:
    """The ``torch.device`` this process trains on (made current on CUDA): ``auto`` is ``cuda``
    when visible, else ``cpu``; index-less ``cuda`` is the current device, or ``cuda:LOCAL_RANK``
    under torchrun; ``cuda:N`` as given in a single process."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device={name!r}: expected auto, cpu, cuda or cuda:N ({e})") from None
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise RuntimeError(f"device={name!r} requested but CUDA is not available "
                           "(use --device cpu, or install the CUDA build of torch)")
    count = torch.cuda.device_count()
    if info is not None and info.enabled:
        if dev.index is not None and dev.index != info.local_rank:
            warnings.warn(f"device={name!r} ignored under torchrun: rank {info.rank} uses "
                          f"cuda:{info.local_rank} (its LOCAL_RANK)", stacklevel=2)
        index = info.local_rank
    else:
        index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < count:
        raise RuntimeError(f"device={name!r}: CUDA device {index} requested but only {count} "
                           "visible (check CUDA_VISIBLE_DEVICES / --nproc_per_node)")
    dev = torch.device("cuda", index)
    torch.cuda.set_device(dev)
    return dev


def amp_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype for `TrainConfig.amp`: ``auto`` is bf16 on CUDA and off elsewhere."""
    if mode == "auto":
        mode = "bf16" if device.type == "cuda" else "off"
    return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]
