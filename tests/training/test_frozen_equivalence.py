"""The trainer with ``trainable = "head"`` reproduces training/frozen.py's head loop on real
cub-dev photos (3 + 3 species): same features, same per-epoch metrics for the same seed.

Written before frozen.py's loop was deleted, to show the port changes nothing but float noise;
the figures it printed are in benchmarks/RESULTS-training.md ("One training loop")."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
CUB = REPO.parent / "shared" / "data" / "cub-dev" / "images"
EPOCHS = 3


def _trainer_cfg(out: Path, **kw):
    from embedder.pretrained import DEFAULT, PRETRAINED
    from training.config import TrainConfig

    spec = PRETRAINED[DEFAULT]
    base = dict(dataset="folder", root=str(CUB), max_classes=3, backbone=spec.backbone,
                pretrained=True, pooling=spec.pooling, gem_p=spec.gem_p,
                input_size=spec.input_size, resize=spec.resize, dim=32, trainable="head",
                trunk_cache=True, trunk_views=0, head_init="pca", head_input="l2",
                loss="triplet", miner="distance", das=True, das_preset="robust",
                epochs=EPOCHS, lr=1e-3, batch_size=6, per_class=2, seed=3,
                eval_ks=[1, 2, 4, 8], eval_clustering=True, eval_initial=True,
                export_onnx=False, tensorboard=False, progress=False, device="cpu", amp="off",
                out=str(out), cache_dir=str(out.parent / "cache"))
    base.update(kw)
    return TrainConfig(**base).validate()


@pytest.mark.parametrize("das", [False, True])
def test_trainer_head_mode_reproduces_frozen_head_loop(tmp_path, pretrained_onnx, das):
    from training import train
    from training.frozen import head_config, train_head
    from training.frozen_features import frozen_splits
    from training.trunk_cache import CachedViews  # noqa: F401  (the cache the trainer reads)

    if not CUB.is_dir():
        pytest.fail(f"cub-dev not found at {CUB}")
    tr, te = frozen_splits(CUB, cache=tmp_path / "features", max_classes=3, progress=False)
    cfg = _trainer_cfg(tmp_path / "run", das=das)
    old = train_head(head_config(loss="triplet", miner="distance", das=das, das_preset="robust",
                                 dim=32, epochs=EPOCHS, lr=1e-3, batch_size=6, per_class=2,
                                 seed=3), tr, te, eval_epochs=list(range(EPOCHS + 1)))
    res = train(cfg)

    # same inputs: the trainer's cached pooled features, L2-normalised, are the ONNX features
    cache = sorted((tmp_path / "cache").glob("*.npy"))
    acts = {np.load(p).shape[1]: np.load(p)[0] for p in cache}
    for feats, split in ((tr.features, tr), (te.features, te)):
        mine = acts[len(split)]
        mine = mine / np.linalg.norm(mine, axis=1, keepdims=True)
        print(f"max |feature diff| over {len(split)} images: {np.abs(mine - feats).max():.2e}")
        assert np.abs(mine - feats).max() < 1e-3

    new = {r["epoch"]: r for r in res.history}
    print(f"DAS={das}: epoch, R@1 / NMI / MAP@R frozen.py vs trainer, loss (trainer)")
    for e in range(EPOCHS + 1):
        a, b = old["metrics"][e], new[e]
        print(e, *(f"{100 * a[k]:.3f}/{100 * b[k]:.3f}" for k in ("R@1", "NMI", "MAP@R")),
              b.get("loss", ""))
        # one test query of 180 moving its nearest neighbour is 0.56 R@1 points
        assert abs(a["R@1"] - b["R@1"]) <= 1.01 / len(te)
        assert abs(a["MAP@R"] - b["MAP@R"]) < 5e-3
    assert old["steps"] == res.history[-1]["steps"]
