"""Building blocks shared by the CuTe DSL sparse MLA kernels (forward, backward main).

Compile-time parameter checks, the accumulator views the online softmax and the epilogues
index by (row, column), quad reductions, the dynamic-shape stand-ins every kernel is compiled
over, and the branch-free KV row gather (zero-filling 16-byte ``cp.async``). Everything here
is traced into the kernels at compile time; nothing runs on its own.

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm

#: Value head dim of MLA.
D_V = 512
#: bf16 elements per 16-byte copy.
VEC = 8
#: Supported compile-time parameters.
D_QK_CHOICES = (512, 576)
HEAD_CHOICES = (16, 32, 64, 128)
LAYOUTS = ("compact", "noncompact")


def check_params(d_qk: int, heads: int, layout: str, kernel: str) -> None:
    """Raise ``ValueError`` naming the bad compile-time parameter of ``kernel``."""
    if d_qk not in D_QK_CHOICES:
        raise ValueError(f"d_qk={d_qk!r}: the CuTe DSL {kernel} supports {D_QK_CHOICES}")
    if heads not in HEAD_CHOICES:
        raise ValueError(f"heads={heads!r}: the CuTe DSL {kernel} supports {HEAD_CHOICES}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {LAYOUTS}")


def acc_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """A warp-level MMA accumulator ``((2, 2), M, N)`` (or its coordinates) as ``(rows, cols)``
    of this thread."""
    flat = cute.make_layout(acc.layout.shape)
    rows_cols = cute.make_layout(((flat.shape[0][1], flat.shape[1]),
                                  (flat.shape[0][0], flat.shape[2])),
                                 stride=((flat.stride[0][1], flat.stride[1]),
                                         (flat.stride[0][0], flat.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, rows_cols))


def wg_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """A warpgroup MMA accumulator ``((2, 2, V), M, N)`` (or its coordinates) as ``(rows, cols)``;
    columns run over the value pair first, so ``(2 j, 2 j + 1)`` are adjacent columns."""
    flat = cute.make_layout(acc.layout.shape)
    sh, st = flat.shape, flat.stride
    rows_cols = cute.make_layout(((sh[0][1], sh[1]), (sh[0][0], sh[0][2], sh[2])),
                                 stride=((st[0][1], st[1]), (st[0][0], st[0][2], st[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, rows_cols))


def wg_acc_as_a(acc: cute.Tensor) -> cute.Tensor:
    """A 64 x N warpgroup MMA accumulator ``((2, 2, N / 8), 1, 1)`` (converted to 16 bits) as the
    register A operand of a following warpgroup MMA: ``((2, 2, 2), 1, N / 16)``, the two 8-column
    blocks of each 16-wide K step being the value pair's neighbours."""
    div = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    sh, st = div.shape, div.stride
    layout = cute.make_layout(((sh[0][0], sh[0][1], sh[0][2][0]), sh[1], (sh[0][2][1], sh[2])),
                              stride=((st[0][0], st[0][1], st[0][2][0]), st[1],
                                      (st[0][2][1], st[2])))
    return cute.make_tensor(acc.iterator, layout)


def quad_max(val: Float32) -> Float32:
    """Max over the 4 lanes of a quad (the threads sharing an accumulator row)."""
    for offset in (2, 1):
        val = cute.arch.fmax(val, cute.arch.shuffle_sync_bfly(val, offset=offset))
    return val


def quad_sum(val: Float32) -> Float32:
    """Sum over the 4 lanes of a quad."""
    for offset in (2, 1):
        val = val + cute.arch.shuffle_sync_bfly(val, offset=offset)
    return val


#: Slots a warp reads per step of :func:`row_end`'s backward scan.
SCAN_SLOTS = 256


