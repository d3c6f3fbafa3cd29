"""DAS equations on hand-made tensors, checked against a plain loop reference of the spec."""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

from training.das import DAS
from training.das_bank import max_kept_pairs as _max_kept_pairs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]


def reference_update(frm, bank, ptr, count, v, y, K, Z):
    """The spec, written as loops: FRM +1 on top-K channels; ordered pairs i != j of each
    class in row-major batch order, zero differences dropped, written one by one into a ring."""
    frm, bank, ptr, count = frm.clone(), bank.clone(), ptr.clone(), count.clone()
    for i in range(len(y)):
        for c in torch.topk(v[i], K).indices.tolist():
            frm[y[i], c] += 1
    for cls in sorted(set(y.tolist())):
        members = [i for i in range(len(y)) if y[i] == cls]
        for i in members:
            for j in members:
                if i == j:
                    continue
                t = v[i] - v[j]
                if torch.all(t == 0):
                    continue
                bank[cls, ptr[cls]] = t
                ptr[cls] = (ptr[cls] + 1) % Z
                count[cls] = min(count[cls] + 1, Z)
    return frm, bank, ptr, count


def test_frm_counts_signed_topk_per_class():
    das = DAS(3, 6, topk=2, mts=False, num_produce=1)
    v = torch.tensor([[0.9, 0.1, -5.0, 0.5, 0.0, 0.2],     # top-2 signed: ch 0, 3 (not -5)
                      [0.1, 0.8, 0.0, 0.7, 0.0, 0.0],      # ch 1, 3
                      [0.0, 0.0, 0.3, 0.0, 0.9, 0.4]])     # ch 4, 5
    das(v, torch.tensor([0, 0, 2]))
    expected = torch.zeros(3, 6)
    expected[0, [0, 3]] += 1
    expected[0, [1, 3]] += 1
    expected[2, [4, 5]] += 1
    assert torch.equal(das.frm, expected)
    das(v, torch.tensor([0, 0, 2]))
    assert torch.equal(das.frm, 2 * expected)


def test_mask_scaling_only_on_masked_channels_within_range():
    das = DAS(2, 8, topk=3, num_produce=50, scale_range=0.3, mts=False, normalize=False, seed=1)
    das.frm[0] = torch.tensor([5., 0., 9., 1., 7., 0., 0., 2.])   # mask of class 0: 2, 4, 0
    das.frm[1] = torch.tensor([0., 0., 0., 0., 0., 3., 4., 5.])   # mask of class 1: 5, 6, 7
    das.eval()                                                    # keep the FRM as set
    v = torch.ones(2, 8)
    out, lab = das(v, torch.tensor([0, 1]))
    s = out[2:].view(50, 2, 8)                                    # copies of ones = factors
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, [0, 2, 4]] = True
    mask[1, [5, 6, 7]] = True
    assert torch.equal(s[:, ~mask], torch.ones_like(s[:, ~mask]))  # untouched, exactly
    on = s[:, mask]
    assert (on >= 0.7).all() and (on <= 1.3).all()
    assert on.std() > 0.1                                         # independent draws
    assert on.min() < 0.8 and on.max() > 1.2                      # spans the range


def test_absolute_scale_bounds():
    das = DAS(1, 4, topk=4, num_produce=200, scale_bounds=(0.5, 2.0), mts=False,
              normalize=False, seed=0).eval()
    out, _ = das(torch.ones(1, 4), torch.tensor([0]))
    s = out[1:]
    assert (s >= 0.5).all() and (s <= 2.0).all() and s.min() < 0.6 and s.max() > 1.9


def test_fifo_order_and_wraparound_hand_made():
    Z = 3
    das = DAS(2, 2, topk=1, bank_size=Z, num_produce=1, dfs=False)
    v = torch.tensor([[1., 0.], [0., 1.], [2., 2.]])
    das(v, torch.tensor([0, 0, 0]))           # 6 ordered pairs: only the last 3 survive
    # row-major order: (0,1) (0,2) (1,0) (1,2) (2,0) (2,1); ring slots 0,1,2,0,1,2
    assert torch.equal(das.bank[0], torch.stack([v[1] - v[2], v[2] - v[0], v[2] - v[1]]))
    assert das.bank_ptr.tolist() == [0, 0] and das.bank_count.tolist() == [3, 0]
    w = torch.tensor([[5., 5.], [4., 3.]])
    das(w, torch.tensor([0, 0]))              # overwrites the two oldest slots, in order
    assert torch.equal(das.bank[0], torch.stack([w[0] - w[1], w[1] - w[0], v[2] - v[1]]))
    assert das.bank_ptr.tolist() == [2, 0] and das.bank_count.tolist() == [3, 0]


