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
TRAIN_CLASSES = {"cub": 100, "cars": 98, "sop": 11318, "omniglot": 100, "folder": 25}


def test_config_set_covers_the_paper():
    names = {p.relative_to(REPO / "configs").as_posix() for p in CONFIGS}
    assert len([n for n in names if n.startswith("table2/")]) == 7 * 3 * 2
    assert len([n for n in names if n.startswith("table3/")]) == 6 * 2
    # supplementary Table I: softmax and arcface, with and without DAS, on CUB, CARS, SOP
    assert len([n for n in names if n.startswith("supp_tableI/")]) == 2 * 2 * 3
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
    from training.run_state import build_model

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
    from training.run_state import build_optimizer
    from training.step import build_criterion, build_das

    cfg = load_config(path)
    assert cfg.root and cfg.out.startswith("runs/")
    n_cls = TRAIN_CLASSES[cfg.dataset]
    # dim = 0 (no embedding layer): the loss and DAS are sized by the pooled features' width
    sized = cfg if cfg.dim else dataclasses.replace(cfg, dim=_model_out_dim(cfg, True)[0])
    criterion = build_criterion(sized, n_cls)
    dim, norm = _model_out_dim(cfg, criterion.normalize)
    assert dim == sized.dim
    assert (abs(norm - 1) < 1e-4) == criterion.normalize
    das = build_das(sized, n_cls, criterion.normalize) if cfg.das else None
    # one step's worth of the loss on a class-balanced batch, through DAS when on
    sampler = ClassBalancedBatchSampler(np.repeat(np.arange(n_cls), cfg.per_class * 2),
                                        batch_size=cfg.batch_size, per_class=cfg.per_class, seed=0)
    batch = next(iter(sampler))
    labels = torch.as_tensor(np.repeat(np.arange(n_cls), cfg.per_class * 2)[batch])
    torch.manual_seed(0)
    emb = torch.randn(len(batch), sized.dim, requires_grad=True)
    e = torch.nn.functional.normalize(emb, dim=1) if criterion.normalize else emb
    if das is not None:
        assert (das.dfs, das.mts, das.topk) == (cfg.das_dfs, cfg.das_mts, cfg.das_topk)
        assert (das.scale_bounds, das.shift_scale, das.detach) == \
            (cfg.das_scale_bounds_tuple, cfg.das_shift_scale, cfg.das_detach)
        assert das.bank.dtype == getattr(torch, cfg.das_bank_dtype)
        e, lab = das(e, labels)
        assert len(e) == len(batch) * (cfg.das_num_produce + 1)
    else:
        lab = labels
    loss = criterion(e, lab)
    assert torch.isfinite(loss)
    loss.backward()
    assert emb.grad is not None
    opt, sched = build_optimizer(cfg, torch.nn.Linear(2, 2), criterion)
    assert opt.defaults["weight_decay"] == cfg.weight_decay
    # MultiStepLR, or with a warm-up the same milestones inside a LambdaLR factor
    assert sched.milestones if cfg.warmup_epochs == 0 else sched.lr_lambdas[0].milestones


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
    ("optimizer = 'sgd'", "unknown option(s) optimizer; see"),
    ("epoch = 4", "unknown option(s) epoch; did you mean epoch -> epochs?"),
    ("dataset = 'imagenet'", "dataset='imagenet': expected one of"),
    ("batch_size = 100\nper_class = 3", "not a multiple of per_class=3"),
    ("lr = [", "not valid TOML"),
    ("include = 'missing.toml'", "config file not found"),
    ("das_scale_bounds = [2.0, 0.5]", "das_scale_bounds=[2.0, 0.5]: expected 0 < low <= high"),
    ("das_scale_bounds = [0, 2]", "das_scale_bounds=[0.0, 2.0]: expected 0 < low <= high"),
    ("das_scale_bounds = [0.5]", "das_scale_bounds=[0.5]: expected [] or [low, high]"),
    ("das_scale_bounds = [0.5, 1.0, 2.0]", "expected [] or [low, high]"),
    ("das_scale_bounds = ['a', 'b']", "das_scale_bounds=['a', 'b']: expected list"),
    ("das_bank_dtype = 'float8'", "das_bank_dtype='float8': expected one of float32, float16, bfloat16"),
    ("das_aux_loss = 'yes'", "das_aux_loss='yes': expected bool"),
    ("das_aux_weight = -1", "das_aux_weight=-1.0: expected a finite number >= 0"),
    ("das_scale_range = 1.5", "das_scale_range=1.5: expected 0 <= r_s < 1"),
    ("das_preset = 'fast'", "das_preset='fast': expected one of paper, robust"),
    ("loss_flavour = 'roth'", "loss_flavour='roth': expected one of authors, pml"),
    ("test_images = 1.0", "test_images=1.0: expected a share in [0, 1)"),
    ("test_images = 0.2", "test_images=0.2 holds out photos of every class of a folder dataset: not with dataset='cub'"),
    ("dataset = 'folder'\ntest_images = 0.2\nvalidation_classes = 4", "not with validation_classes"),
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


