"""CuTe DSL backward postprocess of sparse MLA: ``dkv_acc`` [s_kv, D] fp32 -> ``dkv`` bf16.

Round-to-nearest-even conversion, 8 columns per thread (one 16-byte store). ``dkv_acc`` rows are
in the main kernel's interleaved column order (:func:`~dsa_aot.kernels.dkv_interleave.dkv_acc_column`):
a thread's 8 columns are 4 pairs 16 bytes apart.
``s_kv`` and ``D`` are run-time sizes (``D`` a multiple of 64, e.g. 512 or 576); columns are
contiguous, row strides are run-time multiples of 8 elements with 16-byte aligned bases.

Deterministic mode (:class:`SparseMlaBwdReduce`): the main kernel stored every valid slot's dKV
row (bf16, one per query row, slot and head block, interleaved columns) in ``dkv_rows``; one CTA
per KV row ``j`` sums the rows ``row_order[row_offsets[j]:row_offsets[j + 1]]`` in that order in
fp32, one partial sum per group of ``row_group`` consecutive rows of ``dkv_rows`` (a fixed number
of query rows), each partial added in turn, in group order, to the running total read from
``dkv_acc`` [s_kv, D] fp32 (natural columns; the total over the call's earlier query-row chunks,
whose bounds fall on group bounds); it writes the total back there and as bf16 to ``dkv``. The
total thus takes the same additions in the same order however the call is chunked: the bits do
not depend on the chunking.
``d_sink_acc`` [parts, H] holds one partial sum per preprocess CTA, added in index order into
``d_sink`` [H]. Every sum has a fixed order, so every bit depends on the inputs only.

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from dsa_aot.kernels.dkv_interleave import DKV_GROUP

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


#: Rows a reducing thread has in flight (loads issued before the first add).
REDUCE_UNROLL = 8


def reduce_runs(vec: Int32) -> tuple[Int32, tuple, tuple]:
    """Natural columns of the 8 interleaved values ``[8 vec, 8 vec + 8)`` of a ``dkv_rows`` row:
    two runs of 4, from ``base`` and ``base + 8``, taking the values at the given offsets
    (:func:`~dsa_aot.kernels.dkv_interleave.dkv_acc_column` inverted)."""
    block = vec % 4
    base = (vec // 4) * DKV_GROUP + 16 * (block // 2) + 4 * (block % 2)
    return base, (0, 1, 4, 5), (2, 3, 6, 7)


class SparseMlaBwdReduce:
    """Deterministic mode: each KV row's stored dKV rows summed in a fixed order into
    ``dkv_acc`` and ``dkv``; ``d_sink`` partials added in index order."""

    @cute.jit
    def __call__(self, dkv_rows: cute.Tensor, row_order: cute.Tensor, row_offsets: cute.Tensor,
                 dkv_acc: cute.Tensor, dkv: cute.Tensor, d_sink_acc: cute.Tensor,
                 d_sink: cute.Tensor, row_group: Int32, stream: cuda.CUstream) -> None:
        s_kv = cute.size(dkv_acc, mode=[0])
        ctas = cutlass.max(s_kv, Int32(1))
        self.kernel(dkv_rows, row_order, row_offsets, dkv_acc, dkv, d_sink_acc, d_sink, row_group,
                    cute.size(dkv_acc, mode=[1]) // VEC).launch(
            grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, dkv_rows: cute.Tensor, row_order: cute.Tensor, row_offsets: cute.Tensor,
               dkv_acc: cute.Tensor, dkv: cute.Tensor, d_sink_acc: cute.Tensor,
               d_sink: cute.Tensor, row_group: Int32, col_vecs: Int32) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        j, _, _ = cute.arch.block_idx()
        if j < cute.size(dkv_acc, mode=[0]):
            start = row_offsets[j]
            end = row_offsets[j + 1]
            for vec in cutlass.range(tidx, col_vecs, THREADS, unroll=1):
                # the running total over the call's earlier chunks, in this row's order; each
                # group's partial is added to it in turn, so a call's chunking changes no bit
                base, first, second = reduce_runs(vec)
                total = cute.make_rmem_tensor(VEC, Float32)
                for run, offs in ((0, first), (8, second)):
                    prev = cute.local_tile(dkv_acc[j, None], (4,), ((base + run) // 4,)).load()
                    for i in cutlass.range_constexpr(4):
                        total[offs[i]] = prev[i]
                group_sum = cute.make_rmem_tensor(VEC, Float32)
                group_sum.fill(0.0)
                group_end = row_group  # the first row past the open group
                got = [cute.make_rmem_tensor(VEC, BFloat16) for _ in range(REDUCE_UNROLL)]
                rows = [Int32(0) for _ in range(REDUCE_UNROLL)]
                for e0 in cutlass.range(start, end, REDUCE_UNROLL, unroll=1):
                    for u in cutlass.range_constexpr(REDUCE_UNROLL):
                        if e0 + u < end:
                            rows[u] = row_order[e0 + u]
                            row = dkv_rows[rows[u], None]
                            got[u].store(cute.local_tile(row, (VEC,), (vec,)).load())
                    for u in cutlass.range_constexpr(REDUCE_UNROLL):  # in order: fixed sums
                        if e0 + u < end:
                            if rows[u] >= group_end:  # a later group of query rows: close this one
                                for i in cutlass.range_constexpr(VEC):
                                    total[i] = total[i] + group_sum[i]
                                group_sum.fill(0.0)
                                group_end = (rows[u] // row_group + 1) * row_group
                            vals = got[u].load().to(Float32)
                            for i in cutlass.range_constexpr(VEC):
                                group_sum[i] = group_sum[i] + vals[i]
                for i in cutlass.range_constexpr(VEC):  # the last group
                    total[i] = total[i] + group_sum[i]
                for run, offs in ((0, first), (8, second)):
                    acc = cute.local_tile(dkv_acc[j, None], (4,), ((base + run) // 4,))
                    out = cute.local_tile(dkv[j, None], (4,), ((base + run) // 4,))
                    summed = cute.make_rmem_tensor(4, Float32)
                    for i in cutlass.range_constexpr(4):
                        summed[i] = total[offs[i]]
                    acc.store(summed.load())
                    out.store(summed.load().to(BFloat16))
        if j == 0:
            fold_d_sink(d_sink_acc, d_sink, tidx)


@cute.jit
def fold_d_sink(d_sink_acc: cute.Tensor, d_sink: cute.Tensor, tidx: Int32) -> None:
    """Thread ``h < H`` of one CTA: ``d_sink[h]``, the preprocess's partials ``d_sink_acc[:, h]``
    added in index order (a fixed order: the same bits every call)."""
    if tidx < cute.size(d_sink, mode=[0]):
        part_sum = Float32(0.0)
        for part in cutlass.range(cute.size(d_sink_acc, mode=[0]), unroll=1):
            part_sum = part_sum + d_sink_acc[part, tidx]
        d_sink[tidx] = part_sum


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
    index = cute.runtime.make_fake_tensor(Int32, (cute.sym_int32(symbol="entries"),), (1,),
                                          assumed_align=4)
    offsets = cute.runtime.make_fake_tensor(Int32, (cute.sym_int32(symbol="s_kv_1"),), (1,),
                                            assumed_align=4)
    rows = cute.runtime.make_fake_tensor(BFloat16, (cute.sym_int32(symbol="rows"), d),
                                         (cute.sym_int64(divisibility=VEC), 1), assumed_align=16)
    parts = cute.runtime.make_fake_tensor(Float32, (cute.sym_int32(symbol="parts"), heads),
                                          (cute.sym_int64(), 1), assumed_align=4)
    return {"dkv_rows": rows, "row_order": index, "row_offsets": offsets,
            "dkv_acc": matrix(Float32), "dkv": matrix(BFloat16), "d_sink_acc": parts,
            "d_sink": cute.runtime.make_fake_tensor(Float32, (heads,), (1,), assumed_align=4),
            "row_group": Int32(1), "stream": cuda.CUstream(0)}


def compile_bwd_postprocess(arch: str, extra_options: str = "", deterministic: bool = False,
                            ) -> tuple[object, dict[str, object]]:
    """``cute.compile`` the kernel for ``arch`` (``CUTE_DSL_ARCH=<arch>`` set before import);
    ``deterministic`` compiles :class:`SparseMlaBwdReduce` instead."""
    fakes = fake_arguments(deterministic)
    kernel = SparseMlaBwdReduce() if deterministic else SparseMlaBwdPostprocess()
    compiled = cute.compile(kernel, *fakes.values(),
                            options=f"--gpu-arch {arch} {extra_options}".strip())
    return compiled, fakes
