"""The torch reference against a naive dense-masked softmax, autograd and the contract's edge cases."""

from __future__ import annotations

import pytest
import torch

from dsa_aot.kernels import reference as ref
from dsa_aot.kernels.reference import sparse_mla_bwd_ref, sparse_mla_fwd_ref, valid_mask

INF = float("inf")
INT32_MIN = -(2**31)


def _dense(q, kv, idx, length=None, sink=None, scale=None, d_v=8):
    """Naive dense softmax over all S_kv columns (+ sink column) with per-slot multiplicities.

    Differentiable in q, kv and sink; float64. Each valid slot is its own term, so a key
    picked c times contributes log(c) to its score. Needs finite sinks.
    """
    s_q, heads, d_qk = q.shape
    s_kv = kv.shape[0]
    scale = d_qk ** -0.5 if scale is None else scale
    counts = torch.zeros(s_q, s_kv, dtype=torch.float64)
    for t in range(s_q):
        n = idx.shape[1] if length is None else max(0, min(int(length[t]), idx.shape[1]))
        for j in range(n):
            c = int(idx[t, j])
            if 0 <= c < s_kv:
                counts[t, c] += 1
    scores = scale * torch.einsum("thd,nd->thn", q, kv) + torch.log(counts)[:, None, :]
    lse = torch.logsumexp(scores, dim=-1)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, INF), lse)
    if sink is not None:
        full = torch.cat([scores, sink[None, :, None].expand(s_q, heads, 1)], dim=-1)
    else:
        full = scores
    m = full.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(full - m)
    denom = e.sum(dim=-1, keepdim=True)
    p = e[..., :s_kv] / torch.where(denom == 0, torch.ones_like(denom), denom)
    return p @ kv[:, :d_v], lse


def _inputs(s_q, heads, d_qk, s_kv, k, seed=0, scale_q=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, heads, d_qk, generator=g, dtype=torch.float64) * scale_q
    kv = torch.randn(s_kv, d_qk, generator=g, dtype=torch.float64)
    idx = torch.randint(-2, s_kv + 2, (s_q, k), generator=g, dtype=torch.int32)
    return q, kv, idx


def _check_fwd_bwd(q, kv, idx, length=None, sink=None, d_v=8, scale=None, seed=1):
    out, lse = sparse_mla_fwd_ref(q, kv, idx, length, sink, scale, d_v=d_v)
    ref_out, ref_lse = _dense(q, kv, idx, length, sink, scale, d_v)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dq, dkv, d_sink = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, length, sink, scale, d_v=d_v)
    qa = q.clone().requires_grad_()
    kva = kv.clone().requires_grad_()
    sa = None if sink is None else sink.clone().requires_grad_()
    o, _ = _dense(qa, kva, idx, length, sa, scale, d_v)
    grads = torch.autograd.grad((o * dout).sum(), [t for t in (qa, kva, sa) if t is not None],
                                allow_unused=True)
    torch.testing.assert_close(dq, grads[0], rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(dkv, grads[1], rtol=1e-9, atol=1e-11)
    if sink is None:
        assert d_sink is None
    else:
        torch.testing.assert_close(d_sink, grads[2], rtol=1e-9, atol=1e-11)
    return out, lse, dq, dkv, d_sink


def test_valid_mask_rules():
    idx = torch.tensor([[0, -1, 4, 5, INT32_MIN, 2147480000, 3]], dtype=torch.int32)
    assert valid_mask(idx, 5).tolist() == [[True, False, True, False, False, False, True]]
    lengths = torch.tensor([3], dtype=torch.int32)
    assert valid_mask(idx, 5, lengths).tolist() == [[True, False, True, False, False, False, False]]
    idx2 = idx.repeat(3, 1)
    m = valid_mask(idx2, 5, torch.tensor([-4, 0, 100], dtype=torch.int32))
    assert not m[0].any() and not m[1].any()
    assert m[2].tolist() == [True, False, True, False, False, False, True]


@pytest.mark.parametrize("layout", ["noncompact", "compact"])
@pytest.mark.parametrize("with_sink", [False, True])
def test_matches_dense_with_duplicates(layout, with_sink):
    q, kv, idx = _inputs(5, 4, 16, 11, 9, seed=3)
    idx[0, :4] = 7                      # the same key four times: four terms
    idx[1, 2] = idx[1, 5] = 0
    length = torch.tensor([9, 4, 0, -3, 20], dtype=torch.int32) if layout == "compact" else None
    sink = torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64) if with_sink else None
    _check_fwd_bwd(q, kv, idx, length, sink)


