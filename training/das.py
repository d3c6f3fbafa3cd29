"""Densely-Anchored Sampling (DAS, ECCV 2022): DFS + MTS as one plug-in module.

`emb, lab = das(emb, lab)` sits between the embedder and any miner/loss, following
../shared/docs/das-spec.md (the authors' code where the paper is vague): FRM update, bank
update, then T copies per real embedding. DFS: FRM ``P`` (C x d) counts signed top-K channels;
a class's mask is the top-K of its row; masked channels get a factor U[1-r_s, 1+r_s] per copy.
MTS: a per-class FIFO ring (C x Z x d) of intra-class differences (ordered pairs, row-major,
zeros dropped, last Z kept); a copy is shifted by ``r_b * t`` with ``t`` a uniform filled slot.
Produce: ``v' = s * v + b``, re-normalised when ``normalize``.

Batched tensor code with no host sync. State lives in buffers (``state_dict()``, ``.to()``);
the generator's state is the module's extra state, so a resumed run draws the same numbers.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import BANK_DTYPES
from .das_bank import update_bank, update_frm
from .das_fused import FusedBackend

__all__ = ["DAS", "BACKENDS"]

#: ``auto``: the fused Triton kernels (training/das_triton.py) on CUDA once their self-check
#: passed for the batch's kernel variant (training/das_fused.py), this file's tensor code
#: elsewhere; ``eager``: this file's code everywhere; ``triton``: the kernels everywhere,
#: unchecked (on CPU through Triton's interpreter: slow, for tests).
BACKENDS = ("auto", "eager", "triton")


class _FusedCall(torch.autograd.Function):
    """The fused call as one autograd node: the real rows are copied into ``out[:B]`` by the
    produce kernel, so their gradient is routed back by hand (the copies are constants)."""

    @staticmethod
    def forward(ctx, embeddings: Tensor, labels: Tensor, das: "DAS"):
        out, lab = das.fused.call(das, embeddings.detach(), labels)
        ctx.mark_non_differentiable(lab)
        ctx.rows = embeddings.shape[0]
        return out, lab

    @staticmethod
    def backward(ctx, grad_out: Tensor, grad_lab: Tensor | None):
        return grad_out[:ctx.rows], None, None


class DAS(nn.Module):
    """Produce T embeddings per real one (DFS scaling + MTS shifting); see module docstring."""

    frm: Tensor
    bank: Tensor
    bank_ptr: Tensor
    bank_count: Tensor
    hash_weights: Tensor

    def __init__(self, num_classes: int, dim: int, *, num_produce: int = 3, topk: int = 4,
                 bank_size: int = 10, scale_range: float = 0.01, shift_scale: float = 0.01,
                 scale_bounds: tuple[float, float] | None = None, normalize: bool = True,
                 detach: bool = True, dfs: bool = True, mts: bool = True,
                 bank_dtype: torch.dtype = torch.float32, seed: int | None = None,
                 backend: str = "auto", graph: bool = False) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
        checks = {"num_classes": (num_classes, num_classes >= 1, ">= 1"), "dim": (dim, dim >= 1, ">= 1"),
                  "num_produce": (num_produce, num_produce >= 0, ">= 0"),
                  "topk": (topk, 1 <= topk <= dim, f"1 <= topk <= dim={dim}"),
                  "bank_size": (bank_size, bank_size >= 1, ">= 1"),
                  "scale_range": (scale_range, scale_bounds is not None or 0.0 <= scale_range < 1.0,
                                  "0 <= r_s < 1"),
                  "scale_bounds": (scale_bounds, scale_bounds is None or (
                      len(scale_bounds) == 2 and 0.0 < scale_bounds[0] <= scale_bounds[1]), "0 < low <= high"),
                  "shift_scale": (shift_scale, shift_scale >= 0, ">= 0")}
        for name, (value, ok, expected) in checks.items():
            if not ok:
                raise ValueError(f"{name}={value}: expected {expected}")
        if bank_dtype not in [getattr(torch, name) for name in BANK_DTYPES]:
            raise ValueError(f"bank_dtype={bank_dtype}: expected torch.{' | torch.'.join(BANK_DTYPES)}")
        self.num_classes, self.dim = int(num_classes), int(dim)
        self.num_produce, self.topk, self.bank_size = int(num_produce), int(topk), int(bank_size)
        self.scale_range, self.shift_scale = float(scale_range), float(shift_scale)
        self.scale_bounds = None if scale_bounds is None else tuple(float(b) for b in scale_bounds)
        self.normalize, self.detach, self.dfs, self.mts = normalize, detach, dfs, mts
        # graph: CUDA-graph replay of the fused call (training/das_fused.py); off by default
        self.seed, self.backend, self.graph = seed, backend, bool(graph)
        #: the fused path (kernels, their self-check verdicts, the CUDA graphs): DAS's seam
        self.fused = FusedBackend()
        # FRM counts are kept in float32: exact up to 2**24 per cell and topk-friendly on CUDA.
        self.register_buffer("frm", torch.zeros(num_classes, dim))
        self.register_buffer("bank", torch.zeros(num_classes, bank_size, dim, dtype=bank_dtype))
        self.register_buffer("bank_ptr", torch.zeros(num_classes, dtype=torch.long))
        self.register_buffer("bank_count", torch.zeros(num_classes, dtype=torch.long))
        # Fixed odd multipliers for das_bank.row_hash (exact row equality); not state.
        g = torch.Generator().manual_seed(0x5EED)
        w = torch.randint(1, 2**62, (dim,), generator=g, dtype=torch.long) | 1
        self.register_buffer("hash_weights", w, persistent=False)
        self._generator: torch.Generator | None = None
        self._pending_rng: tuple[str, Tensor] | None = None

    # ------------------------------------------------------------------ randomness / state
    def generator(self) -> torch.Generator | None:
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
        gen = self.generator()
        return {} if gen is None else {"device_type": gen.device.type, "rng_state": gen.get_state()}

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
                f"mts={self.mts}, bank_dtype={self.bank.dtype}, backend={self.backend}"
                + (", graph=True" if self.graph else ""))

    # ------------------------------------------------------------------ checks
    def _check(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        """Shapes, dtypes and devices; the labels on the state's device (dtype and strides
        as given: the fused kernels read any integer labels and check their range)."""
        if embeddings.dim() != 2 or embeddings.shape[1] != self.dim:
            raise ValueError(f"embeddings: expected shape (B, {self.dim}), "
                             f"got {tuple(embeddings.shape)}")
        if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
            raise ValueError(f"labels: expected shape ({embeddings.shape[0]},), "
                             f"got {tuple(labels.shape)}")
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise ValueError(f"labels: expected an integer tensor, got {labels.dtype}")
        if embeddings.device != self.frm.device:
            raise ValueError(f"embeddings on {embeddings.device} but the DAS state on "
                             f"{self.frm.device}: move the module with .to(device)")
        return labels.to(self.frm.device)

    def _host_range_check(self, labels: Tensor) -> None:
        """On CPU: one reduction read on the host (free there); the offending ids only on
        error. (Also the fused kernels' check on CPU: the interpreter skips device asserts.)"""
        lo, hi = (int(t) for t in torch.aminmax(labels)) if labels.numel() else (0, 0)
        if lo < 0 or hi >= self.num_classes:
            bad = (labels < 0) | (labels >= self.num_classes)
            raise ValueError(f"labels: expected class ids in [0, {self.num_classes}), "
                             f"got {labels[bad][:5].tolist()}")

    # ------------------------------------------------------------------ produce
    def _mask_index(self, y: Tensor) -> Tensor:
        """Eq. (mask): (B, K) channel ids of the K highest FRM counts of each anchor's class
        (with C <= B every class is ranked once and looked up: cheaper, same rows)."""
        if self.num_classes <= y.shape[0]:
            return self.frm.topk(self.topk, dim=1).indices.index_select(0, y)
        return self.frm.index_select(0, y).topk(self.topk, dim=1).indices

    def factor_bounds(self) -> tuple[float, float]:
        """Eq. (scaling_factors): U[1-r_s, 1+r_s] (or U[lo, hi]) on the masked channels."""
        return (self.scale_bounds if self.scale_bounds is not None
                else (1.0 - self.scale_range, 1.0 + self.scale_range))

    def draw(self, T: int, B: int, gen: torch.Generator | None, device) -> Tensor | None:
        """All uniforms of one call in one draw (one launch): ``T*B*K`` DFS factors, then
        ``T*B`` bank-slot uniforms. On CPU this is the same stream as drawing them apart."""
        n = T * B * (self.topk * self.dfs + self.mts)
        return torch.rand(n, generator=gen, device=device) if n else None

    def _gamma(self, r: Tensor, T: int, B: int) -> Tensor:
        lo, hi = self.factor_bounds()
        return lo + (hi - lo) * r[:T * B * self.topk].view(T, B, self.topk)

    def _shift_draw(self, y: Tensor, T: int, r: Tensor) -> tuple[Tensor, Tensor]:
        """Eq. (shifting), the draw: (flat, factor): flat (T*B,) the bank rows of a uniform filled
        slot of each anchor's class, factor (1, B, 1) = r_b, or 0 while its bank is empty."""
        B = y.shape[0]
        count = self.bank_count.index_select(0, y)                           # (B,)
        u = r[T * B * self.topk * self.dfs:].view(T, B)
        slot = (u * count).long().clamp_(max=self.bank_size - 1)           # floor(u * count)
        flat = torch.add(slot, y, alpha=self.bank_size).view(-1)          # y * Z + slot
        factor = torch.where(count > 0, self.shift_scale, 0.0)
        return flat, factor[None, :, None]

    def _produce_into(self, base: Tensor, y: Tensor, work: Tensor,
                      gen: torch.Generator | None) -> None:
        """Write the T copies of ``base`` (B, d, no grad) into ``work`` (T, B, d, float32): the
        spec's ``v' = s * v + r_b * t`` through addcmul, then ``/ max(||v'||, 1e-12)``, in place."""
        T, B = work.shape[0], work.shape[1]
        r = self.draw(T, B, gen, base.device)
        idx = flat = factor = scaled = idx_t = None
        if self.dfs:
            idx = self._mask_index(y)                                      # (B, K)
            scaled = base.gather(1, idx)[None] * self._gamma(r, T, B)      # (T, B, K) s * v
            idx_t = idx[None].expand(T, -1, -1)
        if self.mts:
            flat, factor = self._shift_draw(y, T, r)
            flat_bank, t = self.bank.view(-1, self.dim), work.view(-1, self.dim)   # work holds t now
            if flat_bank.dtype == torch.float32:      # gathered straight in (no temporary)
                torch.index_select(flat_bank, 0, flat, out=t)
            else:
                t.copy_(flat_bank.index_select(0, flat))
            if self.dfs:
                scaled = torch.addcmul(scaled, work.gather(2, idx_t), factor)
            torch.addcmul(base[None].expand(T, -1, -1), work, factor, out=work)
        else:
            work.copy_(base[None].expand(T, -1, -1))
        if self.dfs:
            work.scatter_(2, idx_t, scaled)
        if self.normalize:
            work.div_(torch.linalg.vector_norm(work, dim=-1, keepdim=True).clamp_min_(1e-12))

    def _produce_graph(self, base: Tensor, y: Tensor, T: int,
                       gen: torch.Generator | None) -> Tensor:
        """(T, B, d) copies when gradients flow through ``s * v`` (``detach=False``):
        out-of-place ops so autograd sees them; same draws and arithmetic as _produce_into."""
        B = base.shape[0]
        r = self.draw(T, B, gen, base.device)
        produced = base.repeat(T, 1).view(T, B, self.dim)
        if self.dfs:
            idx = self._mask_index(y)[None].expand(T, -1, -1)               # (T, B, K)
            produced = produced.scatter(2, idx, produced.gather(2, idx) * self._gamma(r, T, B))
        if self.mts:
            flat, factor = self._shift_draw(y, T, r)
            t = self.bank.view(-1, self.dim).index_select(0, flat).view(T, B, self.dim).float()
            produced = torch.addcmul(produced, t, factor)
        if self.normalize:
            produced = F.normalize(produced, dim=-1)
        return produced

    # ------------------------------------------------------------------ forward
    def forward(self, embeddings: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Return ``cat([v, v'_1..v'_T])`` and ``cat([y] * (T+1))``; training mode first updates
        the FRM and the bank from this batch (spec order), eval mode leaves the state alone."""
        y = self._check(embeddings, labels)
        T = self.num_produce
        if T == 0:
            return embeddings, labels
        B = embeddings.shape[0]
        # auto: on CUDA once this batch's kernel variant passed its self-check (else eager)
        fused = self.backend == "triton" or (self.backend == "auto"
                                             and self.fused.wanted(self, embeddings, y))
        if not fused:
            y = y.long()
        if y.device.type == "cpu":
            self._host_range_check(y)
        elif not fused:   # no host sync on accelerators: fails asynchronously (fused: its assert)
            torch._assert_async(~((y < 0) | (y >= self.num_classes)).any(),
                                "DAS labels out of [0, num_classes)")
        grad_copies = not self.detach and torch.is_grad_enabled() and embeddings.requires_grad
        if fused and not grad_copies:
            if embeddings.requires_grad and torch.is_grad_enabled():
                return _FusedCall.apply(embeddings, y, self)
            return self.fused.call(self, embeddings, y)
        if fused:   # detach=False: fused state update, the copies through autograd (eager)
            self.fused.update(self, embeddings.detach(), y)
            y = y.long()   # range checked by the update kernel
        # Statistics and the bank are built in float32 even under autocast (fp16 differences
        # of nearby embeddings lose most of their digits). The guard is only entered when
        # autocast is on: entering it costs as much as a small tensor op.
        device_type = embeddings.device.type
        guard = (torch.autocast(device_type=device_type, enabled=False)
                 if torch.is_autocast_enabled(device_type) else contextlib.nullcontext())
        with guard:
            v_const = embeddings.detach().float()
            if self.training and not fused:
                if self.dfs:
                    update_frm(self.frm, v_const, y, self.topk)
                if self.mts:
                    update_bank(self.bank, self.bank_ptr, self.bank_count,
                                self.hash_weights, v_const, y)
            gen = self.generator()
            base = v_const if self.detach else embeddings.float()
            if base.requires_grad:
                produced = self._produce_graph(base, y, T, gen)
                out = torch.cat([embeddings,
                                 produced.reshape(T * B, self.dim).to(embeddings.dtype)])
            else:
                # No gradient through the copies (every detach=True step): fill the output's
                # tail in place, then put the real embeddings (with their graph) in front.
                out = torch.empty(((T + 1) * B, self.dim), dtype=embeddings.dtype,
                                  device=embeddings.device)
                if embeddings.dtype == torch.float32:
                    self._produce_into(base, y, out[B:].view(T, B, self.dim), gen)
                else:
                    work = torch.empty((T, B, self.dim), device=embeddings.device)
                    self._produce_into(base, y, work, gen)
                    out[B:].copy_(work.view(T * B, self.dim))
                out[:B].copy_(embeddings)
        # = labels.repeat(T + 1), without repeat's extra dispatch
        return out, labels.expand(T + 1, B).reshape(-1)

    # ------------------------------------------------------------------ reporting
    def bank_nbytes(self) -> int:
        """Bytes held by the transformation bank (the dominant memory cost at SOP scale)."""
        return self.bank.numel() * self.bank.element_size()
