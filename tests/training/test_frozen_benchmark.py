"""The frozen-feature benchmark's core on real Caltech-101 photos (3 + 3 classes, 1 epoch):
features cached once, the head trained through the trainer's step, the grid's paired report."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CALTECH = REPO.parent / "shared" / "data" / "caltech101-dev" / "images"


@pytest.fixture(scope="module")
def caltech_root() -> Path:
    if not CALTECH.is_dir():
        pytest.fail(f"caltech101-dev not found at {CALTECH}")
    return CALTECH


@pytest.fixture(scope="module")
def splits(caltech_root, pretrained_onnx, tmp_path_factory):
    from training.frozen_features import frozen_splits

    cache = tmp_path_factory.mktemp("features")
    train, test = frozen_splits(caltech_root, cache=cache, max_classes=3, progress=False)
    return train, test, cache


def test_features_are_computed_once_and_split_by_class(splits, caltech_root, monkeypatch):
    from training import frozen_features
    from training.data import _natural_key

    train, test, cache = splits
    classes = sorted((d.name for d in caltech_root.iterdir() if d.is_dir()), key=_natural_key)
    assert train.classes == classes[:3] and test.classes == classes[25:28]
    assert train.features.shape == (len(train), 1280) and test.features.shape[1] == 1280
    np.testing.assert_allclose(np.linalg.norm(train.features, axis=1), 1.0, atol=1e-4)
    assert len(list(Path(cache).glob("*.npz"))) == 1

    def no_model(*a, **k):
        raise AssertionError("features were recomputed instead of read from the cache")
    monkeypatch.setattr("embedder.OnnxEmbedder", no_model)
    again, _ = frozen_features.frozen_splits(caltech_root, cache=cache, max_classes=3,
                                             progress=False)
    np.testing.assert_array_equal(again.features, train.features)


def test_pca_head_starts_at_the_frozen_ranking_and_training_is_seeded(splits):
    from training.frozen import build_head, evaluate_features, head_config, train_head

    train, test, _ = splits
    raw = evaluate_features(test.features, test.labels)
    head = build_head("pca", train, 32, True)
    with torch.no_grad():
        start = evaluate_features(head(torch.from_numpy(test.features)).numpy(), test.labels)
    assert abs(start["R@1"] - raw["R@1"]) < 0.1           # a projection, not a scramble
    cfg = head_config(loss="triplet", miner="distance", das=True, dim=32, epochs=1, lr=1e-3,
                      batch_size=6, per_class=2, seed=3)
    a = train_head(cfg, train, test, eval_epochs=[0, 1])
    b = train_head(cfg, train, test, eval_epochs=[1])
    assert a["metrics"][1] == b["metrics"][1] and a["steps"] == len(train) // 6
    assert a["metrics"][0]["R@1"] == pytest.approx(start["R@1"])
    assert set(a["metrics"][1]) >= {"R@1", "NMI", "MAP@R"}


def test_tiny_grid_reports_paired_intervals(splits, caltech_root, tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO))
    from benchmarks import frozen_table2

    _, _, cache = splits
    out = tmp_path / "grid"
    rc = frozen_table2.main(["--root", str(caltech_root), "--max-classes", "3", "--seeds", "0",
                             "1", "--epochs", "1", "--methods", "triplet:distance",
                             "multisimilarity:none", "--workers", "1", "--cache", str(cache),
                             "--dim", "16", "--out", str(out)])
    assert rc == 0
    runs = json.loads((out / "runs.json").read_text())
    assert len(runs) == 8 and {r["variant"] for r in runs} == {"base", "DAS"}
    text = (out / "results.md").read_text()
    assert "untrained frozen features" in text and "| triplet [distance] | DAS |" in text
    assert text.count("/2 |") == 2                        # DAS better in k/2 seeds, per pair
    assert (out / "r1_differences.png").stat().st_size > 1000
    assert frozen_table2.main(["--root", str(tmp_path / "missing")]) == 2