def test_duplicates_count_per_slot():
    q, kv, _ = _inputs(1, 2, 8, 6, 3)
    once, _ = sparse_mla_fwd_ref(q, kv, torch.tensor([[1, 2, -1]], dtype=torch.int32), d_v=8)
    twice, _ = sparse_mla_fwd_ref(q, kv, torch.tensor([[1, 2, 2]], dtype=torch.int32), d_v=8)
    assert not torch.allclose(once, twice)
    _check_fwd_bwd(q, kv, torch.tensor([[1, 2, 2]], dtype=torch.int32))


class _RefAttention(torch.autograd.Function):
    """Forward = reference forward, backward = closed-form reference backward."""

    @staticmethod
    def forward(ctx, q, kv, sink, idx, length):
        out, lse = sparse_mla_fwd_ref(q, kv, idx, length, sink, d_v=4)
        ctx.save_for_backward(q, kv, sink, idx, out, lse)
        ctx.length = length
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, sink, idx, out, lse = ctx.saved_tensors
        dq, dkv, d_sink = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, ctx.length, sink, d_v=4)
        return dq, dkv, d_sink, None, None


@pytest.mark.parametrize("layout", ["noncompact", "compact"])
def test_gradcheck_closed_form_backward(layout):
    q, kv, idx = _inputs(3, 2, 6, 5, 7, seed=5)
    idx[0, 1] = idx[0, 3] = 2           # duplicates
    idx[2, :] = -1 if layout == "noncompact" else idx[2, :]  # an empty row
    length = torch.tensor([7, 3, 0], dtype=torch.int32) if layout == "compact" else None
    sink = torch.tensor([0.5, -0.7], dtype=torch.float64)
    inputs = (q.requires_grad_(), kv.requires_grad_(), sink.requires_grad_(), idx, length)
    assert torch.autograd.gradcheck(_RefAttention.apply, inputs, eps=1e-6, atol=1e-7)


def test_topk_length_nonpositive_and_beyond_k():
    q, kv, idx = _inputs(4, 2, 8, 9, 6, seed=7)
    idx = idx.clamp(0, 8)               # all indices valid: only the length decides
    length = torch.tensor([0, -5, 6, 1000], dtype=torch.int32)
    sink = torch.tensor([0.1, 0.2], dtype=torch.float64)
    out, lse, dq, dkv, d_sink = _check_fwd_bwd(q, kv, idx, length, sink)
    assert torch.isposinf(lse[:2]).all() and (out[:2] == 0).all() and (dq[:2] == 0).all()
    full, full_lse = sparse_mla_fwd_ref(q[2:], kv, idx[2:], None, sink, d_v=8)
    assert torch.equal(out[2:], full) and torch.equal(lse[2:], full_lse)


@pytest.mark.parametrize("sink_value", [None, 0.5, INF, -INF])
def test_rows_without_valid_slot(sink_value):
    q, kv, idx = _inputs(3, 2, 8, 5, 4, seed=9)
    idx[1] = torch.tensor([-1, 5, INT32_MIN, 2147480000], dtype=torch.int32)
    sink = None if sink_value is None else torch.full((2,), sink_value, dtype=torch.float64)
    out, lse = sparse_mla_fwd_ref(q, kv, idx, None, sink, d_v=8)
    assert torch.isposinf(lse[1]).all() and (out[1] == 0).all()
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    dout = torch.randn_like(out)
    dq, dkv, d_sink = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, None, sink, d_v=8)
    assert (dq[1] == 0).all()
    assert torch.isfinite(dq).all() and torch.isfinite(dkv).all()
    if sink is not None:
        assert torch.isfinite(d_sink).all()
    # The empty row contributes nothing to dkv, whatever the sink.
    _, dkv_without, _ = sparse_mla_bwd_ref(q[[0, 2]], kv, out[[0, 2]], dout[[0, 2]], lse[[0, 2]],
                                           idx[[0, 2]], None, sink, d_v=8)
    torch.testing.assert_close(dkv, dkv_without, rtol=1e-12, atol=1e-12)


def test_empty_row_with_finite_sink_has_zero_sink_probability():
    q, kv, idx = _inputs(2, 2, 8, 5, 3, seed=10)
    idx[1] = -1
    sink = torch.tensor([0.3, -0.2], dtype=torch.float64)
    out, lse = sparse_mla_fwd_ref(q, kv, idx, None, sink, d_v=8)
    dout = torch.randn_like(out)
    fake_out = torch.randn_like(out)     # a nonzero delta on the empty row must not reach d_sink
    _, _, d_sink = sparse_mla_bwd_ref(q, kv, fake_out, dout, lse, idx, None, sink, d_v=8)
    _, _, d_sink0 = sparse_mla_bwd_ref(q[:1], kv, fake_out[:1], dout[:1], lse[:1], idx[:1], None, sink, d_v=8)
    torch.testing.assert_close(d_sink, d_sink0, rtol=1e-12, atol=0)


