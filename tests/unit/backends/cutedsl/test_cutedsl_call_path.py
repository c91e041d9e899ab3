"""The per-call path of an exported CuTe DSL kernel, without a GPU or a build.

A :class:`CuteDslKernel` over a hand-written record (shaped like the sm_90a forward's) whose
entry points are libc functions that do nothing, or a Python callback standing in for the
entry that reads the packed frame. Tensors are CPU tensors seen through :class:`OnCuda` (what
the runtime reads of a tensor, reporting a CUDA device). Covered: the remembered layouts (a hit
still checks every pointer's alignment; a changed dtype, shape, stride or device is checked in
full and raises the same errors; the cache is bounded), the frame a remembered layout packs,
and the runners handing the kernels their tensors by name.
"""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import pytest
import torch

from dsa_aot import runners
from dsa_aot.backends.cutedsl.records import CuteExportRecord
from dsa_aot.backends.cutedsl.runtime import CuteDslKernel, CuteRuntimeError
from dsa_aot.specs.models import KernelSpec

H, D, DV = 64, 576, 512


def _libc() -> str:
    ctypes.CDLL(None).labs  # noqa: B018 - libc is mapped
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "/libc.so" in path or "/libc-" in path:
            return path
    pytest.skip("libc not found in /proc/self/maps")


def _dim(d: int | str | None, div: int = 1) -> dict:
    return {"value": d} if isinstance(d, int) else {"symbol": d, "divisibility": div}


def _tensor(name: str, dtype: str, shape: list, stride: list, align: int) -> dict:
    strides = [_dim(s) if isinstance(s, int) or s is None else _dim(None, int(s[1:])) for s in stride]
    return {"kind": "tensor", "name": name, "dtype": dtype, "shape": [_dim(d) for d in shape],
            "stride": strides, "align": align}


ARGS = [_tensor("q", "bfloat16", ["s_q", H, D], ["d8", "d8", 1], 16),
        _tensor("kv", "bfloat16", ["s_kv", D], ["d8", 1], 16),
        _tensor("topk_idxs", "int32", ["s_q", "topk"], [None, 1], 4),
        {"kind": "scalar", "name": "softmax_scale", "dtype": "float32"},
        _tensor("lse", "float32", ["s_q", H], [None, 1], 4),
        {"kind": "stream", "name": "stream"}]


@pytest.fixture
def kernel() -> CuteDslKernel:
    """A kernel whose init, load and entry are libc's labs, llabs and imaxabs (they do nothing)."""
    record = CuteExportRecord.model_validate({
        "name": "k", "kernel": "fwd", "arch": "sm_90a", "prefix": "k", "library": _libc(),
        "object_file": "-", "header": "-",
        "symbols": {"init": "labs", "load_to_device": "llabs", "entry": "imaxabs"},
        "args": ARGS, "link": "static_cudart", "dsl_version": "-", "library_sha256": "-",
        "build_seconds": 0.0})
    return CuteDslKernel(Path("/"), record)


class OnCuda:
    """A CPU tensor as the runtime sees a CUDA tensor on ``index``."""

    is_cuda = True

    def __init__(self, t: torch.Tensor, index: int = 0) -> None:
        self.t, self.index = t, index
        self.dtype, self.shape = t.dtype, t.shape
        self.device = torch.device("cuda", index)

    def stride(self) -> tuple[int, ...]:
        return self.t.stride()

    def get_device(self) -> int:
        return self.index

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def _inputs(s_q: int = 3, s_kv: int = 10, topk: int = 5) -> list[OnCuda]:
    return [OnCuda(torch.zeros(s_q, H, D, dtype=torch.bfloat16)),
            OnCuda(torch.zeros(s_kv, D, dtype=torch.bfloat16)),
            OnCuda(torch.zeros(s_q, topk, dtype=torch.int32)),
            OnCuda(torch.zeros(s_q, H))]


