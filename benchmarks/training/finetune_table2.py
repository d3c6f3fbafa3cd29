"""The paper's Table 2 in the fine-tuning regime on real photos: baseline vs DAS, paired seeds.

    python -m benchmarks.training.finetune_table2 --quick                       # CPU: 3 pairs x 3 seeds
    python -m benchmarks.training.finetune_table2 --config configs/photos_finetune_gpu.toml --seeds 0 1 2

Every run is `python -m training` with a recipe config (default the CPU recipe,
configs/photos_finetune_cpu.toml: the last EfficientNet-Lite0 stages fine-tuned on a cached
trunk) and one loss/sampler pair, with and without DAS (`--preset`), over paired seeds. The
trunk cache (training/trunk_cache.py) is keyed by model, images and views, so the first run
builds it and every other run, of this grid or a later one, reads it. `--root` is any folder
of class folders (sorted, first half trains, second half tests); `--validation` trains on the
first half of the training classes and evaluates on the rest, never reading the test classes.
Metrics are those of the last epoch (no selection on the evaluated classes). Also reported, on
the same evaluation classes and through the same metric code: the training-free embedders
(the ImageNet network with average pooling, today's default gallery model, and with GeM).
Runs are appended to <out>/runs.json as they finish; rerunning the same command skips those.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from embedder.cli import UsageError, run_main

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.training.finetune_table2"

from benchmarks.training.frozen_table2 import TABLE2
from benchmarks.training.paired import method_label, plot, split_method, row_cells, summarise, table_row

QUICK = ["triplet:semihard", "margin:distance", "multisimilarity:none"]
#: --quick's schedule: the CPU recipe's own (3 epochs since its second version): 18 runs of
#: 1.6-1.9 min under load plus the one-off trunk cache stay under an hour; --set epochs=...
#: overrides it.
QUICK_SCHEDULE: dict = {}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "photos_finetune_cpu.toml"),
                   help="recipe (TOML) every run starts from")
    p.add_argument("--root", default=None, help="class-folder dataset (default: the config's)")
    p.add_argument("--quick", action="store_true",
                   help=f"CPU grid: {', '.join(QUICK)} x seeds 0 1 2, the recipe's schedule")
    p.add_argument("--methods", nargs="+", default=None, help="loss:sampler pairs (default "
                   "Table 2's seven)")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default 0-4 (0-2 --quick)")
    p.add_argument("--preset", default="robust", help="DAS preset of the DAS runs")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="TrainConfig field for every run; repeatable")
    p.add_argument("--validation", action="store_true",
                   help="evaluate on the second half of the training classes")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip the training-free rows (average pooling, GeM)")
    p.add_argument("--out", default=None, help="default bench_out/finetune_table2/<name>")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at once, each in its own process (a GPU that one small model "
                        "leaves mostly idle: an H100 trains several Lite1 runs side by side); "
                        "pair with --set workers=N so that jobs x workers fits the CPUs")
    return p


def _run_config(args, method: str, variant: str, seed: int, out: Path):
    from training.config import load_config, load_toml, parse_override

    loss, miner = split_method(method)
    values = load_toml(args.config)
    values.update({"loss": loss, "miner": miner or "none", "das": variant != "base",
                   "das_preset": args.preset, "seed": seed, "export_onnx": False, "concat": "",
                   "eval_initial": False, "tensorboard": False, "progress": False,
                   "out": str(out / "runs" / f"{loss.replace(':', '_')}-{miner}-{variant}-s{seed}")})
    if args.root:
        values["root"] = args.root
    if args.quick:                  # fits an hour on 2 cores (docs/benchmarks/training-das.md)
        values.update(QUICK_SCHEDULE)
    overrides = dict(parse_override(o) for o in args.overrides)
    values.update(overrides)
    if "eval_every" not in overrides:        # last epoch only, unless a curve is asked for
        values["eval_every"] = values.get("epochs", 300)
    if args.validation:
        from training.data import load_splits

        train, _ = load_splits(values.get("dataset", "folder"), values["root"])
        values["validation_classes"] = train.num_classes - train.num_classes // 2
    return load_config(None, values)


def _one_run(args, method: str, variant: str, seed: int, out: Path) -> dict:
    """One grid cell, trained; in a worker process of its own under --jobs."""
    from training import train

    cfg = _run_config(args, method, variant, seed, out)
    t = time.perf_counter()
    res = train(cfg)
    return {"method": method, "variant": variant, "seed": seed, "metrics": res.last_metrics,
            "seconds": time.perf_counter() - t, "steps": res.history[-1]["steps"],
            "initial": res.initial_metrics,
            "curve": [{k: r[k] for k in ("epoch", "seconds", "R@1", "MAP@R") if k in r}
                      for r in res.history]}


def _results(args, jobs: list[tuple[str, str, int]], out: Path):
    """Finished runs as they come: in this process one after another, or --jobs at once in
    spawned processes (CUDA cannot be shared with forked children)."""
    if args.jobs == 1:
        for job in jobs:
            yield _one_run(args, *job, out)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        for fut in as_completed([ex.submit(_one_run, args, *job, out) for job in jobs]):
            yield fut.result()


def training_free(cfg) -> dict[str, dict[str, float]]:
    """Metrics of the untrained ImageNet network (dim 0, L2-normalised) with average pooling and
    with GeM on the evaluation classes: one fp32 pass, both poolings from the same map."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from embedder import Embedder, EmbedderConfig
    from embedder.metrics import evaluate
    from training.finetune import carve_validation
    from training.run_state import build_datasets

    train, test = build_datasets(cfg)
    _, ev, _, _ = carve_validation(train, test, cfg.validation_classes)
    model = Embedder(EmbedderConfig(backbone=cfg.backbone, dim=0, pretrained=cfg.pretrained,
                                    pooling="gem", gem_p=cfg.gem_p), cfg.preprocessing()).eval()
    avg, gem = [], []
    with torch.no_grad():
        for x, _ in tqdm(DataLoader(ev, batch_size=32), desc="training-free embedders"):
            fmap = model.backbone(x)
            avg.append(torch.nn.functional.normalize(fmap.mean((2, 3)), dim=1).numpy())
            gem.append(torch.nn.functional.normalize(model.pool(fmap), dim=1).numpy())
    return {name: {k: float(v) for k, v in evaluate(np.concatenate(e), ev.labels,
                                                     seed=cfg.seed).items()}
            for name, e in (("average pooling (today's default)", avg),
                            (f"GeM p = {cfg.gem_p:g}", gem))}


