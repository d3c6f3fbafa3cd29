"""The self-check that lets ``DAS(backend="auto")`` trust the fused Triton kernels.

Triton compiles one binary per *variant*: the constexprs (dim block, batch block, K, the DFS /
MTS / normalise switches, train or eval), the pointer dtypes (embeddings, labels, bank, output)
and its integer specialisations (an argument equal to 1 or divisible by 16: B, d, Z, C and the
strides). A check of one small variant says nothing about the others, and the first real step
would compile them outside any guard. So the check is keyed on all of that (`variant_key`), and
runs, before a module's first real step of a new variant, at that module's real shapes and
settings (C, d, K, Z, T, the batch's B, dtypes and strides) on synthetic data built to have no
top-K ties: eager and fused modules start from the same random state (FRM, bank, pointers,
counts), run two steps, and must agree on every state tensor (bit for bit, ``bank_ptr``
included), on the labels, and on the outputs (to the last bits of the normalisation).

A CUDA fault in a kernel (illegal address, failed assert) is sticky: the process's CUDA context
is dead and the eager code that should take over would crash too. On CUDA the check therefore
runs in a child process (``python -m training.das_check SPEC``) on the same GPU; whatever
happens there, the trainer's context is untouched, and Triton's on-disk cache means the parent
then loads the child's compiled binaries instead of compiling again. On CPU (Triton's
interpreter, the test suite) it runs in-process: no CUDA context to poison.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["decide", "variant_key", "describe", "verdict", "run_spec", "spec_of"]

#: seconds the child may take (imports, compiling two kernels, two steps of each backend)
TIMEOUT_S = 600
#: test hook: the child aborts (as a sticky CUDA fault would kill it) when this is set
_CRASH_ENV = "DAS_SELFCHECK_CRASH"

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                               torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)}
_VERDICTS: dict[tuple, tuple[bool, str]] = {}


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _spec_int(n: int) -> str:
    """How Triton specialises an integer argument."""
    return "1" if n == 1 else ("16k" if n % 16 == 0 else "n")


def variant_key(das, emb: Tensor, y: Tensor) -> tuple:
    """Everything that makes Triton compile (or specialise) the two kernels differently."""
    B, d = emb.shape
    return (emb.device, emb.dtype, y.dtype, das.bank.dtype,
            _pow2(d), _pow2(B), das.topk, das.num_produce > 0, das.dfs, das.mts, das.normalize,
            das.training, das.detach,
            tuple(_spec_int(n) for n in (B, d, das.bank_size, das.num_classes, *emb.stride(),
                                         *y.stride())),
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
    return {"num_classes": das.num_classes, "dim": das.dim, "num_produce": das.num_produce,
            "topk": das.topk, "bank_size": das.bank_size, "scale_range": das.scale_range,
            "shift_scale": das.shift_scale, "scale_bounds": das.scale_bounds,
            "normalize": das.normalize, "detach": das.detach, "dfs": das.dfs, "mts": das.mts,
            "bank_dtype": str(das.bank.dtype), "training": das.training,
            "device": str(emb.device), "batch": emb.shape[0], "emb_dtype": str(emb.dtype),
            "emb_stride": list(emb.stride()), "label_dtype": str(y.dtype),
            "label_stride": list(y.stride()), "emb_align": emb.data_ptr() % 16,
            "label_align": y.data_ptr() % 16}


def _layout(shape: tuple[int, ...], stride: list[int], dtype: torch.dtype, device: str,
            align: int) -> Tensor:
    """An empty tensor with these strides whose address is ``align`` bytes past a multiple
    of 16, as the real input's (Triton assumes 16-byte alignment where it holds)."""
    item = torch.empty((), dtype=dtype).element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 1
    base = torch.empty(span + 16 // item + 1, dtype=dtype, device=device)
    off = ((align - base.data_ptr()) % 16) // item
    return base.as_strided(shape, stride, off)


def _batch(spec: dict[str, Any], g: torch.Generator, step: int) -> tuple[Tensor, Tensor]:
    """A batch in the real layout whose top-K has no tie at its boundary (the kernels break
    ties to the lowest channel, torch.topk in an unspecified order): K + 1 entries of each
    row are the distinct integers 2..K+2 (exact in every float dtype), the rest are in
    (-1, 1). One class gets 5 members (its ring wraps), and one row is a duplicate."""
    B, d, C, K = spec["batch"], spec["dim"], spec["num_classes"], spec["topk"]
    v = torch.rand(B, d, generator=g) * 2 - 1
    top = torch.rand(B, d, generator=g).argsort(dim=1)[:, :min(K + 1, d)]
    v.scatter_(1, top, (torch.arange(top.shape[1]) + 2.0).expand(B, -1))
    y = torch.randint(0, C, (B,), generator=g)
    y[:min(5, B)] = (1 + step) % C
    if B >= 7:
        v[6], y[6] = v[5], y[5]
    emb = _layout((B, d), spec["emb_stride"], _DTYPES[spec["emb_dtype"]], spec["device"],
                  spec.get("emb_align", 0))
    lab = _layout((B,), spec["label_stride"], _DTYPES[spec["label_dtype"]], spec["device"],
                  spec.get("label_align", 0))
    emb.copy_(v)
    lab.copy_(y)
    return emb.requires_grad_(emb.dtype.is_floating_point), lab


def run_spec(spec: dict[str, Any]) -> tuple[bool, str]:
    """Eager and fused modules at ``spec``, two steps from one random state: (agree, why not)."""
    from .das import DAS

    dev = torch.device(spec["device"])
    kw = {k: spec[k] for k in ("num_produce", "topk", "bank_size", "scale_range", "shift_scale",
                               "normalize", "detach", "dfs", "mts")}
    kw["scale_bounds"] = None if spec["scale_bounds"] is None else tuple(spec["scale_bounds"])
    kw["bank_dtype"] = _DTYPES[spec["bank_dtype"]]
    C, d, Z, B = spec["num_classes"], spec["dim"], spec["bank_size"], spec["batch"]
    g = torch.Generator().manual_seed(0)
    # FRM counts: a random permutation per row, spaced wider than one batch's +1s (no ties)
    frm = torch.rand(C, d, generator=g).argsort(dim=1).float() * (B * spec["topk"] + 1)
    bank = torch.randn(C, Z, d, generator=g)
    count = torch.randint(0, Z + 1, (C,), generator=g)
    ptr = torch.where(count < Z, count, torch.randint(0, Z, (C,), generator=g))
    mods = []
    for backend in ("eager", "triton"):
        m = DAS(C, d, seed=0, backend=backend, **kw).to(dev).train(spec["training"])
        with torch.no_grad():
            m.frm.copy_(frm)
            m.bank.copy_(bank)
            m.bank_ptr.copy_(ptr)
            m.bank_count.copy_(count)
        mods.append(m)
    batches = [_batch(spec, g, step) for step in range(2)]
    emb_dtype = _DTYPES[spec["emb_dtype"]]
    tol = 2e-5 if emb_dtype in (torch.float32, torch.float64) else 2 * torch.finfo(emb_dtype).eps
    for step, (emb, lab) in enumerate(batches):
        outs = []
        for m in mods:
            o, ol = m(emb, lab)          # emb requires grad, as a model's output does
            outs.append((o.detach(), ol))
        (oe, le), (of, lf) = outs
        for name in ("frm", "bank", "bank_ptr", "bank_count"):
            a, b = getattr(mods[0], name), getattr(mods[1], name)
            if not torch.equal(a, b):
                return False, f"step {step + 1}: {name} differs from the eager code's"
        if not torch.equal(mods[0]._gen().get_state(), mods[1]._gen().get_state()):
            return False, f"step {step + 1}: the generator drew more or fewer numbers than eager"
        if not torch.equal(le, lf) or oe.dtype != of.dtype or oe.shape != of.shape:
            return False, f"step {step + 1}: labels, output dtype or shape differ"
        err = (oe.float() - of.float()).abs().max().item() if oe.numel() else 0.0
        if not err <= tol:
            return False, f"step {step + 1}: outputs differ by {err:.3g} (> {tol:.1g})"
    return True, ""


def _run_isolated(spec: dict[str, Any]) -> tuple[bool, str]:
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


def decide(das, emb: Tensor, y: Tensor) -> bool:
    """The auto backend's choice for this batch's variant, remembered on the module: checked
    on first sight; a pass says so on stderr (the training log shows which kernels ran), a
    failure warns once, naming the cause, and leaves the module on the eager code."""
    key = variant_key(das, emb, y)
    ok = das._fused_ok.get(key)
    if ok is None:
        ok, reason = verdict(das, emb, y, key)
        das._fused_ok[key] = ok
        if ok:
            # tqdm.write: a training epoch's progress bar is on stderr too, and a plain print
            # would land on the bar's line (seen on an H200: the log's line then began with the
            # bar, and gpu_check did not find it)
            from tqdm import tqdm

            tqdm.write(f"DAS: fused Triton kernels in use ({describe(key)}; self-check passed)",
                       file=sys.stderr)
        else:
            warnings.warn(f"DAS: the fused Triton kernels are not used for {describe(key)} "
                          f"({reason}); running the eager tensor code instead", RuntimeWarning,
                          stacklevel=4)
    return ok


def verdict(das, emb: Tensor, y: Tensor, key: tuple | None = None,
            isolate: bool | None = None) -> tuple[bool, str]:
    """(use the kernels, why not) for this variant; cached per process. Never raises."""
    key = variant_key(das, emb, y) if key is None else key
    if key in _VERDICTS:
        return _VERDICTS[key]
    spec = spec_of(das, emb, y)
    if isolate is None:
        isolate = emb.device.type == "cuda"
    try:
        res = _run_isolated(spec) if isolate else run_spec(spec)
    except Exception as e:  # a kernel that fails to compile must not stop a training run
        res = (False, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
    _VERDICTS[key] = res
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m training.das_check SPEC_JSON\n\nRuns the fused DAS kernels' "
              "self-check for one variant (spec as written by das_check.spec_of) and prints "
              '{"ok": ..., "reason": ...}.', file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    spec = json.loads(argv[0])
    if os.environ.get(_CRASH_ENV):
        os.abort()
    try:
        ok, reason = run_spec(spec)
    except Exception as e:
        ok, reason = False, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    if spec["device"].startswith("cuda"):
        torch.cuda.synchronize()       # a late fault shows here, as a non-zero exit
    print(json.dumps({"ok": ok, "reason": reason}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
