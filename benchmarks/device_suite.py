"""One command that spends a lent GPU well: the photo recipe, its DAS grid and the GPU check.

    python -m benchmarks.device_suite --out $OUT/suite          # on the GPU machine, <= 10 min
    python -m benchmarks.device_suite --dry-run --out /tmp/ds   # the same code paths, CPU, tiny

On the GPU machine lent through the `device` tool: ``bash benchmarks/device_prep.sh`` here (it
packs what the run needs into .device-carry/, under the tool's 64 MiB), then one `run` with
carry [".device-carry"] and the command
``source .device-carry/env.sh && python -m benchmarks.device_suite --out $OUT/suite``.

Steps, each a row of one summary (OUT/summary.md, also printed):
1. probe: one recipe run of 2 epochs alone on the GPU with ``device_batches = true`` (images
   decoded once into GPU memory, augmented there), then one with DataLoader workers (as the
   grid ran until 2026-11): epoch seconds of each, solo;
2. sweep, on validation species only (``finetune_table2 --validation``: the first half of the
   training species trains, the rest evaluates every epoch): the `SWEEP` cells (loss, backbone
   lr, trainable depth, head), with and without DAS, seeds 0 and 1, all at once; the cell and
   epoch count with the best mean R@1 (one seed's differences were 0.3-0.5 R@1, 5-8 queries);
3. grid, on the test species: the chosen cell, its loss then ``PAIRS`` x seeds 0-2, with and without
   DAS (paired), ``--jobs`` runs at once; each run's training-free start evaluated too;
4. ``benchmarks.gpu_check`` (CUDA tests, DAS kernels and their goals, training CLI with its
   ONNX export, bf16), last, so that its timings run on a quiet GPU.
Each step gets a share of ``--budget-s``; a step past its share is stopped (its own processes,
by process group) and FAILs, and what it finished is still reported (the grids write each run
as it ends). Exit 0 when every step passed.

``--dry-run`` runs the steps but the probe on the CPU with tiny settings (3 + 3 species at 64 px,
one epoch of 4 steps, one seed, one pair, one sweep cell, the grid's two runs in two processes;
gpu_check --quick without its CUDA tests): what CI can check of this script and of gpu_check's
plumbing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.training.paired import method_label
from embedder.cli import UsageError, run_main

REPO = Path(__file__).resolve().parents[1]
RECIPE = "configs/photos_finetune_gpu.toml"
#: the recipe's own loss first: with --jobs below the grid's size its runs start first
PAIRS = ["multisimilarity:none", "triplet:semihard", "margin:distance"]
SEEDS = [0, 1, 2]
#: what every step's processes import: a wheel missing on the GPU machine (pillow-heif on
#: 2026-11-30) fails here in seconds, not in every run of every step
IMPORTS = ("import training.runs, training.trainer, training.losses, embedder.metrics, "
           "pytorch_metric_learning, lmdb")
#: the share of the budget each step may take at most, in order (gpu_check: what is left)
SHARES = {"probe": 0.16, "sweep": 0.27, "grid": 0.30, "gpu_check": 0.27}
#: CPU-only tiny settings of --dry-run, for every training run (4 steps of one epoch: the code
#: paths are those of a full epoch; a full pass over 3 species cost ~30 s per run)
DRY_SET = ["max_classes=3", "epochs=1", "steps_per_epoch=4", "eval_every=1", "lr_milestones=[2]",
           "warmup_epochs=0", "input_size=64", "resize=72", "batch_size=6", "per_class=2",
           "workers=0", "device=cpu", "amp=off", "channels_last=false", "threads=1",
           # the export path stays checked by gpu_check's training row (parity-checked)
           "export_onnx=false"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_suite", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "bench_out" / "device_suite",
                   help="logs, run folders, the grid's table and summary.md")
    p.add_argument("--root", type=Path, default=REPO.parent / "shared" / "data" / "cub-dev" / "images",
                   help="class-folder photos for the recipe and the grid")
    p.add_argument("--budget-s", type=float, default=560.0,
                   help="wall-clock seconds for the whole suite (a lent GPU has 15 minutes, "
                        "its start included)")
    p.add_argument("--jobs", type=int, default=9, help="grid runs at once on the GPU")
    p.add_argument("--workers", type=int, default=2,
                   help="DataLoader workers of the probe's loader run (the grids decode once "
                        "into GPU memory)")
    p.add_argument("--steps", default="probe,sweep,grid,gpu_check",
                   help="which steps, comma-separated (a rerun inside one loan leaves out "
                        "what already passed); their shares of the budget are renormalised")
    p.add_argument("--cells", default="",
                   help="the sweep's cells by their index in SWEEP, comma-separated (default: "
                        "the first seven)")
    p.add_argument("--sweep-epochs", type=int, default=10, help="epochs of each sweep run")
    p.add_argument("--pairs", type=int, default=len(PAIRS),
                   help="loss:sampler pairs of the grid (the sweep's choice first)")
    p.add_argument("--dry-run", action="store_true",
                   help="the same steps on the CPU with tiny settings (for CI)")
    return p


@dataclass(frozen=True)
class Cell:
    """One sweep cell: a loss:sampler pair, the backbone's lr and trainable depth, and any
    further recipe values (``KEY=VALUE``)."""
    method: str
    backbone_lr: float
    trainable: str = "all"
    sets: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The cell's folder name and log suffix."""
        parts = [self.method.replace("pml:", "").replace(":none", "").replace(":", "-"),
                 f"lr{self.backbone_lr:g}", self.trainable.replace(":", ""), *self.sets]
        return "-".join(parts).replace("=", "")

    def cells(self) -> str:
        """The cell's first columns in the sweep's table."""
        return (f"| {method_label(self.method)} | {self.backbone_lr:g} | {self.trainable} | "
                f"{', '.join(self.sets) or '-'} |")


