"""bench/profile_deterministic.py's CPU-side parts: which phase each GPU kernel of a backward
call belongs to, the per-phase sums, span and idle time, and the result's Markdown."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"

#: Kernel names as the profiler reports them (CuTe DSL entry names carry module and class).
NAMES = {
    "kernel_cutlass_kernel_ws_dsa_aotkernelscutedsl_bwd_wsSparseMlaBwdWsNoncompactDeterministic_"
    "object_at__tensorptrbf16gmemalign16o128512i64div8": "main",
    "kernel_cutlass_kernel_slot_major_dsa_aotkernelscutedsl_bwd_slot_majorSparseMlaBwdSlotMajor"
    "Noncompact_object_at__tensorptrbf16": "main",
    "kernel_cutlass_kernel_dsa_aotkernelscutedsl_bwd_postprocessSparseMlaBwdReduce_object_at__"
    "tensorptrbf16gmemalign16odiv64i64div81": "reduce",
    "kernel_cutlass_kernel_dsa_aotkernelscutedsl_bwd_postprocessSparseMlaBwdPostprocess_object_"
    "at__tensorptrf32gmem": "postprocess",
    "kernel_cutlass_kernel_dsa_aotkernelscutedsl_bwd_preprocessSparseMlaBwdPreprocess_object_at__"
    "tensorptrbf16": "preprocess",
    "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::"
    "DeviceRadixSortPolicy<short, long, int>::Policy900, false, short, long, int, int>": "sort",
    "void at::native::(anonymous namespace)::searchsorted_cuda_kernel<short>(long*, short const*)": "sort",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
    "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)": "torch",
}


@pytest.fixture(scope="module")
def prof():
    spec = importlib.util.spec_from_file_location("_bench_profile_deterministic",
                                                  BENCH / "profile_deterministic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", sorted(NAMES))
def test_each_kernel_lands_in_its_phase(prof, name):
    assert prof.phase_of(name) == NAMES[name]


def test_phases_sum_kernel_time_and_the_gaps_are_idle(prof):
    kernels = [("cutedsl_bwd_preprocessX", 0.0, 140.0),
               ("kernel_ws_dsa_aotkernelscutedsl_bwd_wsSparseMlaBwdWs", 150.0, 3150.0),
               ("cub::DeviceRadixSortHistogramKernel", 3160.0, 3200.0),
               ("cub::DeviceRadixSortOnesweepKernel", 3200.0, 3260.0),
               ("cutedsl_bwd_postprocessSparseMlaBwdReduce", 3270.0, 4470.0)]
    got = prof.summarize(kernels)
    assert got["span_ms"] == pytest.approx(4.47)
    assert got["idle_ms"] == pytest.approx(0.03)  # 10 + 10 + 10 us between kernels
    assert got["phases"]["main"] == {"ms": 3.0, "kernels": 1}
    assert got["phases"]["sort"] == {"ms": 0.1, "kernels": 2}
    assert got["phases"]["reduce"] == {"ms": 1.2, "kernels": 1}
    assert got["phases"]["postprocess"] == {"ms": 0.0, "kernels": 0}
    assert got["main_launch_ms"] == [3.0]
    assert prof.summarize([]) == {"span_ms": 0.0, "idle_ms": 0.0,
                                  "phases": {p: {"ms": 0.0, "kernels": 0} for p, _ in prof.PHASES},
                                  "main_launch_ms": []}


def test_each_main_launch_is_listed_in_launch_order(prof):
    """The fixed-point mode launches the main kernel several times a call: sample, guess, redo."""
    kernels = [("kernel_ws_dsa_aotkernelscutedsl_bwd_wsSparseMlaBwdWs", 2000.0, 12000.0),
               ("kernel_ws_dsa_aotkernelscutedsl_bwd_wsSparseMlaBwdWs", 100.0, 600.0),
               ("elementwise_kernel", 600.0, 700.0),
               ("kernel_ws_dsa_aotkernelscutedsl_bwd_wsSparseMlaBwdWs", 12000.0, 12014.0)]
    got = prof.summarize(kernels)
    assert got["main_launch_ms"] == [0.5, 10.0, 0.014]
    assert got["phases"]["main"] == {"ms": pytest.approx(10.514), "kernels": 3}


def test_markdown_has_a_row_per_shape_and_mode(prof):
    call = prof.summarize([("cutedsl_bwd_wsX", 0.0, 1000.0), ("FillFunctor", 1000.0, 1010.0)])
    doc = {"command": "python bench/profile_deterministic.py --rows 0",
           "environment": {"gpu": "NVIDIA H200", "date": "2026-12-04", "torch": "2.11.0",
                           "cuda": "13.0"},
           "records": [{"heads": 64, "d_qk": 576, "topk": 2048, "fast": call,
                        "deterministic": call}]}
    lines = prof.markdown(doc).splitlines()
    rows = [line for line in lines if line.startswith("| 64 | 576 | 2048 |")]
    assert [r.split(" | ")[3] for r in rows] == ["fast", "deterministic"]
    doc["records"][0]["mode"] = "fixed_point"  # recorded since the mode is chosen per run
    rows = [line for line in prof.markdown(doc).splitlines() if line.startswith("| 64 | 576 | 2048 |")]
    assert [r.split(" | ")[3] for r in rows] == ["fast", "deterministic (fixed_point)"]
    assert "| 1.000 (1) |" in rows[0] and "| 0.010 (1) |" in rows[0] and " - |" in rows[0]
