"""CuTe DSL postprocess of the fixed-point deterministic backward: the steps around each launch
of the main kernel that the runtime would otherwise do with torch ops (``dkv_fixed``'s layout:
:mod:`dsa_aot.kernels.fixed_point`; the schedule: :mod:`dsa_aot.fixed_point`).

One exported function, three kernels, picked by the run-time scalar ``fixed_step``:

* :data:`STEP_GUESS` (one CTA): the first scales of a group. Each KV row's seen exponent (word
  ``D +`` :data:`~dsa_aot.kernels.fixed_point.WORD_SEEN`) becomes the larger of itself and the
  biased exponent of the row's max word (what the last launch measured); the lower median of
  the seen rows comes from a 256-bin histogram in shared memory; each row's scale word gets
  ``2^k`` with ``k + 127 = clamp(fixed_bound - MARGIN_BITS + 253 - e, 1, 253)``, ``e`` the
  row's seen exponent, else the median (0 when no row was seen: the largest scale). The max and
  count words and the control row's skip word are cleared. Between the measuring launch and a
  group's launch the GPU would otherwise wait for a dozen host-side torch ops.
* :data:`STEP_CHECK` (one CTA), after a group's first launch: from each row's count and max,
  the scale that fits it exactly (:func:`exact_scale`); the group is redone when a row that was
  added to overflowed its guess or lost more than ``SLACK_BITS`` bits to it: then every row
  gets its exact scale and its words, max and count are cleared; the control row's skip word
  tells the re-launch whether to run (otherwise another dozen host-side torch ops).
* :data:`STEP_FOLD` (one thread per 8 columns of a KV row): a group's integer sums, times
  ``2^-k``, folded into the fp32 total: with :data:`FOLD_FIRST` the total is the group's sums,
  else ``dkv_acc + sums``; with :data:`FOLD_LAST` it is written as bf16 to ``dkv`` in natural
  column order (NaN on a row whose max word is not finite) and CTA 0 adds the ``d_sink``
  partials in index order into ``d_sink``; otherwise it goes to ``dkv_acc`` (natural columns),
  the row's words, max and count are cleared for the next group and its max's exponent is
  merged into the seen word first.

Every sum has one order and the median is order-free, so every bit depends on the inputs only.

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from dsa_aot.kernels.cutedsl_bwd_postprocess import fold_d_sink, interleaved_start
from dsa_aot.kernels.cutedsl_fixed_point import as_f32
from dsa_aot.kernels.fixed_point import (CONTROL_SKIP, FOLD_FIRST, FOLD_LAST, MARGIN_BITS,
                                         SLACK_BITS, STEP_CHECK, STEP_FOLD, STEP_GUESS, VALUE_BITS,
                                         WORD_COUNT, WORD_MAX, WORD_SCALE, WORD_SEEN)

#: Columns folded by one thread, and the threads of a fold CTA.
VEC = 8
THREADS = 256
#: Threads of the guess and check CTAs, and the bins of the guess's histogram (one per biased
#: exponent).
GUESS_THREADS = 1024
BINS = 256


@cute.jit
def exact_scale(adds: Int32, e: Int32) -> Int32:
    """``k + 127`` of the scale that keeps ``adds`` values below ``2^e``'s row within int32:
    ``clamp(min(22, 31 - bit_length(adds)) + 253 - e, 1, 253)`` (``adds`` 0 counts as 1)."""
    length = 32 - Int32(cute.arch.clz(cutlass.max(adds, Int32(1))))
    base = cutlass.min(31 - length, Int32(VALUE_BITS))
    return cutlass.min(cutlass.max(base + 253 - e, Int32(1)), Int32(253))


class FixedPointPost:
    """The fixed-point postprocess steps (module doc)."""

    @cute.jit
    def __call__(self, dkv_fixed: cute.Tensor, dkv_acc: cute.Tensor, dkv: cute.Tensor,
                 d_sink_acc: cute.Tensor, d_sink: cute.Tensor, fixed_step: Int32,
                 fixed_bound: Int32, stream: cuda.CUstream) -> None:
        s_kv = cute.size(dkv, mode=[0])
        col_vecs = cute.size(dkv, mode=[1]) // VEC
        if fixed_step == STEP_GUESS:
            self.guess(dkv_fixed, s_kv, cute.size(dkv, mode=[1]), fixed_bound).launch(
                grid=[1, 1, 1], block=[GUESS_THREADS, 1, 1], stream=stream)
        elif fixed_step == STEP_CHECK:
            self.check(dkv_fixed, s_kv, cute.size(dkv, mode=[1])).launch(
                grid=[1, 1, 1], block=[GUESS_THREADS, 1, 1], stream=stream)
        else:
            items = cutlass.max(s_kv * col_vecs, Int32(1))  # one CTA at least: d_sink
            self.fold(dkv_fixed, dkv_acc, dkv, d_sink_acc, d_sink, fixed_step, s_kv,
                      col_vecs).launch(grid=[(items + THREADS - 1) // THREADS, 1, 1],
                                       block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def guess(self, dkv_fixed: cute.Tensor, s_kv: Int32, d: Int32, fixed_bound: Int32) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.utils.SmemAllocator()
        hist = smem.allocate_tensor(Int32, cute.make_layout(BINS), byte_alignment=16)
        median = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=16)
        for b in cutlass.range(tidx, BINS, GUESS_THREADS, unroll=1):
            hist[b] = Int32(0)
        cute.arch.barrier()
        for j in cutlass.range(tidx, s_kv, GUESS_THREADS, unroll=4):
            row = dkv_fixed[j, None]
            seen = cutlass.max(row[d + WORD_SEEN], row[d + WORD_MAX] >> 23)
            row[d + WORD_SEEN] = seen
            if seen != 0:
                cute.arch.atomic_add((hist.iterator + seen).llvm_ptr, Int32(1))
        cute.arch.barrier()
        if tidx == 0:  # the lower median: the ((n - 1) // 2)-th seen exponent, ascending
            n = Int32(0)
            for b in cutlass.range(1, BINS, unroll=1):
                n = n + hist[b]
            target = n // 2 - 1 + n % 2  # (n - 1) // 2 for n > 0, without a negative division
            found = Int32(0)  # no row seen: 0, the largest scale
            below = Int32(0)
            if n > 0:
                for b in cutlass.range(1, BINS, unroll=1):
                    below = below + hist[b]
                    if found == 0:
                        if below > target:
                            found = b
            median[0] = found
            dkv_fixed[s_kv, CONTROL_SKIP] = Int32(0)
        cute.arch.barrier()
        guess_bits = fixed_bound - MARGIN_BITS + 253
        for j in cutlass.range(tidx, s_kv, GUESS_THREADS, unroll=4):
            row = dkv_fixed[j, None]
            e = row[d + WORD_SEEN]
            if e == 0:
                e = median[0]
            scale = cutlass.min(cutlass.max(guess_bits - e, Int32(1)), Int32(253))
            row[d + WORD_SCALE] = scale << 23
            row[d + WORD_MAX] = Int32(0)
            row[d + WORD_COUNT] = Int32(0)

    @cute.kernel
    def check(self, dkv_fixed: cute.Tensor, s_kv: Int32, d: Int32) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.utils.SmemAllocator()
        flag = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=16)
        if tidx == 0:
            flag[0] = Int32(0)
        cute.arch.barrier()
        bad = Int32(0)
        for j in cutlass.range(tidx, s_kv, GUESS_THREADS, unroll=4):
            row = dkv_fixed[j, None]
            adds = row[d + WORD_COUNT]
            off = exact_scale(adds, row[d + WORD_MAX] >> 23) - (row[d + WORD_SCALE] >> 23)
            if adds > 0:
                bad = bad | cutlass.select_(off < 0, Int32(1), Int32(0)) \
                    | cutlass.select_(off > SLACK_BITS, Int32(1), Int32(0))
        if bad != 0:
            flag[0] = Int32(1)
        cute.arch.barrier()
        redo = flag[0]
        if redo != 0:  # what a launch adds to starts afresh, with the measured scales
            for j in cutlass.range(tidx, s_kv, GUESS_THREADS, unroll=4):
                row = dkv_fixed[j, None]
                row[d + WORD_SCALE] = exact_scale(row[d + WORD_COUNT], row[d + WORD_MAX] >> 23) << 23
                row[d] = Int32(0)
                row[d + WORD_MAX] = Int32(0)
                row[d + WORD_COUNT] = Int32(0)
            quads = d // 4
            zeros = cute.make_rmem_tensor(4, Int32)
            zeros.fill(0)
            for item in cutlass.range(tidx, s_kv * quads, GUESS_THREADS, unroll=1):
                j = item // quads
                cute.local_tile(dkv_fixed[j, None], (4,), (item - j * quads,)).store(zeros.load())
        if tidx == 0:
            dkv_fixed[s_kv, CONTROL_SKIP] = 1 - redo

    @cute.kernel
    def fold(self, dkv_fixed: cute.Tensor, dkv_acc: cute.Tensor, dkv: cute.Tensor,
             d_sink_acc: cute.Tensor, d_sink: cute.Tensor, fixed_step: Int32, s_kv: Int32,
             col_vecs: Int32) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        d = col_vecs * VEC
        first = fixed_step & FOLD_FIRST
        last = fixed_step & FOLD_LAST
        item = bidx * THREADS + tidx
        if item < s_kv * col_vecs:
            j = item // col_vecs
            vec = item - j * col_vecs
            row = dkv_fixed[j, None]
            max_bits = row[d + WORD_MAX]
            inverse = as_f32((254 - (row[d + WORD_SCALE] >> 23)) << 23)  # 2^-k, exact
            base = interleaved_start(vec)
            vals = cute.make_rmem_tensor(VEC, Float32)
            for q in cutlass.range_constexpr(VEC // 2):
                # the pair (2q, 2q + 1) holds S_lo + 2^32 S_hi: the low word is S_lo, and the
                # high word is S_hi less the borrow of a negative S_lo
                lo = row[base + 4 * q]
                hi = row[base + 4 * q + 1]
                hi = hi + cutlass.select_(lo < 0, Int32(1), Int32(0))
                vals[2 * q] = Float32(lo) * inverse
                vals[2 * q + 1] = Float32(hi) * inverse
            total = cute.local_tile(dkv_acc[j, None], (VEC,), (vec,))
            if first == 0:
                prev = total.load()
                for i in cutlass.range_constexpr(VEC):
                    vals[i] = prev[i] + vals[i]
            if last != 0:
                if (max_bits >> 23) == 255:  # a non-finite value reached the row
                    vals.fill(Float32(float("nan")))
                cute.local_tile(dkv[j, None], (VEC,), (vec,)).store(vals.load().to(BFloat16))
            else:
                if (max_bits >> 23) == 255:  # NaN stays NaN through every later group
                    vals.fill(Float32(float("nan")))
                total.store(vals.load())
                for q in cutlass.range_constexpr(VEC // 2):
                    row[base + 4 * q] = Int32(0)
                    row[base + 4 * q + 1] = Int32(0)
                if vec == 0:
                    row[d + WORD_SEEN] = cutlass.max(row[d + WORD_SEEN], max_bits >> 23)
                    row[d + WORD_MAX] = Int32(0)
                    row[d + WORD_COUNT] = Int32(0)
        if last != 0:
            if bidx == 0:
                fold_d_sink(d_sink_acc, d_sink, tidx)


def fake_arguments() -> dict[str, object]:
    """Dynamic-shape stand-ins for every argument, in call order: ``s_kv``, ``D`` (a multiple of
    64), the ``dkv_fixed`` rows and row words, the ``dkv_acc`` rows (``s_kv`` when the call has
    several groups, else none), the ``d_sink`` partials and ``H`` are run-time sizes."""
    s_kv = cute.sym_int32(symbol="s_kv")
    d = cute.sym_int32(divisibility=64, symbol="d")
    heads = cute.sym_int32(symbol="heads")

    def fake(dtype: type, shape: tuple, stride: tuple, align: int) -> object:
        return cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=align)

    return {"dkv_fixed": fake(Int32, (cute.sym_int32(symbol="fixed_rows"),
                                      cute.sym_int32(divisibility=8, symbol="row_words")),
                              (cute.sym_int64(divisibility=8), 1), 16),
            "dkv_acc": fake(Float32, (cute.sym_int32(symbol="acc_rows"), d),
                            (cute.sym_int64(divisibility=VEC), 1), 16),
            "dkv": fake(BFloat16, (s_kv, d), (cute.sym_int64(divisibility=VEC), 1), 16),
            "d_sink_acc": fake(Float32, (cute.sym_int32(symbol="parts"), heads), (cute.sym_int64(), 1), 4),
            "d_sink": fake(Float32, (heads,), (1,), 4),
            "fixed_step": Int32(STEP_GUESS), "fixed_bound": Int32(0), "stream": cuda.CUstream(0)}


def compile_bwd_fixed_point_post(arch: str, extra_options: str = "", deterministic: bool = True,
                                 impl: str = "fixed_point") -> tuple[object, dict[str, object]]:
    """``cute.compile`` :class:`FixedPointPost` for ``arch`` (``CUTE_DSL_ARCH=<arch>`` set before
    import). Only the deterministic mode has it (``impl`` is the build's flavour name)."""
    if not deterministic or impl != "fixed_point":
        raise ValueError("the fixed-point postprocess is the deterministic mode's only")
    fakes = fake_arguments()
    compiled = cute.compile(FixedPointPost(), *fakes.values(),
                            options=f"--gpu-arch {arch} {extra_options}".strip())
    return compiled, fakes


__all__ = ["BINS", "GUESS_THREADS", "THREADS", "VEC", "FixedPointPost", "compile_bwd_fixed_point_post",
           "fake_arguments"]
