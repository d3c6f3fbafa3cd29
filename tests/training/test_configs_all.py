"""Every config file parses and builds its model, loss, sampler and DAS; the CLI's option list
comes from TrainConfig; bad configs fail with a one-line reason."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from training.config import ConfigError, TrainConfig, load_config, load_toml

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.toml") if "base" not in p.parts)
# class counts of the training splits (no dataset needed to build from a config)
TRAIN_CLASSES = {"cub": 100, "cars": 98, "sop": 11318, "omniglot": 100}


def test_config_set_covers_the_paper():
    names = {p.relative_to(REPO / "configs").as_posix() for p in CONFIGS}
    assert len([n for n in names if n.startswith("table2/")]) == 7 * 3 * 2
    assert len([n for n in names if n.startswith("table3/")]) == 6 * 2
    assert {"table1/cub_ms_das_r512.toml", "table1/cars_ms_das_r512.toml",
            "table1/sop_ms_das_r512.toml", "ablation/cars_triplet_distance_dfs_only.toml",
            "ablation/cars_triplet_distance_mts_only.toml", "omniglot_cpu.toml"} <= names


def test_generated_configs_are_up_to_date(tmp_path):
    sys.path.insert(0, str(REPO / "configs"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    shutil_copy = (REPO / "configs" / "base")
    (tmp_path / "base").symlink_to(shutil_copy)
    for p in generate.generate(tmp_path):
        rel = p.relative_to(tmp_path)
        assert p.read_text() == (REPO / "configs" / rel).read_text(), f"re-run configs/generate.py ({rel})"


_MODELS: dict = {}


def _model_out_dim(cfg: TrainConfig, normalize: bool) -> tuple[int, float]:
    """Build each distinct embedder once (ResNet50 is slow to build) and run one image."""
    from training.trainer import build_model

    key = (cfg.backbone, cfg.dim, cfg.pooling, normalize, cfg.input_size)
    if key not in _MODELS:
        model = build_model(dataclasses.replace(cfg, pretrained=False), normalize).eval()
        pre = model.preprocessing
        with torch.no_grad():
            out = model(torch.randn(2, pre.channels(), pre.input_size, pre.input_size))
        _MODELS[key] = (out.shape[1], float(out.norm(dim=1).mean()))
    return _MODELS[key]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(REPO / "configs").as_posix())
def test_config_parses_and_builds(path):
    from training.batching import ClassBalancedBatchSampler
    from training.trainer import build_criterion, build_das, build_optimizer

    cfg = load_config(path)
    assert cfg.root and cfg.out.startswith("runs/")
    n_cls = TRAIN_CLASSES[cfg.dataset]
    criterion = build_criterion(cfg, n_cls)
    dim, norm = _model_out_dim(cfg, criterion.normalize)
    assert dim == cfg.dim
    assert (abs(norm - 1) < 1e-4) == criterion.normalize
    das = build_das(cfg, n_cls, criterion.normalize) if cfg.das else None
    # one step's worth of the loss on a class-balanced batch, through DAS when on
    sampler = ClassBalancedBatchSampler(np.repeat(np.arange(n_cls), cfg.per_class * 2),
                                        batch_size=cfg.batch_size, per_class=cfg.per_class, seed=0)
    batch = next(iter(sampler))
    labels = torch.as_tensor(np.repeat(np.arange(n_cls), cfg.per_class * 2)[batch])
    torch.manual_seed(0)
    emb = torch.randn(len(batch), cfg.dim, requires_grad=True)
    e = torch.nn.functional.normalize(emb, dim=1) if criterion.normalize else emb
    if das is not None:
        assert (das.dfs, das.mts, das.topk) == (cfg.das_dfs, cfg.das_mts, cfg.das_topk)
        e, lab = das(e, labels)
        assert len(e) == len(batch) * (cfg.das_num_produce + 1)
    else:
        lab = labels
    loss = criterion(e, lab)
    assert torch.isfinite(loss)
    loss.backward()
    assert emb.grad is not None
    opt, sched = build_optimizer(cfg, torch.nn.Linear(2, 2), criterion)
    assert opt.defaults["weight_decay"] == cfg.weight_decay and sched.milestones


def test_include_override_and_set_values(tmp_path):
    (tmp_path / "base.toml").write_text('dataset = "omniglot"\nlr = 0.5\nepochs = 9\n')
    (tmp_path / "exp.toml").write_text('include = "base.toml"\nlr = 0.25\n')
    cfg = load_config(tmp_path / "exp.toml", ["epochs=4", "eval_ks=[1, 10]", "root=2024",
                                              "das=false"])
    assert (cfg.dataset, cfg.lr, cfg.epochs, cfg.eval_ks, cfg.root, cfg.das) == \
        ("omniglot", 0.25, 4, [1, 10], "2024", False)
    assert cfg.milestones() == [3]  # 2/3 and 5/6 of 4 epochs, rounded
    assert TrainConfig(epochs=300).milestones() == [200, 250]


@pytest.mark.parametrize("text,message", [
    ("lr = 'fast'", "lr='fast': expected float"),
    ("optimizer = 'sgd'", "unknown option(s) optimizer"),
    ("dataset = 'imagenet'", "dataset='imagenet': expected one of"),
    ("batch_size = 100\nper_class = 3", "not a multiple of per_class=3"),
    ("lr = [", "not valid TOML"),
    ("include = 'missing.toml'", "config file not found"),
])
def test_bad_config_is_named(tmp_path, text, message):
    p = tmp_path / "bad.toml"
    p.write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert message in str(info.value)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "training", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_cli_help_lists_every_option_with_default_and_errors_are_one_line(tmp_path):
    proc = _cli("--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name} VALUE" in text, f.name
    assert '(default: 1e-05)' in text and '(default: 112)' in text and '(default: "resnet50")' in text
    proc = _cli("--config", str(REPO / "configs" / "omniglot_cpu.toml"), "--epochs", "0")
    assert proc.returncode != 0 and proc.stderr.strip().count("\n") == 0
    assert "epochs=0: expected a positive integer" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("--dataset", "cub", "--root", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r"),
                "--backbone", "small_cnn", "--pretrained", "false")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "CUB-200-2011 root" in proc.stderr and "nowhere" in proc.stderr


def test_base_files_hold_the_paper_recipe():
    base = load_toml(REPO / "configs" / "base" / "cub.toml")
    cfg = load_config(REPO / "configs" / "table2" / "cars_triplet_distance_das.toml")
    assert base["lr"] == 1e-5 and base["weight_decay"] == 4e-4 and base["epochs"] == 300
    assert (cfg.batch_size, cfg.per_class, cfg.lr_milestones, cfg.lr_gamma) == (112, 2, [200, 250], 0.3)
    assert (cfg.loss, cfg.miner, cfg.das, cfg.dataset, cfg.dim) == ("triplet", "distance", True, "cars", 128)
