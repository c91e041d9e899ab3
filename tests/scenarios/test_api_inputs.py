"""Public API inputs on CPU: an ``InputError`` naming the argument, or the contract's result.

CPU tensors run the torch reference through ``dsa_aot.sparse_mla_fwd`` / ``sparse_mla_bwd``;
legal edge inputs are compared with a direct float64 evaluation of the contract written here.
"""

from __future__ import annotations

import math

import pytest
import torch

import dsa_aot

INF = float("inf")
S_Q, H, D, S_KV, K = 3, 16, 576, 7, 6
INT32_MIN = -(2**31)


def _inputs(d_qk: int = D, heads: int = H, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S_Q, heads, d_qk, generator=g).bfloat16()
    kv = torch.randn(S_KV, d_qk, generator=g).bfloat16()
    idx = torch.randint(0, S_KV, (S_Q, K), generator=g, dtype=torch.int32)
    return q, kv, idx


def _contract_fwd(q, kv, idx, length=None, sink=None, scale=None):
    """out, lse straight from the contract's definitions, in float64, one row at a time."""
    q64, kv64 = q.double(), kv.double()
    scale = q.shape[2] ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64)
    lse = torch.full((q.shape[0], q.shape[1]), INF, dtype=torch.float64)
    for t in range(q.shape[0]):
        n = idx.shape[1] if length is None else min(max(int(length[t]), 0), idx.shape[1])
        cols = [int(i) for i in idx[t, :n] if 0 <= int(i) < kv.shape[0]]
        if not cols:
            continue
        s = scale * q64[t] @ kv64[cols].T  # [H, n_valid]
        lse[t] = torch.logsumexp(s, dim=1)
        denom = lse[t] if sink is None else torch.logaddexp(lse[t], sink.double())
        out[t] = torch.exp(s - denom[:, None]) @ kv64[cols, :512]
    return out, lse


def _close(got, want, tol):
    got, want = got.double(), want.double()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert not torch.isnan(got).any()
    err = (got[finite] - want[finite]).norm() / max(want[finite].norm().item(), 1e-30)
    assert err < tol, err


def _check(res, q, kv, idx, **kw):
    out, lse = res
    want_out, want_lse = _contract_fwd(q, kv, idx, **kw)
    _close(out, want_out, 1e-2)
    _close(lse, want_lse, 1e-5)


