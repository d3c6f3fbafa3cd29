"""``DAS(graph=True)``: the fused call (update, draw, produce) captured once per batch layout in
a CUDA graph and replayed, for when the host cost of launching it is what stands between a DAS
call and the <= 0.10 ms goal (issue 20): a replay is the two input copies plus one graph
launch, whatever the kernels' Python launch overhead.

Only on CUDA, only for the fused path without gradient through the copies (every detach=True
step). What it changes for the caller: the returned tensors are the graph's static buffers, so
the next call of the same layout overwrites them (a training step has consumed them by then),
and the uniforms come from the same generator in graph-safe mode, i.e. not necessarily the
same numbers as the ungraphed call draws. The state (FRM, bank, pointers, counts) is written by
the same kernels and ends up the same. A capture that fails warns once and the module goes on
without a graph. It can only run on a GPU: `benchmarks/das_overhead.py` times it and
`benchmarks/gpu_check.py` reports it against the goal.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["graphed_call"]


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    v: Tensor
    y: Tensor
    out: Tensor
    lab: Tensor


def _capture(das, v: Tensor, y: Tensor) -> _Captured:
    dev = v.device
    sv = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=dev).copy_(v)
    sy = torch.empty_strided(y.shape, y.stride(), dtype=y.dtype, device=dev).copy_(y)
    state = [t.clone() for t in (das.frm, das.bank, das.bank_ptr, das.bank_count)]
    gen = das._gen()
    rng = gen.get_state() if gen is not None else torch.cuda.get_rng_state(dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):      # warm-up: compiles and loads the kernels before capture
        das._fused_call_direct(sv, sy)
    torch.cuda.current_stream(dev).wait_stream(side)
    try:
        graph = torch.cuda.CUDAGraph()
        if gen is not None:
            graph.register_generator_state(gen)
        with torch.cuda.graph(graph):
            out, lab = das._fused_call_direct(sv, sy)
    finally:                           # the warm-up's writes and draws are undone
        for t, saved in zip((das.frm, das.bank, das.bank_ptr, das.bank_count), state):
            t.copy_(saved)
        if gen is not None:
            gen.set_state(rng)
        else:
            torch.cuda.set_rng_state(rng, dev)
    return _Captured(graph, sv, sy, out, lab)


def graphed_call(das, v: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """The fused call through the module's graph for this layout (captured on first use)."""
    key = (v.shape, v.dtype, v.stride(), y.dtype, y.stride(), das.training, v.device)
    cap = das._graphs.get(key)
    if cap is None:
        try:
            with torch.cuda.device(v.device):
                cap = _capture(das, v, y)
        except Exception as e:   # e.g. a torch without register_generator_state
            das.graph = False
            warnings.warn(f"DAS: CUDA-graph capture failed ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0][:200]}); running the fused kernels "
                          "without a graph", RuntimeWarning, stacklevel=4)
            return das._fused_call_direct(v, y)
        das._graphs[key] = cap
    cap.v.copy_(v)
    cap.y.copy_(y)
    cap.graph.replay()
    return cap.out.detach(), cap.lab.detach()
