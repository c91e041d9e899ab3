"""One call of our kernel and one of the peer's on identical inputs, for a profiler.

Each is called once to warm up (loads, the peer's JIT), then once more between
``cudaProfilerStart`` / ``cudaProfilerStop``, so ``ncu --profile-from-start off`` sees exactly the
two measured launches (plus our backward's pre/postprocess kernels)::

    ncu --clock-control none --profile-from-start off \\
        --metrics gpu__time_duration.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,... \\
        python bench/profile_pair.py --op fwd --shape 4096 8192 64 576 2048 \\
        --flashmla <vLLM>/_flashmla_C.abi3.so

Peers: FlashMLA's ``sparse_prefill_fwd`` for ``--op fwd`` (``--flashmla`` or ``FLASHMLA_SO``),
the cuDNN frontend's ``sparse_attention_backward_wrapper`` for ``--op bwd``; a missing peer is
skipped (``--no-peer`` skips it too). Our kernel comes through the public API (``DSA_AOT_*``
settings apply). ``--deterministic stored_rows|fixed_point`` profiles our deterministic backward
in that mode instead of the fast one; a fixed-point call with S_q up to
``dsa_aot.fixed_point.GROUP_ROWS`` launches the main kernel three times (the measuring sample,
the group, its re-launch that returns at once unless needed), so ``--kernel-name
regex:cutedsl_bwd_ws --launch-skip 1 --launch-count 1`` selects the group's launch. ``--variant``
profiles a non-default backward tile (a flavour of ``bench/variants.toml``) in place of ours.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sparse_mla import peer_bwd, peer_fwd, variant_kernel  # noqa: E402
from common import make_inputs  # noqa: E402

import dsa_aot  # noqa: E402
from dsa_aot import settings  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--shape", type=int, nargs=5, metavar=("S_Q", "S_KV", "H", "D_QK", "K"),
                    default=[4096, 8192, 64, 576, 2048])
    ap.add_argument("--flashmla", help="compiled FlashMLA library (_flashmla_C.abi3.so); default $FLASHMLA_SO")
    ap.add_argument("--deterministic", choices=settings.DETERMINISTIC_MODES,
                    help="bwd: our deterministic backward in this mode instead of the fast one")
    ap.add_argument("--no-peer", action="store_true", help="profile our kernel only")
    ap.add_argument("--variant", metavar="OP:BACKEND:FIELD=VALUE,...",
                    help="profile this non-default tile (as bench_sparse_mla.py --variant) instead of the "
                    "spec the loader picks, e.g. bwd:cutedsl:flavour=wgmma_ws_dq_lines")
    args = ap.parse_args()
    if args.variant and (args.op != "bwd" or args.deterministic):
        ap.error("--variant profiles a fast-mode backward tile: use it with --op bwd, without "
                 "--deterministic")
    if not torch.cuda.is_available():
        print("profile_pair.py needs a CUDA GPU", file=sys.stderr)
        return 2
    s_q, s_kv, h, d, k = args.shape
    x = make_inputs(s_q, s_kv, h, d, k)
    scale = d ** -0.5
    if args.op == "fwd":
        flashmla = None if args.no_peer else peer_fwd(args.flashmla)
        calls = [lambda: dsa_aot.sparse_mla_fwd(x["q"], x["kv"], x["topk_idxs"], attn_sink=x["attn_sink"])]
        if flashmla is not None:
            calls.append(lambda: flashmla(x, scale))
    else:
        out, lse = dsa_aot.sparse_mla_fwd(x["q"], x["kv"], x["topk_idxs"], attn_sink=x["attn_sink"])
        cudnn = None if args.no_peer else peer_bwd()
        det = args.deterministic is not None
        mode = args.deterministic or settings.get().deterministic_mode

        def ours():
            with settings.scope(deterministic_mode=mode):
                return dsa_aot.sparse_mla_bwd(x["q"], x["kv"], out, x["dout"], lse, x["topk_idxs"],
                                              attn_sink=x["attn_sink"], deterministic=det)
        if args.variant:
            found = variant_kernel(args.variant, "bwd", h, d, x["q"].device.index or 0)
            if found is None:
                print(f"--variant {args.variant}: no kernel for h{h} d{d}", file=sys.stderr)
                return 2
            kernel = found[1]
            calls = [lambda: kernel(x["q"], x["kv"], out, x["dout"], lse, x["topk_idxs"], None, x["attn_sink"],
                                    scale)]
        else:
            calls = [ours]
        if cudnn is not None:
            calls.append(lambda: cudnn(x["q"], x["kv"], out, x["dout"], lse, x["attn_sink"], x["topk_idxs"]))
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {args.op} {args.shape}: ours" + (" and the peer" if len(calls) > 1 else " (no peer)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
