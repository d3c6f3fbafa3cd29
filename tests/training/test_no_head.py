"""dim = 0: fine-tuning without an embedding layer, on real cub-dev photos (3 species, 64 px).

Why it exists: on fine-grained photos a new embedding layer (random or PCA) starts below the
pretrained pooled features it sits on (issue 23: -1.1 R@1 for a PCA head of 128 on cub-dev
validation species); with no layer, epoch 0 IS the training-free embedder and training moves the
last stages only."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from knn_asserts import recall_bounds


def _cfg(root, out, **kw):
    from training.config import TrainConfig

    base = dict(dataset="folder", root=str(root), max_classes=3, backbone="efficientnet_lite0",
                pretrained=True, pooling="gem", gem_p=4.0, dim=0, trainable="last:1",
                trunk_cache=True, trunk_views=1, frozen_bn=True, loss="multisimilarity",
                miner="none", das=True, das_preset="robust", epochs=1, lr=1e-3,
                backbone_lr=1e-3, batch_size=6, per_class=2, input_size=64, steps_per_epoch=2,
                eval_clustering=False, tensorboard=False, progress=False, device="cpu",
                amp="off", seed=1, out=str(out), cache_dir=str(out.parent / "cache"),
                parity_images=2)
    base.update(kw)
    return TrainConfig(**base).validate()


def test_without_a_head_epoch_0_is_the_pretrained_embedder_and_the_tail_trains(cub_mini, tmp_path):
    from embedder import Embedder, EmbedderConfig, OnnxEmbedder
    from training import train

    cfg = _cfg(cub_mini, tmp_path / "run")
    result = train(cfg)
    # epoch 0 ranks exactly as the pretrained GeM features of the same network (no layer between)
    from training.run_state import build_datasets

    _, test = build_datasets(cfg)
    ref = Embedder(EmbedderConfig(backbone="efficientnet_lite0", dim=0, pooling="gem", gem_p=4.0,
                                  pretrained=True), cfg.preprocessing()).eval()

    with torch.no_grad():
        e = torch.cat([ref(torch.stack([test[i][0] for i in range(j, min(j + 32, len(test)))]))
                       for j in range(0, len(test), 32)]).numpy()
    low, high = recall_bounds(e, test.labels, 1)      # the run embedded in other batches: ties at rank 1
    assert low - 1e-9 <= result.initial_metrics["R@1"] <= high + 1e-9
    # the evaluation classes, in the split's order, for a gallery of exactly them (README)
    assert (result.run_dir / "eval_classes.txt").read_text().splitlines() == test.split.classes
    # the last stage moved, nothing earlier did; the embedding is the 1280-d pooled feature
    after = torch.load(result.last_checkpoint, weights_only=True)["state_dict"]
    before = ref.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(k.startswith("backbone.net.blocks.6.") for k in changed)
    assert all(k.startswith(("backbone.net.blocks.6.", "backbone.net.conv_head.",
                             "backbone.net.bn2.")) for k in changed), sorted(changed)[:5]
    assert not any(k.startswith("head.") for k in after)
    onnx = OnnxEmbedder(result.onnx_path, device="cpu")
    assert onnx.dim == 1280
    v = onnx.embed([test.image(0)])
    assert v.shape == (1, 1280) and np.isclose(np.linalg.norm(v), 1.0, atol=1e-4)


def test_dim_0_is_refused_where_nothing_would_train(cub_mini, tmp_path):
    from training.config import ConfigError

    with pytest.raises(ConfigError, match="dim=0"):
        _cfg(cub_mini, tmp_path / "run", trainable="head")
    with pytest.raises(ConfigError, match="dim=-1"):
        _cfg(cub_mini, tmp_path / "run", dim=-1)
    with pytest.raises(ConfigError, match="head_init='pca'"):
        _cfg(cub_mini, tmp_path / "run", head_init="pca")


def test_without_a_head_the_whole_network_trains_at_backbone_lr(tmp_path):
    """The GPU recipe (dim = 0, every stage trains) trained at lr 1e-4 while it said backbone_lr
    1e-5: with no embedding layer everything fell into the one group at lr (found by the H200
    sweep of 2026-11-28, whose four backbone lr cells gave identical curves)."""
    from training.run_state import build_components, build_optimizer

    cfg = _cfg(tmp_path, tmp_path / "r", trainable="all", trunk_cache=False, lr=1e-4,
               backbone_lr=1e-5, pretrained=False)
    model, criterion, _ = build_components(cfg, 3)
    opt, _ = build_optimizer(cfg, model, criterion, None)
    assert [(g["name"], g["lr"]) for g in opt.param_groups] == [("backbone", 1e-5)]
    assert sum(len(g["params"]) for g in opt.param_groups) == sum(
        1 for p in model.parameters() if p.requires_grad)
    # without backbone_lr: one group at lr, as before
    plain = _cfg(tmp_path, tmp_path / "r", trainable="all", trunk_cache=False, lr=1e-4,
                 backbone_lr=0.0, pretrained=False)
    opt, _ = build_optimizer(plain, *build_components(plain, 3)[:2], None)
    assert [(g["name"], g["lr"]) for g in opt.param_groups] == [("model", 1e-4)]
