"""The deterministic backward on a GPU: the same bits on every call and in every process for
the same inputs, and nearly the fast mode's accuracy against the torch reference.

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
from dsa_aot import fixed_point, runners, settings
from dsa_aot.kernels.reference import sparse_mla_bwd_ref

from test_sparse_mla_gpu import inputs, poison, rel

pytestmark = pytest.mark.gpu

VARIANTS = list(itertools.product((512, 576), (16, 32, 64, 128), ("compact", "noncompact")))


@pytest.fixture(autouse=True)
def stored_rows_unless_asked():
    """Deterministic calls run in the stored-rows mode unless a test says otherwise (the
    default, ``auto``, would serve H64/H128 in fixed point): the tests before the fixed-point
    section are the stored-rows mode's."""
    with settings.scope(deterministic_mode="stored_rows"):
        yield


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


@pytest.mark.parametrize("mode", ["stored_rows", "fixed_point"])
def test_same_bits_in_other_processes(mode):
    """Two fresh processes (deterministic through DSA_AOT_DETERMINISTIC=1, the mode through
    DSA_AOT_DETERMINISTIC_MODE) and this one agree."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, DSA_AOT_DETERMINISTIC="1", DSA_AOT_DETERMINISTIC_MODE=mode)
    digests = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", CHILD.format(here=here)], env=env, capture_output=True,
                              text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        digests.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    q, kv, idx, length, sink, dout = inputs(777, 3000, 64, 576, 1000, layout="compact", seed=5)
    out, lse = forward(q, kv, idx, length, sink)
    with settings.scope(deterministic_mode=mode):
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


@pytest.mark.parametrize("mode", settings.DETERMINISTIC_MODES)
@pytest.mark.parametrize("h,d", [(64, 576), (128, 512), (16, 576), (32, 512)])
def test_dkv_is_about_as_accurate_as_the_fast_mode(mode, h, d):
    """Stored rows: each slot's dkv row is rounded to bf16 once before the fixed-order sum
    (measured: 1.22x the fast mode's error). Fixed point: each value is rounded to an integer of
    about 2^-17 of its row's largest. Either way dkv stays within 1.3x of the fast mode's error
    against the fp32 reference, and dq is the same (both modes walk a row's blocks in the same
    order, at H128 the staggered one)."""
    q, kv, idx, length, sink, dout = inputs(512, 8192, h, d, 2048, seed=4)
    out, lse = forward(q, kv, idx, length, sink)
    with settings.scope(deterministic_mode=mode):
        det = det_bwd(q, kv, out, dout, lse, idx, length, sink)
    fast = fast_bwd(q, kv, out, dout, lse, idx, length, sink)
    _, rkv, _ = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, length, sink, compute_dtype=torch.float32)
    assert torch.equal(det[0], fast[0])  # dq: the same kernel and block order, no atomics
    assert rel(det[1], rkv) <= 1.3 * rel(fast[1], rkv) + 1e-5
    assert rel(det[1], fast[1]) <= 5e-3


@pytest.mark.parametrize("workspace", [1, 90 << 20, 1 << 40])
def test_chunking_changes_no_bit(workspace):
    """A workspace that holds one group of 64 query rows (36 MiB of rows here), two (chunks of
    groups 0-1, 2-3, 4), or the whole call: the same bits (chunks are whole groups, and each
    group's partial sum is added to the running total in turn)."""
    q, kv, idx, length, sink, dout = inputs(300, 2048, 128, 576, 256, seed=9)
    out, lse = forward(q, kv, idx, length, sink)
    want = det_bwd(q, kv, out, dout, lse, idx, length, sink)
    with settings.scope(deterministic_workspace=workspace):
        got = assert_repeats(2, lambda: det_bwd(q, kv, out, dout, lse, idx, length, sink))
    for a, b in zip(want, got):
        if a is not None:
            assert torch.equal(a, b)


def test_a_dominant_kv_row_neither_overflows_nor_loses_the_small_rows():
    """Every query puts most of its attention on KV row 0 (an attention sink in the KV): row 0's
    dkv sums a large addend from every query, the other rows' are about 1e3 times smaller and
    must keep their accuracy."""
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
    assert rel(grads[1][1:], rkv[1:]) <= 1.3 * rel(fast[1][1:], rkv[1:]) + 1e-5


def test_a_nan_input_gives_a_nan_dkv_as_the_fast_mode_does():
    """A NaN in one row of dout reaches exactly the dkv rows the fast mode's atomics reach."""
    q, kv, idx, length, sink, dout = inputs(64, 1024, 64, 576, 256, seed=8)
    out, lse = forward(q, kv, idx, length, sink)
    dout = dout.clone()
    dout[3, 5, 7] = float("nan")
    _, dkv, _ = det_bwd(q, kv, out, dout, lse, idx, length, sink)
    _, fast, _ = fast_bwd(q, kv, out, dout, lse, idx, length, sink)
    assert torch.isnan(dkv).any()
    assert torch.equal(torch.isnan(dkv), torch.isnan(fast))


@pytest.mark.parametrize("h", [16, 32, 64, 128])
def test_auto_is_the_default_and_serves_each_head_count_in_fixed_point(h):
    """``auto`` (the default) gives the fixed-point mode's bits at every head count the kernels
    have, and not those of the stored-rows mode."""
    served = "fixed_point"
    assert settings.Settings().deterministic_mode == "auto"
    q, kv, idx, length, sink, dout = inputs(200, 2048, h, 576, 512, seed=h)
    out, lse = forward(q, kv, idx, length, sink)
    got = {}
    for mode in ("auto", "stored_rows", "fixed_point"):
        with settings.scope(deterministic_mode=mode):
            got[mode] = digest(*det_bwd(q, kv, out, dout, lse, idx, length, sink))
    other = "fixed_point" if served == "stored_rows" else "stored_rows"
    assert got["auto"] == got[served] != got[other]


# ---- the fixed-point mode (DSA_AOT_DETERMINISTIC_MODE=fixed_point, dsa_aot.fixed_point) ----


@pytest.fixture
def fixed_point_mode():
    """Deterministic calls in this test use the fixed-point kernels (the ``-det`` specs with a
    ``_fixed`` flavour)."""
    with settings.scope(deterministic_mode="fixed_point"):
        yield


@pytest.mark.parametrize("d,h,layout", VARIANTS, ids=[f"d{d}-h{h}-{l}" for d, h, l in VARIANTS])
def test_fixed_point_variant_matches_the_reference_and_repeats(fixed_point_mode, d, h, layout):
    q, kv, idx, length, sink, dout = inputs(300, 2048, h, d, 256, layout=layout, seed=d + h)
    out, lse = forward(q, kv, idx, length, sink)
    grads = assert_repeats(3, lambda: det_bwd(q, kv, out, dout, lse, idx, length, sink))
    check_against_reference(grads, q, kv, out, dout, lse, idx, length, sink)


def test_fixed_point_heavily_repeated_indices_and_nan(fixed_point_mode):
    """Every query row's slots on 8 KV rows (tens of thousands of adds a row), then a NaN in
    dout: the dkv rows it reaches are NaN, the others match the reference."""
    q, kv, idx, length, sink, dout = inputs(512, 1024, 64, 576, 256, seed=11)
    idx = (idx % 8).contiguous()
    out, lse = forward(q, kv, idx, length, sink)
    grads = assert_repeats(2, lambda: det_bwd(q, kv, out, dout, lse, idx, length, sink))
    check_against_reference(grads, q, kv, out, dout, lse, idx, length, sink)
    dout = dout.clone()
    dout[3, 5, 7] = float("nan")
    _, dkv, _ = det_bwd(q, kv, out, dout, lse, idx, length, sink)
    _, fast, _ = fast_bwd(q, kv, out, dout, lse, idx, length, sink)
    assert torch.equal(torch.isnan(dkv).any(1), torch.isnan(fast).any(1))


@pytest.mark.parametrize("scale", [2.0 ** 10, 2.0 ** -20])
def test_a_later_group_far_from_the_first_is_redone(fixed_point_mode, monkeypatch, scale):
    """Query rows after the first groups get a dout 2^10 above (their dkv values overflow the
    guessed scale) or 2^-20 below (a guess that would waste their precision): the group is
    re-launched with the measured scales; dkv matches the reference and repeats bit for bit."""
    monkeypatch.setattr(fixed_point, "sample_rows", lambda s_q: range(min(s_q, 32)))  # not 96..
    monkeypatch.setattr(fixed_point, "GROUP_ROWS", 64)
    q, kv, idx, length, sink, dout = inputs(300, 2048, 64, 576, 256, seed=9)
    dout = dout.clone()
    dout[96:] = (dout[96:].float() * scale).to(torch.bfloat16)
    out, lse = forward(q, kv, idx, length, sink)
    grads = assert_repeats(3, lambda: det_bwd(q, kv, out, dout, lse, idx, length, sink))
    check_against_reference(grads, q, kv, out, dout, lse, idx, length, sink)
    fast = fast_bwd(q, kv, out, dout, lse, idx, length, sink)
    _, rkv, _ = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, length, sink, compute_dtype=torch.float32)
    assert rel(grads[1], rkv) <= 1.3 * rel(fast[1], rkv) + 1e-5


def test_no_host_sync_and_capturable_in_a_cuda_graph(fixed_point_mode):
    """The whole deterministic call (groups, re-launch decisions on the device) runs under
    ``set_sync_debug_mode("error")`` and replays from a CUDA graph with the eager call's bits."""
    q, kv, idx, length, sink, dout = inputs(300, 2048, 128, 512, 256, seed=3)
    out, lse = forward(q, kv, idx, length, sink)
    want = det_bwd(q, kv, out, dout, lse, idx, length, sink)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = dsa_aot.sparse_mla_bwd(q, kv, out, dout, lse, idx, topk_length=length,
                                     attn_sink=sink, deterministic=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream
        dsa_aot.sparse_mla_bwd(q, kv, out, dout, lse, idx, topk_length=length, attn_sink=sink,
                               deterministic=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dsa_aot.sparse_mla_bwd(q, kv, out, dout, lse, idx, topk_length=length,
                                          attn_sink=sink, deterministic=True)
    for t in captured:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(want, captured))


@pytest.mark.parametrize("group_rows,zero_dout", [(4096, False), (64, False), (4096, True)])
def test_the_postprocess_steps_match_their_torch_definition(fixed_point_mode, monkeypatch, group_rows,
                                                            zero_dout):
    """Every guess, check and fold step of real calls (one group, and five with a redo), each launched
    on the kernel and done by :func:`~dsa_aot.fixed_point.post_reference` on copies of the same
    arguments: the same bits (NaN payloads aside); the sample's launch measures every row's
    maximum and adds nothing; dkv still matches the reference. A zero dout (every dKV value
    zero: no row seen, so the guess has no median) gives a zero dkv."""
    monkeypatch.setattr(fixed_point, "GROUP_ROWS", group_rows)
    original = runners.fixed_point_dkv
    steps = []

    def checked_dkv(launch, post, dkv, *args):
        def checked_launch(rows, fixed, measure):
            launch(rows, fixed, measure)
            if measure:  # the sample measures and adds nothing
                words = fixed[:dkv.shape[0], :dkv.shape[1]]
                seen = fixed[:dkv.shape[0], dkv.shape[1] + fixed_point.WORD_MAX].any()
                assert not words.any() and bool(seen) != zero_dout

        def checked_post(*post_args):
            *tensors, step, bound = post_args
            mine = [t.clone() for t in tensors]
            post(*post_args)
            fixed_point.post_reference(*mine, step, bound)
            for name, got, want in zip(("dkv_fixed", "dkv_acc", "dkv", "d_sink_acc", "d_sink"),
                                       tensors, mine):
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True,
                                           msg=lambda m: f"step {step}, {name}: {m}")
            steps.append(step)
        return original(checked_launch, checked_post, dkv, *args)

    monkeypatch.setattr(runners, "fixed_point_dkv", checked_dkv)
    q, kv, idx, length, sink, dout = inputs(300, 2048, 64, 576, 256, layout="compact", seed=5)
    dout = torch.zeros_like(dout) if zero_dout else dout.clone()
    dout[200:] = (dout[200:].float() * 2.0 ** 10).to(torch.bfloat16)  # a later group is redone
    out, lse = forward(q, kv, idx, length, sink)
    grads = det_bwd(q, kv, out, dout, lse, idx, length, sink)
    torch.cuda.synchronize()
    if zero_dout:
        assert not grads[1].any() and not torch.isnan(grads[1]).any()
    else:
        check_against_reference(grads, q, kv, out, dout, lse, idx, length, sink)
    groups = len(fixed_point.group_bounds(300))
    assert len(steps) == 3 * groups and steps[-1] & fixed_point.FOLD_LAST