def test_zero_differences_dropped_and_partial_fill():
    das = DAS(3, 4, topk=1, bank_size=10, num_produce=1, dfs=False)
    a = torch.tensor([1., -0.0, 3., 4.])
    b = torch.tensor([1., 0.0, 3., 4.])       # equal to a (−0 == 0): difference is zero
    c = torch.tensor([0., 1., 0., 0.])
    das(torch.stack([a, b, c, c]), torch.tensor([0, 0, 1, 2]))
    assert das.bank_count.tolist() == [0, 0, 0]
    das(torch.stack([a, c, b]), torch.tensor([0, 0, 0]))
    # pairs (a,c) (a,b)=0 (c,a) (c,b) (b,a)=0 (b,c): four non-zero ones, in that order
    assert das.bank_count.tolist() == [4, 0, 0] and das.bank_ptr.tolist() == [4, 0, 0]
    assert torch.equal(das.bank[0, :4], torch.stack([a - c, c - a, c - b, b - c]))
    assert torch.equal(das.bank[0, 4:], torch.zeros(6, 4))


@pytest.mark.parametrize("device", DEVICES)
def test_state_update_matches_loop_reference_on_random_batches(device):
    torch.manual_seed(0)
    C, d, K, Z = 7, 16, 3, 5
    das = DAS(C, d, topk=K, bank_size=Z, num_produce=2, seed=3).to(device)
    state = [t.cpu().clone() for t in (das.frm, das.bank, das.bank_ptr, das.bank_count)]
    for step in range(12):
        B = int(torch.randint(2, 20, ()))
        y = torch.randint(0, C, (B,))
        v = torch.randn(B, d)
        if step % 3 == 0:                      # duplicate rows: zero differences
            v[1] = v[0]
            y[1] = y[0]
        if step % 4 == 1:                      # all classes distinct: nothing to write
            y = torch.randperm(C)[:min(B, C)]
            v = v[:len(y)]
        das(v.to(device), y.to(device))
        state = reference_update(*state, v, y, K, Z)
        assert torch.equal(das.frm.cpu(), state[0])
        assert torch.equal(das.bank_ptr.cpu(), state[2])
        assert torch.equal(das.bank_count.cpu(), state[3])
        torch.testing.assert_close(das.bank.cpu(), state[1], rtol=0, atol=1e-6)


def test_kept_pair_bound_is_tight_enough():
    # one class of 4 brings 12 pairs, 10 survive: 2.5 per member is the worst case for Z=10
    assert _max_kept_pairs(112, 10) == 280
    assert _max_kept_pairs(2, 10) == 2 and _max_kept_pairs(1, 10) == 0


def test_shift_is_rb_times_a_stored_same_class_difference():
    das = DAS(3, 4, topk=1, bank_size=10, num_produce=40, shift_scale=0.1, dfs=False,
              normalize=False, seed=0)
    v = torch.tensor([[1., 0., 0., 0.], [0., 2., 0., 0.], [0., 0., 3., 0.], [0., 0., 0., 4.]])
    y = torch.tensor([0, 0, 1, 1])
    das(v, y)
    stored = {0: das.bank[0, :2].clone(), 1: das.bank[1, :2].clone()}
    das.eval()
    probe = torch.tensor([[1., 1., 1., 1.], [2., 2., 2., 2.], [3., 3., 3., 3.]])
    out, lab = das(probe, torch.tensor([0, 1, 2]))
    shifts = (out[3:] - probe.repeat(40, 1)).view(40, 3, 4)
    for cls in (0, 1):
        cand = 0.1 * stored[cls]                                  # (2, d)
        err = (shifts[:, cls, None, :] - cand[None]).abs().amax(-1)  # (40, 2)
        assert (err.min(dim=1).values < 1e-6).all()               # each is one of them
        hit = err.argmin(dim=1)
        assert set(hit.tolist()) == {0, 1}                        # both slots get drawn
    assert torch.equal(shifts[:, 2], torch.zeros(40, 4))          # empty bank: no shift


