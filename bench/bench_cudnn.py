"""The cudnn backend against the cuDNN frontend's own wrapper: first call and steady state.

    DSA_AOT_PREBUILT_DIR=<root with the sm_90a cudnn and cutedsl specs> \\
        python bench/bench_cudnn.py --out bench/results/h200_cudnn_calls.json

For each catalog backward shape (``bench_sparse_mla.BWD_SHAPES``):

1. **first call**, each side in its own fresh process: ``dsa_aot.sparse_mla_bwd`` served by
   the cudnn backend from the prebuilt root (``DSA_AOT_REQUIRE_PREBUILT=1``; the compiler modules
   it imported are listed, none may be), and the frontend's
   ``sparse_attention_backward_wrapper`` (its first call JIT-compiles). Both processes first run
   our forward for ``out``/``lse`` (not timed), then time the first backward to its result;
2. **steady state** in this process on identical inputs: ``--rounds`` interleaved rounds (the
   order flips every round) of the median of ``--reps`` calls each, end to end with CUDA events,
   and the GPU time of the kernels each side launches per call (``torch.profiler``), so a gap is
   attributed to the kernels or to the host path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sparse_mla import BWD_SHAPES, rel  # noqa: E402
from common import bwd_flops, environment, make_inputs, time_cuda  # noqa: E402

import dsa_aot  # noqa: E402
from dsa_aot import settings  # noqa: E402

COMPILERS = ("tilelang", "tvm", "tvm_ffi", "cutlass", "cudnn")

FIRST_CALL = textwrap.dedent("""
    import json, sys, time
    import torch
    sys.path.insert(0, {bench!r})
    from common import make_inputs
    import dsa_aot
    side, shape = {side!r}, {shape!r}
    x = make_inputs(*shape)
    out, lse = dsa_aot.sparse_mla_fwd(x["q"], x["kv"], x["topk_idxs"], attn_sink=x["attn_sink"])
    torch.cuda.synchronize()
    before = set(sys.modules)
    if side == "theirs":
        from cudnn.deepseek_sparse_attention.sparse_attention_backward.api import (
            sparse_attention_backward_wrapper as wrapper)
        call = lambda: wrapper(x["q"], x["kv"], out, x["dout"], lse, x["attn_sink"], x["topk_idxs"])
    else:
        call = lambda: dsa_aot.sparse_mla_bwd(x["q"], x["kv"], out, x["dout"], lse, x["topk_idxs"],
                                              attn_sink=x["attn_sink"])
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    second = time.perf_counter() - t0
    print(json.dumps({{"first_ms": first * 1e3, "second_ms": second * 1e3,
                      "compiler_modules": sorted({{m.split(".")[0] for m in set(sys.modules) - before
                                                  if m.split(".")[0] in {compilers!r}}})}}))
""")


def first_call(side: str, shape: tuple[int, ...]) -> dict:
    env = dict(os.environ, DSA_AOT_BACKENDS="cudnn,cutedsl")
    if side == "ours":
        env["DSA_AOT_REQUIRE_PREBUILT"] = "1"
    code = FIRST_CALL.format(bench=str(Path(__file__).resolve().parent), side=side, shape=tuple(shape),
                             compilers=COMPILERS)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} first call of {shape} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kernel_ms(call, n: int = 10) -> float:
    """GPU time of the kernels ``call`` launches, per call (profiler, after a warm call)."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return total_us / n / 1e3


