"""Run report pieces: FRM normalisation (supp. Fig. III), Markdown table, PNG files."""
from __future__ import annotations

import json

import numpy as np

from training.config import TrainConfig
from training.report import metrics_markdown, normalised_frm, write_report


def test_frm_rows_normalised_by_their_max_first_48_classes():
    rng = np.random.default_rng(0)
    frm = rng.integers(0, 50, size=(60, 16)).astype(np.float32)
    frm[3] = 0
    m = normalised_frm(frm)
    assert m.shape == (48, 16)
    np.testing.assert_allclose(m[[0, 1, 2, 47]].max(axis=1), 1.0)
    assert not m[3].any()
    np.testing.assert_allclose(m[5], frm[5] / frm[5].max())


def test_report_files(tmp_path):
    history = [{"epoch": 0, "steps": 0, "loss": "", "R@1": 0.2, "R@2": 0.3, "NMI": 0.4},
               {"epoch": 1, "steps": 5, "loss": 0.9, "R@1": 0.5, "R@2": 0.6, "NMI": 0.5},
               {"epoch": 2, "steps": 10, "loss": 0.7},
               {"epoch": 3, "steps": 15, "loss": 0.6, "R@1": 0.45, "R@2": 0.62, "NMI": 0.55}]
    cfg = TrainConfig(dataset="omniglot", epochs=3)
    paths = write_report(tmp_path, cfg, history, 1, history[1], history[0],
                         np.eye(4, 8) * 5, ["a/1", "a/2", "b/1", "b/2"])
    md = paths["markdown"].read_text()
    assert "Best epoch by R@1: **1** of 3" in md
    assert "| best (epoch 1) | 50.00 | 60.00 | 50.00 |" in md
    assert "| last (epoch 3) | 45.00 | 62.00 | 55.00 |" in md
    data = json.loads(paths["json"].read_text())
    assert data["best_epoch"] == 1 and data["last"]["R@1"] == 0.45
    for key in ("curves", "frm"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert metrics_markdown([("x", {"R@1": 1.0})]).splitlines()[0] == "| model | R@1 |"