@pytest.mark.parametrize("device", DEVICES)
def test_copies_labels_and_normalisation(device):
    T, B, d = 3, 6, 10
    das = DAS(4, d, num_produce=T, scale_range=0.2, shift_scale=0.1, seed=0).to(device)
    v = F.normalize(torch.randn(B, d, device=device), dim=1)
    y = torch.tensor([0, 0, 1, 1, 3, 3], device=device)
    out, lab = das(v, y)
    assert out.shape == ((T + 1) * B, d) and lab.tolist() == y.tolist() * (T + 1)
    assert torch.equal(out[:B], v)
    torch.testing.assert_close(out[B:].norm(dim=1), torch.ones(T * B, device=device))
    assert not torch.equal(out[B:2 * B], out[2 * B:3 * B])       # fresh draw per copy
    raw = DAS(4, d, num_produce=T, normalize=False, scale_range=0.2, seed=0)(v.cpu() * 3, y.cpu())[0]
    assert (raw[B:].norm(dim=1) > 2).all()                        # unnormalised stays so


def test_without_dfs_and_mts_copies_equal_anchors():
    das = DAS(2, 5, num_produce=2, dfs=False, mts=False, normalize=False)
    v = torch.randn(4, 5)
    out, _ = das(v, torch.tensor([0, 0, 1, 1]))
    assert torch.equal(out[4:8], v) and torch.equal(out[8:], v)
    assert das.bank_count.sum() == 0 and das.frm.sum() == 0       # switched-off state idle


def test_gradients_detach_on_and_off():
    torch.manual_seed(0)
    v = torch.randn(4, 6, requires_grad=True)
    y = torch.tensor([0, 0, 1, 1])
    kw = dict(num_produce=3, scale_range=0.3, shift_scale=0.1, normalize=False, seed=5)
    out, _ = DAS(2, 6, detach=True, **kw)(v, y)
    out[4:].sum().backward()
    assert v.grad is None or torch.equal(v.grad, torch.zeros_like(v))
    v.grad = None
    das = DAS(2, 6, detach=False, mts=False, **kw)
    out, _ = das(v, y)
    out[4:].sum().backward()
    # copies are s_t * v, so d/dv sum_t (s_t * v) = sum_t s_t = sum_t copy_t / v
    s = (out[4:].detach() / v.detach().repeat(3, 1)).view(3, 4, 6)
    assert (s != 1).any()
    torch.testing.assert_close(v.grad, s.sum(0))
    v.grad = None
    out, _ = DAS(2, 6, detach=False, **kw)(v, y)                 # shifts are constants
    out[4:].sum().backward()
    assert torch.isfinite(v.grad).all() and (v.grad != 0).all()


