"""benchmarks/gpu_check.py: the one-command GPU check. CI has no GPU, so this runs its
plumbing on the CPU (the same steps, tiny settings) and checks its refusal without CUDA."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_without_cuda_it_says_so_in_one_line():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no CUDA device visible" in proc.stderr


@pytest.mark.slow
def test_plumbing_on_cpu(tmp_path, omniglot_root):
    """Training through the CLI (default device logic, ONNX export + parity, embedder info)
    and the DAS benchmark's table parsed into the summary."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick",
                           "--skip-tests", "--data", str(omniglot_root), "--out", str(tmp_path)],
                          capture_output=True, text=True, env=_env(), timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "PASS  training CLI, default device: device cpu" in out
    assert "ONNX exported + parity-checked" in out
    assert "PASS  ONNX model (embedder info): dim 64" in out
    assert "PASS  DAS overhead: small_cnn @ 28 triplet [distance]" in out
    assert (tmp_path / "run" / "model.onnx").exists() and (tmp_path / "das_overhead.md").exists()
