"""benchmarks/training/finetune_table2.py on real cub-dev photos (2 + 2 species of `cub_mini`, 64 px, 2 steps): one
shared trunk cache, paired report, training-free rows, resumable."""
from __future__ import annotations

import json
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def test_tiny_finetune_grid(cub_mini, tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO))
    from benchmarks.training import finetune_table2

    cache, out = tmp_path / "cache", tmp_path / "grid"
    argv = ["--root", str(cub_mini), "--methods", "multisimilarity:none", "--seeds", "0", "1",
            "--out", str(out)] + [a for kv in (
                "max_classes=2", "input_size=64", "epochs=1", "steps_per_epoch=2", "trunk_views=1", "dim=8",
                "batch_size=4", "per_class=2", f"cache_dir={cache}", "threads=2")
                for a in ("--set", kv)]
    assert finetune_table2.main(argv) == 0
    runs = json.loads((out / "runs.json").read_text())
    assert sorted((r["variant"], r["seed"]) for r in runs) == [("DAS", 0), ("DAS", 1),
                                                               ("base", 0), ("base", 1)]
    assert all(set(r["metrics"]) >= {"R@1", "NMI", "MAP@R"} for r in runs)
    # one cache for every run: the training split's views and the test split's centre crops
    assert len(list(cache.glob("*.npy"))) == 2
    text = (out / "results.md").read_text()
    from training.config import load_config

    p = load_config(REPO / "configs" / "photos_finetune_cpu.toml").gem_p      # the recipe's GeM
    assert "training-free, average pooling" in text and f"training-free, GeM p = {p:g}" in text
    assert "| multisimilarity | DAS | 2 |" in text and "/2 |" in text
    assert (out / "r1_differences.png").stat().st_size > 1000

    def no_training(*a, **k):
        raise AssertionError("a finished run was trained again")
    monkeypatch.setattr("training.train", no_training)
    assert finetune_table2.main(argv) == 0            # everything in runs.json: nothing to run
    assert finetune_table2.main(["--root", str(tmp_path / "missing")]) == 1