@pytest.mark.parametrize("compute_dtype", [torch.float64, torch.float32])
def test_very_negative_lse_with_padded_columns(compute_dtype):
    # Scores ~ -100, so lse < -88: a zero-filled masked score would give exp(0 - lse) = inf in
    # fp32 (e^88 > FLT_MAX), and inf * 0 = NaN downstream.
    s_q, heads, d, s_kv, k = 3, 2, 8, 6, 10
    kv = torch.ones(s_kv, d, dtype=torch.float64) + 0.01 * torch.arange(s_kv * d, dtype=torch.float64).view(s_kv, d)
    q = torch.full((s_q, heads, d), -100.0 / (d * d ** -0.5), dtype=torch.float64)
    idx = torch.full((s_q, k), -1, dtype=torch.int32)
    idx[:, :3] = torch.tensor([0, 2, 4], dtype=torch.int32)
    out, lse = sparse_mla_fwd_ref(q, kv, idx, d_v=8, compute_dtype=compute_dtype)
    assert (lse < -88).all() and torch.isfinite(out).all()
    dout = torch.randn(out.shape, dtype=compute_dtype)
    dq, dkv, _ = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, d_v=8, compute_dtype=compute_dtype)
    assert torch.isfinite(dq).all() and torch.isfinite(dkv).all()
    if compute_dtype == torch.float64:
        _check_fwd_bwd(q, kv, idx)
    else:
        ref_out, _ = _dense(q, kv, idx, d_v=8)
        torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-5)


def test_k_larger_than_s_kv_keeps_dkv_of_late_columns():
    q, kv, _ = _inputs(3, 2, 8, 4, 1, seed=11)
    k = 12
    idx = torch.full((3, k), -1, dtype=torch.int32)
    idx[0, 9] = 3                       # valid index in a column >= S_kv
    idx[1, 5] = 1
    idx[1, 11] = 2
    idx[2, 7] = 3
    _, _, _, dkv, _ = _check_fwd_bwd(q, kv, idx)
    assert (dkv[[1, 2, 3]].abs().sum(dim=1) > 0).all()
    assert (dkv[0] == 0).all()


@pytest.mark.parametrize("k", [1, 37, 65])
def test_k_not_multiple_of_tile(k):
    q, kv, idx = _inputs(4, 2, 8, 23, k, seed=k)
    _check_fwd_bwd(q, kv, idx, sink=torch.tensor([0.0, 1.0], dtype=torch.float64))


def test_out_of_range_indices_are_masked():
    q, kv, _ = _inputs(2, 2, 8, 5, 1, seed=13)
    bad = torch.tensor([[-1, 5, INT32_MIN, 2147480000, 2, 6],
                        [4, 2147483647, -2, 0, INT32_MIN, 3]], dtype=torch.int32)
    good = torch.tensor([[2, -1, -1, -1, -1, -1], [4, -1, -1, 0, -1, 3]], dtype=torch.int32)
    out_b, lse_b, dq_b, dkv_b, _ = _check_fwd_bwd(q, kv, bad)
    out_g, lse_g = sparse_mla_fwd_ref(q, kv, good, d_v=8)
    assert torch.equal(out_b, out_g) and torch.equal(lse_b, lse_g)


def test_sink_plus_inf():
    q, kv, idx = _inputs(4, 2, 8, 7, 5, seed=14)
    idx[3] = -1
    sink = torch.full((2,), INF, dtype=torch.float64)
    out, lse = sparse_mla_fwd_ref(q, kv, idx, None, sink, d_v=8)
    assert (out == 0).all()
    _, lse_nosink = sparse_mla_fwd_ref(q, kv, idx, d_v=8)
    assert torch.equal(lse, lse_nosink)  # lse excludes the sink
    dout = torch.randn_like(out)
    given_out = torch.randn_like(out)   # delta from the given out, nonzero
    dq, dkv, d_sink = sparse_mla_bwd_ref(q, kv, given_out, dout, lse, idx, None, sink, d_v=8)
    assert (dq == 0).all() and (dkv == 0).all()
    delta = (given_out * dout).sum(-1)
    torch.testing.assert_close(d_sink, -delta.sum(0), rtol=1e-12, atol=0)


