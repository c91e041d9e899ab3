"""The public API on a GPU against the torch reference: every (D_qk, H, layout), several
shapes, every seed edge case. Outputs are NaN-poisoned first (the caching allocator hands
the poisoned blocks back), inputs are random, NaN never passes.

Run on the H200 with the prebuilt cache: DSA_AOT_PREBUILT_DIR=... pytest -m gpu tests/gpu
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

import dsa_aot
from dsa_aot.kernels.reference import sparse_mla_bwd_ref, sparse_mla_fwd_ref

pytestmark = pytest.mark.gpu

INT32_MIN = -(2**31)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the kernel output"
    denom = b.norm()
    return float((a - b).norm() / denom) if denom > 0 else float((a - b).norm())


def poison(*shapes_dtypes) -> None:
    """Fill blocks of the output sizes with NaN and free them, so torch.empty reuses them."""
    blocks = [torch.full(s, float("nan"), dtype=d, device="cuda") for s, d in shapes_dtypes]
    del blocks


def inputs(s_q, s_kv, h, d, k, *, layout="noncompact", sink=True, seed=0, invalid_frac=0.1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((s_q, h, d), generator=g, device="cuda").to(torch.bfloat16)
    kv = torch.randn((s_kv, d), generator=g, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, k), generator=g, device="cuda", dtype=torch.int32)
    bad = torch.rand((s_q, k), generator=g, device="cuda") < invalid_frac
    idx = torch.where(bad, torch.full_like(idx, -1), idx)
    length = None
    if layout == "compact":
        length = torch.randint(-2, k + 3, (s_q,), generator=g, device="cuda", dtype=torch.int32)
    attn_sink = torch.randn((h,), generator=g, device="cuda") if sink else None
    dout = torch.randn((s_q, h, 512), generator=g, device="cuda").to(torch.bfloat16)
    return q, kv, idx, length, attn_sink, dout


def run_fwd(q, kv, idx, length, sink):
    poison(((q.shape[0], q.shape[1], 512), torch.bfloat16), ((q.shape[0], q.shape[1]), torch.float32))
    return dsa_aot.sparse_mla_fwd(q, kv, idx, topk_length=length, attn_sink=sink)


def run_bwd(q, kv, out, dout, lse, idx, length, sink):
    poison((tuple(q.shape), torch.bfloat16), (tuple(kv.shape), torch.bfloat16))
    return dsa_aot.sparse_mla_bwd(q, kv, out, dout, lse, idx, topk_length=length, attn_sink=sink)


def check_fwd(q, kv, idx, length, sink):
    out, lse = run_fwd(q, kv, idx, length, sink)
    torch.cuda.synchronize()
    ref_out, ref_lse = sparse_mla_fwd_ref(q, kv, idx, length, sink, compute_dtype=torch.float32)
    assert rel(out, ref_out) <= 5e-3
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and not torch.isnan(lse).any()
    assert (lse[~finite] == float("inf")).all()
    if finite.any():
        assert float((lse[finite] - ref_lse[finite]).abs().max()) <= 1e-3
    return out, lse


def check_bwd(q, kv, out, lse, dout, idx, length, sink):
    dq, dkv, d_sink = run_bwd(q, kv, out, dout, lse, idx, length, sink)
    torch.cuda.synchronize()
    rq, rkv, rsink = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, length, sink, compute_dtype=torch.float32)
    assert rel(dq, rq) <= 1e-2
    assert rel(dkv, rkv) <= 1e-2
    if sink is not None:
        assert rel(d_sink, rsink) <= 1e-2
    else:
        assert d_sink is None
    return dq, dkv, d_sink


VARIANTS = list(itertools.product((512, 576), (16, 32, 64, 128), ("compact", "noncompact")))
SHAPES = list(itertools.product((1, 62, 1024), (95, 4096), (128, 2048)))


@pytest.mark.parametrize("d,h,layout", VARIANTS, ids=[f"d{d}-h{h}-{l}" for d, h, l in VARIANTS])
def test_every_variant_every_shape(d, h, layout):
    for i, (s_q, s_kv, k) in enumerate(SHAPES):
        q, kv, idx, length, sink, dout = inputs(s_q, s_kv, h, d, k, layout=layout, seed=i, sink=i % 2 == 0)
        out, lse = check_fwd(q, kv, idx, length, sink)
        check_bwd(q, kv, out, lse, dout, idx, length, sink)


@pytest.mark.parametrize("pattern", ["rising", "falling", "odd_blocks_higher"])
@pytest.mark.parametrize("d,h,layout", [(576, 64, "compact"), (512, 128, "noncompact"), (576, 16, "noncompact")])
def test_running_max_moves_between_blocks(pattern, d, h, layout):
    """Score levels that change from one block of 64 slots to the next (every block moves the
    running max; K 677 leaves a partial last block): the online softmax's rescaling, also when
    warpgroups take turns over blocks."""
    s_q, k = 5, 677
    g = torch.Generator(device="cuda").manual_seed(len(pattern))
    v = torch.randn(d, generator=g, device="cuda")
    q = (v + 0.5 * torch.randn(s_q, h, d, generator=g, device="cuda")).to(torch.bfloat16)
    block = torch.arange(k, device="cuda") // 64
    level = {"rising": 1.5 * block, "falling": -1.5 * block, "odd_blocks_higher": 3.0 * (block % 2)}[pattern]
    kv = (level.float()[:, None] / (d ** -0.5 * v.dot(v)) * v + torch.randn(k, d, generator=g, device="cuda"))
    idx = torch.arange(k, dtype=torch.int32, device="cuda").repeat(s_q, 1)
    length = torch.full((s_q,), k, dtype=torch.int32, device="cuda") if layout == "compact" else None
    sink = torch.randn(h, generator=g, device="cuda")
    dout = torch.randn((s_q, h, 512), generator=g, device="cuda").to(torch.bfloat16)
    out, lse = check_fwd(q, kv.to(torch.bfloat16), idx, length, sink)
    check_bwd(q, kv.to(torch.bfloat16), out, lse, dout, idx, length, sink)


@pytest.mark.parametrize("layout", ["compact", "noncompact"])
def test_empty_rows_and_topk_length_bounds(layout):
    s_q, s_kv, h, d, k = 64, 300, 64, 576, 200
    q, kv, idx, length, sink, dout = inputs(s_q, s_kv, h, d, k, layout=layout)
    idx[:8] = -1                                   # rows with every slot invalid
    if layout == "compact":
        length[8:16] = 0
        length[16:24] = -5                         # topk_length <= 0: empty
        length[24:32] = k + 100                    # > K: clamped to K
    out, lse = check_fwd(q, kv, idx, length, sink)
    assert (out[:8] == 0).all() and (lse[:8] == float("inf")).all()
    if layout == "compact":
        assert (out[8:24] == 0).all() and (lse[8:24] == float("inf")).all()
    dq, dkv, _ = check_bwd(q, kv, out, lse, dout, idx, length, sink)
    assert (dq[:8] == 0).all()


@pytest.mark.parametrize("layout", ["compact", "noncompact"])
def test_padded_tail_with_very_negative_lse(layout):
    """Scores ~ -100: lse < -80, so an unmasked zero score would give exp(-lse) = inf, inf*0 = NaN."""
    s_q, s_kv, h, d, k = 32, 128, 64, 576, 100       # K not a multiple of the tile
    g = torch.Generator(device="cuda").manual_seed(3)
    u = torch.randn((d,), generator=g, device="cuda")
    u = u / u.norm()
    kv = (u[None, :] * 10 + 0.01 * torch.randn((s_kv, d), generator=g, device="cuda")).to(torch.bfloat16)
    scale = d ** -0.5
    q = (-u[None, None, :] * (100 / (10 * scale)) + 0.01 * torch.randn((s_q, h, d), generator=g, device="cuda"))
    q = q.to(torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, k), generator=g, device="cuda", dtype=torch.int32)
    length = None
    if layout == "compact":
        length = torch.full((s_q,), 37, dtype=torch.int32, device="cuda")
    else:
        idx[:, 37:] = -1
    dout = torch.randn((s_q, h, 512), generator=g, device="cuda").to(torch.bfloat16)
    out, lse = check_fwd(q, kv, idx, length, None)
    assert float(lse.max()) < -80
    check_bwd(q, kv, out, lse, dout, idx, length, None)


@pytest.mark.parametrize("k", [300, 2048])
@pytest.mark.parametrize("h", [16, 64, 128])
def test_noncompact_rows_end_at_their_last_valid_slot(h, k):
    """A noncompact row's blocks end at its last valid slot, forward and backward: trailing
    padding of every length (none, within a block, whole blocks, whole 256-slot scan steps, the
    whole row), a lone valid slot at either end, out-of-range values in the tail. Each mode matches the reference, and dq
    equals the compact layout's with ``topk_length`` at the same ends."""
    s_kv, d = 4096, 576
    ends = [k, k - 1, 0, 1, 63, 64, 65, 255, 256, 257, k // 2, 129]
    s_q = len(ends) + 4
    q, kv, idx, _, sink, dout = inputs(s_q, s_kv, h, d, k, invalid_frac=0.0)
    for r, end in enumerate(ends):
        idx[r, end:] = -1
    idx[len(ends), :k - 1] = -1                    # only the last slot valid
    idx[len(ends) + 1, 1:] = -1                    # only the first
    idx[len(ends) + 2, 200:] = s_kv                # out of range past slot 200
    idx[len(ends) + 3, 37:] = INT32_MIN
    out, lse = check_fwd(q, kv, idx, None, sink)
    dq, _, _ = check_bwd(q, kv, out, lse, dout, idx, None, sink)
    length = torch.tensor(ends, dtype=torch.int32, device="cuda")
    n = len(ends)
    cdq, _, _ = run_bwd(q[:n], kv, out[:n], dout[:n], lse[:n], idx[:n], length, sink)
    assert rel(dq[:n], cdq) <= 1e-6
    det = dsa_aot.sparse_mla_bwd(q, kv, out, dout, lse, idx, attn_sink=sink, deterministic=True)
    _, rkv, _ = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, None, sink, compute_dtype=torch.float32)
    assert torch.equal(det[0], dq) and rel(det[1], rkv) <= 1e-2


