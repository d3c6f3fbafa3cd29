"""OnnxEmbedder: batching, sources, failures reported per batch, clear load errors."""
from __future__ import annotations


import numpy as np
import onnx
import pytest
import torch
from PIL import Image

from embedder import ImageLoadError, OnnxEmbedder
from embedder.checkpoint import file_sha256
from embedder.runtime import ModelLoadError


@pytest.fixture(scope="module")
def rt(small_onnx):
    return OnnxEmbedder(small_onnx, device="cpu", threads=1, batch_size=3)


def test_properties(rt, small_onnx):
    assert rt.provider == "cpu"  # no GPU on this machine; "auto" must not claim CUDA either
    assert OnnxEmbedder(small_onnx).provider == "cpu"
    assert rt.model_hash == file_sha256(small_onnx)
    assert rt.dim == 64 and rt.normalized and rt.preprocessing.mode == "L"


def test_batches_and_sources_agree(rt, small_onnx, omniglot_paths):
    paths = omniglot_paths[:7]
    one_batch = OnnxEmbedder(small_onnx, batch_size=32).embed(paths)
    emb = rt.embed(paths)  # batches of 3, 3, 1
    assert emb.shape == (7, 64) and emb.dtype == np.float32
    np.testing.assert_allclose(emb, one_batch, atol=1e-5)
    mixed = [paths[0], paths[1].read_bytes(), Image.open(paths[2])]
    np.testing.assert_allclose(rt.embed(mixed), emb[:3], atol=1e-6)
    x = np.stack([rt.prepare(p) for p in paths])
    np.testing.assert_allclose(rt.embed_arrays(x), emb, atol=1e-6)
    assert rt.embed([]).shape == (0, 64)
    # seven different drawings, seven different embeddings (no constant output)
    assert np.unique(emb.round(4), axis=0).shape[0] == 7


def test_embed_iter_reports_failures(rt, omniglot_paths, tmp_path):
    bad_text = tmp_path / "x.png"
    bad_text.write_text("hello")
    items = [("a", omniglot_paths[0]), ("bad1", bad_text), ("b", omniglot_paths[1]),
             ("c", omniglot_paths[2].read_bytes()), ("bad2", b"\x89PNG\r\n\x1a\n broken"),
             ("d", omniglot_paths[3]), ("e", tmp_path / "missing.png"), ("f", omniglot_paths[4])]
    batches = list(rt.embed_iter(iter(items), workers=2))  # a generator: no len()
    keys = [k for ks, _, _ in batches for k in ks]
    fails = {k: e for _, _, fs in batches for k, e in fs}
    assert keys == ["a", "b", "c", "d", "f"]
    assert set(fails) == {"bad1", "bad2", "e"}
    assert all(isinstance(e, ImageLoadError) for e in fails.values())
    assert fails["bad1"].path == str(bad_text) and "not an image" in fails["bad1"].reason
    assert fails["bad2"].path == "bad2"  # bytes are named by their key
    assert "file not found" in fails["e"].reason
    assert all(len(ks) == len(e) <= 3 for ks, e, _ in batches)
    emb = np.concatenate([e for _, e, _ in batches])
    np.testing.assert_allclose(emb, rt.embed([omniglot_paths[i] for i in range(5)]), atol=1e-6)
    only_bad = list(rt.embed_iter([("z", b"")]))
    assert only_bad[0][0] == [] and only_bad[0][1].shape == (0, 64) and only_bad[0][2][0][0] == "z"


def test_embed_raises_on_bad_image(rt, omniglot_paths):
    with pytest.raises(ImageLoadError, match="empty file"):
        rt.embed([omniglot_paths[0], b""])


def test_embed_arrays_shape_check(rt):
    with pytest.raises(ValueError, match=r"expects \(N, 1, 28, 28\)"):
        rt.embed_arrays(np.zeros((2, 3, 224, 224), np.float32))


def test_model_load_errors(tmp_path, small_onnx):
    with pytest.raises(ModelLoadError, match="ONNX model file not found"):
        OnnxEmbedder(tmp_path / "none.onnx")
    txt = tmp_path / "fake.onnx"
    txt.write_text("not onnx")
    with pytest.raises(ModelLoadError, match="not a loadable ONNX model"):
        OnnxEmbedder(txt)
    ckpt = tmp_path / "best.pt"                 # a training run's checkpoint where its export goes
    torch.save({"state_dict": {}}, ckpt)
    with pytest.raises(ModelLoadError, match="a PyTorch checkpoint, not an ONNX model: .*embedder export"):
        OnnxEmbedder(ckpt)
    proto = onnx.load(str(small_onnx))
    del proto.metadata_props[:]
    plain = tmp_path / "plain.onnx"
    onnx.save(proto, str(plain))
    with pytest.raises(ModelLoadError, match="not a das embedder"):
        OnnxEmbedder(plain)
    with pytest.raises(ValueError, match="device must be"):
        OnnxEmbedder(small_onnx, device="tpu")