def test_cli_help_lists_every_option_with_default_and_errors_are_one_line(tmp_path, capsys):
    """The kit's policy (embedder/cli.py), in-process: a bad config value is a usage error (exit
    2, the short usage line then ONE error line), a missing dataset an expected error (exit 1,
    one line), neither a traceback."""
    from training.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name} VALUE" in text, f.name
    assert '(default: 1e-05)' in text and '(default: 112)' in text and '(default: "resnet50")' in text
    assert main(["--config", str(REPO / "configs" / "omniglot_cpu.toml"), "--epochs", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("usage: python -m training [--config FILE]")
    assert err[1].startswith("python -m training: error: ") and "epochs=0: expected a positive" in err[1]
    assert main(["--dataset", "cub", "--root", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r"),
                 "--backbone", "small_cnn", "--pretrained", "false"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUB-200-2011 root" in err[0] and "nowhere" in err[0]
    (tmp_path / "a_file").write_text("")      # --out inside a file: refused before any data is read
    assert main(["--config", str(REPO / "configs" / "omniglot_cpu.toml"), "--out", str(tmp_path / "a_file" / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"python -m training: error: --out {tmp_path}/a_file/run: {tmp_path}/a_file is a file; "
                       "expected a run directory (new or existing)"), err


def test_base_files_hold_the_paper_recipe():
    base = load_toml(REPO / "configs" / "base" / "cub.toml")
    cfg = load_config(REPO / "configs" / "table2" / "cars_triplet_distance_das.toml")
    assert base["lr"] == 1e-5 and base["weight_decay"] == 4e-4 and base["epochs"] == 300
    assert (cfg.batch_size, cfg.per_class, cfg.lr_milestones, cfg.lr_gamma) == (112, 2, [200, 250], 0.3)
    assert (cfg.loss, cfg.miner, cfg.das, cfg.dataset, cfg.dim) == ("triplet", "distance", True, "cars", 128)


def test_das_presets_fill_in_options_that_the_config_does_not_set(tmp_path):
    from training.config import DAS_PRESETS
    from training.step import build_das

    assert DAS_PRESETS["paper"] == {} and load_config(None, []).das_preset == "paper"
    robust = DAS_PRESETS["robust"]
    cfg = load_config(None, ["das_preset=robust"])
    assert {k: getattr(cfg, k) for k in robust} == robust
    # an explicit key wins over the preset, in a file as on the command line
    key, value = "das_shift_scale", 0.25
    (tmp_path / "c.toml").write_text(f"das_preset = 'robust'\n{key} = {value}\n")
    cfg = load_config(tmp_path / "c.toml")
    assert getattr(cfg, key) == value and cfg.das_scale_bounds == robust["das_scale_bounds"]
    das = build_das(load_config(None, {"das_preset": "robust"}), 5, normalize=True)
    assert das.detach == robust.get("das_detach", True)
    assert das.scale_bounds == tuple(robust["das_scale_bounds"])
    # a preset's refinement for one loss: robust detaches the copies for contrastive only,
    # and an explicit key still wins
    assert load_config(None, ["das_preset=robust", "loss=contrastive"]).das_detach is True
    assert load_config(None, ["das_preset=robust", "loss=margin"]).das_detach is False
    assert load_config(None, ["das_preset=robust", "loss=contrastive", "das_detach=false"]).das_detach is False
    assert load_config(None, ["das_preset=paper", "loss=contrastive"]).das_detach is True
    # the paper's configs keep the spec's defaults and the authors' loss flavour
    paper = load_config(REPO / "configs" / "table2" / "cub_triplet_distance_das.toml")
    assert (paper.das_preset, paper.loss_flavour, paper.das_detach, paper.das_shift_scale) == \
        ("paper", "authors", True, 0.01)


def test_new_das_options_parse_and_reach_the_das_module(tmp_path):
    from training.step import aux_weight, build_das

    assert (TrainConfig().das_scale_bounds, TrainConfig().das_bank_dtype,
            TrainConfig().das_aux_loss, TrainConfig().das_aux_weight) == ([], "float32", False, 1.0)
    (tmp_path / "c.toml").write_text("das_scale_bounds = [0.5, 2]\ndas_bank_dtype = 'float16'\n")
    cfg = load_config(tmp_path / "c.toml", ["das_aux_loss=true", "das_aux_weight=0.25"])
    assert cfg.das_scale_bounds == [0.5, 2.0] and cfg.das_scale_bounds_tuple == (0.5, 2.0)
    assert (cfg.das_bank_dtype, cfg.das_aux_loss, cfg.das_aux_weight) == ("float16", True, 0.25)
    assert aux_weight(cfg) == 0.25
    das = build_das(cfg, 5, normalize=True)
    assert das.scale_bounds == (0.5, 2.0) and das.bank.dtype == torch.float16
    # the produced copies are scaled by factors from the absolute bounds, not U[1-r_s, 1+r_s]:
    # DFS alone, unnormalised, on all-ones embeddings, so each copy's entries are its factors
    dfs_only = build_das(dataclasses.replace(cfg, das_mts=False, das_num_produce=200), 5,
                         normalize=False)
    out, _ = dfs_only(torch.ones(10, cfg.dim), torch.arange(5).repeat(2))
    factors = out[10:][out[10:] != 1.0]
    assert len(factors) == 200 * 10 * cfg.das_topk
    assert 0.5 <= float(factors.min()) < 0.6 and 1.9 < float(factors.max()) <= 2.0
    das = build_das(load_config(None, ["das_bank_dtype=bfloat16"]), 5, normalize=True)
    assert das.scale_bounds is None and das.scale_range == 0.01 and das.bank.dtype == torch.bfloat16
    # the CLI flag form
    proc = _cli("--das_scale_bounds", "[0.5, 2.0]", "--das_bank_dtype", "bfloat16",
                "--das_aux_loss", "true", "--print-config")
    assert proc.returncode == 0, proc.stderr
    assert '"das_scale_bounds": [\n    0.5,\n    2.0\n  ]' in proc.stdout
    proc = _cli("--das_bank_dtype", "int8", "--print-config")
    assert proc.returncode == 2 and "das_bank_dtype='int8'" in proc.stderr


# The SOP rows of the authors' released run scripts (table2.sh):
# (scale bounds or None for r_s = 0.01, r_b, detach, aux loss, normalised)
SOP_AUTHORS = {
    "triplet_semihard": ((0.5, 2.0), 0.1, True, True, True),
    "triplet_distance": ((0.5, 2.0), 0.1, True, True, True),
    "contrastive_distance": ((0.5, 2.0), 0.1, False, False, True),
    "margin_distance": ((0.5, 2.0), 0.01, False, False, True),
    "lifted": (None, 0.1, False, False, False),
    "npair": (None, 0.1, False, False, False),
    "multisimilarity": ((0.5, 2.0), 0.1, False, False, True),
}


@pytest.mark.parametrize("name", sorted(SOP_AUTHORS))
def test_sop_das_configs_carry_the_authors_settings(name):
    from training.step import aux_weight, build_criterion, build_das

    bounds, r_b, detach, aux, normalized = SOP_AUTHORS[name]
    cfg = load_config(REPO / "configs" / "table2" / f"sop_{name}_das.toml")
    criterion = build_criterion(cfg, 20)
    das = build_das(cfg, 20, criterion.normalize)
    assert das.scale_bounds == bounds and das.scale_range == 0.01
    assert (das.shift_scale, das.detach, das.normalize) == (r_b, detach, normalized)
    assert (aux_weight(cfg) is not None) == aux and cfg.das_aux_weight == 1.0
    # CUB and CARS keep the spec's recipe for the same loss
    for ds in ("cub", "cars"):
        other = load_config(REPO / "configs" / "table2" / f"{ds}_{name}_das.toml")
        d = build_das(other, 20, criterion.normalize)
        assert (d.scale_bounds, d.scale_range, d.shift_scale, d.detach) == (None, 0.01, 0.01, True)
        assert aux_weight(other) is None


def test_table1_sop_and_supplementary_table_i():
    from training.run_state import build_optimizer
    from training.step import build_criterion

    cfg = load_config(REPO / "configs" / "table1" / "sop_ms_das_r512.toml")
    assert (cfg.das_scale_bounds, cfg.das_shift_scale, cfg.das_detach, cfg.das_aux_loss) == \
        ([0.5, 2.0], 0.1, False, False)
    cub = load_config(REPO / "configs" / "table1" / "cub_ms_das_r512.toml")
    assert (cub.das_scale_bounds, cub.das_shift_scale, cub.das_detach) == ([], 0.01, True)
    proxy_lr = {("softmax", "cub"): 1e-5, ("softmax", "cars"): 1e-5, ("softmax", "sop"): 2e-3,
                ("arcface", "cub"): 5e-4, ("arcface", "cars"): 5e-4, ("arcface", "sop"): 5e-4}
    for (loss, ds), lr in proxy_lr.items():
        for das in ("base", "das"):
            cfg = load_config(REPO / "configs" / "supp_tableI" / f"{ds}_{loss}_{das}.toml")
            assert (cfg.loss, cfg.dataset, cfg.das, cfg.miner_name) == (loss, ds, das == "das", None)
            opt, _ = build_optimizer(cfg, torch.nn.Linear(2, 2), build_criterion(cfg, 10))
            groups = {g["name"]: g["lr"] for g in opt.param_groups}
            assert groups == {"model": cfg.lr, f"{loss}.W": lr}, (ds, loss, groups)


def test_exclude_own_copies_reaches_the_miner():
    """das_exclude_own_copies: the trainer passes each row's origin, so the miner never pairs a
    real anchor with its own copies; off (the default) leaves the spec's behaviour."""
    import torch
    from training import distributed as D
    from training.config import load_config
    from training.run_state import build_components
    from training.step import compute_loss

    seen = []
    for flag in (False, True):
        cfg = load_config(None, {"backbone": "small_cnn", "pretrained": False, "dim": 16,
                                 "loss": "triplet", "miner": "random", "das": True,
                                 "das_exclude_own_copies": flag})
        model, criterion, das = build_components(cfg, num_classes=4)
        calls = []
        miner = criterion.miner
        criterion.miner = lambda e, y, origin=None: calls.append(origin) or miner(e, y, origin)
        x = torch.randn(8, 1, 28, 28)
        y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        loss = compute_loss(model, criterion, das, x, y, info=D.DistInfo(), seed=0,
                            exclude_own_copies=cfg.das_exclude_own_copies)
        assert torch.isfinite(loss)
        seen.append(calls[0])
    assert seen[0] is None
    assert torch.equal(seen[1], torch.arange(32) % 8)
