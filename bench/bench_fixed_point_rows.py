"""The fixed-point mode's ``dkv_fixed`` row stride: packed rows against 128-byte aligned ones.

The fixed-point deterministic backward adds dKV into int32 rows of ``D + 8`` words
(:mod:`dsa_aot.kernels.fixed_point`); :func:`dsa_aot.fixed_point.fixed_rows` allocates them with
a row stride rounded up to :data:`~dsa_aot.fixed_point.ROW_ALIGN_WORDS` words so that each row
starts on an L2 line. The kernels take the stride at run time, so one process runs both: per
shape, the fast mode, the fixed-point mode with packed rows (stride ``D + 8``) and with aligned
rows, each timed alone, then the two alternating (:func:`common.time_paired`), and whether the
two give the same bits of dq, dkv and d_sink::

    DSA_AOT_PREBUILT_DIR=<prebuilt cache> python bench/bench_fixed_point_rows.py \\
        --out bench/results/h100_fixed_point_row_stride.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_deterministic import ROWS  # noqa: E402
from common import environment, make_inputs, time_cuda, time_paired, write_results  # noqa: E402

import dsa_aot  # noqa: E402
import dsa_aot.fixed_point as fixed_point  # noqa: E402
from dsa_aot import settings  # noqa: E402
from dsa_aot.kernels.fixed_point import row_words  # noqa: E402

ALIGNED = fixed_point.ROW_ALIGN_WORDS
PACKED = 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/h100_fixed_point_row_stride.json"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", help="only these rows (0-based) of bench_deterministic.ROWS")
    args = ap.parse_args()
    env = environment()
    records = []
    with settings.scope(backends=("cutedsl",), deterministic_mode="fixed_point"):
        for i, (s_q, s_kv, h, d, k) in enumerate(ROWS):
            if args.rows and i not in args.rows:
                continue
            x = make_inputs(s_q, s_kv, h, d, k)
            out, lse = dsa_aot.sparse_mla_fwd(x["q"], x["kv"], x["topk_idxs"], attn_sink=x["attn_sink"])

            def call(deterministic: bool):
                return dsa_aot.sparse_mla_bwd(x["q"], x["kv"], out, x["dout"], lse, x["topk_idxs"],
                                              attn_sink=x["attn_sink"], deterministic=deterministic)

            def with_stride(align: int):
                def run():
                    fixed_point.ROW_ALIGN_WORDS = align
                    return call(True)
                return run

            try:
                packed, aligned = with_stride(PACKED)(), with_stride(ALIGNED)()
                same = all(torch.equal(a, b) for a, b in zip(packed, aligned))
                fast_ms = time_cuda(lambda: call(False), reps=args.reps)
                packed_ms = time_cuda(with_stride(PACKED), reps=args.reps)
                aligned_ms = time_cuda(with_stride(ALIGNED), reps=args.reps)
                paired = time_paired(with_stride(PACKED), with_stride(ALIGNED), reps=args.pairs)
            finally:
                fixed_point.ROW_ALIGN_WORDS = ALIGNED
            rec = {"s_q": s_q, "s_kv": s_kv, "heads": h, "d_qk": d, "topk": k,
                   "packed_stride": row_words(d), "aligned_stride": fixed_point.row_stride(d),
                   "same_bits": same, "fast_ms": round(fast_ms, 4), "packed_ms": round(packed_ms, 4),
                   "aligned_ms": round(aligned_ms, 4),
                   "packed_over_aligned_paired": {n: round(paired[n], 4) for n in ("ratio", "q1", "q3")},
                   "packed_over_fast": round(packed_ms / fast_ms, 3), "aligned_over_fast": round(aligned_ms / fast_ms, 3)}
            records.append(rec)
            print(rec, flush=True)
    doc = {"command": " ".join(["python", *sys.argv]), "environment": env, "records": records}
    lines = [f"# Fixed-point `dkv_fixed` rows, packed vs 128-byte aligned, {env['gpu']}, {env['date']}", "",
             f"`{doc['command']}`; torch {env['torch']}, CUDA {env['cuda']}, nvidia-cutlass-dsl "
             f"{env['nvidia-cutlass-dsl']}. Median of {args.reps} calls each; paired: the two strides "
             f"alternating, {args.pairs} pairs, median [q1, q3] of the per-pair ratios.", "",
             "| H | D_qk | K | row stride, packed / aligned (words) | fast ms | packed ms | aligned ms | "
             "packed/aligned, paired | det/fast, packed / aligned | same bits |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        p = r["packed_over_aligned_paired"]
        lines.append(f"| {r['heads']} | {r['d_qk']} | {r['topk']} | {r['packed_stride']} / {r['aligned_stride']} | "
                     f"{r['fast_ms']:.3f} | {r['packed_ms']:.3f} | {r['aligned_ms']:.3f} | "
                     f"{p['ratio']:.3f} [{p['q1']:.3f}, {p['q3']:.3f}] | {r['packed_over_fast']:.2f} / "
                     f"{r['aligned_over_fast']:.2f} | {'yes' if r['same_bits'] else 'NO'} |")
    write_results(args.out, doc, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
