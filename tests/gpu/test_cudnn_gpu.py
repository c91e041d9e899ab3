"""The cudnn backend through the public API on a GPU, against the torch reference.

Every test of ``test_sparse_mla_gpu.py`` (every variant and shape, every seed edge case) runs
again with ``DSA_AOT_BACKENDS=cudnn,cutedsl``: the backward is the cuDNN frontend's (its top-k
buckets, calls padded to them), the forward is ours on sm_90a (the frontend has none there) and
the frontend's on sm_100a where it has a kernel. Plus the bucket choice, the fallback above the
widest bucket, and a fresh process served from a prebuilt root with no compiler imported.

Run on the H200 with the prebuilt root built on the CPU machine:
DSA_AOT_PREBUILT_DIR=... DSA_AOT_REQUIRE_PREBUILT=1 pytest -m gpu tests/gpu/test_cudnn_gpu.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import dsa_aot
from dsa_aot import settings
from test_sparse_mla_gpu import *  # noqa: F401,F403  (the suite, re-run with the backend forced)
from test_sparse_mla_gpu import check_bwd, check_fwd, inputs

pytestmark = pytest.mark.gpu

FORCED = "cudnn,cutedsl"


@pytest.fixture(autouse=True)
def cudnn_first(monkeypatch: pytest.MonkeyPatch):
    """``DSA_AOT_BACKENDS=cudnn,cutedsl`` for every test of this module, kernels looked up afresh."""
    from dsa_aot import ops

    monkeypatch.setenv("DSA_AOT_BACKENDS", FORCED)
    settings.reload()
    ops._clear()
    yield
    monkeypatch.undo()
    settings.reload()
    ops._clear()


def _arch() -> str:
    from dsa_aot.loader import arch_of_capability

    return arch_of_capability(*torch.cuda.get_device_capability())


def test_backward_is_served_by_cudnn_buckets():
    from dsa_aot.loader import get_loader
    from dsa_aot.runners import TopkBuckets

    loader = get_loader()
    kernel, res = loader.resolve("bwd", _arch(), 576, 64, "noncompact", torch.cuda.current_device())
    assert isinstance(kernel, TopkBuckets) and res.spec.backend == "cudnn", res
    widths = loader.topk_widths("cudnn", "bwd", _arch())
    assert widths == [512, 1024, 2048], widths

    def stored(width: int) -> bool:
        spec = res.spec.model_copy(update={"topk": width})
        return any(loader.find(store, spec) for store in loader.stores())

    for k in (1, 512, 513, 2048):
        served, bucket = kernel.kernel_for(k)
        # the narrowest stored bucket >= k; when none is stored, the narrowest one, compiled
        fitting = [w for w in widths if w >= k]
        expected = next((w for w in fitting if stored(w)), fitting[0])
        assert bucket == expected and served.spec.id.endswith(f"-cudnn-k{expected}"), (k, bucket, expected)


def test_widths_above_every_bucket_fall_back():
    """K 4096 > 2048: the next backend of the ranking serves it, and matches the reference."""
    s_q, s_kv, h, d, k = 8, 5000, 64, 576, 4096
    q, kv, idx, length, sink, dout = inputs(s_q, s_kv, h, d, k)
    out, lse = check_fwd(q, kv, idx, length, sink)
    check_bwd(q, kv, out, lse, dout, idx, length, sink)


@pytest.mark.parametrize("k", [1, 300, 511, 512, 1000, 2047])
def test_padded_widths_match_the_reference(k):
    for layout in ("compact", "noncompact"):
        q, kv, idx, length, sink, dout = inputs(62, 4096, 32, 512, k, layout=layout, seed=k)
        out, lse = check_fwd(q, kv, idx, length, sink)
        check_bwd(q, kv, out, lse, dout, idx, length, sink)


@pytest.mark.skipif(not os.environ.get("DSA_AOT_PREBUILT_DIR"), reason="needs a prebuilt root")
def test_fresh_process_serves_cudnn_backward_prebuilt_without_compilers():
    code = ("import sys, torch, dsa_aot\n"
            "from dsa_aot.loader import get_loader\n"
            "q = torch.randn(4, 64, 576, device='cuda').to(torch.bfloat16)\n"
            "kv = torch.randn(128, 576, device='cuda').to(torch.bfloat16)\n"
            "i = torch.randint(0, 128, (4, 2048), device='cuda', dtype=torch.int32)\n"
            "o = torch.randn(4, 64, 512, device='cuda').to(torch.bfloat16)\n"
            "lse = torch.randn(4, 64, device='cuda')\n"
            "dq, dkv, _ = dsa_aot.sparse_mla_bwd(q, kv, o, o, lse, i); torch.cuda.synchronize()\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('tilelang', 'tvm', 'tvm_ffi', 'cutlass', 'cudnn')]\n"
            "assert not bad, bad\nprint('ok')\n")
    env = dict(os.environ, DSA_AOT_REQUIRE_PREBUILT="1", DSA_AOT_BACKENDS="cudnn")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
