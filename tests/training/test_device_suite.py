"""benchmarks/device_suite.py: the one command a lent GPU runs (issue 30 item 5). CI has no GPU:
its --dry-run runs the same steps on the CPU with tiny settings, on real cub-dev photos and
Omniglot; the budget's stop and the refusal without CUDA are checked for real."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import device_suite

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def test_a_step_past_its_share_is_stopped_with_its_children(tmp_path):
    """A grid that overruns must not hold the GPU past the loan: the step's whole process
    group goes, grandchildren included (the grid's worker processes)."""
    pid_file = tmp_path / "child.pid"
    proc = device_suite._start(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"],
                               tmp_path / "step.log")
    t0 = time.monotonic()
    codes = device_suite._wait_all({"step": proc}, time.monotonic() + 1.5)
    assert codes == {"step": 124} and time.monotonic() - t0 < 20
    child = int(pid_file.read_text())
    for _ in range(50):     # reaped by init shortly after the kill
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the step's child {child} outlived the stop")


def test_a_partial_grid_fails_and_says_how_far_it_got(tmp_path):
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "runs.json").write_text(json.dumps([{"method": "x"}] * 5))
    row = device_suite.grid_row(tmp_path, 124, 300.0, 12)
    assert row.ok is False and row.note.startswith("5 of 12 runs, exit 124")


def test_the_sweep_chooses_by_the_mean_of_both_variants_and_the_fewest_epochs(tmp_path):
    """Validation curves of two cells, with and without DAS: the cell and epoch whose mean R@1
    is highest wins; a tie goes to the earlier epoch; a cell that never finished is listed."""
    Cell = device_suite.Cell
    fast, slow = Cell("multisimilarity:none", 1e-5), Cell("multisimilarity:none", 3e-6)
    proxy = Cell("pml:ProxyAnchorLoss:none", 1e-4, "last:3", ("dim=512", "lr=1e-4"))

    def cell(c, base, das):
        d = device_suite._cell_dir(tmp_path, c)
        d.mkdir(parents=True)
        runs = [{"variant": v, "seed": 0, "curve": [{"epoch": e, "R@1": r} for e, r in enumerate(c)]}
                for v, c in (("DAS", das), ("base", base))]
        (d / "runs.json").write_text(json.dumps(runs))

    cell(fast, [0.90, 0.92, 0.95, 0.93], [0.90, 0.94, 0.93, 0.95])   # means .93 .94 .94
    cell(slow, [0.90, 0.91, 0.92, 0.93], [0.90, 0.90, 0.91, 0.92])
    best, table = device_suite.choose(tmp_path, [fast, slow, proxy])
    assert (best["cell"], best["epochs"]) == (fast, 2)
    assert best["variants"] == {"base": 0.95, "DAS": 0.93} and best["start"] == 0.90
    assert "| multisimilarity | 1e-05 | all | - | DAS | 0 | 90.00 94.00 93.00 95.00 |" in table
    rows = [line for line in table if line.startswith("| multisimilarity | 1e-05 |")]
    assert [r.split(" | ")[4] for r in rows] == ["-", "DAS"]        # base runs listed first
    assert "| pml:ProxyAnchorLoss | 0.0001 | last:3 | dim=512, lr=1e-4 | - | - | not finished |" in table
    assert device_suite.grid_methods(best)[0] == "multisimilarity:none"
    # a second seed joins the mean: epoch 3 now wins for the first cell
    d = device_suite._cell_dir(tmp_path, fast)
    runs = json.loads((d / "runs.json").read_text())
    runs.append({"variant": "base", "seed": 1, "curve": [{"epoch": e, "R@1": r} for e, r in
                                                          enumerate([0.90, 0.90, 0.90, 0.99])]})
    (d / "runs.json").write_text(json.dumps(runs))
    best, _ = device_suite.choose(tmp_path, [fast, slow])
    assert best["epochs"] == 3 and abs(best["R@1"] - (0.93 + 0.95 + 0.99) / 3) < 1e-12
    assert best["variants"] == {"base": (0.93 + 0.99) / 2, "DAS": 0.95}
    # a proxy loss chosen leads the grid, the other pairs follow; every cell has its own folder
    cell(proxy, [0.90, 0.99, 0.99, 0.99], [0.90, 0.99, 0.99, 0.99])
    best, _ = device_suite.choose(tmp_path, [fast, slow, proxy])
    assert best["cell"] == proxy and best["epochs"] == 1
    methods = device_suite.grid_methods(best)
    assert methods[0] == proxy.method and len(methods) == len(device_suite.PAIRS)
    assert len({c.name for c in device_suite.SWEEP}) == len(device_suite.SWEEP)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_without_cuda_it_says_so_in_one_line(capsys):
    """A usage error of the CLI kit: the usage, then one error line; exit 2."""
    assert device_suite.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in str(err) and err[0].startswith("usage: python -m benchmarks.device_suite")
    assert err[-1].startswith("python -m benchmarks.device_suite: error: no CUDA") and "--dry-run" in err[-1]


