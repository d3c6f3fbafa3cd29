"""The paper's Table 2 and Table 3 on frozen features of real photos, baseline vs DAS, on CPU.

    python -m benchmarks.training.frozen_table2 --root ../shared/data/caltech101-dev/images
    python -m benchmarks.training.frozen_table2 --root ../shared/data/omniglot

Every run is the trainer (`training.train`) with ``trainable = "head"``: the pooled features of
a training-free ImageNet embedder (`--model`, default the gallery default of
`embedder.pretrained`) are computed once per dataset into the trainer's trunk cache (this
process builds it before forking the runs), L2-normalised before the head (``head_input =
"l2"``, so the head sees what `indexer build` stores), and a d = 128 head is trained on them with
the trainer's loop: DAS, miner, loss, Adam groups, class-balanced batches with 2 images per
class, for each loss/sampler pair, with and without DAS, over paired seeds. Reported: the
untrained frozen features, every trained row (R@1, NMI, MAP@R, mean over seeds) and, per pair,
the paired R@1 / NMI / MAP@R difference DAS - baseline with its 95% t-interval; a PNG plots the
R@1 intervals.

Classes: `--root` is a folder of class folders (sorted, first half train, second half test)
or an Omniglot root (first 20 alphabets train, last 10 test). `--validation` never touches the
test classes: it trains on the first half of the training classes and evaluates on the second
half (the trainer's ``validation_classes``), which is how the head, lr and epochs were chosen.
Runs are independent processes' work (`--workers`, one torch thread each) and deterministic in
their seed.
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
PROG = "python -m benchmarks.training.frozen_table2"

from benchmarks.training.paired import (method_label, parse_variants, plot, row_cells,
                               summarise, table_row, variant_label)

# Table 2's seven pairs, then Table 3's samplers that Table 2 lacks (loss:sampler).
TABLE2 = ["triplet:semihard", "triplet:distance", "contrastive:distance", "margin:distance",
          "lifted:none", "npair:none", "multisimilarity:none"]
TABLE3 = ["triplet:random", "triplet:softhard", "contrastive:random"]
ABLATION = "triplet:distance"                    # Table 5: DFS only / MTS only
#: supplementary Table III (margin [distance] on CARS) and the main text's K sweep (SOP)
SWEEPS = {"rs": ("das_scale_range", [0.01, 0.1, 0.2, 0.5]),
          "rb": ("das_shift_scale", [0.001, 0.01, 0.1, 1.0]),
          "T": ("das_num_produce", [1, 3, 5, 10]),
          "K": ("das_topk", [1, 2, 4, 8, 16, 32])}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--root", required=True, help="class-folder dataset or Omniglot root")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--grid", nargs="+", default=["table2", "table3", "ablation"],
                   choices=["table2", "table3", "ablation"], help="which rows to run")
    p.add_argument("--methods", nargs="+", default=None,
                   help="loss:sampler pairs instead of --grid (e.g. triplet:distance)")
    p.add_argument("--sweep", choices=sorted(SWEEPS), default=None,
                   help="supp. Table III sweep with margin [distance] (or --methods) instead")
    p.add_argument("--preset", default="paper", help="DAS preset of the DAS runs "
                   "(training.config.DAS_PRESETS)")
    p.add_argument("--flavour", default="authors", choices=["authors", "pml"])
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="TrainConfig field for every run (e.g. das_shift_scale=1.0); repeatable")
    p.add_argument("--variant", dest="variants", action="append", default=[],
                   metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="DAS runs with these TrainConfig fields on top of --preset, instead of "
                        "the one 'DAS' run per pair (repeatable); each is paired with the baseline")
    p.add_argument("--model", default=None, help="training-free embedder whose pooled features "
                   "the heads train on (embedder.pretrained name, e.g. lite0-avg; default: the "
                   "gallery default)")
    p.add_argument("--head", default="pca", choices=["pca", "random"],
                   help="initial embedding layer (the trainer's head_init)")
    p.add_argument("--epochs", type=int, default=None, help="default: per dataset, see DEFAULTS")
    p.add_argument("--lr", type=float, default=None, help="default: per dataset")
    p.add_argument("--weight-decay", type=float, default=None, help="default: per dataset")
    p.add_argument("--views", type=int, default=None,
                   help="augmented crops per training image in the cache (0 = centre crop only)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--per-class", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=0,
                   help="0 = per_class x min(56, training classes), the paper's 112 at most")
    p.add_argument("--max-classes", type=int, default=0,
                   help="use only the first N classes of each split (0 = all; for quick checks)")
    p.add_argument("--validation", action="store_true",
                   help="train on the first half of the training classes, test on the second")
    p.add_argument("--reuse", default=None, metavar="RUNS_JSON",
                   help="take the runs already in this runs.json (same settings!) instead of "
                        "training them again, e.g. the baselines of an earlier grid (runs are "
                        "deterministic in their seed)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cache", default=None,
                   help="trunk cache folder (default $DAS_CACHE/trunk_cache)")
    p.add_argument("--out", default=None, help="run folder (default bench_out/frozen_table2/<name>)")
    p.add_argument("--results", default=None,
                   help="Markdown file for the tables (default <out>/results.md)")
    return p


#: Head training defaults per dataset kind, chosen with --validation (docs/benchmarks/training-das.md,
#: "Frozen features"): Omniglot's baseline gains 11 R@1 points over the untrained features at
#: lr 1e-3 in 5 epochs; on caltech101-dev no head, lr, epoch count or augmented views beat the
#: untrained features on validation classes, and lr 1e-4 over 10 epochs costs the least.
DEFAULTS = {"folder": {"epochs": 10, "lr": 1e-4, "weight_decay": 4e-4, "views": 0},
            "omniglot": {"epochs": 5, "lr": 1e-3, "weight_decay": 4e-4, "views": 0}}


# ---------------------------------------------------------------------------------- jobs
_DATA: dict = {}


def _load(args) -> dict:
    """The parsed splits and the settings once per process (the parent, before forking)."""
    if not _DATA:
        from benchmarks.training.frozen_features import dataset_kind
        from training.data import load_splits

        kind = dataset_kind(args.root)
        train, test = load_splits(kind, args.root, max_classes=args.max_classes)
        val = train.num_classes - train.num_classes // 2 if args.validation else 0
        n_train = train.num_classes - val
        defaults = DEFAULTS[kind]
        views = args.views if args.views is not None else defaults["views"]
        _DATA.update(train=train, test=test, kind=kind, defaults=defaults, views=views,
                     validation_classes=val, n_train=n_train)
    return _DATA


def _config(args, method: str, variant: str, seed: int, out: str = "-"):
    """The TrainConfig of one run: head-training defaults, the pair, the variant, --set."""
    from benchmarks.training.frozen_features import head_run_config
    from training.config import parse_override

    data = _load(args)
    d = data["defaults"]
    loss, _, miner = method.partition(":")
    n_cls = data["n_train"]
    values = {"max_classes": args.max_classes, "validation_classes": data["validation_classes"],
              "trunk_views": data["views"], "cache_dir": args.cache or "",
              "head_init": args.head, "dim": args.dim, "loss": loss,
              "miner": miner or "none", "loss_flavour": args.flavour,
              "epochs": args.epochs or d["epochs"], "lr": args.lr or d["lr"],
              "weight_decay": d["weight_decay"] if args.weight_decay is None else args.weight_decay,
              "batch_size": args.batch_size or args.per_class * min(56, n_cls),
              "per_class": args.per_class, "seed": seed, "das": variant != "base",
              "das_preset": args.preset, "threads": 1, "out": out}
    values.update(dict(parse_override(o) for o in args.overrides))
    named = parse_variants(args.variants)
    if variant in named:
        values.update(dict(parse_override(o) for o in named[variant]))
    if variant == "dfs_only":
        values["das_mts"] = False
    elif variant == "mts_only":
        values["das_dfs"] = False
    elif variant.startswith("sweep:"):
        _, key, val = variant.split(":")
        values[key] = int(val) if key in ("das_num_produce", "das_topk") else float(val)
        if key == "das_scale_range":
            values["das_scale_bounds"] = []          # r_s only means something without bounds
    values["eval_every"] = values["epochs"]          # metrics of the last epoch only
    return head_run_config(args.root, model=args.model, **values)


def run_job(job) -> dict:
    """One training run (the trainer, one torch thread) in a scratch folder; its metrics."""
    import shutil
    import tempfile

    from training import train

    args, method, variant, seed = job
    data = _load(args)
    tmp = tempfile.mkdtemp(prefix="frozen_table2-")
    try:
        cfg = _config(args, method, variant, seed, out=tmp)
        t0 = time.perf_counter()
        r = train(cfg, train_split=data["train"], test_split=data["test"])
        seconds = time.perf_counter() - t0
    finally:       # checkpoints of a benchmark run are not kept (the whole backbone, ~20 MB)
        shutil.rmtree(tmp, ignore_errors=True)
    keep = {k: v for k, v in r.last_metrics.items()
            if k.startswith("R@") or k in ("NMI", "F1", "MAP@R")}
    return {"method": method, "variant": variant, "seed": seed, "metrics": keep,
            "seconds": seconds, "steps": r.history[-1]["steps"]}


def jobs_for(args) -> list[tuple[str, str]]:
    """(method, variant) pairs; every variant is paired with the method's baseline."""
    if args.sweep:
        key, values = SWEEPS[args.sweep]
        methods = args.methods or ["margin:distance"]
        return [(m, v) for m in methods
                for v in ["base"] + [f"sweep:{key}:{x}" for x in values]]
    methods = list(args.methods or [])
    if not methods:
        if "table2" in args.grid:
            methods += TABLE2
        if "table3" in args.grid:
            methods += TABLE3
    named = list(parse_variants(args.variants))
    out = [(m, v) for m in methods for v in ["base", *named]]
    if args.methods is None and "ablation" in args.grid:
        out += [(ABLATION, "dfs_only"), (ABLATION, "mts_only")]
        if ABLATION not in methods:
            out += [(ABLATION, v) for v in ["base", *named]]
    return out


