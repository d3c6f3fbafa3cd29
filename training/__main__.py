"""``python -m training --config FILE [--set key=value ...] [--<option> value ...]``; ``--help``
is generated from `TrainConfig`'s fields, so it never drifts from the code.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from embedder import use_batch_budget
from embedder.cli import UsageError, run_main

from .config import TrainConfig, load_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m training",
        usage="%(prog)s [--config FILE] [--set KEY=VALUE ...] [--print-config] [--<option> VALUE ...]",
        description="Train an image embedder with DAS (Densely-Anchored Sampling). Options come "
                    "from a TOML config (--config; `include = \"base.toml\"` inherits), then "
                    "--set key=value overrides, then the per-option flags below, in that order. "
                    "Values are TOML (e.g. --set eval_ks=[1,10] --das false).")
    p.add_argument("--config", metavar="FILE", help="TOML config file (see configs/)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                   help="override one option; repeatable")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved configuration as JSON and exit")
    g = p.add_argument_group("training options (TrainConfig fields)")
    # the help text: each field's trailing ``# comment`` in config.py's TrainConfig source
    comments = {m.group(1): m.group(2).strip() for line in inspect.getsource(TrainConfig).splitlines()
                if (m := re.match(r"\s+(\w+): [^=]+=.*?#\s*(.+)$", line))}
    for f in fields(TrainConfig):
        d = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        g.add_argument(f"--{f.name}", metavar="VALUE", default=None,
                       help=f"{comments.get(f.name, '')} (default: {json.dumps(d)})")
    return p


def run(args: argparse.Namespace) -> int:
    """Resolve the config (a bad one is a usage error: exit 2), then train."""
    overrides = list(args.overrides) + [f"{f.name}={getattr(args, f.name)}" for f in fields(TrainConfig)
                                        if getattr(args, f.name) is not None]
    cfg = load_config(args.config, overrides)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    out = Path(cfg.out)
    blocked = next((d for d in (out, *out.parents) if d.exists() and not d.is_dir()), None)
    if blocked is not None:         # before a minute of caching: the first write would fail there
        raise UsageError(f"--out {cfg.out}: {blocked} is a file; expected a run directory (new or existing)")
    from embedder import keep_freed_memory

    from .runs import train

    keep_freed_memory()         # this process is the batch job: big tensors reuse freed pages
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 speaks for the run
        return 0
    best = result.best_metrics.get("R@1")
    print(f"run directory: {result.run_dir}")
    print(f"device: {result.device}")
    if best is not None:
        print(f"best epoch {result.best_epoch}: R@1 {100 * best:.2f}%")
    if result.onnx_path:
        print(f"ONNX model: {result.onnx_path}")
    if result.pair is not None:           # config `concat`: both backbones in one file
        alone = ", ".join(f"{b} alone {100 * r.best_metrics.get('R@1', float('nan')):.2f}%"
                          for b, r in zip(result.pair.backbones, (result.pair.front, result)))
        start = result.pair.initial.get("R@1")
        print(f"both backbones ({' + '.join(result.pair.backbones)}): R@1 "
              f"{100 * result.pair.metrics['R@1']:.2f}%" + (f", untrained {100 * start:.2f}%" if start else "")
              + f" ({alone})")
        if result.pair.onnx_path:
            print(f"ONNX model, both backbones: {result.pair.onnx_path}")
    if result.skipped:
        print(f"{len(result.skipped)} unreadable image(s) skipped (list in {result.skipped_file})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The kit's policy (embedder/cli.py): a bad config exits 2 (ConfigError is a usage error),
    a dataset, image, checkpoint or diverging run 1 with one line, a bug keeps its traceback."""
    from embedder import PretrainedWeightsUnavailable

    from .trainer import NonFiniteLossError

    # DatasetLayoutError (an OSError), ImageLoadError and CheckpointError are already expected
    return run_main("python -m training", build_parser(), argv, handler=run,
                    expected=(NonFiniteLossError, PretrainedWeightsUnavailable))


if __name__ == "__main__":
    use_batch_budget()          # the user's own files: a phone's 24 MP HEIC is read, not refused
    sys.exit(main())