def test_topk_wider_than_kv_keeps_dkv():
    """K > S_kv with valid indices in columns >= S_kv: their dkv must not be dropped."""
    s_q, s_kv, h, d, k = 16, 40, 64, 512, 256
    q, kv, idx, length, sink, dout = inputs(s_q, s_kv, h, d, k, invalid_frac=0.0)
    idx[:, :200] = -1                               # every valid slot sits in a column >= S_kv
    out, lse = check_fwd(q, kv, idx, None, sink)
    _, dkv, _ = check_bwd(q, kv, out, lse, dout, idx, None, sink)
    assert dkv.abs().sum() > 0


@pytest.mark.parametrize("bad", [-1, 95, INT32_MIN, 2147480000])
def test_out_of_range_indices_are_padding(bad):
    s_q, s_kv, h, d, k = 62, 95, 32, 576, 128
    q, kv, idx, length, sink, dout = inputs(s_q, s_kv, h, d, k, invalid_frac=0.0)
    idx[:, ::3] = bad
    out, lse = check_fwd(q, kv, idx, None, sink)
    check_bwd(q, kv, out, lse, dout, idx, None, sink)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), 2.4e38, -2.4e38])
def test_saturating_sinks(value):
    s_q, s_kv, h, d, k = 62, 4096, 64, 576, 128
    q, kv, idx, length, sink, dout = inputs(s_q, s_kv, h, d, k)
    sink[::2] = value
    out, lse = check_fwd(q, kv, idx, None, sink)
    dq, dkv, d_sink = check_bwd(q, kv, out, lse, dout, idx, None, sink)
    assert torch.isfinite(d_sink).all()
    if value > 0:
        assert (out[:, ::2] == 0).all() and (dq[:, ::2] == 0).all()


