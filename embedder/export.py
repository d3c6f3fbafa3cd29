"""ONNX export, carrying in ``metadata_props`` what indexing and serving need; moved into place only
after a parity check against the torch model on real images (else :class:`ParityError`).
"""
from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence, Union

import numpy as np
import torch

from .errors import ParityError
from .files import atomic_target
from .images import ImageSource, load_image
from .model import Embedder
from .runtime import ONNX_FORMAT, load_session, write_metadata

if TYPE_CHECKING:  # pragma: no cover
    from .concat import ConcatEmbedder
#: what export_onnx takes: one embedder, or several concatenated (embedder.concat)
AnyEmbedder = Union[Embedder, "ConcatEmbedder"]

PARITY_ATOL = 1e-4
PARITY_MIN_COS = 0.9999
_SKIMAGE_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg",
                   "motorcycle_left.png", "hubble_deep_field.jpg", "ihc.png", "retina.jpg")
log = logging.getLogger(__name__)


def default_parity_images() -> list[Path]:
    """Real photos shipped with scikit-image (a dependency), so every export can be checked offline."""
    from skimage import data_dir

    paths = [Path(data_dir) / n for n in _SKIMAGE_PHOTOS if (Path(data_dir) / n).exists()]
    if not paths:
        raise FileNotFoundError(f"no scikit-image photos under {data_dir} for the parity check; "
                                "pass parity_images explicitly")
    return paths


def _parity_batch(model: AnyEmbedder, images: Sequence[ImageSource] | None) -> np.ndarray:
    pre = model.preprocessing
    srcs = list(images) if images else default_parity_images()
    return np.stack([pre.eval_array(load_image(s, mode=pre.mode)) for s in srcs]).astype(np.float32)


def _torch_export(model: AnyEmbedder, example: torch.Tensor, path: Path) -> str:
    """Dynamo exporter (the default in torch 2.14); the legacy one only if dynamo fails."""
    kw: dict[str, Any] = dict(input_names=["x"], output_names=["embedding"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(model, (example,), str(path), dynamo=True, external_data=False,
                              dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
                              optimize=True, verbose=False, **kw)
            return "dynamo"
        except Exception as e:  # noqa: BLE001 - any dynamo failure -> documented fallback
            log.warning("dynamo ONNX export failed (%s: %s); falling back to the legacy exporter",
                        type(e).__name__, e)
            torch.onnx.export(model, (example,), str(path), dynamo=False, opset_version=17,
                              dynamic_axes={"x": {0: "batch"}, "embedding": {0: "batch"}}, **kw)
            return "torchscript"


@contextmanager
def out_of_place(model: torch.nn.Module) -> Iterator[int]:
    """Within the block every in-place activation (timm's and torchvision's ``inplace=True``
    ReLU6, SiLU, ...) of ``model`` runs out of place; yields how many were switched, switched back
    after. The ONNX graph is the same (torch.export functionalises in-place ops anyway), but
    decomposing each in-place op costs ~0.1 s of symbolic-shape work under a dynamic batch: a
    Lite1 export 16.5 -> 11.4 s on 2 cores (``python -m benchmarks.embedder.export_time``).
    Switched back so that the parity check compares the file with the model as it was given."""
    switched = [mod for mod in model.modules() if getattr(mod, "inplace", None) is True]  # any library's flag
    for mod in switched:
        mod.inplace = False
    try:
        yield len(switched)
    finally:
        for mod in switched:
            mod.inplace = True


def check_parity(onnx_path: str | os.PathLike, model: AnyEmbedder, batch: np.ndarray) -> dict[str, float]:
    """Compare ONNX vs torch on ``batch`` at batch size 1 and at the full batch; raise on mismatch."""
    sess = load_session(onnx_path)
    with torch.no_grad():
        ref = model(torch.from_numpy(batch)).numpy()
    scale = 1.0 if model.config.normalize else max(1.0, float(np.abs(ref).max()))
    worst = {"max_abs_diff": 0.0, "min_cosine": 1.0}
    for name, got in (("batch 1", np.concatenate([sess.run(None, {"x": batch[i:i + 1]})[0]
                                                  for i in range(len(batch))])),
                      (f"batch {len(batch)}", sess.run(None, {"x": batch})[0])):
        if got.shape != ref.shape:
            raise ParityError(f"ONNX output shape {got.shape} != torch {ref.shape} at {name}")
        diff = float(np.abs(got - ref).max())
        cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1) + 1e-12)
        worst["max_abs_diff"] = max(worst["max_abs_diff"], diff)
        worst["min_cosine"] = min(worst["min_cosine"], float(cos.min()))
        if not np.isfinite(got).all() or diff > PARITY_ATOL * scale or cos.min() < PARITY_MIN_COS:
            raise ParityError(
                f"ONNX export of {model.config.backbone} does not match torch at {name}: max abs "
                f"diff {diff:.3g} (limit {PARITY_ATOL * scale:.3g}), min cosine {cos.min():.6f} "
                f"(limit {PARITY_MIN_COS})")
    return worst


def _public_config(cfg: dict) -> dict:
    """The config as the ONNX file records it: a local weights file by its name (no server path)."""
    if cfg.get("weights"):
        cfg = {**cfg, "weights": Path(str(cfg["weights"])).name}
    return cfg


def _weights_record(cfg: dict) -> dict:
    """``weights_file`` (basename) and ``weights_sha256`` of a local weights file, else nothing."""
    from .hashing import file_sha256

    w = Path(str(cfg.get("weights") or "")).expanduser()
    if not cfg.get("weights") or not w.is_file():
        return {}
    return {"weights_file": w.name, "weights_sha256": file_sha256(w)}


def export_onnx(model: AnyEmbedder, out: str | os.PathLike, *, source_hash: str = "",
                parity_images: list | None = None) -> Path:
    """Export ``model`` to one self-contained .onnx file (dynamic batch), parity-checked before the rename."""
    import onnx

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).cpu().eval()
    batch = _parity_batch(m, parity_images)
    if len(batch) < 2:  # torch.export specialises a batch of 1; give it two to keep it dynamic
        batch = np.concatenate([batch, batch[::-1]])
    example = torch.from_numpy(batch[:2].copy())
    # the proto saved back below is self-contained: a "<name>.data" side file goes either way
    with atomic_target(out, suffix=".onnx") as tmp_name:
        tmp = Path(tmp_name)
        try:
            with out_of_place(m):
                exporter = _torch_export(m, example, tmp)
            proto = onnx.load(str(tmp))
            pre = m.preprocessing
            write_metadata(proto, {
                "format": ONNX_FORMAT, "dim": str(m.dim), "input_size": str(pre.input_size),
                "channels": str(pre.channels()), "mean": json.dumps(list(pre.mean)),
                "std": json.dumps(list(pre.std)), "backbone": m.config.backbone,
                "normalized": "true" if m.config.normalize else "false", "source_hash": source_hash,
                "preprocessing": pre.to_json(),
                "config": json.dumps(_public_config(m.config.to_dict()), sort_keys=True),
                **_weights_record(m.config.to_dict()), "exporter": exporter,
                "torch_version": torch.__version__,
            })
            onnx.save(proto, str(tmp))
            check_parity(tmp, m, batch)
        finally:
            Path(tmp_name + ".data").unlink(missing_ok=True)
    return out