PCA_HEAD = ("dim=512", "head_init=pca", "lr=1e-4")
#: the sweep's cells (each with and without DAS, 2 seeds); the recipe's values come first.
#: 2026-11-28/30 swept multi-similarity's backbone lr x depth (3e-6..1e-4 x all / last:3: at
#: most +0.65 R@1 on validation); 2026-12-01 added Proxy-Anchor (Kim et al. 2020, the field's
#: strongest simple recipe on CUB) and a PCA-initialised 512-d head at a higher lr: none ahead
#: of the recipe (docs/benchmarks/training-das.md#on-a-gpu)
SWEEP = [Cell("multisimilarity:none", 3e-6), Cell("multisimilarity:none", 1e-5),
         Cell("multisimilarity:none", 3e-6, sets=PCA_HEAD),
         Cell("pml:ProxyAnchorLoss:none", 1e-5), Cell("pml:ProxyAnchorLoss:none", 3e-5),
         Cell("pml:ProxyAnchorLoss:none", 1e-4), Cell("pml:ProxyAnchorLoss:none", 3e-5, sets=PCA_HEAD),
         # the slow end, for --cells 0,7,8 --sweep-epochs 20
         Cell("multisimilarity:none", 1e-6), Cell("pml:ProxyAnchorLoss:none", 3e-6)]


@dataclass
class Row:
    name: str
    ok: bool | None            # None: information, judges nothing
    note: str
    detail: list[str] = field(default_factory=list)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _wait_all(procs: dict[str, subprocess.Popen], deadline: float) -> dict[str, int]:
    """Exit codes of ``procs``; those still running at ``deadline`` are stopped with their
    children (each was started in a process group of its own) and get 124."""
    codes: dict[str, int] = {}
    while len(codes) < len(procs):
        for name, proc in procs.items():
            if name not in codes and proc.poll() is not None:
                codes[name] = proc.returncode
        if len(codes) < len(procs) and time.monotonic() >= deadline:
            for name, proc in procs.items():
                if name not in codes:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
                    codes[name] = 124
        time.sleep(0.5)
    return codes


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        fh.write(" ".join(cmd) + "\n\n")
        fh.flush()
        return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _sets(values: list[str]) -> list[str]:
    return [a for kv in values for a in ("--set", kv)]


def _training(args, *extra: str) -> list[str]:
    """A `python -m training` run of the recipe (tiny on --dry-run)."""
    return [sys.executable, "-m", "training", "--config", RECIPE, "--root", str(args.root),
            "--seed", "0", *extra, *(_sets(DRY_SET) if args.dry_run else [])]


