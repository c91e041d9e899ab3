"""How the fixed-point mode's measuring sample fares on causal (prefill) inputs.

The fixed-point deterministic backward launches the main kernel once over a sample of query rows
to guess each KV row's scale (:mod:`dsa_aot.fixed_point`); a group whose guess proves wrong is
launched again. In a causal prefill (``S_kv = S_q``, query row ``t`` picks among positions up
to ``t``) the first query rows reach only the first KV rows, so a sample of the first rows
leaves the others to a median guess. This times, per shape and in one process: the fast mode,
the fixed-point mode with a sample of the first :data:`~dsa_aot.fixed_point.SAMPLE_ROWS` rows
and with the rows spread over the call (the default, :func:`~dsa_aot.fixed_point.sample_rows`),
and the stored-rows mode; the milliseconds of each main-kernel launch of one call (a re-launch
that ran takes as long as the group, a skipped one ~0.01 ms); and dkv's relative error against
the fp32 reference at a small causal shape::

    DSA_AOT_PREBUILT_DIR=<prebuilt cache> python bench/bench_fixed_point_sample.py \\
        --out bench/results/h100_fixed_point_sample_causal.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, make_inputs, time_cuda, write_results  # noqa: E402

import dsa_aot  # noqa: E402
import dsa_aot.fixed_point as fixed_point  # noqa: E402
import dsa_aot.runners as runners  # noqa: E402
from dsa_aot import settings  # noqa: E402
from dsa_aot.kernels.reference import sparse_mla_bwd_ref  # noqa: E402

SHAPES = [(4096, 4096, 64, 576, 2048), (4096, 4096, 16, 512, 512)]
ACCURACY_SHAPES = [(1024, 1024, 64, 576, 512), (1024, 1024, 16, 512, 512)]


def first_rows(s_q: int) -> range:
    """The sample of the first query rows (the former default)."""
    return range(min(s_q, fixed_point.SAMPLE_ROWS))


SAMPLES = {"first": first_rows, "spread": fixed_point.sample_rows}


def launch_ms(call) -> list[tuple[int, float]]:
    """(query rows, ms) of each main-kernel launch of one fixed-point call."""
    log = []
    original = runners.fixed_point_dkv

    def timed_dkv(launch, *args, **kwargs):
        def timed(rows, fixed, measure):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launch(rows, fixed, measure)
            end.record()
            log.append((len(rows), start, end))
        return original(timed, *args, **kwargs)

    runners.fixed_point_dkv = timed_dkv
    try:
        call()
        torch.cuda.synchronize()
    finally:
        runners.fixed_point_dkv = original
    return [(n, round(s.elapsed_time(e), 3)) for n, s, e in log]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/h200_fixed_point_sample_causal.json"))
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_fixed_point_sample.py needs a CUDA GPU", file=sys.stderr)
        return 2
    env = environment()
    timing, accuracy = [], []
    try:
        for s_q, s_kv, h, d, k in SHAPES:
            x = make_inputs(s_q, s_kv, h, d, k, causal=True)
            out, lse = dsa_aot.sparse_mla_fwd(x["q"], x["kv"], x["topk_idxs"], attn_sink=x["attn_sink"])

            def call(det: bool):
                return dsa_aot.sparse_mla_bwd(x["q"], x["kv"], out, x["dout"], lse, x["topk_idxs"],
                                              attn_sink=x["attn_sink"], deterministic=det)
            rec = {"s_q": s_q, "s_kv": s_kv, "heads": h, "d_qk": d, "topk": k,
                   "fast_ms": round(time_cuda(lambda: call(False), reps=args.reps), 3)}
            for name, sample in SAMPLES.items():
                fixed_point.sample_rows = sample
                with settings.scope(deterministic_mode="fixed_point"):
                    rec[f"fixed_{name}_launch_ms"] = launch_ms(lambda: call(True))
                    rec[f"fixed_{name}_ms"] = round(time_cuda(lambda: call(True), reps=args.reps), 3)
            fixed_point.sample_rows = SAMPLES["spread"]
            with settings.scope(deterministic_mode="stored_rows"):
                rec["stored_rows_ms"] = round(time_cuda(lambda: call(True), reps=args.reps), 3)
            timing.append(rec)
            print(json.dumps(rec), flush=True)
        for s_q, s_kv, h, d, k in ACCURACY_SHAPES:
            x = make_inputs(s_q, s_kv, h, d, k, causal=True)
            out, lse = dsa_aot.sparse_mla_fwd(x["q"], x["kv"], x["topk_idxs"], attn_sink=x["attn_sink"])
            ref = sparse_mla_bwd_ref(x["q"], x["kv"], out, x["dout"], lse, x["topk_idxs"], None,
                                     x["attn_sink"], compute_dtype=torch.float32)[1]
            rec = {"s_q": s_q, "s_kv": s_kv, "heads": h, "d_qk": d, "topk": k}
            runs = [("fast", None, "spread"), ("fixed_first", "fixed_point", "first"),
                    ("fixed_spread", "fixed_point", "spread"), ("stored_rows", "stored_rows", "spread")]
            for name, mode, sample in runs:
                fixed_point.sample_rows = SAMPLES[sample]
                with settings.scope(deterministic_mode=mode or "auto"):
                    dkv = dsa_aot.sparse_mla_bwd(x["q"], x["kv"], out, x["dout"], lse, x["topk_idxs"],
                                                 attn_sink=x["attn_sink"], deterministic=mode is not None)[1]
                rec[f"dkv_rel_{name}"] = round(float((dkv.float() - ref).norm() / ref.norm()), 6)
            accuracy.append(rec)
            print(json.dumps(rec), flush=True)
    finally:
        fixed_point.sample_rows = SAMPLES["spread"]
    doc = {"command": " ".join(["python", *sys.argv]), "environment": env, "timing": timing,
           "accuracy": accuracy}
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
