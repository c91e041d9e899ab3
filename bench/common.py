"""Shared helpers for the benchmarks: inputs, timing, environment description, result files."""

from __future__ import annotations

import datetime
import importlib.metadata as md
import importlib.util
import json
import platform
import re
import statistics
from pathlib import Path

import torch

from dsa_aot.specs.installed import driver_cuda_version, dsl_cuda_choice


def make_inputs(s_q: int, s_kv: int, heads: int, d_qk: int, topk: int, *, seed: int = 0,
                device: str = "cuda", sink: bool = True, causal: bool = False) -> dict[str, torch.Tensor]:
    """Random bf16 inputs with distinct in-range indices per row (never zeros). ``causal``: query
    row ``t`` sits at position ``s_kv - s_q + t`` and picks among the positions up to it, -1 in
    the slots it cannot fill (the early rows of a prefill are mostly padding)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((s_q, heads, d_qk), generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    kv = torch.randn((s_kv, d_qk), generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    k = min(topk, s_kv)
    keys = torch.rand((s_q, s_kv), generator=g, device=device)
    if causal:
        pos = torch.arange(s_kv - s_q, s_kv, device=device)[:, None]
        keys = keys.masked_fill(torch.arange(s_kv, device=device)[None, :] > pos, 2.0)  # last
    idx = keys.argsort(dim=1)[:, :k].to(torch.int32)
    if causal:
        idx = idx.masked_fill(torch.arange(k, device=device)[None, :] > pos, -1)
    if k < topk:
        idx = torch.cat([idx, torch.full((s_q, topk - k), -1, dtype=torch.int32, device=device)], dim=1)
    dout = torch.randn((s_q, heads, 512), generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    attn_sink = (torch.randn((heads,), generator=g, device=device) if sink else None)
    return {"q": q, "kv": kv, "topk_idxs": idx.contiguous(), "dout": dout, "attn_sink": attn_sink}


def time_cuda(fn, *, warmup: int = 5, reps: int = 30) -> float:
    """Median milliseconds of ``fn()`` measured with CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_timed(fn) for _ in range(reps))


def _timed(fn) -> float:
    """Milliseconds of one ``fn()`` between two CUDA events, waited for."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_paired(fn_a, fn_b, *, warmup: int = 3, reps: int = 30) -> dict[str, float]:
    """``fn_a`` and ``fn_b`` called alternately (a, b, then b, a, ...), each call timed by its own
    CUDA events. The median of the per-pair ratios ``ms_a / ms_b`` compares the two under the
    same clock and temperature, which drift between rounds timed one after the other; ``q1`` /
    ``q3`` are its quartiles."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    torch.cuda.synchronize()
    times: dict[int, list[float]] = {0: [], 1: []}
    for rep in range(reps):
        order = ((0, fn_a), (1, fn_b)) if rep % 2 == 0 else ((1, fn_b), (0, fn_a))
        for which, fn in order:
            times[which].append(_timed(fn))
    ratios = statistics.quantiles([a / b for a, b in zip(times[0], times[1])], n=4)
    return {"ratio": ratios[1], "q1": ratios[0], "q3": ratios[2]}


def fwd_flops(s_q: int, heads: int, topk: int, d_qk: int, d_v: int = 512) -> float:
    return 2.0 * s_q * heads * topk * (d_qk + d_v)


def bwd_flops(s_q: int, heads: int, topk: int, d_qk: int, d_v: int = 512) -> float:
    return 2.0 * s_q * heads * topk * (3 * d_qk + 2 * d_v)


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "absent"


_DSL_FLAVOUR = re.compile(r"^_cutlass_ir\.cu(\d+)\.")


def dsl_mlir_libs() -> Path | None:
    """The CuTe DSL's ``_mlir/_mlir_libs`` folder, found without importing ``cutlass``."""
    found = importlib.util.find_spec("cutlass")
    if found is None or not found.submodule_search_locations:
        return None
    return Path(list(found.submodule_search_locations)[0]) / "_mlir" / "_mlir_libs"


def cutlass_dsl_flavour(mlir_libs: Path | None, driver: int | None) -> str:
    """Which CUDA flavour the CuTe DSL loads, and why, given its ``_mlir_libs`` folder and the
    driver (``cuDriverGetVersion``'s value, None for no driver).

    The DSL ships one ``_cutlass_ir.cu<N>`` extension per installed ``nvidia-cutlass-dsl-libs-cu<N>``
    and loads the newest whose CUDA major the driver supports (the newest installed without a
    driver). The cuDNN frontend's CuTe DSL kernels are compiled with it, and their speed depends on
    it (``bench/results/h100_bwd_cudnn_dsl_flavours.md``), so result files name it.
    """
    files = mlir_libs.iterdir() if mlir_libs is not None and mlir_libs.is_dir() else ()
    installed = sorted({int(m.group(1)) for p in files if (m := _DSL_FLAVOUR.match(p.name))})
    if not installed:
        return "absent"
    names = ", ".join(f"cu{v}" for v in installed)
    chosen = dsl_cuda_choice(installed, driver)
    if driver is None:
        return f"cu{chosen} (installed {names}; no driver: the newest)"
    driver_text = f"driver CUDA {driver // 1000}.{driver % 1000 // 10}"
    if chosen is None:
        return f"none usable (installed {names}; {driver_text})"
    return f"cu{chosen} (installed {names}; {driver_text})"


def environment() -> dict[str, str]:
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__, "cuda": str(torch.version.cuda), "python": platform.python_version(),
        "tilelang": _version("tilelang"), "nvidia-cutlass-dsl": _version("nvidia-cutlass-dsl"),
        "cutlass-dsl flavour": cutlass_dsl_flavour(dsl_mlir_libs(), driver_cuda_version()),
        "nvidia-cudnn-frontend": _version("nvidia-cudnn-frontend"),
        "date": datetime.date.today().isoformat(),
    }


def write_results(out: Path, doc: object, markdown: str | None = None) -> None:
    """``doc`` as JSON at ``out`` and, when given, ``markdown`` beside it (same name, ``.md``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    if markdown is not None:
        out.with_suffix(".md").write_text(markdown)
