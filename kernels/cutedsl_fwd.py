"""CuTe DSL sparse MLA forward (one latent KV head, gathered top-k keys): the contract, and what
its flavours share.

Contract (see :mod:`dsa_aot.kernels.reference`): ``q`` [s_q, H, D_qk] bf16, ``kv`` [s_kv, D_qk]
bf16, ``topk_idxs`` [s_q, K] int32, ``topk_length`` [s_q] int32 (compact layout only),
``attn_sink`` [H] fp32 (-inf: no sink), ``out`` [s_q, H, 512] bf16, ``lse`` [s_q, H] fp32 and the
run-time scalar ``softmax_scale``. ``D_qk`` (512 or 576), ``H`` (16, 32, 64, 128) and the layout
are compile-time; ``s_q``, ``s_kv`` and ``K`` are run-time (any ``K >= 1``, no tile multiple).

Every flavour (``impl``) runs the same algorithm on tiles of one query row and a block of 64
heads (H < 64: the extra rows of Q are zero-filled and never stored; H = 128: two tiles per row):

* the row's valid slots are walked in blocks of 64: each gathered KV row is copied by
  ``cp.async`` from ``kv[idx]`` into a 128-byte-swizzled shared tile. A slot is valid iff it lies
  below ``clamp(topk_length, 0, K)`` (compact) or ``K`` and ``0 <= idx < s_kv``; an invalid slot
  is never read (its shared row is zero-filled) and its score is set to -inf before any exp;
* ``S = Q K^T`` and ``O += P V`` on tensor cores; ``V`` is the first 512 columns of the same shared
  KV tile read MN-major. The online softmax runs in base 2 with ``scale * log2(e)``; the running
  max starts at a finite floor so an all-masked block never forms ``inf - inf``; ``P`` is rounded
  to bf16 before ``P V``;
* epilogue: ``lse = ln 2 * (m + log2(l))`` (sink excluded), ``out = O / l * w`` with the sink
  weight ``w = 1 / (1 + exp(sink - lse))`` (0 for sink=+inf, 1 for sink=-inf, no overflow to NaN);
  a row without a valid slot stores ``out = 0`` and ``lse = +inf``.

Each flavour is one kernel class, a subclass of :class:`SparseMlaFwd` with a compact and a
noncompact entry point, in a module of its own that says how it schedules the work:

* ``mma`` (any arch; the sm_100a default): :mod:`dsa_aot.kernels.cutedsl_fwd_mma`, 8 warps of
  SM80 ``mma.sync``;
* ``wgmma`` and ``wgmma_pipe`` (sm_90a): :mod:`dsa_aot.kernels.cutedsl_fwd_wgmma`, two
  warpgroups issuing ``wgmma`` from shared memory;
* ``wgmma_ws`` (sm_90a; :func:`default_impl` there): :mod:`dsa_aot.kernels.cutedsl_fwd_ws`,
  warp-specialised (a producer warpgroup and two consumers);
* ``wgmma_split`` (sm_90a): :mod:`dsa_aot.kernels.cutedsl_fwd_split`, persistent and
  warp-specialised, the two consumer warpgroups alternating KV blocks for the scores and softmax.

This module holds what more than one of them uses: the constants and the contract's checks, the
gather of the 256-thread flavours (:meth:`SparseMlaFwd.load_idx`, :meth:`SparseMlaFwd.gather`),
the warp-specialised flavours' producer (:func:`producer_idx`; :func:`gather_rows`, the
``wgmma_ws`` gather, ``wgmma_split`` has its branch-free own), shared memory and copies, the
epilogue's ``lse`` and output factor (:func:`row_lse_and_factor`), the
fake arguments and :func:`compile_fwd`, which builds any flavour.

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import hopper_helpers as sm90_utils

from dsa_aot.kernels import cutedsl_common as common
from dsa_aot.kernels.cutedsl_common import (D_V, VEC, fake_tensor, quad_max, quad_sum,
                                            run_time_sizes, vec_stride, walked_slots)

#: Heads per CTA (the MMA M tile) and gathered KV rows per block (the N tile of ``Q K^T``).
BLOCK_H = 64
BLOCK_N = 64
#: 8 warps: 4 along the heads, 2 along the KV rows / value columns.
WARPS_M, WARPS_N = 4, 2
THREADS = 32 * WARPS_M * WARPS_N
#: KV rows one pass of the 16-byte copies covers (8 threads per 64-column slab).
ROWS_PER_PASS = THREADS // (64 // VEC)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: Finite floor of the running max (base-2 units).
M_FLOOR = -1.0e30

_INF = float("inf")


def check_params(d_qk: int, heads: int, layout: str) -> None:
    """Raise ``ValueError`` naming the bad compile-time parameter."""
    common.check_params(d_qk, heads, layout, "forward")


#: Every flavour :func:`compile_fwd` builds.
IMPLS = ("mma", "wgmma", "wgmma_pipe", "wgmma_ws", "wgmma_split")
#: The flavours that need two KV buffers.
TWO_BUFFER_IMPLS = ("wgmma_pipe", "wgmma_ws", "wgmma_split")
#: The warp-specialised flavours: threads per warpgroup, and the producer's KV rows per pass of
#: its 16-byte copies.
WG_THREADS = 128
WS_ROWS_PER_PASS = WG_THREADS // (64 // VEC)


def g2s_copy(threads: int) -> cute.TiledCopy:
    """The 16-byte ``cp.async`` copy of bf16 rows by ``threads`` threads: 8 threads per
    64-column slab, ``threads // 8`` rows per pass."""
    g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                              BFloat16, num_bits_per_copy=128)
    cols = 64 // VEC
    return cute.make_tiled_copy_tv(g2s, cute.make_layout((threads // cols, cols),
                                                         stride=(cols, 1)),
                                   cute.make_layout((1, VEC)))


def wg_mma(n: int, b_major: warpgroup.OperandMajorMode, warpgroups: tuple = (1, 1, 1),
           **kwargs: object) -> cute.TiledMma:
    """A bf16 x bf16 -> fp32 warpgroup MMA of 64 x ``n`` per warpgroup (A K-major; B
    ``b_major``), ``warpgroups`` along (M, N, K); ``kwargs`` go to ``make_trivial_tiled_mma``."""
    return sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, warpgroup.OperandMajorMode.K,
                                             b_major, Float32, warpgroups, (BLOCK_H, n),
                                             **kwargs)


