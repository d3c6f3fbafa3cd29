"""Fine-tuning on real cub-dev photos (3 + 3 species of `cub_mini`, 12 photos each, 64 px, a few steps): which weights train,
the cached trunk against the full network, the cache's reuse, and the exported ONNX model."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch


def _cfg(root, out, **kw):
    from training.config import TrainConfig

    base = dict(dataset="folder", root=str(root), max_classes=3, backbone="efficientnet_lite0",
                pretrained=True, pooling="gem", dim=16, head_init="pca", trainable="last:1",
                trunk_views=1, frozen_bn=False, loss="multisimilarity", miner="none", das=False,
                epochs=1, lr=1e-3, backbone_lr=1e-3, batch_size=6, per_class=2, input_size=64,
                steps_per_epoch=3, eval_clustering=False, export_onnx=False, tensorboard=False,
                progress=False, device="cpu", amp="off", seed=1, out=str(out),
                cache_dir=str(out.parent / "cache"))
    base.update(kw)
    return TrainConfig(**base).validate()


def _initial(cfg):
    from training.run_state import build_model
    from training.stages import split_stages

    model = build_model(cfg)
    split_stages(model, cfg.trainable)
    return model


def test_last1_trains_only_the_last_stage_and_the_head(cub_mini, tmp_path):
    from training import train

    cfg = _cfg(cub_mini, tmp_path / "run", head_init="random")
    before = _initial(cfg).state_dict()
    train(cfg)
    after = torch.load(tmp_path / "run" / "last.pt", weights_only=True)["state_dict"]
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    last = ("backbone.net.blocks.6.", "backbone.net.conv_head.", "backbone.net.bn2.")
    assert any(k.startswith("head.") for k in changed)
    assert any(k.startswith("backbone.net.blocks.6.") for k in changed)
    assert any(k.startswith("backbone.net.bn2.running") for k in changed)   # BN of the tail trains
    frozen = {k for k in changed if not k.startswith(last + ("head.",))}
    assert frozen == set(), sorted(frozen)[:5]          # stem, stages 0-5, their BN statistics


def test_cached_trunk_gives_the_full_networks_loss_on_the_same_views(cub_mini, tmp_path):
    from training.data import ImageDataset, load_splits
    from training.distributed import DistInfo
    from training.stages import split_stages
    from training.step import build_criterion, compute_loss
    from training.trunk_cache import trunk_activations

    cfg = _cfg(cub_mini, tmp_path / "run", trainable="last:2", frozen_bn=True)
    model = _initial(cfg)
    split = split_stages(model, cfg.trainable)
    train_split, _ = load_splits("folder", cub_mini, max_classes=3)
    pre = cfg.preprocessing()
    ds = ImageDataset(train_split, pre.eval_transform())
    acts = trunk_activations(split.prefix, ds, pre, what="t", views=2, seed=5,
                             cache_dir=tmp_path / "c", progress=False)
    assert acts.shape[:2] == (3, len(ds)) and acts.dtype == np.float16
    idx = [int(i) for c in range(3) for i in np.flatnonzero(train_split.labels == c)[:4]]
    # the same crops, drawn as the cache draws them: view 0 centre, views 1.. seeded per image
    xs, a = [], []
    for i in idx:
        img = ds.image(i)
        torch.manual_seed(5 * 1_000_003 + i)
        crops = [pre.train_transform()(img) for _ in range(2)]
        xs.append(crops[1])
        a.append(torch.from_numpy(np.asarray(acts[2, i], dtype=np.float32)))
    x, a = torch.stack(xs), torch.stack(a)
    y = torch.as_tensor(train_split.labels[idx])
    crit = build_criterion(cfg, 3)
    split.suffix.train()
    full = split.network
    full.train()
    info = DistInfo()
    loss_full = compute_loss(full, crit, None, x, y, info=info, seed=7)
    loss_cached = compute_loss(split.suffix, crit, None, a, y, info=info, seed=7)
    assert loss_full.item() > 0
    assert loss_cached.item() == pytest.approx(loss_full.item(), rel=2e-3, abs=2e-3)
    torch.testing.assert_close(split.suffix(a), full(x), atol=3e-3, rtol=0)
    assert model.training and not any(m.training for m in split.prefix.modules())


def test_trunk_cache_is_reused_and_keyed_by_views(cub_mini, tmp_path, monkeypatch):
    from training.data import ImageDataset, load_splits
    from training.stages import split_stages
    from training.trunk_cache import trunk_activations

    cfg = _cfg(cub_mini, tmp_path / "run", trainable="head")
    model = _initial(cfg)
    split = split_stages(model, "head")
    _, test = load_splits("folder", cub_mini, max_classes=2)
    pre = cfg.preprocessing()
    ds = ImageDataset(test, pre.eval_transform())
    a = np.array(trunk_activations(split.prefix, ds, pre, what="h", cache_dir=tmp_path, progress=False))
    assert a.shape == (1, len(ds), model.num_features)
    calls = []
    monkeypatch.setattr(type(split.prefix), "forward", lambda self, x: calls.append(1) or x)
    b = trunk_activations(split.prefix, ds, pre, what="h", cache_dir=tmp_path, progress=False)
    assert calls == [] and np.array_equal(a, b)
    (tmp_path / "link").symlink_to(cub_mini, target_is_directory=True)   # the root spelled otherwise
    _, same = load_splits("folder", tmp_path / "link", max_classes=2)
    c = trunk_activations(split.prefix, ImageDataset(same, pre.eval_transform()), pre, what="h",
                          cache_dir=tmp_path, progress=False)
    assert calls == [] and np.array_equal(a, c)
    trunk_activations(split.prefix, ds, pre, what="h", views=1, cache_dir=tmp_path, progress=False)
    assert calls                       # other views: another key, computed afresh
    assert len(list(tmp_path.glob("*.npy"))) == 2
    calls.clear()                      # decoded at another size (whole, before 2026-11-30): another key
    trunk_activations(split.prefix, ImageDataset(test, pre.eval_transform(), min_side=pre.decode_side), pre,
                      what="h", cache_dir=tmp_path, progress=False)
    assert calls and len(list(tmp_path.glob("*.npy"))) == 3


def test_cached_run_exports_the_whole_network_to_onnx(cub_mini, tmp_path):
    from embedder import OnnxEmbedder, load_checkpoint
    from embedder.metrics import evaluate
    from training import train
    from training.data import load_splits

    out = tmp_path / "run"
    res = train(_cfg(cub_mini, out, trunk_cache=True, export_onnx=True, parity_images=4,
                     frozen_bn=True, steps_per_epoch=0))
    train_split, test = load_splits("folder", cub_mini, max_classes=3)
    assert res.onnx_path is not None and res.history[-1]["steps"] == len(train_split) // 6
    emb = OnnxEmbedder(res.onnx_path, device="cpu", threads=2).embed(test.paths)
    model, _ = load_checkpoint(res.best_checkpoint)
    assert model.config.pooling == "gem" and model.dim == 16
    r1 = evaluate(emb, test.labels, ks=(1,), clustering=False, map_r=False)["R@1"]
    # the cached trunk evaluated from fp16 activations, ONNX the whole fp32 network
    assert abs(r1 - res.best_metrics["R@1"]) <= 2 / len(test)
    cfg_saved = json.loads((out / "config.json").read_text())
    assert cfg_saved["trunk_cache"] is True


def test_concat_trains_a_second_backbone_first_and_exports_both_in_one_file(cub_mini, tmp_path):
    """config `concat`: the second backbone's run in <out>/<name>/, this one's in <out>, and
    <out>/two.onnx = [second, this] / sqrt(2), evaluated as one embedder."""
    from embedder import OnnxEmbedder, load_checkpoint, load_image
    from embedder.metrics import evaluate
    from training import train
    from training.data import load_splits

    out = tmp_path / "run"
    res = train(_cfg(cub_mini, out, concat="efficientnet_lite1", trunk_cache=True, frozen_bn=True,
                     export_onnx=True, parity_images=4))
    pair = res.pair
    assert pair is not None and pair.backbones == ("efficientnet_lite1", "efficientnet_lite0")
    assert pair.front.best_checkpoint == out / "efficientnet_lite1" / "best.pt"
    assert res.best_checkpoint == out / "best.pt" and pair.onnx_path == out / "two.onnx"
    assert res.onnx_path is None and pair.front.onnx_path is None      # the one file is two.onnx
    _, test = load_splits("folder", cub_mini, max_classes=3)
    both = OnnxEmbedder(pair.onnx_path, device="cpu", threads=2).embed(test.paths)
    assert both.shape == (len(test), 32)
    with torch.inference_mode():
        parts = []
        for ckpt in (pair.front.best_checkpoint, res.best_checkpoint):
            model = load_checkpoint(ckpt)[0]
            x = np.stack([model.preprocessing.eval_array(load_image(p.read_bytes())) for p in test.paths])
            parts.append(model(torch.from_numpy(x)).numpy())
    np.testing.assert_allclose(both * np.sqrt(2), np.concatenate(parts, 1), atol=1e-4)
    r1 = evaluate(both, test.labels, ks=(1,), clustering=False, map_r=False)["R@1"]
    assert abs(r1 - pair.metrics["R@1"]) <= 1 / len(test)
    saved = json.loads((out / "two.json").read_text())
    assert saved["backbones"] == list(pair.backbones) and set(saved["alone"]) == set(pair.backbones)
    assert saved["initial"] == pair.initial and 0 < pair.initial["R@1"] <= 1
    report = (out / "metrics.md").read_text()
    assert "## Both backbones (efficientnet_lite1 + efficientnet_lite0: two.onnx)" in report
    assert f"| best epochs | {100 * pair.metrics['R@1']:.2f} |" in report and "| untrained |" in report
    # the pair's figures come from the runs' kept evaluation embeddings (no second pass): best.pt's
    # embeddings and the epoch-0 network's; a resumed finished pair reads them again
    for run, emb in zip((pair.front, res), parts):
        held = np.load(run.run_dir / "eval_embeddings.npz")
        assert set(held) == {"initial", "best", "labels"} and np.array_equal(held["labels"], test.labels)
        np.testing.assert_allclose(held["best"], emb, atol=1e-4)
        assert evaluate(held["initial"], test.labels, ks=(1,), clustering=False, map_r=False)["R@1"] == \
            run.initial_metrics["R@1"]
    again = train(_cfg(cub_mini, out, concat="efficientnet_lite1", trunk_cache=True, frozen_bn=True,
                       export_onnx=True, parity_images=4, resume=True)).pair
    assert again.metrics == pair.metrics and again.initial == pair.initial


def test_fit_batch_trains_on_fewer_classes_than_a_batch_holds(cub_mini, tmp_path, capsys):
    """The photo recipes' 12 classes a batch on 3 training folders: with fit_batch a batch holds
    all 3 (x per_class); without, the run stops before training, naming the remedy."""
    from training import train

    with pytest.raises(ValueError, match="needs 12 classes per batch, but labels have only 3.*fit_batch"):
        train(_cfg(cub_mini, tmp_path / "strict", batch_size=48, per_class=4))
    res = train(_cfg(cub_mini, tmp_path / "fit", batch_size=48, per_class=4, fit_batch=True,
                     steps_per_epoch=0))
    assert "batch_size 48 -> 12: 3 training classes x per_class 4 (fit_batch)" in capsys.readouterr().out
    assert res.history[-1]["steps"] == 36 // 12                      # 3 classes x 12 photos


def test_test_images_trains_on_every_class_and_evaluates_on_their_held_out_photos(cub_mini, tmp_path):
    """``test_images``: the run trains on all three classes and evaluates (epoch 0 and after) on
    the fifth of each class's photos it never trained on: 3 x 2 of 3 x 12, found by their own class."""
    from training.trainer import train_run

    res = train_run(_cfg(cub_mini, tmp_path / "closed", test_images=0.2, steps_per_epoch=0, epochs=1,
                         trunk_cache=True, eval_ks=[1, 2]), keep_embeddings=True)
    classes = (res.run_dir / "eval_classes.txt").read_text().split()
    assert classes == sorted(d.name for d in cub_mini.iterdir())[:3]
    held = np.load(res.run_dir / "eval_embeddings.npz")
    assert held["best"].shape[0] == 6 and sorted(held["labels"].tolist()) == [0, 0, 1, 1, 2, 2]
    assert res.history[-1]["steps"] == 30 // 6                       # 3 classes x 10 training photos
    assert 0 <= res.initial_metrics["R@1"] <= 1 and "R@1" in res.history[-1]


