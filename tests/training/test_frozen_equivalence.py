"""The trainer's head mode trains on what the gallery embedder stores, and ``head_input = "l2"``
is part of the model (checkpoint, export), not only of the training inputs.

The loop itself was compared with the deleted training/frozen.py head loop at commit 01f5fbc
(this file's first version: same seed, per-epoch R@1 / NMI / MAP@R equal to 3 decimals, with
and without DAS); the figures are in docs/benchmarks/history.md ("One training loop")."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]


def test_cached_pooled_features_are_the_gallery_embedders(cub_mini, tmp_path, pretrained_onnx):
    """The trainer's float32 pooled-feature cache, L2-normalised, equals the ONNX default
    embedder's output for the same photos (what `indexer build` stores), to float noise."""
    sys.path.insert(0, str(REPO))
    from benchmarks.training.frozen_features import frozen_splits
    from embedder import OnnxEmbedder
    from training.data import load_splits

    train, test = frozen_splits(cub_mini, cache=tmp_path / "cache", max_classes=1, progress=False)
    cached = list((tmp_path / "cache").glob("*.npy"))
    assert len(cached) == 2 and all(np.load(p).dtype == np.float32 for p in cached)
    tr_split, _ = load_splits("folder", cub_mini, max_classes=1)
    emb = OnnxEmbedder(pretrained_onnx, device="cpu")
    onnx = np.concatenate([e for _, e, _ in emb.embed_iter(enumerate(tr_split.paths),
                                                            progress=False)])
    assert onnx.shape == train.features.shape
    assert np.abs(onnx - train.features).max() < 1e-4


def test_head_input_l2_travels_with_the_checkpoint(tmp_path):
    from embedder import Embedder, EmbedderConfig, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = Embedder(EmbedderConfig(backbone="small_cnn", dim=8, head_input="l2")).eval()
    pooled = torch.randn(5, model.num_features) * 7
    with torch.no_grad():
        want = F.normalize(model.head(F.normalize(pooled, dim=1)), dim=1)
        np.testing.assert_allclose(model.embed(pooled), want, atol=1e-6)
        raw = Embedder(EmbedderConfig(backbone="small_cnn", dim=8)).eval()
        raw.load_state_dict(model.state_dict())
        assert not torch.allclose(raw.embed(pooled), want, atol=1e-3)   # the option matters
    save_checkpoint(tmp_path / "m.pt", model)
    again, _ = load_checkpoint(tmp_path / "m.pt")
    pre = model.preprocessing
    x = torch.rand(2, pre.channels(), pre.input_size, pre.input_size)
    with torch.no_grad():
        np.testing.assert_allclose(again(x), model(x), atol=1e-6)
    assert again.config.head_input == "l2"
    with pytest.raises(ValueError, match="head_input"):
        EmbedderConfig(backbone="small_cnn", head_input="unit")