@cute.jit
def wg_gemm(mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
            stage: Int32, steps: cutlass.Constexpr) -> None:
    """Issue ``acc += A B`` over ``steps`` k-steps of ``a`` and of stage ``stage`` of ``b`` as
    one fenced, committed wgmma group (not waited for)."""
    warpgroup.fence()
    for k in cutlass.range_constexpr(steps):
        cute.gemm(mma, acc, a[None, None, k], b[None, None, k, stage], acc)
    warpgroup.commit_group()


@cute.jit
def copy_q_tile(m_q: cute.Tensor, s_q: cute.Tensor, q_copy: cute.TiledCopy, t: Int32, hb: Int32,
                tidx: Int32, d_qk: cutlass.Constexpr, heads: cutlass.Constexpr) -> None:
    """Issue the ``cp.async`` copies of the CTA's 64 x ``d_qk`` block of Q into shared memory
    by the 256 threads of ``q_copy`` (head rows past ``heads`` zero-filled; not committed)."""
    thr_q = q_copy.get_slice(tidx)
    q_row = tidx // (64 // VEC)
    t_g_q = thr_q.partition_S(cute.local_tile(m_q[t, None, None], (BLOCK_H, d_qk), (hb, 0)))
    t_s_q = thr_q.partition_D(s_q)
    for m in cutlass.range_constexpr(cute.size(t_s_q, mode=[1])):
        row = q_row + m * (THREADS // (64 // VEC))
        if cutlass.const_expr(heads >= BLOCK_H):
            cute.copy(q_copy, t_g_q[None, m, None], t_s_q[None, m, None])
        else:
            if row < heads:
                cute.copy(q_copy, t_g_q[None, m, None], t_s_q[None, m, None])
            else:
                t_s_q[None, m, None].fill(0)


@cute.jit
def store_tile(acc: cute.Tensor, coords: cute.Tensor, t_g: cute.Tensor,
               heads: cutlass.Constexpr) -> None:
    """Store a thread's fp32 accumulator ``acc`` as bf16 into ``t_g``, its partition of
    ``out``; ``coords`` are the accumulator's (head row, column), rows past ``heads`` skipped."""
    r_o = cute.make_fragment_like(acc, BFloat16)
    r_o.store(acc.load().to(BFloat16))
    for i in cutlass.range_constexpr(cute.size(r_o)):
        if cutlass.const_expr(heads >= BLOCK_H):
            t_g[i] = r_o[i]
        else:
            if coords[i][0] < heads:
                t_g[i] = r_o[i]


@cute.jit
def p_to_shared(acc_s: cute.Tensor, mma: cute.TiledMma, s_p: cute.Tensor, tidx: Int32) -> None:
    """Round a thread's ``P`` (fp32 ``acc_s`` of ``mma``) to bf16 and store it into ``s_p``."""
    r_pc = cute.make_fragment_like(acc_s, BFloat16)
    r_pc.store(acc_s.load().to(BFloat16))
    copy_p = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16),
                                    mma)
    thr_copy_p = copy_p.get_slice(tidx)
    cute.copy(copy_p, thr_copy_p.retile(r_pc), thr_copy_p.partition_D(s_p))


