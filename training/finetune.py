"""What a fine-tuning run feeds its steps: images or cached trunk activations, the network that
runs on them, the validation carve-out, and the PCA start of the embedding layer. ``"all"``:
images through the whole Embedder; frozen stages: the prefix without gradients, then the
suffix; ``trunk_cache = true``: the prefix's outputs from disk (training/trunk_cache.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .config import TrainConfig
from .data import ImageDataset
from .skips import Readable, SkipLog, UnreadableDataError, drain, filter_collate

__all__ = ["Inputs", "cache_name", "cached_activations", "carve_validation", "pca_directions",
           "prepare_inputs", "readable_rows"]


@dataclass
class Inputs:
    """What the loop draws from and runs."""

    train: Dataset          # images or cached activations, with `.labels` (or DeviceBatches)
    evaluate: Dataset       # the evaluation set in the same form
    net: nn.Module          # the module a step (and evaluation) runs on those inputs


def carve_validation(train: ImageDataset, test: ImageDataset, n: int
                     ) -> tuple[ImageDataset, ImageDataset, np.ndarray | None, np.ndarray | None]:
    """(train, evaluation, train rows, evaluation rows): with ``n > 0`` the last `n` training
    classes evaluate (the test split unread); ``n = 0``: (train, test, None, None)."""
    if n <= 0:
        return train, test, None, None
    split = train.split
    if n >= split.num_classes:
        raise ValueError(f"validation_classes={n}: the training split has only "
                         f"{split.num_classes} classes (keep at least one to train on)")
    keep = split.num_classes - n
    rows_t = np.flatnonzero(split.labels < keep)
    rows_v = np.flatnonzero(split.labels >= keep)
    tr = ImageDataset(split.class_range(0, keep), train.transform, train.mode, train.cache, train.min_side)
    va = ImageDataset(split.class_range(keep, n), test.transform, test.mode, train.cache, test.min_side)
    return tr, va, rows_t, rows_v


def pca_directions(features: np.ndarray | torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k principal directions (k, D), mean (D,)) in float32, sign-fixed; eigh of the
    D x D covariance in float64 (cheaper than an SVD of N x D for D = 1280)."""
    x = torch.as_tensor(np.asarray(features), dtype=torch.float64)
    if k > min(x.shape):
        raise ValueError(f"head_init='pca': dim={k} exceeds the {min(x.shape)} principal "
                         f"directions of {x.shape[0]} training features of width {x.shape[1]}")
    mean = x.mean(0)
    xc = x - mean
    _, vecs = torch.linalg.eigh(xc.T @ xc)
    w = vecs[:, -k:].flip(1).T                                   # descending variance
    w = w * torch.sign(w.sum(1, keepdim=True) + 1e-12)            # deterministic signs
    return w.float().contiguous(), mean.float()


@torch.no_grad()
def _pooled(fn, dataset: Dataset, batch_size: int, device: torch.device,
            skips: SkipLog) -> torch.Tensor:
    loader = DataLoader(Readable(dataset), batch_size=batch_size, collate_fn=filter_collate)
    out = [fn(x.to(device)).float().cpu() for x, _, _ in drain(loader, skips) if x is not None]
    if not out:
        raise UnreadableDataError("head_init='pca': no training image could be decoded")
    return torch.cat(out)


@torch.no_grad()
def init_head_pca(model: nn.Module, pooled: torch.Tensor) -> None:
    """Embedding layer := projection on the top-d principal directions of the training images'
    pooled features (bias = -W mean), so training starts from the pretrained ranking."""
    w, mean = pca_directions(pooled, model.head.out_features)
    model.head.weight.copy_(w.to(model.head.weight))
    model.head.bias.copy_((-w @ mean).to(model.head.bias))


def cache_name(cfg: TrainConfig) -> str:
    """What the frozen prefix computes, for the trunk cache's name and key (backbone, cut, and
    pooling for ``"head"``); runs differing only in the head share one cache."""
    name = f"{cfg.backbone}-{cfg.trainable}"
    if cfg.trainable == "head":
        name += f"-{cfg.pooling}" + (f"{cfg.gem_p:g}" if cfg.pooling == "gem" else "")
    return name


def cached_activations(cfg: TrainConfig, prefix: nn.Module, train_full: ImageDataset,
                       test: ImageDataset | None = None, skips: SkipLog | None = None
                       ) -> tuple[np.ndarray, np.ndarray | None]:
    """(training (1 + trunk_views, N, ...), test (1, M, ...) or None) activations of the frozen
    prefix from the trunk cache, computed on first use (a benchmark calls it before forking).
    Every seed reads the same cache (seed 0) and draws its own views; pooled features are float32
    like the gallery embedder's. Undecodable images go into `skips` (else the first raises)."""
    from .trunk_cache import trunk_activations

    pre = cfg.preprocessing()
    pooled = cfg.trainable == "head"
    kw = dict(seed=0, cache_dir=cfg.cache_dir or None, progress=cfg.progress,
              threads=max(1, cfg.workers or torch.get_num_threads()),
              dtype=np.float32 if pooled else np.float16)
    what = cache_name(cfg)
    failed: tuple[dict[int, str] | None, ...] = ({}, {}) if skips is not None else (None, None)
    acts = trunk_activations(prefix, train_full, pre, what=what, views=cfg.trunk_views,
                             failed=failed[0], **kw)
    test_acts = (None if test is None else
                 trunk_activations(prefix, test, pre, what=what, views=0, failed=failed[1], **kw))
    if skips is not None:
        for ds, rows in ((train_full, failed[0]), (test, failed[1])):
            for r, why in rows.items():
                skips.add(ds.split.paths[r], why)
    return acts, test_acts


