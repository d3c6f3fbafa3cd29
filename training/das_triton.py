"""DAS's training step as two fused Triton kernels, for CUDA: the eager module (training/das.py)
is launch-bound on a GPU (~134 tiny kernels, ~0.46 ms on an H200), beyond what CUDA graphs or
torch.compile recover. One call is three launches: ``update`` (a program per real row, skipped in
eval: the label check; DFS +1s by atomics; MTS done for a whole class by its first member, so no
grid-wide barrier), one ``torch.rand`` of all uniforms (the eager module's random stream), and
``produce`` (a program per (plane, row): plane 0 copies the real rows, plane t >= 1 is copy t).

Inputs are read through their strides and dtypes (no conversion copy). Top-K ties go to the
lowest channel (torch leaves them unspecified), so outputs match the eager module exactly when
the top-K has no boundary tie (norms to the last bit). On CPU the bodies run in Triton's
interpreter; every launch goes through `_launch`, which tests wrap to count launches.
"""

import functools
from types import SimpleNamespace

import torch
from torch import Tensor

try:  # triton ships with the CUDA build of torch; absent on some CPU-only installs
    import triton
    import triton.language as tl
    constexpr = tl.constexpr
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = tl = None
    constexpr = int  # only so that the kernel signatures below still parse

__all__ = ["available", "fused_update", "fused_produce"]


def available(device: torch.device) -> bool:
    """Whether the fused kernels can run natively on ``device`` (CUDA with Triton)."""
    return triton is not None and device.type == "cuda"


# ------------------------------------------------------------------------------ kernel bodies
def _update(v, sv0, sv1, y, sy, frm, w, bank, ptr, count, B, D, C, Z,
            K: constexpr, BLOCK_D: constexpr, BLOCK_B: constexpr,
            DFS: constexpr, MTS: constexpr):
    i = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    c = tl.load(y + i * sy).to(tl.int64)
    ob = tl.arange(0, BLOCK_B)
    mb = ob < B
    yv = tl.load(y + ob * sy, mask=mb, other=0).to(tl.int64)
    # every program checks the whole batch before writing: a bad label changes no state.
    # (Compiled in by _launch's debug=True; Triton's CPU interpreter skips it: the module
    # checks labels on the host there.)
    tl.device_assert((yv >= 0) & (yv < C), "DAS labels out of [0, num_classes)")
    if DFS:
        x = tl.load(v + i * sv0 + offs * sv1, mask=m, other=0.0).to(tl.float32)
        row = tl.where(m, x, float("-inf"))
        for _ in tl.static_range(K):
            a = tl.argmax(row, axis=0, tie_break_left=True)
            tl.atomic_add(frm + c * D + a, 1.0)
            row = tl.where(offs == a, float("-inf"), row)
    if MTS:
        same = mb & (yv == c)
        if tl.sum((same & (ob < i)).to(tl.int32), axis=0) == 0:   # first member: the class
            wv = tl.load(w + offs, mask=m, other=0)
            hs = tl.zeros([BLOCK_B], dtype=tl.int64)
            j = i
            while j < B:                                           # member hashes
                xj = tl.load(v + j * sv0 + offs * sv1, mask=m, other=0.0).to(tl.float32)
                bits = (xj + 0.0).to(tl.int32, bitcast=True).to(tl.int64)  # +0.0: -0.0 -> 0.0
                hs = tl.where(ob == j, tl.sum(bits * wv, axis=0), hs)
                j = tl.min(tl.where(same & (ob > j), ob, B), axis=0)   # next member, or B
            total = tl.zeros([], dtype=tl.int64)
            j = i
            while j < B:                                           # valid pairs of the class
                hj = tl.sum(tl.where(ob == j, hs, 0), axis=0)
                total += tl.sum((same & (hs != hj)).to(tl.int64), axis=0)
                j = tl.min(tl.where(same & (ob > j), ob, B), axis=0)
            keep_from = total - tl.minimum(total, Z)               # the last Z are kept
            p0 = tl.load(ptr + c)
            run = tl.zeros([], dtype=tl.int64)                     # pair number, row-major
            a = i
            while a < B:
                ha = tl.sum(tl.where(ob == a, hs, 0), axis=0)
                cnt = tl.sum((same & (hs != ha)).to(tl.int64), axis=0)
                if run + cnt > keep_from:                          # some of its pairs are kept
                    xa = tl.load(v + a * sv0 + offs * sv1, mask=m, other=0.0).to(tl.float32)
                    b = i
                    while b < B:
                        hb = tl.sum(tl.where(ob == b, hs, 0), axis=0)
                        if hb != ha:
                            if run >= keep_from:
                                xb = tl.load(v + b * sv0 + offs * sv1, mask=m,
                                             other=0.0).to(tl.float32)
                                slot = (p0 + run) % Z
                                tl.store(bank + (c * Z + slot) * D + offs,
                                         (xa - xb).to(bank.dtype.element_ty), mask=m)
                            run += 1
                        b = tl.min(tl.where(same & (ob > b), ob, B), axis=0)
                else:
                    run += cnt
                a = tl.min(tl.where(same & (ob > a), ob, B), axis=0)
            tl.store(ptr + c, (p0 + total) % Z)
            tl.store(count + c, tl.minimum(tl.load(count + c) + total, Z))


