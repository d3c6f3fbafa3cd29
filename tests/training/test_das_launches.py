"""One fused DAS call is at most three launches (issue 20): the update kernel, one draw of all
uniforms, the produce kernel. Counted, not claimed: every Triton launch goes through
``das_triton._launch`` (wrapped here), and every torch op the call dispatches is recorded below
the autograd layer; ops that launch nothing on a GPU (allocations, views) are not counted.
Triton's CPU interpreter copies tensors with torch ops of its own: those are not the call's and
are ignored while a kernel runs. Every launch must also name the tensors' device (Triton
launches on the current CUDA device, so a module on cuda:1 needs ``torch.cuda.device``)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from training import das_triton
from training.das import DAS

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

#: ops that allocate or re-view memory: no kernel launch on a GPU
FREE = {"empty.memory_format", "empty_strided.default", "view.default", "_unsafe_view.default",
        "expand.default", "slice.Tensor", "select.int", "as_strided.default", "alias.default",
        "detach.default", "t.default", "transpose.int", "unsqueeze.default", "squeeze.dim",
        "lift_fresh.default", "empty_like.default"}


class LaunchCounter(TorchDispatchMode):
    def __init__(self, monkeypatch):
        super().__init__()
        self.ops: list[str] = []
        self.kernels: list[tuple[str, torch.device]] = []
        self._in_kernel = False
        real = das_triton._launch

        def launch(kernel, grid, device, *args, **meta):
            self.kernels.append((getattr(kernel, "fn", kernel).__name__.lstrip("_"), device))
            self._in_kernel = True
            try:
                return real(kernel, grid, device, *args, **meta)
            finally:
                self._in_kernel = False

        monkeypatch.setattr(das_triton, "_launch", launch)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        if not self._in_kernel and name not in FREE:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _batch(B=12, d=16, C=6, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    v = torch.randn(B, d, generator=g).to(DEVICE, dtype)
    y = (torch.arange(B) % C).to(DEVICE)
    return v.requires_grad_(), y


@pytest.mark.parametrize("case", ["train", "train-bf16-fp16bank", "eval", "strided-int32",
                                  "no-dfs", "no-mts"])
def test_one_call_is_at_most_three_launches(monkeypatch, case):
    kw = {"bank_dtype": torch.float16} if "fp16bank" in case else {}
    das = DAS(6, 16, num_produce=2, seed=0, backend="triton",
              dfs=case != "no-dfs", mts=case != "no-mts", **kw).to(DEVICE)
    v, y = _batch(dtype=torch.bfloat16 if "bf16" in case else torch.float32)
    if case == "strided-int32":
        y = torch.stack([y, y], 1).reshape(-1).to(torch.int32)[::2]
    das(v, y)                                  # compile / warm up outside the count
    das.train(case != "eval")
    counter = LaunchCounter(monkeypatch)
    with counter:
        out, lab = das(v, y)
    assert [k for k, _ in counter.kernels] == (["produce"] if case == "eval"
                                               else ["update", "produce"])
    # all draws of the call in one; on CPU the label range check is a host reduction (the
    # interpreter skips device asserts), on CUDA it is the update kernel's assert
    host_only = (["aminmax.default", "_local_scalar_dense.default",
                  "_local_scalar_dense.default"] if DEVICE == "cpu" else [])
    assert counter.ops == host_only + ["rand.generator"]
    assert len(counter.ops) - len(host_only) + len(counter.kernels) <= 3
    assert all(dev == v.device for _, dev in counter.kernels)
    assert out.shape == (36, 16) and lab.shape == (36,)
    out.float().sum().backward()                         # the real rows keep their gradient
    assert torch.equal(v.grad, torch.ones_like(v))


def test_launches_run_under_the_tensors_cuda_device(monkeypatch):
    """A kernel for tensors on cuda:1 is launched inside ``torch.cuda.device(cuda:1)`` (faked
    here: no GPU on CI), so it does not go to the current device cuda:0 and fault."""
    current = {"index": 0}
    seen = []

    class FakeDevice:
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            self.prev, current["index"] = current["index"], self.index

        def __exit__(self, *exc):
            current["index"] = self.prev

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append((grid, current["index"], meta))

    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    das_triton._launch(FakeKernel(), (4,), torch.device("cuda", 1), 1, 2, K=3)
    assert seen == [((4,), 1, {"K": 3, "debug": True, "sanitize_overflow": False})]
    assert current["index"] == 0


def test_graph_option_same_state_as_the_direct_call():
    """``graph=True`` only changes how the fused call is launched on CUDA (captured once per
    batch layout, then replayed; timed by benchmarks/training/das_overhead.py): the same kernels write
    the same state, the real rows and labels come back unchanged. Its uniforms are drawn in
    graph-safe mode, so only off CUDA (where it is inert) are the copies equal too."""
    a = DAS(6, 16, num_produce=2, seed=0, backend="triton", graph=True).to(DEVICE)
    b = DAS(6, 16, num_produce=2, seed=0, backend="triton").to(DEVICE)
    assert "graph=True" in repr(a)
    v, y = _batch()
    for step in range(3):
        vs = v.detach() * (step + 1)
        (oa, la), (ob, lb) = a(vs, y), b(vs, y)
        assert torch.equal(oa[:12], ob[:12]) and torch.equal(la, lb)
        if DEVICE != "cuda":
            torch.testing.assert_close(oa, ob, rtol=0, atol=0)
    assert all(torch.equal(x, z) for x, z in zip(a.state_dict().values(),
                                                 b.state_dict().values()) if torch.is_tensor(x))
    assert a.graph and len(a.fused.graphs) == (1 if DEVICE == "cuda" else 0)
