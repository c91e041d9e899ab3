"""CuTe DSL sparse MLA forward (one latent KV head, gathered top-k keys).

Contract (see :mod:`dsa_aot.kernels.reference`): ``q`` [s_q, H, D_qk] bf16, ``kv`` [s_kv, D_qk]
bf16, ``topk_idxs`` [s_q, K] int32, ``topk_length`` [s_q] int32 (compact layout only),
``attn_sink`` [H] fp32 (-inf: no sink), ``out`` [s_q, H, 512] bf16, ``lse`` [s_q, H] fp32 and the
run-time scalar ``softmax_scale``. ``D_qk`` (512 or 576), ``H`` (16, 32, 64, 128) and the layout
are compile-time; ``s_q``, ``s_kv`` and ``K`` are run-time (any ``K >= 1``, no tile multiple).

Three flavours (``impl``) share the algorithm; each CTA of 256 threads owns one query row and a
block of 64 heads (H < 64: the extra rows of Q are zero-filled and never stored; H = 128 uses two
CTAs per row):

* the row's valid slots are walked in blocks of 64: each gathered KV row is copied by
  ``cp.async`` from ``kv[idx]`` into a 128-byte-swizzled shared tile (the indices of the next
  block are loaded one block ahead, so no copy waits on them). A slot is valid iff it lies below
  ``clamp(topk_length, 0, K)`` (compact) or ``K`` and ``0 <= idx < s_kv``; an invalid slot is never
  read (its shared row is zero-filled) and its score is set to -inf before any exp;
* ``S = Q K^T`` and ``O += P V`` on tensor cores; ``V`` is the first 512 columns of the same shared
  KV tile read MN-major. The online softmax runs in base 2 with ``scale * log2(e)``; the running
  max starts at a finite floor so an all-masked block never forms ``inf - inf``. The two halves of
  the CTA that share head rows exchange row maxima through shared memory, and ``P`` (rounded to
  bf16) goes through shared memory to become the A operand of ``P V``;
* epilogue: ``lse = ln 2 * (m + log2(l))`` (sink excluded), ``out = O / l * w`` with the sink
  weight ``w = 1 / (1 + exp(sink - lse))`` (0 for sink=+inf, 1 for sink=-inf, no overflow to NaN);
  a row without a valid slot stores ``out = 0`` and ``lse = +inf``.

``mma`` (any arch; the sm_100a default): 8 warps of SM80 ``mma.sync`` fed by ``ldmatrix``, warp
``w`` owning head rows ``16 * (w % 4)`` and half of every 32 columns (``w // 4``); one KV buffer
by default (two spill registers). ``wgmma`` (sm_90a): two warpgroups issue ``wgmma`` from shared
memory, each computing 32 score columns and 256 output columns, with two KV buffers (block
``b + 1`` is gathered while block ``b`` is computed). ``wgmma_pipe``: as
``wgmma``, but ``P V`` of block ``b`` stays in flight until the scores of block ``b + 1`` are
waited for, and block ``b + 1`` is gathered right after the barrier that follows that wait.
``wgmma_ws`` (the sm_90a default; 384 threads, warp-specialised): warpgroup 2 is the producer (``setmaxnreg``
80): it gathers each block into a ring of two KV buffers with ``cp.async`` and signals ``full``
through ``cp.async.mbarrier.arrive.noinc`` plus a plain arrive (after its validity flags);
warpgroup 0 (``setmaxnreg`` 240) computes the whole 64 x 64 score tile, the online softmax, lse
and the left half of ``O`` (value columns 0-255); warpgroup 1 rescales and accumulates the right
half (256-511) from the same ``P``, handed over through shared memory with ``p_full`` /
``p_free`` mbarriers. A buffer is returned to the producer (``empty``) once both halves' ``P V``
have completed. No CTA-wide barrier inside the loop; a named barrier joins the two consumers for
the epilogue.
``wgmma_split`` (sm_90a, 384 threads) is its own kernel class in
:mod:`dsa_aot.kernels.cutedsl_fwd_split`: the two consumer warpgroups alternate KV blocks for the
scores and softmax and each owns half of ``O``; it shares this module's constants and helpers.

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.utils import hopper_helpers as sm90_utils

from dsa_aot.kernels import cutedsl_common as common
from dsa_aot.kernels.cutedsl_common import (D_QK_CHOICES, D_V, HEAD_CHOICES, LAYOUTS, VEC,
                                            acc_rows_cols, fake_tensor, quad_max, quad_sum,
                                            run_time_sizes, vec_stride, wg_rows_cols)

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


IMPLS = ("mma", "wgmma", "wgmma_pipe", "wgmma_ws")
#: ``wgmma_ws``: threads per warpgroup, 3 warpgroups (softmax + left half of P V, right half
#: of P V, gather producer), and the producer's KV rows per pass of its 16-byte copies.
WG_THREADS = 128
WS_THREADS = 3 * WG_THREADS
WS_ROWS_PER_PASS = WG_THREADS // (64 // VEC)
#: setmaxnreg budgets (<= 3 * 168 in all: the launch gives each thread 65536 / 384 -> 168).
WS_SOFTMAX_REGS, WS_PRODUCER_REGS = 240, 80
#: Named barrier joining the two consumer warpgroups before the epilogue (0 is __syncthreads).
WS_EPILOGUE_BARRIER = 1


@cute.jit
def load_q_tile(m_q: cute.Tensor, s_q: cute.Tensor, q_copy: cute.TiledCopy, t: Int32, hb: Int32,
                tidx: Int32, d_qk: cutlass.Constexpr, heads: cutlass.Constexpr) -> None:
    """Copy the CTA's 64 x ``d_qk`` block of Q into shared memory with the 256 threads of
    ``q_copy`` (head rows past ``heads`` zero-filled) and make it visible to wgmma."""
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
    cute.arch.cp_async_commit_group()
    cute.arch.cp_async_wait_group(0)
    cute.arch.fence_view_async_shared()  # Q -> wgmma reads


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
def store_out_half(acc_o: cute.Tensor, c_o: cute.Tensor, thr_o: cute.core.ThrMma,
                   m_out: cute.Tensor, t: Int32, hb: Int32, half: Int32,
                   heads: cutlass.Constexpr) -> None:
    """Store a warpgroup's 64 x 256 fp32 ``acc_o`` (value columns ``256 half ..``) as bf16;
    ``c_o`` are its coordinates, head rows past ``heads`` are skipped."""
    g_out = cute.local_tile(m_out[t, None, None], (BLOCK_H, D_V // 2), (hb, half))
    t_g = thr_o.partition_C(g_out)
    r_o = cute.make_fragment_like(acc_o, BFloat16)
    r_o.store(acc_o.load().to(BFloat16))
    for i in cutlass.range_constexpr(cute.size(r_o)):
        if cutlass.const_expr(heads >= BLOCK_H):
            t_g[i] = r_o[i]
        else:
            if c_o[i][0] < heads:
                t_g[i] = r_o[i]


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


def ws_smem_layouts(d_qk: int, bn: int, stages: int) -> tuple:
    """Shared-memory layouts of the warp-specialised flavours: Q (64 x ``d_qk``) and a ring of
    ``stages`` KV tiles (``bn`` x ``d_qk``), K-major 128-byte swizzled; V^T of one half of the
    value columns, (256, ``bn``) per stage, over the KV tiles' bytes (MN-major; the right half
    starts 256 * ``bn`` elements later, whole atoms); and the 64 x ``bn`` P tile."""
    k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, BFloat16)
    s_q_layout = cute.tile_to_shape(k_atom, (BLOCK_H, d_qk), (0, 1))
    s_kv_layout = cute.tile_to_shape(k_atom, (bn, d_qk, stages), (0, 1, 2))
    v_tile = cute.tile_to_shape(mn_atom, (D_V // 2, bn), (1, 0))
    s_v_layout = cute.make_composed_layout(
        v_tile.inner, 0, cute.make_layout(
            (v_tile.outer.shape[0], v_tile.outer.shape[1], stages),
            stride=(v_tile.outer.stride[0], v_tile.outer.stride[1], bn * d_qk)))
    p_atom = k_atom
    if bn % 64 != 0:
        p_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, BFloat16)
    s_p_layout = cute.tile_to_shape(p_atom, (BLOCK_H, bn), (0, 1))
    return s_q_layout, s_kv_layout, s_v_layout, s_p_layout


def ws_copies() -> tuple[cute.TiledCopy, cute.TiledCopy]:
    """The 16-byte ``cp.async`` copies of the warp-specialised flavours: Q by the 256 consumer
    threads, gathered KV rows by the 128 producer threads (16 rows per pass)."""
    g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                              BFloat16, num_bits_per_copy=128)
    cols = 64 // VEC
    q_copy = cute.make_tiled_copy_tv(g2s, cute.make_layout((THREADS // cols, cols),
                                                           stride=(cols, 1)),
                                     cute.make_layout((1, VEC)))
    kv_copy = cute.make_tiled_copy_tv(g2s, cute.make_layout((WG_THREADS // cols, cols),
                                                            stride=(cols, 1)),
                                      cute.make_layout((1, VEC)))
    return q_copy, kv_copy


class SparseMlaFwd:
    """The forward kernel for one ``(d_qk, heads, layout)``.

    ``impl``: ``"mma"`` (warp-level ``mma.sync``, any arch), ``"wgmma"`` (sm_90a warpgroup
    MMA from shared memory), ``"wgmma_pipe"`` (the same with ``P V`` left in flight across
    the next block's barrier; two KV buffers) or ``"wgmma_ws"`` (warp-specialised producer /
    consumers with mbarriers; two KV buffers); ``kv_stages``: gathered KV tiles in flight.
    """

    #: ``wgmma_ws``: gathered KV rows per block and KV buffers in the ring (64 x 2 fills the
    #: shared memory at D_qk 576; 32 x 4 and 32 x 3 are correct but slower on the H200).
    ws_block_n: int = BLOCK_N
    ws_stages: int = 2

    def __init__(self, d_qk: int, heads: int, layout: str, kv_stages: int = 2,
                 impl: str = "mma") -> None:
        check_params(d_qk, heads, layout)
        if kv_stages not in (1, 2):
            raise ValueError(f"kv_stages={kv_stages!r}: use 1 or 2")
        if impl not in IMPLS:
            raise ValueError(f"impl={impl!r}: use one of {IMPLS}")
        if impl in ("wgmma_pipe", "wgmma_ws") and kv_stages != 2:
            raise ValueError(f"impl={impl!r} needs kv_stages=2")
        self.d_qk = d_qk
        self.heads = heads
        self.compact = layout == "compact"
        self.kv_stages = kv_stages
        self.impl = impl

    # ---------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def launch(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor,
               topk_length: cute.Tensor, attn_sink: cute.Tensor, out: cute.Tensor,
               lse: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream) -> None:
        if cutlass.const_expr(self.impl == "wgmma_ws"):
            self.launch_ws(q, kv, topk_idxs, topk_length, attn_sink, out, lse, softmax_scale,
                           stream)
        elif cutlass.const_expr(self.impl != "mma"):
            self.launch_wgmma(q, kv, topk_idxs, topk_length, attn_sink, out, lse, softmax_scale,
                              stream)
        else:
            self.launch_mma(q, kv, topk_idxs, topk_length, attn_sink, out, lse, softmax_scale,
                            stream)

    @cute.jit
    def launch_mma(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor,
                   topk_length: cute.Tensor, attn_sink: cute.Tensor, out: cute.Tensor,
                   lse: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream) -> None:
        d = self.d_qk
        atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0,
                                         cute.make_layout((8, 64), stride=(64, 1)))
        s_q_layout = cute.tile_to_shape(atom, (BLOCK_H, d), (0, 1))
        s_kv_layout = cute.tile_to_shape(atom, (BLOCK_N, d), (0, 1))
        s_p_layout = cute.tile_to_shape(atom, (BLOCK_H, BLOCK_N), (0, 1))
        stages = self.kv_stages

        @cute.struct
        class SharedStorage:
            s_q: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(s_q_layout)], 1024]
            s_kv: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(s_kv_layout) * stages],
                                    1024]
            s_p: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(s_p_layout)], 1024]
            s_max: cute.struct.Align[cute.struct.MemRange[Float32, WARPS_N * BLOCK_H], 16]
            s_sum: cute.struct.Align[cute.struct.MemRange[Float32, WARPS_N * BLOCK_H], 16]
            s_valid: cute.struct.Align[cute.struct.MemRange[Int32, BLOCK_N * stages], 16]

        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=128)
        cols = 64 // VEC
        gmem_copy = cute.make_tiled_copy_tv(
            g2s, cute.make_layout((THREADS // cols, cols), stride=(cols, 1)),
            cute.make_layout((1, VEC)))
        # each warp takes 16 contiguous columns of every 32 (two n8 atoms: ldmatrix.x4 for B)
        tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)),
                                        (WARPS_M, WARPS_N, 1),
                                        permutation_mnk=(WARPS_M * 16, WARPS_N * 16, 16))
        s_q = cute.size(q, mode=[0])
        if s_q > 0:
            self.kernel(q, kv, topk_idxs, topk_length, attn_sink, out, lse,
                        softmax_scale * Float32(LOG2E), s_q_layout, s_kv_layout, s_p_layout,
                        gmem_copy, tiled_mma, SharedStorage).launch(
                grid=[s_q, (self.heads + BLOCK_H - 1) // BLOCK_H, 1], block=[THREADS, 1, 1],
                smem=SharedStorage.size_in_bytes(), stream=stream)

    # ---------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_idx: cute.Tensor,
               m_len: cute.Tensor, m_sink: cute.Tensor, m_out: cute.Tensor, m_lse: cute.Tensor,
               scale_log2: Float32, s_q_layout: cute.ComposedLayout,
               s_kv_layout: cute.ComposedLayout, s_p_layout: cute.ComposedLayout,
               gmem_copy: cute.TiledCopy, tiled_mma: cute.TiledMma,
               SharedStorage: cutlass.Constexpr) -> None:
        d = self.d_qk
        heads = self.heads
        tidx, _, _ = cute.arch.thread_idx()
        t, hb, _ = cute.arch.block_idx()
        warp_n = cute.arch.warp_idx() // WARPS_M
        lane = cute.arch.lane_idx()
        s_kv = cute.size(m_kv, mode=[0])
        topk = cute.size(m_idx, mode=[1])
        n_valid = topk
        if cutlass.const_expr(self.compact):
            n_valid = cutlass.max(cutlass.min(m_len[t], topk), Int32(0))
        n_blocks = (n_valid + BLOCK_N - 1) // BLOCK_N

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        s_q = storage.s_q.get_tensor(s_q_layout)
        s_p = storage.s_p.get_tensor(s_p_layout)
        s_kv_bufs = [cute.make_tensor(storage.s_kv.data_ptr() + i * cute.cosize(s_kv_layout),
                                      s_kv_layout) for i in range(self.kv_stages)]
        s_max = storage.s_max.get_tensor(cute.make_layout(WARPS_N * BLOCK_H))
        s_sum = storage.s_sum.get_tensor(cute.make_layout(WARPS_N * BLOCK_H))
        s_valid_all = storage.s_valid.get_tensor(cute.make_layout(BLOCK_N * self.kv_stages))

        # ---- gmem -> smem copies: 32 rows x 64 columns per pass, 16 B per thread ----------
        thr_copy = gmem_copy.get_slice(tidx)
        row_in_pass = tidx // (64 // VEC)
        g_q = cute.local_tile(m_q[t, None, None], (BLOCK_H, d), (hb, 0))
        t_g_q = thr_copy.partition_S(g_q)
        t_s_q = thr_copy.partition_D(s_q)
        for m in cutlass.range_constexpr(cute.size(t_s_q, mode=[1])):
            row = row_in_pass + m * (THREADS // (64 // VEC))
            if cutlass.const_expr(heads >= BLOCK_H):
                cute.copy(gmem_copy, t_g_q[None, m, None], t_s_q[None, m, None])
            else:
                if row < heads:
                    cute.copy(gmem_copy, t_g_q[None, m, None], t_s_q[None, m, None])
                else:
                    t_s_q[None, m, None].fill(0)
        # rows 0..63 of kv as a template: each thread's row is re-based on its gathered index
        t_g_kv = thr_copy.partition_S(cute.local_tile(m_kv, (BLOCK_N, d), (0, 0)))
        row_stride = m_kv.stride[0]
        t_s_kv = [thr_copy.partition_D(buf) for buf in s_kv_bufs]

        # ---- MMA partitions ----------------------------------------------------------------
        thr_mma = tiled_mma.get_slice(tidx)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                   BFloat16)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                     BFloat16)
        copy_a = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
        copy_b = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        copy_bt = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)

        t_s_q_a = copy_a.partition_S(s_q)  # (CPY, M, D/16)
        r_q = thr_mma.make_fragment_A(thr_mma.partition_A(cute.local_tile(s_q, (BLOCK_H, 16),
                                                                          (0, 0))))
        r_q_view = copy_a.retile(r_q)
        t_s_p_a = copy_a.partition_S(s_p)  # (CPY, M, 4)
        r_p = thr_mma.make_fragment_A(thr_mma.partition_A(s_p))
        r_p_view = copy_a.retile(r_p)

        t_s_k_b = [copy_b.partition_S(buf) for buf in s_kv_bufs]  # (CPY, N, D/16)
        r_k = thr_mma.make_fragment_B(thr_mma.partition_B(cute.local_tile(s_kv_bufs[0],
                                                                          (BLOCK_N, 16), (0, 0))))
        r_k_view = copy_b.retile(r_k)
        # V^T views: (512 value columns, 64 KV rows) over the same tiles
        s_vt_bufs = [cute.composition(buf, cute.make_layout((D_V, BLOCK_N), stride=(BLOCK_N, 1)))
                     for buf in s_kv_bufs]
        n_chunks = D_V // BLOCK_N
        r_v = thr_mma.make_fragment_B(thr_mma.partition_B(cute.local_tile(s_vt_bufs[0],
                                                                          (BLOCK_N, 16),
                                                                          (0, 0))))
        r_v_view = copy_bt.retile(r_v)

        acc_shape = thr_mma.partition_shape_C((BLOCK_H, BLOCK_N))
        acc_o = [cute.make_rmem_tensor(acc_shape, Float32) for _ in range(n_chunks)]
        for c in cutlass.range_constexpr(n_chunks):
            acc_o[c].fill(0.0)
        c_s = thr_mma.partition_C(cute.make_identity_tensor((BLOCK_H, BLOCK_N)))
        c_s_mn = acc_rows_cols(c_s)
        rows_per_thread = cute.size(c_s_mn, mode=[0])
        row_max = cute.make_rmem_tensor(rows_per_thread, Float32)
        row_sum = cute.make_rmem_tensor(rows_per_thread, Float32)
        row_max.fill(M_FLOOR)
        row_sum.fill(0.0)

        # ---- prologue: first block in flight, the next block's indices loading ------------
        idx0, idx1 = self.load_idx(0, t, m_idx, n_valid, row_in_pass)
        if n_blocks > 0:
            self.gather(idx0, idx1, s_kv, t_g_kv, row_stride, t_s_kv[0], s_valid_all, 0,
                        gmem_copy, row_in_pass, tidx)
        cute.arch.cp_async_commit_group()
        idx0, idx1 = self.load_idx(1, t, m_idx, n_valid, row_in_pass)

        for b in cutlass.range(n_blocks, unroll=1):
            stage = 0
            if cutlass.const_expr(self.kv_stages == 2):
                stage = b % 2
            if cutlass.const_expr(self.kv_stages == 2):
                # prefetch block b + 1 into the other buffer (freed by the previous block's end)
                if b + 1 < n_blocks:
                    if stage == 0:
                        self.gather(idx0, idx1, s_kv, t_g_kv, row_stride, t_s_kv[1],
                                    s_valid_all, BLOCK_N, gmem_copy, row_in_pass, tidx)
                    else:
                        self.gather(idx0, idx1, s_kv, t_g_kv, row_stride, t_s_kv[0],
                                    s_valid_all, 0, gmem_copy, row_in_pass, tidx)
                cute.arch.cp_async_commit_group()
                idx0, idx1 = self.load_idx(b + 2, t, m_idx, n_valid, row_in_pass)
                cute.arch.cp_async_wait_group(1)
            else:
                cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if cutlass.const_expr(self.kv_stages == 2):
                if stage == 0:
                    self.compute_block(0, t_s_q_a, r_q, r_q_view, t_s_k_b[0], r_k, r_k_view,
                                       s_vt_bufs[0], r_v, r_v_view, t_s_p_a, r_p, r_p_view, s_p,
                                       s_valid_all, s_max, acc_o, row_max, row_sum, c_s_mn,
                                       scale_log2, tiled_mma, thr_mma, copy_bt, warp_n, lane,
                                       tidx)
                else:
                    self.compute_block(BLOCK_N, t_s_q_a, r_q, r_q_view, t_s_k_b[1], r_k,
                                       r_k_view, s_vt_bufs[1], r_v, r_v_view, t_s_p_a, r_p,
                                       r_p_view, s_p, s_valid_all, s_max, acc_o, row_max,
                                       row_sum, c_s_mn, scale_log2, tiled_mma, thr_mma, copy_bt,
                                       warp_n, lane, tidx)
            else:
                self.compute_block(0, t_s_q_a, r_q, r_q_view, t_s_k_b[0], r_k, r_k_view,
                                   s_vt_bufs[0], r_v, r_v_view, t_s_p_a, r_p, r_p_view, s_p,
                                   s_valid_all, s_max, acc_o, row_max, row_sum, c_s_mn,
                                   scale_log2, tiled_mma, thr_mma, copy_bt, warp_n, lane, tidx)
            cute.arch.barrier()  # every warp is done with this buffer, s_p and s_max
            if cutlass.const_expr(self.kv_stages == 1):
                if b + 1 < n_blocks:
                    self.gather(idx0, idx1, s_kv, t_g_kv, row_stride, t_s_kv[0], s_valid_all, 0,
                                gmem_copy, row_in_pass, tidx)
                cute.arch.cp_async_commit_group()
                idx0, idx1 = self.load_idx(b + 2, t, m_idx, n_valid, row_in_pass)

        # ---- epilogue ------------------------------------------------------------------------
        cute.arch.cp_async_wait_group(0)
        for r in cutlass.range_constexpr(rows_per_thread):
            total = quad_sum(row_sum[r])
            if lane % 4 == 0:
                s_sum[warp_n * BLOCK_H + c_s_mn[r, 0][0]] = total
        cute.arch.barrier()
        for r in cutlass.range_constexpr(rows_per_thread):
            row = c_s_mn[r, 0][0]
            head = hb * BLOCK_H + row
            lse_val, factor = row_lse_and_factor(row_max[r], s_sum[row] + s_sum[BLOCK_H + row],
                                                 head, heads, m_sink)
            for c in cutlass.range_constexpr(n_chunks):
                acc_mn = acc_rows_cols(acc_o[c])
                acc_mn[r, None] = acc_mn[r, None].load() * factor
            if (warp_n == 0) & (lane % 4 == 0) & (head < heads):
                m_lse[t, head] = lse_val
        g_out = cute.local_tile(m_out[t, None, None], (BLOCK_H, D_V), (hb, 0))
        for c in cutlass.range_constexpr(n_chunks):
            g_chunk = cute.local_tile(g_out, (BLOCK_H, BLOCK_N), (0, c))
            t_g = thr_mma.partition_C(g_chunk)
            r_o = cute.make_fragment_like(acc_o[c], BFloat16)
            r_o.store(acc_o[c].load().to(BFloat16))
            for i in cutlass.range_constexpr(cute.size(r_o)):
                if cutlass.const_expr(heads >= BLOCK_H):
                    t_g[i] = r_o[i]
                else:
                    if c_s[i][0] < heads:
                        t_g[i] = r_o[i]

    @cute.jit
    def load_idx(self, block: Int32, t: Int32, m_idx: cute.Tensor, n_valid: Int32,
                 row_in_pass: Int32) -> tuple[Int32, Int32]:
        """This thread's two KV indices of block ``block`` (-1 past the valid slots).

        Loaded one block ahead of :meth:`gather`, so the copies never wait on this load.
        """
        slot = block * BLOCK_N + row_in_pass
        idx0 = Int32(-1)
        idx1 = Int32(-1)
        if slot < n_valid:
            idx0 = m_idx[t, slot]
        if slot + ROWS_PER_PASS < n_valid:
            idx1 = m_idx[t, slot + ROWS_PER_PASS]
        return idx0, idx1

    @cute.jit
    def gather(self, idx0: Int32, idx1: Int32, s_kv: Int32, t_g_kv: cute.Tensor,
               row_stride: cutlass.Int64, t_s_kv: cute.Tensor, s_valid_all: cute.Tensor,
               valid_base: Int32, gmem_copy: cute.TiledCopy, row_in_pass: Int32,
               tidx: Int32) -> None:
        """Issue the ``cp.async`` copies of one block's gathered rows (no commit).

        An index outside ``[0, s_kv)`` is never dereferenced: its shared row is zero-filled and
        its validity flag cleared.
        """
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
    def compute_block(self, valid_base: cutlass.Constexpr, t_s_q_a: cute.Tensor, r_q: cute.Tensor,
                      r_q_view: cute.Tensor, t_s_k_b: cute.Tensor, r_k: cute.Tensor,
                      r_k_view: cute.Tensor, s_vt: cute.Tensor, r_v: cute.Tensor,
                      r_v_view: cute.Tensor, t_s_p_a: cute.Tensor, r_p: cute.Tensor,
                      r_p_view: cute.Tensor, s_p: cute.Tensor, s_valid_all: cute.Tensor,
                      s_max: cute.Tensor, acc_o: list, row_max: cute.Tensor,
                      row_sum: cute.Tensor, c_s_mn: cute.Tensor, scale_log2: Float32,
                      tiled_mma: cute.TiledMma, thr_mma: cute.core.ThrMma,
                      copy_bt: cute.TiledCopy, warp_n: Int32, lane: Int32,
                      tidx: Int32) -> None:
        """Scores, online softmax and ``O += P V`` for the block in the given buffer."""
        acc_s = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK_H, BLOCK_N)), Float32)
        acc_s.fill(0.0)
        for k in cutlass.range_constexpr(self.d_qk // 16):
            cute.copy(_ldsm_a(tiled_mma), t_s_q_a[None, None, k], r_q_view[None, None, 0])
            cute.copy(_ldsm_b(tiled_mma), t_s_k_b[None, None, k], r_k_view[None, None, 0])
            cute.gemm(tiled_mma, acc_s, r_q[None, None, 0], r_k[None, None, 0], acc_s)

        acc_s_mn = acc_rows_cols(acc_s)
        rows = cute.size(acc_s_mn, mode=[0])
        cols = cute.size(acc_s_mn, mode=[1])
        # mask invalid slots to -inf (before any exp), scale into base-2 units, partial max
        for r in cutlass.range_constexpr(rows):
            part = Float32(-_INF)
            for j in cutlass.range_constexpr(cols):
                col = c_s_mn[r, j][1]
                val = acc_s_mn[r, j] * scale_log2
                if s_valid_all[valid_base + col] == 0:
                    val = Float32(-_INF)
                acc_s_mn[r, j] = val
                part = cute.arch.fmax(part, val)
            part = quad_max(part)
            if lane % 4 == 0:
                s_max[warp_n * BLOCK_H + c_s_mn[r, 0][0]] = part
        cute.arch.barrier()
        for r in cutlass.range_constexpr(rows):
            row = c_s_mn[r, 0][0]
            m_blk = cute.arch.fmax(s_max[row], s_max[BLOCK_H + row])
            m_old = row_max[r]
            m_new = cute.arch.fmax(m_old, m_blk)
            corr = cute.math.exp2(m_old - m_new, fastmath=True)
            psum = Float32(0.0)
            for j in cutlass.range_constexpr(cols):
                p = cute.math.exp2(acc_s_mn[r, j] - m_new, fastmath=True)
                acc_s_mn[r, j] = p
                psum = psum + p
            row_sum[r] = row_sum[r] * corr + psum
            row_max[r] = m_new
            for c in cutlass.range_constexpr(len(acc_o)):
                acc_mn = acc_rows_cols(acc_o[c])
                acc_mn[r, None] = acc_mn[r, None].load() * corr
        # P (bf16) -> shared memory, then the A operand of P V
        r_pc = cute.make_fragment_like(acc_s, BFloat16)
        r_pc.store(acc_s.load().to(BFloat16))
        store_p = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                             BFloat16), tiled_mma)
        thr_store_p = store_p.get_slice(tidx)
        cute.copy(store_p, thr_store_p.retile(r_pc), thr_store_p.partition_D(s_p))
        cute.arch.barrier()
        cute.copy(_ldsm_a(tiled_mma), t_s_p_a, r_p_view)
        for c in cutlass.range_constexpr(len(acc_o)):
            s_vt_c = cute.local_tile(s_vt, (BLOCK_N, BLOCK_N), (c, 0))
            t_s_vt = copy_bt.partition_S(s_vt_c)  # (CPY, N, 4)
            for k in cutlass.range_constexpr(BLOCK_N // 16):
                cute.copy(_ldsm_bt(tiled_mma), t_s_vt[None, None, k], r_v_view[None, None, 0])
                cute.gemm(tiled_mma, acc_o[c], r_p[None, None, k], r_v[None, None, 0], acc_o[c])


    # ---------------------------------------------------------------------------------------
    # sm_90a: warpgroup MMA from shared memory
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def launch_wgmma(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor,
                     topk_length: cute.Tensor, attn_sink: cute.Tensor, out: cute.Tensor,
                     lse: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream) -> None:
        d = self.d_qk
        stages = self.kv_stages
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128,
                                                  BFloat16)
        # Q and each KV tile: K-major 128-byte swizzled (8 x 64 atoms, rows first); V^T is the
        # same bytes read MN-major: (512 value columns, 64 KV rows), KV rows first.
        s_q_layout = cute.tile_to_shape(k_atom, (BLOCK_H, d), (0, 1))
        s_kv_layout = cute.tile_to_shape(k_atom, (BLOCK_N, d, stages), (0, 1, 2))
        v_tile = cute.tile_to_shape(mn_atom, (D_V, BLOCK_N), (1, 0))
        s_v_layout = cute.make_composed_layout(
            v_tile.inner, 0, cute.make_layout(
                (v_tile.outer.shape[0], v_tile.outer.shape[1], stages),
                stride=(v_tile.outer.stride[0], v_tile.outer.stride[1], BLOCK_N * d)))
        s_p_layout = cute.tile_to_shape(k_atom, (BLOCK_H, BLOCK_N), (0, 1))

        @cute.struct
        class SharedStorage:
            s_q: cute.struct.Align[cute.struct.MemRange[BFloat16,
                                                         cute.cosize(s_q_layout.outer)], 1024]
            s_kv: cute.struct.Align[cute.struct.MemRange[
                BFloat16, cute.cosize(s_kv_layout.outer)], 1024]
            s_p: cute.struct.Align[cute.struct.MemRange[BFloat16,
                                                         cute.cosize(s_p_layout.outer)], 1024]
            s_max: cute.struct.Align[cute.struct.MemRange[Float32, WARPS_N * BLOCK_H], 16]
            s_sum: cute.struct.Align[cute.struct.MemRange[Float32, WARPS_N * BLOCK_H], 16]
            s_valid: cute.struct.Align[cute.struct.MemRange[Int32, BLOCK_N * stages], 16]

        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=128)
        cols = 64 // VEC
        gmem_copy = cute.make_tiled_copy_tv(
            g2s, cute.make_layout((THREADS // cols, cols), stride=(cols, 1)),
            cute.make_layout((1, VEC)))
        # two warpgroups side by side along N: S is 64 x (2 x 32), O is 64 x (2 x 256)
        mma_s = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (1, WARPS_N, 1), (BLOCK_H, BLOCK_N // WARPS_N))
        mma_o = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (1, WARPS_N, 1), (BLOCK_H, D_V // WARPS_N))
        s_q = cute.size(q, mode=[0])
        if s_q > 0:
            self.kernel_wgmma(q, kv, topk_idxs, topk_length, attn_sink, out, lse,
                              softmax_scale * Float32(LOG2E), s_q_layout, s_kv_layout, s_v_layout,
                              s_p_layout, gmem_copy, mma_s, mma_o, SharedStorage).launch(
                grid=[s_q, (self.heads + BLOCK_H - 1) // BLOCK_H, 1], block=[THREADS, 1, 1],
                smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel_wgmma(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_idx: cute.Tensor,
                     m_len: cute.Tensor, m_sink: cute.Tensor, m_out: cute.Tensor,
                     m_lse: cute.Tensor, scale_log2: Float32, s_q_layout: cute.ComposedLayout,
                     s_kv_layout: cute.ComposedLayout, s_v_layout: cute.ComposedLayout,
                     s_p_layout: cute.ComposedLayout, gmem_copy: cute.TiledCopy,
                     mma_s: cute.TiledMma, mma_o: cute.TiledMma,
                     SharedStorage: cutlass.Constexpr) -> None:
        d = self.d_qk
        heads = self.heads
        mma_s.set(warpgroup.Field.ACCUMULATE, True)  # accumulators are zero-filled instead
        mma_o.set(warpgroup.Field.ACCUMULATE, True)
        tidx, _, _ = cute.arch.thread_idx()
        t, hb, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        lane = cute.arch.lane_idx()
        s_kv = cute.size(m_kv, mode=[0])
        topk = cute.size(m_idx, mode=[1])
        n_valid = topk
        if cutlass.const_expr(self.compact):
            n_valid = cutlass.max(cutlass.min(m_len[t], topk), Int32(0))
        n_blocks = (n_valid + BLOCK_N - 1) // BLOCK_N

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        s_q = storage.s_q.get_tensor(s_q_layout.outer, swizzle=s_q_layout.inner)
        s_p = storage.s_p.get_tensor(s_p_layout.outer, swizzle=s_p_layout.inner)
        s_kv_all = storage.s_kv.get_tensor(s_kv_layout.outer, swizzle=s_kv_layout.inner)
        s_v_all = cute.make_tensor(s_kv_all.iterator, s_v_layout.outer)  # same swizzled bytes
        s_max = storage.s_max.get_tensor(cute.make_layout(WARPS_N * BLOCK_H))
        s_sum = storage.s_sum.get_tensor(cute.make_layout(WARPS_N * BLOCK_H))
        s_valid_all = storage.s_valid.get_tensor(cute.make_layout(BLOCK_N * self.kv_stages))

        thr_copy = gmem_copy.get_slice(tidx)
        row_in_pass = tidx // (64 // VEC)
        g_q = cute.local_tile(m_q[t, None, None], (BLOCK_H, d), (hb, 0))
        t_g_q = thr_copy.partition_S(g_q)
        t_s_q = thr_copy.partition_D(s_q)
        for m in cutlass.range_constexpr(cute.size(t_s_q, mode=[1])):
            row = row_in_pass + m * (THREADS // (64 // VEC))
            if cutlass.const_expr(heads >= BLOCK_H):
                cute.copy(gmem_copy, t_g_q[None, m, None], t_s_q[None, m, None])
            else:
                if row < heads:
                    cute.copy(gmem_copy, t_g_q[None, m, None], t_s_q[None, m, None])
                else:
                    t_s_q[None, m, None].fill(0)
        t_g_kv = thr_copy.partition_S(cute.local_tile(m_kv, (BLOCK_N, d), (0, 0)))
        row_stride = m_kv.stride[0]
        t_s_kv = thr_copy.partition_D(s_kv_all)  # (CPY, 2, D/64, stages)

        # ---- warpgroup MMA partitions (descriptors over shared memory) ---------------------
        wg_s = mma_s.get_slice(wg * 128)
        wg_o = mma_o.get_slice(wg * 128)
        r_q = mma_s.make_fragment_A(wg_s.partition_A(s_q))           # (MMA, 1, D/16)
        r_k = mma_s.make_fragment_B(wg_s.partition_B(s_kv_all))      # (MMA, 1, D/16, stages)
        r_p = mma_o.make_fragment_A(wg_o.partition_A(s_p))           # (MMA, 1, 4)
        r_v = mma_o.make_fragment_B(wg_o.partition_B(s_v_all))       # (MMA, 1, 4, stages)
        thr_s = mma_s.get_slice(tidx)
        thr_o = mma_o.get_slice(tidx)
        acc_o = cute.make_rmem_tensor(thr_o.partition_shape_C((BLOCK_H, D_V)), Float32)
        acc_o.fill(0.0)
        c_s = thr_s.partition_C(cute.make_identity_tensor((BLOCK_H, BLOCK_N)))
        c_s_mn = wg_rows_cols(c_s)
        c_o = thr_o.partition_C(cute.make_identity_tensor((BLOCK_H, D_V)))
        rows_per_thread = cute.size(c_s_mn, mode=[0])
        row_max = cute.make_rmem_tensor(rows_per_thread, Float32)
        row_sum = cute.make_rmem_tensor(rows_per_thread, Float32)
        row_max.fill(M_FLOOR)
        row_sum.fill(0.0)

        idx0, idx1 = self.load_idx(0, t, m_idx, n_valid, row_in_pass)
        if n_blocks > 0:
            self.gather(idx0, idx1, s_kv, t_g_kv, row_stride, t_s_kv[None, None, None, 0],
                        s_valid_all, Int32(0), gmem_copy, row_in_pass, tidx)
        cute.arch.cp_async_commit_group()
        idx0, idx1 = self.load_idx(1, t, m_idx, n_valid, row_in_pass)
        pipelined = self.impl == "wgmma_pipe"

        for b in cutlass.range(n_blocks, unroll=1):
            stage = b % self.kv_stages
            nxt = (b + 1) % self.kv_stages
            if cutlass.const_expr(self.kv_stages == 2 and not pipelined):
                if b + 1 < n_blocks:  # into the other buffer, freed by the previous block's end
                    self.gather(idx0, idx1, s_kv, t_g_kv, row_stride,
                                t_s_kv[None, None, None, nxt], s_valid_all, nxt * BLOCK_N,
                                gmem_copy, row_in_pass, tidx)
                cute.arch.cp_async_commit_group()
                idx0, idx1 = self.load_idx(b + 2, t, m_idx, n_valid, row_in_pass)
                cute.arch.cp_async_wait_group(1)
            else:
                cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()  # cp.async / zero-fill writes -> wgmma reads
            cute.arch.barrier()
            if cutlass.const_expr(pipelined):
                # the previous block's P V is still in flight: its wait comes with this block's
                # scores, and the next gather starts once both warpgroups are past that wait
                self.compute_block_wgmma(stage, r_q, r_k, r_p, r_v, s_p, s_valid_all, s_max,
                                         acc_o, row_max, row_sum, c_s_mn, scale_log2, mma_s,
                                         mma_o, thr_s, wg, lane, tidx, b, n_blocks, idx0, idx1,
                                         s_kv, t_g_kv, row_stride, t_s_kv, gmem_copy,
                                         row_in_pass)
                idx0, idx1 = self.load_idx(b + 2, t, m_idx, n_valid, row_in_pass)
            else:
                self.compute_block_wgmma(stage, r_q, r_k, r_p, r_v, s_p, s_valid_all, s_max,
                                         acc_o, row_max, row_sum, c_s_mn, scale_log2, mma_s,
                                         mma_o, thr_s, wg, lane, tidx, b, n_blocks, idx0, idx1,
                                         s_kv, t_g_kv, row_stride, t_s_kv, gmem_copy,
                                         row_in_pass)
                cute.arch.barrier()  # both warpgroups are done with this buffer, s_p and s_max
                if cutlass.const_expr(self.kv_stages == 1):
                    if b + 1 < n_blocks:
                        self.gather(idx0, idx1, s_kv, t_g_kv, row_stride,
                                    t_s_kv[None, None, None, 0], s_valid_all, Int32(0),
                                    gmem_copy, row_in_pass, tidx)
                    cute.arch.cp_async_commit_group()
                    idx0, idx1 = self.load_idx(b + 2, t, m_idx, n_valid, row_in_pass)
        if cutlass.const_expr(pipelined):
            warpgroup.wait_group(0)

        # ---- epilogue ------------------------------------------------------------------------
        cute.arch.cp_async_wait_group(0)
        for r in cutlass.range_constexpr(rows_per_thread):
            total = quad_sum(row_sum[r])
            if lane % 4 == 0:
                s_sum[wg * BLOCK_H + c_s_mn[r, 0][0]] = total
        cute.arch.barrier()
        acc_o_mn = wg_rows_cols(acc_o)
        for r in cutlass.range_constexpr(rows_per_thread):
            row = c_s_mn[r, 0][0]
            head = hb * BLOCK_H + row
            lse_val, factor = row_lse_and_factor(row_max[r], s_sum[row] + s_sum[BLOCK_H + row],
                                                 head, heads, m_sink)
            acc_o_mn[r, None] = acc_o_mn[r, None].load() * factor
            if (wg == 0) & (lane % 4 == 0) & (head < heads):
                m_lse[t, head] = lse_val
        g_out = cute.local_tile(m_out[t, None, None], (BLOCK_H, D_V), (hb, 0))
        t_g = thr_o.partition_C(g_out)
        r_o = cute.make_fragment_like(acc_o, BFloat16)
        r_o.store(acc_o.load().to(BFloat16))
        for i in cutlass.range_constexpr(cute.size(r_o)):
            if cutlass.const_expr(heads >= BLOCK_H):
                t_g[i] = r_o[i]
            else:
                if c_o[i][0] < heads:
                    t_g[i] = r_o[i]

    @cute.jit
    def compute_block_wgmma(self, stage: Int32, r_q: cute.Tensor,
                            r_k: cute.Tensor, r_p: cute.Tensor, r_v: cute.Tensor,
                            s_p: cute.Tensor, s_valid_all: cute.Tensor, s_max: cute.Tensor,
                            acc_o: cute.Tensor, row_max: cute.Tensor,
                            row_sum: cute.Tensor, c_s_mn: cute.Tensor, scale_log2: Float32,
                            mma_s: cute.TiledMma, mma_o: cute.TiledMma, thr_s: cute.core.ThrMma,
                            wg: Int32, lane: Int32, tidx: Int32, b: Int32, n_blocks: Int32,
                            idx0: Int32, idx1: Int32, s_kv: Int32, t_g_kv: cute.Tensor,
                            row_stride: cutlass.Int64, t_s_kv: cute.Tensor,
                            gmem_copy: cute.TiledCopy, row_in_pass: Int32) -> None:
        """Scores (this warpgroup's 32 columns), online softmax and ``O += P V``.

        ``wgmma_pipe``: ``P V`` is left in flight (waited with the next block's scores) and
        block ``b + 1`` is gathered here, after the barrier that follows every warpgroup's wait.
        """
        pipelined = self.impl == "wgmma_pipe"
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((BLOCK_H, BLOCK_N)), Float32)
        acc_s.fill(0.0)
        warpgroup.fence()
        for k in cutlass.range_constexpr(self.d_qk // 16):
            cute.gemm(mma_s, acc_s, r_q[None, None, k], r_k[None, None, k, stage], acc_s)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        acc_s_mn = wg_rows_cols(acc_s)
        rows = cute.size(acc_s_mn, mode=[0])
        cols = cute.size(acc_s_mn, mode=[1])
        for r in cutlass.range_constexpr(rows):
            part = Float32(-_INF)
            for j in cutlass.range_constexpr(cols):
                col = c_s_mn[r, j][1]
                val = acc_s_mn[r, j] * scale_log2
                if s_valid_all[stage * BLOCK_N + col] == 0:
                    val = Float32(-_INF)
                acc_s_mn[r, j] = val
                part = cute.arch.fmax(part, val)
            part = quad_max(part)
            if lane % 4 == 0:
                s_max[wg * BLOCK_H + c_s_mn[r, 0][0]] = part
        cute.arch.barrier()
        if cutlass.const_expr(pipelined):
            nxt = (b + 1) % 2
            if b + 1 < n_blocks:
                self.gather(idx0, idx1, s_kv, t_g_kv, row_stride, t_s_kv[None, None, None, nxt],
                            s_valid_all, nxt * BLOCK_N, gmem_copy, row_in_pass, tidx)
            cute.arch.cp_async_commit_group()
        acc_o_mn = wg_rows_cols(acc_o)
        for r in cutlass.range_constexpr(rows):
            row = c_s_mn[r, 0][0]
            m_blk = cute.arch.fmax(s_max[row], s_max[BLOCK_H + row])
            m_old = row_max[r]
            m_new = cute.arch.fmax(m_old, m_blk)
            corr = cute.math.exp2(m_old - m_new, fastmath=True)
            psum = Float32(0.0)
            for j in cutlass.range_constexpr(cols):
                p = cute.math.exp2(acc_s_mn[r, j] - m_new, fastmath=True)
                acc_s_mn[r, j] = p
                psum = psum + p
            row_sum[r] = row_sum[r] * corr + psum
            row_max[r] = m_new
            acc_o_mn[r, None] = acc_o_mn[r, None].load() * corr
        r_pc = cute.make_fragment_like(acc_s, BFloat16)
        r_pc.store(acc_s.load().to(BFloat16))
        store_p = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                             BFloat16), mma_s)
        thr_store_p = store_p.get_slice(tidx)
        cute.copy(store_p, thr_store_p.retile(r_pc), thr_store_p.partition_D(s_p))
        cute.arch.fence_view_async_shared()  # P stores -> wgmma reads
        cute.arch.barrier()
        warpgroup.fence()
        for k in cutlass.range_constexpr(BLOCK_N // 16):
            cute.gemm(mma_o, acc_o, r_p[None, None, k], r_v[None, None, k, stage], acc_o)
        warpgroup.commit_group()
        if cutlass.const_expr(not pipelined):
            warpgroup.wait_group(0)

    # ---------------------------------------------------------------------------------------
    # sm_90a: warp-specialised (producer warpgroup + two consumer warpgroups, mbarriers)
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def launch_ws(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor,
                  topk_length: cute.Tensor, attn_sink: cute.Tensor, out: cute.Tensor,
                  lse: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream) -> None:
        d = self.d_qk
        bn = self.ws_block_n
        stages = self.ws_stages
        half = D_V // 2
        s_q_layout, s_kv_layout, s_v_layout, s_p_layout = ws_smem_layouts(d, bn, stages)

        @cute.struct
        class SharedStorage:
            s_q: cute.struct.Align[cute.struct.MemRange[BFloat16,
                                                         cute.cosize(s_q_layout.outer)], 1024]
            s_kv: cute.struct.Align[cute.struct.MemRange[
                BFloat16, cute.cosize(s_kv_layout.outer)], 1024]
            s_p: cute.struct.Align[cute.struct.MemRange[BFloat16,
                                                         cute.cosize(s_p_layout.outer)], 1024]
            s_alpha: cute.struct.Align[cute.struct.MemRange[Float32, BLOCK_H], 16]
            s_fac: cute.struct.Align[cute.struct.MemRange[Float32, BLOCK_H], 16]
            s_valid: cute.struct.Align[cute.struct.MemRange[Int32, bn * stages], 16]
            # full[stages], empty[stages], p_full, p_free
            mbar: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 2 * stages + 2], 8]

        q_copy, kv_copy = ws_copies()
        mma_s = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (1, 1, 1), (BLOCK_H, bn))
        mma_o = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (BLOCK_H, half))
        s_q = cute.size(q, mode=[0])
        if s_q > 0:
            self.kernel_ws(q, kv, topk_idxs, topk_length, attn_sink, out, lse,
                           softmax_scale * Float32(LOG2E), s_q_layout, s_kv_layout, s_v_layout,
                           s_p_layout, q_copy, kv_copy, mma_s, mma_o, SharedStorage).launch(
                grid=[s_q, (self.heads + BLOCK_H - 1) // BLOCK_H, 1],
                block=[WS_THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel_ws(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_idx: cute.Tensor,
                  m_len: cute.Tensor, m_sink: cute.Tensor, m_out: cute.Tensor,
                  m_lse: cute.Tensor, scale_log2: Float32, s_q_layout: cute.ComposedLayout,
                  s_kv_layout: cute.ComposedLayout, s_v_layout: cute.ComposedLayout,
                  s_p_layout: cute.ComposedLayout, q_copy: cute.TiledCopy,
                  kv_copy: cute.TiledCopy, mma_s: cute.TiledMma, mma_o: cute.TiledMma,
                  SharedStorage: cutlass.Constexpr) -> None:
        d = self.d_qk
        heads = self.heads
        bn = self.ws_block_n
        stages = self.ws_stages
        half = D_V // 2
        mma_s.set(warpgroup.Field.ACCUMULATE, True)  # accumulators are zero-filled instead
        mma_o.set(warpgroup.Field.ACCUMULATE, True)
        tidx, _, _ = cute.arch.thread_idx()
        t, hb, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        wtid = tidx % WG_THREADS
        lane = cute.arch.lane_idx()
        s_kv = cute.size(m_kv, mode=[0])
        topk = cute.size(m_idx, mode=[1])
        n_valid = topk
        if cutlass.const_expr(self.compact):
            n_valid = cutlass.max(cutlass.min(m_len[t], topk), Int32(0))
        n_blocks = (n_valid + bn - 1) // bn

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        s_q = storage.s_q.get_tensor(s_q_layout.outer, swizzle=s_q_layout.inner)
        s_p = storage.s_p.get_tensor(s_p_layout.outer, swizzle=s_p_layout.inner)
        s_kv_all = storage.s_kv.get_tensor(s_kv_layout.outer, swizzle=s_kv_layout.inner)
        s_alpha = storage.s_alpha.get_tensor(cute.make_layout(BLOCK_H))
        s_fac = storage.s_fac.get_tensor(cute.make_layout(BLOCK_H))
        s_valid_all = storage.s_valid.get_tensor(cute.make_layout(bn * stages))
        mbar = storage.mbar.data_ptr()
        full_bar = mbar
        empty_bar = mbar + stages
        p_full_bar = mbar + 2 * stages
        p_free_bar = mbar + 2 * stages + 1

        if tidx == 0:
            for s in cutlass.range_constexpr(stages):
                # 128 cp.async arrivals (noinc) + 128 plain arrivals of the producer
                cute.arch.mbarrier_init(full_bar + s, 2 * WG_THREADS)
                cute.arch.mbarrier_init(empty_bar + s, 2 * WG_THREADS)
            cute.arch.mbarrier_init(p_full_bar, WG_THREADS)
            cute.arch.mbarrier_init(p_free_bar, WG_THREADS)
        cute.arch.mbarrier_init_fence()

        if tidx < THREADS:
            load_q_tile(m_q, s_q, q_copy, t, hb, tidx, d, heads)
        cute.arch.barrier()

        if wg == 2:
            # ---- producer: gathered rows by cp.async, completion tracked by full[stage] ----
            cute.arch.setmaxregister_decrease(WS_PRODUCER_REGS)
            thr_kv = kv_copy.get_slice(wtid)
            p_row = wtid // (64 // VEC)
            t_g_kv = thr_kv.partition_S(cute.local_tile(m_kv, (bn, d), (0, 0)))
            t_s_kv = thr_kv.partition_D(s_kv_all)  # (CPY, 4, D/64, stages)
            row_stride = m_kv.stride[0]
            for b in cutlass.range(n_blocks, unroll=1):
                stage = b % stages
                idx = self.load_idx_ws(b, t, m_idx, n_valid, p_row)  # in flight during the wait
                cute.arch.mbarrier_wait(empty_bar + stage, ((b // stages) % 2) ^ 1)
                gather_rows(kv_copy, t_g_kv, t_s_kv, stage, idx, p_row, s_kv, row_stride,
                            0, d // 64, s_valid_all, stage * bn, wtid, True, bn)
                cute.arch.cp_async_mbarrier_arrive_noinc(full_bar + stage)
                cute.arch.mbarrier_arrive(full_bar + stage)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
        else:
            s_v_all = cute.make_tensor(s_kv_all.iterator + wg * (half * bn),
                                       s_v_layout.outer)
            wg_o = mma_o.get_slice(0)
            r_p = mma_o.make_fragment_A(wg_o.partition_A(s_p))          # (MMA, 1, 4)
            r_v = mma_o.make_fragment_B(wg_o.partition_B(s_v_all))      # (MMA, 1, 4, stages)
            thr_o = mma_o.get_slice(wtid)
            acc_o = cute.make_rmem_tensor(thr_o.partition_shape_C((BLOCK_H, half)), Float32)
            acc_o.fill(0.0)
            c_o = thr_o.partition_C(cute.make_identity_tensor((BLOCK_H, half)))
            c_o_mn = wg_rows_cols(c_o)
            acc_o_mn = wg_rows_cols(acc_o)
            rows = cute.size(c_o_mn, mode=[0])
            if wg == 0:
                # ---- scores (all 64 columns), online softmax, left half of P V, lse --------
                cute.arch.setmaxregister_increase(WS_SOFTMAX_REGS)
                wg_s = mma_s.get_slice(0)
                r_q = mma_s.make_fragment_A(wg_s.partition_A(s_q))       # (MMA, 1, D/16)
                r_k = mma_s.make_fragment_B(wg_s.partition_B(s_kv_all))  # (MMA, 1, D/16, st)
                thr_s = mma_s.get_slice(wtid)
                c_s_mn = wg_rows_cols(thr_s.partition_C(cute.make_identity_tensor((BLOCK_H,
                                                                                  bn))))
                row_max = cute.make_rmem_tensor(rows, Float32)
                row_sum = cute.make_rmem_tensor(rows, Float32)
                row_max.fill(M_FLOOR)
                row_sum.fill(0.0)
                store_p = cute.make_tiled_copy_C(
                    cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16), mma_s)
                thr_store_p = store_p.get_slice(wtid)
                t_s_p = thr_store_p.partition_D(s_p)
                for b in cutlass.range(n_blocks, unroll=1):
                    stage = b % stages
                    cute.arch.mbarrier_wait(full_bar + stage, (b // stages) % 2)
                    cute.arch.fence_view_async_shared()  # gathered rows -> wgmma reads
                    acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((BLOCK_H, bn)),
                                                  Float32)
                    acc_s.fill(0.0)
                    warpgroup.fence()
                    for k in cutlass.range_constexpr(d // 16):
                        cute.gemm(mma_s, acc_s, r_q[None, None, k], r_k[None, None, k, stage],
                                  acc_s)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    acc_s_mn = wg_rows_cols(acc_s)
                    cols = cute.size(acc_s_mn, mode=[1])
                    alpha = cute.make_rmem_tensor(rows, Float32)
                    for r in cutlass.range_constexpr(rows):
                        m_blk = Float32(-_INF)
                        for j in cutlass.range_constexpr(cols):
                            val = acc_s_mn[r, j] * scale_log2
                            if s_valid_all[stage * bn + c_s_mn[r, j][1]] == 0:
                                val = Float32(-_INF)
                            acc_s_mn[r, j] = val
                            m_blk = cute.arch.fmax(m_blk, val)
                        m_blk = quad_max(m_blk)
                        m_old = row_max[r]
                        m_new = cute.arch.fmax(m_old, m_blk)
                        corr = cute.math.exp2(m_old - m_new, fastmath=True)
                        psum = Float32(0.0)
                        for j in cutlass.range_constexpr(cols):
                            p = cute.math.exp2(acc_s_mn[r, j] - m_new, fastmath=True)
                            acc_s_mn[r, j] = p
                            psum = psum + p
                        row_sum[r] = row_sum[r] * corr + psum
                        row_max[r] = m_new
                        alpha[r] = corr
                        acc_o_mn[r, None] = acc_o_mn[r, None].load() * corr
                    r_pc = cute.make_fragment_like(acc_s, BFloat16)
                    r_pc.store(acc_s.load().to(BFloat16))
                    if b > 0:  # the right half has consumed the previous P and alpha
                        cute.arch.mbarrier_wait(p_free_bar, (b - 1) % 2)
                    cute.copy(store_p, thr_store_p.retile(r_pc), t_s_p)
                    if lane % 4 == 0:
                        for r in cutlass.range_constexpr(rows):
                            s_alpha[c_s_mn[r, 0][0]] = alpha[r]
                    cute.arch.fence_view_async_shared()  # P stores -> wgmma reads
                    cute.arch.mbarrier_arrive(p_full_bar)
                    warpgroup.fence()
                    for k in cutlass.range_constexpr(bn // 16):
                        cute.gemm(mma_o, acc_o, r_p[None, None, k], r_v[None, None, k, stage],
                                  acc_o)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    cute.arch.mbarrier_arrive(empty_bar + stage)
                # lse and the per-row output factor (shared with the right half)
                for r in cutlass.range_constexpr(rows):
                    row = c_o_mn[r, 0][0]
                    head = hb * BLOCK_H + row
                    lse_val, factor = row_lse_and_factor(row_max[r], quad_sum(row_sum[r]), head,
                                                         heads, m_sink)
                    if lane % 4 == 0:
                        s_fac[row] = factor
                        if head < heads:
                            m_lse[t, head] = lse_val
            else:
                # ---- right half of P V, rescaled by the softmax's alpha --------------------
                for b in cutlass.range(n_blocks, unroll=1):
                    stage = b % stages
                    cute.arch.mbarrier_wait(full_bar + stage, (b // stages) % 2)
                    cute.arch.mbarrier_wait(p_full_bar, b % 2)
                    cute.arch.fence_view_async_shared()
                    for r in cutlass.range_constexpr(rows):
                        acc_o_mn[r, None] = acc_o_mn[r, None].load() * s_alpha[c_o_mn[r, 0][0]]
                    warpgroup.fence()
                    for k in cutlass.range_constexpr(bn // 16):
                        cute.gemm(mma_o, acc_o, r_p[None, None, k], r_v[None, None, k, stage],
                                  acc_o)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    cute.arch.mbarrier_arrive(p_free_bar)
                    cute.arch.mbarrier_arrive(empty_bar + stage)
            # ---- epilogue: both halves scaled by the factor, stored as bf16 ----------------
            cute.arch.barrier(barrier_id=WS_EPILOGUE_BARRIER, number_of_threads=THREADS)
            for r in cutlass.range_constexpr(rows):
                acc_o_mn[r, None] = acc_o_mn[r, None].load() * s_fac[c_o_mn[r, 0][0]]
            store_out_half(acc_o, c_o, thr_o, m_out, t, hb, wg, heads)

    @cute.jit
    def load_idx_ws(self, block: Int32, t: Int32, m_idx: cute.Tensor, n_valid: Int32,
                    p_row: Int32) -> list:
        """The producer thread's KV indices of block ``block``, one per pass (-1 past the end)."""
        return producer_idx(block, t, m_idx, n_valid, p_row, self.ws_block_n)


def _ldsm_a(tiled_mma: cute.TiledMma) -> cute.TiledCopy:
    return cute.make_tiled_copy_A(
        cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16),
        tiled_mma)


def _ldsm_b(tiled_mma: cute.TiledMma) -> cute.TiledCopy:
    return cute.make_tiled_copy_B(
        cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16),
        tiled_mma)