def _produce(v, sv0, sv1, y, sy, frm, bank, count, r, out, lab, B, D, Z, C, u_off,
             lo, span, shift, K: constexpr, BLOCK_D: constexpr, DFS: constexpr,
             MTS: constexpr, NORMALIZE: constexpr, CHECK: constexpr):
    p = tl.program_id(0)           # plane: 0 = the real rows, t + 1 = copy t
    i = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    yi = tl.load(y + i * sy)
    c = yi.to(tl.int64)
    if CHECK:                      # eval mode: no update kernel checked the labels
        tl.device_assert((c >= 0) & (c < C), "DAS labels out of [0, num_classes)")
    tl.store(lab + p * B + i, yi.to(lab.dtype.element_ty))
    xr = tl.load(v + i * sv0 + offs * sv1, mask=m, other=0.0)
    if p == 0:
        tl.store(out + i * D + offs, xr.to(out.dtype.element_ty), mask=m)
    else:
        t = p - 1
        x = xr.to(tl.float32)
        res = x
        tv = x * 0.0
        fac = 0.0
        if MTS:
            n = tl.load(count + c)
            u = tl.load(r + u_off + t * B + i)
            slot = tl.minimum((u * n.to(tl.float32)).to(tl.int64), Z - 1)
            fac = tl.where(n > 0, shift, 0.0)
            tv = tl.load(bank + (c * Z + slot) * D + offs, mask=m, other=0.0).to(tl.float32)
            res = x + tv * fac
        if DFS:
            row = tl.where(m, tl.load(frm + c * D + offs, mask=m, other=0.0), float("-inf"))
            for k in tl.static_range(K):
                a = tl.argmax(row, axis=0, tie_break_left=True)
                hit = offs == a
                gamma = lo + span * tl.load(r + (t * B + i) * K + k)
                scaled = tl.sum(tl.where(hit, x, 0.0), axis=0) * gamma
                if MTS:
                    scaled = scaled + tl.sum(tl.where(hit, tv, 0.0), axis=0) * fac
                res = tl.where(hit, scaled, res)
                row = tl.where(hit, float("-inf"), row)
        if NORMALIZE:
            norm = tl.sqrt(tl.sum(tl.where(m, res * res, 0.0), axis=0))
            res = res / tl.maximum(norm, 1e-12)
        tl.store(out + (p * B + i) * D + offs, res.to(out.dtype.element_ty), mask=m)


_BODIES = {"update": _update, "produce": _produce}


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> SimpleNamespace:
    if triton is None:
        raise RuntimeError("the fused DAS kernels need triton (it ships with torch's CUDA build)")
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(tl.argmax, InterpretedFunction):
            raise RuntimeError("the fused DAS kernels on CPU run in Triton's interpreter, which "
                               "must be on before triton is first imported: set "
                               "TRITON_INTERPRET=1 in the environment")
        return SimpleNamespace(**{k: InterpretedFunction(f) for k, f in _BODIES.items()})
    return SimpleNamespace(**{k: triton.jit(f) for k, f in _BODIES.items()})


def pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _launch(kernel, grid: tuple[int, ...], device: torch.device, *args, **meta) -> None:
    """The one place a kernel is launched: under the tensors' own CUDA device, device-side asserts
    on (the label check), overflow sanitising off (the row hash wraps on purpose)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[grid](*args, **meta, debug=True, sanitize_overflow=False)
    else:
        kernel[grid](*args, **meta)


# ------------------------------------------------------------------------------ launchers
def fused_update(v: Tensor, y: Tensor, frm: Tensor, bank: Tensor, ptr: Tensor, count: Tensor,
                 hash_weights: Tensor, *, topk: int, dfs: bool, mts: bool,
                 interpret: bool = False) -> None:
    """FRM and bank update of one batch in place (eager ``update_frm`` + ``update_bank``), one
    launch; ``v`` (B, d) float, ``y`` (B,) integer, any strides; bad labels fail the assert."""
    B, D = v.shape
    if B == 0:
        return
    _launch(_kernels(interpret).update, (B,), v.device,
            v, v.stride(0), v.stride(1), y, y.stride(0), frm, hash_weights, bank, ptr, count,
            B, D, frm.shape[0], bank.shape[1], K=topk, BLOCK_D=pow2(D), BLOCK_B=pow2(B),
            DFS=dfs, MTS=mts and B >= 2)


def fused_produce(base: Tensor, y: Tensor, frm: Tensor, bank: Tensor, count: Tensor,
                  r: Tensor | None, out: Tensor, lab: Tensor, *, topk: int, dfs: bool, mts: bool,
                  bounds: tuple[float, float], shift: float, normalize: bool,
                  check_labels: bool, interpret: bool = False) -> None:
    """Write ``cat([base, copies])`` into ``out`` ((T+1)B, d, any float dtype) and ``cat([y] *
    (T+1))`` into ``lab`` in one launch; ``r``: the call's uniforms (``T*B*K`` DFS factors, then
    ``T*B`` bank-slot draws), in the eager module's order."""
    B, D = base.shape
    planes = out.shape[0] // max(B, 1)
    if B == 0 or planes == 0:
        return
    T = planes - 1
    lo, hi = bounds
    _launch(_kernels(interpret).produce, (planes, B), base.device,
            base, base.stride(0), base.stride(1), y, y.stride(0), frm, bank, count,
            base if r is None else r, out, lab, B, D, bank.shape[1], frm.shape[0],
            T * B * topk if dfs else 0, float(lo), float(hi) - float(lo), float(shift),
            K=topk, BLOCK_D=pow2(D), DFS=dfs and T > 0, MTS=mts and T > 0,
            NORMALIZE=normalize, CHECK=check_labels)
