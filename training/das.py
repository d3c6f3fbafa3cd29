"""Densely-Anchored Sampling (DAS, ECCV 2022): DFS + MTS as one plug-in module.

`emb, lab = das(emb, lab)` sits between the embedder and any miner/loss. It follows
docs/das-spec.md (the authors' code where the paper is vague):

* order: FRM update, bank update, then T copies per real embedding;
* DFS: FRM ``P`` (C x d) counts each real embedding's signed top-K channels; a class's mask is
  the top-K of its FRM row; masked channels get an independent factor U[1-r_s, 1+r_s] per copy
  (or U[lo, hi] with ``scale_bounds``), all others 1;
* MTS: a per-class FIFO ring (C x Z x d) of intra-class differences ``v_i - v_j`` (ordered
  pairs i != j, row-major batch order, zero differences dropped, the last Z kept); a copy is
  shifted by ``r_b * t`` with ``t`` a uniformly drawn filled slot of its class (0 while empty);
* produce: ``v' = s * v + b``, re-normalised when ``normalize``.

Everything is batched tensor code with no host synchronisation, so the step is cheap on CPU
and does not stall a CUDA stream. State (FRM, bank, pointers, counts) lives in buffers so that
``state_dict()`` and ``.to(device)`` carry it; the seeded generator's state travels as the
module's extra state so that a resumed run draws the same numbers.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["DAS"]


@functools.lru_cache(maxsize=256)
def _max_kept_pairs(batch: int, bank_size: int) -> int:
    """Static upper bound on the differences one batch can leave in the banks.

    A class with n members brings n(n-1) ordered pairs of which at most Z survive, i.e.
    min(n(n-1), Z)/n per member; the worst class size over the whole batch bounds the total.
    A static bound keeps the write path free of data-dependent shapes (no nonzero(), no sync).
    """
    if batch < 2:
        return 0
    per_member = max(min(n * (n - 1), bank_size) / n for n in range(2, batch + 1))
    return min(batch * (batch - 1), math.ceil(batch * per_member))


class DAS(nn.Module):
    """Produce T embeddings per real one (DFS scaling + MTS shifting); see module docstring."""

    frm: Tensor
    bank: Tensor
    bank_ptr: Tensor
    bank_count: Tensor
    _hash_weights: Tensor

    def __init__(self, num_classes: int, dim: int, *, num_produce: int = 3, topk: int = 4,
                 bank_size: int = 10, scale_range: float = 0.01, shift_scale: float = 0.01,
                 scale_bounds: tuple[float, float] | None = None, normalize: bool = True,
                 detach: bool = True, dfs: bool = True, mts: bool = True,
                 bank_dtype: torch.dtype = torch.float32, seed: int | None = None) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes={num_classes}: expected >= 1")
        if dim < 1:
            raise ValueError(f"dim={dim}: expected >= 1")
        if num_produce < 0:
            raise ValueError(f"num_produce={num_produce}: expected >= 0")
        if not 1 <= topk <= dim:
            raise ValueError(f"topk={topk}: expected 1 <= topk <= dim={dim}")
        if bank_size < 1:
            raise ValueError(f"bank_size={bank_size}: expected >= 1")
        if scale_bounds is None and not 0.0 <= scale_range < 1.0:
            raise ValueError(f"scale_range={scale_range}: expected 0 <= r_s < 1")
        if scale_bounds is not None:
            lo, hi = (float(b) for b in scale_bounds)
            if not 0.0 < lo <= hi:
                raise ValueError(f"scale_bounds={scale_bounds}: expected 0 < low <= high")
        if shift_scale < 0:
            raise ValueError(f"shift_scale={shift_scale}: expected >= 0")
        if bank_dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise ValueError(f"bank_dtype={bank_dtype}: expected float32, float16 or bfloat16")
        self.num_classes, self.dim = int(num_classes), int(dim)
        self.num_produce, self.topk, self.bank_size = int(num_produce), int(topk), int(bank_size)
        self.scale_range, self.shift_scale = float(scale_range), float(shift_scale)
        self.scale_bounds = None if scale_bounds is None else (float(scale_bounds[0]),
                                                               float(scale_bounds[1]))
        self.normalize, self.detach, self.dfs, self.mts = normalize, detach, dfs, mts
        self.seed = seed
        # FRM counts are kept in float32: exact up to 2**24 per cell and topk-friendly on CUDA.
        self.register_buffer("frm", torch.zeros(num_classes, dim))
        self.register_buffer("bank", torch.zeros(num_classes, bank_size, dim, dtype=bank_dtype))
        self.register_buffer("bank_ptr", torch.zeros(num_classes, dtype=torch.long))
        self.register_buffer("bank_count", torch.zeros(num_classes, dtype=torch.long))
        # Fixed odd multipliers for an exact row-equality hash (see _equal_rows); not state.
        g = torch.Generator().manual_seed(0x5EED)
        w = torch.randint(1, 2**62, (dim,), generator=g, dtype=torch.long) | 1
        self.register_buffer("_hash_weights", w, persistent=False)
        self._generator: torch.Generator | None = None
        self._pending_rng: tuple[str, Tensor] | None = None

    # ------------------------------------------------------------------ randomness / state
    def _gen(self) -> torch.Generator | None:
        """The module's generator, on the buffers' device (re-created after `.to(device)`)."""
        if self.seed is None:
            return None  # global RNG: torch.manual_seed makes runs reproducible
        device = self.frm.device
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(int(self.seed))
            if self._pending_rng is not None and self._pending_rng[0] == device.type:
                self._generator.set_state(self._pending_rng[1])
            self._pending_rng = None
        return self._generator

    def get_extra_state(self) -> dict[str, Any]:
        """Generator state, so a checkpoint resumes the exact random stream."""
        gen = self._gen()
        if gen is None:
            return {}
        return {"device_type": gen.device.type, "rng_state": gen.get_state()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if not state:
            return
        # Restored lazily: the module may be moved to another device after loading.
        self._generator = None
        self._pending_rng = (str(state["device_type"]), state["rng_state"].cpu())

    def extra_repr(self) -> str:
        scale = (f"scale_bounds={self.scale_bounds}" if self.scale_bounds
                 else f"scale_range={self.scale_range}")
        return (f"num_classes={self.num_classes}, dim={self.dim}, T={self.num_produce}, "
                f"K={self.topk}, Z={self.bank_size}, {scale}, shift_scale={self.shift_scale}, "
                f"normalize={self.normalize}, detach={self.detach}, dfs={self.dfs}, "
                f"mts={self.mts}, bank_dtype={self.bank.dtype}")

    # ------------------------------------------------------------------ checks
    def _check(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        if embeddings.dim() != 2 or embeddings.shape[1] != self.dim:
            raise ValueError(f"embeddings: expected shape (B, {self.dim}), "
                             f"got {tuple(embeddings.shape)}")
        if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
            raise ValueError(f"labels: expected shape ({embeddings.shape[0]},), "
                             f"got {tuple(labels.shape)}")
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise ValueError(f"labels: expected an integer tensor, got {labels.dtype}")
        labels = labels.to(device=self.frm.device, dtype=torch.long)
        bad = (labels < 0) | (labels >= self.num_classes)
        if labels.device.type == "cpu":
            if bool(bad.any()):
                raise ValueError(f"labels: expected class ids in [0, {self.num_classes}), "
                                 f"got {labels[bad][:5].tolist()}")
        else:  # no host sync on accelerators: fails asynchronously instead
            torch._assert_async(~bad.any(), "DAS labels out of [0, num_classes)")
        return labels

    # ------------------------------------------------------------------ state updates
    @torch.no_grad()
    def _update_frm(self, v: Tensor, y: Tensor) -> None:
        """Eq. (frm): each real embedding adds 1 to P[y, c] for its top-K channels (signed)."""
        idx = v.topk(self.topk, dim=1).indices                       # (B, K)
        rows = y[:, None].expand_as(idx)
        self.frm.index_put_((rows, idx), torch.ones(idx.shape, device=v.device,
                                                    dtype=self.frm.dtype), accumulate=True)

    def _equal_rows(self, v: Tensor) -> Tensor:
        """(B, B) bool: rows that are bit-identical, i.e. whose difference is exactly zero.

        Hand-written because a Gram-matrix distance is not exact for duplicates and the dense
        B x B x d difference tensor costs more than the whole rest of the step. The hash of the
        float bits (odd random multipliers, wrapping int64 arithmetic) is equal for equal rows
        and collides for different rows with probability ~2**-63.
        """
        bits = (v + 0.0).view(torch.int32).to(torch.long)            # +0.0 folds -0.0 into 0.0
        h = (bits * self._hash_weights).sum(dim=1)
        return h[:, None] == h[None, :]

    @torch.no_grad()
    def _update_bank(self, v: Tensor, y: Tensor) -> None:
        """Eq. (transformation)+(fifo), vectorised; see the spec's MTS section."""
        B, Z = v.shape[0], self.bank_size
        if B < 2:
            return
        device = v.device
        ar = torch.arange(B, device=device)
        same = y[:, None] == y[None, :]
        valid = same & (ar[:, None] != ar[None, :]) & ~self._equal_rows(v)   # ordered pairs
        # Counts go through float32 matmuls (exact below 2**24; CUDA has no integer matmul).
        vf = valid.float()
        row_cnt = vf.sum(dim=1)                                            # pairs with i first
        earlier = (same & (ar[None, :] < ar[:, None])).float()            # same class, row i' < i
        before_row = (earlier @ row_cnt).long()                            # pairs of earlier rows
        total = (same.float() @ row_cnt).long()                            # pairs of the class
        vi = valid.long()
        rank = before_row[:, None] + vi.cumsum(dim=1) - vi                 # write order in class
        kept = valid & (rank >= (total - Z)[:, None])                      # the last Z survive
        ptr = self.bank_ptr.index_select(0, y)                             # (B,)
        slot = (ptr[:, None] + rank) % Z
        # Static-size selection of the kept pairs (their number is bounded, see _max_kept_pairs).
        L = _max_kept_pairs(B, Z)
        # Compaction without sorting: kept pair number r goes to position r; the rest land in a
        # dummy position L that is dropped. Positions past the kept ones hold pair 0 (filler).
        flat_kept = kept.reshape(-1)
        order = flat_kept.long().cumsum(0) - 1
        pos = torch.where(flat_kept, order, L)
        sel = torch.zeros(L + 1, dtype=torch.long, device=device)
        sel.scatter_(0, pos, torch.arange(B * B, device=device))
        sel = sel[:L]
        sel_kept = torch.arange(L, device=device) <= order[-1]
        i_sel, j_sel = sel // B, sel % B
        target = y.index_select(0, i_sel) * Z + slot.reshape(-1).index_select(0, sel)
        target = torch.where(sel_kept, target, 0)
        # Kept pairs have distinct targets and come first, so every filler entry can
        # repeat entry 0's write (same slot, same value: deterministic). When nothing is kept,
        # entry 0 writes slot 0's own value back (a no-op).
        src = torch.where(sel_kept, torch.arange(L, device=device), 0)
        target = target.index_select(0, src)
        flat_bank = self.bank.view(-1, self.dim)
        diff = (v.index_select(0, i_sel.index_select(0, src))
                - v.index_select(0, j_sel.index_select(0, src))).to(flat_bank.dtype)  # (L, d)
        value = torch.where(sel_kept[:1, None], diff, flat_bank[:1])
        flat_bank.index_put_((target,), value)
        # Pointer and fill count advance by the class total (rows of one class agree).
        self.bank_ptr.index_put_((y,), (ptr + total) % Z)
        count = torch.clamp(self.bank_count.index_select(0, y) + total, max=Z)
        self.bank_count.index_put_((y,), count)

    # ------------------------------------------------------------------ produce
    def _mask_index(self, y: Tensor) -> Tensor:
        """Eq. (mask): (B, K) channel ids of the K highest FRM counts of each anchor's class."""
        return self.frm.index_select(0, y).topk(self.topk, dim=1).indices

    def _gamma(self, shape: tuple[int, ...], gen: torch.Generator | None, device) -> Tensor:
        """Eq. (scaling_factors) on the masked channels: U[1-r_s, 1+r_s] (or U[lo, hi])."""
        lo, hi = (self.scale_bounds if self.scale_bounds is not None
                  else (1.0 - self.scale_range, 1.0 + self.scale_range))
        return lo + (hi - lo) * torch.rand(shape, generator=gen, device=device)

    def _shift_parts(self, y: Tensor, T: int, gen: torch.Generator | None
                     ) -> tuple[Tensor, Tensor]:
        """Eq. (shifting) as (t, factor): t (T, B, d) a uniformly drawn filled slot of each
        anchor's class, factor (1, B, 1) = r_b, or 0 while the class's bank is empty."""
        count = self.bank_count.index_select(0, y)                           # (B,)
        u = torch.rand(T, y.shape[0], generator=gen, device=y.device)
        slot = (u * count).long().clamp(max=self.bank_size - 1)            # floor(u * count)
        flat = (y[None, :] * self.bank_size + slot).reshape(-1)
        t = self.bank.view(-1, self.dim).index_select(0, flat).view(T, -1, self.dim).float()
        factor = (count > 0).float() * self.shift_scale
        return t, factor[None, :, None]

    def forward(self, embeddings: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Return ``cat([v, v'_1..v'_T])`` and ``cat([y] * (T+1))``.

        In training mode the FRM and the bank are updated from this batch first (spec order);
        in eval mode the copies come from the stored state without changing it.
        """
        y = self._check(embeddings, labels)
        T = self.num_produce
        if T == 0:
            return embeddings, labels
        # Statistics and the bank are built in float32 even under autocast (fp16 differences
        # of nearby embeddings lose most of their digits).
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            v_const = embeddings.detach().float()
            if self.training:
                if self.dfs:
                    self._update_frm(v_const, y)
                if self.mts:
                    self._update_bank(v_const, y)
            gen = self._gen()
            base = v_const if self.detach else embeddings.float()
            B = base.shape[0]
            # One fresh (T, B, d) copy, edited in place when no gradient flows (every step).
            inplace = not base.requires_grad
            produced = base.repeat(T, 1).view(T, B, self.dim)
            if self.dfs:
                # s * v touches only the K masked channels: gather, scale, scatter back.
                idx = self._mask_index(y)[None].expand(T, -1, -1)          # (T, B, K)
                gamma = self._gamma(tuple(idx.shape), gen, base.device)
                scaled = produced.gather(2, idx) * gamma
                produced = (produced.scatter_(2, idx, scaled) if inplace
                            else produced.scatter(2, idx, scaled))
            if self.mts:
                t, factor = self._shift_parts(y, T, gen)
                produced = (produced.addcmul_(t, factor) if inplace
                            else torch.addcmul(produced, t, factor))
            if self.normalize:
                produced = (produced.div_(produced.norm(dim=-1, keepdim=True).clamp_min(1e-12))
                            if inplace else F.normalize(produced, dim=-1))
            produced = produced.reshape(T * B, self.dim).to(embeddings.dtype)
        out = torch.cat([embeddings, produced], dim=0)
        return out, labels.repeat(T + 1)

    # ------------------------------------------------------------------ reporting
    def bank_nbytes(self) -> int:
        """Bytes held by the transformation bank (the dominant memory cost at SOP scale)."""
        return self.bank.numel() * self.bank.element_size()