def _table2(args, out: Path, methods: list[str], seeds: list[int], jobs: int,
            *sets: str) -> list[str]:
    """A `finetune_table2` grid of the recipe, images decoded once into device memory."""
    return [sys.executable, "-m", "benchmarks.training.finetune_table2", "--config", RECIPE,
            "--root", str(args.root), "--methods", *methods, "--seeds", *map(str, seeds),
            "--jobs", str(jobs), "--no-baselines", "--out", str(out),
            *_sets(DRY_SET if args.dry_run else ["threads=2"]),
            *_sets(["device_batches=true", *sets])]


def step_probe(args, deadline: float) -> list[Row]:
    """Epoch seconds of the recipe alone on the GPU: images decoded once into device memory,
    then DataLoader workers decoding every epoch (each run alone, one after the other)."""
    out, rows = args.out / "probe", []
    if args.dry_run:      # a plain `python -m training` run: the sweep and the grid cover its code
        return [Row("probe", None, "not run in --dry-run")]
    kinds = [("device", ["device_batches=true"]),
             ("loader", ["device_batches=false", f"workers={args.workers}"])]
    for name, sets in kinds:
        cmd = _training(args, "--out", str(out / name), *_sets(
            ["epochs=2", "eval_every=2", "export_onnx=false", "progress=false", *sets]))
        t0 = time.monotonic()
        rc = _wait_all({name: _start(cmd, args.out / f"probe-{name}.log")}, deadline)[name]
        metrics = out / name / "metrics.json"
        hist = json.loads(metrics.read_text()).get("history", []) if metrics.is_file() else []
        secs = [f"{r['seconds']:.1f}" for r in hist if r.get("epoch")]
        # the loader run is the comparison, judged by nothing (it may not fit its share)
        ok = (rc == 0 and bool(secs)) if name == "device" else None
        rows.append(Row(f"probe: 2 epochs alone, {name}", ok,
                        f"epoch seconds {' / '.join(secs) or '-'} (exit {rc}, "
                        f"{time.monotonic() - t0:.0f} s with start-up)"))
    return rows


def sweep_cells(args) -> list[Cell]:
    if args.dry_run:
        return SWEEP[:1]
    return [SWEEP[int(i)] for i in args.cells.split(",")] if args.cells else SWEEP[:7]


def _cell_dir(out: Path, cell: Cell) -> Path:
    return out / "sweep" / cell.name


def choose(out: Path, cells: list[Cell]) -> tuple[dict | None, list[str]]:
    """The sweep's choice: the cell and epoch count whose validation R@1, averaged over its runs
    (with and without DAS, every seed), is highest (ties: fewer epochs, then the earlier cell);
    and the table of every run's curve."""
    best, lines = None, ["| loss [sampler] | backbone lr | trainable | other | DAS | seed | "
                         "R@1 by epoch (validation) |", "|---|---|---|---|---|---:|---|"]
    for cell in cells:
        path = _cell_dir(out, cell) / "runs.json"
        runs = json.loads(path.read_text()) if path.is_file() else []
        curves = []
        for r in sorted(runs, key=lambda r: (r["variant"] != "base", r.get("seed", 0))):
            curve = {c["epoch"]: c["R@1"] for c in r.get("curve", []) if "R@1" in c}
            curves.append((r["variant"], curve))
            lines.append(f"{cell.cells()} {'-' if r['variant'] == 'base' else 'DAS'} | "
                         f"{r.get('seed', 0)} | "
                         + " ".join(f"{100 * curve[e]:.2f}" for e in sorted(curve)) + " |")
        if not curves:
            lines.append(f"{cell.cells()} - | - | not finished |")
            continue
        epochs = set.intersection(*(set(c) for _, c in curves)) - {0}
        for e in sorted(epochs):
            mean = sum(c[e] for _, c in curves) / len(curves)
            if best is None or mean > best["R@1"]:
                per = {v: [c[e] for w, c in curves if w == v] for v, _ in curves}
                best = {"cell": cell, "backbone_lr": cell.backbone_lr, "trainable": cell.trainable,
                        "epochs": e, "R@1": mean, "start": curves[0][1].get(0),
                        "variants": {v: sum(x) / len(x) for v, x in per.items()}}
    return best, lines


