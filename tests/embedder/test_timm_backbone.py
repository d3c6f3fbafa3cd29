"""`backbone = "timm:<model name>"`: timm's tiny test models (random init, no download) through
weights files, timm's own preprocessing, the poolings of ViTs and CNNs, and the one-line errors
of a machine without the hub and of a name timm does not know."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _saved(tmp_path: Path, arch: str, fmt: str, **kw) -> tuple[Path, dict]:
    """A random-init timm model (with its classifier) saved the way users hand weights over."""
    import safetensors.torch
    import timm

    torch.manual_seed(3)
    sd = timm.create_model(arch, pretrained=False, **kw).state_dict()
    path = tmp_path / f"{arch}.{fmt}"
    if fmt == "safetensors":
        safetensors.torch.save_file(sd, str(path))
    elif fmt == "bin":
        torch.save(sd, path)                                        # a bare state dict
    else:
        torch.save({"epoch": 7, "state_dict": sd, "optimizer": {}}, path)   # a training checkpoint
    return path, sd


@pytest.mark.parametrize("arch,fmt", [("test_vit", "safetensors"), ("test_vit", "pth"),
                                      ("test_convnext", "bin")])
def test_weights_file_loads_through_timm_state_dict_equal(tmp_path, arch, fmt):
    from embedder import Embedder, EmbedderConfig

    path, sd = _saved(tmp_path, arch, fmt)
    model = Embedder(EmbedderConfig(backbone=f"timm:{arch}", dim=8, pooling="model",
                                    pretrained=False, weights=str(path)))
    got = model.backbone.net.state_dict()
    head = {k for k in sd if k.startswith(("head.fc.", "head.weight", "head.bias"))}
    assert head and set(got) == set(sd) - head        # the classifier is dropped (num_classes=0)
    for k, v in got.items():
        assert torch.equal(v, sd[k]), k


def test_preprocessing_is_timms_own_eval_transform(photo_paths):
    """Size, crop ratio, mean/std and bicubic resize from timm's pretrained config: our numpy
    pipeline (what serving runs) gives timm's own eval transform's tensor."""
    import timm
    from PIL import Image
    from timm.data import create_transform, resolve_data_config

    from embedder.preprocess import preprocessing_for

    pre = preprocessing_for("timm:test_efficientnet")
    dc = resolve_data_config({}, model=timm.create_model("test_efficientnet"))
    assert (pre.input_size, pre.interpolation) == (dc["input_size"][1], "bicubic") == (160, "bicubic")
    assert pre.mean == dc["mean"] and pre.std == dc["std"] and pre.resize == 168   # 160 / 0.95
    ref = create_transform(**dc)
    for p in photo_paths[:3]:
        img = Image.open(p).convert("RGB")
        np.testing.assert_allclose(pre.eval_array(img), ref(img).numpy(), atol=2e-5)


def test_vit_and_cnn_poolings_match_timm(tmp_path):
    import timm

    from embedder import Embedder, EmbedderConfig

    x = torch.randn(2, 3, 160, 160)

    def pooled(arch, pooling):
        torch.manual_seed(0)
        m = Embedder(EmbedderConfig(backbone=f"timm:{arch}", dim=0, pooling=pooling,
                                    normalize=False, pretrained=False)).eval()
        with torch.no_grad():
            return m(x), m.backbone.net

    got, net = pooled("test_vit", "model")
    with torch.no_grad():
        tokens = net.forward_features(x)
        assert torch.allclose(got, net(x), atol=1e-6)          # timm's own head-less output
        assert torch.allclose(pooled("test_vit", "cls")[0], tokens[:, 0], atol=1e-6)
        assert torch.allclose(pooled("test_vit", "mean")[0], tokens[:, 1:].mean(1), atol=1e-6)
        gem = tokens[:, 1:].clamp(min=1e-6).pow(3).mean(1).pow(1 / 3)
        assert torch.allclose(pooled("test_vit", "gem")[0], gem, atol=1e-5)
        got, net = pooled("test_convnext", "model")
        assert torch.allclose(got, net(x), atol=1e-6)
        assert torch.allclose(pooled("test_convnext", "mean")[0],
                              net.forward_features(x).mean((2, 3)), atol=1e-6)
    with pytest.raises(ValueError, match="pooling='avg' does not apply to timm:test_vit"):
        pooled("test_vit", "avg")
    with pytest.raises(ValueError, match="pooling='cls' does not apply to timm:test_convnext"):
        pooled("test_convnext", "cls")
    assert timm.create_model("test_vit").num_prefix_tokens == 1


def test_unknown_model_or_missing_weights_fail_in_one_line_before_any_data(tmp_path):
    from training.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, {"backbone": "timm:vit_smal_patch14_dinov2"})
    msg = str(e.value)
    assert "\n" not in msg and "unknown timm model 'vit_smal_patch14_dinov2'" in msg
    assert "timm.list_models('*vit*'" in msg
    with pytest.raises(ConfigError, match=r"Invalid pretrained tag \(nope\)"):
        load_config(None, {"backbone": "timm:test_vit.nope"})
    with pytest.raises(ConfigError, match=r"missing\.safetensors: weights file not found"):
        load_config(None, {"backbone": "timm:test_vit", "weights": str(tmp_path / "missing.safetensors")})
    with pytest.raises(ConfigError, match="layer_decay needs a timm"):
        load_config(None, {"backbone": "resnet18", "layer_decay": 0.75})


def test_hub_offline_fails_in_one_line_naming_the_file_to_provide(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "HF_HOME": str(tmp_path / "hf"), "DAS_CACHE": str(tmp_path / "das")}
    r = subprocess.run([sys.executable, "-m", "embedder", "pretrained", "--backbone",
                        "timm:test_vit.r160_in1k", "--out", str(tmp_path / "m.onnx")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and not (tmp_path / "m.onnx").exists()
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "https://huggingface.co/timm/test_vit.r160_in1k/resolve/main/model.safetensors" in lines[0]
    assert "--weights PATH" in lines[0] and str(tmp_path / "hf" / "hub") in lines[0]


def test_layer_decay_groups_lr_by_depth(tmp_path):
    from training.config import TrainConfig
    from training.run_state import build_model, build_optimizer
    from training.stages import split_stages
    from training.step import build_criterion

    cfg = TrainConfig(backbone="timm:test_vit", pretrained=False, dim=8, pooling="cls",
                      trainable="last:2", layer_decay=0.5, lr=1e-3, backbone_lr=1e-4,
                      loss="multisimilarity", miner="none").validate()
    model = build_model(cfg)
    split = split_stages(model, cfg.trainable)
    opt, _ = build_optimizer(cfg, model, build_criterion(cfg, 4), split)
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    net = model.backbone.net
    assert lr_of[id(model.head.weight)] == pytest.approx(1e-3)
    # timm's groups of a head-less model: the final norm with the last block, at backbone_lr
    assert lr_of[id(net.norm.weight)] == pytest.approx(1e-4)
    assert lr_of[id(net.blocks[5].mlp.fc1.weight)] == pytest.approx(1e-4)
    assert lr_of[id(net.blocks[4].mlp.fc1.weight)] == pytest.approx(0.5e-4)
    assert id(net.blocks[3].mlp.fc1.weight) not in lr_of                 # frozen
    assert not net.blocks[3].mlp.fc1.weight.requires_grad and not net.pos_embed.requires_grad


@pytest.mark.parametrize("arch,trainable", [("test_vit", "last:2"), ("test_convnext", "last:1")])
def test_frozen_prefix_then_trainable_suffix_is_the_whole_network(arch, trainable):
    """What the trunk cache stores (tokens after block L-N, a ConvNeXt stage's input) followed by
    the trained part gives the embedder's own output."""
    from embedder import Embedder, EmbedderConfig
    from training.stages import split_stages

    torch.manual_seed(0)
    model = Embedder(EmbedderConfig(backbone=f"timm:{arch}", dim=8, pooling="model",
                                    pretrained=False)).eval()
    split = split_stages(model, trainable)
    x = torch.randn(2, 3, 160, 160)
    with torch.no_grad():
        acts = split.prefix(x)
        assert torch.allclose(split.suffix.eval()(acts), model(x), atol=1e-5)
    if arch == "test_vit":
        assert acts.shape == (2, 101, 64)            # class token + 10 x 10 patches
        assert not any(p.requires_grad for p in model.backbone.net.blocks[3].parameters())
        assert all(p.requires_grad for p in model.backbone.net.blocks[4].parameters())