def _ldsm_bt(tiled_mma: cute.TiledMma) -> cute.TiledCopy:
    return cute.make_tiled_copy_B(
        cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), BFloat16),
        tiled_mma)


class SparseMlaFwdCompact(SparseMlaFwd):
    """Entry point of the compact layout (``topk_length`` given)."""

    @cute.jit
    def __call__(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor,
                 topk_length: cute.Tensor, attn_sink: cute.Tensor, out: cute.Tensor,
                 lse: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream) -> None:
        self.launch(q, kv, topk_idxs, topk_length, attn_sink, out, lse, softmax_scale, stream)


class SparseMlaFwdNoncompact(SparseMlaFwd):
    """Entry point of the noncompact layout (padding marked by out-of-range indices)."""

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
    """The MMA flavour an arch gets by default (the wgmma flavours need sm_90a)."""
    return "wgmma_ws" if arch == "sm_90a" else "mma"


def default_kv_stages(impl: str) -> int:
    """KV tiles in flight by default: one for mma (fewer registers, faster on the H200)."""
    return 1 if impl == "mma" else 2


def compile_fwd(arch: str, d_qk: int, heads: int, layout: str, kv_stages: int | None = None,
                impl: str | None = None, extra_options: str = "") -> tuple[object, dict[str, object]]:
    """``cute.compile`` the forward for ``arch`` (``CUTE_DSL_ARCH=<arch>`` set before import).

    ``impl=None`` takes :func:`default_impl`, ``kv_stages=None`` :func:`default_kv_stages`.
    ``impl="wgmma_split"`` compiles :class:`~dsa_aot.kernels.cutedsl_fwd_split.SparseMlaFwdSplit`.
    Returns the compiled function and the fake arguments it was compiled with.
    """
    impl = impl or default_impl(arch)
    kv_stages = kv_stages or default_kv_stages(impl)
    if impl != "mma" and arch != "sm_90a":
        raise ValueError(f"impl={impl!r} needs sm_90a, not {arch}; use impl='mma'")
    fakes = fake_arguments(d_qk, heads, layout, num_sms=impl == "wgmma_split")
    if impl == "wgmma_split":  # its own kernel class (two KV buffers, fixed)
        from dsa_aot.kernels.cutedsl_fwd_split import entry_class

        if kv_stages != 2:
            raise ValueError(f"impl={impl!r} needs kv_stages=2")
        kernel = entry_class(layout)(d_qk, heads, layout)
    else:
        cls = SparseMlaFwdCompact if layout == "compact" else SparseMlaFwdNoncompact
        kernel = cls(d_qk, heads, layout, kv_stages, impl)
    compiled = cute.compile(kernel, *fakes.values(),
                            options=f"--gpu-arch {arch} {extra_options}".strip())
    return compiled, fakes


def default_softmax_scale(d_qk: int) -> float:
    """The contract's default ``softmax_scale``."""
    return float(d_qk ** -0.5)


__all__ = ["IMPLS", "SparseMlaFwd", "SparseMlaFwdCompact", "SparseMlaFwdNoncompact",
           "check_params", "compile_fwd", "default_impl", "default_kv_stages",
           "default_softmax_scale", "fake_arguments"]
