"""One command that spends a lent GPU well: the photo recipe, its DAS grid and the GPU check.

    python -m benchmarks.device_suite --out $OUT/suite          # on the GPU machine, <= 10 min
    python -m benchmarks.device_suite --dry-run --out /tmp/ds   # the same code paths, CPU, tiny

On the GPU machine lent through the `device` tool: ``bash benchmarks/device_prep.sh`` here (it
packs what the run needs into .device-carry/, under the tool's 64 MiB), then one `run` with
carry [".device-carry"] and the command
``source .device-carry/env.sh && python -m benchmarks.device_suite --out $OUT/suite``.

Steps, each a row of one summary (OUT/summary.md, also printed):
1. photos, in parallel on the one GPU (a Lite1 run leaves an H100 mostly idle):
   a. the GPU photo recipe (configs/photos_finetune_gpu.toml: the shipped training-free
      embedder, every stage fine-tuned, multi-similarity) on cub-dev, seed 0, with the
      training-free start evaluated beside it (epoch 0) and the ONNX export parity-checked;
   b. ``benchmarks.training.finetune_table2`` with that recipe: triplet [semihard], margin [distance],
      multi-similarity x seeds 0 1, with and without DAS, ``--jobs`` runs at once;
2. ``benchmarks.gpu_check`` (CUDA tests, DAS kernels and their goals, training CLI, bf16),
   after the photos so that its timings run on a quiet GPU.
Each step gets a share of ``--budget-s``; a step past its share is stopped (its own processes,
by process group) and FAILs, and what it finished is still reported (the grid writes each run
as it ends). Exit 0 when every step passed.

``--dry-run`` runs the same steps on the CPU with tiny settings (3 + 3 species at 64 px, one
epoch of 4 steps, one seed, one pair, the recipe not exported; gpu_check --quick without its CUDA tests): what CI can check of
this script and of gpu_check's plumbing.
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

from embedder.cli import UsageError, run_main

REPO = Path(__file__).resolve().parents[1]
RECIPE = "configs/photos_finetune_gpu.toml"
PAIRS = ["triplet:semihard", "margin:distance", "multisimilarity:none"]
SEEDS = [0, 1]
#: seconds of the budget each step may take at most, in order (the rest goes to the last)
SHARES = {"photos": 0.55}
#: CPU-only tiny settings of --dry-run, for both photo runs (4 steps of one epoch: the code
#: paths are those of a full epoch; a full pass over 3 species cost ~30 s per run)
DRY_SET = ["max_classes=3", "epochs=1", "steps_per_epoch=4", "eval_every=1", "lr_milestones=[2]",
           "warmup_epochs=0", "input_size=64", "resize=72", "batch_size=6", "per_class=2",
           "workers=0", "device=cpu", "amp=off", "channels_last=false", "threads=1",
           # the Lite1 export (dynamo) was 30 of the recipe's 41 CPU seconds; the export path
           # stays checked by gpu_check's training row (a small network, parity-checked)
           "export_onnx=false"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_suite", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "bench_out" / "device_suite",
                   help="logs, run folders, the grid's table and summary.md")
    p.add_argument("--root", type=Path, default=REPO.parent / "shared" / "data" / "cub-dev" / "images",
                   help="class-folder photos for the recipe and the grid")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-clock seconds for the whole suite (a lent GPU has 15 minutes, "
                        "its start included)")
    p.add_argument("--jobs", type=int, default=6, help="grid runs at once on the GPU")
    p.add_argument("--workers", type=int, default=2,
                   help="DataLoader workers of each photo run (jobs x (workers + 1) ~ CPUs)")
    p.add_argument("--dry-run", action="store_true",
                   help="the same steps on the CPU with tiny settings (for CI)")
    return p


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


def photo_commands(args) -> dict[str, list[str]]:
    """The recipe run and the grid, as the commands a user would type."""
    py, out = sys.executable, args.out
    recipe = [py, "-m", "training", "--config", RECIPE, "--root", str(args.root),
              "--out", str(out / "recipe"), "--seed", "0", "--eval_initial", "true",
              "--set", f"workers={args.workers}"]
    grid = [py, "-m", "benchmarks.training.finetune_table2", "--config", RECIPE, "--root", str(args.root),
            "--methods", *(PAIRS[-1:] if args.dry_run else PAIRS),
            "--seeds", *map(str, SEEDS[:1] if args.dry_run else SEEDS),
            "--jobs", str(min(args.jobs, 2) if args.dry_run else args.jobs), "--no-baselines",
            "--out", str(out / "grid"), "--set", f"workers={args.workers}"]
    if args.dry_run:
        for cmd in (recipe, grid):
            for kv in DRY_SET:
                cmd += ["--set", kv]
    else:
        grid += ["--set", "threads=2"]
    return {"recipe": recipe, "grid": grid}


def recipe_row(out: Path, rc: int, secs: float, export: bool = True) -> Row:
    """``export``: whether the run was asked for its ONNX file (not in --dry-run)."""
    metrics, onnx = out / "recipe" / "metrics.json", out / "recipe" / "model.onnx"
    if not metrics.is_file():
        return Row("photo recipe (cub-dev, seed 0)", False,
                   f"exit {rc}, no metrics.json (see {out / 'recipe.log'})")
    m = json.loads(metrics.read_text())
    first, last = m.get("initial") or {}, m.get("last") or m.get("best") or {}
    note = (f"training-free start R@1 {100 * first.get('R@1', float('nan')):.2f} MAP@R "
            f"{100 * first.get('MAP@R', float('nan')):.2f} -> fine-tuned R@1 "
            f"{100 * last.get('R@1', float('nan')):.2f} MAP@R "
            f"{100 * last.get('MAP@R', float('nan')):.2f}; ONNX "
            f"{'exported + parity-checked' if onnx.is_file() else 'MISSING' if export else 'not asked for'}"
            f" ({secs:.0f} s)")
    ok = rc == 0 and (onnx.is_file() or not export) and "R@1" in last and "R@1" in first
    return Row("photo recipe (cub-dev, seed 0)", ok, note)


def grid_row(out: Path, rc: int, secs: float, expected: int) -> Row:
    runs_path, table = out / "grid" / "runs.json", out / "grid" / "results.md"
    runs = json.loads(runs_path.read_text()) if runs_path.is_file() else []
    detail = table.read_text().splitlines() if table.is_file() else []
    note = (f"{len(runs)} of {expected} runs" + ("" if rc == 0 else f", exit {rc}")
            + f" ({secs:.0f} s); table in {table}")
    return Row("DAS grid (finetune_table2, recipe)", rc == 0 and len(runs) == expected, note,
               detail)


def step_photos(args, deadline: float) -> list[Row]:
    procs = {name: _start(cmd, args.out / f"{name}.log")
             for name, cmd in photo_commands(args).items()}
    t0 = time.monotonic()
    codes = _wait_all(procs, deadline)
    secs = time.monotonic() - t0
    n_runs = 2 * (1 if args.dry_run else len(PAIRS) * len(SEEDS))
    return [recipe_row(args.out, codes["recipe"], secs, export=not args.dry_run),
            grid_row(args.out, codes["grid"], secs, n_runs)]


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
    if not args.dry_run and not torch.cuda.is_available():
        raise UsageError("no CUDA device visible (torch.cuda.is_available() is False); run "
                         "it on a GPU machine, or pass --dry-run to check the script on the CPU")
    if not args.root.is_dir():
        raise UsageError(f"--root {args.root}: not a directory of class folders")
    args.out.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    start = time.monotonic()
    end = start + args.budget_s
    rows: list[Row] = []
    print(f"device_suite: photos (recipe + grid), {args.budget_s * SHARES['photos']:.0f} s "
          "at most", file=sys.stderr, flush=True)
    rows += step_photos(args, start + args.budget_s * SHARES["photos"])
    print(f"device_suite: gpu_check, {end - time.monotonic():.0f} s left", file=sys.stderr,
          flush=True)
    rows += step_gpu_check(args, end)
    text = render(rows, card, torch.__version__, args)
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
