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


def test_export_traces_activations_out_of_place_on_its_own_copy(trained_like, omniglot_paths):
    """export_onnx traces in-place activations out of place (the same graph, a faster trace), on
    its own copy and only while tracing: the model it was given keeps its flags, the switch
    changes no output, and the flags come back after the block (the parity check's reference)."""
    import copy

    from embedder.export import out_of_place

    loaded, _, _ = trained_like
    relus = [m for m in loaded.modules() if isinstance(m, torch.nn.ReLU)]
    assert relus and all(m.inplace for m in relus)          # exported by the fixture, untouched
    twin = copy.deepcopy(loaded)
    with out_of_place(twin) as n:
        assert n == len(relus) and not any(m.inplace for m in twin.modules() if isinstance(m, torch.nn.ReLU))
        switched = _torch_embed(twin, omniglot_paths[:4])
    assert all(m.inplace for m in twin.modules() if isinstance(m, torch.nn.ReLU))
    np.testing.assert_allclose(switched, _torch_embed(loaded, omniglot_paths[:4]),
                               rtol=0, atol=1e-6)          # the same kernels; no bit-equality promised


def test_default_model_path_concurrent_first_use(tmp_path, monkeypatch):
    """Two first uses at once: one export, both get the same complete file, no temp files.
    The export is the real one (export_onnx's atomic write) of a small network in the default's
    place: the lock is what is under test here; the default's own export is checked by the
    ``pretrained_onnx`` fixture and test_pretrained_embedder (an 1,280-d Lite1 export here cost
    46 s of the suite for the same lock)."""
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from embedder import pretrained
    from embedder.pretrained import MODEL_NAME, cache_dir, default_model_path

    monkeypatch.setenv("DAS_CACHE", str(tmp_path / "cache"))
    exports, started = [], threading.Barrier(2)

    def export_small(name, out):
        exports.append(name)
        return export_onnx(Embedder(EmbedderConfig(backbone="small_cnn", dim=32)).eval(), out)

    monkeypatch.setattr(pretrained, "export_pretrained", export_small)

    said = []

    def first_use(_):
        started.wait(timeout=30)          # both threads ask before either has a file
        return default_model_path(on_export=said.append)

    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(first_use, range(2)))
    assert len(exports) == 1, exports
    assert len(said) == 1 and said[0].startswith(f"exporting the pretrained embedder {MODEL_NAME} to ONNX once")
    assert paths[0] == paths[1] == cache_dir() / f"{MODEL_NAME}.onnx"
    assert OnnxEmbedder(paths[0]).dim == 32  # complete and valid
    assert sorted(p.name for p in cache_dir().iterdir()) == sorted(
        [paths[0].name, f".{MODEL_NAME}.lock"])
    assert default_model_path(on_export=said.append) == paths[0] and len(exports) == 1 and len(said) == 1
    assert os.path.getsize(paths[0]) > 1000


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