def test_state_dict_round_trip_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    kw = dict(num_produce=3, scale_range=0.2, shift_scale=0.1, seed=11, bank_size=4)
    a = DAS(5, 8, **kw)
    batches = [(torch.randn(10, 8), torch.randint(0, 5, (10,))) for _ in range(6)]
    for v, y in batches[:3]:
        a(v, y)
    path = tmp_path / "das.pt"
    torch.save(a.state_dict(), path)
    b = DAS(5, 8, **{**kw, "seed": 999})
    b.load_state_dict(torch.load(path, weights_only=True))
    for name in ("frm", "bank", "bank_ptr", "bank_count"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    for v, y in batches[3:]:
        assert torch.equal(a(v, y)[0], b(v, y)[0])                # same draws after resume


def test_seeded_runs_are_reproducible_and_seeds_differ():
    v, y = torch.randn(8, 16), torch.arange(4).repeat_interleave(2)
    kw = dict(scale_range=0.2, shift_scale=0.2)
    r1 = [DAS(4, 16, seed=1, **kw)(v, y)[0] for _ in range(2)]
    r2 = DAS(4, 16, seed=2, **kw)(v, y)[0]
    assert torch.equal(r1[0], r1[1]) and not torch.equal(r1[0], r2)


@pytest.mark.parametrize("bank_dtype", [torch.float16, torch.bfloat16])
def test_compact_bank(bank_dtype):
    das = DAS(3, 8, bank_dtype=bank_dtype, shift_scale=0.1, seed=0)
    v, y = torch.randn(6, 8), torch.tensor([0, 0, 1, 1, 2, 2])
    out, _ = das(v, y)
    assert das.bank.dtype == bank_dtype and out.dtype == torch.float32
    assert das.bank_nbytes() == 3 * 10 * 8 * 2
    torch.testing.assert_close(das.bank[0, 0].float(), v[0] - v[1], rtol=1e-2, atol=1e-2)


def test_sop_scale_bank_memory():
    assert DAS(11318, 512, bank_dtype=torch.float32).bank_nbytes() == 11318 * 10 * 512 * 4
    assert DAS(11318, 512, bank_dtype=torch.float16).bank_nbytes() == 11318 * 10 * 512 * 2


def test_autocast_bfloat16_cpu():
    torch.manual_seed(0)
    layer = torch.nn.Linear(12, 8)
    das = DAS(3, 8, seed=0, detach=False)
    x, y = torch.randn(6, 12), torch.tensor([0, 0, 1, 1, 2, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        e = layer(x)
        out, lab = das(e, y)
        loss = out.float().pow(2).sum()
    assert e.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    loss.backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()
    assert das.bank.dtype == torch.float32
    torch.testing.assert_close(das.bank[0, 0], (e[0].float() - e[1].float()).detach())  # fp32 diff


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_step_has_no_host_sync():
    das = DAS(98, 64, seed=0).cuda()
    v = torch.randn(112, 64, device="cuda")
    y = torch.arange(56, device="cuda").repeat_interleave(2)
    das(v, y)
    torch.cuda.set_sync_debug_mode("error")
    try:
        das(v, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_state_moves_with_to_and_repr():
    das = DAS(4, 8, seed=0)
    names = {n for n, _ in das.named_buffers()}
    assert {"frm", "bank", "bank_ptr", "bank_count"} <= names
    assert set(das.state_dict()) >= {"frm", "bank", "bank_ptr", "bank_count", "_extra_state"}
    buf = io.BytesIO()
    torch.save(das.state_dict(), buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)
    assert "T=3" in repr(das) and "K=4" in repr(das)


@pytest.mark.parametrize("kwargs, match", [
    ({"topk": 0}, "topk"), ({"topk": 9}, "topk"), ({"bank_size": 0}, "bank_size"),
    ({"scale_range": 1.5}, "scale_range"), ({"scale_bounds": (2.0, 0.5)}, "scale_bounds"),
    ({"num_produce": -1}, "num_produce"), ({"bank_dtype": torch.int32}, "bank_dtype"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DAS(4, 8, **kwargs)


def test_bank_dtypes_are_the_configs_and_the_error_lists_exactly_them():
    """One list (config.BANK_DTYPES): DAS takes each of them and nothing else, float64
    included (it was accepted although the message did not name it)."""
    from training.config import BANK_DTYPES

    for name in BANK_DTYPES:
        assert DAS(2, 4, bank_dtype=getattr(torch, name)).bank.dtype == getattr(torch, name)
    with pytest.raises(ValueError) as info:
        DAS(2, 4, bank_dtype=torch.float64)
    assert str(info.value) == ("bank_dtype=torch.float64: expected "
                               + " | ".join(f"torch.{name}" for name in BANK_DTYPES))


def test_bad_inputs_name_the_problem():
    das = DAS(4, 8)
    with pytest.raises(ValueError, match=r"labels: expected class ids in \[0, 4\).*\[7\]"):
        das(torch.randn(2, 8), torch.tensor([1, 7]))
    with pytest.raises(ValueError, match=r"embeddings: expected shape \(B, 8\)"):
        das(torch.randn(2, 5), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="labels: expected shape"):
        das(torch.randn(2, 8), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="integer"):
        das(torch.randn(2, 8), torch.tensor([1.0, 1.0]))