def test_a_class_smaller_than_per_class_trains_and_bad_splits_stop_before_anything_is_written(cub_mini, tmp_path,
                                                                                              capsys):
    """A training folder of 2 photos beside folders of 12, per_class 4: it trains (its photos repeat
    in its batches, one line names it; it stopped the run until 2026-11-30). Splits that cannot
    train or test stop before anything is written."""
    from training import train

    root = tmp_path / "photos"
    for d in sorted(p for p in cub_mini.iterdir() if p.is_dir()):
        (root / d.name).mkdir(parents=True)
        for f in sorted(d.iterdir())[:2 if d.name == sorted(p.name for p in cub_mini.iterdir())[1] else None]:
            (root / d.name / f.name).symlink_to(f)
    small = sorted(p.name for p in root.iterdir())[1]
    res = train(_cfg(root, tmp_path / "small", per_class=4, batch_size=12, max_classes=0, steps_per_epoch=2))
    assert f"1 training class(es) with fewer than per_class=4 images: '{small}' (2); their images repeat" \
        in capsys.readouterr().out
    assert res.history[-1]["steps"] == 2 and np.isfinite(res.history[-1]["loss"])
    three = tmp_path / "three"                  # 3 classes: the first half is 1 class, no negatives
    for d in sorted(root.iterdir())[:3]:
        shutil.copytree(d, three / d.name, symlinks=True)
    with pytest.raises(ValueError, match="1 training class .*needs two or more"):
        train(_cfg(three, tmp_path / "run", per_class=2, batch_size=4, max_classes=0))
    assert not (tmp_path / "run").exists()
    test_half = sorted(p for p in root.iterdir())[len(list(root.iterdir())) // 2:]
    for d in test_half:                     # the test half one photo a class: nothing could be found
        for f in sorted(d.iterdir())[1:]:
            f.unlink()
    with pytest.raises(ValueError, match="no test class holds two images or more"):
        train(_cfg(root, tmp_path / "run", per_class=2, batch_size=4, max_classes=0))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("concat, says", [("efficientnet_lite0", "is the backbone itself"),
                                          ("resnet18", r"\(mean, std differ\)"),
                                          ("resnet5", "unknown backbone")])
def test_concat_that_cannot_join_fails_before_any_run(tmp_path, concat, says):
    from training.config import ConfigError

    with pytest.raises(ConfigError, match=says):
        _cfg(tmp_path, tmp_path / "run", concat=concat)


def test_pca_head_starts_at_the_pooled_ranking(cub_mini, tmp_path):
    """With head_init = "pca" the untrained embedder ranks the test images (nearly) as its
    pooled features do, so training starts from the pretrained ranking."""
    from embedder.metrics import evaluate
    from training import train
    from training.data import ImageDataset, load_splits

    cfg = _cfg(cub_mini, tmp_path / "run", trainable="head", trunk_cache=True, dim=32, epochs=1,
               steps_per_epoch=1)
    res = train(cfg)
    model = _initial(cfg)
    _, test = load_splits("folder", cub_mini, max_classes=3)
    ds = ImageDataset(test, cfg.preprocessing().eval_transform())
    with torch.no_grad():
        pooled = torch.cat([model.features(torch.stack([ds[i][0] for i in range(s, min(s + 32, len(ds)))]))
                            for s in range(0, len(ds), 32)]).numpy()
    raw = evaluate(pooled / np.linalg.norm(pooled, axis=1, keepdims=True), test.labels, ks=(1,),
                   clustering=False, map_r=False)["R@1"]
    assert abs(res.initial_metrics["R@1"] - raw) < 0.1


def test_validation_classes_never_read_the_test_split(cub_mini, tmp_path):
    from training.data import ImageDataset, load_splits
    from training.finetune import carve_validation

    train, test = load_splits("folder", cub_mini, max_classes=4)
    t = ImageDataset(train, lambda im: im)
    tr, va, rows_t, rows_v = carve_validation(t, ImageDataset(test, lambda im: im), 1)
    assert tr.split.classes == train.classes[:3] and va.split.classes == train.classes[3:]
    assert set(va.split.paths) <= set(train.paths) and not set(va.split.paths) & set(test.paths)
    assert [train.paths[i] for i in rows_v] == va.split.paths
    with pytest.raises(ValueError, match="validation_classes=4"):
        carve_validation(t, t, 4)


def test_optimizer_groups_and_warmup(tmp_path, cub_mini):
    from training.config import ConfigError, TrainConfig
    from training.run_state import RunState

    cfg = _cfg(cub_mini, tmp_path / "r", lr=1e-4, backbone_lr=1e-5, warmup_epochs=2, epochs=6,
               lr_milestones=[4])
    state = RunState.build(cfg, np.array([0, 0, 1, 1, 2, 2]), 3, torch.device("cpu"), None)
    lrs = {g["name"]: g["lr"] for g in state.optimizer.param_groups}
    assert lrs["model"] == pytest.approx(1e-4 / 3) and lrs["backbone"] == pytest.approx(1e-5 / 3)
    head = {id(p) for p in state.model.head.parameters()}
    assert {id(p) for p in state.optimizer.param_groups[0]["params"]} == head
    seen = []
    for _ in range(6):
        seen.append(state.optimizer.param_groups[0]["lr"])
        state.scheduler.step()
    assert seen == pytest.approx([1e-4 / 3, 2e-4 / 3, 1e-4, 1e-4, 3e-5, 3e-5])
    for bad, msg in ((dict(trainable="last:x"), "trainable"),
                     (dict(trainable="all", trunk_cache=True), "trunk_cache"),
                     (dict(head_init="zeros"), "head_init")):
        with pytest.raises(ConfigError, match=msg):
            TrainConfig(**{**cfg.to_dict(), **bad}).validate()
    with pytest.raises(ValueError, match="7 stages"):
        RunState.build(TrainConfig(**{**cfg.to_dict(), "trainable": "last:8"}),
                       np.array([0, 0, 1, 1]), 2, torch.device("cpu"), None)


def test_cache_name_separates_what_the_prefix_computes(tmp_path, cub_mini):
    """The pooled features of a head-only run depend on the pooling; stage activations do not
    depend on the head, so runs that differ only in the head share a cache."""
    from training.finetune import cache_name

    cfg = _cfg(cub_mini, tmp_path / "r", trainable="head")
    names = {cache_name(_replaced(cfg, pooling=p)) for p in ("avg", "gem", "avgmax")}
    assert len(names) == 3
    assert cache_name(_replaced(cfg, pooling="gem", gem_p=4.0)) not in names
    last = _cfg(cub_mini, tmp_path / "r", trainable="last:2")
    assert cache_name(last) == cache_name(_replaced(last, dim=512, pooling="avg",
                                                              head_init="random"))


def _replaced(cfg, **kw):
    from training.config import replace

    return replace(cfg, **kw)