def test_sink_minus_inf_has_no_effect():
    q, kv, idx = _inputs(4, 2, 8, 7, 5, seed=15)
    idx[2] = -1
    sink = torch.full((2,), -INF, dtype=torch.float64)
    out, lse = sparse_mla_fwd_ref(q, kv, idx, None, sink, d_v=8)
    out0, lse0 = sparse_mla_fwd_ref(q, kv, idx, d_v=8)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    dout = torch.randn_like(out)
    dq, dkv, d_sink = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, None, sink, d_v=8)
    dq0, dkv0, none = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, None, None, d_v=8)
    assert none is None and torch.equal(dq, dq0) and torch.equal(dkv, dkv0)
    assert (d_sink == 0).all()


@pytest.mark.parametrize("compute_dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("big", [2.4e38, -2.4e38])
def test_saturating_finite_sink(big, compute_dtype):
    q, kv, idx = _inputs(4, 2, 8, 7, 5, seed=16)
    idx[1] = -1
    sink = torch.tensor([big, 0.5], dtype=torch.float32)   # legal fp32 values
    out, lse = sparse_mla_fwd_ref(q, kv, idx, None, sink, d_v=8, compute_dtype=compute_dtype)
    dout = torch.randn(out.shape, dtype=compute_dtype)
    dq, dkv, d_sink = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, None, sink, d_v=8,
                                         compute_dtype=compute_dtype)
    for t in (out, dq, dkv, d_sink):
        assert torch.isfinite(t).all()
    if big > 0:
        assert (out[:, 0] == 0).all() and (dq[:, 0] == 0).all()
    else:
        out0, _ = sparse_mla_fwd_ref(q, kv, idx, None, None, d_v=8, compute_dtype=compute_dtype)
        torch.testing.assert_close(out[:, 0], out0[:, 0], rtol=0, atol=0)
    if compute_dtype == torch.float64:
        _check_fwd_bwd(q, kv, idx, sink=sink.double())


def test_default_scale_and_explicit_scale():
    q, kv, idx = _inputs(3, 2, 12, 9, 6, seed=17)
    a, la = sparse_mla_fwd_ref(q, kv, idx, d_v=8)
    b, lb = sparse_mla_fwd_ref(q, kv, idx, softmax_scale=12 ** -0.5, d_v=8)
    assert torch.equal(a, b) and torch.equal(la, lb)
    _check_fwd_bwd(q, kv, idx, scale=0.7)


def test_chunking_does_not_change_results(monkeypatch):
    q, kv, idx = _inputs(13, 2, 8, 17, 9, seed=18)
    sink = torch.tensor([0.2, -0.4], dtype=torch.float64)
    out, lse = sparse_mla_fwd_ref(q, kv, idx, None, sink, d_v=8)
    dout = torch.randn_like(out)
    grads = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, None, sink, d_v=8)
    monkeypatch.setattr(ref, "_CHUNK_ELEMENTS", 1)        # one row per chunk
    out1, lse1 = sparse_mla_fwd_ref(q, kv, idx, None, sink, d_v=8)
    grads1 = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, None, sink, d_v=8)
    torch.testing.assert_close(out1, out, rtol=1e-13, atol=0)
    torch.testing.assert_close(lse1, lse, rtol=1e-13, atol=0)
    for a, b in zip(grads1, grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_bf16_inputs_and_empty_kv():
    q, kv, idx = _inputs(3, 2, 16, 6, 5, seed=19)
    out, lse = sparse_mla_fwd_ref(q.bfloat16(), kv.bfloat16(), idx, d_v=8)
    ref_out, ref_lse = _dense(q.bfloat16().double(), kv.bfloat16().double(), idx, d_v=8)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    empty_kv = torch.zeros(0, 16, dtype=torch.bfloat16)
    out, lse = sparse_mla_fwd_ref(q.bfloat16(), empty_kv, idx, d_v=8)
    assert (out == 0).all() and torch.isposinf(lse).all()
    dq, dkv, _ = sparse_mla_bwd_ref(q, empty_kv, out, torch.randn_like(out), lse, idx, d_v=8)
    assert dkv.shape == (0, 16) and (dq == 0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_matches_cpu():
    q, kv, idx = _inputs(6, 4, 16, 10, 7, seed=20)
    sink = torch.tensor([0.0, INF, -INF, 2.4e38], dtype=torch.float32)
    out, lse = sparse_mla_fwd_ref(q, kv, idx, None, sink, d_v=8)
    out_c, lse_c = sparse_mla_fwd_ref(q.cuda(), kv.cuda(), idx.cuda(), None, sink.cuda(), d_v=8)
    torch.testing.assert_close(out_c.cpu(), out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_c.cpu(), lse, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    grads = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, None, sink, d_v=8)
    grads_c = sparse_mla_bwd_ref(q.cuda(), kv.cuda(), out.cuda(), dout.cuda(), lse.cuda(), idx.cuda(),
                                 None, sink.cuda(), d_v=8)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-12, atol=1e-12)