@cute.jit
def row_end(m_idx: cute.Tensor, t: Int32, n_kv: Int32) -> Int32:
    """One past the last valid slot of noncompact row ``t`` (``0 <= idx < n_kv``; 0 when the
    row has none), call while tracing. Every warp finds it on its own: a backward scan of
    :data:`SCAN_SLOTS` slots a step (coalesced loads, then a warp max) that stops reading at the
    first step holding a valid slot, so a full row costs one step."""
    topk = cute.size(m_idx, mode=[1])
    lane = cute.arch.lane_idx()
    n_steps = (topk + SCAN_SLOTS - 1) // SCAN_SLOTS
    end = Int32(0)
    for step in cutlass.range(n_steps, unroll=1):
        if end == 0:
            base = (n_steps - 1 - step) * SCAN_SLOTS + lane
            found = Int32(0)
            for i in cutlass.range_constexpr(SCAN_SLOTS // 32):
                slot = base + 32 * i
                idx = Int32(-1)
                if slot < topk:
                    idx = m_idx[t, slot]
                if (idx >= 0) & (idx < n_kv):
                    found = slot + 1   # the lane's slots rise with i
            for offset in (16, 8, 4, 2, 1):
                found = cutlass.max(found, cute.arch.shuffle_sync_bfly(found, offset=offset))
            end = cute.arch.make_warp_uniform(found)
    # ptxas cannot see through the shuffles that ``end`` is the same on every lane: unmarked, the
    # block loops that it bounds count as divergent and their wgmma serialise (C7520)
    return cute.arch.make_warp_uniform(end)


def walked_slots(m_idx: cute.Tensor, m_len: cute.Tensor, t: Int32, n_kv: Int32,
                 compact: bool) -> Int32:
    """The slots of row ``t`` a kernel walks (call while tracing): ``clamp(topk_length[t], 0,
    K)`` in the compact layout, else :func:`row_end`, so trailing -1 slots (the early rows of a
    causal prefill) cost no block; what they would add is exactly zero."""
    if compact:
        return cutlass.max(cutlass.min(m_len[t], cute.size(m_idx, mode=[1])), Int32(0))
    return row_end(m_idx, t, n_kv)


def run_time_sizes() -> tuple[object, object, object]:
    """Symbolic ``s_q``, ``s_kv`` and ``topk``: one compiled kernel serves every value."""
    return (cute.sym_int32(symbol="s_q"), cute.sym_int32(symbol="s_kv"),
            cute.sym_int32(symbol="topk"))


def vec_stride() -> object:
    """A run-time stride that is a multiple of 8 bf16 elements (16-byte aligned rows)."""
    return cute.sym_int64(divisibility=VEC)


def fake_tensor(dtype: type, shape: tuple, stride: tuple, align: int) -> object:
    """A dynamic-shape stand-in the kernel is compiled over (``align``: bytes of the base)."""
    return cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=align)