def step_sweep(args, deadline: float) -> tuple[list[Row], dict | None]:
    cells = sweep_cells(args)
    procs = {f"sweep {cell.name}": _start(
        _table2(args, _cell_dir(args.out, cell), [cell.method], SEEDS[:1 if args.dry_run else 2],
                # every run of a cell at once when a few cells leave the GPU room
                1 if args.dry_run else (4 if len(cells) <= 4 else 2), f"backbone_lr={cell.backbone_lr}",
                f"trainable={cell.trainable}", *cell.sets, "eval_every=1", "eval_initial=true",
                # --dry-run: 2 + 2 of cub-mini's 4 training species, 2 per batch; else the
                # 10-epoch curve the recipe's epochs were chosen from
                *(["max_classes=4", "batch_size=4"] if args.dry_run else [f"epochs={args.sweep_epochs}"]))
        + ["--validation"],
        args.out / f"sweep-{cell.name}.log") for cell in cells}
    t0 = time.monotonic()
    codes = _wait_all(procs, deadline)
    best, table = choose(args.out, cells)
    done = sum(rc == 0 for rc in codes.values())
    note = f"{done} of {len(cells)} cells finished ({time.monotonic() - t0:.0f} s); "
    if best is None:
        return [Row("sweep (validation species)", False, note + "nothing to choose from",
                    table)], None
    v, cell = best["variants"], best["cell"]
    note += (f"chosen: {method_label(cell.method)}, backbone lr {cell.backbone_lr:g}, trainable "
             f"{cell.trainable}{''.join(', ' + s for s in cell.sets)}, {best['epochs']} epochs: "
             f"validation R@1 {100 * best['R@1']:.2f} (start "
             f"{100 * (best['start'] or float('nan')):.2f}; without / with DAS "
             f"{100 * v.get('base', float('nan')):.2f} / {100 * v.get('DAS', float('nan')):.2f})")
    return [Row("sweep (validation species)", done == len(cells), note, table)], best


def grid_methods(best: dict | None) -> list[str]:
    """The grid's loss:sampler pairs: the sweep's choice first, then the other `PAIRS`."""
    first = best["cell"].method if best else PAIRS[0]
    return [first] + [m for m in PAIRS if m != first][:len(PAIRS) - 1]


def step_grid(args, deadline: float, best: dict | None) -> list[Row]:
    sets = ["eval_initial=true"]          # no choice (the sweep failed): the recipe's own values
    if best:
        cell = best["cell"]
        sets += [f"backbone_lr={cell.backbone_lr}", f"trainable={cell.trainable}", *cell.sets]
        if not args.dry_run:
            sets.append(f"epochs={best['epochs']}")
    methods = grid_methods(best)[:args.pairs]
    methods, seeds = (methods[:1], SEEDS[:1]) if args.dry_run else (methods, SEEDS)
    cmd = _table2(args, args.out / "grid", methods, seeds,
                  min(args.jobs, 2) if args.dry_run else args.jobs, *sets)
    t0 = time.monotonic()
    rc = _wait_all({"grid": _start(cmd, args.out / "grid.log")}, deadline)["grid"]
    return [grid_row(args.out, rc, time.monotonic() - t0, 2 * len(methods) * len(seeds),
                     methods[0])]


def grid_row(out: Path, rc: int, secs: float, expected: int, method: str = PAIRS[0]) -> Row:
    """The test grid: how many runs finished, and the training-free start of `method` (the
    sweep's choice) against its fine-tuned runs (the mean over the seeds without DAS)."""
    runs_path, table = out / "grid" / "runs.json", out / "grid" / "results.md"
    runs = json.loads(runs_path.read_text()) if runs_path.is_file() else []
    detail = table.read_text().splitlines() if table.is_file() else []
    note = (f"{len(runs)} of {expected} runs" + ("" if rc == 0 else f", exit {rc}")
            + f" ({secs:.0f} s)")
    own = [r for r in runs if r.get("method") == method and r.get("variant") == "base"
           and r.get("initial")]
    if own:
        mean = lambda k, key: sum(r[k][key] for r in own) / len(own)  # noqa: E731
        note += (f"; {method} without DAS, {len(own)} seed(s): training-free start R@1 "
                 f"{100 * mean('initial', 'R@1'):.2f} MAP@R {100 * mean('initial', 'MAP@R'):.2f}"
                 f" -> fine-tuned R@1 {100 * mean('metrics', 'R@1'):.2f} MAP@R "
                 f"{100 * mean('metrics', 'MAP@R'):.2f}")
    return Row("grid (test species, chosen setting)", rc == 0 and len(runs) == expected, note,
               detail)


