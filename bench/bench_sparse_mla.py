"""Time dsa-aot's sparse MLA forward and backward on the GPU, beside the peers on the same
inputs in the same process: FlashMLA's sparse prefill forward and the cuDNN frontend's DSA
backward.

    python bench/bench_sparse_mla.py --out bench/results/h200.json [--flashmla DIR/_flashmla_C.abi3.so]
        [--variant bwd:cutedsl:flavour=wgmma ...]

Writes the JSON records and a Markdown table (same name, .md) with command, GPU, toolchain and
date. Each time is the median of ``--reps`` calls after warm-up; forward times are the best of
``--rounds`` interleaved rounds (FlashMLA, then our backends), which evens out clock drift.
Where a peer ran, each of our rows also gets a paired ratio: the peer and ours called
alternately, each call timed by its own events, and the median (and quartiles) of the per-pair
ratios, which compares the two under the same clock and temperature (``--no-paired`` skips it).
Our kernels come through the public API, so the artifact that runs is the one the loader
picks (set DSA_AOT_REQUIRE_PREBUILT=1 to be sure it is prebuilt). ``--variant`` adds rows for a
spec with a non-default tile (e.g. an MMA flavour), loaded by the production loader from the
prebuilt root (or built into the cache). FlashMLA is loaded from a compiled ``_flashmla_C``
library given by ``--flashmla`` or ``FLASHMLA_SO`` (nothing of it lives here); without one its
column is empty. ``bench/plot_results.py`` draws the chart from the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bwd_flops, environment, fwd_flops, make_inputs, time_cuda, time_paired  # noqa: E402

import dsa_aot  # noqa: E402
from dsa_aot import ops, settings  # noqa: E402
from dsa_aot.backends import get as get_backend  # noqa: E402
from dsa_aot.loader import MissingPrebuiltError  # noqa: E402

#: (S_q, S_kv, H, D_qk, K): DeepSeek-V3.2-class shapes, H16/H32 being tensor-parallel ranks of H128.
FWD_SHAPES = [(4096, 8192, 64, 576, 2048), (4096, 8192, 128, 576, 2048), (4096, 8192, 128, 512, 1024),
              (4096, 8192, 64, 512, 2048), (4096, 32768, 128, 576, 2048), (16384, 65536, 128, 576, 2048),
              (4096, 8192, 16, 576, 2048), (4096, 8192, 32, 576, 2048)]
BWD_SHAPES = [(4096, 8192, 64, 576, 2048), (4096, 8192, 128, 576, 2048), (4096, 8192, 128, 512, 1024),
              (4096, 8192, 64, 512, 2048), (4096, 8192, 32, 576, 2048), (4096, 8192, 16, 576, 2048),
              (4096, 8192, 16, 512, 512)]


def peer_fwd(path: str | None):
    """FlashMLA's ``sparse_prefill_fwd`` from a compiled ``_flashmla_C`` library, or None."""
    import os

    path = path or os.environ.get("FLASHMLA_SO")
    if not path:
        return None
    try:
        torch.ops.load_library(path)
        op = torch.ops._flashmla_C.sparse_prefill_fwd
    except Exception as exc:  # the peer is optional
        print(f"FlashMLA unavailable ({path}): {exc}", file=sys.stderr)
        return None

    def run(x: dict, scale: float):
        out, _, lse = op(x["q"], x["kv"][:, None, :], x["topk_idxs"][:, None, :], scale, 512,
                         x["attn_sink"], None, None)
        return out, lse
    return run


def variant_kernel(text: str, op: str, heads: int, d_qk: int, device: int):
    """The kernel of ``op:backend:field=value,...`` for this shape through the production loader
    (a stored artifact, else built and published into the cache), or None when the variant is
    for another op or cannot take this shape (e.g. a flavour of other head counts)."""
    from dsa_aot.build import build_and_publish
    from dsa_aot.loader import get_loader
    from dsa_aot.specs.models import KernelSpec, TileConfig

    vop, backend, fields = (text.split(":") + [""])[:3]
    if vop != op:
        return None
    tile = TileConfig(**{k: (int(v) if v.isdigit() else v) for k, v in
                         (f.split("=") for f in fields.split(",") if f)})
    spec = KernelSpec(op=op, arch="sm_90a", d_qk=d_qk, heads=heads, layout="noncompact", backend=backend, tile=tile)
    try:  # a flavour for some head counts only: no row where it cannot build
        get_backend(backend).check_spec(spec)
    except ValueError as exc:
        print(f"variant {text}: no row at h{heads} d{d_qk}: {exc}", file=sys.stderr)
        return None
    loader = get_loader()
    hit = loader.try_load(spec, device)
    if hit is not None:
        return spec, hit[0]
    store = loader.writable_store()
    done = build_and_publish(store, spec, loader.toolchain())
    return spec, get_backend(backend).load(done.manifest, done.read(store), device)


