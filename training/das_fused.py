"""DAS's fused backend (`FusedBackend`, owned by the module, reading only DAS's public attributes):
when ``backend="auto"`` may trust the Triton kernels (training/das_triton.py), the fused call, and
its CUDA-graph replay (``DAS(graph=True)``).

The self-check: Triton compiles one binary per variant (constexprs, pointer dtypes, integer
specialisations), and checking one says nothing of the others, so it is keyed on all of that
(`variant_key`) and runs before a module's first step of a new variant, at its real shapes on
tie-free data: eager and fused modules run two steps from one state and must agree bit for bit on
the state and labels, on the outputs to the normalisation's last bits. A CUDA fault is sticky (the
eager fall-back would crash too), so on CUDA it runs in a child process (``python -m
training.das_check SPEC``) whose binaries the parent then loads from Triton's cache.

The CUDA graph (CUDA, detach=True steps; for the <= 0.10 ms goal): the fused call captured once per
batch layout; returned tensors are its static buffers (overwritten by the next call of that
layout), uniforms come from the generator in graph-safe mode (other numbers, same state). A failed
capture warns once and the module goes on without a graph.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["FusedBackend", "candidate", "variant_key", "describe", "verdict", "run_spec",
           "spec_of", "check_batch"]

#: seconds the child may take (imports, compiling two kernels, two steps of each backend)
TIMEOUT_S = 600

DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                               torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)}
#: DAS's keyword options the check rebuilds both modules with (`spec_of` records them)
_OPTIONS = ("num_produce", "topk", "bank_size", "scale_range", "shift_scale", "normalize", "detach",
            "dfs", "mts")
#: the process's verdicts per variant (a check compiles kernels: once per process is enough)
VERDICTS: dict[tuple, tuple[bool, str]] = {}


def candidate(device: torch.device) -> bool:
    """Whether ``backend="auto"`` considers the kernels on ``device`` (then self-checks them)."""
    if device.type != "cuda":
        return False
    from . import das_triton   # imported only where it may run: triton costs ~0.3 s

    return das_triton.available(device)


def variant_key(das, emb: Tensor, y: Tensor) -> tuple:
    """Everything that makes Triton compile (or specialise) the two kernels differently."""
    from .das_triton import pow2

    B, d = emb.shape
    return (emb.device, emb.dtype, y.dtype, das.bank.dtype,
            pow2(d), pow2(B), das.topk, das.num_produce > 0, das.dfs, das.mts, das.normalize,
            das.training, das.detach,
            tuple("1" if n == 1 else "16k" if n % 16 == 0 else "n"   # Triton's int specialisation
                  for n in (B, d, das.bank_size, das.num_classes, *emb.stride(), *y.stride())),
            emb.data_ptr() % 16, y.data_ptr() % 16)       # pointer alignment: also specialised


def describe(key: tuple) -> str:
    dev, emb, lab, bank, bd, bb, k, _, dfs, mts, norm, train, detach = key[:13]
    sw = "+".join(n for n, on in (("dfs", dfs), ("mts", mts), ("normalize", norm)) if on)
    emb, bank = (str(t).replace("torch.", "") for t in (emb, bank))
    return (f"{dev}, {emb} embeddings, {bank} bank, "
            f"BLOCK_D={bd}, BLOCK_B={bb}, K={k}, {sw or 'no switches'}, "
            f"{'train' if train else 'eval'}{'' if detach else ', detach=False'}")


def spec_of(das, emb: Tensor, y: Tensor) -> dict[str, Any]:
    """The module's settings and the batch's layout, as JSON (for the child process)."""
    return {**{k: getattr(das, k) for k in ("num_classes", "dim", "scale_bounds", "training",
                                            *_OPTIONS)},
            "bank_dtype": str(das.bank.dtype), "device": str(emb.device), "batch": emb.shape[0],
            "emb_dtype": str(emb.dtype), "emb_stride": list(emb.stride()), "label_dtype": str(y.dtype),
            "label_stride": list(y.stride()), "emb_align": emb.data_ptr() % 16,
            "label_align": y.data_ptr() % 16}


def _layout(spec: dict[str, Any], name: str, value: Tensor) -> Tensor:
    """``value`` in a tensor of input ``name``'s dtype and strides, its address as far past a
    multiple of 16 as the real input's (Triton assumes 16-byte alignment where it holds)."""
    shape, stride, dtype = value.shape, spec[f"{name}_stride"], DTYPES[spec[f"{name}_dtype"]]
    align, device = spec.get(f"{name}_align", 0), spec["device"]
    item = torch.empty((), dtype=dtype).element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 1
    base = torch.empty(span + 16 // item + 1, dtype=dtype, device=device)
    off = ((align - base.data_ptr()) % 16) // item
    return base.as_strided(shape, stride, off).copy_(value)


def check_batch(spec: dict[str, Any], g: torch.Generator, step: int) -> tuple[Tensor, Tensor]:
    """A batch in the real layout whose top-K has no boundary tie: K + 1 entries per row are the
    integers 2..K+2, the rest in (-1, 1); one class of 5 (its ring wraps), one duplicate row."""
    B, d, C, K = spec["batch"], spec["dim"], spec["num_classes"], spec["topk"]
    v = torch.rand(B, d, generator=g) * 2 - 1
    top = torch.rand(B, d, generator=g).argsort(dim=1)[:, :min(K + 1, d)]
    v.scatter_(1, top, (torch.arange(top.shape[1]) + 2.0).expand(B, -1))
    y = torch.randint(0, C, (B,), generator=g)
    y[:min(5, B)] = (1 + step) % C
    if B >= 7:
        v[6], y[6] = v[5], y[5]
    emb, lab = _layout(spec, "emb", v), _layout(spec, "label", y)
    return emb.requires_grad_(emb.dtype.is_floating_point), lab


def run_spec(spec: dict[str, Any], das_type: Callable[..., Any]) -> tuple[bool, str]:
    """Eager and fused ``das_type`` (DAS) modules at ``spec``, two steps from one random state:
    (agree, why not). The type is handed in so that this module never imports training/das.py."""
    dev = torch.device(spec["device"])
    kw = {k: spec[k] for k in _OPTIONS}
    kw["scale_bounds"] = None if spec["scale_bounds"] is None else tuple(spec["scale_bounds"])
    kw["bank_dtype"] = DTYPES[spec["bank_dtype"]]
    C, d, Z, B = spec["num_classes"], spec["dim"], spec["bank_size"], spec["batch"]
    g = torch.Generator().manual_seed(0)
    # FRM counts: a random permutation per row, spaced wider than one batch's +1s (no ties)
    frm = torch.rand(C, d, generator=g).argsort(dim=1).float() * (B * spec["topk"] + 1)
    bank = torch.randn(C, Z, d, generator=g)
    count = torch.randint(0, Z + 1, (C,), generator=g)
    ptr = torch.where(count < Z, count, torch.randint(0, Z, (C,), generator=g))
    mods = []
    for backend in ("eager", "triton"):
        m = das_type(C, d, seed=0, backend=backend, **kw).to(dev).train(spec["training"])
        for buf, value in zip((m.frm, m.bank, m.bank_ptr, m.bank_count), (frm, bank, ptr, count)):
            buf.copy_(value)
        mods.append(m)
    batches = [check_batch(spec, g, step) for step in range(2)]
    emb_dtype = DTYPES[spec["emb_dtype"]]
    tol = 2e-5 if emb_dtype in (torch.float32, torch.float64) else 2 * torch.finfo(emb_dtype).eps
    for step, (emb, lab) in enumerate(batches):
        (oe, le), (of, lf) = (m(emb, lab) for m in mods)   # emb requires grad, as a model's does
        for name in ("frm", "bank", "bank_ptr", "bank_count"):
            a, b = getattr(mods[0], name), getattr(mods[1], name)
            if not torch.equal(a, b):
                return False, f"step {step + 1}: {name} differs from the eager code's"
        if not torch.equal(mods[0].generator().get_state(), mods[1].generator().get_state()):
            return False, f"step {step + 1}: the generator drew more or fewer numbers than eager"
        if not torch.equal(le, lf) or oe.dtype != of.dtype or oe.shape != of.shape:
            return False, f"step {step + 1}: labels, output dtype or shape differ"
        err = (oe.float() - of.float()).abs().max().item() if oe.numel() else 0.0
        if not err <= tol:
            return False, f"step {step + 1}: outputs differ by {err:.3g} (> {tol:.1g})"
    return True, ""


def run_isolated(spec: dict[str, Any]) -> tuple[bool, str]:
    """`run_spec` in a child process on the same device; a fault there stays there."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    try:
        proc = subprocess.run([sys.executable, "-m", "training.das_check", json.dumps(spec)],
                              capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"the check process took over {TIMEOUT_S} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        res = json.loads(lines[-1])
        return bool(res["ok"]), str(res["reason"])
    err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return False, f"the check process exited with status {proc.returncode}: {err[:300]}"


def verdict(das, emb: Tensor, y: Tensor, key: tuple | None = None,
            isolate: bool | None = None) -> tuple[bool, str]:
    """(use the kernels, why not) for this variant; cached per process. Never raises."""
    key = variant_key(das, emb, y) if key is None else key
    if key in VERDICTS:
        return VERDICTS[key]
    spec = spec_of(das, emb, y)
    isolate = emb.device.type == "cuda" if isolate is None else isolate
    try:
        res = run_isolated(spec) if isolate else run_spec(spec, type(das))
    except Exception as e:  # a kernel that fails to compile must not stop a training run
        res = (False, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
    VERDICTS[key] = res
    return res


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    v: Tensor
    y: Tensor
    out: Tensor
    lab: Tensor


class FusedBackend:
    """The fused path of one DAS module: verdicts per kernel variant, CUDA graphs per batch
    layout; the module is handed in on every call (no back-reference to go stale on a copy)."""

    def __init__(self) -> None:
        self.verdicts: dict[tuple, bool] = {}     # auto: self-check verdict per kernel variant
        self.graphs: dict[tuple, _Captured] = {}  # graph=True: one capture per batch layout

    def wanted(self, das, emb: Tensor, y: Tensor) -> bool:
        """The auto backend's choice for this batch's variant, checked on first sight: a pass is
        said on stderr, a failure warns once and keeps the eager code for that variant."""
        if not candidate(emb.device):
            return False
        key = variant_key(das, emb, y)
        ok = self.verdicts.get(key)
        if ok is None:
            ok, reason = verdict(das, emb, y, key)
            self.verdicts[key] = ok
            if ok:
                # tqdm.write: a training epoch's progress bar is on stderr too, and a plain print
                # would land on the bar's line (seen on an H200: the log's line then began with
                # the bar, and gpu_check did not find it)
                from tqdm import tqdm

                tqdm.write(f"DAS: fused Triton kernels in use ({describe(key)}; self-check passed)",
                           file=sys.stderr)
            else:
                warnings.warn(f"DAS: the fused Triton kernels are not used for {describe(key)} "
                              f"({reason}); running the eager tensor code instead", RuntimeWarning,
                              stacklevel=4)
        return ok

    @staticmethod
    def update(das, v: Tensor, y: Tensor) -> None:
        """The FRM and bank update of one batch in one launch (labels range-checked there)."""
        from . import das_triton

        das_triton.fused_update(v, y, das.frm, das.bank, das.bank_ptr, das.bank_count,
                                das.hash_weights, topk=das.topk, dfs=das.dfs, mts=das.mts,
                                interpret=v.device.type != "cuda")

    def call(self, das, v: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """The whole call, replayed from the layout's CUDA graph when ``das.graph`` (on CUDA)."""
        if das.graph and v.device.type == "cuda":
            return self.graph(das, v, y)
        return self.call_direct(das, v, y)

    def call_direct(self, das, v: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """The whole call in three launches: update (training), one draw, produce; ``v`` is
        read in its own dtype and strides and never gets a gradient."""
        from . import das_triton

        T, B = das.num_produce, v.shape[0]
        if das.training:
            self.update(das, v, y)
        out = torch.empty(((T + 1) * B, das.dim), dtype=v.dtype, device=v.device)
        lab = torch.empty((T + 1) * B, dtype=y.dtype, device=v.device)
        r = das.draw(T, B, das.generator(), v.device)
        das_triton.fused_produce(
            v, y, das.frm, das.bank, das.bank_count, r, out, lab, topk=das.topk,
            dfs=das.dfs, mts=das.mts, bounds=das.factor_bounds(), shift=das.shift_scale,
            normalize=das.normalize, check_labels=not das.training,
            interpret=v.device.type != "cuda")
        return out, lab

    def graph(self, das, v: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """The fused call through the module's graph for this layout (captured on first use)."""
        key = (v.shape, v.dtype, v.stride(), y.dtype, y.stride(), das.training, v.device)
        cap = self.graphs.get(key)
        if cap is None:
            try:
                with torch.cuda.device(v.device):
                    cap = self._capture(das, v, y)
            except Exception as e:   # e.g. a torch without register_generator_state
                das.graph = False
                warnings.warn(f"DAS: CUDA-graph capture failed ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0][:200]}); running the fused "
                              "kernels without a graph", RuntimeWarning, stacklevel=4)
                return self.call_direct(das, v, y)
            self.graphs[key] = cap
        cap.v.copy_(v)
        cap.y.copy_(y)
        cap.graph.replay()
        return cap.out.detach(), cap.lab.detach()

    def _capture(self, das, v: Tensor, y: Tensor) -> _Captured:
        dev = v.device
        sv = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=dev).copy_(v)
        sy = torch.empty_strided(y.shape, y.stride(), dtype=y.dtype, device=dev).copy_(y)
        tensors = (das.frm, das.bank, das.bank_ptr, das.bank_count)
        state = [t.clone() for t in tensors]
        gen = das.generator()
        rng = gen.get_state() if gen is not None else torch.cuda.get_rng_state(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):   # warm-up: compiles and loads the kernels before capture
            self.call_direct(das, sv, sy)
        torch.cuda.current_stream(dev).wait_stream(side)
        try:
            graph = torch.cuda.CUDAGraph()
            if gen is not None:
                graph.register_generator_state(gen)
            with torch.cuda.graph(graph):
                out, lab = self.call_direct(das, sv, sy)
        finally:                        # the warm-up's writes and draws are undone
            for t, saved in zip(tensors, state):
                t.copy_(saved)
            if gen is not None:
                gen.set_state(rng)
            else:
                torch.cuda.set_rng_state(rng, dev)
        return _Captured(graph, sv, sy, out, lab)