def steady(shape: tuple[int, ...], wrapper, rounds: int, reps: int) -> dict:
    x = make_inputs(*shape)
    with settings.scope(backends=("cudnn", "cutedsl")):
        out, lse = dsa_aot.sparse_mla_fwd(x["q"], x["kv"], x["topk_idxs"], attn_sink=x["attn_sink"])

        def ours():
            return dsa_aot.sparse_mla_bwd(x["q"], x["kv"], out, x["dout"], lse, x["topk_idxs"],
                                          attn_sink=x["attn_sink"])

        def theirs():
            return wrapper(x["q"], x["kv"], out, x["dout"], lse, x["attn_sink"], x["topk_idxs"])

        mine, peer = ours(), theirs()
        agreement = {n: round(rel(m, peer[n]), 6) for n, m in zip(("dq", "dkv", "d_sink"), mine)}
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        for r in range(rounds):
            order = (("ours", ours), ("theirs", theirs)) if r % 2 == 0 else (("theirs", theirs), ("ours", ours))
            for name, fn in order:
                times[name].append(time_cuda(fn, reps=reps))
        k_ours, k_theirs = kernel_ms(ours), kernel_ms(theirs)
    ms = {n: statistics.median(v) for n, v in times.items()}
    return {"ours_ms": round(ms["ours"], 4), "theirs_ms": round(ms["theirs"], 4),
            "ratio": round(ms["theirs"] / ms["ours"], 4),
            "rounds_ms": {n: [round(t, 4) for t in v] for n, v in times.items()},
            "kernel_ms": {"ours": round(k_ours, 4), "theirs": round(k_theirs, 4)},
            "kernel_ratio": round(k_theirs / k_ours, 4), "agreement_rel_err": agreement,
            "tflops_ours": round(bwd_flops(shape[0], shape[2], shape[4], shape[3]) / ms["ours"] / 1e9, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/h200_cudnn_calls.json"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--shapes", type=int, nargs="+", help="only these rows (0-based) of BWD_SHAPES")
    ap.add_argument("--skip-first-call", action="store_true")
    args = ap.parse_args()
    from cudnn.deepseek_sparse_attention.sparse_attention_backward.api import sparse_attention_backward_wrapper

    shapes = [s for i, s in enumerate(BWD_SHAPES) if not args.shapes or i in args.shapes]
    rows = []
    for shape in shapes:
        row: dict = dict(zip(("s_q", "s_kv", "heads", "d_qk", "topk"), shape))
        if not args.skip_first_call:
            ours, theirs = first_call("ours", shape), first_call("theirs", shape)
            row["first_call"] = {"ours_ms": round(ours["first_ms"], 2), "theirs_ms": round(theirs["first_ms"], 1),
                                 "speedup": round(theirs["first_ms"] / ours["first_ms"], 1),
                                 "ours_second_ms": round(ours["second_ms"], 2),
                                 "ours_compiler_modules": ours["compiler_modules"],
                                 "theirs_compiler_modules": theirs["compiler_modules"]}
        row["steady"] = steady(shape, sparse_attention_backward_wrapper, args.rounds, args.reps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    cmd = "python bench/bench_cudnn.py " + " ".join(sys.argv[1:])
    report = {"command": cmd, "environment": environment(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    env = report["environment"]
    lines = [f"# cudnn backend vs the cuDNN frontend's wrapper on {env['gpu']}", "",
             f"Command: `{cmd}`  ", f"Date: {env['date']}  ",
             "Toolchain: " + ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("gpu", "date")), "",
             "First call: a fresh process each, after our forward; ours from the prebuilt root "
             "(`DSA_AOT_REQUIRE_PREBUILT=1`), theirs JIT-compiles. Steady state: median of "
             f"{args.rounds} interleaved rounds of the median of {args.reps} calls; kernel ms = GPU time "
             "of the kernels per call (profiler).", "",
             "| S_q | S_kv | H | D_qk | K | first call ours ms | first call theirs ms | speedup | "
             "ours ms | theirs ms | theirs/ours | kernel ms ours | kernel ms theirs | kernel theirs/ours |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, s = r.get("first_call", {}), r["steady"]
        lines.append(f"| {r['s_q']} | {r['s_kv']} | {r['heads']} | {r['d_qk']} | {r['topk']} | "
                     f"{f.get('ours_ms', '-')} | {f.get('theirs_ms', '-')} | {f.get('speedup', '-')} | "
                     f"{s['ours_ms']:.3f} | {s['theirs_ms']:.3f} | {s['ratio']:.3f} | {s['kernel_ms']['ours']:.3f} | "
                     f"{s['kernel_ms']['theirs']:.3f} | {s['kernel_ratio']:.3f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