def peer_bwd():
    try:
        from cudnn.deepseek_sparse_attention.sparse_attention_backward.api import (
            sparse_attention_backward_wrapper)
    except Exception as exc:  # the peer is optional
        print(f"peer unavailable: {exc}", file=sys.stderr)
        return None
    return sparse_attention_backward_wrapper


def _served_by(op: str, heads: int, d_qk: int, topk: int) -> str:
    """The backend whose kernel the last call of this shape used (from the runner's spec; a
    top-k bucketed backend reports the bucket's kernel for this width)."""
    for (kop, _, kd, kh, _, det), kernel in ops._KERNELS.items():
        if (kop, kd, kh, det) == (op, d_qk, heads, False):
            if hasattr(kernel, "kernel_for"):  # runners.TopkBuckets
                kernel = kernel.kernel_for(topk)[0]
            spec = getattr(kernel, "spec", None)
            return spec.backend if spec is not None else "reference"
    return "none"


def run_forced(op: str, backend: str, call, heads: int, d_qk: int, topk: int, reps: int):
    """``call()`` with only ``backend`` allowed: (its first result, median ms), or None (logged)
    when that backend has no artifact for the shape or another one served it."""
    with settings.scope(backends=(backend,)):
        try:
            first = call()
        except MissingPrebuiltError as exc:
            print(f"{op}  h{heads} d{d_qk} k{topk}: {backend} skipped: {exc}", flush=True)
            return None
        served = _served_by(op, heads, d_qk, topk)
        if served != backend:
            print(f"{op}  h{heads} d{d_qk} k{topk}: {backend} not available (served by {served}); "
                  "skipped", flush=True)
            return None
        return first, time_cuda(call, reps=reps)


REF_ROWS = 256


def _paired_fields(paired: dict | None) -> dict:
    """A record's paired-timing fields (peer ms / ours, call by call), or none."""
    if not paired:
        return {}
    return {"paired_ratio": round(paired["ratio"], 3), "paired_ratio_q1": round(paired["q1"], 3),
            "paired_ratio_q3": round(paired["q3"], 3)}