def test_autograd_matches_functional():
    q, kv, idx, length, sink, dout = inputs(62, 4096, 64, 576, 2048, layout="compact")
    q.requires_grad_(True)
    kv.requires_grad_(True)
    sink.requires_grad_(True)
    out, lse = dsa_aot.sparse_mla(q, kv, idx, topk_length=length, attn_sink=sink)
    out.backward(dout)
    dq, dkv, d_sink = dsa_aot.sparse_mla_bwd(q.detach(), kv.detach(), out.detach(), dout, lse, idx,
                                             topk_length=length, attn_sink=sink.detach())
    # dq is exact; dkv sums fp32 atomics in a run-dependent order, so a few bf16 roundings differ
    # between two calls (1.2e-5 to 1.4e-5 seen on the H200): not a difference between the paths
    assert rel(q.grad, dq) < 1e-5 and rel(kv.grad, dkv) < 1e-4
    assert rel(sink.grad, d_sink) < 1e-5


def test_cuda_graph_capture_replays():
    q, kv, idx, length, sink, _ = inputs(62, 4096, 64, 576, 2048)
    out, lse = dsa_aot.sparse_mla_fwd(q, kv, idx, attn_sink=sink)   # load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = dsa_aot.sparse_mla_fwd(q, kv, idx, attn_sink=sink)
    q.copy_(torch.randn_like(q, dtype=torch.float32).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, _ = dsa_aot.sparse_mla_fwd(q, kv, idx, attn_sink=sink)
    assert torch.equal(g_out, ref_out)


@pytest.mark.parametrize("h,layout", [(64, "compact"), (16, "noncompact")])
def test_cuda_graph_capture_replays_the_backward(h, layout):
    """The backward queues its stages without waiting for the host, so a training step can
    capture it: a replay with a new dout matches an eager call up to the order of fp32 atomic
    adds (dkv: where two orders' fp32 sums round to neighbouring bf16 values, a few dozen
    elements of 2.4 M differ by one bf16 step, about 1e-5 of the norm; a stale replay differs
    by about 1)."""
    q, kv, idx, length, sink, dout = inputs(200, 4096, h, 576, 1024, layout=layout, seed=3)
    out, lse = dsa_aot.sparse_mla_fwd(q, kv, idx, topk_length=length, attn_sink=sink)

    def call():
        return dsa_aot.sparse_mla_bwd(q, kv, out, dout, lse, idx, topk_length=length, attn_sink=sink)

    call()  # load the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_dq, g_dkv, g_sink = call()
    dout.copy_(torch.randn_like(dout, dtype=torch.float32).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    dq, dkv, d_sink = call()
    assert rel(g_dq, dq) < 1e-6 and rel(g_dkv, dkv) < 1e-4 and rel(g_sink, d_sink) < 1e-6


@pytest.mark.skipif(not os.environ.get("DSA_AOT_PREBUILT_DIR"), reason="needs a prebuilt root")
def test_fresh_process_hit_imports_no_compiler():
    code = ("import sys, torch, dsa_aot\n"
            "q = torch.randn(4, 64, 576, device='cuda').to(torch.bfloat16)\n"
            "kv = torch.randn(128, 576, device='cuda').to(torch.bfloat16)\n"
            "i = torch.randint(0, 128, (4, 128), device='cuda', dtype=torch.int32)\n"
            "o, l = dsa_aot.sparse_mla_fwd(q, kv, i); torch.cuda.synchronize()\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('tilelang', 'tvm', 'tvm_ffi', 'cutlass')]\n"
            "assert not bad, bad\nprint('ok')\n")
    env = dict(os.environ, DSA_AOT_REQUIRE_PREBUILT="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


@pytest.mark.skipif(not os.environ.get("DSA_AOT_PREBUILT_DIR"), reason="needs a prebuilt root")
def test_fresh_process_serving_path_runs_forward_and_backward_without_pydantic():
    """A serving image (no compiler installed): the serving path loads the prebuilt kernels from
    their JSON records, and they compute what the reference computes."""
    from dsa_aot import serving

    why = serving.why_not("fwd", "sm_90a", 576, 64, "noncompact")
    if why is not None:
        pytest.skip(f"the serving path leaves this process's lookups to the loader: {why}")
    code = ("import json, sys, torch, dsa_aot\n"
            "from dsa_aot.kernels.reference import sparse_mla_fwd_ref\n"
            "g = torch.Generator(device='cuda').manual_seed(0)\n"
            "q = torch.randn(64, 64, 576, device='cuda', generator=g).to(torch.bfloat16)\n"
            "kv = torch.randn(512, 576, device='cuda', generator=g).to(torch.bfloat16)\n"
            "i = torch.randint(0, 512, (64, 256), device='cuda', dtype=torch.int32, generator=g)\n"
            "q.requires_grad_(); kv.requires_grad_()\n"
            "o, l = dsa_aot.sparse_mla(q, kv, i)\n"
            "o.float().square().sum().backward(); torch.cuda.synchronize()\n"
            "ro, rl = sparse_mla_fwd_ref(q.detach(), kv.detach(), i, None, None, 576 ** -0.5)\n"
            "err = float((o.detach().double() - ro.double()).norm() / ro.double().norm())\n"
            "grads = [bool(torch.isfinite(t.grad.float()).all()) for t in (q, kv)]\n"
            "print(json.dumps({'err': err, 'grads_finite': grads, 'pydantic': 'pydantic' in sys.modules,\n"
            "                  'loader': 'dsa_aot.loader' in sys.modules}))\n")
    env = dict(os.environ, DSA_AOT_REQUIRE_PREBUILT="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not got["pydantic"] and not got["loader"], got
    assert got["err"] < 1e-2 and got["grads_finite"] == [True, True], got
