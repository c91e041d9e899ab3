"""Where the backward's time goes, fast and deterministic modes, kernel by kernel (torch profiler).

    DSA_AOT_PREBUILT_DIR=<prebuilt cache> DSA_AOT_REQUIRE_PREBUILT=1 \\
        python bench/profile_deterministic.py --rows 0 2 --out bench/results/h200_deterministic_profile.json

For each row of :data:`bench_deterministic.ROWS` (``--rows`` picks some): the CuTe DSL backward
through the public API, warmed up, then one call per mode under ``torch.profiler``. Every GPU
kernel of the call is put in a phase (:func:`phase_of`: the main kernel, the deterministic
reduction, the pre- and postprocess, the row order's sort and search, other torch kernels); per
phase its kernels' GPU time and count, and for the call its span on the GPU (first kernel start to
last kernel end) and the idle time between kernels (span minus the kernels' time). Writes JSON and
a Markdown table; ``DSA_AOT_DETERMINISTIC_WORKSPACE`` (or ``--workspace``) sets the stored-rows
chunking, ``DSA_AOT_DETERMINISTIC_MODE`` (or ``--mode``) the deterministic mode.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_deterministic import ROWS  # noqa: E402
from common import environment, make_inputs, write_results  # noqa: E402

import dsa_aot  # noqa: E402
from dsa_aot import settings  # noqa: E402

#: Phases in report order, with the kernel-name fragments that place a kernel in them (the first
#: phase with a matching fragment wins; CuTe DSL kernel names carry their module and class).
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reduce", ("SparseMlaBwdReduce",)),
    ("postprocess", ("cutedsl_bwd_postprocess",)),
    ("preprocess", ("cutedsl_bwd_preprocess",)),
    ("main", ("cutedsl_bwd_ws", "cutedsl_bwd_slot_major", "cutedsl_bwd_main")),
    ("sort", ("sort", "Sort", "cub::")),  # CUB's radix sort kernels, torch's searchsorted
    ("torch", ()),
)


def phase_of(kernel_name: str) -> str:
    """The phase of a GPU kernel, by its name (``torch`` when no fragment matches)."""
    for phase, fragments in PHASES:
        if any(f in kernel_name for f in fragments):
            return phase
    return "torch"


def summarize(kernels: list[tuple[str, float, float]]) -> dict:
    """Per phase the GPU time (ms) and count of ``kernels`` ``(name, start_us, end_us)``, the
    call's span on the GPU, its idle time between kernels (ms) and each main-kernel launch's
    time in launch order (the fixed-point mode launches it several times a call)."""
    phases = {phase: {"ms": 0.0, "kernels": 0} for phase, _ in PHASES}
    main_launches = []
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        phase = phase_of(name)
        p = phases[phase]
        p["ms"] += (end - start) / 1e3
        p["kernels"] += 1
        if phase == "main":
            main_launches.append(round((end - start) / 1e3, 4))
    busy = sum(p["ms"] for p in phases.values())
    span = (max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)) / 1e3 if kernels else 0.0
    return {"span_ms": round(span, 4), "idle_ms": round(max(0.0, span - busy), 4),
            "phases": {k: {"ms": round(v["ms"], 4), "kernels": v["kernels"]} for k, v in phases.items()},
            "main_launch_ms": main_launches}


def gpu_kernels(prof) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of every GPU kernel the profiler saw."""
    found = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.end > ev.time_range.start:
            found.append((ev.name, float(ev.time_range.start), float(ev.time_range.end)))
    return found


def profile_call(call) -> dict:
    """One profiled call (after two warm-ups) of ``call``, summarized."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return summarize(gpu_kernels(prof))


def markdown(doc: dict) -> str:
    """The result file's Markdown: a row per (shape, mode), a column per phase."""
    env = doc["environment"]
    names = [phase for phase, _ in PHASES]
    lines = [f"# Backward time by phase (CuTe DSL), {env['gpu']}, {env['date']}", "",
             f"`{doc['command']}`; torch {env['torch']}, CUDA {env['cuda']}. One profiled call per "
             "mode (torch.profiler) after warm-up; ms of GPU time per phase (kernels), the call's "
             "span on the GPU and its idle time between kernels.", "",
             "| H | D_qk | K | mode | span ms | idle ms | " + " | ".join(f"{n} ms (kernels)" for n in names)
             + " |", "|---|---|---|---|---|---|" + "---|" * len(names)]
    for r in doc["records"]:
        for mode in ("fast", "deterministic"):
            got = r[mode]
            cells = [f"{got['phases'][n]['ms']:.3f} ({got['phases'][n]['kernels']})"
                     if got["phases"][n]["kernels"] else "-" for n in names]
            label = mode if mode == "fast" or "mode" not in r else f"deterministic ({r['mode']})"
            lines.append(f"| {r['heads']} | {r['d_qk']} | {r['topk']} | {label} | {got['span_ms']:.3f} | "
                         f"{got['idle_ms']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/h200_deterministic_profile.json"))
    ap.add_argument("--rows", type=int, nargs="+", help="only these row numbers (0-based)")
    ap.add_argument("--workspace", type=int, help="deterministic_workspace in bytes (default: the setting)")
    ap.add_argument("--mode", choices=settings.DETERMINISTIC_MODES, default=None,
                    help="the deterministic mode profiled (default: the setting)")
    args = ap.parse_args()
    env = environment()
    records = []
    cfg = settings.get()
    with settings.scope(backends=("cutedsl",),
                        deterministic_workspace=args.workspace or cfg.deterministic_workspace,
                        deterministic_mode=args.mode or cfg.deterministic_mode):
        for i, (s_q, s_kv, h, d, k) in enumerate(ROWS):
            if args.rows and i not in args.rows:
                continue
            x = make_inputs(s_q, s_kv, h, d, k)
            out, lse = dsa_aot.sparse_mla_fwd(x["q"], x["kv"], x["topk_idxs"], attn_sink=x["attn_sink"])
            rec = {"s_q": s_q, "s_kv": s_kv, "heads": h, "d_qk": d, "topk": k,
                   "workspace": settings.get().deterministic_workspace,
                   "mode": settings.get().deterministic_mode, "date": env["date"]}
            for mode, det in (("fast", False), ("deterministic", True)):
                rec[mode] = profile_call(lambda: dsa_aot.sparse_mla_bwd(
                    x["q"], x["kv"], out, x["dout"], lse, x["topk_idxs"], attn_sink=x["attn_sink"],
                    deterministic=det))
            records.append(rec)
            print(json.dumps(rec), flush=True)
    doc = {"command": " ".join(["python", *sys.argv]), "environment": env, "records": records}
    write_results(args.out, doc, markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
