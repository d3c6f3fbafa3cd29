"""A local weights file loaded into a timm model, refused in one line naming the file when it does
not fit. Why not timm's ``pretrained_cfg_overlay=dict(file=F)``: with ``num_classes=0`` it loads
with ``strict=False``, so another model's weights load as nothing (a random backbone). Here the
file is read without running code, unwrapped, checked finite, and timm's ``load_pretrained`` must
leave no missing, unexpected or mis-shaped key.
"""
from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any

from .errors import PretrainedWeightsUnavailable

#: A safetensors header (JSON of tensor names, dtypes, shapes, offsets) above this is refused
#: before it is parsed: ViT-g/14's is ~150 KB; 16 MiB leaves room for 100x as many tensors.
MAX_HEADER_BYTES = 16 * 2 ** 20
WRAPPERS = ("state_dict", "model_state_dict", "model", "state_dict_ema", "module")
PREFIXES = ("module.", "_orig_mod.")
ALLOWED_MISSING_SUFFIX = "num_batches_tracked"


def _refuse(path: Path, what: str) -> PretrainedWeightsUnavailable:
    return PretrainedWeightsUnavailable(f"{path}: {what}")


def _names(keys: list[str], n: int = 4) -> str:
    return ", ".join(keys[:n]) + (f" ... ({len(keys)} in all)" if len(keys) > n else "")


def safetensors_keys(path: Path) -> list[str]:
    """The tensor names of a safetensors file from its header alone (capped, then parsed)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise _refuse(path, "not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        size = path.stat().st_size
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise _refuse(path, f"safetensors header of {n:,} bytes (file {size:,} bytes; at most "
                                f"{MAX_HEADER_BYTES:,} accepted): not a weights file this loader reads")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:
            raise _refuse(path, f"unreadable safetensors header ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise _refuse(path, "unreadable safetensors header (not a JSON object)")
    return [k for k in header if k != "__metadata__"]


def _strip(key: str) -> str:
    for p in PREFIXES:
        while key.startswith(p):
            key = key[len(p):]
    return key


def unwrap(obj: Any, path: Path) -> dict:
    """The state dict inside a checkpoint: wrapper dicts descended, DDP/compile prefixes cut."""
    import torch

    for _ in range(4):
        if not isinstance(obj, dict):
            break
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            break
        inner = next((obj[k] for k in WRAPPERS if isinstance(obj.get(k), dict)), None)
        if inner is None:
            break
        obj = inner
    if not isinstance(obj, dict) or not obj:
        raise _refuse(path, f"no state dict in it (a {type(obj).__name__}; expected tensors by name, "
                            f"bare or under one of {', '.join(WRAPPERS)})")
    sd = {_strip(str(k)): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not sd:
        raise _refuse(path, f"no tensors in its state dict (keys {_names(sorted(map(str, obj)))})")
    return sd


def read_state_dict(path: Path, model_keys: set[str], has_filter: bool) -> dict:
    """The file's tensors by name (unwrapped), refused early where possible (module docstring)."""
    import torch

    if path.suffix.lower() == ".safetensors":
        keys = safetensors_keys(path)
        if not has_filter and not model_keys & {_strip(k) for k in keys}:
            raise _refuse(path, f"none of its {len(keys)} tensor names is one of the model's "
                                f"({_names(keys, 3)} vs {_names(sorted(model_keys), 3)}): weights "
                                "of another model?")
        from safetensors.torch import load_file

        try:
            return unwrap(load_file(str(path)), path)
        except PretrainedWeightsUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise _refuse(path, f"unreadable safetensors file ({type(e).__name__}: "
                                f"{' '.join(str(e).split())[:200]})") from None
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:        # an old (non-zip) torch file cannot be mapped: read it
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle/zip errors of a hostile or damaged file
        raise _refuse(path, f"not a weights file torch reads safely ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:200]})") from None
    return unwrap(obj, path)


def check_finite(sd: dict, path: Path) -> None:
    """NaN/inf in any floating tensor: refused naming the file and the first such tensor."""
    import torch

    bad = [k for k, v in sd.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise _refuse(path, f"{len(bad)} tensor(s) hold NaN or inf ({_names(bad, 3)}): damaged "
                            "or diverged weights")


def load_weights_file(model: Any, path: Path, in_chans: int = 3) -> None:
    """Load ``path`` into the timm ``model`` through timm's ``load_pretrained``, refusing a misfit."""
    import sys

    from timm.models import load_pretrained

    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    filter_fn = getattr(sys.modules.get(type(model).__module__), "checkpoint_filter_fn", None)
    sd = read_state_dict(path, set(model.state_dict()), filter_fn is not None)
    check_finite(sd, path)
    seen: dict[str, list[str]] = {}

    def record(_module: Any, result: Any) -> None:
        seen["missing"], seen["unexpected"] = list(result.missing_keys), list(result.unexpected_keys)

    hook = model.register_load_state_dict_post_hook(record)
    quiet = logging.getLogger(load_pretrained.__module__)   # its key warnings: ours say more, once
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        # source "": a state dict passed in wins over the hub (timm prefers the hub otherwise)
        load_pretrained(model, pretrained_cfg={**cfg, "source": "", "state_dict": sd, "file": None},
                        num_classes=0, in_chans=in_chans, filter_fn=filter_fn, strict=False)
    except RuntimeError as e:   # torch's size mismatches: one line each, many lines in all
        lines = [ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln]
        names = [ln.split("for ", 1)[1].split(":", 1)[0] for ln in lines if "for " in ln]
        what = (f"{len(names)} tensor(s) of the wrong shape ({_names(names, 3)})" if names else
                " ".join(str(e).split())[:300])
        raise _refuse(path, f"does not fit timm model {cfg.get('architecture', type(model).__name__)}: "
                            f"{what}") from None
    finally:
        hook.remove()
        quiet.setLevel(level)
    missing = [k for k in seen.get("missing", []) if not k.endswith(ALLOWED_MISSING_SUFFIX)]
    unexpected = seen.get("unexpected", [])
    if missing or unexpected:
        parts = ([f"{len(missing)} of the model's {len(model.state_dict())} tensors missing "
                  f"({_names(missing, 3)})"] if missing else []) + \
                ([f"{len(unexpected)} unexpected ({_names(unexpected, 3)})"] if unexpected else [])
        raise _refuse(path, f"does not fit timm model {cfg.get('architecture', type(model).__name__)}: "
                            f"{'; '.join(parts)}; a checkpoint of another model, or a layout this "
                            "loader does not unwrap")
