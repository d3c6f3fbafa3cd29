"""Train an embedding head on frozen features with the trainer's own step (seconds per run).

The frozen-feature benchmark (benchmarks/frozen_table2.py) asks one question many times: does
DAS change what a loss/sampler learns? Running EfficientNet-Lite0 for each of ~100 runs is out
of reach on a CPU, so the backbone's features are computed once (training/frozen_features.py)
and only a head ``feature (1280) -> embedding (d)`` is trained here, through exactly the
trainer's step: `step.compute_loss` with `build_criterion`, `build_das`, the trainer's Adam
groups and lr schedule, `ClassBalancedBatchSampler` batches and `embedder.metrics.evaluate`.

Heads (``head=``):

* ``"pca"`` (default): a linear layer initialised to the top-d principal directions of the
  training features (bias = -W mean), so the untrained head already ranks test images almost
  as the raw frozen features do and training starts from there instead of from a random
  projection that first has to rediscover what ImageNet features know.
* ``"residual"``: the fixed PCA projection plus a trainable 2-layer MLP correction whose last
  layer starts at zero: training can only add to the frozen ranking.
* ``"linear"``: a randomly initialised linear layer (overfits the few training classes: the
  previous attempt at this benchmark landed below the untrained features).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import TrainConfig
from .frozen_features import FeatureSplit

__all__ = ["HEADS", "FeatureHead", "build_head", "train_head", "evaluate_features"]

HEADS = ("pca", "residual", "linear")


_PCA_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def pca(features: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k principal directions (k, D), mean (D,)) in float32, sign-fixed; eigh of the
    D x D covariance (a D = 1280 SVD of the data costs ~10x more), memoised per array since
    every run of a benchmark grid starts from the same training features."""
    key = (id(features), features.shape, k)
    hit = _PCA_CACHE.get(key)
    if hit is not None:
        return hit
    x = torch.as_tensor(features, dtype=torch.float64)
    mean = x.mean(0)
    xc = x - mean
    _, vecs = torch.linalg.eigh(xc.T @ xc)
    w = vecs[:, -k:].flip(1).T                                   # descending variance
    w = w * torch.sign(w.sum(1, keepdim=True) + 1e-12)            # deterministic signs
    _PCA_CACHE.clear()
    _PCA_CACHE[key] = (w.float().contiguous(), mean.float())
    return _PCA_CACHE[key]


class FeatureHead(nn.Module):
    """``v = [normalize](W x + b [+ MLP(x)])``; see the module docstring for the kinds."""

    def __init__(self, in_dim: int, dim: int, kind: str = "pca", normalize: bool = True,
                 hidden: int = 512) -> None:
        super().__init__()
        if kind not in HEADS:
            raise ValueError(f"head={kind!r}: expected one of {HEADS}")
        self.kind, self.normalize = kind, normalize
        self.proj = nn.Linear(in_dim, dim)
        self.mlp: nn.Module | None = None
        if kind == "residual":
            self.proj.requires_grad_(False)
            self.mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
            nn.init.zeros_(self.mlp[2].weight)
            nn.init.zeros_(self.mlp[2].bias)

    @torch.no_grad()
    def init_pca(self, features: np.ndarray) -> None:
        """Top principal directions of `features` as the projection (sign-fixed, seed-free)."""
        w, mean = pca(features, self.proj.out_features)
        self.proj.weight.copy_(w)
        self.proj.bias.copy_(-w @ mean)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.proj(x)
        if self.mlp is not None:
            v = v + self.mlp(x)
        return F.normalize(v, dim=1) if self.normalize else v


def build_head(kind: str, train: FeatureSplit, dim: int, normalize: bool) -> FeatureHead:
    head = FeatureHead(train.features.shape[1], dim, kind, normalize)
    if kind in ("pca", "residual"):
        if dim > min(train.features.shape):
            raise ValueError(f"head {kind!r}: dim={dim} exceeds the {min(train.features.shape)} "
                             f"principal directions {len(train)} training features have")
        head.init_pca(train.features)
    return head