@cute.jit
def softmax_row(acc_s_mn: cute.Tensor, r: cutlass.Constexpr, m_blk: Float32,
                row_max: cute.Tensor, row_sum: cute.Tensor) -> Float32:
    """Online softmax of row ``r`` of a block's scores (base-2 units, masked) whose max over the
    block is ``m_blk``: ``P = exp2(S - m_new)`` in place, the row's running max and sum updated;
    returns ``exp2(m_old - m_new)``, the factor of the row's earlier output."""
    m_old = row_max[r]
    m_new = cute.arch.fmax(m_old, m_blk)
    corr = cute.math.exp2(m_old - m_new, fastmath=True)
    psum = Float32(0.0)
    for j in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
        p = cute.math.exp2(acc_s_mn[r, j] - m_new, fastmath=True)
        acc_s_mn[r, j] = p
        psum = psum + p
    row_sum[r] = row_sum[r] * corr + psum
    row_max[r] = m_new
    return corr


@cute.jit
def row_lse_and_factor(row_max: Float32, total: Float32, head: Int32, heads: cutlass.Constexpr,
                       m_sink: cute.Tensor) -> tuple[Float32, Float32]:
    """A head row's ``lse`` (natural log, sink excluded; +inf without a valid slot) and the factor
    its output is scaled by: ``w / total`` with the sink weight ``w = 1 / (1 + exp(sink - lse))``
    (0 for sink=+inf, 1 for sink=-inf, never NaN), 0 for an empty row. ``row_max`` is in base-2
    units; ``total`` is the row's sum of ``exp2(s - row_max)``."""
    lse_val = Float32(_INF)
    factor = Float32(0.0)
    if total > Float32(0.0):
        lse_val = (row_max + cute.math.log2(total, fastmath=False)) * Float32(LN2)
        sink = Float32(-_INF)
        if head < heads:
            sink = m_sink[head]
        weight = Float32(1.0) / (Float32(1.0) + cute.math.exp2((sink - lse_val) * Float32(LOG2E),
                                                               fastmath=False))
        factor = weight / total
    return lse_val, factor