# ---------------------------------------------------------------------------------- report
def render(rows: list[dict], untrained: dict, head0: dict, meta: dict, done: bool) -> str:
    lines = [f"## Frozen features: {meta['title']}", "",
             f"Command (from the repository root): `{meta['command']}`", "",
             meta["setup"], ""]
    if not done:
        lines += ["**Partial results: the run was still going when this was written.**", ""]
    lines += ["| loss [sampler] | DAS | R@1 | NMI | MAP@R | R@1 DAS - base [95% CI] | "
              "NMI diff | MAP@R diff | DAS better | s/run |",
              "|---|---|---:|---:|---:|---|---|---|---:|---:|",
              f"| untrained frozen features (1280-d) | - | {100 * untrained['R@1']:.2f} | "
              f"{100 * untrained['NMI']:.2f} | {100 * untrained['MAP@R']:.2f} | | | | | |",
              f"| untrained head (epoch 0) | - | {100 * head0['R@1']:.2f} | "
              f"{100 * head0['NMI']:.2f} | {100 * head0['MAP@R']:.2f} | | | | | |"]
    for r in rows:
        lines.append(table_row([method_label(r["method"]), variant_label(r["variant"]),
                                *row_cells(r, ".1f")]))
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    """The kit's policy (embedder/cli.py): a bad --set is a usage error (exit 2), a dataset that
    is not there (DatasetLayoutError, an OSError) one line and exit 1."""
    return run_main(PROG, build_parser(), argv, handler=lambda args: run(args, argv))


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    import multiprocessing as mp

    import numpy as np
    import torch
    from tqdm.auto import tqdm

    torch.set_num_threads(1)
    root = Path(args.root)
    _DATA.clear()
    data = _load(args)
    probes = {v: _config(args, "triplet:distance", v, args.seeds[0])  # fail fast on --set
              for v in parse_variants(args.variants)}
    probe = next(iter(probes.values()))
    name = ("val-" if args.validation else "") + (root.name if root.name != "images" else root.parent.name)
    out = Path(args.out or REPO / "bench_out" / "frozen_table2" / name)
    out.mkdir(parents=True, exist_ok=True)
    results = Path(args.results or out / "results.md")
    command = "python -m benchmarks.training.frozen_table2 " + shlex.join(
        argv if argv is not None else sys.argv[1:])
    from benchmarks.training.frozen_features import frozen_splits, pca_head
    from embedder.metrics import evaluate

    def metrics(emb: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        return {k: float(v) for k, v in evaluate(emb, labels, ks=(1, 2, 4, 8), clustering=True,
                                                 seed=0).items()}

    # builds the pooled-feature cache once, here, before the runs fork and read it
    train, test = frozen_splits(args.root, cfg=probe, progress=True)
    untrained = metrics(test.features, test.labels)
    head = pca_head(train, args.dim)
    if args.head == "random":          # the Linear's own random init, seeded like run 0
        torch.manual_seed(args.seeds[0])
        head[0].reset_parameters()
    with torch.no_grad():
        head0 = metrics(head(torch.from_numpy(test.features)).numpy(), test.labels)
    das_keys = ("das_num_produce", "das_topk", "das_bank_size", "das_scale_range",
                "das_scale_bounds", "das_shift_scale", "das_detach", "das_aux_loss",
                "das_exclude_own_copies")
    das_text = "; ".join(f"{v}: " + ", ".join(f"{k[4:]} = {getattr(p, k)}" for k in das_keys)
                         for v, p in probes.items())
    views_text = f", {data['views']} augmented views each" if data["views"] else ""
    meta = {"title": f"{name}, {'validation split of the training classes' if args.validation else 'held-out test classes'}",
            "command": command,
            "setup": (f"{train.num_classes} training classes ({len(train)} images"
                      f"{views_text}), "
                      f"{test.num_classes} {'validation' if args.validation else 'test'} classes "
                      f"({len(test)} images); frozen {probe.backbone} features ({probe.pooling} "
                      f"pooling, {probe.input_size} px, L2-normalised), head {args.head!r} "
                      f"-> d = {args.dim}, {probe.epochs} epochs, Adam lr {probe.lr:g}, weight "
                      f"decay {probe.weight_decay:g}, batch {probe.batch_size} ({probe.per_class} "
                      f"per class), loss flavour {probe.loss_flavour!r}; DAS runs (preset "
                      f"{args.preset!r}) {das_text}; seeds {', '.join(map(str, args.seeds))}, "
                      f"paired by seed; metrics of the last epoch, in %. CPU: "
                      f"{platform.machine()}, {args.workers} worker process(es) x 1 torch thread.")}
    jobs = [(args, m, v, s) for m, v in jobs_for(args) for s in args.seeds]
    runs: list[dict] = []
    if args.reuse:
        have = {(r["method"], r["variant"], r["seed"]): r
                for r in json.loads(Path(args.reuse).read_text())}
        runs = [have[j[1:]] for j in jobs if j[1:] in have]
        jobs = [j for j in jobs if j[1:] not in have]
    t0 = time.time()
    ctx = mp.get_context("fork")
    with ctx.Pool(args.workers) if args.workers > 1 else _Serial() as pool:
        for r in tqdm(pool.imap_unordered(run_job, jobs), total=len(jobs), desc="runs"):
            runs.append(r)
            if len(runs) % 10 == 0:
                rows = summarise(runs)
                results.write_text(render(rows, untrained, head0, meta, False))
                (out / "runs.json").write_text(json.dumps(runs, indent=1))
    wall = time.time() - t0
    rows = summarise(runs)
    load = os.getloadavg()
    text = render(rows, untrained, head0, meta, True)
    reused = f", {len(runs) - len(jobs)} more taken from {args.reuse}" if args.reuse else ""
    text += (f"Wall time of the grid: {wall / 60:.1f} min for {len(jobs)} runs{reused} "
             f"(load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}).\n")
    results.write_text(text)
    (out / "runs.json").write_text(json.dumps(runs, indent=1))
    plot(rows, out / "r1_differences.png", meta["title"])
    print(text)
    print(f"figure: {out / 'r1_differences.png'}")
    return 0


class _Serial:
    """`Pool` stand-in for --workers 1 (no fork)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def imap_unordered(self, fn, items):
        return map(fn, items)


if __name__ == "__main__":
    sys.exit(main())
