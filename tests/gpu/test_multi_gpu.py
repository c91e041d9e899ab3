"""Several GPUs in one process, and several ranks on one host.

* every op of every backend with all tensors on one GPU while another is current, both ways:
  the results equal the single-device results, the kernels run on the tensors' device and on
  that device's current stream (read from the profiler's trace), the caller's current device
  is left alone;
* one process alternating between the GPUs, and threads making their first call on the GPUs at
  the same moment: one load per (kernel, device);
* ``torchrun`` ranks starting cold from one read-only prebuilt root (``multi_rank_check.py``).

The cross-device tests need two GPUs and skip on one; the concurrency tests and the ranks run on
one GPU too (two ranks then share it and exchange gradients over gloo instead of NCCL).

    DSA_AOT_PREBUILT_DIR=... DSA_AOT_REQUIRE_PREBUILT=1 pytest -m gpu tests/gpu/test_multi_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import dsa_aot
from dsa_aot import ops, settings

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
HERE = Path(__file__).resolve().parent
BACKENDS = {"fwd": ("tilelang", "cutedsl"), "bwd": ("tilelang", "cutedsl", "cudnn")}
S_Q, S_KV, H, D, K = 256, 1024, 64, 576, 512


def make_inputs(device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn((S_Q, H, D), generator=g).bfloat16(),
         "kv": torch.randn((S_KV, D), generator=g).bfloat16(),
         "idx": torch.randint(-1, S_KV, (S_Q, K), generator=g, dtype=torch.int32),
         "sink": torch.randn((H,), generator=g),
         "dout": torch.randn((S_Q, H, 512), generator=g).bfloat16()}
    return {n: t.to(device) for n, t in x.items()}


def run(op: str, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    out, lse = dsa_aot.sparse_mla_fwd(x["q"], x["kv"], x["idx"], attn_sink=x["sink"])
    if op == "fwd":
        return out, lse
    return dsa_aot.sparse_mla_bwd(x["q"], x["kv"], out, x["dout"], lse, x["idx"], attn_sink=x["sink"])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(autouse=True)
def device_zero():
    """Every test starts and ends with cuda:0 current."""
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(0)


@pytest.fixture
def only(monkeypatch: pytest.MonkeyPatch):
    """``only(backend)``: the loader tries just that backend; kernels are looked up afresh."""
    def pick(backend: str) -> None:
        # the forward of a backward test comes from `backend` where it has one, else cutedsl
        monkeypatch.setenv("DSA_AOT_BACKENDS", f"{backend},cutedsl")
        settings.reload()
        ops._clear()
    yield pick
    monkeypatch.undo()
    settings.reload()
    ops._clear()


def _served(op: str, device: int) -> str:
    kernel = ops._KERNELS[(op, device, D, H, "noncompact", False)]
    if hasattr(kernel, "kernel_for"):
        kernel = kernel.kernel_for(K)[0]
    return getattr(getattr(kernel, "spec", None), "backend", "reference")


def _kernels_by_stream(trace: Path) -> list[tuple[str, int, int]]:
    events = json.loads(trace.read_text())["traceEvents"]
    return [(e["name"], int(e["args"]["device"]), int(e["args"]["stream"]))
            for e in events if e.get("cat") == "kernel"]


OPS = [(op, b) for op, bs in BACKENDS.items() for b in bs]


@pytest.mark.parametrize("op,backend", OPS)
def test_kernels_run_on_the_callers_current_stream(op, backend, only, tmp_path):
    check_binding(op, backend, 0, 0, only, tmp_path)


@two_gpus
@pytest.mark.parametrize("op,backend", OPS)
@pytest.mark.parametrize("data,current", [(1, 0), (0, 1)])
def test_tensors_on_another_gpu_than_the_current_one(op, backend, data, current, only, tmp_path):
    check_binding(op, backend, data, current, only, tmp_path)


def check_binding(op: str, backend: str, data: int, current: int, only, tmp_path: Path) -> None:
    """Tensors on ``cuda:data`` while ``cuda:current`` is current, on a side stream of ``data``:
    results equal the single-device ones; every kernel on ``data``, on the side stream."""
    only(backend)
    torch.cuda.set_device(data)
    expected = run(op, make_inputs(f"cuda:{data}"))  # the single-device result
    assert _served(op, data) == backend
    ops._clear()
    torch.cuda.set_device(current)
    x = make_inputs(f"cuda:{data}")
    side = torch.cuda.Stream(device=data)
    trace = tmp_path / "trace.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(side):  # that device's current stream becomes `side`
            x["q"].add_(0)  # a torch kernel on `side` (the marker): ours must share its stream
            got = run(op, x)
        side.synchronize()
    prof.export_chrome_trace(str(trace))
    assert torch.cuda.current_device() == current, "a call moved the caller's current device"
    for a, b in zip(got, expected):
        assert a.device == torch.device(f"cuda:{data}")
        if op == "fwd" or a.shape == x["q"].shape:  # dq and forward results are deterministic
            assert torch.equal(a.cpu(), b.cpu())
        else:  # dkv, d_sink: fp32 atomics, order varies between calls
            assert rel(a, b) <= 1e-3
    kernels = _kernels_by_stream(trace)
    assert len(kernels) > 1, kernels  # the marker and ours
    assert {k[1] for k in kernels} == {data}, f"a kernel ran on another device: {kernels}"
    assert len({k[2] for k in kernels}) == 1, f"a kernel left `side` (the marker's stream): {kernels}"


@two_gpus
def test_one_process_alternates_between_gpus():
    ops._clear()
    xs = [make_inputs(f"cuda:{d}", seed=1) for d in (0, 1)]
    first = [run("bwd", x) for x in xs]
    for _ in range(3):
        for d, x in enumerate(xs):
            for a, b in zip(run("bwd", x), first[d]):
                assert a.device.index == d and rel(a, b) <= 1e-3
    assert all(("bwd", d, D, H, "noncompact", False) in ops._KERNELS for d in (0, 1))
    assert rel(first[1][0], first[0][0]) <= 1e-3  # the same inputs give the same dq on both


def _first_calls_at_once(devices: list[int], monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Each thread makes its first call on its device at the same moment; returns the loader's
    resolve calls, as (op, device)."""
    from dsa_aot.loader import get_loader

    loader = get_loader()
    real = loader.resolve
    calls: list[tuple[str, int]] = []

    def counted(op, arch, d_qk, heads, layout, device_index, **kw):
        calls.append((op, device_index))
        return real(op, arch, d_qk, heads, layout, device_index, **kw)

    monkeypatch.setattr(loader, "resolve", counted)
    ops._clear()
    xs = [make_inputs(f"cuda:{d}", seed=2) for d in devices]
    barrier = threading.Barrier(len(devices))
    results: list[object] = [None] * len(devices)

    def first_call(i: int) -> None:
        barrier.wait()
        try:
            results[i] = run("bwd", xs[i])
        except BaseException as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=first_call, args=(i,)) for i in range(len(devices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        assert not isinstance(r, BaseException), r
    for i, d in enumerate(devices):
        for a, b in zip(results[i], run("bwd", xs[i])):
            assert a.device.index == d and rel(a, b) <= 1e-3
    return calls


def test_threads_first_calls_on_one_gpu_load_once(monkeypatch: pytest.MonkeyPatch):
    calls = _first_calls_at_once([0] * 4, monkeypatch)
    assert sorted(calls) == [("bwd", 0), ("fwd", 0)], calls


@two_gpus
def test_threads_first_calls_on_two_gpus_load_once_per_device(monkeypatch: pytest.MonkeyPatch):
    calls = _first_calls_at_once([0, 1, 0, 1], monkeypatch)
    assert sorted(calls) == [("bwd", 0), ("bwd", 1), ("fwd", 0), ("fwd", 1)], calls


@two_gpus
def test_tensors_on_two_gpus_in_one_call_are_refused():
    x = make_inputs("cuda:0")
    with pytest.raises(dsa_aot.InputError, match="kv is on cuda:1 but q is on cuda:0"):
        dsa_aot.sparse_mla_fwd(x["q"], x["kv"].to("cuda:1"), x["idx"])


def test_torchrun_ranks_start_cold_from_one_read_only_prebuilt_root(tmp_path):
    root = settings.get().prebuilt_dirs
    if not root:
        pytest.skip("needs DSA_AOT_PREBUILT_DIR (a prebuilt root)")
    env = dict(os.environ, DSA_AOT_REQUIRE_PREBUILT="1", DSA_AOT_CACHE_DIR=str(tmp_path / "empty-cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "multi_rank_check.py"), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in reports:
        assert r["ok"], json.dumps(r)
        assert r["device"] == (r["rank"] if GPUS >= 2 else 0)
        assert r["compiler_modules"] == [], r
    assert reports[0]["backend"] == ("nccl" if GPUS >= 2 else "gloo")
