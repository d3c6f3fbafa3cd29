"""DAS's state updates (the write side): the frequency-recorded matrix (FRM) and the bank ring,
as pure tensor functions writing a `training.das.DAS` module's buffers in place; the fused
Triton kernels (training/das_triton.py) replace them on CUDA.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["max_kept_pairs", "row_hash", "update_frm", "update_bank"]


@functools.lru_cache(maxsize=256)
def max_kept_pairs(batch: int, bank_size: int) -> int:
    """Static upper bound on the differences one batch can leave in the banks (a class of n
    brings n(n-1) pairs, at most Z survive), so the write path has no data-dependent shapes."""
    if batch < 2:
        return 0
    per_member = max(min(n * (n - 1), bank_size) / n for n in range(2, batch + 1))
    return min(batch * (batch - 1), math.ceil(batch * per_member))


@torch.no_grad()
def update_frm(frm: Tensor, v: Tensor, y: Tensor, topk: int) -> None:
    """Eq. (frm): each real embedding adds 1 to P[y, c] for its top-K channels (signed), in one
    accumulating index_put_ (repeated cells add up, as the spec's loop does)."""
    idx = v.topk(topk, dim=1).indices                                # (B, K)
    one = torch.ones((), device=v.device, dtype=frm.dtype)
    frm.index_put_((y[:, None], idx), one, accumulate=True)


def row_hash(v: Tensor, weights: Tensor) -> Tensor:
    """(B,) int64 key equal for bit-identical rows: a hash of the float bits with odd multipliers
    ``weights`` (wrapping; collisions ~2**-63), cheaper and exacter than a pairwise difference."""
    bits = (v + 0.0).view(torch.int32)                               # +0.0 folds -0.0 into 0.0
    return (bits * weights).sum(dim=1)


@torch.no_grad()
def update_bank(bank: Tensor, bank_ptr: Tensor, bank_count: Tensor, hash_weights: Tensor,
                v: Tensor, y: Tensor) -> None:
    """Eq. (transformation)+(fifo), vectorised with static shapes (no nonzero(), no host sync).

    1. Stable-sort the batch by label: each class is a contiguous diagonal block of the (B, B)
       pair grid, whose row-major order is the spec's write order.
    2. ``valid`` = same label, different row hash; one cumsum numbers the valid pairs, class c
       getting ``[P_c, E_c)``, of which the last ``min(E_c - P_c, Z)`` are kept.
    3. Entry ``r`` of a static list of ``L = max_kept_pairs(B, Z)`` finds its class and pair
       number by searchsorted over the kept counts, and its grid cell by searchsorted in the
       cumsum: no B x B scatter, only L rows of differences.
    4. One index_put_ writes the L rows; surplus entries repeat entry 0 (deterministic), and
       with nothing kept bank row 0 is restored afterwards.
    """
    B, Z, dim = v.shape[0], bank.shape[1], bank.shape[2]
    if B < 2:
        return
    device = v.device
    ys, perm = torch.sort(y, stable=True)
    hs = row_hash(v, hash_weights).index_select(0, perm)
    valid = (ys[:, None] == ys[None, :]) & (hs[:, None] != hs[None, :])
    cs = valid.view(-1).cumsum(0)                                      # pair numbers + 1
    cum = F.pad(cs.view(B, B)[:, -1], (1, 0))                          # pairs in rows < p
    first = cum.index_select(0, torch.searchsorted(ys, ys))            # P_c per member
    end = cum.index_select(0, torch.searchsorted(ys, ys, right=True))  # E_c per member
    total = end - first                                                # pairs of the class
    kept = torch.clamp(total, max=Z)
    # Running kept counts, each class credited once (at its first member in sorted
    # order), so `run` is the same for every member of a class.
    is_first = F.pad(ys[1:] != ys[:-1], (1, 0), value=True)
    run = torch.where(is_first, kept, 0).cumsum(0)
    ptr = bank_ptr.index_select(0, ys)
    # Per member: [start of its class in the kept numbering, number (+1) of its first
    # kept pair, ring slot of its first kept pair (unreduced), class * Z].
    table = torch.stack([run - kept, end - kept + 1, ptr + total - kept, ys * Z])
    L = max_kept_pairs(B, Z)
    r = torch.arange(L, device=device)
    r = torch.where(r < run[-1:], r, 0)                                # fillers = entry 0
    owner = torch.searchsorted(run, r, right=True).clamp_(max=B - 1)
    start, num1, slot0, cls_z = table.index_select(1, owner).unbind(0)
    off = r - start                                                    # 0..k_c-1
    pos = torch.searchsorted(cs, num1 + off).clamp_(max=B * B - 1)     # grid cell
    any_kept = run[-1:] > 0
    target = torch.where(any_kept, cls_z + (slot0 + off) % Z, 0)
    i = perm.index_select(0, torch.div(pos, B, rounding_mode="floor"))
    j = perm.index_select(0, pos % B)
    # (L, d) rows v_i - v_j, the second gather subtracted in place. (An embedding_bag with
    # weights +1/-1 is one pass, but 0 + (-0.0) turns some zeros' sign.)
    diff = v.index_select(0, i).sub_(v.index_select(0, j))
    flat_bank = bank.view(-1, dim)
    row0 = flat_bank[:1].clone()
    flat_bank.index_put_((target,), diff.to(flat_bank.dtype))
    flat_bank[:1] = torch.where(any_kept[:, None], flat_bank[:1], row0)
    # Pointer and fill count advance by the class total (members of a class agree).
    bank_ptr.index_put_((ys,), (ptr + total) % Z)
    count = torch.clamp(bank_count.index_select(0, ys) + total, max=Z)
    bank_count.index_put_((ys,), count)
