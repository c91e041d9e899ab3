"""The device binding of the launch paths, on what a CPU machine can check: a call whose tensors
are not on a CUDA device binds nothing and never initializes CUDA; tensors on two devices in one
call are an ``InputError`` naming both. (The binding itself is exercised on GPUs by
``tests/gpu/test_multi_gpu.py``.)"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap

import pytest
import torch

import dsa_aot
from dsa_aot.ops import on_device


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_non_cuda_tensors_bind_nothing(device):
    assert isinstance(on_device(torch.device(device)), contextlib.nullcontext)


def test_a_reference_call_never_initializes_cuda():
    code = textwrap.dedent("""
        import torch, dsa_aot
        q = torch.randn(3, 16, 576).bfloat16(); kv = torch.randn(9, 576).bfloat16()
        idx = torch.randint(-1, 9, (3, 4), dtype=torch.int32)
        out, lse = dsa_aot.sparse_mla_fwd(q, kv, idx)
        dsa_aot.sparse_mla_bwd(q, kv, out, torch.randn_like(out), lse, idx)
        print(torch.cuda.is_initialized())
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "False"


@pytest.mark.parametrize("moved", ["kv", "topk_idxs", "attn_sink"])
def test_tensors_on_two_devices_are_refused(moved):
    args = {"q": torch.randn(2, 16, 576).bfloat16(), "kv": torch.randn(4, 576).bfloat16(),
            "topk_idxs": torch.zeros(2, 4, dtype=torch.int32), "attn_sink": torch.zeros(16)}
    args[moved] = args[moved].to("meta")
    with pytest.raises(dsa_aot.InputError, match=f"{moved} is on meta but q is on cpu"):
        dsa_aot.sparse_mla_fwd(args["q"], args["kv"], args["topk_idxs"], attn_sink=args["attn_sink"])