@pytest.fixture
def validations(kernel: CuteDslKernel, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the kernel ran its full validation (one entry per run)."""
    runs: list[int] = []
    full = kernel._validate

    def counted(tensors):
        runs.append(1)
        return full(tensors)

    monkeypatch.setattr(kernel, "_validate", counted)
    return runs


def test_a_remembered_layout_skips_validation_and_matches_it(kernel, validations) -> None:
    tensors = _inputs()
    first = kernel.marshal(tensors)
    assert kernel.marshal(tensors) == first and len(validations) == 1
    device, values = first
    q, kv, idx, lse = (t.t for t in tensors)
    assert device == 0
    assert values == [q.data_ptr(), 3, H * D, D, kv.data_ptr(), 10, D,
                      idx.data_ptr(), 3, 5, 5, lse.data_ptr(), 3, H]
    again = _inputs()  # new tensors, same layout: a hit with their own pointers
    assert kernel.marshal(again)[1][0] == again[0].t.data_ptr() and len(validations) == 1


def test_a_remembered_layout_still_checks_alignment(kernel, validations) -> None:
    tensors = _inputs()
    kernel.marshal(tensors)
    base = torch.zeros(3 * H * D + 8, dtype=torch.bfloat16)
    for offset, ok in ((8, True), (1, False), (4, False)):  # 16, 2 and 8 bytes in
        view = base[offset:offset + 3 * H * D].view(3, H, D)
        assert (view.shape, view.stride()) == (tensors[0].shape, tensors[0].t.stride())
        call = [OnCuda(view), *tensors[1:]]
        if ok:
            kernel.marshal(call)
            kernel(*call, stream=0, softmax_scale=0.5)
            continue
        for run in (kernel.marshal, lambda c: kernel(*c, stream=0, softmax_scale=0.5)):
            with pytest.raises(ValueError, match="^k: q: data pointer must be 16-byte aligned$"):
                run(call)
    assert len(validations) == 1  # every call above was a hit
    lse = torch.zeros(3 * H + 1)[1:].view(3, H)  # 4-byte aligned: fine for lse
    kernel.marshal([*tensors[:3], OnCuda(lse)])


@pytest.mark.parametrize("change, error", [
    (lambda ts: [OnCuda(ts[0].t.to(torch.float16)), *ts[1:]], "k: q must be bfloat16, got torch.float16"),
    (lambda ts: [OnCuda(torch.zeros(3, 32, D, dtype=torch.bfloat16)), *ts[1:]],
     r"k: q: size\[1\] must be 64, got 32"),
    (lambda ts: [ts[0], ts[1], ts[2], OnCuda(torch.zeros(4, H))], "k: lse: size.0.=4 but q has s_q=3"),
    (lambda ts: [ts[0], OnCuda(torch.zeros(10, D + 4, dtype=torch.bfloat16)[:, :D]), *ts[2:]],
     r"k: kv: stride\[0\]=580 must be a multiple of 8"),
    (lambda ts: [ts[0], OnCuda(torch.zeros(10, 2 * D, dtype=torch.bfloat16)[:, ::2]), *ts[2:]],
     r"k: kv: stride\[1\] must be 1, got 2"),
    (lambda ts: [*ts[:3], ts[3].t], "k: lse must be a CUDA tensor, got cpu"),
    (lambda ts: [*ts[:3], OnCuda(ts[3].t, index=1)], "k: tensors are on devices 0 and 1"),
])
def test_a_changed_layout_is_validated_in_full(kernel, validations, change, error) -> None:
    tensors = _inputs()
    kernel.marshal(tensors)
    bad = change(tensors)
    for _ in range(2):  # a failed validation is not remembered
        with pytest.raises(ValueError, match=error):
            kernel.marshal(bad)
        with pytest.raises(ValueError, match=error):
            kernel(*bad, stream=0, softmax_scale=0.5)
    assert len(validations) == 5 and len(kernel._layouts) == 1


def test_the_layout_cache_is_bounded(kernel, validations) -> None:
    limit = kernel.LAYOUTS
    for s_q in range(1, limit + 11):  # S_q varies call to call
        kernel.marshal(_inputs(s_q=s_q))
    assert len(kernel._layouts) == limit and len(validations) == limit + 10
    kernel.marshal(_inputs(s_q=limit + 10))  # the newest is kept
    kernel.marshal(_inputs(s_q=11))  # the oldest kept
    assert len(validations) == limit + 10
    kernel.marshal(_inputs(s_q=10))  # dropped, first in first out
    assert len(validations) == limit + 11 and len(kernel._layouts) == limit


def test_calls_pack_the_frame_the_entry_reads(kernel) -> None:
    """A Python entry reads each call's frame: the tensors' descriptors, the scale, the stream
    and argv as the C structs lay them out; a nonzero result raises, and the next call (the
    same pooled buffer) starts from 0 again."""
    frame = kernel.frame
    seen: list[tuple[bytes, list[int], int]] = []
    status = [0]

    def entry(argv: int, count: int) -> None:
        base = argv - frame.argv_offset
        pointers = list(struct.unpack(frame.argv_format, ctypes.string_at(argv, 8 * count)))
        seen.append((ctypes.string_at(base, frame.ret_offset), [p - base for p in pointers], count))
        ctypes.c_int32.from_address(pointers[-1]).value = status[0]

    kernel._entry = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)(entry)
    kernel._devices.add(0)  # prepared
    for s_q, scale, stream in ((3, 0.25, 0xABC), (3, 0.5, 0xDEF), (7, 2, 0x123)):  # hit, miss
        tensors = _inputs(s_q=s_q)
        kernel(*tensors, stream=stream, softmax_scale=scale)
        _, values = kernel.marshal(tensors)
        values[11:11] = [float(scale)]  # record order: q, kv, topk_idxs, scale, lse, stream
        ref, _ = frame.pack([*values, stream])
        raw, offsets, count = seen[-1]
        assert raw == ref.raw[:frame.ret_offset]
        assert offsets == frame.offsets and count == len(ARGS) + 1
    status[0] = 700
    with pytest.raises(CuteRuntimeError, match=r"k: launch failed with CUDA error 700 \(cudaErrorIllegalAddress\)"):
        kernel(*_inputs(), stream=0, softmax_scale=0.5)
    status[0] = 0
    kernel(*_inputs(), stream=0, softmax_scale=0.5)
    assert len(frame._free) == 1  # one buffer served every call


def test_scalars_and_tensors_by_name(kernel) -> None:
    kernel._devices.add(0)
    q, kv, idx, lse = _inputs()
    kernel(q, kv, idx, lse, stream=0, softmax_scale=1)  # an int scale is converted
    kernel(q, kv, lse=lse, topk_idxs=idx, stream=0, softmax_scale=0.5)
    with pytest.raises(TypeError, match="k: scalar softmax_scale must be a real number, got bool"):
        kernel(q, kv, idx, lse, stream=0, softmax_scale=True)
    with pytest.raises(TypeError, match=r"k: missing scalar arguments \['softmax_scale'\]"):
        kernel(q, kv, idx, lse, stream=0)
    with pytest.raises(TypeError, match=r"k: missing tensors \['lse'\]"):
        kernel(q, kv, idx, stream=0, softmax_scale=0.5)
    with pytest.raises(TypeError, match="k takes 4 tensors"):
        kernel(q, kv, idx, lse, lse, stream=0, softmax_scale=0.5)


# ---------------------------------------------------------------------------------------------
# Runners
# ---------------------------------------------------------------------------------------------

class _Stage:
    """A CuTe DSL kernel as the runners see it: names, and the call."""

    def __init__(self, tensors: list[str], scalars: list[str]) -> None:
        self.tensor_names, self.scalar_names = tensors, scalars
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *tensors, **kwargs) -> None:
        self.calls.append((tensors, kwargs))


def test_fwd_runner_passes_the_kernels_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runners, "current_stream", lambda dev: 42)
    stage = _Stage(["q", "kv", "topk_idxs", "attn_sink", "out", "lse"], ["softmax_scale"])
    fwd = runners.CuteFwd(stage, KernelSpec.from_id("fwd-sm_90a-d576-h64-noncompact-cutedsl"))
    q, kv, idx, sink = torch.zeros(3, H, D), torch.zeros(10, D), torch.zeros(3, 5), torch.zeros(H)
    out, lse = fwd(q, kv, idx, None, sink, 0.5)
    (tensors, kwargs), = stage.calls
    assert [t is x for t, x in zip(tensors, (q, kv, idx, sink, out, lse))] == [True] * 6
    assert kwargs == {"stream": 42, "softmax_scale": 0.5}
    assert out.shape == (3, H, DV) and lse.shape == (3, H)


def test_fwd_runner_gives_a_persistent_kernel_the_sm_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel with an ``num_sms`` scalar gets the device's SM count on every call."""
    monkeypatch.setattr(runners, "current_stream", lambda dev: 42)
    monkeypatch.setattr(runners, "_sm_count", lambda dev: 132)
    stage = _Stage(["q", "kv", "topk_idxs", "attn_sink", "out", "lse"], ["softmax_scale", "num_sms"])
    fwd = runners.CuteFwd(stage, KernelSpec.from_id("fwd-sm_90a-d576-h64-noncompact-cutedsl"))
    q, kv, idx, sink = torch.zeros(3, H, D), torch.zeros(10, D), torch.zeros(3, 5), torch.zeros(H)
    fwd(q, kv, idx, None, sink, 0.5)
    fwd(q, kv, idx, None, sink, 0.25)
    assert [kw for _, kw in stage.calls] == [{"stream": 42, "softmax_scale": 0.5, "num_sms": 132},
                                             {"stream": 42, "softmax_scale": 0.25, "num_sms": 132}]


def test_bwd_runner_passes_the_stages_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsa_aot.backends.tilelang.launch import CubinKernel

    class Cubin(CubinKernel):
        def __init__(self) -> None:
            self.launches: list[tuple[int, dict]] = []

        def launch(self, stream: int, args: dict) -> None:
            self.launches.append((stream, args))

    monkeypatch.setattr(runners, "current_stream", lambda dev: 7)
    pre = _Stage(["out", "dout", "lse", "attn_sink", "delta", "lse_sink", "d_sink"], [])
    main = _Stage(["q", "kv", "dout", "topk_idxs", "topk_length", "lse_sink", "delta", "dq", "dkv_acc"],
                  ["softmax_scale"])
    post = _Stage(["dkv_acc", "dkv"], [])
    spec = KernelSpec.from_id("bwd-sm_90a-d576-h64-compact-cutedsl")
    q, kv, out, dout = torch.zeros(3, H, D), torch.zeros(10, D), torch.zeros(3, H, DV), torch.zeros(3, H, DV)
    lse, idx, length, sink = torch.zeros(3, H), torch.zeros(3, 5), torch.zeros(3), torch.zeros(H)
    dq, dkv, d_sink = runners.StagedBwd(pre, main, post, spec)(q, kv, out, dout, lse, idx, length, sink, 0.5)
    (pre_t, pre_kw), = pre.calls
    (main_t, main_kw), = main.calls
    (post_t, post_kw), = post.calls
    assert pre_t[:4] == (out, dout, lse, sink) and pre_t[6] is d_sink
    assert main_t[:5] == (q, kv, dout, idx, length) and main_t[5] is pre_t[5] and main_t[6] is pre_t[4]
    assert main_t[7] is dq and post_t == (main_t[8], dkv)
    assert pre_kw == post_kw == {"stream": 7} and main_kw == {"stream": 7, "softmax_scale": 0.5}
    cubin = Cubin()
    runners.StagedBwd(pre, cubin, post, spec)(q, kv, out, dout, lse, idx, length, sink, 0.5)
    (stream, args), = cubin.launches
    assert stream == 7 and args["q"] == q.data_ptr() and args["topk_length"] == length.data_ptr()
    assert {k: args[k] for k in ("softmax_scale", "s_q", "s_kv", "topk")} == \
        {"softmax_scale": 0.5, "s_q": 3, "s_kv": 10, "topk": 5}
    assert args["dkv_acc"] == post.calls[-1][0][0].data_ptr() and args["d_sink"] == pre.calls[-1][0][6].data_ptr()
    assert "d_sink_acc" not in args  # the fast backward has none


def test_bwd_runner_fixed_point_path_launches_its_postprocess_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deterministic call with the fixed-point main kernel: the preprocess once, the main kernel
    and the fixed-point postprocess through ``fixed_point_dkv``'s launches, the postprocess with
    ``dkv_fixed``, the running total, ``dkv`` and the ``d_sink`` partials and sum by name and
    its step and bound as scalars; no fp32 ``dkv_acc`` of the runner's."""
    monkeypatch.setattr(runners, "current_stream", lambda dev: 7)
    s_q, s_kv = 40, 10
    parts = runners.d_sink_parts(s_q)
    partials = torch.randn(parts, H, dtype=torch.float32)

    class Pre(_Stage):
        def __call__(self, *tensors, **kwargs) -> None:
            super().__call__(*tensors, **kwargs)
            tensors[-1].copy_(partials)  # d_sink_acc

    pre = Pre(["out", "dout", "lse", "attn_sink", "delta", "lse_sink", "d_sink_acc"], [])
    main = _Stage(["q", "kv", "dout", "topk_idxs", "topk_length", "lse_sink", "delta", "dq", "dkv_fixed"],
                  ["softmax_scale", "row_start", "row_step", "row_count", "fixed_measure"])
    post = _Stage(["dkv_fixed", "dkv_acc", "dkv", "d_sink_acc", "d_sink"], ["fixed_step", "fixed_bound"])
    seen = {}

    def fake_fixed_point_dkv(launch, run_post, dkv_, d_sink_acc_, d_sink_, s_q_, head_blocks):
        seen.update(s_q=s_q_, head_blocks=head_blocks, dkv=dkv_, d_sink=d_sink_)
        fixed, total = torch.zeros(s_kv + 1, D + 8, dtype=torch.int32), torch.empty(0, D)
        launch(range(0, s_q, 8), fixed, True)  # a stepped, measuring sample
        run_post(fixed, total, dkv_, d_sink_acc_, d_sink_, 0, 19)
        launch(range(8, 24), fixed, False)  # a group of a larger call
        run_post(fixed, total, dkv_, d_sink_acc_, d_sink_, 7, 0)
        seen.update(fixed=fixed, total=total)

    monkeypatch.setattr(runners, "fixed_point_dkv", fake_fixed_point_dkv)
    spec = KernelSpec.from_id("bwd-sm_90a-d576-h64-compact-cutedsl-det")
    q, kv = torch.randn(s_q, H, D), torch.randn(s_kv, D)
    out, dout, lse = torch.randn(s_q, H, DV), torch.randn(s_q, H, DV), torch.randn(s_q, H)
    idx, length, sink = torch.zeros(s_q, 5, dtype=torch.int32), torch.arange(s_q, dtype=torch.int32), torch.randn(H)
    dq, dkv, d_sink = runners.StagedBwd(pre, main, post, spec)(q, kv, out, dout, lse, idx, length, sink, 0.5)
    assert len(pre.calls) == 1 and seen["s_q"] == s_q and seen["head_blocks"] == 1
    assert seen["dkv"] is dkv and seen["d_sink"] is d_sink and dkv.dtype == torch.bfloat16
    (guess_t, guess_kw), (fold_t, fold_kw) = post.calls
    assert guess_t[0] is seen["fixed"] and guess_t[1] is seen["total"] and guess_t[2] is dkv
    assert torch.equal(guess_t[3], partials) and guess_t[4] is d_sink
    assert guess_kw == {"stream": 7, "fixed_step": 0, "fixed_bound": 19}
    assert fold_kw == {"stream": 7, "fixed_step": 7, "fixed_bound": 0}
    # the main kernel gets the whole tensors (no slicing: host time) and its rows as scalars
    (sample_t, sample_kw), (group_t, group_kw) = main.calls
    for tensors in (sample_t, group_t):
        assert tensors[:5] == (q, kv, dout, idx, length) and tensors[7] is dq
        assert tensors[8] is seen["fixed"]
    assert sample_kw == {"stream": 7, "softmax_scale": 0.5, "row_start": 0, "row_step": 8,
                         "row_count": 5, "fixed_measure": 1}
    assert group_kw == {"stream": 7, "softmax_scale": 0.5, "row_start": 8, "row_step": 1,
                        "row_count": 16, "fixed_measure": 0}