@cutlass.dsl_user_op
def cp_async_16_zfill(dst: Int32, src: Int64, src_bytes: Int32, policy: Int64 | None = None, *,
                      loc=None, ip=None) -> None:
    """One 16-byte ``cp.async.cg`` from global ``src`` to shared ``dst``, reading
    ``src_bytes`` (16 or 0) and zero-filling the rest: an invalid slot costs the same one
    instruction as a valid one and reads nothing. ``policy``: an L2 cache policy
    (:func:`l2_policy`) for the read."""
    args = [Int32(dst).ir_value(loc=loc, ip=ip), Int64(src).ir_value(loc=loc, ip=ip),
            Int32(src_bytes).ir_value(loc=loc, ip=ip)]
    text, constraints = "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r"
    if policy is not None:
        args.append(Int64(policy).ir_value(loc=loc, ip=ip))
        text, constraints = "cp.async.cg.shared.global.L2::cache_hint [$0], [$1], 16, $2, $3;", "r,l,r,l"
    llvm.inline_asm(None, args, text, constraints, has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def sw128_offset(row, chunk):
    """Byte offset of 16-byte ``chunk`` of ``row`` in a K-major tile of 128-byte swizzled rows
    (8 rows x 64 bf16 atoms): the chunks of a row are permuted by ``row % 8``."""
    return row * 128 + ((chunk ^ (row % 8)) * 16)


@cutlass.dsl_user_op
def copy_16_shared_to_global(src: Int32, dst: Int64, *, loc=None, ip=None) -> None:
    """Copy 16 bytes from shared ``src`` to global ``dst`` through registers (one
    ``ld.shared.v4.b32`` and one ``st.global.v4.b32``): staged epilogues write whole sectors."""
    llvm.inline_asm(None, [Int32(src).ir_value(loc=loc, ip=ip), Int64(dst).ir_value(loc=loc, ip=ip)],
                    "{ .reg .b32 a, b, c, d; ld.shared.v4.b32 {a, b, c, d}, [$0]; "
                    "st.global.v4.b32 [$1], {a, b, c, d}; }", "r,l",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def store_staged_row(s_tiles: Int32, tile_rows: int, row, chunk, tiles, g_chunk: Int64) -> None:
    """Store 16-byte ``chunk`` of ``row`` of each 64-column tile in ``tiles`` (constexpr
    indices) from swizzled K-major tiles of ``tile_rows`` rows at shared ``s_tiles`` to global,
    where ``g_chunk`` is the chunk's address in tile 0's columns (a staged epilogue's whole-line
    stores: 8 lanes of ``chunk`` 0-7 write one 128-byte line)."""
    s_row = s_tiles + sw128_offset(row, chunk)
    for tile in tiles:
        copy_16_shared_to_global(s_row + tile * tile_rows * 128, g_chunk + tile * 128)


@cutlass.dsl_user_op
def l2_policy(kind: cutlass.Constexpr, *, loc=None, ip=None) -> Int64:
    """A ``createpolicy`` L2 cache policy for all of a load's or store's lines, ``kind``
    ``"evict_first"`` (streamed data, read or written once) or ``"evict_last"`` (the hot set)."""
    return Int64(llvm.inline_asm(Int64.mlir_type, [],
                                 f"createpolicy.fractional.L2::{kind}.b64 $0, 1.0;", "=l",
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cutlass.dsl_user_op
def store_bf16x2_hint(addr: Int64, v0: Float32, v1: Float32, policy: Int64, *, loc=None,
                      ip=None) -> None:
    """Round two fp32 values to bf16 and store them (4 bytes, ``v0`` first) at ``addr`` under
    the L2 cache ``policy``."""
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Float32(v0).ir_value(loc=loc, ip=ip),
                           Float32(v1).ir_value(loc=loc, ip=ip), Int64(policy).ir_value(loc=loc, ip=ip)],
                    "{ .reg .b32 v; cvt.rn.bf16x2.f32 v, $2, $1; "
                    "st.global.L2::cache_hint.b32 [$0], v, $3; }", "l,f,f,l",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@cute.jit
def gather_row_zfill(idx: Int32, s_kv: Int32, j: Int32, row: Int32, kv_base: Int64,
                     row_bytes: Int64, s_tile_base: Int32, tile_rows: cutlass.Constexpr,
                     lo: cutlass.Constexpr, hi: cutlass.Constexpr, src_tile_offset=0,
                     policy=None) -> tuple:
    """Gather KV row ``idx`` into row ``row`` of a shared KV tile, this thread's share: 16-byte
    chunk ``j`` of each 64-column tile in ``[lo, hi)``. The tile is K-major, 128-byte swizzled
    and 1024-byte aligned, addressed by hand: 64-column tile ``c`` is ``tile_rows`` rows of 128
    bytes from ``s_tile_base``, chunk ``j`` of row ``r`` at ``(j ^ (r % 8)) * 16``. Shared tile
    ``c`` is filled from the row's 64-column tile ``c + src_tile_offset`` (a CTA that holds a
    column slice passes the slice's first tile). Branch-free:
    a row outside ``[0, s_kv)`` is copied from KV row 0 with a source size of 0 (reads nothing,
    zero-fills), so ptxas predicates the copies. Returns ``(valid, the row read)``."""
    valid = (idx >= 0) & (idx < s_kv)
    src_row = Int32(0)
    nbytes = Int32(0)
    if valid:
        src_row = idx
        nbytes = Int32(16)
    src = kv_base + Int64(src_row) * row_bytes + j * (VEC * 2)
    dst = s_tile_base + sw128_offset(row, j)
    for c in cutlass.range_constexpr(lo, hi):
        cp_async_16_zfill(dst + c * (tile_rows * 128), src + (src_tile_offset + c) * 128, nbytes,
                          policy)
    return valid, src_row