def readable_rows(skips: SkipLog, ds: ImageDataset, rows: np.ndarray | None, labels: np.ndarray,
                   which: str, min_per_class: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(rows, labels) of `rows` (None: all of `ds`) without unreadable images and classes left
    under `min_per_class`; a note per class dropped; an error below 2."""
    rows = np.arange(len(ds)) if rows is None else np.asarray(rows)
    ok = skips.readable(ds.split.paths[r] for r in rows)
    if ok.all():
        return rows, labels
    classes = np.unique(labels)
    counts = {int(c): int(ok[labels == c].sum()) for c in classes}
    names = {int(y): ds.split.classes[ds.split.labels[r]] for r, y in zip(rows, labels)}
    for c, n in counts.items():
        if n == 0:
            skips.note(f"class {names[c]!r} ({which}): all {int((labels == c).sum())} images "
                       f"unreadable; dropped")
        elif n < min_per_class:
            skips.note(f"class {names[c]!r} ({which}): only {n} readable image(s), fewer than "
                       f"per_class={min_per_class}; dropped")
    keep_cls = [c for c, n in counts.items() if n >= min_per_class]
    if len(keep_cls) < 2:
        raise UnreadableDataError(
            f"the {which} split has {len(keep_cls)} class(es) with readable images left after "
            f"skipping {int((~ok).sum())} unreadable image(s) (first: "
            f"{next(ds.split.paths[r] for r, k in zip(rows, ok) if not k)}); expected at least 2")
    ok &= np.isin(labels, keep_cls)
    return rows[ok], labels[ok]


def _device_sets(cfg: TrainConfig, state, train: ImageDataset, evaluate: ImageDataset):
    """``device_batches = true``: the training images decoded once into device memory (the
    sampler rebuilt without those that do not decode) and the evaluation crops beside them."""
    from .device_batches import DeviceBatches, DeviceEvalSet, DeviceImages
    from .run_state import balanced_sampler

    pre, threads = cfg.preprocessing(), max(cfg.workers, torch.get_num_threads())
    images = DeviceImages(train.split, pre, state.device, state.skips, threads=threads)
    rows, labels = readable_rows(state.skips, train, None, train.labels, "train", cfg.per_class)
    if len(rows) != len(train):
        state.sampler = balanced_sampler(cfg, labels)
    return (DeviceBatches(images, state.sampler, cfg.seed, rows),
            DeviceEvalSet(evaluate.split, pre, state.device, state.skips, threads=threads))


def prepare_inputs(cfg: TrainConfig, state, train_full: ImageDataset, test: ImageDataset, *,
                   fresh: bool) -> Inputs:
    """Datasets and network of a run; `fresh` runs also get the PCA head init. Rows the trunk
    cache could not decode are left out (sampler rebuilt); else failures drop out per batch."""
    from .run_state import balanced_sampler
    from .trunk_cache import CachedViews

    train, evaluate, rows_t, rows_v = carve_validation(train_full, test, cfg.validation_classes)
    split, model, device, skips = state.split, state.model, state.device, state.skips
    if split is None:
        net, train_in, eval_in, pooled_fn = model, train, evaluate, model.features
    elif not cfg.trunk_cache:
        net, train_in, eval_in = split.network, train, evaluate
        pooled_fn = lambda x: split.suffix.pooled(split.prefix(x))  # noqa: E731
    else:
        acts, test_acts = cached_activations(cfg, split.prefix, train_full,
                                             None if rows_v is not None else test, skips)
        rt, yt = readable_rows(skips, train_full, rows_t, train.labels, "train", cfg.per_class)
        train_in = CachedViews(acts, yt, train=True, seed=cfg.seed, rows=rt)
        if len(rt) != len(train):       # the same batches whenever the same rows are left
            state.sampler = balanced_sampler(cfg, yt)
        held = rows_v is not None    # validation classes: rows of the training cache
        rv, yv = readable_rows(skips, train_full if held else test, rows_v, evaluate.labels,
                                "validation" if held else "test")
        eval_in = CachedViews(acts if held else test_acts, yv, train=False, rows=rv)
        net, pooled_fn = split.suffix, split.suffix.pooled
    if cfg.device_batches:
        train_in, eval_in = _device_sets(cfg, state, train, evaluate)
    if fresh and cfg.head_init == "pca":
        if cfg.trunk_cache:
            centre = CachedViews(train_in.acts, train_in.labels, train=False, rows=train_in.rows)
        else:   # the training images through the eval transform (centre crops)
            centre = ImageDataset(train.split, evaluate.transform, train.mode, train.cache, evaluate.min_side)
        was = net.training
        net.eval()
        model.eval()
        init_head_pca(model, model.head_in(_pooled(pooled_fn, centre, cfg.eval_batch_size, device,
                                                   skips)))
        net.train(was)
    return Inputs(train_in, eval_in, net)