def step_gpu_check(args, deadline: float) -> list[Row]:
    out = args.out / "gpu_check"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out)]
    if args.dry_run:
        cmd += ["--device", "cpu", "--quick", "--skip-tests"]
    else:
        cmd += ["--budget-s", f"{max(30.0, deadline - time.monotonic() - 10):.0f}"]
    t0 = time.monotonic()
    rc = _wait_all({"gpu_check": _start(cmd, args.out / "gpu_check.log")}, deadline)["gpu_check"]
    summary = out / "summary.txt"
    lines = summary.read_text().splitlines() if summary.is_file() else []
    return [Row("gpu_check", rc == 0 and bool(lines),
                f"exit {rc} ({time.monotonic() - t0:.0f} s)", lines)]


def render(rows: list[Row], card: str, torch_version: str, args) -> str:
    mode = "dry run on the CPU" if args.dry_run else card
    lines = [f"# device_suite on {mode}", "",
             f"torch {torch_version}, {platform.machine()}, {os.cpu_count()} CPUs; budget "
             f"{args.budget_s:.0f} s, grid --jobs {args.jobs}, workers {args.workers}", ""]
    for r in rows:
        mark = "INFO" if r.ok is None else ("PASS" if r.ok else "FAIL")
        lines.append(f"- **{mark}** {r.name}: {r.note}")
    for r in rows:
        if r.detail:
            lines += ["", f"## {r.name}", "", *r.detail]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """The kit's policy (embedder/cli.py): bad options, or no CUDA without --dry-run, are usage
    errors (exit 2)."""
    return run_main("python -m benchmarks.device_suite", build_parser(), argv, handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    if args.jobs < 1 or args.workers < 0 or args.budget_s <= 0:
        raise UsageError("--jobs >= 1, --workers >= 0 and --budget-s > 0 expected")
    unknown = set(s.strip() for s in args.steps.split(",")) - set(SHARES)
    if unknown:
        raise UsageError(f"--steps: unknown {', '.join(sorted(unknown))}; expected some of "
                         f"{', '.join(SHARES)}")
    if not args.dry_run and not torch.cuda.is_available():
        raise UsageError("no CUDA device visible (torch.cuda.is_available() is False); run "
                         "it on a GPU machine, or pass --dry-run to check the script on the CPU")
    if not args.root.is_dir():
        raise UsageError(f"--root {args.root}: not a directory of class folders")
    check = subprocess.run([sys.executable, "-c", IMPORTS], cwd=REPO, env=_env(),
                           capture_output=True, text=True)
    if check.returncode:
        last = (check.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise OSError(f"the runs cannot start on this machine: {last} (benchmarks/"
                      "device_prep.sh packs the wheels a GPU image lacks)")
    args.out.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    start = time.monotonic()
    end = start + args.budget_s
    steps = [name.strip() for name in args.steps.split(",")]
    total = sum(SHARES[name] for name in steps)
    ends, at = {}, start
    for name in steps:
        at += args.budget_s * SHARES[name] / total
        ends[name] = at
    rows: list[Row] = []
    best = None
    for name in steps:
        print(f"device_suite: {name}, until {ends[name] - start:.0f} s", file=sys.stderr,
              flush=True)
        if name == "probe":
            rows += step_probe(args, ends[name])
        elif name == "sweep":
            sweep_rows, best = step_sweep(args, ends[name])
            rows += sweep_rows
        elif name == "grid":
            rows += step_grid(args, ends[name], best)
        else:
            rows += step_gpu_check(args, end)
    text = render(rows, card, torch.__version__, args)
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