# -- illegal inputs: InputError naming the argument ----------------------------------------------
def _t(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


BAD_FWD = {
    "q not a tensor": (lambda q, kv, i: ([[1.0]], kv, i, {}), "q must be a torch.Tensor"),
    "q rank 2": (lambda q, kv, i: (q[:, 0], kv, i, {}), "q must have 3 dims"),
    "q float32": (lambda q, kv, i: (q.float(), kv, i, {}), "q must be torch.bfloat16"),
    "q non-contiguous": (lambda q, kv, i: (q.transpose(0, 1).contiguous().transpose(0, 1), kv, i, {}),
                         "q must be contiguous"),
    "heads 8": (lambda q, kv, i: (q[:, :8].contiguous(), kv, i, {}), "q.shape[1] (heads)"),
    "heads 24": (lambda q, kv, i: (torch.cat([q, q[:, :8]], 1), kv, i, {}), "q.shape[1] (heads)"),
    "D_qk 256": (lambda q, kv, i: (q[..., :256].contiguous(), kv[:, :256].contiguous(), i, {}), "q.shape[2] (D_qk)"),
    "D_qk 640": (lambda q, kv, i: (_t(S_Q, H, 640), _t(S_KV, 640), i, {}), "q.shape[2] (D_qk)"),
    "kv rank 3": (lambda q, kv, i: (q, kv[None], i, {}), "kv must have 2 dims"),
    "kv float16": (lambda q, kv, i: (q, kv.half(), i, {}), "kv must be torch.bfloat16"),
    "kv on another device": (lambda q, kv, i: (q, kv.to("meta"), i, {}), "kv is on meta"),
    "kv width != D_qk": (lambda q, kv, i: (q, kv[:, :512].contiguous(), i, {}), "kv.shape[1]"),
    "kv non-contiguous": (lambda q, kv, i: (q, torch.cat([kv, kv], 1)[:, ::2], i, {}), "kv must be contiguous"),
    "topk_idxs int64": (lambda q, kv, i: (q, kv, i.long(), {}), "topk_idxs must be torch.int32"),
    "topk_idxs rank 1": (lambda q, kv, i: (q, kv, i[0], {}), "topk_idxs must have 2 dims"),
    "topk_idxs rows != S_q": (lambda q, kv, i: (q, kv, i[:2], {}), "topk_idxs.shape[0]"),
    "topk_idxs on another device": (lambda q, kv, i: (q, kv, i.to("meta"), {}), "topk_idxs is on meta"),
    "topk_length int64": (lambda q, kv, i: (q, kv, i, {"topk_length": torch.ones(S_Q, dtype=torch.int64)}),
                          "topk_length must be torch.int32"),
    "topk_length rows != S_q": (lambda q, kv, i: (q, kv, i, {"topk_length": torch.ones(S_Q + 1, dtype=torch.int32)}),
                                "topk_length.shape[0]"),
    "topk_length rank 2": (lambda q, kv, i: (q, kv, i, {"topk_length": torch.ones(S_Q, 1, dtype=torch.int32)}),
                           "topk_length must have 1 dims"),
    "attn_sink float16": (lambda q, kv, i: (q, kv, i, {"attn_sink": torch.zeros(H, dtype=torch.float16)}),
                          "attn_sink must be torch.float32"),
    "attn_sink length != H": (lambda q, kv, i: (q, kv, i, {"attn_sink": torch.zeros(H + 1)}), "attn_sink.shape[0]"),
    "softmax_scale 0": (lambda q, kv, i: (q, kv, i, {"softmax_scale": 0.0}), "softmax_scale"),
    "softmax_scale negative": (lambda q, kv, i: (q, kv, i, {"softmax_scale": -0.1}), "softmax_scale"),
    "softmax_scale nan": (lambda q, kv, i: (q, kv, i, {"softmax_scale": math.nan}), "softmax_scale"),
    "softmax_scale inf": (lambda q, kv, i: (q, kv, i, {"softmax_scale": INF}), "softmax_scale"),
    "softmax_scale text": (lambda q, kv, i: (q, kv, i, {"softmax_scale": "x"}), "softmax_scale"),
}


@pytest.mark.parametrize("case", sorted(BAD_FWD))
def test_bad_forward_input_names_the_argument(case):
    make, words = BAD_FWD[case]
    q, kv, idx, kw = make(*_inputs())
    with pytest.raises(dsa_aot.InputError) as err:
        dsa_aot.sparse_mla_fwd(q, kv, idx, **kw)
    argument = words.split()[0].split(".")[0]
    assert str(err.value).startswith(argument) and words in str(err.value), str(err.value)
    assert isinstance(err.value, ValueError)


def _bwd_args():
    q, kv, idx = _inputs()
    out, lse = dsa_aot.sparse_mla_fwd(q, kv, idx)
    return dict(q=q, kv=kv, out=out, dout=torch.randn_like(out.float()).bfloat16(), lse=lse, topk_idxs=idx)


BAD_BWD = {
    "out D_v 576": (lambda a: a.update(out=_t(S_Q, H, 576)), "out.shape"),
    "dout float32": (lambda a: a.update(dout=a["dout"].float()), "dout must be torch.bfloat16"),
    "dout wrong heads": (lambda a: a.update(dout=_t(S_Q, 32, 512)), "dout.shape"),
    "lse bf16": (lambda a: a.update(lse=a["lse"].bfloat16()), "lse must be torch.float32"),
    "lse wrong shape": (lambda a: a.update(lse=a["lse"][:, :8].contiguous()), "lse.shape"),
    "lse non-contiguous": (lambda a: a.update(lse=a["lse"].t().contiguous().t()), "lse must be contiguous"),
}


@pytest.mark.parametrize("case", sorted(BAD_BWD))
def test_bad_backward_input_names_the_argument(case):
    args = _bwd_args()
    edit, words = BAD_BWD[case]
    edit(args)
    with pytest.raises(dsa_aot.InputError) as err:
        dsa_aot.sparse_mla_bwd(**args)
    assert words in str(err.value)


# -- legal edge inputs: the contract's result ------------------------------------------------------
@pytest.mark.parametrize("lengths", [[-5, 0, 2], [K, K + 1, 2**31 - 1], [INT32_MIN, 3, K]])
def test_topk_length_outside_0_K_is_clamped(lengths):
    q, kv, idx = _inputs()
    length = torch.tensor(lengths, dtype=torch.int32)
    out, lse = dsa_aot.sparse_mla_fwd(q, kv, idx, topk_length=length)
    _check((out, lse), q, kv, idx, length=length)
    for t, n in enumerate(lengths):
        if n <= 0:
            assert torch.all(out[t] == 0) and torch.all(torch.isposinf(lse[t]))  # an empty row


def test_out_of_range_indices_are_padding():
    q, kv, idx = _inputs()
    idx[0, :4] = torch.tensor([-1, S_KV, INT32_MIN, 2147480000], dtype=torch.int32)
    idx[1, :] = -1  # a row with no valid slot
    out, lse = dsa_aot.sparse_mla_fwd(q, kv, idx)
    _check((out, lse), q, kv, idx)
    assert torch.all(out[1] == 0) and torch.all(torch.isposinf(lse[1]))
    compact_len = torch.full((S_Q,), K, dtype=torch.int32)
    _check(dsa_aot.sparse_mla_fwd(q, kv, idx, topk_length=compact_len), q, kv, idx, length=compact_len)


def test_topk_wider_than_s_kv():
    q, kv, _ = _inputs()
    idx = torch.arange(3 * S_KV, dtype=torch.int32).remainder(S_KV).repeat(S_Q, 1)  # K=21 > S_kv=7
    _check(dsa_aot.sparse_mla_fwd(q, kv, idx), q, kv, idx)


@pytest.mark.parametrize("sink_value", [INF, -INF, 2.4e38, -2.4e38, 0.3])
def test_attn_sink_extremes(sink_value):
    q, kv, idx = _inputs()
    sink = torch.full((H,), sink_value)
    sink[1] = 0.5  # mixed heads
    out, lse = dsa_aot.sparse_mla_fwd(q, kv, idx, attn_sink=sink)
    _check((out, lse), q, kv, idx, sink=sink)
    _, lse_plain = dsa_aot.sparse_mla_fwd(q, kv, idx)
    assert torch.equal(lse, lse_plain)  # lse excludes the sink
    if sink_value in (INF, 2.4e38):
        assert torch.all(out[:, 0] == 0)  # the sink takes all the mass
    if sink_value in (-INF, -2.4e38):
        out_plain, _ = dsa_aot.sparse_mla_fwd(q, kv, idx)
        assert torch.equal(out[:, 0], out_plain[:, 0])  # no effect
    dq, dkv, d_sink = dsa_aot.sparse_mla_bwd(q, kv, out, torch.randn_like(out.float()).bfloat16(), lse, idx,
                                             attn_sink=sink)
    for grad in (dq, dkv, d_sink):
        assert torch.isfinite(grad.float()).all()


@pytest.mark.parametrize("d_qk", [512, 576])
@pytest.mark.parametrize("heads", [16, 32, 64, 128])
def test_every_catalog_shape_is_accepted(d_qk, heads):
    q, kv, idx = _inputs(d_qk, heads)
    out, lse = dsa_aot.sparse_mla_fwd(q, kv, idx)
    assert out.shape == (S_Q, heads, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (S_Q, heads) and lse.dtype == torch.float32


def test_differentiable_op_reports_the_same_errors():
    q, kv, idx = _inputs()
    with pytest.raises(dsa_aot.InputError, match="topk_idxs must be torch.int32"):
        dsa_aot.sparse_mla(q.requires_grad_(), kv, idx.long())
