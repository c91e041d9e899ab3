"""Device side of the deterministic backward's fixed-point dKV adds (CuTe DSL helpers).

The layout of ``dkv_fixed`` is :mod:`dsa_aot.kernels.fixed_point`. The dKV warpgroup of the
``wgmma_ws`` / ``wgmma_ws_slot_major`` main kernels calls, per block of 64 slots:

* :func:`fixed_scales`: the scales ``2^k`` of the 2 rows this lane's own values belong to (0 for
  an invalid slot);
* :func:`add_fixed`, per 64-column chunk: each value becomes ``fma(v, 2^k, 1.5 2^23)``'s bits;
  three butterfly rounds between the half-warp's rows trade word pairs so that one
  ``red.global.add.u64`` of the warp (two words a lane) adds two whole 128-byte lines, in the
  same interleaved column order as the fast mode's fp32 atomics (an invalid slot's adds go to
  a sink row, :func:`sink_rows`);
* :func:`fold_max` after each chunk and :func:`flush_max` after the block: the row's largest
  ``|v|`` (``red.global.max.u32`` of fp32 bits) and its count of adds.

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm

from dsa_aot.kernels.fixed_point import (CONTROL_SKIP, PAIR_MAGIC, SINK_ROWS, WORD_COUNT, WORD_MAX,
                                         WORD_SCALE)


def _select(cond, if_value, else_value):
    """``if_value if cond else else_value`` for a run-time ``cond`` (a select, no branch)."""
    return type(if_value)(cutlass.select_(cond, if_value, else_value))


def _asm(result, args: list, text: str, constraints: str, side_effects: bool, loc, ip):
    return llvm.inline_asm(result, [a.ir_value(loc=loc, ip=ip) for a in args], text,
                           constraints, has_side_effects=side_effects, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@cutlass.dsl_user_op
def fixed_bits(v: Float32, scale: Float32, *, loc=None, ip=None) -> Int32:
    """The bits of ``fma.rn(v, scale, 1.5 * 2^23)``: ``0x4B400000 + rni(v scale)`` while
    ``|v scale| < 2^22``."""
    return Int32(_asm(Int32.mlir_type, [Float32(v), Float32(scale)],
                      "{ .reg .f32 t; fma.rn.f32 t, $1, $2, 0f4B400000; mov.b32 $0, t; }",
                      "=r,f,f", False, loc, ip))


@cutlass.dsl_user_op
def max_abs(m: Float32, v: Float32, *, loc=None, ip=None) -> Float32:
    """``max.NaN(m, |v|)``: the running largest magnitude, NaN once any value was NaN."""
    return Float32(_asm(Float32.mlir_type, [Float32(m), Float32(v)],
                        "{ .reg .f32 t; abs.f32 t, $2; max.NaN.f32 $0, $1, t; }", "=f,f,f",
                        False, loc, ip))


@cutlass.dsl_user_op
def f32_bits(v: Float32, *, loc=None, ip=None) -> Int32:
    """The bits of fp32 ``v``."""
    return Int32(_asm(Int32.mlir_type, [Float32(v)], "mov.b32 $0, $1;", "=r,f", False, loc, ip))


@cutlass.dsl_user_op
def as_f32(bits: Int32, *, loc=None, ip=None) -> Float32:
    """``bits`` read as an fp32 value."""
    return Float32(_asm(Float32.mlir_type, [Int32(bits)], "mov.b32 $0, $1;", "=f,r", False,
                        loc, ip))


@cutlass.dsl_user_op
def red_fixed(base: Int64, row: Int32, stride: Int32, lane_word: Int32, word: cutlass.Constexpr,
              value: Int32, go: Int32, op: cutlass.Constexpr = "add", *, loc=None,
              ip=None) -> None:
    """``red.relaxed.gpu.global.<op>.u32`` of ``value`` into word ``row * stride + lane_word +
    word`` of ``dkv_fixed`` at ``base``, where ``row >= 0`` and ``go`` is nonzero. The address is
    made inside the instruction block, so the compiler cannot keep one pointer per row, group
    and chunk alive across the block loop (which costs registers, then spills)."""
    _asm(None, [Int64(base), Int32(row), Int32(stride), Int32(lane_word), Int32(value),
                Int32(go)],
         "{ .reg .pred p, q; .reg .s32 w; .reg .b64 a; setp.ge.s32 p, $1, 0; "
         "setp.ne.and.s32 q, $5, 0, p; mad.lo.s32 w, $1, $2, $3; "
         f"add.s32 w, w, {int(word)}; mad.wide.s32 a, w, 4, $0; "
         f"@q red.relaxed.gpu.global.{op}.u32 [a], $4; }}",
         "l,r,r,r,r,r", True, loc, ip)


@cutlass.dsl_user_op
def red_add_word_pairs(base: Int64, row: Int32, stride: Int32, lane_word: Int32,
                       first_byte: cutlass.Constexpr, second_byte: cutlass.Constexpr, lo0: Int32,
                       hi0: Int32, lo1: Int32, hi1: Int32, *, loc=None, ip=None) -> None:
    """Two ``red.relaxed.gpu.global.add.u64`` into one ``dkv_fixed`` row, of two words'
    :func:`fixed_bits` each: ``(lo0, hi0)`` at byte offset ``first_byte`` and ``(lo1, hi1)`` at
    ``second_byte`` (immediates) from word ``row * stride + lane_word`` (even), each pair as the
    int64 ``n_lo + 2^32 n_hi`` (its bits, low word first, less :data:`PAIR_MAGIC`; adding the
    bits as they are and leaving the subtraction to the runtime makes ptxas spill at H32). Not
    predicated (ptxas makes a predicated ``red`` a branch): an invalid slot's ``row`` is a sink
    row. One address for both, made inside the block so that the compiler
    cannot keep one pointer per row, group and chunk alive across the block loop."""
    _asm(None, [Int64(base), Int32(row), Int32(stride), Int32(lane_word), Int32(lo0), Int32(hi0),
                Int32(lo1), Int32(hi1)],
         "{ .reg .s32 w; .reg .b64 a, x, y; mad.lo.s32 w, $1, $2, $3; mad.wide.s32 a, w, 4, $0; "
         f"mov.b64 x, {{$4, $5}}; mov.b64 y, {{$6, $7}}; sub.s64 x, x, {PAIR_MAGIC}; "
         f"sub.s64 y, y, {PAIR_MAGIC}; red.relaxed.gpu.global.add.u64 [a+{int(first_byte)}], x; "
         f"red.relaxed.gpu.global.add.u64 [a+{int(second_byte)}], y; }}",
         "l,r,r,r,r,r,r,r", True, loc, ip)


@cutlass.dsl_user_op
def ld_global_s32(addr: Int64, *, loc=None, ip=None) -> Int32:
    """One 4-byte load from global ``addr`` that is not cached in L1 (``ld.global.cg``): the
    runtime wrote it just before the launch."""
    return Int32(_asm(Int32.mlir_type, [Int64(addr)], "ld.global.cg.s32 $0, [$1];", "=r,l",
                      True, loc, ip))


@cute.jit
def launch_skipped(m_dkv: cute.Tensor, s_kv: Int32) -> Int32:
    """The control row's skip word (row ``s_kv``, word :data:`CONTROL_SKIP`): nonzero when the
    runtime decided this launch has nothing to do."""
    row = m_dkv.iterator.toint() + Int64(s_kv) * Int64(m_dkv.stride[0]) * 4
    return ld_global_s32(row + CONTROL_SKIP * 4)


@cute.jit
def sink_rows(rows: Int32) -> Int32:
    """The first of this CTA's 64 sink rows (:data:`SINK_ROWS` after the control row of
    ``dkv_fixed``'s ``rows``, 64 a CTA in turn), where the adds of its invalid slots go."""
    cta, _, _ = cute.arch.block_idx()
    return rows - SINK_ROWS + (cta % (SINK_ROWS // 64)) * 64


@cute.jit
def fixed_scales(m_dkv: cute.Tensor, s_idx: cute.Tensor, first: Int32, lane: Int32,
                 d: cutlass.Constexpr) -> list:
    """Per block: ``2^k`` of this lane's own rows, ``scales[r]`` for block row ``8 r + lane / 4``
    after ``first`` (the ``s_idx`` position of the warp's first row); 0 for an invalid slot
    (``s_idx`` -1)."""
    stride = Int32(m_dkv.stride[0])
    base = m_dkv.iterator.toint()
    scales = []
    for r in cutlass.range_constexpr(2):
        row = s_idx[first + 8 * r + lane // 4]
        bits = Int32(0)
        if row >= 0:
            bits = ld_global_s32(base + Int64(row * stride + d + WORD_SCALE) * 4)
        scales.append(as_f32(bits))
    return scales


def add_fixed(acc: cute.Tensor, s_idx: cute.Tensor, first: Int32, stride: Int32, scales: list,
              base: Int64, rows_total: Int32, col0: cutlass.Constexpr, lane: Int32) -> list:
    """Add one ``(64 slots, 64 columns)`` dKV chunk of a warpgroup accumulator (``acc`` as a
    ``(rows, cols)`` view) to ``dkv_fixed`` at ``base``; ``col0``: the chunk's first column;
    the adds of an invalid slot (``s_idx`` -1) at block row ``i`` go to sink row ``i`` of
    :func:`sink_rows` (``rows_total``: ``dkv_fixed``'s rows).
    Returns the largest ``|v|`` of this lane's values per fragment row (NaN if any was).

    A lane holds, per fragment row ``r`` and 32-column group, 8 values of its row ``8 r + lane /
    4``: each becomes ``fma(v, 2^k, 1.5 2^23)``'s bits with that row's scale. In the
    interleaved order they are 4 word pairs ("chunks") of the group's line: chunk ``c`` at words
    ``4 q + 2 (c % 2) + 16 (c / 2)`` (``q = lane % 4``). The half-warp's 16 lanes hold 4 rows,
    row ``a = (lane / 4) % 4`` in the 4 lanes ``(a, q)``. Each lane keeps its chunk 0 and, in
    three butterfly rounds ``m = 1, 2, 3`` (lane ``^ 4 m``), sends its chunk ``m`` and receives
    the partner's (row ``a ^ m``, chunk ``m``): a lane's 4 chunks are then one of each row,
    register ``k`` holding row ``a ^ k``. Two swap stages on the bits of ``a`` put row ``j`` in
    register ``j``, and add ``j`` of the warp (:func:`red_add_word_pairs`, one
    ``red.global.add.u64`` a group) covers row ``j`` of each half-warp: two whole 128-byte lines,
    each lane at the words of its chunk ``a ^ j``. The two groups of a chunk share the address."""
    rows = cute.size(acc, mode=[0])
    quad = lane % 4
    a = (lane // 4) % 4
    half_rows = 4 * (lane // 16)
    row_max = []
    for r in range(rows):
        peak = Float32(0.0)
        held = {}
        for g in range(2):
            ints = []
            for i in range(8):
                v = acc[r, 8 * g + i]
                peak = max_abs(peak, v)
                ints.append(fixed_bits(v, scales[r]))
            regs = [ints[0:2]] + [[cute.arch.shuffle_sync_bfly(w, offset=4 * m)
                                   for w in ints[2 * m:2 * m + 2]] for m in range(1, 4)]
            for bit in (1, 2):  # register k -> k ^ (a & bit): then register j holds row j
                swap = (a & bit) != 0
                regs = [[_select(swap, regs[k ^ bit][w], regs[k][w]) for w in range(2)]
                        for k in range(4)]
            held[g] = regs
        row_max.append(peak)
        for j in range(4):
            i = 8 * r + half_rows + j
            row = s_idx[first + i]
            row = _select(row >= 0, row, sink_rows(rows_total) + i)
            k = a ^ j
            red_add_word_pairs(base, row, stride, 4 * quad + 2 * (k % 2) + 16 * (k // 2), 4 * col0,
                               4 * (col0 + 32), *held[0][j], *held[1][j])
    return row_max


def chunk_max(acc: cute.Tensor) -> list:
    """The largest ``|v|`` of this lane's values per fragment row of a ``(64 slots, 64
    columns)`` dKV chunk (``acc`` as a ``(rows, cols)`` view; NaN if any was): what
    :func:`add_fixed` returns, without its adds (a measuring launch)."""
    row_max = []
    for r in range(cute.size(acc, mode=[0])):
        peak = Float32(0.0)
        for i in range(cute.size(acc, mode=[1])):
            peak = max_abs(peak, acc[r, i])
        row_max.append(peak)
    return row_max


@cute.jit
def fold_max(row_max: list, s_max: cute.Tensor, warp_rows: Int32, lane: Int32) -> None:
    """Per chunk: each of this warp's 16 rows' largest magnitude so far into ``s_max`` (shared
    fp32, one slot a block row): the max over the row's quad (``row_max[r]``: the lane's, of
    block row ``8 r + lane / 4``), then a read-modify-write by the quad's first lane, the slot's
    only writer (``warp_rows``: the warp's first block row). A running max kept in registers
    across the chunks makes ptxas spill; the slot costs none."""
    for r in cutlass.range_constexpr(2):
        m = row_max[r]
        for off in (1, 2):
            m = max_abs(m, cute.arch.shuffle_sync_bfly(m, offset=off))
        slot = warp_rows + 8 * r + lane // 4
        if lane % 4 == 0:
            s_max[slot] = max_abs(s_max[slot], m)


@cute.jit
def flush_max(s_max: cute.Tensor, warp_rows: Int32, s_idx: cute.Tensor, first: Int32,
              stride: Int32, base: Int64, lane: Int32, d: cutlass.Constexpr) -> None:
    """Per block, after the last :func:`fold_max`: lane ``i < 16`` adds block row ``warp_rows +
    i``'s largest magnitude to word ``D + WORD_MAX`` of its KV row (``s_idx[first + i]``;
    ``red.max`` of the fp32 bits), counts the row's add in word ``D + WORD_COUNT`` and resets
    its slot to 0."""
    cute.arch.sync_warp()
    if lane < 16:
        row = s_idx[first + lane]
        red_fixed(base, row, stride, Int32(0), d + WORD_MAX, f32_bits(s_max[warp_rows + lane]),
                  Int32(1), "max")
        red_fixed(base, row, stride, Int32(0), d + WORD_COUNT, Int32(1), Int32(1), "add")
        s_max[warp_rows + lane] = Float32(0.0)
    cute.arch.sync_warp()


__all__ = ["add_fixed", "as_f32", "chunk_max", "f32_bits", "fixed_bits", "fixed_scales", "flush_max", "fold_max",
           "launch_skipped", "ld_global_s32", "max_abs", "red_add_word_pairs", "red_fixed", "sink_rows"]