def test_a_module_missing_on_the_machine_stops_it_before_any_step(tmp_path, capsys, monkeypatch):
    """The H200 of 2026-11-30 lacked pillow-heif: every run of every step failed alike. Now one
    line names the missing module, exit 1, and no step starts."""
    monkeypatch.setattr(device_suite, "IMPORTS", "import training.__main__, no_such_wheel_here")
    assert device_suite.main(["--dry-run", "--root", str(tmp_path), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No module named 'no_such_wheel_here'" in err[0], err
    assert "device_prep.sh" in err[0] and not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.timeout(1250)      # the subprocess has 1200 s
def test_dry_run_on_cpu(tmp_path, cub_mini, omniglot_root):
    """Every step but the probe on the CPU: one sweep cell on validation species, the grid with
    and without DAS in two processes at once with its training-free start, gpu_check's training runs; one summary with a
    PASS row each and the tables."""
    out = tmp_path / "suite"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.device_suite", "--dry-run",
                           "--root", str(cub_mini), "--out", str(out),
                           "--budget-s", "1100"], cwd=REPO,     # wall time: a loaded machine is no failure
                          capture_output=True, text=True, env=_env(), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert summary.count("**PASS**") == 3 and "FAIL" not in summary
    assert "**INFO** probe: not run in --dry-run" in summary
    assert "1 of 1 cells finished" in summary
    assert "chosen: multisimilarity, backbone lr 3e-06, trainable all" in summary
    assert "training-free start R@1" in summary and "-> fine-tuned R@1" in summary
    sweep = json.loads((out / "sweep" / device_suite.SWEEP[0].name / "runs.json").read_text())
    assert sorted(r["variant"] for r in sweep) == ["DAS", "base"]
    assert [c["epoch"] for c in sweep[0]["curve"]] == [0, 1]           # a curve, epoch 0 too
    runs = json.loads((out / "grid" / "runs.json").read_text())
    assert sorted(r["variant"] for r in runs) == ["DAS", "base"]
    assert all(r["initial"]["R@1"] > 0 for r in runs)
    assert "| multisimilarity | DAS | 1 |" in summary
    # gpu_check's own plumbing, run by the suite (was test_gpu_check.test_plumbing_on_cpu)
    assert "PASS  training CLI, default device: device cpu" in summary
    assert "ONNX exported + parity-checked" in summary
    assert "PASS  ONNX model (embedder info): dim 64" in summary
    assert "PASS  training with bf16 autocast + bf16 bank: loss" in summary
    assert "PASS  DAS overhead benchmark" in summary
    assert "INFO  goal: full step with/without DAS <= 1.1, small_cnn @ 28 triplet [distance]" in summary
    gc = out / "gpu_check"
    assert (gc / "run" / "model.onnx").exists() and (gc / "das_overhead.json").exists()
