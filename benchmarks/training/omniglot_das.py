"""Baseline vs DAS on Omniglot with held-out classes, on CPU: same config and seeds, paired.

    python -m benchmarks.training.omniglot_das --root ../shared/data/omniglot

For each loss:sampler pair (default: triplet [distance-weighted], margin [distance-weighted]
and multi-similarity), trains the small_cnn embedder from scratch with and without DAS for
each seed, evaluates the *last* epoch on the held-out classes (no test-set model selection),
and prints / writes R@1/2/4/8, NMI and F1 as mean +- standard deviation over seeds, the paired
R@1 difference DAS - baseline with its 95% t-interval, and DAS's time per step as a ratio to
the baseline measured in the same run. `--preset` picks the DAS options of the DAS runs
(training.config.DAS_PRESETS), `--flavour` the loss/sampler flavour, `--set` any other
TrainConfig field. `--root` is any Omniglot folder with images_background/ (and optionally
images_evaluation/, then used as the test split). The table goes to `--results` (default
results.md in `--out`, under the git-ignored bench_out/); the kept figures are in
docs/benchmarks/training-das.md.
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

from embedder.cli import run_main

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.training.omniglot_das"

from benchmarks.training.paired import fmt_interval, parse_variants, t_interval

METRICS = ("R@1", "R@2", "R@4", "R@8", "NMI", "F1")


def build_parser() -> argparse.ArgumentParser:
    default_root = os.environ.get("DAS_OMNIGLOT", str(REPO.parent / "shared" / "data" / "omniglot"))
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--root", default=default_root, help="Omniglot root (images_background/ inside)")
    p.add_argument("--methods", nargs="+", default=["triplet:distance", "margin:distance",
                                                     "multisimilarity:none"],
                   help="loss:miner pairs")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--preset", default="paper", help="DAS preset of the DAS runs")
    p.add_argument("--flavour", default="authors", choices=["authors", "pml"],
                   help="loss/sampler flavour (TrainConfig.loss_flavour)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="TrainConfig field for every run, e.g. das_shift_scale=1.0; repeatable")
    p.add_argument("--variant", dest="variants", action="append", default=[],
                   metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="a DAS run with these TrainConfig fields on top of --preset (repeatable; "
                        "default: one variant 'DAS' without extra fields); each is paired with "
                        "the same baseline runs")
    p.add_argument("--config", default=None,
                   help="a training config (TOML) giving dataset, model and schedule instead of "
                        "the Omniglot small_cnn recipe of the options below (e.g. the GPU "
                        "fine-tuning run configs/caltech_finetune_gpu.toml)")
    p.add_argument("--validation", action="store_true",
                   help="never touch the held-out alphabets: test on --classes classes from the "
                        "second half of the training alphabets instead (for choosing settings)")
    p.add_argument("--test-offset", type=int, default=0, metavar="N",
                   help="test on held-out classes N .. N+--classes-1 instead of the first ones; "
                        "training is unchanged, so this checks a result on classes it was not "
                        "chosen on")
    p.add_argument("--reuse", default=None, metavar="RESULTS_JSON",
                   help="take the runs already in this results.json (same settings!) instead of "
                        "training them again, e.g. the baselines of an earlier invocation")
    p.add_argument("--workers", type=int, default=1,
                   help="parallel runs (processes); each uses --threads torch threads")
    p.add_argument("--classes", type=int, default=80,
                   help="first N classes of each split (train and held-out test)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=112)
    p.add_argument("--per-class", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--input-size", type=int, default=28)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--exclude-own-copies", action="store_true",
                   help="DAS runs: samplers never draw an anchor's own copies as positives "
                        "(TrainConfig.das_exclude_own_copies; not in the paper; same as "
                        "--set das_exclude_own_copies=true)")
    p.add_argument("--out", default=str(REPO / "bench_out" / "omniglot_das"), help="run directories")
    p.add_argument("--results", default=None,
                   help="Markdown file the results table is written to (default: results.md in --out; "
                        "kept figures: docs/benchmarks/training-das.md)")
    return p


def _mean_std(values: list[float]) -> tuple[float, float]:
    import numpy as np

    a = np.asarray(values, dtype=float)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def render(results: dict, args: argparse.Namespace, command: str, done: bool, das_text: str) -> str:
    lines = ["## Omniglot: baseline vs DAS (benchmarks/training/omniglot_das.py)", "",
             f"Command (from the repository root): `{command}`", "",
             f"Setup: small_cnn trained from scratch, {args.input_size} px, d = {args.dim}, first "
             f"{args.classes} training classes and "
             + (f"{args.classes} validation classes from the second half of the training "
                f"alphabets (held-out alphabets untouched)" if args.validation else
                f"held-out classes {args.test_offset}-{args.test_offset + args.classes - 1} (last "
                f"10 alphabets of images_background/ unless images_evaluation/ exists)")
             + f", {args.epochs} "
             f"epochs, Adam lr {args.lr:g}, batch {args.batch_size} with {args.per_class} per "
             f"class, loss flavour {args.flavour!r}; DAS runs (preset {args.preset!r}) {das_text}; "
             f"seeds {', '.join(map(str, args.seeds))}, paired by seed; metrics of the last epoch "
             f"on the held-out classes, in %, mean +- std over seeds. CPU: "
             f"{platform.processor() or platform.machine()}, {args.workers} run(s) at a time x "
             f"{args.threads} torch thread(s), machine shared with other jobs (timings are ratios "
             "within this run).", ""]
    if not done:
        lines += ["**Partial results: the run was still going when this was written.**", ""]
    lines += ["| loss [sampler] | DAS | " + " | ".join(METRICS) + " | s/step | DAS time ratio |",
              "|---|---|" + "---|" * (len(METRICS) + 2)]
    for method, by_das in results.items():
        base_step = None
        for das in ["off"] + [k for k in by_das if k != "off"]:
            runs = by_das.get(das, [])
            if not runs:
                continue
            cells = []
            for m in METRICS:
                mu, sd = _mean_std([100 * r["metrics"][m] for r in runs])
                cells.append(f"{mu:.2f} +- {sd:.2f}")
            step, _ = _mean_std([r["sec_per_step"] for r in runs])
            if das == "off":
                base_step = step
            ratio = f"{step / base_step:.2f}" if base_step else ""
            lines.append(f"| {method} | {'no' if das == 'off' else das} | " + " | ".join(cells)
                         + f" | {step:.3f} | {ratio} |")
    lines.append("")
    deltas = []
    for method, by_das in results.items():
        off = {r["seed"]: r for r in by_das.get("off", [])}
        for variant in [k for k in by_das if k != "off"]:
            on = {r["seed"]: r for r in by_das[variant]}
            seeds = sorted(set(on) & set(off))
            if not seeds:
                continue
            d = [100 * (on[s]["metrics"]["R@1"] - off[s]["metrics"]["R@1"]) for s in seeds]
            wins = sum(x > 0 for x in d)
            deltas.append(f"- {method}, {variant}: R@1 DAS - baseline = "
                          f"{fmt_interval(t_interval(d))} points (mean [95% t-interval]; DAS "
                          f"better in {wins}/{len(d)} seeds)")
    if deltas:
        lines += ["Paired by seed:", ""] + deltas + [""]
    return "\n".join(lines)


def _config(args: argparse.Namespace, method: str, variant: str | None, seed: int):
    """Config of one run: ``variant`` None is the baseline, else a name from --variant."""
    from training.config import load_config, parse_override

    das = variant is not None
    loss, _, miner = method.partition(":")
    name = f"{loss}_{miner or 'none'}_{variant or 'base'}_s{seed}".replace("/", "_")
    if args.config:   # the recipe (dataset, model, schedule, device) comes from the file
        from training.config import load_toml

        values = load_toml(args.config)
        values.update({"loss": loss, "miner": miner or "none", "loss_flavour": args.flavour,
                       "das": das, "das_preset": args.preset, "seed": seed,
                       "eval_every": values.get("epochs", 300), "eval_initial": False,
                       "export_onnx": False, "tensorboard": False, "progress": False,
                       "out": str(Path(args.out) / name)})
    else:
        values = {"dataset": "omniglot", "root": str(args.root), "max_classes": args.classes,
                  "cache_images": True, "backbone": "small_cnn", "pretrained": False,
                  "dim": args.dim, "input_size": args.input_size, "loss": loss,
                  "miner": miner or "none", "loss_flavour": args.flavour, "das": das,
                  "das_preset": args.preset, "epochs": args.epochs, "lr": args.lr,
                  "batch_size": args.batch_size, "per_class": args.per_class,
                  "eval_every": args.epochs, "eval_initial": False, "export_onnx": False,
                  "tensorboard": False, "progress": False, "seed": seed, "device": "cpu",
                  "amp": "off", "threads": args.threads, "out": str(Path(args.out) / name)}
    if args.exclude_own_copies:
        values["das_exclude_own_copies"] = True
    values.update(dict(parse_override(o) for o in args.overrides))
    if das:
        values.update(dict(parse_override(o) for o in parse_variants(args.variants)[variant]))
    return load_config(None, values)


_SPLITS: dict = {}


def validation_splits(root, classes: int):
    """(train, val) inside the training alphabets: their first `classes` classes, and `classes`
    classes from the second half (other alphabets), relabelled 0..classes-1."""
    from training.data import load_splits

    full, _ = load_splits("omniglot", root)
    half = full.num_classes // 2
    if classes > half:
        raise ValueError(f"--classes {classes} with --validation: at most {half}")
    return full.first_classes(classes), full.class_range(half, classes)


def _run(job) -> dict:
    """One training run (in a worker process with --workers > 1)."""
    from training import train

    args, method, das, seed = job
    cfg = _config(args, method, das, seed)
    r = train(cfg, train_split=_SPLITS["train"], test_split=_SPLITS["test"])
    last = r.history[-1]
    secs = sum(h["seconds"] for h in r.history if h.get("loss") != "")
    return {"method": method, "das": das or "off", "seed": seed, "metrics": r.last_metrics,
            "sec_per_step": secs / max(last["steps"], 1)}


def main(argv=None) -> int:
    """The kit's policy (embedder/cli.py): a bad --set is a usage error (exit 2), a dataset that
    is not there (DatasetLayoutError, an OSError) one line and exit 1."""
    return run_main(PROG, build_parser(), argv, handler=lambda args: run(args, argv))


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    import multiprocessing as mp

    import torch
    from tqdm.auto import tqdm

    from training.data import load_splits

    torch.set_num_threads(args.threads)
    if args.config:
        from training.config import load_config

        base = load_config(args.config)
        _SPLITS["train"], _SPLITS["test"] = load_splits(
            base.dataset, base.root, max_classes=base.max_classes,
            test_classes=base.test_classes, holdout_alphabets=base.holdout_alphabets)
    elif args.validation:
        _SPLITS["train"], _SPLITS["test"] = validation_splits(args.root, args.classes)
    else:
        train, test = load_splits("omniglot", args.root)
        _SPLITS["train"] = train.first_classes(args.classes)
        _SPLITS["test"] = test.class_range(args.test_offset, args.classes)
    variants = parse_variants(args.variants)
    probes = {v: _config(args, args.methods[0], v, args.seeds[0]) for v in variants}
    keys = ("das_num_produce", "das_topk", "das_bank_size", "das_scale_range", "das_scale_bounds",
            "das_shift_scale", "das_detach", "das_aux_loss", "das_exclude_own_copies")
    das_text = "; ".join(f"{v}: " + ", ".join(f"{k[4:]} = {getattr(p, k)}" for k in keys)
                         for v, p in probes.items())
    for m in args.methods[1:]:      # a preset's refinement for one loss (DAS_PRESET_LOSSES)
        for v, p in probes.items():
            q = _config(args, m, v, args.seeds[0])
            diff = ", ".join(f"{k[4:]} = {getattr(q, k)}" for k in keys if getattr(q, k) != getattr(p, k))
            das_text += f" ({v} with {m}: {diff})" if diff else ""
    command = ("python -m benchmarks.training.omniglot_das " + shlex.join(argv if argv is not None else sys.argv[1:])).rstrip()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.results is None:
        args.results = str(out / "results.md")
    results: dict[str, dict[str, list]] = {}
    jobs = [(args, m, v, s) for m in args.methods for v in [None, *variants] for s in args.seeds]
    if args.reuse:   # runs of an earlier invocation: keep them, train only the missing ones
        old = json.loads(Path(args.reuse).read_text())
        have = {(e["method"], e["das"], e["seed"]): e for by in old.values() for es in by.values()
                for e in es}
        kept = [have[(m, v or "off", s)] for _, m, v, s in jobs if (m, v or "off", s) in have]
        jobs = [j for j in jobs if (j[1], j[2] or "off", j[3]) not in have]
        for entry in kept:
            loss, _, miner = entry["method"].partition(":")
            results.setdefault(f"{loss} [{miner or 'none'}]", {}).setdefault(
                entry["das"], []).append(entry)
    t_start = time.time()
    pool = mp.get_context("fork").Pool(args.workers) if args.workers > 1 else None
    try:
        runs = pool.imap_unordered(_run, jobs) if pool else map(_run, jobs)
        for entry in tqdm(runs, total=len(jobs), desc="benchmark runs"):  # noqa: B007
            loss, _, miner = entry["method"].partition(":")
            label = f"{loss} [{miner or 'none'}]"
            results.setdefault(label, {}).setdefault(entry["das"], []).append(entry)
            tqdm.write(f"{label} {entry['das']} seed {entry['seed']}: R@1 "
                       f"{100 * entry['metrics']['R@1']:.2f} ({entry['sec_per_step']:.3f} s/step)")
            Path(args.results).write_text(render(results, args, command, False, das_text))
            (out / "results.json").write_text(json.dumps(results, indent=2))
    finally:
        if pool:
            pool.close()
            pool.join()
    text = render(results, args, command, True, das_text)
    load = os.getloadavg()
    text += (f"Wall time: {(time.time() - t_start) / 60:.1f} min (load average at the end "
             f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}).\n")
    Path(args.results).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
