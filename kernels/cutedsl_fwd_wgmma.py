"""CuTe DSL sparse MLA forward, flavours ``wgmma`` and ``wgmma_pipe`` (sm_90a).

Same contract and algorithm as :mod:`dsa_aot.kernels.cutedsl_fwd`. One CTA of 256 threads per
query row and block of 64 heads: two warpgroups issue ``wgmma`` from shared memory (Q and each KV
tile K-major, ``V`` the same bytes read MN-major), each computing 32 score columns and 256 output
columns:

* each thread copies its 16-byte pieces of two of a block's 64 gathered KV rows
  (``cp.async``); the indices of the next block are loaded one block ahead, so no copy waits on
  them;
* the two warpgroups exchange their row maxima through shared memory, and ``P`` (rounded to
  bf16) goes through shared memory to become the A operand of ``P V``;
* ``wgmma``: two KV buffers by default (block ``b + 1`` is gathered while block ``b`` is
  computed), or one (``kv_stages=1``: the next block gathered after the barrier that ends the
  current one);
* ``wgmma_pipe`` (two KV buffers): as ``wgmma``, but ``P V`` of block ``b`` stays in flight until
  the scores of block ``b + 1`` are waited for, and block ``b + 1`` is gathered right after the
  barrier that follows that wait.

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from dsa_aot.kernels.cutedsl_common import D_V, wg_rows_cols
from dsa_aot.kernels.cutedsl_fwd import (BLOCK_H, BLOCK_N, LOG2E, M_FLOOR, THREADS, WARPS_N,
                                         Gather, SparseMlaFwd, SparseMlaFwdCompact,
                                         SparseMlaFwdNoncompact, compile_entry, g2s_copy,
                                         p_to_shared, store_tile, wg_gemm, wg_mma,
                                         wg_smem_layouts, wg_storage, wg_tiles)


class SparseMlaFwdWgmma(SparseMlaFwd):
    """The ``wgmma`` / ``wgmma_pipe`` forward for one ``(d_qk, heads, layout)``; ``kv_stages``
    1 or 2 (``wgmma_pipe``: 2)."""

    IMPLS = ("wgmma", "wgmma_pipe")

    # ---------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def launch(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor,
               topk_length: cute.Tensor, attn_sink: cute.Tensor, out: cute.Tensor,
               lse: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream) -> None:
        stages = self.kv_stages
        # Q and each KV tile: K-major 128-byte swizzled (8 x 64 atoms, rows first); V^T is the
        # same bytes read MN-major: (512 value columns, 64 KV rows), KV rows first.
        s_q_layout, s_kv_layout, s_v_layout, s_p_layout = wg_smem_layouts(self.d_qk, BLOCK_N,
                                                                          stages, D_V)
        gmem_copy = g2s_copy(THREADS)
        # two warpgroups side by side along N: S is 64 x (2 x 32), O is 64 x (2 x 256)
        mma_s = wg_mma(BLOCK_N // WARPS_N, warpgroup.OperandMajorMode.K, (1, WARPS_N, 1))
        mma_o = wg_mma(D_V // WARPS_N, warpgroup.OperandMajorMode.MN, (1, WARPS_N, 1))
        s_q = cute.size(q, mode=[0])
        if s_q > 0:
            SharedStorage = wg_storage(s_q_layout, s_kv_layout, s_p_layout,
                                       s_max=(Float32, WARPS_N * BLOCK_H, 16),
                                       s_sum=(Float32, WARPS_N * BLOCK_H, 16),
                                       s_valid=(Int32, BLOCK_N * stages, 16))
            self.kernel_wgmma(q, kv, topk_idxs, topk_length, attn_sink, out, lse,
                              softmax_scale * Float32(LOG2E), s_q_layout, s_kv_layout, s_v_layout,
                              s_p_layout, gmem_copy, mma_s, mma_o, SharedStorage).launch(
                grid=[s_q, (self.heads + BLOCK_H - 1) // BLOCK_H, 1], block=[THREADS, 1, 1],
                smem=SharedStorage.size_in_bytes(), stream=stream)

    # ---------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------

    @cute.kernel
    def kernel_wgmma(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_idx: cute.Tensor,
                     m_len: cute.Tensor, m_sink: cute.Tensor, m_out: cute.Tensor,
                     m_lse: cute.Tensor, scale_log2: Float32, s_q_layout: cute.ComposedLayout,
                     s_kv_layout: cute.ComposedLayout, s_v_layout: cute.ComposedLayout,
                     s_p_layout: cute.ComposedLayout, gmem_copy: cute.TiledCopy,
                     mma_s: cute.TiledMma, mma_o: cute.TiledMma,
                     SharedStorage: cutlass.Constexpr) -> None:
        mma_s.set(warpgroup.Field.ACCUMULATE, True)  # accumulators are zero-filled instead
        mma_o.set(warpgroup.Field.ACCUMULATE, True)
        tidx, _, _ = cute.arch.thread_idx()
        t, hb, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        lane = cute.arch.lane_idx()
        s_kv = cute.size(m_kv, mode=[0])
        n_valid, n_blocks = self.row_slots(t, m_idx, m_len, BLOCK_N, s_kv)

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        s_q, s_kv_all, s_p = wg_tiles(storage, s_q_layout, s_kv_layout, s_p_layout)
        s_v_all = cute.make_tensor(s_kv_all.iterator, s_v_layout.outer)  # same swizzled bytes
        s_max, s_sum, s_valid_all = self.row_scratch(storage)
        g, thr_copy = self.start_copies(m_q, m_kv, m_idx, n_valid, s_kv, s_q, s_valid_all,
                                        gmem_copy, t, hb, tidx)
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

        idx0, idx1 = self.load_idx(0, g)
        idx0, idx1 = self.gather_next(n_blocks > 0, idx0, idx1, g, t_s_kv[None, None, None, 0],
                                      Int32(0), 1)
        pipelined = self.impl == "wgmma_pipe"

        for b in cutlass.range(n_blocks, unroll=1):
            stage = b % self.kv_stages
            nxt = (b + 1) % self.kv_stages
            if cutlass.const_expr(self.kv_stages == 2 and not pipelined):
                if b + 1 < n_blocks:  # into the other buffer, freed by the previous block's end
                    self.gather(idx0, idx1, g, t_s_kv[None, None, None, nxt], nxt * BLOCK_N)
                cute.arch.cp_async_commit_group()
                idx0, idx1 = self.load_idx(b + 2, g)
                cute.arch.cp_async_wait_group(1)
            else:
                cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()  # cp.async / zero-fill writes -> wgmma reads
            cute.arch.barrier()
            # wgmma_pipe: the previous block's P V is still in flight: its wait comes with this
            # block's scores, and the next gather starts once both warpgroups are past that wait
            self.compute_block_wgmma(stage, r_q, r_k, r_p, r_v, s_p, s_max, acc_o, row_max,
                                     row_sum, c_s_mn, scale_log2, mma_s, mma_o, thr_s, wg, lane,
                                     b, n_blocks, idx0, idx1, g, t_s_kv)
            if cutlass.const_expr(pipelined):
                idx0, idx1 = self.load_idx(b + 2, g)
            else:
                cute.arch.barrier()  # both warpgroups are done with this buffer, s_p and s_max
                if cutlass.const_expr(self.kv_stages == 1):
                    idx0, idx1 = self.gather_next(b + 1 < n_blocks, idx0, idx1, g,
                                                  t_s_kv[None, None, None, 0], Int32(0), b + 2)
        if cutlass.const_expr(pipelined):
            warpgroup.wait_group(0)

        # ---- epilogue ------------------------------------------------------------------------
        self.finish_rows([wg_rows_cols(acc_o)], row_max, row_sum, c_s_mn, s_sum, wg, lane, t, hb,
                         m_sink, m_lse)
        g_out = cute.local_tile(m_out[t, None, None], (BLOCK_H, D_V), (hb, 0))
        store_tile(acc_o, c_o, thr_o.partition_C(g_out), self.heads)

    @cute.jit
    def compute_block_wgmma(self, stage: Int32, r_q: cute.Tensor, r_k: cute.Tensor,
                            r_p: cute.Tensor, r_v: cute.Tensor, s_p: cute.Tensor,
                            s_max: cute.Tensor, acc_o: cute.Tensor, row_max: cute.Tensor,
                            row_sum: cute.Tensor, c_s_mn: cute.Tensor, scale_log2: Float32,
                            mma_s: cute.TiledMma, mma_o: cute.TiledMma, thr_s: cute.core.ThrMma,
                            wg: Int32, lane: Int32, b: Int32, n_blocks: Int32, idx0: Int32,
                            idx1: Int32, g: Gather, t_s_kv: cute.Tensor) -> None:
        """Scores (this warpgroup's 32 columns), online softmax and ``O += P V``.

        ``wgmma_pipe``: ``P V`` is left in flight (waited with the next block's scores) and
        block ``b + 1`` is gathered here, after the barrier that follows every warpgroup's wait.
        """
        pipelined = self.impl == "wgmma_pipe"
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((BLOCK_H, BLOCK_N)), Float32)
        acc_s.fill(0.0)
        wg_gemm(mma_s, acc_s, r_q, r_k, stage, self.d_qk // 16)
        warpgroup.wait_group(0)

        acc_s_mn = wg_rows_cols(acc_s)
        self.masked_max(acc_s_mn, c_s_mn, g.s_valid_all, stage * BLOCK_N, scale_log2, s_max, wg,
                        lane)
        if cutlass.const_expr(pipelined):
            nxt = (b + 1) % 2
            if b + 1 < n_blocks:
                self.gather(idx0, idx1, g, t_s_kv[None, None, None, nxt], nxt * BLOCK_N)
            cute.arch.cp_async_commit_group()
        self.rescale(acc_s_mn, c_s_mn, s_max, row_max, row_sum, [wg_rows_cols(acc_o)])
        p_to_shared(acc_s, mma_s, s_p, g.tidx)
        cute.arch.fence_view_async_shared()  # P stores -> wgmma reads
        cute.arch.barrier()
        wg_gemm(mma_o, acc_o, r_p, r_v, stage, BLOCK_N // 16)
        if cutlass.const_expr(not pipelined):
            warpgroup.wait_group(0)


class SparseMlaFwdWgmmaCompact(SparseMlaFwdWgmma, SparseMlaFwdCompact):
    """Entry point of the compact layout."""


class SparseMlaFwdWgmmaNoncompact(SparseMlaFwdWgmma, SparseMlaFwdNoncompact):
    """Entry point of the noncompact layout."""


def compile_fwd_wgmma(arch: str, d_qk: int, heads: int, layout: str,
                      kv_stages: int | None = None, impl: str = "wgmma",
                      extra_options: str = "") -> tuple[object, dict[str, object]]:
    """``cute.compile`` flavour ``impl`` (``wgmma`` or ``wgmma_pipe``) for ``arch`` (sm_90a;
    ``CUTE_DSL_ARCH`` set before import); see
    :func:`~dsa_aot.kernels.cutedsl_fwd.compile_entry`."""
    return compile_entry(SparseMlaFwdWgmmaCompact, SparseMlaFwdWgmmaNoncompact, arch, d_qk,
                         heads, layout, kv_stages, impl, extra_options)


__all__ = ["SparseMlaFwdWgmma", "SparseMlaFwdWgmmaCompact",
           "SparseMlaFwdWgmmaNoncompact", "compile_fwd_wgmma"]
