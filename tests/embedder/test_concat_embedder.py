"""The two-backbone embedder (issue 30): L2-normalised embeddings of several backbones
concatenated and scaled by 1/sqrt(n), exported as one ONNX file."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from embedder import Embedder, EmbedderConfig, OnnxEmbedder, export_onnx, load_image
from embedder.concat import ConcatEmbedder
from embedder.pretrained import PRETRAINED, ConcatSpec, parse_spec
from embedder.preprocess import Preprocessing


def test_named_two_backbone_spec():
    spec = parse_spec("lite0+lite1-gem4")
    assert isinstance(spec, ConcatSpec) and spec.dim == 2560
    assert [p.backbone for p in spec.parts] == ["efficientnet_lite0", "efficientnet_lite1"]
    assert all(p.pooling == "gem" and p.gem_p == 4 and p.input_size == 224 for p in spec.parts)
    # the same thing spelled out part by part, and a cache name of its own
    assert parse_spec("lite0-gem4-224+lite1-gem4-224") == spec
    assert spec.model_name not in {s.model_name for s in PRETRAINED.values() if s is not spec}
    assert spec.preprocessing() == spec.parts[1].preprocessing()


def test_parts_with_different_preprocessing_are_refused():
    # Lite1 at its native 240 px cannot share one input with Lite0 at 224
    with pytest.raises(ValueError, match="share one input size"):
        parse_spec("lite0-gem4+lite1-gem4")
    with pytest.raises(ValueError, match="unknown pretrained embedder 'lite9-gem'"):
        parse_spec("lite0-gem4-224+lite9-gem")


def _small(seed: int) -> Embedder:
    torch.manual_seed(seed)
    return Embedder(EmbedderConfig(backbone="small_cnn", dim=32),
                    preprocessing=Preprocessing(28, 32, (0.5,), (0.5,), "L")).eval()


def test_concat_is_the_scaled_concatenation_and_unit_length():
    a, b = _small(0), _small(1)
    cat = ConcatEmbedder([a, b]).eval()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        want = torch.cat([a(x), b(x)], 1) / math.sqrt(2)
        got = cat(x)
    assert cat.dim == 64 and torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(got.norm(dim=1), torch.ones(3), atol=1e-5)
    # the cosine of two concatenated embeddings is the mean of the parts' cosines
    with torch.no_grad():
        pa, pb = a(x), b(x)
    assert torch.allclose(got[0] @ got[1], ((pa[0] @ pa[1]) + (pb[0] @ pb[1])) / 2, atol=1e-5)


def test_concat_refuses_mismatched_or_unnormalised_parts():
    other = Embedder(EmbedderConfig(backbone="small_cnn", dim=32),
                     preprocessing=Preprocessing(32, 36, (0.5,), (0.5,), "L"))
    with pytest.raises(ValueError, match="share one preprocessing"):
        ConcatEmbedder([_small(0), other])
    raw = Embedder(EmbedderConfig(backbone="small_cnn", dim=32, normalize=False),
                   preprocessing=Preprocessing(28, 32, (0.5,), (0.5,), "L"))
    with pytest.raises(ValueError, match="L2-normalise"):
        ConcatEmbedder([_small(0), raw])
    with pytest.raises(ValueError, match="at least two"):
        ConcatEmbedder([_small(0)])


def test_concat_exports_to_one_onnx_file(tmp_path, omniglot_paths):
    cat = ConcatEmbedder([_small(0), _small(1)]).eval()
    out = export_onnx(cat, tmp_path / "cat.onnx", source_hash="two-small-cnns",
                      parity_images=omniglot_paths[:4])   # the parity check passed
    rt = OnnxEmbedder(out)
    assert rt.dim == 64 and rt.normalized and rt.backbone == "small_cnn+small_cnn"
    cfg = json.loads(rt.metadata["config"])
    assert cfg["kind"] == "concat" and [p["dim"] for p in cfg["parts"]] == [32, 32]
    e = rt.embed(omniglot_paths[:4])
    assert e.shape == (4, 64) and np.allclose(np.linalg.norm(e, axis=1), 1, atol=1e-5)


def test_export_puts_a_pretrained_embedder_in_front_of_a_checkpoint(tmp_path, cub_root, omniglot_paths):
    """`embedder export CKPT --concat lite0-gem4-224` (or `--concat LITE0.pt`): the fine-tuning
    recipe's Lite1 with Lite0 in front. With the recipe's networks untouched (epoch 0) that is the
    two-backbone default itself: the same embeddings as `embedder pretrained --name
    lite0+lite1-gem4`. A checkpoint that cannot share the input is refused in one line."""
    from inprocess import run_main

    from embedder import default_model_path, save_checkpoint
    from embedder.__main__ import main
    from embedder.pretrained import pretrained_embedder

    ckpt = save_checkpoint(tmp_path / "best.pt", pretrained_embedder("lite1-gem4-224"))
    r = run_main(main, "embedder", ["export", ckpt, "--concat", "lite0-gem4-224", "--out", tmp_path / "two.onnx"])
    assert r.returncode == 0 and "(efficientnet_lite0+efficientnet_lite1, dim 2560)" in r.stdout, r.stderr
    photos = sorted(cub_root.glob("*/*.jpg"))[:6]
    got = OnnxEmbedder(tmp_path / "two.onnx").embed(photos)
    want = OnnxEmbedder(default_model_path("lite0+lite1-gem4")).embed(photos)
    assert got.shape == (6, 2560) and np.abs(got - want).max() < 1e-4
    # both trunks fine-tuned (the recipe's two runs): a checkpoint in front of a checkpoint; small
    # networks, as the route is what differs (a second two-backbone export cost ~20 s of the suite)
    front, back = save_checkpoint(tmp_path / "a.pt", _small(0)), save_checkpoint(tmp_path / "b.pt", _small(1))
    r = run_main(main, "embedder", ["export", back, "--concat", front, "--out", tmp_path / "both.onnx"])
    assert r.returncode == 0 and "(small_cnn+small_cnn, dim 64)" in r.stdout, r.stderr
    pre = _small(0).preprocessing
    x = np.stack([pre.eval_array(load_image(p, mode=pre.mode)) for p in omniglot_paths[:4]]).astype(np.float32)
    with torch.no_grad():
        both = ConcatEmbedder([_small(0), _small(1)]).eval()(torch.from_numpy(x)).numpy()
    assert np.abs(OnnxEmbedder(tmp_path / "both.onnx").embed(omniglot_paths[:4]) - both).max() < 1e-4
    r = run_main(main, "embedder", ["export", ckpt, "--concat", tmp_path / "none.pt", "--out", tmp_path / "y.onnx"])
    assert r.returncode == 1 and "none.pt" in r.stderr and "not found" in r.stderr
    small = save_checkpoint(tmp_path / "small.pt", _small(0))
    r = run_main(main, "embedder", ["export", small, "--concat", "lite0-gem4-224", "--out", tmp_path / "x.onnx"])
    assert r.returncode == 1 and "share one preprocessing" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.onnx").exists()
