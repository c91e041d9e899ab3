"""The deterministic backward on a GPU: the same bits on every call and in every process for
the same inputs, and the same accuracy against the torch reference as the fast mode.

Run on the H200 with the prebuilt cache (its -det specs): DSA_AOT_PREBUILT_DIR=... pytest -m gpu
tests/gpu/test_deterministic_gpu.py
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

import dsa_aot
from dsa_aot import settings
from dsa_aot.kernels.reference import sparse_mla_bwd_ref
from dsa_aot.runners import d_sink_parts, fixed_point_scale

from test_sparse_mla_gpu import inputs, poison, rel

pytestmark = pytest.mark.gpu

VARIANTS = list(itertools.product((512, 576), (16, 32, 64, 128), ("compact", "noncompact")))


def det_bwd(q, kv, out, dout, lse, idx, length, sink):
    poison((tuple(q.shape), torch.bfloat16), (tuple(kv.shape), torch.bfloat16))
    return dsa_aot.sparse_mla_bwd(q, kv, out, dout, lse, idx, topk_length=length, attn_sink=sink,
                                  deterministic=True)


def forward(q, kv, idx, length, sink):
    return dsa_aot.sparse_mla_fwd(q, kv, idx, topk_length=length, attn_sink=sink)


def check_against_reference(grads, q, kv, out, dout, lse, idx, length, sink) -> None:
    dq, dkv, d_sink = grads
    rq, rkv, rsink = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, length, sink, compute_dtype=torch.float32)
    assert rel(dq, rq) <= 1e-2
    assert rel(dkv, rkv) <= 1e-2
    if sink is not None:
        assert rel(d_sink, rsink) <= 1e-2


def digest(*tensors: torch.Tensor | None) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def assert_repeats(n, call) -> tuple[torch.Tensor, ...]:
    first = call()
    torch.cuda.synchronize()
    for _ in range(n - 1):
        again = call()
        torch.cuda.synchronize()
        for a, b in zip(first, again):
            if a is not None:
                assert torch.equal(a, b), "a deterministic gradient changed between two identical calls"
    return first


@pytest.mark.parametrize("d,h,layout", VARIANTS, ids=[f"d{d}-h{h}-{l}" for d, h, l in VARIANTS])
def test_every_variant_matches_the_reference_and_repeats(d, h, layout):
    for i, (s_q, s_kv, k) in enumerate([(1, 95, 128), (62, 4096, 2048), (300, 1000, 300)]):
        q, kv, idx, length, sink, dout = inputs(s_q, s_kv, h, d, k, layout=layout, seed=i, sink=i != 1)
        out, lse = forward(q, kv, idx, length, sink)
        grads = assert_repeats(2, lambda: det_bwd(q, kv, out, dout, lse, idx, length, sink))
        check_against_reference(grads, q, kv, out, dout, lse, idx, length, sink)


@pytest.mark.parametrize("h,layout", [(64, "noncompact"), (128, "compact"), (16, "noncompact")])
def test_bit_identical_over_twenty_calls(h, layout):
    q, kv, idx, length, sink, dout = inputs(1024, 4096, h, 576, 2048, layout=layout, seed=7)
    out, lse = forward(q, kv, idx, length, sink)
    grads = assert_repeats(20, lambda: det_bwd(q, kv, out, dout, lse, idx, length, sink))
    check_against_reference(grads, q, kv, out, dout, lse, idx, length, sink)


@pytest.mark.parametrize("pattern", ["few_rows", "one_row_per_query", "runs"])
def test_heavily_repeated_indices(pattern):
    """Duplicates inside a block of 64 slots (up to 64 of one row), across blocks and across
    queries: each duplicate adds, in slot order, every call."""
    s_q, s_kv, h, d, k = 256, 512, 64, 576, 300
    q, kv, idx, length, sink, dout = inputs(s_q, s_kv, h, d, k, seed=3)
    g = torch.Generator(device="cuda").manual_seed(11)
    if pattern == "few_rows":
        idx = torch.randint(0, 8, (s_q, k), generator=g, device="cuda", dtype=torch.int32)
    elif pattern == "one_row_per_query":
        idx = torch.randint(0, s_kv, (s_q, 1), generator=g, device="cuda", dtype=torch.int32).expand(s_q, k)
    else:
        idx = (torch.arange(k, device="cuda", dtype=torch.int32) // 37).expand(s_q, k) + \
            torch.randint(0, 4, (s_q, 1), generator=g, device="cuda", dtype=torch.int32)
    idx = idx.contiguous()
    idx[:, ::17] = -1  # padding between the duplicates
    out, lse = forward(q, kv, idx, None, sink)
    grads = assert_repeats(20, lambda: det_bwd(q, kv, out, dout, lse, idx, None, sink))
    check_against_reference(grads, q, kv, out, dout, lse, idx, None, sink)


CHILD = """
import hashlib, json, sys, torch
sys.path.insert(0, {here!r})
import dsa_aot
from test_sparse_mla_gpu import inputs
from test_deterministic_gpu import digest
q, kv, idx, length, sink, dout = inputs(777, 3000, 64, 576, 1000, layout="compact", seed=5)
out, lse = dsa_aot.sparse_mla_fwd(q, kv, idx, topk_length=length, attn_sink=sink)
dq, dkv, ds = dsa_aot.sparse_mla_bwd(q, kv, out, dout, lse, idx, topk_length=length, attn_sink=sink)
print(json.dumps({{"grads": digest(dq, dkv, ds), "fwd": digest(out, lse)}}))
"""


def test_same_bits_in_other_processes():
    """Two fresh processes (deterministic through DSA_AOT_DETERMINISTIC=1) and this one agree."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, DSA_AOT_DETERMINISTIC="1")
    digests = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", CHILD.format(here=here)], env=env, capture_output=True,
                              text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        digests.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    q, kv, idx, length, sink, dout = inputs(777, 3000, 64, 576, 1000, layout="compact", seed=5)
    out, lse = forward(q, kv, idx, length, sink)
    mine = digest(*det_bwd(q, kv, out, dout, lse, idx, length, sink))
    assert digests[0] == digests[1]
    assert digests[0]["fwd"] == digest(out, lse)  # the same inputs reached the backward
    assert digests[0]["grads"] == mine


