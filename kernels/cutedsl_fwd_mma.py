"""CuTe DSL sparse MLA forward, flavour ``mma`` (any arch; the sm_100a default).

Same contract and algorithm as :mod:`dsa_aot.kernels.cutedsl_fwd`. One CTA of 256 threads per
query row and block of 64 heads: 8 warps of SM80 ``mma.sync`` fed by ``ldmatrix``, warp ``w``
owning head rows ``16 * (w % 4)`` and half of every 32 columns (``w // 4``):

* each thread copies its 16-byte pieces of two of a block's 64 gathered KV rows
  (``cp.async``); the indices of the next block are loaded one block ahead, so no copy waits on
  them;
* ``kv_stages`` KV buffers: one by default (two spill registers), the next block gathered after
  the barrier that ends the current one; with two, block ``b + 1`` is gathered into the other
  buffer while block ``b`` is computed;
* the two halves of the CTA that share head rows exchange row maxima through shared memory, and
  ``P`` (rounded to bf16) goes through shared memory to become the A operand of ``P V``; ``O``
  is accumulated as eight 64-column chunks.

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import warp

from dsa_aot.kernels.cutedsl_common import D_V, acc_rows_cols
from dsa_aot.kernels.cutedsl_fwd import (BLOCK_H, BLOCK_N, LOG2E, M_FLOOR, THREADS, WARPS_M,
                                         WARPS_N, SparseMlaFwd, SparseMlaFwdCompact,
                                         SparseMlaFwdNoncompact, compile_entry, g2s_copy,
                                         p_to_shared, store_tile)

#: The ``impl`` name of this flavour.
IMPL = "mma"


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


class SparseMlaFwdMma(SparseMlaFwd):
    """The ``mma`` forward for one ``(d_qk, heads, layout)``; ``kv_stages`` 1 or 2."""

    IMPLS = (IMPL,)

    # ---------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def launch(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor,
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

        gmem_copy = g2s_copy(THREADS)
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
        tidx, _, _ = cute.arch.thread_idx()
        t, hb, _ = cute.arch.block_idx()
        warp_n = cute.arch.warp_idx() // WARPS_M
        lane = cute.arch.lane_idx()
        s_kv = cute.size(m_kv, mode=[0])
        n_valid, n_blocks = self.row_slots(t, m_idx, m_len, BLOCK_N, s_kv)

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        s_q = storage.s_q.get_tensor(s_q_layout)
        s_p = storage.s_p.get_tensor(s_p_layout)
        s_kv_bufs = [cute.make_tensor(storage.s_kv.data_ptr() + i * cute.cosize(s_kv_layout),
                                      s_kv_layout) for i in range(self.kv_stages)]
        s_max, s_sum, s_valid_all = self.row_scratch(storage)
        g, thr_copy = self.start_copies(m_q, m_kv, m_idx, n_valid, s_kv, s_q, s_valid_all,
                                        gmem_copy, t, hb, tidx)
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
        # compute_block's operands after the buffer's own
        operands = (t_s_q_a, r_q, r_q_view, r_k, r_k_view, r_v, r_v_view, t_s_p_a, r_p, r_p_view,
                    s_p, s_valid_all, s_max, acc_o, row_max, row_sum, c_s_mn, scale_log2,
                    tiled_mma, thr_mma, copy_bt, warp_n, lane, tidx)

        # ---- prologue: first block in flight, the next block's indices loading ------------
        idx0, idx1 = self.load_idx(0, g)
        idx0, idx1 = self.gather_next(n_blocks > 0, idx0, idx1, g, t_s_kv[0], 0, 1)

        for b in cutlass.range(n_blocks, unroll=1):
            stage = 0
            if cutlass.const_expr(self.kv_stages == 2):
                stage = b % 2
            if cutlass.const_expr(self.kv_stages == 2):
                # prefetch block b + 1 into the other buffer (freed by the previous block's end)
                if b + 1 < n_blocks:
                    if stage == 0:
                        self.gather(idx0, idx1, g, t_s_kv[1], BLOCK_N)
                    else:
                        self.gather(idx0, idx1, g, t_s_kv[0], 0)
                cute.arch.cp_async_commit_group()
                idx0, idx1 = self.load_idx(b + 2, g)
                cute.arch.cp_async_wait_group(1)
            else:
                cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if cutlass.const_expr(self.kv_stages == 2):
                if stage == 0:
                    self.compute_block(0, t_s_k_b[0], s_vt_bufs[0], *operands)
                else:
                    self.compute_block(BLOCK_N, t_s_k_b[1], s_vt_bufs[1], *operands)
            else:
                self.compute_block(0, t_s_k_b[0], s_vt_bufs[0], *operands)
            cute.arch.barrier()  # every warp is done with this buffer, s_p and s_max
            if cutlass.const_expr(self.kv_stages == 1):
                idx0, idx1 = self.gather_next(b + 1 < n_blocks, idx0, idx1, g, t_s_kv[0], 0,
                                              b + 2)

        # ---- epilogue ------------------------------------------------------------------------
        self.finish_rows([acc_rows_cols(acc) for acc in acc_o], row_max, row_sum, c_s_mn, s_sum,
                         warp_n, lane, t, hb, m_sink, m_lse)
        g_out = cute.local_tile(m_out[t, None, None], (BLOCK_H, D_V), (hb, 0))
        for c in cutlass.range_constexpr(n_chunks):
            g_chunk = cute.local_tile(g_out, (BLOCK_H, BLOCK_N), (0, c))
            store_tile(acc_o[c], c_s, thr_mma.partition_C(g_chunk), self.heads)

    @cute.jit
    def compute_block(self, valid_base: cutlass.Constexpr, t_s_k_b: cute.Tensor,
                      s_vt: cute.Tensor, t_s_q_a: cute.Tensor, r_q: cute.Tensor,
                      r_q_view: cute.Tensor, r_k: cute.Tensor, r_k_view: cute.Tensor,
                      r_v: cute.Tensor, r_v_view: cute.Tensor, t_s_p_a: cute.Tensor,
                      r_p: cute.Tensor, r_p_view: cute.Tensor, s_p: cute.Tensor,
                      s_valid_all: cute.Tensor, s_max: cute.Tensor, acc_o: list,
                      row_max: cute.Tensor, row_sum: cute.Tensor, c_s_mn: cute.Tensor,
                      scale_log2: Float32, tiled_mma: cute.TiledMma, thr_mma: cute.core.ThrMma,
                      copy_bt: cute.TiledCopy, warp_n: Int32, lane: Int32, tidx: Int32) -> None:
        """Scores, online softmax and ``O += P V`` for the block in the buffer of ``t_s_k_b``
        (its K partition) and ``s_vt`` (its V^T view), flags from ``valid_base``."""
        acc_s = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK_H, BLOCK_N)), Float32)
        acc_s.fill(0.0)
        for k in cutlass.range_constexpr(self.d_qk // 16):
            cute.copy(_ldsm_a(tiled_mma), t_s_q_a[None, None, k], r_q_view[None, None, 0])
            cute.copy(_ldsm_b(tiled_mma), t_s_k_b[None, None, k], r_k_view[None, None, 0])
            cute.gemm(tiled_mma, acc_s, r_q[None, None, 0], r_k[None, None, 0], acc_s)

        acc_s_mn = acc_rows_cols(acc_s)
        self.masked_max(acc_s_mn, c_s_mn, s_valid_all, valid_base, scale_log2, s_max, warp_n,
                        lane)
        self.rescale(acc_s_mn, c_s_mn, s_max, row_max, row_sum,
                     [acc_rows_cols(acc) for acc in acc_o])
        # P (bf16) -> shared memory, then the A operand of P V
        p_to_shared(acc_s, tiled_mma, s_p, tidx)
        cute.arch.barrier()
        cute.copy(_ldsm_a(tiled_mma), t_s_p_a, r_p_view)
        for c in cutlass.range_constexpr(len(acc_o)):
            s_vt_c = cute.local_tile(s_vt, (BLOCK_N, BLOCK_N), (c, 0))
            t_s_vt = copy_bt.partition_S(s_vt_c)  # (CPY, N, 4)
            for k in cutlass.range_constexpr(BLOCK_N // 16):
                cute.copy(_ldsm_bt(tiled_mma), t_s_vt[None, None, k], r_v_view[None, None, 0])
                cute.gemm(tiled_mma, acc_o[c], r_p[None, None, k], r_v[None, None, 0], acc_o[c])

class SparseMlaFwdMmaCompact(SparseMlaFwdMma, SparseMlaFwdCompact):
    """Entry point of the compact layout."""


class SparseMlaFwdMmaNoncompact(SparseMlaFwdMma, SparseMlaFwdNoncompact):
    """Entry point of the noncompact layout."""


def compile_fwd_mma(arch: str, d_qk: int, heads: int, layout: str, kv_stages: int | None = None,
                    impl: str = IMPL, extra_options: str = "") -> tuple[object, dict[str, object]]:
    """``cute.compile`` this flavour for ``arch`` (any; ``CUTE_DSL_ARCH`` set before import);
    see :func:`~dsa_aot.kernels.cutedsl_fwd.compile_entry`."""
    return compile_entry(SparseMlaFwdMmaCompact, SparseMlaFwdMmaNoncompact, arch, d_qk, heads,
                         layout, kv_stages, impl, extra_options)


__all__ = ["IMPL", "SparseMlaFwdMma", "SparseMlaFwdMmaCompact", "SparseMlaFwdMmaNoncompact",
           "compile_fwd_mma"]
