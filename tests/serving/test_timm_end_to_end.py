"""A timm ViT and a timm CNN (timm's tiny test models, random init, handed over as weights
files) through every path: 1 epoch of DAS training on real cub-dev photos (`cub_mini`) with the trunk cache
off and on, ONNX export with the parity check, a training-free export through
`python -m embedder pretrained --backbone`, `indexer build`, and search through a running app."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

SPECIES = 4
SIZE = 64


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, Path]:
    """test_vit (built for 64 px) and test_convnext saved as a user would hand them over."""
    import safetensors.torch
    import timm

    d = tmp_path_factory.mktemp("timm-weights")
    torch.manual_seed(0)
    vit = timm.create_model("test_vit", img_size=SIZE)
    safetensors.torch.save_file(vit.state_dict(), str(d / "vit.safetensors"))
    torch.manual_seed(0)
    torch.save({"state_dict": timm.create_model("test_convnext").state_dict(), "epoch": 1},
               d / "convnext.pth")
    return {"vit": d / "vit.safetensors", "cnn": d / "convnext.pth"}


def _cfg(cub_root: Path, out: Path, **kw):
    from training.config import TrainConfig

    base = dict(dataset="folder", root=str(cub_root), max_classes=SPECIES, pretrained=False,
                dim=16, trunk_views=1, loss="triplet", miner="distance", das=True, epochs=1,
                lr=1e-3, batch_size=8, per_class=2, input_size=SIZE, steps_per_epoch=3,
                eval_clustering=False, eval_initial=False, export_onnx=False, tensorboard=False,
                progress=False, device="cpu", amp="off", seed=0, out=str(out),
                cache_dir=str(out.parent / "cache"), parity_images=4)
    base.update(kw)
    return TrainConfig(**base).validate()


def _changed(before: dict, run: Path) -> set[str]:
    after = torch.load(run / "last.pt", weights_only=True)["state_dict"]
    return {k for k in before if not torch.equal(before[k], after[k])}


@pytest.mark.parametrize("arch,pooling,trainable,trains", [
    ("vit", "cls", "last:2", ("backbone.net.blocks.4.", "backbone.net.blocks.5.", "backbone.net.norm.")),
    ("cnn", "model", "last:1", ("backbone.net.stages.3.", "backbone.net.head.norm.")),
])
def test_trains_with_das_cache_off_and_on_and_exports(cub_mini, tmp_path, weights, arch, pooling,
                                                      trainable, trains):
    from embedder import OnnxEmbedder
    from training import train
    from training.run_state import build_model

    name = {"vit": "timm:test_vit", "cnn": "timm:test_convnext"}[arch]
    kw = dict(backbone=name, weights=str(weights[arch]), pooling=pooling, trainable=trainable,
              layer_decay=0.75)
    before = build_model(_cfg(cub_mini, tmp_path / "x", **kw)).state_dict()
    for cache in (False, True):
        run = tmp_path / f"cache{int(cache)}"
        cfg = _cfg(cub_mini, run, trunk_cache=cache, export_onnx=cache, **kw)
        train(cfg)
        changed = _changed(before, run)
        assert any(k.startswith(trains) for k in changed) and any(k.startswith("head.") for k in changed)
        assert {k for k in changed if not k.startswith(trains + ("head.",))} == set()
    caches = sorted((tmp_path / "cache").glob("*.npy"))
    acts = np.load(caches[0], mmap_mode="r")
    assert acts.dtype == np.float16
    if arch == "vit":           # tokens after block L-N: 1 class token + (64/16)^2 patches, width 64
        assert acts.shape[2:] == (1 + (SIZE // 16) ** 2, 64)
    onnx = OnnxEmbedder(tmp_path / "cache1" / "model.onnx")
    pre = json.loads(onnx.metadata["preprocessing"])
    assert onnx.metadata["backbone"] == name and pre["interpolation"] == "bicubic"
    assert pre["input_size"] == SIZE and onnx.dim == 16
    # `python -m embedder export best.pt` rebuilds the model from the checkpoint alone (the
    # weights file it started from is recorded, not read) and gives the served embeddings
    from embedder import load_checkpoint

    model, _ = load_checkpoint(tmp_path / "cache1" / "best.pt")
    assert model.config.weights == str(weights[arch])
    img = sorted(cub_mini.rglob("*.jpg"))[0]
    with torch.no_grad():
        ref = model(torch.from_numpy(onnx.prepare(img)[None])).numpy()
    np.testing.assert_allclose(onnx.embed([img]), ref, atol=1e-4)


def _gallery(cub_root: Path, out: Path, per_class: int = 5) -> Path:
    """The first images of the last species of cub-dev (test classes), linked, not copied."""
    for cls in sorted(p for p in cub_root.iterdir() if p.is_dir())[-3:]:
        (out / cls.name).mkdir(parents=True)
        for f in sorted(cls.glob("*.jpg"))[:per_class]:
            (out / cls.name / f.name).symlink_to(f)
    return out


def test_vit_and_cnn_indexes_are_searched_through_the_app(cub_root, tmp_path, weights, start_app,
                                                          free_port):
    from embedder.__main__ import main as embedder_cli
    from embedder import Embedder, EmbedderConfig, export_onnx
    from embedder.preprocess import preprocessing_for
    from indexer import build_index
    import dataclasses

    # the ViT as training exports it (a checkpoint's model), the CNN through the CLI
    pre = dataclasses.replace(preprocessing_for("timm:test_vit"), input_size=SIZE, resize=68)
    vit = Embedder(EmbedderConfig(backbone="timm:test_vit", dim=0, pooling="gem", pretrained=False,
                                  weights=str(weights["vit"])), pre).eval()
    vit_onnx = export_onnx(vit, tmp_path / "vit.onnx", source_hash="test")
    cnn_onnx = tmp_path / "cnn.onnx"
    assert embedder_cli(["pretrained", "--backbone", "timm:test_convnext", "--weights",
                         str(weights["cnn"]), "--pooling", "gem", "--input-size", str(SIZE),
                         "--out", str(cnn_onnx)]) == 0
    from embedder.quantize import int8_by_default
    from indexer.cli.write import model_metadata

    # `indexer build --model` leaves timm backbones fp32 unasked (int8 would leave MatMul float)
    backbones = [model_metadata(m)["backbone"] for m in (vit_onnx, cnn_onnx)]
    assert backbones == ["timm:test_vit", "timm:test_convnext"] and not any(map(int8_by_default, backbones))
    gallery = _gallery(cub_root, tmp_path / "gallery")
    idx = {}
    for name, model in (("vit", vit_onnx), ("cnn", cnn_onnx)):
        idx[name] = tmp_path / f"idx-{name}"
        build_index(gallery, idx[name], model=model, progress=False)
    query = sorted(gallery.rglob("*.jpg"))[7]
    args = ["--index", idx["vit"], "--index", idx["cnn"], "--name", "vit", "--name", "cnn"]
    with start_app(args, tmp_path, free_port()) as (url, _):
        with httpx.Client(timeout=60) as c:
            info = c.get(f"{url}/api/indexes").json()
            assert [i["name"] for i in info] == ["vit", "cnn"]
            for name, dim in (("vit", 64), ("cnn", 64)):
                r = c.post(f"{url}/api/search", data={"k": "3", "index": name},
                           files={"image": (query.name, query.read_bytes(), "image/jpeg")})
                assert r.status_code == 200, r.text
                res = r.json()["results"]
                # the query is in the gallery: the served pipeline (decode, timm's bicubic
                # preprocessing, onnxruntime) finds it first, as indexing embedded it
                assert len(res) == 3 and res[0]["label"] == query.parent.name
                assert res[0]["score"] == pytest.approx(1.0, abs=1e-3)