def test_autograd_and_the_setting_select_the_deterministic_kernel():
    q, kv, idx, length, sink, dout = inputs(128, 2048, 128, 512, 1024, seed=9)
    out, lse = forward(q, kv, idx, length, sink)
    want = det_bwd(q, kv, out, dout, lse, idx, length, sink)
    with settings.scope(deterministic=True):
        assert all(torch.equal(a, b) for a, b in zip(want, dsa_aot.sparse_mla_bwd(
            q, kv, out, dout, lse, idx, topk_length=length, attn_sink=sink)))
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, kv, sink)]
    o, _ = dsa_aot.sparse_mla(leaves[0], leaves[1], idx, attn_sink=leaves[2], deterministic=True)
    o.backward(dout)
    for leaf, w in zip(leaves, want):
        assert torch.equal(leaf.grad, w)


def fast_bwd(q, kv, out, dout, lse, idx, length, sink):
    return dsa_aot.sparse_mla_bwd(q, kv, out, dout, lse, idx, topk_length=length, attn_sink=sink,
                                  deterministic=False)


@pytest.mark.parametrize("h,d", [(64, 576), (128, 512), (16, 576), (32, 512)])
def test_fixed_point_dkv_is_as_accurate_as_the_fast_mode(h, d):
    """The int64 fixed-point sums lose nothing against the fast mode's fp32 atomics: both are as
    close to the fp32 reference, and to each other."""
    q, kv, idx, length, sink, dout = inputs(512, 8192, h, d, 2048, seed=4)
    out, lse = forward(q, kv, idx, length, sink)
    det = det_bwd(q, kv, out, dout, lse, idx, length, sink)
    fast = fast_bwd(q, kv, out, dout, lse, idx, length, sink)
    _, rkv, _ = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, length, sink, compute_dtype=torch.float32)
    assert torch.equal(det[0], fast[0])  # dq: the same kernel, no atomics
    assert rel(det[1], rkv) <= 1.05 * rel(fast[1], rkv) + 1e-5
    assert rel(det[1], fast[1]) <= 5e-3


def test_a_dominant_kv_row_neither_overflows_nor_loses_the_small_rows():
    """Every query puts most of its attention on KV row 0 (an attention sink in the KV): row 0's
    dkv is the largest partial sum the bound must cover, the other rows' are about 1e3 times
    smaller and must keep their accuracy under the same scale."""
    s_q, s_kv, h, d, k = 1024, 2048, 64, 576, 512
    q, kv, idx, length, sink, dout = inputs(s_q, s_kv, h, d, k, layout="noncompact", seed=6)
    idx[:, 0] = 0
    idx[:, 1:] = torch.where(idx[:, 1:] == 0, 1, idx[:, 1:])  # row 0 in slot 0 only
    u = torch.randn((d,), generator=torch.Generator(device="cuda").manual_seed(12), device="cuda")
    q = (q.float() + u).to(torch.bfloat16)  # every query leans towards u ...
    kv = kv.clone()
    kv[0] = (0.4 * u).to(torch.bfloat16)  # ... and row 0's key is u: score ~10 above the others'
    idx = idx.contiguous()
    out, lse = forward(q, kv, idx, length, sink)
    grads = assert_repeats(3, lambda: det_bwd(q, kv, out, dout, lse, idx, length, sink))
    _, rkv, _ = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, length, sink, compute_dtype=torch.float32)
    assert torch.isfinite(grads[1]).all()
    assert rel(grads[1][:1], rkv[:1]) <= 1e-2
    assert rel(grads[1][1:], rkv[1:]) <= 1e-2  # the small rows, on their own
    fast = fast_bwd(q, kv, out, dout, lse, idx, length, sink)
    assert rel(grads[1][1:], rkv[1:]) <= 1.05 * rel(fast[1][1:], rkv[1:]) + 1e-5