def reference(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference on the first 256 query rows (the full problem would take minutes)."""
    from dsa_aot.kernels.reference import sparse_mla_fwd_ref

    n = REF_ROWS
    return sparse_mla_fwd_ref(x["q"][:n], x["kv"], x["topk_idxs"][:n], attn_sink=x["attn_sink"],
                              compute_dtype=torch.float32)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def markdown(records: list[dict], env: dict[str, str], cmd: str) -> list[str]:
    """The result file's Markdown: command, GPU, toolchain and date, then one row per record
    ("-" in the peer and paired columns where no peer ran)."""
    lines = [f"# Sparse MLA on {env['gpu']}", "",
             f"Command: `{cmd}`  ", f"Date: {env['date']}  ",
             "Toolchain: " + ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("gpu", "date")), "",
             "| op | backend | S_q | S_kv | H | D_qk | K | dsa-aot ms | TFLOPS | peer ms | peer TFLOPS | ratio (peer ms / ours) "
             "| paired ratio [q1, q3] |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    if any(r.get("causal") for r in records):
        lines[6:6] = ["Causal prefill inputs (`--causal`): the early rows' trailing slots are -1; TFLOPS "
                      "count every slot.", ""]
    for r in records:
        flops = (fwd_flops if r["op"] == "fwd" else bwd_flops)(r["s_q"], r["heads"], r["topk"], r["d_qk"])
        ptf = f"{flops / r['peer_ms'] / 1e9:.0f}" if r["peer_ms"] else "-"
        lines.append(f"| {r['op']} | {r['backend'].split('/')[-1]} | {r['s_q']} | {r['s_kv']} | {r['heads']} | {r['d_qk']} | {r['topk']} | "
                     f"{r['ms']:.3f} | {r['tflops']:.0f} | {r['peer_ms'] or '-'} | {ptf} | {r['ratio'] or '-'} | "
                     + (f"{r['paired_ratio']} [{r['paired_ratio_q1']}, {r['paired_ratio_q3']}] |" if r.get("paired_ratio") else "- |"))
    return lines


def table_rows(table: list[tuple[int, ...]], args: argparse.Namespace) -> list[tuple[int, ...]]:
    """The rows of ``table`` a run times (``--shapes`` picks row numbers; default all)."""
    return [r for i, r in enumerate(table) if not args.shapes or i in args.shapes]


def _rows(own: list[list[int]] | None, table: list[tuple[int, ...]],
          args: argparse.Namespace) -> list[tuple[int, ...]]:
    """The rows of your own (``--fwd-shape`` / ``--bwd-shape``), else the table's."""
    return [tuple(row) for row in own] if own else table_rows(table, args)


def fwd_rows(args: argparse.Namespace) -> list[tuple[int, ...]]:
    """The forward rows a run times: its ``--fwd-shape`` rows, else the table's."""
    return _rows(args.fwd_shape, FWD_SHAPES, args)


def bwd_rows(args: argparse.Namespace) -> list[tuple[int, ...]]:
    """The backward rows a run times: its ``--bwd-shape`` rows, else the table's."""
    return _rows(args.bwd_shape, BWD_SHAPES, args)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/h200.json"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2,
                    help="forward: interleaved rounds (peer, then ours); each keeps its best median")
    ap.add_argument("--fwd-backends", nargs="+", default=["tilelang", "cutedsl"])
    ap.add_argument("--bwd-backends", nargs="+", default=["tilelang", "cutedsl"])
    ap.add_argument("--ops", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    ap.add_argument("--flashmla", help="compiled FlashMLA library (_flashmla_C.abi3.so); default $FLASHMLA_SO")
    ap.add_argument("--variant", action="append", default=[],
                    help="extra rows for op:backend:tile-field=value,... e.g. bwd:cutedsl:flavour=wgmma")
    ap.add_argument("--shapes", type=int, nargs="+", help="only these row numbers (0-based) of each table")
    ap.add_argument("--fwd-shape", type=int, nargs=5, action="append", metavar=("S_Q", "S_KV", "H", "D", "K"),
                    help="forward rows of your own instead of the table (repeat for several)")
    ap.add_argument("--bwd-shape", type=int, nargs=5, action="append", metavar=("S_Q", "S_KV", "H", "D", "K"),
                    help="backward rows of your own instead of the table (repeat for several), e.g. "
                    "the same S_Q x K at fewer, longer rows")
    ap.add_argument("--causal", action="store_true",
                    help="causal prefill inputs: query row t sits at position S_kv - S_q + t and picks "
                    "among the positions up to it, -1 in the slots it cannot fill (trailing)")
    ap.add_argument("--no-paired", action="store_true",
                    help="skip the paired timing (ours and the peer called alternately, median per-pair ratio)")
    return ap


def main() -> int:
    args = parser().parse_args()
    env = environment()
    records = []
    peer = peer_bwd()
    flashmla = peer_fwd(args.flashmla)
    for s_q, s_kv, h, d, k in fwd_rows(args) if "fwd" in args.ops else []:
        x = make_inputs(s_q, s_kv, h, d, k, causal=args.causal)
        ref_out, ref_lse = reference(x)  # once per shape; every backend is checked against it
        scale = d ** -0.5
        peer_ms = None
        theirs_fwd = lambda: flashmla(x, scale)  # noqa: E731
        ours_fwd = lambda: dsa_aot.sparse_mla_fwd(x["q"], x["kv"], x["topk_idxs"], attn_sink=x["attn_sink"])  # noqa: E731
        if flashmla is not None:
            theirs_out, theirs_lse = theirs_fwd()
        best: dict[str, tuple | None] = {}
        for _ in range(args.rounds):  # interleaved: peer, then each backend, round after round
            if flashmla is not None:
                ms = time_cuda(theirs_fwd, reps=args.reps)
                peer_ms = ms if peer_ms is None else min(peer_ms, ms)
            for backend in args.fwd_backends:
                run = run_forced("fwd", backend, ours_fwd, h, d, k, args.reps)
                prev = best.get(backend)
                best[backend] = run if prev is None or run is None else (prev[0], min(prev[1], run[1]))
        if peer_ms is not None:
            print(f"fwd  flashmla  h{h} d{d} k{k}: {peer_ms:.3f} ms "
                  f"{fwd_flops(s_q, h, k, d) / peer_ms / 1e9:.0f} TFLOPS", flush=True)
        runs = list(best.items())
        paired: dict[str, dict] = {}
        for backend, run in runs:
            if run is not None and flashmla is not None and not args.no_paired:
                with settings.scope(backends=(backend,)):
                    paired[backend] = time_paired(theirs_fwd, ours_fwd, reps=args.reps)
        for text in args.variant:
            found = variant_kernel(text, "fwd", h, d, x["q"].device.index or 0)
            if found is not None:
                spec, kernel = found
                call = lambda: kernel(x["q"], x["kv"], x["topk_idxs"], None, x["attn_sink"], scale)  # noqa: E731
                name = f"{spec.backend}[{text.split(':', 2)[2]}]"
                runs.append((name, (call(), time_cuda(call, reps=args.reps))))
                if flashmla is not None and not args.no_paired:
                    paired[name] = time_paired(theirs_fwd, call, reps=args.reps)
        for backend, run in runs:
            if run is None:
                continue
            (out, lse), ms = run
            tf = fwd_flops(s_q, h, k, d) / ms / 1e9
            rec = {"op": "fwd", "backend": f"dsa-aot/{backend}", "s_q": s_q, "s_kv": s_kv, "heads": h,
                   "d_qk": d, "topk": k, "ms": round(ms, 4), "tflops": round(tf, 1),
                   "out_rel_err": round(rel(out[:REF_ROWS], ref_out), 5),
                   "lse_max_abs_err": round(float((lse[:REF_ROWS] - ref_lse).abs().max()), 5),
                   "peer": None, "peer_ms": None, "ratio": None, "date": env["date"], "causal": args.causal}
            if peer_ms is not None:
                rec.update(peer="flashmla sparse_prefill_fwd", peer_ms=round(peer_ms, 4), ratio=round(peer_ms / ms, 3),
                           agreement_rel_err={"out": round(rel(out, theirs_out), 5),
                                              "lse": round(rel(lse, theirs_lse), 7)})
                rec.update(_paired_fields(paired.get(backend)))
            records.append(rec)
            print(f"fwd  {backend:9s} h{h} d{d} k{k}: {ms:.3f} ms {tf:.0f} TFLOPS  ours/peer speed "
                  f"{rec['ratio']}", flush=True)
    for s_q, s_kv, h, d, k in bwd_rows(args) if "bwd" in args.ops else []:
        x = make_inputs(s_q, s_kv, h, d, k, causal=args.causal)
        out, lse = dsa_aot.sparse_mla_fwd(x["q"], x["kv"], x["topk_idxs"], attn_sink=x["attn_sink"])
        peer_ms, peer_res, row_peer = None, None, peer
        if peer is not None:
            def theirs():
                return peer(x["q"], x["kv"], out, x["dout"], lse, x["attn_sink"], x["topk_idxs"])
            try:
                peer_res = theirs()  # JIT compile happens here
                peer_ms = time_cuda(theirs, reps=args.reps)
            except Exception as exc:  # a peer that refuses the row leaves its columns empty
                print(f"bwd  h{h} d{d} k{k}: peer failed: {type(exc).__name__}: {exc}", flush=True)
                row_peer = None
        runs = []
        paired = {}
        ours_bwd = lambda: dsa_aot.sparse_mla_bwd(  # noqa: E731
            x["q"], x["kv"], out, x["dout"], lse, x["topk_idxs"], attn_sink=x["attn_sink"])
        for backend in args.bwd_backends:
            run = run_forced("bwd", backend, ours_bwd, h, d, k, args.reps)
            runs.append((backend, run))
            if run is not None and row_peer is not None and not args.no_paired:
                with settings.scope(backends=(backend,)):
                    paired[backend] = time_paired(theirs, ours_bwd, reps=args.reps)
        for text in args.variant:
            found = variant_kernel(text, "bwd", h, d, x["q"].device.index or 0)
            if found is not None:
                spec, kernel = found
                call = lambda: kernel(x["q"], x["kv"], out, x["dout"], lse, x["topk_idxs"], None,  # noqa: E731
                                      x["attn_sink"], d ** -0.5)
                name = f"{spec.backend}[{text.split(':', 2)[2]}]"
                runs.append((name, (call(), time_cuda(call, reps=args.reps))))
                if row_peer is not None and not args.no_paired:
                    paired[name] = time_paired(theirs, call, reps=args.reps)
        for backend, run in runs:
            if run is None:
                continue
            mine, ms = run
            tf = bwd_flops(s_q, h, k, d) / ms / 1e9
            rec = {"op": "bwd", "backend": f"dsa-aot/{backend}", "s_q": s_q, "s_kv": s_kv, "heads": h,
                   "d_qk": d, "topk": k, "ms": round(ms, 4), "tflops": round(tf, 1), "peer": None,
                   "peer_ms": None, "ratio": None, "date": env["date"], "causal": args.causal}
            if peer_ms is not None:
                agree = {n: rel(m, peer_res[n]) for n, m in zip(("dq", "dkv", "d_sink"), mine)}
                rec.update(peer="cudnn-frontend sparse_attention_backward_wrapper", peer_ms=round(peer_ms, 4),
                           ratio=round(peer_ms / ms, 3), agreement_rel_err={n: round(v, 5) for n, v in agree.items()})
                rec.update(_paired_fields(paired.get(backend)))
            records.append(rec)
            print(f"bwd  {backend:9s} h{h} d{d} k{k}: {ms:.3f} ms {tf:.0f} TFLOPS  peer {rec['peer_ms']} ms  "
                  f"ours/peer speed {rec['ratio']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    cmd = "python bench/bench_sparse_mla.py " + " ".join(sys.argv[1:])
    lines = markdown(records, env, cmd)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(records) - 2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
