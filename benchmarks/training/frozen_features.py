"""Frozen pooled features of a training-free embedder as arrays, for the benchmarks and probes.

Not a second cache or a second network: the features are the trainer's own pooled-feature cache
(``trainable = "head"``, ``trunk_cache = true``: training/finetune.py `cached_activations`,
training/trunk_cache.py), L2-normalised as the trainer's ``head_input = "l2"`` does, i.e.
what the gallery embedder stores for the same images (tests/training/test_frozen_equivalence.py
checked them against the ONNX export: max difference < 1e-6). frozen_table2.py reads the
same files when its runs train; das_gradient_probe.py and das_geometry.py take them as arrays.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FeatureSplit", "dataset_kind", "head_run_config", "frozen_splits", "pca_head"]


@dataclass
class FeatureSplit:
    """Features (N, D) float32 (L2-normalised) with labels 0..C-1 and class names."""

    features: np.ndarray
    labels: np.ndarray
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def subset_classes(self, keep: list[int]) -> "FeatureSplit":
        """Rows of the given class ids, relabelled 0..len(keep)-1 in the given order."""
        remap = np.full(self.num_classes, -1, dtype=np.int64)
        remap[np.asarray(keep, dtype=np.int64)] = np.arange(len(keep))
        new = remap[self.labels]
        rows = new >= 0
        return FeatureSplit(self.features[rows], new[rows], [self.classes[i] for i in keep])


def dataset_kind(root: str | os.PathLike) -> str:
    """``"omniglot"`` when `root` holds ``images_background`` (first 20 alphabets train, last
    10 test), else ``"folder"`` (sorted class folders, first half train)."""
    return "omniglot" if (Path(root) / "images_background").is_dir() else "folder"


def head_run_config(root: str | os.PathLike, *, model: str | None = None, **kw: Any):
    """A TrainConfig of a head run on frozen features of the training-free embedder `model`
    (`embedder.pretrained` name, default its DEFAULT): that backbone, pooling and
    preprocessing, ``trainable = "head"`` on the cached pooled features, L2-normalised before
    the head; CPU, no export, no TensorBoard. `kw` sets any other field."""
    from embedder.pretrained import resolve_spec
    from training.config import load_config

    spec = resolve_spec(model)
    values = {"dataset": dataset_kind(root), "root": str(root), "backbone": spec.backbone,
              "pretrained": True, "pooling": spec.pooling, "gem_p": float(spec.gem_p),
              "input_size": spec.input_size, "resize": spec.resize, "trainable": "head",
              "trunk_cache": True, "trunk_views": 0, "head_init": "pca", "head_input": "l2",
              "eval_ks": [1, 2, 4, 8], "eval_clustering": True, "eval_initial": False,
              "device": "cpu", "amp": "off", "export_onnx": False, "tensorboard": False,
              "progress": False}
    values.update(kw)
    return load_config(None, values)


def _features(acts: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    x = np.asarray(acts[0] if rows is None else acts[0][rows], dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def frozen_splits(root: str | os.PathLike, *, model: str | None = None, cache=None,
                  max_classes: int = 0, validation: bool = False, progress: bool = True,
                  cfg=None) -> tuple[FeatureSplit, FeatureSplit]:
    """(train, evaluation) L2-normalised centre-crop features of a class-folder dataset or an
    Omniglot root, from the trainer's pooled-feature cache (built on first use).
    ``validation``: the first half of the training classes and the second half, the test
    split untouched (the trainer's ``validation_classes``). `cfg` (a `head_run_config`) wins
    over the other settings."""
    from training.data import load_splits
    from training.finetune import carve_validation, cached_activations
    from training.run_state import build_datasets, build_model
    from training.stages import split_stages

    if cfg is None:
        cfg = head_run_config(root, model=model, cache_dir=str(cache or ""),
                              max_classes=max_classes)
        if validation:
            n = load_splits(cfg.dataset, cfg.root, max_classes=max_classes)[0].num_classes
            cfg = dataclasses.replace(cfg, validation_classes=n - n // 2)
    cfg = dataclasses.replace(cfg, progress=progress)
    tr, te = load_splits(cfg.dataset, cfg.root, max_classes=cfg.max_classes,
                         holdout_alphabets=cfg.holdout_alphabets)
    train_full, test = build_datasets(cfg, tr, te)
    train, ev, rows_t, rows_v = carve_validation(train_full, test, cfg.validation_classes)
    prefix = split_stages(build_model(cfg), "head").prefix
    acts, test_acts = cached_activations(cfg, prefix, train_full,
                                         None if rows_v is not None else test)
    out_train = FeatureSplit(_features(acts, rows_t), train.labels, list(train.split.classes))
    out_ev = (FeatureSplit(_features(acts, rows_v), ev.labels, list(ev.split.classes))
              if rows_v is not None else
              FeatureSplit(_features(test_acts), test.labels, list(test.split.classes)))
    return out_train, out_ev


def pca_head(train: FeatureSplit, dim: int, normalize: bool = True) -> nn.Module:
    """The trainer's PCA-initialised embedding layer (`finetune.pca_directions`: top-d principal
    directions, bias = -W mean) on `train`, followed by L2 normalisation when `normalize`."""
    from training.finetune import pca_directions

    w, mean = pca_directions(train.features, dim)
    lin = nn.Linear(train.features.shape[1], dim)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(-w @ mean)
    return nn.Sequential(lin, _L2()) if normalize else lin


class _L2(nn.Module):
    """L2 normalisation as a module (torch has none)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=1)
