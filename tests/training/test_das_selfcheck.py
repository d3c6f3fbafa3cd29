"""The auto backend's self-check (training/das_fused.py): keyed on what Triton compiles
differently, run at the module's real shapes before its first real step of a variant, comparing
all state (``bank_ptr`` included); a failure leaves the module on eager with its state untouched
and one warning naming the cause; on CUDA it runs in a child process so that a sticky CUDA fault
cannot poison the trainer (shown here with a child that aborts)."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from training import das_fused, das_triton
from training.das import DAS

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def auto(monkeypatch):
    """auto considers the kernels on this device; fresh verdicts; the specs checked, always
    in-process (on CUDA too, so that the spy and the patched kernels below see them; the
    child process has tests of its own at the end)."""
    monkeypatch.setattr(das_fused, "candidate", lambda device: True)
    monkeypatch.setattr(das_fused, "VERDICTS", {})
    specs = []
    real = das_fused.run_spec

    def spy(spec, das_type=DAS):
        specs.append(spec)
        return real(spec, das_type)

    monkeypatch.setattr(das_fused, "run_spec", spy)
    monkeypatch.setattr(das_fused, "run_isolated", spy)
    return specs


def _data(B, d=16, C=6, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, d, generator=g).to(DEVICE, dtype),
            torch.randint(0, C, (B,), generator=g).to(DEVICE))


def _state(das):
    return {k: t.clone() for k, t in das.state_dict().items() if torch.is_tensor(t)}


def test_checked_once_per_kernel_variant_at_the_real_shapes(auto, capsys):
    das = DAS(6, 16, num_produce=2, topk=3, bank_size=5, seed=0).to(DEVICE)
    v, y = _data(12)
    das(v, y)
    das(*_data(12, seed=1))                                    # same variant: no new check
    assert len(auto) == 1
    s = auto[0]
    assert (s["num_classes"], s["dim"], s["topk"], s["bank_size"], s["num_produce"],
            s["batch"], s["emb_dtype"]) == (6, 16, 3, 5, 2, 12, "torch.float32")
    das(*_data(20))                                            # another batch block
    das(*_data(12, dtype=torch.bfloat16))                      # another output dtype
    das.eval()
    das(v, y)                                                  # the eval-mode kernel
    assert [(x["batch"], x["emb_dtype"], x["training"]) for x in auto[1:]] == [
        (20, "torch.float32", True), (12, "torch.bfloat16", True), (12, "torch.float32", False)]
    assert "fused Triton kernels in use" in capsys.readouterr().err
    # the verdicts are per variant, not per module: a second module of a known variant
    DAS(6, 16, num_produce=2, topk=3, bank_size=5, seed=0).to(DEVICE)(v, y)
    assert len(auto) == 4


def test_variant_key_names_everything_that_compiles_differently():
    das = DAS(6, 16, seed=0)
    v, y = _data(12)
    keys = {das_fused.variant_key(das, v, y)}
    for other in (DAS(6, 16, topk=5), DAS(6, 16, bank_dtype=torch.float16), DAS(6, 16, dfs=False),
                  DAS(6, 16, mts=False), DAS(6, 16, normalize=False), DAS(6, 17)):
        vv = v if other.dim == 16 else _data(12, d=17)[0]
        keys.add(das_fused.variant_key(other, vv, y))
    for vv, yy in ((v.bfloat16(), y), (v, y.int()), (v, torch.stack([y, y], 1)[:, 0]),
                   (_data(16)[0], _data(16)[1]), (_data(40)[0], _data(40)[1])):
        keys.add(das_fused.variant_key(das, vv, yy))
    y_wide = torch.stack([y, y], 1).reshape(-1)
    keys.add(das_fused.variant_key(das, v, y_wide[1::2]))     # 8 bytes off 16-byte alignment
    assert len(keys) == 13


def test_the_check_reproduces_the_batch_layout():
    """Strides, dtypes and the 16-byte misalignment of a sliced label tensor, as Triton
    specialises on them."""
    das = DAS(6, 16, seed=0)
    v, y = _data(12)
    v_t = v.t().contiguous().t().bfloat16()
    y_odd = torch.stack([y, y], 1).reshape(-1).to(torch.int32)[1::2]
    spec = das_fused.spec_of(das, v_t, y_odd)
    emb, lab = das_fused.check_batch(spec, torch.Generator().manual_seed(0), 0)
    assert (emb.dtype, emb.stride(), emb.data_ptr() % 16) == (v_t.dtype, v_t.stride(),
                                                              v_t.data_ptr() % 16)
    assert (lab.dtype, lab.stride(), lab.data_ptr() % 16) == (torch.int32, (2,), 4)
    assert emb.requires_grad and das_fused.variant_key(das, emb, lab) == \
        das_fused.variant_key(das, v_t, y_odd)


def test_a_state_bug_is_caught_and_leaves_the_module_untouched_on_eager(auto, monkeypatch):
    """A kernel bug that only shows in ``bank_ptr`` (the former check compared FRM, bank and
    counts only). The module must train as the eager module does, from the same state."""
    real = das_triton.fused_update

    def off_by_one(*args, **kw):
        real(*args, **kw)
        args[4].add_(1).remainder_(args[3].shape[1])            # ptr

    monkeypatch.setattr(das_triton, "fused_update", off_by_one)
    das = DAS(6, 16, num_produce=2, seed=0).to(DEVICE)
    ref = DAS(6, 16, num_produce=2, seed=0, backend="eager").to(DEVICE)
    v, y = _data(12)
    with pytest.warns(RuntimeWarning, match=r"bank_ptr differs.*running the eager") as rec:
        out = das(v, y)[0]
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1
    torch.testing.assert_close(out, ref(v, y)[0], rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(_state(das).values(), _state(ref).values()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                         # no second warning
        das(v, y)


def test_a_compile_failure_of_a_later_variant_never_touches_the_state(auto, monkeypatch):
    """The first step of a new variant (here: bf16 output) used to compile outside any guard:
    a failure there crashed training, possibly with the bank half written. Now the check runs
    first, on its own modules; the real module's state is exactly eager's."""
    das = DAS(6, 16, num_produce=2, seed=0).to(DEVICE)
    ref = DAS(6, 16, num_produce=2, seed=0, backend="eager").to(DEVICE)
    v, y = _data(12)
    das(v, y), ref(v, y)                                       # fp32 variant: fused, fine
    real = das_triton.fused_update

    def half_written_then_fails(v, y, frm, bank, *args, **kw):
        if v.dtype == torch.bfloat16:
            bank.fill_(7.0)
            raise RuntimeError("out of resources: shared memory")
        return real(v, y, frm, bank, *args, **kw)

    monkeypatch.setattr(das_triton, "fused_update", half_written_then_fails)
    vb, yb = _data(12, dtype=torch.bfloat16, seed=2)
    with pytest.warns(RuntimeWarning, match="bfloat16 embeddings.*out of resources"):
        das(vb, yb)
    ref(vb, yb)
    for k, t in _state(ref).items():
        assert torch.equal(_state(das)[k], t), k


def test_isolated_check_passes_in_a_child_process(monkeypatch):
    monkeypatch.setattr(das_fused, "VERDICTS", {})
    das = DAS(5, 8, num_produce=1, bank_size=3, seed=0).to(DEVICE)
    v, y = _data(6, d=8, C=5)
    ok, reason = das_fused.verdict(das, v, y, isolate=True)
    assert ok, reason


def test_a_crashing_check_process_leaves_the_trainer_on_eager(monkeypatch, tmp_path):
    """A sticky CUDA fault kills the context it happens in; the check's child process stands
    for it here by aborting (a `sitecustomize` on its path: no hook in the product). The parent
    gets a verdict, warns, and trains on eager."""
    monkeypatch.setattr(das_fused, "candidate", lambda device: True)
    monkeypatch.setattr(das_fused, "VERDICTS", {})
    (tmp_path / "sitecustomize.py").write_text("import os\nos.abort()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    real = das_fused.verdict
    monkeypatch.setattr(das_fused, "verdict",
                        lambda das, emb, y, key=None: real(das, emb, y, key, isolate=True))
    das = DAS(5, 8, num_produce=1, seed=0).to(DEVICE)
    ref = DAS(5, 8, num_produce=1, seed=0, backend="eager").to(DEVICE)
    v, y = _data(6, d=8, C=5)
    with pytest.warns(RuntimeWarning, match="check process exited with status"):
        out, _ = das(v, y)
    torch.testing.assert_close(out, ref(v, y)[0], rtol=0, atol=0)