def render(rows, free, meta, done: bool) -> str:
    lines = [f"### {meta['title']}", "", f"Command (repository root): `{meta['command']}`", "",
             meta["setup"], ""]
    if not done:
        lines += ["**Partial: the grid was still running when this was written.**", ""]
    lines += ["| loss [sampler] | DAS | seeds | R@1 | NMI | MAP@R | R@1 DAS - base [95% CI] | "
              "NMI diff | MAP@R diff | DAS better | s/run |",
              "|---|---|---:|---:|---:|---:|---|---|---|---:|---:|"]
    for name, m in free.items():
        lines.append(f"| training-free, {name} | - | - | {100 * m['R@1']:.2f} | "
                     f"{100 * m['NMI']:.2f} | {100 * m['MAP@R']:.2f} | | | | | |")
    for r in rows:
        lines.append(table_row([method_label(r["method"]), "-" if r["variant"] == "base" else "DAS",
                                str(r["n"]), *row_cells(r)]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """The kit's policy (embedder/cli.py): a bad option or --set is a usage error (exit 2), a
    dataset that is not there (DatasetLayoutError, an OSError) one line and exit 1."""
    return run_main(PROG, build_parser(), argv, handler=lambda args: run(args, argv))


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    from tqdm.auto import tqdm

    from training.data import DatasetLayoutError

    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: expected at least 1")
    methods = args.methods or (QUICK if args.quick else TABLE2)
    seeds = args.seeds or ([0, 1, 2] if args.quick else [0, 1, 2, 3, 4])
    probe = _run_config(args, methods[0], "DAS", seeds[0], Path("-"))
    root = Path(probe.root)
    if not root.is_dir():
        raise DatasetLayoutError(f"--root {root}: not a directory of class folders")
    name = ("val-" if args.validation else "") + (root.name if root.name != "images" else root.parent.name)
    out = Path(args.out or REPO / "bench_out" / "finetune_table2" / name)
    out.mkdir(parents=True, exist_ok=True)
    runs_path = out / "runs.json"
    runs = json.loads(runs_path.read_text()) if runs_path.is_file() else []
    have = {(r["method"], r["variant"], r["seed"]) for r in runs}
    free_path = out / "training_free.json"
    if args.no_baselines:
        free = {}
    elif free_path.is_file():
        free = json.loads(free_path.read_text())
    else:
        free = training_free(probe)
        free_path.write_text(json.dumps(free, indent=1))
    command = "python -m benchmarks.training.finetune_table2 " + shlex.join(
        argv if argv is not None else sys.argv[1:])
    where = "validation split of the training classes" if args.validation else "held-out test classes"
    meta = {"title": f"{name}: fine-tuning, {where}", "command": command,
            "setup": (f"Recipe {Path(args.config).name} ({probe.backbone}, trainable "
                      f"{probe.trainable}, trunk cache {probe.trunk_cache} with "
                      f"{probe.trunk_views} views, {probe.pooling} pooling, d = {probe.dim}, head "
                      f"init {probe.head_init}, {probe.epochs} epochs, lr {probe.lr:g} head / "
                      f"{probe.backbone_lr or probe.lr:g} backbone, batch {probe.batch_size} "
                      f"({probe.per_class} per class)); DAS runs: preset {args.preset!r}; seeds "
                      f"{', '.join(map(str, seeds))}, paired; metrics of the last epoch, in %. "
                      f"Machine: {platform.machine()}, {os.cpu_count()} CPUs (shared).")}
    jobs = [(m, v, s) for m in methods for v in ("base", "DAS") for s in seeds
            if (m, v, s) not in have]
    t0 = time.time()
    for run in tqdm(_results(args, jobs, out), total=len(jobs), desc="runs"):
        runs.append(run)
        runs_path.write_text(json.dumps(runs, indent=1))
        (out / "results.md").write_text(render(summarise(runs), free, meta, False))
    rows = summarise(runs)
    text = render(rows, free, meta, True)
    text += f"\nWall time: {(time.time() - t0) / 60:.1f} min for {len(jobs)} new runs"
    text += (f", {args.jobs} at once (s/run is each run's own wall time, shared).\n"
             if args.jobs > 1 else ".\n")
    (out / "results.md").write_text(text)
    plot(rows, out / "r1_differences.png", meta["title"])
    print(text)
    print(f"figure: {out / 'r1_differences.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
