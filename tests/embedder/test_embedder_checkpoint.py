"""Checkpoints: weights_only-loadable dicts that carry config and preprocessing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from embedder import Embedder, EmbedderConfig, Preprocessing, load_checkpoint, save_checkpoint
from embedder.checkpoint import FORMAT, CheckpointError, file_sha256
from embedder.images import load_image


def test_round_trip_weights_config_preprocessing(tmp_path, omniglot_paths):
    torch.manual_seed(1)
    pre = Preprocessing(input_size=28, resize=36, mean=(0.9,), std=(0.3,), mode="L",
                        train_scale=(0.7, 1.0), hflip=False)
    cfg = EmbedderConfig(backbone="small_cnn", dim=24, pooling="avgmax", frozen_bn=True)
    model = Embedder(cfg, pre)
    model.train()(torch.randn(4, 1, 28, 28))  # frozen BN: stats untouched; still a real state
    path = save_checkpoint(tmp_path / "run" / "best.pt", model, epoch=7, metrics={"R@1": 0.5})
    raw = torch.load(path, weights_only=True)  # only plain types and tensors inside
    assert raw["format"] == FORMAT and raw["epoch"] == 7 and raw["metrics"] == {"R@1": 0.5}
    assert raw["preprocessing"] == pre.to_dict()

    loaded, ckpt = load_checkpoint(path)
    assert not loaded.training and loaded.config == cfg and loaded.preprocessing == pre
    x = torch.from_numpy(np.stack([pre.eval_array(load_image(p, mode="L")) for p in omniglot_paths[:5]]))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model.eval()(x))
    assert ckpt["epoch"] == 7
    assert len(file_sha256(path)) == 64 and not list(path.parent.glob("*.tmp"))


def test_pretrained_flag_kept_without_download(tmp_path, monkeypatch):
    """A checkpoint of an ImageNet-initialised resnet loads offline: its weights are in the file."""
    model = Embedder(EmbedderConfig(backbone="resnet18", dim=8))
    model.config.pretrained = True  # as if trained from ImageNet weights
    path = save_checkpoint(tmp_path / "r18.pt", model)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    loaded, _ = load_checkpoint(path)
    assert loaded.config.pretrained is True
    torch.testing.assert_close(loaded.head.weight, model.head.weight)


def test_bad_files(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint file not found"):
        load_checkpoint(tmp_path / "missing.pt")
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint"):
        load_checkpoint(junk)
    other = tmp_path / "other.pt"
    torch.save({"state_dict": {}}, other)
    with pytest.raises(CheckpointError, match="not a das-embedder checkpoint"):
        load_checkpoint(other)
    model = Embedder(EmbedderConfig(backbone="small_cnn", dim=8))
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path / "x.pt", model, config={})
    broken = tmp_path / "broken.pt"
    save_checkpoint(broken, model)
    ck = torch.load(broken, weights_only=True)
    ck["config"]["dim"] = 9
    torch.save(ck, broken)
    with pytest.raises(CheckpointError, match="inconsistent checkpoint"):
        load_checkpoint(broken)
