"""CuTe DSL backward postprocess of sparse MLA: ``dkv_acc`` [s_kv, D] fp32 -> ``dkv`` bf16.

Round-to-nearest-even conversion, 8 columns per thread (one 16-byte store). ``dkv_acc`` rows are
in the main kernel's interleaved column order (:func:`~dsa_aot.kernels.dkv_interleave.dkv_acc_column`):
a thread's 8 columns are 4 pairs 16 bytes apart.
``s_kv`` and ``D`` are run-time sizes (``D`` a multiple of 64, e.g. 512 or 576); columns are
contiguous, row strides are run-time multiples of 8 elements with 16-byte aligned bases.

Deterministic mode (:class:`SparseMlaBwdFold`): ``dkv_acc`` [s_kv, D] is int64 fixed point (the
main kernel's order-free integer sums, columns in the order of
:func:`~dsa_aot.kernels.dkv_interleave.dkv_fixed_column`); each value times ``dkv_scale[1]`` (a
power of two, the inverse of the main kernel's multiplier) is rounded to bf16. ``d_sink_acc``
[parts, H] holds one partial sum per preprocess CTA, added in index order (a fixed order, so the
same bits on every call) into ``d_sink`` [H].

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from dsa_aot.kernels.dkv_interleave import DKV_GROUP, fixed_vec_start

#: Columns converted by one thread.
VEC = 8
THREADS = 128


#: Where a thread's 8 natural columns sit, from :func:`interleaved_start`: (pair value, quad lane).
INTERLEAVED_VEC_SHAPE, INTERLEAVED_VEC_STRIDE = (2, 4), (1, 4)


def interleaved_start(vec):
    """Offset in an interleaved ``dkv_acc`` row of natural column ``8 vec`` (block ``j = vec %
    4`` of its 32-column group starts at ``16 (j // 2) + 2 (j % 2)``); column ``8 vec + 2 q + e``
    is ``e + 4 q`` further. Python ints or DSL ``Int32``."""
    block = vec % 4
    return (vec // 4) * DKV_GROUP + 16 * (block // 2) + 2 * (block % 2)


def interleaved_vec(row: cute.Tensor, vec: Int32) -> cute.Tensor:
    """The 8 fp32 values of natural columns ``[8 vec, 8 vec + 8)`` of an interleaved
    ``dkv_acc`` row, in natural order."""
    return cute.make_tensor(row.iterator + interleaved_start(vec),
                            cute.make_layout(INTERLEAVED_VEC_SHAPE, stride=INTERLEAVED_VEC_STRIDE))


#: Where a thread's 8 natural columns sit in a fixed-point row, from :func:`fixed_vec_start`.
FIXED_VEC_SHAPE, FIXED_VEC_STRIDE = (2, 4), (16, 1)


def fixed_vec(row: cute.Tensor, vec: Int32) -> cute.Tensor:
    """The 8 int64 values of natural columns ``[8 vec, 8 vec + 8)`` of a fixed-point ``dkv_acc``
    row, in natural order."""
    return cute.make_tensor(row.iterator + fixed_vec_start(vec),
                            cute.make_layout(FIXED_VEC_SHAPE, stride=FIXED_VEC_STRIDE))


class SparseMlaBwdPostprocess:
    """fp32 accumulator -> bf16 gradient, elementwise."""

    @cute.jit
    def __call__(self, dkv_acc: cute.Tensor, dkv: cute.Tensor, stream: cuda.CUstream) -> None:
        s_kv = cute.size(dkv_acc, mode=[0])
        col_vecs = cute.size(dkv_acc, mode=[1]) // VEC
        items = s_kv * col_vecs
        if items > 0:
            self.kernel(dkv_acc, dkv, items, col_vecs).launch(
                grid=[(items + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1],
                stream=stream)

    @cute.kernel
    def kernel(self, dkv_acc: cute.Tensor, dkv: cute.Tensor, items: Int32,
               col_vecs: Int32) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        item = bidx * THREADS + tidx
        if item < items:
            row = item // col_vecs
            col = item - row * col_vecs
            src = interleaved_vec(dkv_acc[row, None], col)
            dst = cute.local_tile(dkv[row, None], (VEC,), (col,))
            dst.store(src.load().to(BFloat16))


class SparseMlaBwdFold:
    """Deterministic mode: fixed-point ``dkv_acc`` back to bf16, ``d_sink`` partials added in
    index order."""

    @cute.jit
    def __call__(self, dkv_acc: cute.Tensor, dkv_scale: cute.Tensor, dkv: cute.Tensor,
                 d_sink_acc: cute.Tensor, d_sink: cute.Tensor, stream: cuda.CUstream) -> None:
        s_kv = cute.size(dkv_acc, mode=[0])
        col_vecs = cute.size(dkv_acc, mode=[1]) // VEC
        items = s_kv * col_vecs
        heads = cute.size(d_sink, mode=[0])
        ctas = cutlass.max((items + THREADS - 1) // THREADS, (heads + THREADS - 1) // THREADS)
        self.kernel(dkv_acc, dkv_scale, dkv, d_sink_acc, d_sink, items, col_vecs).launch(
            grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, dkv_acc: cute.Tensor, dkv_scale: cute.Tensor, dkv: cute.Tensor,
               d_sink_acc: cute.Tensor, d_sink: cute.Tensor, items: Int32,
               col_vecs: Int32) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        item = bidx * THREADS + tidx
        if item < items:
            row = item // col_vecs
            col = item - row * col_vecs
            unit = dkv_scale[1]
            src = fixed_vec(dkv_acc[row, None], col).load()
            vals = cute.make_rmem_tensor(cute.make_layout(FIXED_VEC_SHAPE), Float32)
            for i in cutlass.range_constexpr(VEC):
                vals[i] = Float32(src[i]) * unit
            dst = cute.local_tile(dkv[row, None], (VEC,), (col,))
            dst.store(vals.load().to(BFloat16))
        if item < cute.size(d_sink, mode=[0]):
            total = Float32(0.0)
            for part in cutlass.range(cute.size(d_sink_acc, mode=[0]), unroll=1):
                total = total + d_sink_acc[part, item]
            d_sink[item] = total


def fake_arguments(deterministic: bool = False) -> dict[str, object]:
    """Dynamic-shape stand-ins for every argument, in call order (``s_kv``, ``D`` run-time;
    deterministic: also the number of ``d_sink`` partial sums and ``H``)."""
    s_kv = cute.sym_int32(symbol="s_kv")
    d = cute.sym_int32(divisibility=64, symbol="d")

    def matrix(dtype: type) -> object:
        return cute.runtime.make_fake_tensor(dtype, (s_kv, d), (cute.sym_int64(divisibility=VEC), 1),
                                             assumed_align=16)

    if not deterministic:
        return {"dkv_acc": matrix(Float32), "dkv": matrix(BFloat16), "stream": cuda.CUstream(0)}
    heads = cute.sym_int32(symbol="heads")
    fixed = cute.runtime.make_fake_tensor(Int64, (s_kv, d), (cute.sym_int64(divisibility=VEC), 1),
                                          assumed_align=32)
    parts = cute.runtime.make_fake_tensor(Float32, (cute.sym_int32(symbol="parts"), heads),
                                          (cute.sym_int64(), 1), assumed_align=4)
    return {"dkv_acc": fixed,
            "dkv_scale": cute.runtime.make_fake_tensor(Float32, (2,), (1,), assumed_align=4),
            "dkv": matrix(BFloat16), "d_sink_acc": parts,
            "d_sink": cute.runtime.make_fake_tensor(Float32, (heads,), (1,), assumed_align=4),
            "stream": cuda.CUstream(0)}


def compile_bwd_postprocess(arch: str, extra_options: str = "", deterministic: bool = False,
                            ) -> tuple[object, dict[str, object]]:
    """``cute.compile`` the kernel for ``arch`` (``CUTE_DSL_ARCH=<arch>`` set before import);
    ``deterministic`` compiles :class:`SparseMlaBwdFold` instead."""
    fakes = fake_arguments(deterministic)
    kernel = SparseMlaBwdFold() if deterministic else SparseMlaBwdPostprocess()
    compiled = cute.compile(kernel, *fakes.values(),
                            options=f"--gpu-arch {arch} {extra_options}".strip())
    return compiled, fakes
