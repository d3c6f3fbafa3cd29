"""The frozen-feature benchmark on real Caltech-101 photos (3 + 3 classes, 1 epoch): pooled
features cached once (the trainer's trunk cache), the head trained by the trainer itself
(``trainable = "head"``), the grid's paired report."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from knn_asserts import recall_bounds

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def splits(caltech_mini, pretrained_onnx, tmp_path_factory):
    sys.path.insert(0, str(REPO))
    from benchmarks.training.frozen_features import frozen_splits

    cache = tmp_path_factory.mktemp("features")
    train, test = frozen_splits(caltech_mini, cache=cache, max_classes=3, progress=False)
    return train, test, cache


def test_features_are_computed_once_and_split_by_class(splits, caltech_mini, monkeypatch):
    from benchmarks.training import frozen_features
    from training.data import _natural_key

    train, test, cache = splits
    classes = sorted((d.name for d in caltech_mini.iterdir() if d.is_dir()), key=_natural_key)
    assert train.classes == classes[:3] and test.classes == classes[3:6]
    assert train.features.shape == (len(train), 1280) and test.features.shape[1] == 1280
    np.testing.assert_allclose(np.linalg.norm(train.features, axis=1), 1.0, atol=1e-4)
    assert len(list(Path(cache).glob("*.npy"))) == 2          # training and test images

    def no_model(*a, **k):
        raise AssertionError("features were recomputed instead of read from the cache")
    monkeypatch.setattr("training.trunk_cache.ThreadPoolExecutor", no_model)
    again, _ = frozen_features.frozen_splits(caltech_mini, cache=cache, max_classes=3,
                                             progress=False)
    np.testing.assert_array_equal(again.features, train.features)


def test_pca_head_starts_at_the_frozen_ranking_and_training_is_seeded(splits, caltech_mini,
                                                                      tmp_path):
    # ported from training/frozen.py's train_head to the trainer with trainable = "head"
    from benchmarks.training.frozen_features import head_run_config, pca_head
    from embedder.metrics import evaluate
    from training import train as run

    train, test, cache = splits
    raw = evaluate(test.features, test.labels, ks=(1,), clustering=False)
    head = pca_head(train, 32)
    with torch.no_grad():
        start = evaluate(head(torch.from_numpy(test.features)).numpy(), test.labels, ks=(1,),
                         clustering=False)
    assert abs(start["R@1"] - raw["R@1"]) < 0.1           # a projection, not a scramble
    kw = dict(max_classes=3, cache_dir=str(cache), loss="triplet", miner="distance", das=True,
              dim=32, epochs=1, lr=1e-3, batch_size=6, per_class=2, seed=3)
    a = run(head_run_config(caltech_mini, eval_initial=True, out=str(tmp_path / "a"), **kw))
    b = run(head_run_config(caltech_mini, out=str(tmp_path / "b"), **kw))
    metrics = ("R@1", "R@2", "R@4", "R@8", "NMI", "F1", "MAP@R")
    assert [a.last_metrics[k] for k in metrics] == [b.last_metrics[k] for k in metrics]
    assert a.history[-1]["steps"] == len(train) // 6
    low, high = recall_bounds(head(torch.from_numpy(test.features)).detach().numpy(), test.labels, 1)
    assert low - 1e-9 <= a.initial_metrics["R@1"] <= high + 1e-9   # the trainer's batches: ties at rank 1
    assert set(a.last_metrics) >= {"R@1", "NMI", "MAP@R"}


def test_tiny_grid_reports_paired_intervals(splits, caltech_mini, tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO))
    from benchmarks.training import frozen_table2

    _, _, cache = splits
    out = tmp_path / "grid"
    rc = frozen_table2.main(["--root", str(caltech_mini), "--max-classes", "3", "--seeds", "0",
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
    assert frozen_table2.main(["--root", str(tmp_path / "missing")]) == 1
