"""DAS's training step as five fused Triton kernels, for CUDA.

Why hand-written: on a GPU the eager module (training/das.py) is launch-bound. One call is ~134
tiny kernels whose GPU time sums to ~0.46 ms (H200, C = 98, d = 512, B = 112), so neither
CUDA-graph capture nor torch.compile of the same graph gets far below 0.5 ms. These kernels do
the same arithmetic in five launches (plus torch's own random draws, so the random stream is
the eager module's):

1. ``frm_hash``: per real row, +1 on the FRM cells of its signed top-K channels (atomics) and
   the exact row hash used to drop zero differences (same odd multipliers, wrapping int64);
2. ``pair_count``: per row, how many valid ordered pairs (same class, different bits) it heads;
3. ``bank_write``: per row, the ring slot of each of its pairs: its rank in the class's
   row-major pair order is the sum of the counts of earlier rows of the class plus the valid
   pairs before it in its own row; the last Z of the class are written, as in the spec;
4. ``ptr_count``: the first member of each class advances its ring pointer and fill count;
5. ``produce``: per (copy, row), the mask (top-K of the class's FRM row), ``s * v + r_b * t``
   and the re-normalisation, written straight into the output.

Kernels 2-4 are separate launches because each needs the previous one finished for the whole
batch (there is no grid-wide barrier inside a kernel). Ties in a top-K go to the lowest
channel; torch.topk leaves tie order unspecified, so outputs match the eager module exactly
whenever the top-K has no tie at its boundary, and the produce step's norm may differ from
torch's in the last bit (different summation order).

The same kernel bodies run on CPU tensors under Triton's interpreter (``interpret=True``):
slow, but it is how the CPU test suite checks them against the eager module.
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
def _frm_hash(v, y, frm, w, h, D, K: constexpr, BLOCK_D: constexpr,
              DFS: constexpr, MTS: constexpr):
    i = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    x = tl.load(v + i * D + offs, mask=m, other=0.0)
    c = tl.load(y + i)
    if DFS:
        row = tl.where(m, x, float("-inf"))
        for _ in tl.static_range(K):
            a = tl.argmax(row, axis=0, tie_break_left=True)
            tl.atomic_add(frm + c * D + a, 1.0)
            row = tl.where(offs == a, float("-inf"), row)
    if MTS:
        bits = (x + 0.0).to(tl.int32, bitcast=True).to(tl.int64)   # +0.0 folds -0.0 into 0.0
        wv = tl.load(w + offs, mask=m, other=0)
        tl.store(h + i, tl.sum(bits * wv, axis=0))


def _pair_count(y, h, cnt, B, BLOCK_B: constexpr):
    i = tl.program_id(0)
    offs = tl.arange(0, BLOCK_B)
    m = offs < B
    yj = tl.load(y + offs, mask=m, other=-1)
    hj = tl.load(h + offs, mask=m, other=0)
    valid = m & (yj == tl.load(y + i)) & (hj != tl.load(h + i))
    tl.store(cnt + i, tl.sum(valid.to(tl.int64), axis=0))


def _bank_write(v, y, h, cnt, ptr, bank, B, D, Z, BLOCK_B: constexpr,
                BLOCK_D: constexpr):
    i = tl.program_id(0)
    offs = tl.arange(0, BLOCK_B)
    m = offs < B
    c = tl.load(y + i)
    hi = tl.load(h + i)
    yj = tl.load(y + offs, mask=m, other=-1)
    cj = tl.load(cnt + offs, mask=m, other=0)
    same = m & (yj == c)
    first = tl.sum(tl.where(same & (offs < i), cj, 0), axis=0)     # pairs of earlier rows
    total = tl.sum(tl.where(same, cj, 0), axis=0)                  # pairs of the class
    keep_from = total - tl.minimum(total, Z)                       # the last Z are kept
    p0 = tl.load(ptr + c)
    od = tl.arange(0, BLOCK_D)
    md = od < D
    xi = tl.load(v + i * D + od, mask=md, other=0.0)
    run = first
    for j in range(0, B):
        ok = (tl.load(y + j) == c) & (tl.load(h + j) != hi)
        write = ok & (run >= keep_from)
        xj = tl.load(v + j * D + od, mask=md & write, other=0.0)
        slot = (p0 + run) % Z
        tl.store(bank + (c * Z + slot) * D + od, (xi - xj).to(bank.dtype.element_ty),
                 mask=md & write)
        run += ok.to(tl.int64)


def _ptr_count(y, cnt, ptr, count, B, Z, BLOCK_B: constexpr):
    i = tl.program_id(0)
    offs = tl.arange(0, BLOCK_B)
    m = offs < B
    c = tl.load(y + i)
    yj = tl.load(y + offs, mask=m, other=-1)
    same = m & (yj == c)
    is_first = tl.sum((same & (offs < i)).to(tl.int32), axis=0) == 0
    total = tl.sum(tl.where(same, tl.load(cnt + offs, mask=m, other=0), 0), axis=0)
    p = tl.load(ptr + c)
    n = tl.load(count + c)
    tl.store(ptr + c, (p + total) % Z, mask=is_first)
    tl.store(count + c, tl.minimum(n + total, Z), mask=is_first)


def _produce(v, y, frm, bank, count, gamma, u, out, B, D, Z, shift,
             K: constexpr, BLOCK_D: constexpr, DFS: constexpr,
             MTS: constexpr, NORMALIZE: constexpr):
    t = tl.program_id(0)
    i = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    c = tl.load(y + i)
    x = tl.load(v + i * D + offs, mask=m, other=0.0)
    res = x
    tv = x * 0.0
    fac = 0.0
    if MTS:
        n = tl.load(count + c)
        slot = tl.minimum((tl.load(u + t * B + i) * n.to(tl.float32)).to(tl.int64), Z - 1)
        fac = tl.where(n > 0, shift, 0.0)
        tv = tl.load(bank + (c * Z + slot) * D + offs, mask=m, other=0.0).to(tl.float32)
        res = x + tv * fac
    if DFS:
        row = tl.where(m, tl.load(frm + c * D + offs, mask=m, other=0.0), float("-inf"))
        for k in tl.static_range(K):
            a = tl.argmax(row, axis=0, tie_break_left=True)
            hit = offs == a
            scaled = tl.sum(tl.where(hit, x, 0.0), axis=0) * tl.load(gamma + (t * B + i) * K + k)
            if MTS:
                scaled = scaled + tl.sum(tl.where(hit, tv, 0.0), axis=0) * fac
            res = tl.where(hit, scaled, res)
            row = tl.where(hit, float("-inf"), row)
    if NORMALIZE:
        norm = tl.sqrt(tl.sum(tl.where(m, res * res, 0.0), axis=0))
        res = res / tl.maximum(norm, 1e-12)
    tl.store(out + (t * B + i) * D + offs, res.to(out.dtype.element_ty), mask=m)


_BODIES = {"frm_hash": _frm_hash, "pair_count": _pair_count, "bank_write": _bank_write,
           "ptr_count": _ptr_count, "produce": _produce}


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


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# ------------------------------------------------------------------------------ launchers
def fused_update(v: Tensor, y: Tensor, frm: Tensor, bank: Tensor, ptr: Tensor, count: Tensor,
                 hash_weights: Tensor, *, topk: int, dfs: bool, mts: bool,
                 interpret: bool = False) -> None:
    """FRM and bank update of one batch, in place (the eager ``das_bank.update_frm`` +
    ``update_bank``). ``v`` (B, d) float32 contiguous, ``y`` (B,) int64 on the same device."""
    B, D = v.shape
    if B == 0 or not (dfs or mts):
        return
    k = _kernels(interpret)
    BD, BB = _pow2(D), _pow2(B)
    h = torch.empty(B, dtype=torch.long, device=v.device)
    k.frm_hash[(B,)](v, y, frm, hash_weights, h, D, K=topk, BLOCK_D=BD, DFS=dfs, MTS=mts)
    if not mts or B < 2:
        return
    Z = bank.shape[1]
    cnt = torch.empty(B, dtype=torch.long, device=v.device)
    k.pair_count[(B,)](y, h, cnt, B, BLOCK_B=BB)
    k.bank_write[(B,)](v, y, h, cnt, ptr, bank, B, D, Z, BLOCK_B=BB, BLOCK_D=BD)
    k.ptr_count[(B,)](y, cnt, ptr, count, B, Z, BLOCK_B=BB)


def fused_produce(base: Tensor, y: Tensor, frm: Tensor, bank: Tensor, count: Tensor,
                  gamma: Tensor | None, u: Tensor | None, out: Tensor, *, shift: float,
                  topk: int, normalize: bool, interpret: bool = False) -> None:
    """Write the T copies of ``base`` (B, d float32) into ``out`` (T, B, d, any float dtype).

    ``gamma`` (T, B, K) are the DFS factors (None: no DFS) and ``u`` (T, B) the uniforms that
    pick a bank slot (None: no MTS), drawn by the caller from the module's generator."""
    T, B, D = out.shape
    if T == 0 or B == 0:
        return
    dfs, mts = gamma is not None, u is not None
    dummy = base  # never read when its feature is off
    _kernels(interpret).produce[(T, B)](
        base, y, frm, bank, count, gamma if dfs else dummy, u if mts else dummy, out,
        B, D, bank.shape[1], float(shift), K=topk, BLOCK_D=_pow2(D), DFS=dfs, MTS=mts,
        NORMALIZE=normalize)
