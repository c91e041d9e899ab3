"""Host (CPU) cost of one call of an exported CuTe DSL kernel and of its runners, without a GPU.

    python bench/bench_call_overhead.py [--calls 20000] [--rounds 9] [--out results.json]

The kernels are :class:`~dsa_aot.backends.cutedsl.runtime.CuteDslKernel` objects over records
shaped like the real ones (the sm_90a forward, H64 D576 compact; the backward's three stages)
whose entry points are libc's ``labs``, ``llabs`` and ``imaxabs``: a call runs everything up to
and including the C call, which does nothing. The tensors are plain CPU tensors; for the run,
``torch.Tensor.is_cuda`` is made a class attribute reading True (torch's own attribute paths
otherwise, device index -1) and the runners' stream lookup returns 0. Per row: the least, over
``--rounds``, of the mean time per call over ``--calls`` calls (the least disturbed round: a
shared machine only ever adds time).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

import torch

from dsa_aot import runners
from dsa_aot.backends.cutedsl.records import CuteExportRecord
from dsa_aot.backends.cutedsl.runtime import CuteDslKernel
from dsa_aot.specs.models import KernelSpec


def libc_path() -> str:
    """The loaded libc's file (its ``*abs`` functions stand in for the entry points)."""
    ctypes.CDLL(None).labs  # noqa: B018 - libc is mapped
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "/libc.so" in path or "/libc-" in path:
            return path
    raise RuntimeError("libc not found in /proc/self/maps")


def _dim(d: int | str | None, div: int = 1) -> dict:
    if isinstance(d, int):
        return {"value": d}
    return {"symbol": d, "divisibility": div}


def tensor(name: str, dtype: str, shape: list, stride: list, align: int) -> dict:
    """A tensor argument: ints are static, strings symbols, None run-time; ``"d8"`` a run-time
    stride that is a multiple of 8."""
    strides = [_dim(s) if isinstance(s, int) or s is None else _dim(None, int(s[1:])) for s in stride]
    return {"kind": "tensor", "name": name, "dtype": dtype, "shape": [_dim(d) for d in shape],
            "stride": strides, "align": align}


SCALE = {"kind": "scalar", "name": "softmax_scale", "dtype": "float32"}
STREAM = {"kind": "stream", "name": "stream"}
H, D, DV = 64, 576, 512
FWD = [tensor("q", "bfloat16", ["s_q", H, D], ["d8", "d8", 1], 16),
       tensor("kv", "bfloat16", ["s_kv", D], ["d8", 1], 16),
       tensor("topk_idxs", "int32", ["s_q", "topk"], [None, 1], 4),
       tensor("topk_length", "int32", ["s_q"], [None], 4),
       tensor("attn_sink", "float32", [H], [1], 4),
       tensor("out", "bfloat16", ["s_q", H, DV], ["d8", "d8", 1], 16),
       tensor("lse", "float32", ["s_q", H], [None, 1], 4), SCALE, STREAM]
PRE = [tensor("out", "bfloat16", ["s_q", "heads", DV], [None, None, 1], 16),
       tensor("dout", "bfloat16", ["s_q", "heads", DV], [None, None, 1], 16),
       tensor("lse", "float32", ["s_q", "heads"], [None, 1], 4),
       tensor("attn_sink", "float32", ["heads"], [1], 4),
       tensor("delta", "float32", ["s_q", "heads"], [None, 1], 4),
       tensor("lse_sink", "float32", ["s_q", "heads"], [None, 1], 4),
       tensor("d_sink", "float32", ["heads"], [1], 4), STREAM]
MAIN = [tensor("q", "bfloat16", ["s_q", H, D], ["d8", "d8", 1], 16),
        tensor("kv", "bfloat16", ["s_kv", D], ["d8", 1], 16),
        tensor("dout", "bfloat16", ["s_q", H, DV], ["d8", "d8", 1], 16),
        tensor("topk_idxs", "int32", ["s_q", "topk"], [None, 1], 4),
        tensor("topk_length", "int32", ["s_q"], [None], 4),
        tensor("lse_sink", "float32", ["s_q", H], [None, 1], 4),
        tensor("delta", "float32", ["s_q", H], [None, 1], 4),
        tensor("dq", "bfloat16", ["s_q", H, D], ["d8", "d8", 1], 16),
        tensor("dkv_acc", "float32", ["s_kv", D], ["d4", 1], 16), SCALE, STREAM]