@torch.no_grad()
def evaluate_features(emb: np.ndarray, labels: np.ndarray, seed: int = 0) -> dict[str, float]:
    """R@1/2/4/8, NMI, F1 and MAP@R of embeddings (embedder.metrics, k-means seeded)."""
    from embedder.metrics import evaluate

    return {k: float(v) for k, v in evaluate(emb, labels, ks=(1, 2, 4, 8), clustering=True,
                                             seed=seed).items()}


def train_head(cfg: TrainConfig, train: FeatureSplit, test: FeatureSplit, *, head: str = "pca",
               eval_epochs: list[int] | None = None) -> dict[str, Any]:
    """Train a head on `train` with the trainer's step; evaluate on `test` after the epochs in
    `eval_epochs` (default: the last). Returns ``{"metrics": {epoch: {...}}, "seconds": ...,
    "steps": ...}``. Deterministic in ``cfg.seed``."""
    import time

    from .batching import ClassBalancedBatchSampler
    from .distributed import DistInfo
    from .step import aux_weight, build_criterion, build_das, compute_loss, step_seed
    from .run_state import build_optimizer

    cfg.validate()
    eval_epochs = sorted(set(eval_epochs or [cfg.epochs]))
    if eval_epochs[0] < 0 or eval_epochs[-1] > cfg.epochs:
        raise ValueError(f"eval_epochs={eval_epochs}: expected values in [0, {cfg.epochs}]")
    torch.manual_seed(cfg.seed)
    criterion = build_criterion(cfg, train.num_classes)
    model = build_head(head, train, cfg.dim, criterion.normalize)
    das = build_das(cfg, train.num_classes, criterion.normalize) if cfg.das else None
    opt, sched = build_optimizer(cfg, model, criterion)
    sampler = ClassBalancedBatchSampler(train.labels, batch_size=cfg.batch_size,
                                        per_class=cfg.per_class, seed=cfg.seed, drop_last=True)
    x_all = torch.from_numpy(np.ascontiguousarray(train.features, dtype=np.float32))
    if train.views is not None:     # (V + 1, N, D): the centre crop and the augmented views
        x_all = torch.cat([x_all[None], torch.from_numpy(train.views)])
        view_gen = torch.Generator().manual_seed(cfg.seed)
    y_all = torch.from_numpy(train.labels.astype(np.int64))
    x_test = torch.from_numpy(np.ascontiguousarray(test.features, dtype=np.float32))
    info, aux_w = DistInfo(), aux_weight(cfg)

    def evaluate(epoch: int) -> dict[str, float]:
        model.eval()
        with torch.no_grad():
            emb = model(x_test).numpy()
        model.train()
        return evaluate_features(emb, test.labels, seed=cfg.seed)

    out: dict[str, Any] = {"metrics": {}, "steps": 0}
    if 0 in eval_epochs:
        out["metrics"][0] = evaluate(0)
    step, t0 = 0, time.perf_counter()
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for batch in sampler:
            idx = torch.as_tensor(batch)
            if train.views is not None:   # a random view of each image, as augmentation would
                v = torch.randint(0, x_all.shape[0], (len(idx),), generator=view_gen)
                x = x_all[v, idx]
            else:
                x = x_all[idx]
            loss = compute_loss(model, criterion, das, x, y_all[idx], info=info,
                                seed=step_seed(cfg, step), aux_weight=aux_w,
                                exclude_own_copies=cfg.das_exclude_own_copies)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{cfg.loss}: loss {float(loss)} at epoch {epoch + 1}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
        sched.step()
        if epoch + 1 in eval_epochs:
            out["metrics"][epoch + 1] = evaluate(epoch + 1)
    out["seconds"], out["steps"] = time.perf_counter() - t0, step
    return out


def head_config(**kw: Any) -> TrainConfig:
    """A TrainConfig for head training: the paper's DAS/loss defaults, CPU, no files."""
    base = TrainConfig(dataset="folder", root="-", backbone="small_cnn", pretrained=False,
                       device="cpu", amp="off", export_onnx=False, tensorboard=False,
                       progress=False, eval_initial=False)
    return dataclasses.replace(base, **kw).validate()
