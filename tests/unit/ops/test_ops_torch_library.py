"""The torch.library ops on CPU (torch reference kernels): schema, fake tensors, autograd, compile.

What ``torch.compile`` and CUDA graph capture rely on that a CPU machine can check: the ops'
schemas and tags, ``torch.library.opcheck`` (schema, autograd registration, fake tensors,
AOT dispatch with dynamic shapes), a full-graph ``torch.compile`` of forward and backward, and
shape-only calls on the meta device.
"""

from __future__ import annotations

import pytest
import torch

import dsa_aot

S_Q, H, D, S_KV, K = 3, 16, 576, 7, 6


def _inputs(seed: int = 0, sink: bool = True, length: bool = False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S_Q, H, D, generator=g).bfloat16()
    kv = torch.randn(S_KV, D, generator=g).bfloat16()
    idx = torch.randint(-1, S_KV, (S_Q, K), generator=g, dtype=torch.int32)
    topk_length = torch.tensor([K, 2, 0], dtype=torch.int32) if length else None
    attn_sink = torch.randn(H, generator=g) if sink else None
    return q, kv, idx, topk_length, attn_sink


def test_ops_are_pt2_compliant():
    for op in (torch.ops.dsa_aot.sparse_mla_fwd.default, torch.ops.dsa_aot.sparse_mla_bwd.default):
        assert torch.Tag.pt2_compliant_tag in op.tags


@pytest.mark.parametrize("sink", [True, False])
@pytest.mark.parametrize("length", [True, False])
def test_opcheck_fwd(sink, length):
    q, kv, idx, topk_length, attn_sink = _inputs(sink=sink, length=length)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    if attn_sink is not None:
        attn_sink.requires_grad_(True)
    torch.library.opcheck(torch.ops.dsa_aot.sparse_mla_fwd.default, (q, kv, idx, topk_length, attn_sink, None))


def test_opcheck_bwd():
    q, kv, idx, topk_length, attn_sink = _inputs(length=True)
    out, lse = dsa_aot.sparse_mla_fwd(q, kv, idx, topk_length=topk_length, attn_sink=attn_sink)
    dout = torch.randn_like(out, dtype=torch.float32).bfloat16()
    torch.library.opcheck(torch.ops.dsa_aot.sparse_mla_bwd.default,
                          (q, kv, out, dout, lse, idx, topk_length, attn_sink, 0.05))


def test_meta_tensors_get_the_output_shapes():
    q, kv, idx, topk_length, attn_sink = (None if t is None else t.to("meta") for t in _inputs(length=True))
    out, lse = torch.ops.dsa_aot.sparse_mla_fwd(q, kv, idx, topk_length, attn_sink, None)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((S_Q, H, 512), torch.bfloat16, (S_Q, H), torch.float32)
    dq, dkv, d_sink = torch.ops.dsa_aot.sparse_mla_bwd(q, kv, out, out, lse, idx, topk_length, attn_sink, None)
    assert (dq.shape, dkv.shape, d_sink.shape) == (q.shape, kv.shape, (H,))


def _loss_and_grads(fn, q, kv, idx, topk_length, attn_sink):
    q, kv, attn_sink = (t.detach().clone().requires_grad_(True) for t in (q, kv, attn_sink))
    out, lse = fn(q, kv, idx, topk_length, attn_sink)
    (out.float().square().sum() + torch.where(torch.isinf(lse), 0, lse).sum()).backward()
    return out.detach(), lse.detach(), q.grad, kv.grad, attn_sink.grad


def test_full_graph_compile_matches_eager_forward_and_backward():
    def f(q, kv, idx, topk_length, attn_sink):
        return dsa_aot.sparse_mla(q, kv, idx, topk_length=topk_length, attn_sink=attn_sink)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    inputs = _inputs(length=True)
    for got, want in zip(_loss_and_grads(compiled, *inputs), _loss_and_grads(f, *inputs)):
        assert torch.equal(got, want)


def test_gradients_match_the_functional_backward():
    q, kv, idx, topk_length, attn_sink = _inputs(length=True)
    out, lse, dq, dkv, d_sink = _loss_and_grads(
        lambda *a: dsa_aot.sparse_mla(a[0], a[1], a[2], topk_length=a[3], attn_sink=a[4]),
        q, kv, idx, topk_length, attn_sink)
    dout = (2 * out.float()).bfloat16()
    want = dsa_aot.sparse_mla_bwd(q, kv, out, dout, lse, idx, topk_length=topk_length, attn_sink=attn_sink)
    for got, ref in zip((dq, dkv, d_sink), want):
        assert torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=1e-3)


def test_no_sink_gets_no_sink_gradient_and_lse_is_not_differentiable():
    q, kv, idx, _, _ = _inputs(sink=False)
    q.requires_grad_(True)
    out, lse = dsa_aot.sparse_mla(q, kv, idx)
    assert out.requires_grad and not lse.requires_grad
    out.float().sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_double_backward_is_refused():
    q, kv, idx, _, attn_sink = _inputs()
    q.requires_grad_(True)
    out, _ = dsa_aot.sparse_mla(q, kv, idx, attn_sink=attn_sink)
    (dq,) = torch.autograd.grad(out.float().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        dq.float().sum().backward()
