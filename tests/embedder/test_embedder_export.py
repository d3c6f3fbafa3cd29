"""ONNX export: parity with torch on real images, metadata, preprocessing carried through."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from embedder import (Embedder, EmbedderConfig, OnnxEmbedder, Preprocessing, export_onnx,
                      load_checkpoint, save_checkpoint)
from embedder.checkpoint import file_sha256
from embedder.export import ParityError, check_parity
from embedder.images import load_image


@pytest.fixture(scope="module")
def trained_like(tmp_path_factory, omniglot_paths):
    """A small_cnn checkpoint with non-default preprocessing and unnormalised outputs, exported."""
    torch.manual_seed(3)
    pre = Preprocessing(input_size=28, resize=34, mean=(0.92,), std=(0.25,), mode="L", hflip=False)
    model = Embedder(EmbedderConfig(backbone="small_cnn", dim=48, pooling="avgmax", normalize=False), pre)
    # move BN statistics away from their init so eval-mode BN is really exercised
    with torch.no_grad():
        model.train()(torch.from_numpy(np.stack([pre.eval_array(load_image(p, mode="L"))
                                                 for p in omniglot_paths])))
    d = tmp_path_factory.mktemp("export")
    ckpt = save_checkpoint(d / "model.pt", model.eval())
    loaded, _ = load_checkpoint(ckpt)
    out = export_onnx(loaded, d / "model.onnx", source_hash=file_sha256(ckpt),
                      parity_images=omniglot_paths[:6])
    return loaded, ckpt, out


def _torch_embed(model, paths):
    pre = model.preprocessing
    x = torch.from_numpy(np.stack([pre.eval_array(load_image(p, mode=pre.mode)) for p in paths]))
    with torch.no_grad():
        return model(x).numpy()


def _assert_parity(got, ref):
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.9999


@pytest.mark.parametrize("batch", [1, 7])
def test_small_onnx_parity_batches(small_onnx, omniglot_paths, batch):
    torch.manual_seed(0)  # the fixture's model, rebuilt the same way
    model = Embedder(EmbedderConfig(backbone="small_cnn", dim=64)).eval()
    paths = omniglot_paths[8:8 + batch]
    emb = OnnxEmbedder(small_onnx, batch_size=batch).embed(paths)
    _assert_parity(emb, _torch_embed(model, paths))
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


def test_preprocessing_round_trips_checkpoint_to_onnx(trained_like, omniglot_paths):
    model, ckpt, out = trained_like
    rt = OnnxEmbedder(out)
    assert rt.preprocessing == model.preprocessing  # resize 34, mean 0.92: not the defaults
    assert rt.dim == 48 and rt.normalized is False
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert meta["source_hash"] == file_sha256(ckpt)
    assert meta["backbone"] == "small_cnn" and meta["input_size"] == "28"
    assert json.loads(meta["mean"]) == [0.92] and json.loads(meta["std"]) == [0.25]
    assert json.loads(meta["config"])["pooling"] == "avgmax"
    # dynamic batch: 1 and 7 through the session, both match torch (unnormalised outputs)
    for n in (1, 7):
        _assert_parity(rt.embed(omniglot_paths[-n:]), _torch_embed(model, omniglot_paths[-n:]))


def test_default_model_path_concurrent_first_use(tmp_path, monkeypatch):
    """Two first uses at once: one export, both get the same complete file, no temp files."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from embedder.pretrained import MODEL_NAME, cache_dir, default_model_path

    if (cache_dir() / f"{MODEL_NAME}.onnx").exists():  # fixture ran first (other order): fresh dir
        monkeypatch.setenv("DAS_CACHE", str(tmp_path / "cache"))
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: default_model_path(), range(2)))
    assert paths[0] == paths[1] and paths[0].parent == cache_dir()
    assert OnnxEmbedder(paths[0]).dim == 1280  # complete and valid
    assert sorted(p.name for p in cache_dir().iterdir()) == sorted(
        [paths[0].name, f".{MODEL_NAME}.lock"])
    assert default_model_path() == paths[0] and os.path.getsize(paths[0]) > 1_000_000


def test_pretrained_embedder(pretrained_onnx, photo_paths):
    from embedder import pretrained_embedder

    from embedder.pretrained import DEFAULT, PRETRAINED

    rt = OnnxEmbedder(pretrained_onnx)
    assert rt.dim == 1280 and rt.normalized and rt.backbone == PRETRAINED[DEFAULT].backbone
    emb = rt.embed(photo_paths[:5])
    _assert_parity(emb, _torch_embed(pretrained_embedder(), photo_paths[:5]))
    # ImageNet features retrieve: a mirrored, slightly cropped photo is nearest to its original
    from PIL import ImageOps

    img = load_image(photo_paths[1])
    w, h = img.size
    q = ImageOps.mirror(img.crop((w // 10, h // 10, w, h)))
    sims = emb @ rt.embed([q])[0]
    assert int(np.argmax(sims)) == 1


def test_parity_error_is_loud(trained_like, small_onnx, omniglot_paths):
    model, _, _ = trained_like
    other = Embedder(EmbedderConfig(backbone="small_cnn", dim=64)).eval()  # different weights
    pre = other.preprocessing
    batch = np.stack([pre.eval_array(load_image(p, mode="L")) for p in omniglot_paths[:3]])
    with pytest.raises(ParityError, match="does not match torch"):
        check_parity(small_onnx, other, batch)
