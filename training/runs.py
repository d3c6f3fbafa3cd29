"""What a config asks for: one backbone's run, or with ``concat`` two backbones fine-tuned by one
recipe and joined as the two-backbone default is (`embedder.concat`, the second in front). Why: a
one-backbone run starts below that default (unseen birds, int8 + DBA: 94.76 vs 95.50; both 96.04:
docs/benchmarks/training-das.md). The second trains into ``<out>/<its name>/``, then this one into
``<out>``; the pair, before and after, is evaluated on the runs' split and exported (parity-checked)
to ``<out>/two.onnx``, the one file; ``resume = true`` resumes whichever run was interrupted.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from .config import TrainConfig
from .data import Split
from .report import metrics_markdown
from .trainer import EVAL_EMBEDDINGS, PairResult, TrainResult, split_metrics, train_run


def train(cfg: TrainConfig, *, train_split: Split | None = None,
          test_split: Split | None = None) -> TrainResult:
    """Run (or resume) what `cfg` describes: one backbone's run (training/trainer.py), or with
    ``cfg.concat`` two joined (:func:`train_pair`); returns where everything went.
    `train_split`/`test_split` replace the config's dataset (a benchmark shares one parse)."""
    cfg.validate()
    if cfg.concat:
        return train_pair(cfg, train_split=train_split, test_split=test_split)
    return train_run(cfg, train_split=train_split, test_split=test_split)


def train_pair(cfg: TrainConfig, *, train_split: Split | None = None,
               test_split: Split | None = None) -> TrainResult:
    """The second backbone's run, this one's, then both joined: this run's result with ``pair``."""
    from embedder import export_onnx, file_sha256, load_checkpoint
    from embedder.concat import joined

    out = Path(cfg.out)
    front = train_run(replace(cfg, backbone=cfg.concat, concat="", out=str(out / cfg.concat), export_onnx=False),
                      train_split=train_split, test_split=test_split, keep_embeddings=True)
    main = train_run(replace(cfg, export_onnx=False), train_split=train_split, test_split=test_split,
                     keep_embeddings=True)
    if int(os.environ.get("RANK", "0")) != 0:       # torchrun: rank 0 joins and reports
        return main
    backbones = (cfg.concat, cfg.backbone)
    model, source = joined([(load_checkpoint(r.best_checkpoint)[0], file_sha256(r.best_checkpoint))
                            for r in (front, main)])
    initial, metrics = _joined_metrics(cfg, (front, main), model.scale)
    onnx = export_onnx(model.cpu(), out / "two.onnx", source_hash=source) if cfg.export_onnx else None
    (out / "two.json").write_text(json.dumps({
        "backbones": list(backbones), "metrics": metrics, "initial": initial, "onnx": str(onnx) if onnx else None,
        "alone": {b: r.best_metrics for b, r in zip(backbones, (front, main))}}, indent=2))
    rows = [(name, m) for name, m in (("untrained", initial), ("best epochs", metrics)) if m]
    with open(out / "metrics.md", "a") as f:       # the run report names what two.onnx holds
        f.write(f"\n## Both backbones ({' + '.join(backbones)}: two.onnx)\n\n{metrics_markdown(rows)}")
    return replace(main, pair=PairResult(backbones, metrics, initial, front, onnx))


def _joined_metrics(cfg: TrainConfig, runs: tuple[TrainResult, ...],
                    scale: float) -> tuple[dict[str, float], dict[str, float]]:
    """The pair's metrics before training ({} without eval_initial) and of the best epochs, from its
    runs' kept evaluation embeddings joined as `embedder.concat` joins the networks (``scale``: its
    1/sqrt(n)), so no photo is decoded and embedded again (~2 min of a 9-minute run on 1,489 photos)."""
    held = []
    for r in runs:
        path = r.run_dir / EVAL_EMBEDDINGS
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the run's evaluation embeddings are missing (a run "
                                    f"finished before they were kept); run it again without resume")
        held.append(dict(np.load(path)))
    if any(not np.array_equal(h["labels"], held[0]["labels"]) for h in held):
        raise ValueError(f"{', '.join(str(r.run_dir) for r in runs)}: the runs evaluated different "
                         f"images (an image unreadable in one of them); run them again")

    def of(name: str) -> dict[str, float]:
        if any(name not in h for h in held):
            return {}
        return split_metrics(np.concatenate([h[name] for h in held], axis=1) * scale, held[0]["labels"], cfg)

    return of("initial"), of("best")
