"""Real training on a few Omniglot classes: CLI end to end to an ONNX file, and exact resume."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def test_cli_short_training_beats_untrained_and_exports_onnx(tmp_path, omniglot_root):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "training", "--config", str(REPO / "configs" / "omniglot_cpu.toml"),
           "--root", str(omniglot_root), "--out", str(out), "--max_classes", "30",
           "--epochs", "3", "--eval_every", "1", "--progress", "false", "--threads", "2",
           "--set", "parity_images=4"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "metrics.json").read_text())
    assert report["best"]["R@1"] > report["initial"]["R@1"] + 0.03, report
    assert f"best epoch {report['best_epoch']}" in proc.stdout
    for name in ("best.pt", "last.pt", "log.csv", "metrics.md", "curves.png", "frm.png", "model.onnx"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "log.csv").read_text().count("\n") == 1 + 1 + 3  # header, epoch 0, 3 epochs
    assert "| best (epoch" in (out / "metrics.md").read_text()

    # The ONNX file embeds the held-out images like the best checkpoint and reproduces its R@1.
    from embedder import OnnxEmbedder, load_checkpoint
    from embedder.metrics import evaluate
    from training.data import load_splits

    _, test = load_splits("omniglot", omniglot_root, max_classes=30)
    onnx = OnnxEmbedder(out / "model.onnx", device="cpu", threads=2)
    emb = onnx.embed(test.paths)
    model, ck = load_checkpoint(out / "best.pt")
    assert ck["epoch"] == report["best_epoch"]
    with torch.no_grad():
        x = torch.from_numpy(np.stack([onnx.prepare(p) for p in test.paths[:8]]))
        ref = model(x).numpy()
    np.testing.assert_allclose(emb[:8], ref, atol=1e-4)
    r1 = evaluate(emb, test.labels, ks=(1,), clustering=False, map_r=False)["R@1"]
    assert abs(r1 - report["best"]["R@1"]) < 0.005


def _tiny_cfg(root, out, **kw):
    from training.config import TrainConfig

    base = dict(dataset="omniglot", root=str(root), max_classes=8, cache_images=True,
                backbone="small_cnn", pretrained=False, dim=32, loss="margin", miner="distance",
                das=True, epochs=3, lr=1e-3, lr_milestones=[2], batch_size=32, per_class=4,
                steps_per_epoch=3, eval_every=1, eval_clustering=False, export_onnx=False,
                tensorboard=False, progress=False, seed=3, device="cpu", amp="off",
                out=str(out))
    base.update(kw)
    return TrainConfig(**base)


def test_resume_equals_uninterrupted_run(tmp_path, omniglot_root):
    from training import train

    straight = train(_tiny_cfg(omniglot_root, tmp_path / "a"))
    train(_tiny_cfg(omniglot_root, tmp_path / "b", epochs=2))
    resumed = train(_tiny_cfg(omniglot_root, tmp_path / "b", resume=True))

    strip = lambda h: [{k: v for k, v in r.items() if k != "seconds"} for r in h]  # noqa: E731
    assert strip(resumed.history) == strip(straight.history)
    assert len(straight.history) == 4 and straight.history[-1]["steps"] == 9
    a = torch.load(tmp_path / "a" / "last.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "last.pt", weights_only=True)
    for part in ("state_dict", "criterion", "das"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            if isinstance(a[part][k], torch.Tensor):
                torch.testing.assert_close(a[part][k], b[part][k], rtol=0, atol=1e-6, msg=f"{part}.{k}")
    assert a["das"]["frm"].sum() > 0  # DAS state really was carried
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=0, atol=1e-9)
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"] == 3
    # the lr decayed at the milestone, including the margin betas' own group
    assert a["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-3 * 0.3)
    assert len(a["optimizer"]["param_groups"]) >= 2


def test_non_finite_loss_stops_with_clear_message(tmp_path, omniglot_root):
    from training import train
    from training.trainer import NonFiniteLossError

    cfg = _tiny_cfg(omniglot_root, tmp_path / "nan", epochs=1, lr=1e30, loss="contrastive",
                    das=False, eval_initial=False)
    with pytest.raises(NonFiniteLossError, match=r"loss is (nan|inf).*lower the learning rate"):
        train(cfg)


def test_a_pml_loss_trains_behind_das_and_resumes_with_its_proxies(tmp_path, omniglot_root):
    """DAS in front of a loss the paper does not have (PML's Proxy-Anchor): its proxies are
    trained at their own rate, saved, and a resumed run equals an uninterrupted one."""
    from training import train

    kw = dict(loss="pml:ProxyAnchorLoss", miner="none")
    straight = train(_tiny_cfg(omniglot_root, tmp_path / "a", **kw))
    train(_tiny_cfg(omniglot_root, tmp_path / "b", epochs=2, **kw))
    resumed = train(_tiny_cfg(omniglot_root, tmp_path / "b", resume=True, **kw))
    strip = lambda h: [{k: v for k, v in r.items() if k != "seconds"} for r in h]  # noqa: E731
    assert strip(resumed.history) == strip(straight.history)
    a = torch.load(tmp_path / "a" / "last.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "last.pt", weights_only=True)
    torch.testing.assert_close(a["criterion"]["loss.proxies"], b["criterion"]["loss.proxies"])
    groups = {g["name"]: g for g in a["optimizer"]["param_groups"]}
    [pid] = groups["pml:ProxyAnchorLoss.proxies"]["params"]
    assert groups["pml:ProxyAnchorLoss.proxies"]["initial_lr"] == 1e-2 and a["optimizer"]["state"][pid]["step"] == 9
    assert a["das"] and straight.history[-1]["R@1"] > 0
    with pytest.raises(ValueError, match="'pml:ProxyAnchorLoss': .*unexpected keyword argument 'margn'"):
        train(_tiny_cfg(omniglot_root, tmp_path / "bad", loss_options={"margn": 0.1}, **kw))
    assert not (tmp_path / "bad").exists()           # refused before anything is written
