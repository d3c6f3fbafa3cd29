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


def _vit_onnx(tmp_path: Path, weights: dict[str, Path]) -> Path:
    import dataclasses

    from embedder import Embedder, EmbedderConfig, export_onnx
    from embedder.preprocess import preprocessing_for

    pre = dataclasses.replace(preprocessing_for("timm:test_vit"), input_size=SIZE, resize=68)
    vit = Embedder(EmbedderConfig(backbone="timm:test_vit", dim=0, pooling="gem", pretrained=False,
                                  weights=str(weights["vit"])), pre).eval()
    return export_onnx(vit, tmp_path / "vit.onnx", source_hash="test")


def test_a_vits_int8_is_its_matmuls_quantised_dynamically(cub_root, tmp_path, weights):
    """`indexer build --model VIT --int8`: the static recipe quantises Conv/Clip/Add and would
    leave a ViT's MatMuls (its compute) float; a timm backbone's int8 quantises MatMul/Gemm
    dynamically instead (nothing calibrated), checked against fp32 on the gallery's photos, and
    the int8 index finds each photo's own stored self first as the fp32 one does."""
    import onnx

    from embedder.quantize import DYNAMIC_FORMAT
    from indexer import Index
    from indexer.__main__ import main as indexer_cli
    from inprocess import run_main

    vit_onnx = _vit_onnx(tmp_path, weights)
    gallery = _gallery(cub_root, tmp_path / "gallery")
    r = run_main(indexer_cli, "indexer", ["build", gallery, "--model", vit_onnx, "--int8", "--out",
                                          tmp_path / "idx", "--quiet"])
    assert r.returncode == 0, r.stderr
    idx = Index.open(tmp_path / "idx")
    meta = idx.manifest["model"]["metadata"]
    assert json.loads(meta["quantization"])["format"] == DYNAMIC_FORMAT
    ops = {n.op_type for n in onnx.load(tmp_path / "idx" / "model.onnx").graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops and "QuantizeLinear" not in ops
    photos = sorted(gallery.rglob("*.jpg"))
    for p, hits in zip(photos, idx.search(photos, 1)):
        assert hits[0].path.endswith("/" + p.name) and hits[0].score == pytest.approx(1.0, abs=1e-3)
    # the same int8 model as `embedder quantize` writes: its one line says how it was made
    from embedder.__main__ import main as embedder_cli

    q = run_main(embedder_cli, "embedder", ["quantize", vit_onnx, "--calibration", gallery,
                                            "--out", tmp_path / "q.onnx", "--quiet"])
    assert q.returncode == 0 and "int8 MatMul/Gemm, dynamic; checked on 15 images" in q.stdout, q.stdout + q.stderr
    cos = float(q.stdout.split("mean ")[1].split(",")[0])
    assert cos >= 0.95


def test_vit_and_cnn_indexes_are_searched_through_the_app(cub_root, tmp_path, weights, start_app,
                                                          free_port):
    from embedder.__main__ import main as embedder_cli
    from indexer import build_index

    vit_onnx = _vit_onnx(tmp_path, weights)     # as training exports it (a checkpoint's model)
    cnn_onnx = tmp_path / "cnn.onnx"
    assert embedder_cli(["pretrained", "--backbone", "timm:test_convnext", "--weights",
                         str(weights["cnn"]), "--pooling", "gem", "--input-size", str(SIZE),
                         "--out", str(cnn_onnx)]) == 0
    from embedder.quantize import int8_by_default
    from indexer.cli.defaults import model_metadata

    # `indexer build --model` leaves timm backbones fp32 unasked (their int8: measured on speed only)
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
