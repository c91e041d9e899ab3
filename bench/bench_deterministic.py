"""The deterministic backward against the fast one, side by side in one process.

    DSA_AOT_PREBUILT_DIR=<prebuilt cache> python bench/bench_deterministic.py --out bench/results/h200_deterministic.json

For each row (the DeepSeek shapes of the backward benchmark: S_q 4096, S_kv 8192): the CuTe DSL
backward's fast mode (fp32 atomics into one dkv accumulator) and its deterministic mode
(``--mode stored_rows``, the default: every slot's dkv row stored, then summed per KV row in a
fixed order; ``--mode fixed_point``: the fast mode's kernels adding int32 fixed point,
:mod:`dsa_aot.fixed_point`; d_sink partial sums added in a fixed order) through the public API,
CUDA events, median of ``--reps`` after warm-up, interleaved rounds (the best round per mode); how
far two fast calls differ (bits), whether ``--repeat`` deterministic calls agree bit for bit, both
modes' relative difference to each other and to the fp32 torch reference (dkv), and the
deterministic mode's dkv workspace. Writes JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bwd_flops, environment, make_inputs, time_cuda  # noqa: E402

import dsa_aot  # noqa: E402
from dsa_aot import settings  # noqa: E402
from dsa_aot.kernels.reference import sparse_mla_bwd_ref  # noqa: E402
from dsa_aot.fixed_point import group_bounds, row_stride  # noqa: E402
from dsa_aot.kernels.fixed_point import SINK_ROWS  # noqa: E402
from dsa_aot.runners import deterministic_chunk_rows, head_blocks  # noqa: E402

#: (S_q, S_kv, H, D_qk, K): the backward benchmark's rows.
ROWS = [(4096, 8192, 64, 576, 2048), (4096, 8192, 128, 576, 2048), (4096, 8192, 128, 512, 1024),
        (4096, 8192, 64, 512, 2048), (4096, 8192, 32, 576, 2048), (4096, 8192, 16, 576, 2048),
        (4096, 8192, 16, 512, 512)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


def measure(x: dict, out: torch.Tensor, lse: torch.Tensor, reps: int, rounds: int, repeat: int) -> dict:
    def call(det: bool):
        return dsa_aot.sparse_mla_bwd(x["q"], x["kv"], out, x["dout"], lse, x["topk_idxs"],
                                      attn_sink=x["attn_sink"], deterministic=det)

    fast = [call(False) for _ in range(2)]
    det = [call(True) for _ in range(repeat)]
    torch.cuda.synchronize()
    identical = all(torch.equal(a, b) for run in det[1:] for a, b in zip(det[0], run))
    fast_diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(*fast))
    best = {"fast": float("inf"), "det": float("inf")}
    for _ in range(rounds):
        best["fast"] = min(best["fast"], time_cuda(lambda: call(False), reps=reps))
        best["det"] = min(best["det"], time_cuda(lambda: call(True), reps=reps))
    _, ref_dkv, _ = sparse_mla_bwd_ref(x["q"], x["kv"], out, x["dout"], lse, x["topk_idxs"], None,
                                       x["attn_sink"], compute_dtype=torch.float32)
    return {"fast_ms": best["fast"], "det_ms": best["det"], "det_identical": identical,
            "fast_max_abs_diff_two_calls": fast_diff,
            "det_vs_fast_rel": {n: rel(d, f) for n, d, f in zip(("dq", "dkv", "d_sink"), det[0], fast[0])},
            "dkv_rel_to_reference": {"fast": rel(fast[0][1], ref_dkv), "det": rel(det[0][1], ref_dkv)}}


def workspace_bytes(s_q: int, s_kv: int, heads: int, d_qk: int, topk: int, mode: str) -> int:
    """The deterministic call's dkv workspace. Stored rows: one chunk's bf16 dkv rows, the fp32
    running sum and the row order (int32, at least one entry per stored row). Fixed point: the
    int32 rows with their scale, max and count words, the control and sink rows, the fp32
    accumulator, the first group's fp32 sums (the total) and a later group's."""
    if mode == "fixed_point":
        later = len(group_bounds(s_q)) > 1
        return ((s_kv + 1 + SINK_ROWS) * row_stride(d_qk) * 4
                + s_kv * d_qk * 4 * (2 + later))
    hb = head_blocks(heads)
    rows = min(s_q, deterministic_chunk_rows(s_q, topk, hb, d_qk, settings.get().deterministic_workspace))
    return rows * topk * hb * (d_qk * 2 + 4) + s_kv * d_qk * 4


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/h200_deterministic.json"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5, help="deterministic calls compared bit for bit")
    ap.add_argument("--rows", type=int, nargs="+", help="only these row numbers (0-based)")
    ap.add_argument("--causal", action="store_true",
                    help="prefill-style padding: S_kv = S_q, query row t picks among positions <= t, "
                    "-1 in the slots it cannot fill (about a quarter of the slots at K 2048)")
    ap.add_argument("--mode", choices=settings.DETERMINISTIC_MODES, default="auto",
                    help="the deterministic mode measured (DSA_AOT_DETERMINISTIC_MODE; auto: the one "
                    "it serves each head count in, named per row)")
    args = ap.parse_args()
    env = environment()
    records = []
    with settings.scope(backends=("cutedsl",), deterministic_mode=args.mode):
        for i, (s_q, s_kv, h, d, k) in enumerate(ROWS):
            if args.rows and i not in args.rows:
                continue
            if args.causal:
                s_kv = s_q
            x = make_inputs(s_q, s_kv, h, d, k, causal=args.causal)
            out, lse = dsa_aot.sparse_mla_fwd(x["q"], x["kv"], x["topk_idxs"], attn_sink=x["attn_sink"])
            got = measure(x, out, lse, args.reps, args.rounds, args.repeat)
            served = settings.deterministic_mode_for(args.mode, h)
            rec = {"s_q": s_q, "s_kv": s_kv, "heads": h, "d_qk": d, "topk": k,
                   "fast_ms": round(got["fast_ms"], 4), "det_ms": round(got["det_ms"], 4),
                   "det_over_fast": round(got["det_ms"] / got["fast_ms"], 3),
                   "det_tflops": round(bwd_flops(s_q, h, k, d) / got["det_ms"] / 1e9, 1),
                   "det_identical_calls": args.repeat if got["det_identical"] else 0,
                   "fast_max_abs_diff_two_calls": got["fast_max_abs_diff_two_calls"],
                   "det_vs_fast_rel": {n: round(v, 6) for n, v in got["det_vs_fast_rel"].items()},
                   "dkv_rel_to_reference": {n: round(v, 7) for n, v in got["dkv_rel_to_reference"].items()},
                   "workspace_mib": round(workspace_bytes(s_q, s_kv, h, d, k, served) / 2**20, 1),
                   "mode": args.mode, "served_by": served, "causal": args.causal,
                   "date": env["date"]}
            records.append(rec)
            print(json.dumps(rec), flush=True)
    doc = {"command": " ".join(["python", *sys.argv]), "environment": env, "records": records}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    lines = [f"# Deterministic ({args.mode}) vs fast backward (CuTe DSL), {env['gpu']}, {env['date']}", "",
             f"`{doc['command']}`; torch {env['torch']}, CUDA {env['cuda']}. Median of {args.reps}, best "
             f"of {args.rounds} interleaved rounds; {args.repeat} deterministic calls compared bit for bit"
             + ("; causal padding (S_kv = S_q, -1 in the slots a row cannot fill)." if args.causal else "."), "",
             "| H | D_qk | K | mode | fast ms | deterministic ms | det/fast | bit-identical | fast: max diff of "
             "2 calls | dkv rel. error, fast / det | dkv workspace (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['heads']} | {r['d_qk']} | {r['topk']} | {r['served_by']} | {r['fast_ms']:.3f} | "
                     f"{r['det_ms']:.3f} | "
                     f"{r['det_over_fast']:.2f} | {'yes' if r['det_identical_calls'] else 'NO'} | "
                     f"{r['fast_max_abs_diff_two_calls']:.2e} | {r['dkv_rel_to_reference']['fast']:.2e} / "
                     f"{r['dkv_rel_to_reference']['det']:.2e} | {r['workspace_mib']:.0f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