POST = [tensor("dkv_acc", "float32", ["s_kv", None], [None, 1], 16),
        tensor("dkv", "bfloat16", ["s_kv", None], [None, 1], 16), STREAM]


def kernel(name: str, kind: str, args: list[dict], libc: str) -> CuteDslKernel:
    """A kernel over ``args`` whose entry points do nothing (libc), prepared for device -1."""
    record = CuteExportRecord.model_validate({
        "name": name, "kernel": kind, "arch": "sm_90a", "prefix": name, "library": libc,
        "object_file": "-", "header": "-", "symbols": {"init": "labs", "load_to_device": "llabs",
                                                       "entry": "imaxabs"},
        "args": args, "link": "static_cudart", "dsl_version": "-", "library_sha256": "-",
        "build_seconds": 0.0})
    k = CuteDslKernel(Path("/"), record)
    k.prepare(-1)
    return k


def host(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def per_call_us(fn, calls: int, rounds: int) -> float:
    for _ in range(calls // 10):
        fn()
    means = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls * 1e6)
    return min(means)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out")
    args = parser.parse_args()
    libc = libc_path()
    torch.Tensor.is_cuda = True  # shadows the C attribute; removed below
    try:
        rows = _rows(libc)
        results = {}
        for name, fn in rows.items():
            results[name] = round(per_call_us(fn, args.calls, args.rounds), 2)
            print(f"{name:32s} {results[name]:8.2f} us")
    finally:
        del torch.Tensor.is_cuda
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "us_per_call": results},
                                             indent=1) + "\n")


def _rows(libc: str) -> dict:
    s_q, s_kv, topk = 64, 16, 512  # small: every backward call allocates and zeroes dkv_acc
    q, kv = host(s_q, H, D), host(s_kv, D)
    idx, length = host(s_q, topk, dtype=torch.int32), host(s_q, dtype=torch.int32)
    sink, out, lse = host(H, dtype=torch.float32), host(s_q, H, DV), host(s_q, H, dtype=torch.float32)
    dout = host(s_q, H, DV)
    fwd = kernel("fwd", "fwd", FWD, libc)
    tensors = [q, kv, idx, length, sink, out, lse]
    runners.current_stream = lambda dev: 0
    fwd_runner = runners.CuteFwd(fwd, KernelSpec.from_id("fwd-sm_90a-d576-h64-compact-cutedsl"))
    bwd_runner = runners.StagedBwd(kernel("pre", "bwd_preprocess", PRE, libc),
                                   kernel("main", "bwd_main", MAIN, libc),
                                   kernel("post", "bwd_postprocess", POST, libc),
                                   KernelSpec.from_id("bwd-sm_90a-d576-h64-compact-cutedsl"))
    dev = q.device

    def fwd_alloc() -> None:
        torch.empty((s_q, H, DV), dtype=torch.bfloat16, device=dev)
        torch.empty((s_q, H), dtype=torch.float32, device=dev)

    def bwd_alloc() -> None:
        for shape in ((s_q, H), (s_q, H)):
            torch.empty(shape, dtype=torch.float32, device=dev)
        torch.empty_like(q)
        torch.empty((s_kv, D), dtype=torch.bfloat16, device=dev)
        torch.zeros((s_kv, D), dtype=torch.float32, device=dev)
        torch.zeros((H,), dtype=torch.float32, device=dev)

    return {
        "marshal (7 tensors)": lambda: fwd.marshal(tensors),
        "kernel call (fwd, 7 tensors)": lambda: fwd(*tensors, stream=0, softmax_scale=0.1),
        "CuteFwd runner": lambda: fwd_runner(q, kv, idx, length, sink, 0.1),
        "  its allocations (fwd)": fwd_alloc,
        "StagedBwd runner (3 kernels)": lambda: bwd_runner(q, kv, out, dout, lse, idx, length, sink,
                                                           0.1),
        "  its allocations (bwd)": bwd_alloc,
    }


if __name__ == "__main__":
    main()