def test_a_nan_input_gives_a_nan_dkv_as_the_fast_mode_does():
    q, kv, idx, length, sink, dout = inputs(64, 1024, 64, 576, 256, seed=8)
    out, lse = forward(q, kv, idx, length, sink)
    dout = dout.clone()
    dout[3, 5, 7] = float("nan")
    dq, dkv, _ = det_bwd(q, kv, out, dout, lse, idx, length, sink)
    assert torch.isnan(dkv).all()  # the bound is NaN: no finite value is claimed


def preprocess_scale(q, kv, out, dout, lse, sink, scale) -> torch.Tensor:
    """``dkv_scale`` as the loaded deterministic preprocess computes it (that stage alone)."""
    s_q, h, d = q.shape
    kernel = dsa_aot.ops._kernel("bwd", q.device, d, h, "noncompact", True)
    work = torch.zeros(8, dtype=torch.int32, device="cuda")
    delta = torch.empty((s_q, h), dtype=torch.float32, device="cuda")
    parts = torch.empty((d_sink_parts(s_q), h), dtype=torch.float32, device="cuda")
    kernel.pre(out=out, dout=dout, lse=lse, attn_sink=sink, delta=delta, lse_sink=torch.empty_like(delta),
               d_sink_acc=parts, q=q, kv=kv, dkv_max=work[:5], dkv_scale=work[6:].view(torch.float32),
               softmax_scale=scale)
    torch.cuda.synchronize()
    assert work[4].item() == parts.shape[0] * -(-h // 4)  # every CTA took a ticket
    return work[6:].view(torch.float32).clone()


@pytest.mark.parametrize("h,d,s_q,s_kv", [(64, 576, 4096, 8192), (16, 512, 1, 95), (128, 576, 300, 1000),
                                          (32, 512, 7000, 70000)])
def test_the_preprocess_computes_the_reference_scale_on_the_gpu(h, d, s_q, s_kv):
    """The deterministic preprocess finds max |q|, |kv|, |out|, |dout| with integer atomics and
    its last CTA turns them into ``[2^k, 2^-k]``: bit for bit what ``fixed_point_scale`` gives,
    for plain, scaled, all-zero, NaN, infinite and out-of-range inputs."""
    q, kv, idx, length, sink, dout = inputs(min(s_q, 512), min(s_kv, 4096), h, d, 64, seed=11)
    out, lse = forward(q, kv, idx, length, sink)
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn((s_q, h, d), generator=g, device="cuda").bfloat16()
    kv = torch.randn((s_kv, d), generator=g, device="cuda").bfloat16()
    out = out.repeat(-(-s_q // out.shape[0]), 1, 1)[:s_q].contiguous()
    dout = torch.randn((s_q, h, 512), generator=g, device="cuda").bfloat16()
    lse = lse.repeat(-(-s_q // lse.shape[0]), 1)[:s_q].contiguous()
    scale = d ** -0.5
    kv_spike = kv.clone()
    kv_spike[s_kv - 1, d - 1] = -300.0  # the largest |kv| in the last row, last column
    cases = {"plain": (q, kv, out, dout), "scaled": (q * 1e3, kv * 1e-2, out, dout * 7),
             "kv spike": (q, kv_spike, out, dout),
             "zero q": (torch.zeros_like(q), kv, out, dout), "all zero": tuple(torch.zeros_like(t) for t in (q, kv, out, dout)),
             "huge": (q.clone().fill_(2.0 ** 120), kv.clone().fill_(2.0 ** 120), out, dout)}
    for name, value in (("nan q", float("nan")), ("inf kv", float("inf"))):
        bad_q, bad_kv = q.clone(), kv.clone()
        (bad_q if name == "nan q" else bad_kv).view(-1)[-1] = value
        cases[name] = (bad_q, bad_kv, out, dout)
    for name, (q_, kv_, out_, dout_) in cases.items():
        got = preprocess_scale(q_, kv_, out_, dout_, lse, sink, scale)
        want = fixed_point_scale(q_, kv_, out_, dout_, scale)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (name, got.tolist(), want.tolist())
