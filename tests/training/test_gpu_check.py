"""benchmarks/gpu_check.py: the one-command GPU check. CI has no GPU, so this runs its
plumbing on the CPU (the same steps, tiny settings), checks its refusal without CUDA, and checks
its judgements on real pytest / training-log / benchmark outputs: a check that cannot pass on a
broken setup (issue 20)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PYTEST_NO_TRITON = """\
........ssssssssssss...
=========================== short test summary info ============================
SKIPPED [1] tests/training/test_das_fused.py:16: could not import 'triton': No module named 'triton'
SKIPPED [1] tests/training/test_das_launches.py:15: could not import 'triton': No module named 'tr'
40 passed, 2 skipped in 12.31s
"""
PYTEST_ALLOWED = """\
SKIPPED [1] tests/training/test_das_fused.py:133: the interpreter is a CPU-only path
61 passed, 1 skipped in 20.02s
"""


def test_a_skipped_test_fails_the_cuda_run_whatever_its_reason(gpu_check):
    """A missing triton skipped the fused tests with a reason that does not say CUDA: the
    former check passed that run."""
    ok, note = gpu_check.judge_tests(PYTEST_NO_TRITON, 0, "cuda")
    assert not ok and "2 test(s) skipped outside the allow-list" in note
    assert "could not import 'triton'" in note
    assert gpu_check.judge_tests(PYTEST_NO_TRITON, 0, "cpu")[0]          # plumbing run: fine
    assert gpu_check.judge_tests(PYTEST_ALLOWED, 0, "cuda") == (True, "61 passed, 1 skipped in "
                                                                     "20.02s")
    assert not gpu_check.judge_tests(PYTEST_ALLOWED, 1, "cuda")[0]
    assert not gpu_check.judge_tests("no tests ran in 0.01s", 5, "cuda")[0]


def test_the_training_log_must_show_the_fused_kernels(gpu_check, tmp_path):
    """The log lines are the ones training/das_fused.py writes (produced here for real)."""
    from training import das_fused
    from training.das import DAS

    das = DAS(6, 16)
    key = das_fused.variant_key(das, torch.zeros(12, 16), torch.zeros(12, dtype=torch.long))
    line = f"DAS: fused Triton kernels in use ({das_fused.describe(key)}; self-check passed)"
    warn = (f"training/das.py:250: RuntimeWarning: DAS: the fused Triton kernels are not used "
            f"for {das_fused.describe(key)} (RuntimeError: PTX compile failed); running the "
            "eager tensor code instead")
    log = "device: cuda:0\nepoch 1: loss 0.3\n"
    assert gpu_check.fused_in_log(log) == (
        False, "no 'fused Triton kernels in use' line in the training log")
    ok, note = gpu_check.fused_in_log(log + line + "\n")
    assert ok and "float32 bank" in note
    # as an H200 run logged it: the epoch's progress bar (stderr too) shares the line
    ok, note = gpu_check.fused_in_log(log + "epoch 1/4:   0%|          | 0/17 [00:00<?, ?it/s]"
                                      + line + "\n")
    assert ok and note.count("float32 bank") == 1
    ok, note = gpu_check.fused_in_log(log + line + "\n" + warn + "\n")
    assert not ok and "PTX compile failed" in note


def test_every_goal_is_a_row_with_its_figure(gpu_check):
    figs = {"module": [{"device": "cuda", "backend": b, "C": C, "d": 512, "median_ms": ms}
                       for b, C, ms in (("eager", 98, 0.50), ("eager", 11318, 0.60),
                                        ("triton", 98, 0.09), ("triton", 11318, 0.12),
                                        ("triton+graph", 98, 0.04), ("triton+graph", 11318, 0.05))],
            "launches": [{"backend": "eager", "host": 40, "gpu": 40},
                         {"backend": "triton", "host": 1, "gpu": 3},
                         {"backend": "triton+graph", "host": 5, "gpu": 7,
                          "names": {"cudaGraphLaunch": 1, "cudaLaunchKernel": 2,
                                    "cudaMemcpyAsync": 2}}],
            "full_step": [{"device": "cuda", "backbone": "resnet50 @ 224",
                           "loss": "triplet [distance]", "ratio": 1.07}]}
    rows = {name: (ok, note) for name, ok, note in gpu_check.bench_goals(figs, "cuda")}
    goal = [v for k, v in rows.items() if k.startswith("goal: DAS call")]
    assert goal == [(True, "met by: triton+graph")]
    assert rows["DAS call, triton, C=11,318, d=512, B=112, T=3"] == (
        None, "median 0.120 ms (eager 0.600 ms, x5.0)")
    assert rows["goal: <= 3 launches per DAS call (triton)"][0] is True
    # a replay is judged by its time; its host calls are listed by name, not judged
    assert "goal: <= 3 launches per DAS call (triton+graph)" not in rows
    ok, note = rows["launches per DAS call (triton+graph)"]
    assert ok is None and "5 host launch calls" in note and "cudaGraphLaunch x1" in note
    assert rows["goal: full step with/without DAS <= 1.05, resnet50 @ 224 triplet [distance]"] \
        == (False, "ratio 1.070")
    figs["launches"][1]["gpu"] = 0                      # the profiler saw nothing: no pass
    rows = {name: ok for name, ok, _ in gpu_check.bench_goals(figs, "cuda")}
    assert rows["goal: <= 3 launches per DAS call (triton)"] is False


def test_a_step_past_the_budget_is_cut(gpu_check, tmp_path, monkeypatch):
    """The check must fit ~8 minutes of a lent GPU: a step gets what is left of the budget."""
    import time

    monkeypatch.setattr(gpu_check, "_DEADLINE", [time.monotonic() + 1.5, True])
    rc, text, secs = gpu_check._run([sys.executable, "-c", "import time; time.sleep(30)"],
                                    tmp_path / "step.log", None, "tests")
    assert rc == 124 and "timed out after" in text and secs < 20
    assert (tmp_path / "step.log").read_text().startswith(sys.executable)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_without_cuda_it_says_so_in_one_line(gpu_check, capsys):
    """A usage error of the CLI kit: the usage, then one error line; exit 2."""
    assert gpu_check.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in str(err) and err[0].startswith("usage: python -m benchmarks.gpu_check")
    assert err[-1].startswith("python -m benchmarks.gpu_check: error: no CUDA device visible")


# gpu_check's CPU plumbing (training CLI, ONNX + embedder info, bf16 run, the DAS benchmark's
# figures in the summary) runs inside the device suite's dry run: tests/training/test_device_suite.py.
