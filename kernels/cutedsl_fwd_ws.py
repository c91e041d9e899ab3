"""CuTe DSL sparse MLA forward, flavour ``wgmma_ws`` (sm_90a; 384 threads, warp-specialised).

Same contract and algorithm as :mod:`dsa_aot.kernels.cutedsl_fwd`. One CTA of three warpgroups
per query row and block of 64 heads; the two consumer warpgroups load Q, then:

* warpgroup 2 is the producer (``setmaxnreg`` 80): it gathers each block into a ring of two KV
  buffers with ``cp.async`` and signals ``full`` through ``cp.async.mbarrier.arrive.noinc`` plus
  a plain arrive (after its validity flags);
* warpgroup 0 (``setmaxnreg`` 240) computes the whole 64 x 64 score tile, the online softmax,
  ``lse`` and the left half of ``O`` (value columns 0-255);
* warpgroup 1 rescales and accumulates the right half (256-511) from the same ``P``, handed over
  through shared memory with ``p_full`` / ``p_free`` mbarriers;
* a buffer is returned to the producer (``empty``) once both halves' ``P V`` have completed. No
  CTA-wide barrier inside the loop; a named barrier joins the two consumers for the epilogue.

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from dsa_aot.kernels.cutedsl_common import D_V, VEC, quad_max, quad_sum, wg_rows_cols
from dsa_aot.kernels.cutedsl_fwd import (BLOCK_H, BLOCK_N, LOG2E, M_FLOOR, THREADS, WG_THREADS,
                                         SparseMlaFwd, SparseMlaFwdCompact,
                                         SparseMlaFwdNoncompact, compile_entry, copy_q_tile,
                                         gather_rows, producer_idx, row_lse_and_factor,
                                         softmax_row, store_tile, wg_gemm, wg_mma,
                                         wg_smem_layouts, wg_storage, wg_tiles, ws_copies)

#: The ``impl`` name of this flavour.
IMPL = "wgmma_ws"
#: 3 warpgroups: softmax + left half of P V, right half of P V, gather producer.
WS_THREADS = 3 * WG_THREADS
#: setmaxnreg budgets (<= 3 * 168 in all: the launch gives each thread 65536 / 384 -> 168).
WS_SOFTMAX_REGS, WS_PRODUCER_REGS = 240, 80
#: Named barrier joining the two consumer warpgroups before the epilogue (0 is __syncthreads).
WS_EPILOGUE_BARRIER = 1

_INF = float("inf")


class SparseMlaFwdWs(SparseMlaFwd):
    """The ``wgmma_ws`` forward for one ``(d_qk, heads, layout)`` (two KV buffers)."""

    IMPLS = (IMPL,)
    #: Gathered KV rows per block and KV buffers in the ring (64 x 2 fills the shared memory at
    #: D_qk 576; 32 x 4 and 32 x 3 are correct but slower on the H200).
    ws_block_n: int = BLOCK_N
    ws_stages: int = 2

    # ---------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def launch(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor,
               topk_length: cute.Tensor, attn_sink: cute.Tensor, out: cute.Tensor,
               lse: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream) -> None:
        d = self.d_qk
        bn = self.ws_block_n
        stages = self.ws_stages
        half = D_V // 2
        s_q_layout, s_kv_layout, s_v_layout, s_p_layout = wg_smem_layouts(d, bn, stages)

        q_copy, kv_copy = ws_copies()
        mma_s = wg_mma(bn, warpgroup.OperandMajorMode.K)
        mma_o = wg_mma(half, warpgroup.OperandMajorMode.MN)
        s_q = cute.size(q, mode=[0])
        if s_q > 0:
            SharedStorage = wg_storage(s_q_layout, s_kv_layout, s_p_layout,
                                       s_alpha=(Float32, BLOCK_H, 16), s_fac=(Float32, BLOCK_H, 16),
                                       s_valid=(Int32, bn * stages, 16),
                                       # full[stages], empty[stages], p_full, p_free
                                       mbar=(cutlass.Int64, 2 * stages + 2, 8))
            self.kernel_ws(q, kv, topk_idxs, topk_length, attn_sink, out, lse,
                           softmax_scale * Float32(LOG2E), s_q_layout, s_kv_layout, s_v_layout,
                           s_p_layout, q_copy, kv_copy, mma_s, mma_o, SharedStorage).launch(
                grid=[s_q, (self.heads + BLOCK_H - 1) // BLOCK_H, 1],
                block=[WS_THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    # ---------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------

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
        n_valid, n_blocks = self.row_slots(t, m_idx, m_len, bn, s_kv)

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        s_q, s_kv_all, s_p = wg_tiles(storage, s_q_layout, s_kv_layout, s_p_layout)
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
            copy_q_tile(m_q, s_q, q_copy, t, hb, tidx, d, heads)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()  # Q -> wgmma reads
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
                    wg_gemm(mma_s, acc_s, r_q, r_k, stage, d // 16)
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
                        corr = softmax_row(acc_s_mn, r, quad_max(m_blk), row_max, row_sum)
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
                    wg_gemm(mma_o, acc_o, r_p, r_v, stage, bn // 16)
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
                    wg_gemm(mma_o, acc_o, r_p, r_v, stage, bn // 16)
                    warpgroup.wait_group(0)
                    cute.arch.mbarrier_arrive(p_free_bar)
                    cute.arch.mbarrier_arrive(empty_bar + stage)
            # ---- epilogue: both halves scaled by the factor, stored as bf16 ----------------
            cute.arch.barrier(barrier_id=WS_EPILOGUE_BARRIER, number_of_threads=THREADS)
            for r in cutlass.range_constexpr(rows):
                acc_o_mn[r, None] = acc_o_mn[r, None].load() * s_fac[c_o_mn[r, 0][0]]
            g_out = cute.local_tile(m_out[t, None, None], (BLOCK_H, half), (hb, wg))
            store_tile(acc_o, c_o, thr_o.partition_C(g_out), heads)

    @cute.jit
    def load_idx_ws(self, block: Int32, t: Int32, m_idx: cute.Tensor, n_valid: Int32,
                    p_row: Int32) -> list:
        """The producer thread's KV indices of block ``block``, one per pass (-1 past the end)."""
        return producer_idx(block, t, m_idx, n_valid, p_row, self.ws_block_n)


class SparseMlaFwdWsCompact(SparseMlaFwdWs, SparseMlaFwdCompact):
    """Entry point of the compact layout."""


class SparseMlaFwdWsNoncompact(SparseMlaFwdWs, SparseMlaFwdNoncompact):
    """Entry point of the noncompact layout."""


def compile_fwd_ws(arch: str, d_qk: int, heads: int, layout: str, kv_stages: int | None = None,
                   impl: str = IMPL, extra_options: str = "") -> tuple[object, dict[str, object]]:
    """``cute.compile`` this flavour for ``arch`` (sm_90a; ``CUTE_DSL_ARCH`` set before import);
    see :func:`~dsa_aot.kernels.cutedsl_fwd.compile_entry`."""
    return compile_entry(SparseMlaFwdWsCompact, SparseMlaFwdWsNoncompact, arch, d_qk, heads,
                         layout, kv_stages, impl, extra_options)


__all__ = ["IMPL", "SparseMlaFwdWs", "SparseMlaFwdWsCompact", "SparseMlaFwdWsNoncompact",
           "compile_fwd_ws"]