@cute.jit
def gather_rows(kv_copy: cute.TiledCopy, t_g_kv: cute.Tensor, t_s_kv: cute.Tensor,
                stage: Int32, idx: list, p_row: Int32, s_kv: Int32, row_stride: cutlass.Int64,
                lo: cutlass.Constexpr, hi: cutlass.Constexpr, s_flags: cute.Tensor,
                flag_base: Int32, wtid: Int32, flags: cutlass.Constexpr,
                bn: cutlass.Constexpr) -> None:
    """A producer thread's share of one gathered block: per pass of 16 rows, column tiles
    ``[lo, hi)`` of KV row ``idx[m]`` into ``t_s_kv[..., stage]`` by ``cp.async`` (zeros for
    an index outside ``[0, s_kv)``); with ``flags``, each row's validity into
    ``s_flags[flag_base + row]``. ``t_g_kv``: the thread's partition of rows ``0..bn`` of KV,
    moved to row ``idx[m]`` by its offset."""
    whole = lo == 0 and hi == cute.size(t_s_kv, mode=[2])  # whole rows: one copy each
    for m in cutlass.range_constexpr(bn // WS_ROWS_PER_PASS):
        row = p_row + m * WS_ROWS_PER_PASS
        valid = (idx[m] >= 0) & (idx[m] < s_kv)
        if valid:
            src_t = t_g_kv[None, m, None]
            offset = cutlass.Int64(idx[m] - row) * row_stride
            src = cute.make_tensor(src_t.iterator + offset, src_t.layout)
            if cutlass.const_expr(whole):
                cute.copy(kv_copy, src, t_s_kv[None, m, None, stage])
            else:
                for c in cutlass.range_constexpr(lo, hi):
                    cute.copy(kv_copy, src[None, c], t_s_kv[None, m, c, stage])
        else:
            if cutlass.const_expr(whole):
                t_s_kv[None, m, None, stage].fill(0)
            else:
                for c in cutlass.range_constexpr(lo, hi):
                    t_s_kv[None, m, c, stage].fill(0)
        if cutlass.const_expr(flags):
            if wtid % (64 // VEC) == 0:
                s_flags[flag_base + row] = Int32(1) if valid else Int32(0)


@cute.jit
def producer_idx(block: Int32, t: Int32, m_idx: cute.Tensor, n_valid: Int32, p_row: Int32,
                 bn: cutlass.Constexpr) -> list:
    """A producer thread's KV indices of block ``block`` (``bn`` slots), one per pass of 16
    rows (-1 past the row's valid slots)."""
    out = []
    for m in cutlass.range_constexpr(bn // WS_ROWS_PER_PASS):
        slot = block * bn + p_row + m * WS_ROWS_PER_PASS
        idx = Int32(-1)
        if slot < n_valid:
            idx = m_idx[t, slot]
        out.append(idx)
    return out


def wg_smem_layouts(d_qk: int, bn: int, stages: int, v_cols: int = D_V // 2) -> tuple:
    """Shared-memory layouts of the warpgroup-MMA flavours: Q (64 x ``d_qk``) and a ring of
    ``stages`` KV tiles (``bn`` x ``d_qk``), K-major 128-byte swizzled; V^T of ``v_cols`` value
    columns (all of them, or one half), (``v_cols``, ``bn``) per stage, over the KV tiles'
    bytes (MN-major; the right half starts 256 * ``bn`` elements later, whole atoms); and the
    64 x ``bn`` P tile."""
    k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, BFloat16)
    s_q_layout = cute.tile_to_shape(k_atom, (BLOCK_H, d_qk), (0, 1))
    s_kv_layout = cute.tile_to_shape(k_atom, (bn, d_qk, stages), (0, 1, 2))
    v_tile = cute.tile_to_shape(mn_atom, (v_cols, bn), (1, 0))
    s_v_layout = cute.make_composed_layout(
        v_tile.inner, 0, cute.make_layout(
            (v_tile.outer.shape[0], v_tile.outer.shape[1], stages),
            stride=(v_tile.outer.stride[0], v_tile.outer.stride[1], bn * d_qk)))
    p_atom = k_atom
    if bn % 64 != 0:
        p_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, BFloat16)
    s_p_layout = cute.tile_to_shape(p_atom, (BLOCK_H, bn), (0, 1))
    return s_q_layout, s_kv_layout, s_v_layout, s_p_layout


def wg_storage(s_q_layout: cute.ComposedLayout, s_kv_layout: cute.ComposedLayout,
               s_p_layout: cute.ComposedLayout, p_tiles: int = 1, **fields: tuple) -> object:
    """The shared-memory struct of a warpgroup-MMA flavour: Q, the KV ring and ``p_tiles`` P
    tiles (layouts of :func:`wg_smem_layouts`, 1024-byte aligned), then ``fields`` in order,
    each ``name=(dtype, count, alignment)``."""
    arrays = {"s_q": (BFloat16, cute.cosize(s_q_layout.outer), 1024),
              "s_kv": (BFloat16, cute.cosize(s_kv_layout.outer), 1024),
              "s_p": (BFloat16, cute.cosize(s_p_layout.outer) * p_tiles, 1024), **fields}
    annotations = {name: cute.struct.Align[cute.struct.MemRange[dtype, count], align]
                   for name, (dtype, count, align) in arrays.items()}
    return cute.struct(type("SharedStorage", (), {"__annotations__": annotations}))


def wg_tiles(storage: object, s_q_layout: cute.ComposedLayout, s_kv_layout: cute.ComposedLayout,
             s_p_layout: cute.ComposedLayout) -> tuple[cute.Tensor, cute.Tensor, cute.Tensor]:
    """Q, the KV ring and P of a :func:`wg_storage` struct, as swizzled tensors."""
    s_q = storage.s_q.get_tensor(s_q_layout.outer, swizzle=s_q_layout.inner)
    s_p = storage.s_p.get_tensor(s_p_layout.outer, swizzle=s_p_layout.inner)
    s_kv = storage.s_kv.get_tensor(s_kv_layout.outer, swizzle=s_kv_layout.inner)
    return s_q, s_kv, s_p


def ws_copies() -> tuple[cute.TiledCopy, cute.TiledCopy]:
    """The 16-byte ``cp.async`` copies of the warp-specialised flavours: Q by the 256 consumer
    threads, gathered KV rows by the 128 producer threads (16 rows per pass)."""
    return g2s_copy(THREADS), g2s_copy(WG_THREADS)


class Gather(NamedTuple):
    """A thread's part in the gather of the 256-thread flavours (:meth:`SparseMlaFwd.load_idx`,
    :meth:`SparseMlaFwd.gather`): query row ``t`` and its ``n_valid`` valid slots of ``m_idx``;
    ``t_g_kv``, the thread's partition of KV rows 0..63, moved to a gathered row by
    ``row_stride`` (``s_kv`` rows); the KV buffers' validity flags; the 16-byte copy, this
    thread's row in each of its passes and its index in the CTA."""

    t: Int32
    m_idx: cute.Tensor
    n_valid: Int32
    s_kv: Int32
    t_g_kv: cute.Tensor
    row_stride: cutlass.Int64
    s_valid_all: cute.Tensor
    copy: cute.TiledCopy
    row_in_pass: Int32
    tidx: Int32


class SparseMlaFwd:
    """Base of the forward kernel classes, one ``(d_qk, heads, layout)`` each.

    A subclass is one flavour: it names the ``impl`` values it builds (:attr:`IMPLS`) and
    defines ``launch``; ``kv_stages`` is the number of gathered KV tiles in flight (1 or 2).
    The base holds the compile-time parameters and what the two 256-thread flavours (``mma``,
    ``wgmma``) share: the gather, the row maxima and sums exchanged between the two halves of
    the CTA, and the epilogue's rows.
    """

    #: The flavours (``impl``) a subclass builds; the first is its default.
    IMPLS: tuple[str, ...] = ()
    #: Whether the entry points take the int32 ``num_sms`` before the stream (a persistent grid).
    NUM_SMS: bool = False

    def __init__(self, d_qk: int, heads: int, layout: str, kv_stages: int = 2,
                 impl: str | None = None) -> None:
        if not self.IMPLS:
            raise TypeError(f"{type(self).__name__} is no flavour's kernel class")
        impl = impl or self.IMPLS[0]
        check_params(d_qk, heads, layout)
        if kv_stages not in (1, 2):
            raise ValueError(f"kv_stages={kv_stages!r}: use 1 or 2")
        if impl not in self.IMPLS:
            raise ValueError(f"impl={impl!r}: {type(self).__name__} builds {self.IMPLS}")
        if impl in TWO_BUFFER_IMPLS and kv_stages != 2:
            raise ValueError(f"impl={impl!r} needs kv_stages=2")
        self.d_qk = d_qk
        self.heads = heads
        self.compact = layout == "compact"
        self.kv_stages = kv_stages
        self.impl = impl

    def launch(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor,
               topk_length: cute.Tensor, attn_sink: cute.Tensor, out: cute.Tensor,
               lse: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream) -> None:
        """Launch the flavour's kernel (``topk_length`` is only read in the compact layout)."""
        raise NotImplementedError(f"{type(self).__name__} defines no launch")

    def row_slots(self, t: Int32, m_idx: cute.Tensor, m_len: cute.Tensor, bn: int,
                  n_kv: Int32) -> tuple[Int32, Int32]:
        """Row ``t``'s slots to walk (:func:`~dsa_aot.kernels.cutedsl_common.walked_slots`) and
        their blocks of ``bn`` (call while tracing)."""
        n_valid = walked_slots(m_idx, m_len, t, n_kv, self.compact)
        return n_valid, (n_valid + bn - 1) // bn

    # ---------------------------------------------------------------------------------------
    # The 256-thread flavours: two halves of the CTA share the head rows of a block
    # ---------------------------------------------------------------------------------------

    def row_scratch(self, storage: object) -> tuple[cute.Tensor, cute.Tensor, cute.Tensor]:
        """``s_max`` and ``s_sum`` (a value per half of the CTA and head row) and the KV
        buffers' validity flags, from the shared storage (call while tracing)."""
        s_max = storage.s_max.get_tensor(cute.make_layout(WARPS_N * BLOCK_H))
        s_sum = storage.s_sum.get_tensor(cute.make_layout(WARPS_N * BLOCK_H))
        s_valid_all = storage.s_valid.get_tensor(cute.make_layout(BLOCK_N * self.kv_stages))
        return s_max, s_sum, s_valid_all

    def start_copies(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_idx: cute.Tensor,
                     n_valid: Int32, s_kv: Int32, s_q: cute.Tensor, s_valid_all: cute.Tensor,
                     gmem_copy: cute.TiledCopy, t: Int32, hb: Int32,
                     tidx: Int32) -> tuple[Gather, object]:
        """Issue the copies of Q (32 rows x 64 columns per pass, 16 B per thread; not
        committed); return the thread's :class:`Gather` and its slice of ``gmem_copy`` (call
        while tracing)."""
        thr_copy = gmem_copy.get_slice(tidx)
        row_in_pass = tidx // (64 // VEC)
        copy_q_tile(m_q, s_q, gmem_copy, t, hb, tidx, self.d_qk, self.heads)
        # rows 0..63 of kv as a template: each thread's row is re-based on its gathered index
        t_g_kv = thr_copy.partition_S(cute.local_tile(m_kv, (BLOCK_N, self.d_qk), (0, 0)))
        return Gather(t, m_idx, n_valid, s_kv, t_g_kv, m_kv.stride[0], s_valid_all, gmem_copy,
                      row_in_pass, tidx), thr_copy

    @cute.jit
    def masked_max(self, acc_s_mn: cute.Tensor, c_s_mn: cute.Tensor, s_valid_all: cute.Tensor,
                   valid_base: Int32, scale_log2: Float32, s_max: cute.Tensor, half: Int32,
                   lane: Int32) -> None:
        """Scale this thread's scores into base-2 units and set those of invalid slots (flags
        from ``s_valid_all[valid_base ..]``) to -inf, before any exp; each row's max over this
        half's columns goes to ``s_max[64 half + row]``, read after the CTA barrier here."""
        for r in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
            part = Float32(-_INF)
            for j in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
                col = c_s_mn[r, j][1]
                val = acc_s_mn[r, j] * scale_log2
                if s_valid_all[valid_base + col] == 0:
                    val = Float32(-_INF)
                acc_s_mn[r, j] = val
                part = cute.arch.fmax(part, val)
            part = quad_max(part)
            if lane % 4 == 0:
                s_max[half * BLOCK_H + c_s_mn[r, 0][0]] = part
        cute.arch.barrier()

    @cute.jit
    def rescale(self, acc_s_mn: cute.Tensor, c_s_mn: cute.Tensor, s_max: cute.Tensor,
                row_max: cute.Tensor, row_sum: cute.Tensor, acc_o_mns: list) -> None:
        """The online softmax of a block once :meth:`masked_max` is done: ``P`` in place, each
        row's running max (over both halves) and sum, and the output (``acc_o_mns``: row x
        column views of its accumulators) rescaled."""
        for r in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
            row = c_s_mn[r, 0][0]
            m_blk = cute.arch.fmax(s_max[row], s_max[BLOCK_H + row])
            corr = softmax_row(acc_s_mn, r, m_blk, row_max, row_sum)
            for acc_mn in acc_o_mns:
                acc_mn[r, None] = acc_mn[r, None].load() * corr

    @cute.jit
    def finish_rows(self, acc_o_mns: list, row_max: cute.Tensor, row_sum: cute.Tensor,
                    c_s_mn: cute.Tensor, s_sum: cute.Tensor, half: Int32, lane: Int32, t: Int32,
                    hb: Int32, m_sink: cute.Tensor, m_lse: cute.Tensor) -> None:
        """The epilogue's rows once every copy is done: the two halves' row sums added through
        ``s_sum``, the output (``acc_o_mns``, as in :meth:`rescale`) scaled by each row's factor
        and ``lse`` stored by half 0."""
        cute.arch.cp_async_wait_group(0)
        rows = cute.size(c_s_mn, mode=[0])
        for r in cutlass.range_constexpr(rows):
            total = quad_sum(row_sum[r])
            if lane % 4 == 0:
                s_sum[half * BLOCK_H + c_s_mn[r, 0][0]] = total
        cute.arch.barrier()
        for r in cutlass.range_constexpr(rows):
            row = c_s_mn[r, 0][0]
            head = hb * BLOCK_H + row
            lse_val, factor = row_lse_and_factor(row_max[r], s_sum[row] + s_sum[BLOCK_H + row],
                                                 head, self.heads, m_sink)
            for acc_mn in acc_o_mns:
                acc_mn[r, None] = acc_mn[r, None].load() * factor
            if (half == 0) & (lane % 4 == 0) & (head < self.heads):
                m_lse[t, head] = lse_val

    @cute.jit
    def load_idx(self, block: Int32, g: Gather) -> tuple[Int32, Int32]:
        """This thread's two KV indices of block ``block`` (-1 past the valid slots).

        Loaded one block ahead of :meth:`gather`, so the copies never wait on this load.
        """
        t, m_idx, n_valid = g.t, g.m_idx, g.n_valid
        slot = block * BLOCK_N + g.row_in_pass
        idx0 = Int32(-1)
        idx1 = Int32(-1)
        if slot < n_valid:
            idx0 = m_idx[t, slot]
        if slot + ROWS_PER_PASS < n_valid:
            idx1 = m_idx[t, slot + ROWS_PER_PASS]
        return idx0, idx1

    @cute.jit
    def gather(self, idx0: Int32, idx1: Int32, g: Gather, t_s_kv: cute.Tensor,
               valid_base: Int32) -> None:
        """Issue the ``cp.async`` copies of one block's gathered rows into ``t_s_kv`` (a KV
        buffer; its flags from ``valid_base``), not committed.

        An index outside ``[0, s_kv)`` is never dereferenced: its shared row is zero-filled and
        its validity flag cleared.
        """
        s_kv, t_g_kv, row_stride, s_valid_all = g.s_kv, g.t_g_kv, g.row_stride, g.s_valid_all
        gmem_copy, row_in_pass, tidx = g.copy, g.row_in_pass, g.tidx
        for m in cutlass.range_constexpr(BLOCK_N // ROWS_PER_PASS):
            row = row_in_pass + m * ROWS_PER_PASS
            idx = idx0 if m == 0 else idx1
            valid = (idx >= 0) & (idx < s_kv)
            if valid:
                src_t = t_g_kv[None, m, None]
                offset = cutlass.Int64(idx - row) * row_stride
                src = cute.make_tensor(src_t.iterator + offset, src_t.layout)
                cute.copy(gmem_copy, src, t_s_kv[None, m, None])
            else:
                t_s_kv[None, m, None].fill(0)
            if tidx % (64 // VEC) == 0:
                s_valid_all[valid_base + row] = Int32(1) if valid else Int32(0)

    @cute.jit
    def gather_next(self, go: cutlass.Boolean, idx0: Int32, idx1: Int32, g: Gather,
                    t_s_kv: cute.Tensor, valid_base: Int32, block: Int32) -> tuple[Int32, Int32]:
        """If ``go``, :meth:`gather` the block of ``idx0`` / ``idx1``; commit; and return the
        indices of block ``block``."""
        if go:
            self.gather(idx0, idx1, g, t_s_kv, valid_base)
        cute.arch.cp_async_commit_group()
        return self.load_idx(block, g)


class SparseMlaFwdCompact(SparseMlaFwd):
    """Entry point of the compact layout (``topk_length`` given); a flavour's compact entry
    point derives from its kernel class and this."""

    @cute.jit
    def __call__(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor,
                 topk_length: cute.Tensor, attn_sink: cute.Tensor, out: cute.Tensor,
                 lse: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream) -> None:
        self.launch(q, kv, topk_idxs, topk_length, attn_sink, out, lse, softmax_scale, stream)


class SparseMlaFwdNoncompact(SparseMlaFwd):
    """Entry point of the noncompact layout (padding marked by out-of-range indices); a
    flavour's noncompact entry point derives from its kernel class and this."""

    @cute.jit
    def __call__(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor,
                 attn_sink: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
                 softmax_scale: Float32, stream: cuda.CUstream) -> None:
        self.launch(q, kv, topk_idxs, topk_idxs, attn_sink, out, lse, softmax_scale, stream)


def fake_arguments(d_qk: int, heads: int, layout: str,
                   num_sms: bool = False) -> dict[str, object]:
    """Dynamic-shape stand-ins for every argument, in call order.

    ``s_q``, ``s_kv`` and ``topk`` are run-time; heads and head dims are compile-time. The last
    dim of every tensor is contiguous; row/head strides are run-time multiples of 8 elements for
    bf16 tensors (16-byte aligned rows for ``cp.async``). ``num_sms``: an ``int32`` scalar
    ``num_sms`` (the GPU's SM count, which sizes a persistent grid) before the stream.
    """
    check_params(d_qk, heads, layout)
    s_q, s_kv, topk = run_time_sizes()
    fake = fake_tensor

    args: dict[str, object] = {
        "q": fake(BFloat16, (s_q, heads, d_qk), (vec_stride(), vec_stride(), 1), 16),
        "kv": fake(BFloat16, (s_kv, d_qk), (vec_stride(), 1), 16),
        "topk_idxs": fake(Int32, (s_q, topk), (cute.sym_int64(), 1), 4),
    }
    if layout == "compact":
        args["topk_length"] = fake(Int32, (s_q,), (cute.sym_int64(),), 4)
    args |= {
        "attn_sink": fake(Float32, (heads,), (1,), 4),
        "out": fake(BFloat16, (s_q, heads, D_V), (vec_stride(), vec_stride(), 1), 16),
        "lse": fake(Float32, (s_q, heads), (cute.sym_int64(), 1), 4),
        "softmax_scale": Float32(1.0),
    }
    if num_sms:
        args["num_sms"] = Int32(1)
    args["stream"] = cuda.CUstream(0)
    return args


def default_impl(arch: str) -> str:
    """The MMA flavour an arch gets by default: the service's
    (:data:`dsa_aot.backends.cutedsl.flavours.FWD_DEFAULT_IMPL`; the wgmma flavours need sm_90a)."""
    from dsa_aot.backends.cutedsl.flavours import FWD_DEFAULT_IMPL

    return FWD_DEFAULT_IMPL[arch]


def default_kv_stages(impl: str) -> int:
    """KV tiles in flight by default: the service's
    (:data:`dsa_aot.backends.cutedsl.flavours.FWD_DEFAULT_KV_STAGES`; one for mma)."""
    from dsa_aot.backends.cutedsl.flavours import FWD_DEFAULT_KV_STAGES

    return FWD_DEFAULT_KV_STAGES[impl]


def compile_entry(compact: type[SparseMlaFwd], noncompact: type[SparseMlaFwd], arch: str,
                  d_qk: int, heads: int, layout: str, kv_stages: int | None, impl: str,
                  extra_options: str = "") -> tuple[object, dict[str, object]]:
    """``cute.compile`` a flavour's entry point of ``layout`` (``compact`` or ``noncompact``)
    for ``arch``; ``kv_stages=None`` takes :func:`default_kv_stages`. Returns the compiled
    function and the fake arguments it was compiled with."""
    kv_stages = kv_stages or default_kv_stages(impl)
    if impl != "mma" and arch != "sm_90a":
        raise ValueError(f"impl={impl!r} needs sm_90a, not {arch}; use impl='mma'")
    cls = compact if layout == "compact" else noncompact
    fakes = fake_arguments(d_qk, heads, layout, num_sms=cls.NUM_SMS)
    kernel = cls(d_qk, heads, layout, kv_stages, impl)
    compiled = cute.compile(kernel, *fakes.values(),
                            options=f"--gpu-arch {arch} {extra_options}".strip())
    return compiled, fakes


def compile_fwd(arch: str, d_qk: int, heads: int, layout: str, kv_stages: int | None = None,
                impl: str | None = None, extra_options: str = "") -> tuple[object, dict[str, object]]:
    """``cute.compile`` the forward for ``arch`` (``CUTE_DSL_ARCH=<arch>`` set before import).

    ``impl=None`` takes :func:`default_impl`, ``kv_stages=None`` :func:`default_kv_stages`; the
    flavour's own module compiles it (``compile_fwd_<flavour>``, which a build calls directly).
    Returns the compiled function and the fake arguments it was compiled with.
    """
    impl = impl or default_impl(arch)
    if impl == "mma":
        from dsa_aot.kernels.cutedsl_fwd_mma import compile_fwd_mma as compile_flavour
    elif impl in ("wgmma", "wgmma_pipe"):
        from dsa_aot.kernels.cutedsl_fwd_wgmma import compile_fwd_wgmma as compile_flavour
    elif impl == "wgmma_ws":
        from dsa_aot.kernels.cutedsl_fwd_ws import compile_fwd_ws as compile_flavour
    elif impl == "wgmma_split":
        from dsa_aot.kernels.cutedsl_fwd_split import compile_fwd_split as compile_flavour
    else:
        raise ValueError(f"impl={impl!r}: use one of {IMPLS}")
    return compile_flavour(arch, d_qk, heads, layout, kv_stages, impl, extra_options)


def default_softmax_scale(d_qk: int) -> float:
    """The contract's default ``softmax_scale``."""
    return float(d_qk ** -0.5)


__all__ = ["IMPLS", "SparseMlaFwd", "SparseMlaFwdCompact", "SparseMlaFwdNoncompact",
           "check_params", "compile_entry", "compile_fwd", "default_impl", "default_kv_stages",
           "default_softmax_scale", "fake_arguments"]
