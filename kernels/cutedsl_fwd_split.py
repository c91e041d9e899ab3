"""CuTe DSL sparse MLA forward, sm_90a flavour ``wgmma_split``: the score work split in two.

Same contract as :mod:`dsa_aot.kernels.cutedsl_fwd` (and :mod:`dsa_aot.kernels.reference`):
any ``K >= 1``, both layouts, D_qk 512 or 576. A *tile* is one query row and block of 64 heads
(H < 64: extra rows of Q zero-filled and never stored; H = 128: two tiles per row). The grid is
persistent: one CTA of 384 threads per SM (the run-time ``num_sms``), CTA ``b`` of ``G`` running
tiles ``b, b + G, ...`` back to back, so the next tile's Q and first KV blocks are gathered while
the consumers finish the current one; the head blocks of a row are neighbouring CTAs, which run
together, so the second gather of the row's KV rows hits in L2.

Warpgroups and shared memory:

* warpgroup 2, the producer (``setmaxnreg`` 72), per tile: loads the tile's Q (16-byte
  ``cp.async``, ``q_ready`` mbarrier) once both consumers are done with the previous tile's Q
  bytes (``q_free``), then gathers the row's valid slots two blocks of 64 at a time: block
  ``2k`` into KV buffer 0, block ``2k + 1`` into KV buffer 1, each 64 x D_qk,
  128-byte swizzled, copied by 16-byte ``cp.async`` without a branch: an invalid slot, or one
  past the row's blocks, is the same instruction with a source size of 0, which zero-fills and
  reads nothing, and is flagged invalid (a branch per row between the copies and shared-memory
  zero stores kept ptxas from issuing a thread's copies back to back). Each buffer is two
  halves with their own ``ready`` / ``free`` mbarriers: ``L`` = columns 0-255, ``R`` = columns
  256-D_qk. The halves are filled in the order the consumers free them: 0L, 1R, 0R, 1L. The
  slot indices are loaded one pair ahead (the first pair's before the wait for ``q_free``), so
  a gather never waits for its index load (an L2 miss once the KV rows outgrow the L2). The
  mbarrier phases run on across tiles (a count of the block pairs done);
* warpgroups 0 and 1 (``setmaxnreg`` 216) alternate the blocks: warpgroup ``w`` computes the
  whole 64 x 64 score tile ``S = Q K^T`` of buffer ``w`` (its own half first, so it starts
  before the other half lands), masks invalid slots to -inf, and runs the online softmax of
  that block. Warpgroup ``w`` owns value columns ``256 w .. 256 w + 255`` of ``O``: it
  multiplies its own ``P`` (bf16, from registers: the wgmma A operand) with its half of ``V``
  of its own buffer, and the peer's ``P`` (read from shared memory) with its half of ``V`` of
  the peer's buffer;
* one softmax max per pair of blocks: warpgroup 0 publishes its block's running max, warpgroup
  1 folds it into its own and publishes the pair's max ``M``; warpgroup 0 rescales its ``P``
  (still fp32 in registers), its ``O`` half and its row sum to ``M`` before storing ``P`` for
  the peer. The exchanges go through shared memory and named barriers. ``P`` of warpgroup 1
  has its own 64 x 64 tile; ``P`` of warpgroup 0 lives in the RoPE columns (512-575) of
  buffer 0 once its scores are done (D_qk 576; a second tile at D_qk 512);
* a half buffer is freed as soon as its last reader is done: ``0L`` and ``1R`` after the
  owner's own ``P V``, ``0R`` (with warpgroup 0's ``P``) and ``1L`` after the peer's ``P V``.
  Per pair (named barriers in brackets, ``->`` arrive, ``<-`` wait):

  - warpgroup 0: ``S`` of block 2k; softmax; ``-> MAX0``; ``O += P V0L``; free 0L;
    ``<- MAX1``: rescale ``P``, ``O``, ``l`` to ``M``; ``P`` to shared; ``-> P0``; ``<- P1``;
    ``O += P1 V1L``; first half of the next ``S``; free 1L; second half;
  - warpgroup 1: ``S`` of block 2k + 1 (1R, then 1L); ``<- MAX0``; softmax with the pair's max;
    ``-> MAX1``; ``P`` to shared; ``-> P1``; ``O += P V1R``; ``<- P0``; ``O += P0 V0R``; free 1R;
    free 0R;
* epilogue of a tile: the two row sums (each relative to the same final max) are added through
  shared memory (two halves used by alternate tiles, so one named barrier suffices);
  ``lse = ln 2 * (M + log2(l))`` (sink excluded), ``out = O / l * w`` with the sink weight
  ``w = 1 / (1 + exp(sink - lse))``; a row without a valid slot stores ``out = 0`` and
  ``lse = +inf``. Each warpgroup stages its bf16 half of ``out`` in the KV half it read last
  (warpgroup 0: 1L, warpgroup 1: columns 256-511 of 0R; both hold back that half's ``free``
  until then); one thread stores it by TMA (four 64 x 64 tiles of the ``(heads, D_V, s_q)``
  view; head rows past ``heads`` are clipped by the unit) and frees the half once the unit has
  read it, so the consumer warps issue no global stores. Q's bytes are freed (``q_free``) as
  soon as the tile's last score GEMMs are done, at the start of its last pair, so the producer
  loads the next tile's Q while the consumers finish the tile (a tile without blocks stages
  ``out`` in Q's bytes and frees them after).

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, warpgroup

from dsa_aot.kernels.cutedsl_common import (D_V, VEC, gather_row_zfill, quad_max, quad_sum,
                                            wg_acc_as_a, wg_rows_cols)
from dsa_aot.kernels.cutedsl_fwd import (BLOCK_H, BLOCK_N, LOG2E, M_FLOOR, THREADS, WG_THREADS,
                                         WS_ROWS_PER_PASS, SparseMlaFwd, compile_entry,
                                         producer_idx, row_lse_and_factor, wg_gemm,
                                         wg_mma, wg_smem_layouts, wg_storage, ws_copies)

#: The ``impl`` name of this flavour.
IMPL = "wgmma_split"
#: 384 threads: two consumer warpgroups and the producer.
SPLIT_THREADS = 3 * WG_THREADS
#: setmaxnreg budgets: 2 * 216 + 72 = 3 * 168 (65536 registers / 384 threads).
CONSUMER_REGS, PRODUCER_REGS = 216, 72
#: Value columns each consumer warpgroup owns, and 64-column tiles per half of a KV buffer.
HALF = D_V // 2
TILE = 64
HALF_TILES = HALF // TILE
#: Named barriers (0 is __syncthreads), each joining the two consumer warpgroups.
BAR_MAX0, BAR_MAX1, BAR_P0, BAR_P1, BAR_SUM = 1, 2, 3, 4, 5
#: Named barriers of one consumer warpgroup (its ``out`` staged in shared memory).
BAR_OUT = (6, 7)

_INF = float("inf")


class SparseMlaFwdSplit(SparseMlaFwd):
    """The ``wgmma_split`` forward for one ``(d_qk, heads, layout)`` (sm_90a only; two KV
    buffers)."""

    IMPLS = (IMPL,)
    NUM_SMS = True

    # ---------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def launch(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor,
               topk_length: cute.Tensor, attn_sink: cute.Tensor, out: cute.Tensor,
               lse: cute.Tensor, softmax_scale: Float32, num_sms: Int32,
               stream: cuda.CUstream) -> None:
        d = self.d_qk
        # Q, the two KV buffers, V^T of one half of the value columns in both, a P tile
        s_q_layout, s_kv_layout, s_v_layout, s_p_layout = wg_smem_layouts(d, BLOCK_N, 2)
        # P of warpgroup 1, and of warpgroup 0 unless it fits in buffer 0's RoPE columns
        p_tiles = 1 if d > D_V else 2

        _, kv_copy = ws_copies()  # the producer's 16-byte copies (Q and the gathered rows)
        mma_s = wg_mma(BLOCK_N, warpgroup.OperandMajorMode.K)
        # P V with the peer's P from shared memory, and with this warpgroup's P from registers
        mma_pv = wg_mma(HALF, warpgroup.OperandMajorMode.MN)
        mma_pv_rs = wg_mma(HALF, warpgroup.OperandMajorMode.MN,
                           a_source=warpgroup.OperandSource.RMEM)
        # out stored by TMA, 64 x 64 tiles of the (heads, D_V, s_q) view: rows past ``heads``
        # are clipped by the unit
        o_tile = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16),
            (BLOCK_H, TILE), (0, 1))
        out_hdq = cute.make_tensor(out.iterator, cute.select(out.layout, mode=[1, 2, 0]))
        tma_o, m_out_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(),
                                                       out_hdq, o_tile, (BLOCK_H, TILE))
        s_q = cute.size(q, mode=[0])
        if s_q > 0:
            SharedStorage = wg_storage(s_q_layout, s_kv_layout, s_p_layout, p_tiles,
                                       s_max=(Float32, BLOCK_H, 16),
                                       s_sum=(Float32, 4 * BLOCK_H, 16),
                                       s_valid=(Int32, 2 * BLOCK_N, 16),
                                       # ready[buffer][half], free[buffer][half], Q ready, Q free
                                       mbar=(cutlass.Int64, 10, 8))
            self.kernel_split(q, kv, topk_idxs, topk_length, attn_sink, tma_o, m_out_tma, lse,
                              softmax_scale * Float32(LOG2E), s_q_layout, s_kv_layout,
                              s_v_layout, s_p_layout, kv_copy, mma_s, mma_pv, mma_pv_rs,
                              SharedStorage).launch(
                grid=[cta_count(s_q, self.heads, num_sms), 1, 1],
                block=[SPLIT_THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    # ---------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------

    @cute.kernel
    def kernel_split(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_idx: cute.Tensor,
                     m_len: cute.Tensor, m_sink: cute.Tensor, tma_o: cute.CopyAtom,
                     m_out: cute.Tensor, m_lse: cute.Tensor, scale_log2: Float32,
                     s_q_layout: cute.ComposedLayout,
                     s_kv_layout: cute.ComposedLayout, s_v_layout: cute.ComposedLayout,
                     s_p_layout: cute.ComposedLayout, kv_copy: cute.TiledCopy,
                     mma_s: cute.TiledMma, mma_pv: cute.TiledMma, mma_pv_rs: cute.TiledMma,
                     SharedStorage: cutlass.Constexpr) -> None:
        d = self.d_qk
        mma_s.set(warpgroup.Field.ACCUMULATE, True)  # accumulators are zero-filled instead
        mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        mma_pv_rs.set(warpgroup.Field.ACCUMULATE, True)
        tidx, _, _ = cute.arch.thread_idx()
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        n_tiles = cute.size(m_q, mode=[0]) * head_blocks(self.heads)
        if tidx == 0:
            cpasync.prefetch_descriptor(tma_o)
        n_mine = (n_tiles - bid + grid - 1) // grid  # tiles bid, bid + grid, ...

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        s_q = storage.s_q.get_tensor(s_q_layout.outer, swizzle=s_q_layout.inner)
        s_kv_all = storage.s_kv.get_tensor(s_kv_layout.outer, swizzle=s_kv_layout.inner)
        s_p1 = storage.s_p.get_tensor(s_p_layout.outer, swizzle=s_p_layout.inner)
        if cutlass.const_expr(d > D_V):  # buffer 0's RoPE columns: free once its S is done
            s_p0 = cute.make_tensor(s_kv_all.iterator + D_V * BLOCK_N, s_p_layout.outer)
        else:
            s_p0 = cute.make_tensor(s_p1.iterator + cute.cosize(s_p_layout.outer),
                                    s_p_layout.outer)
        s_max = storage.s_max.get_tensor(cute.make_layout(BLOCK_H))
        s_sum = storage.s_sum.get_tensor(cute.make_layout(4 * BLOCK_H))
        s_valid = storage.s_valid.get_tensor(cute.make_layout(2 * BLOCK_N))
        ready = storage.mbar.data_ptr()
        free = ready + 4
        q_ready = ready + 8
        q_free = ready + 9

        if tidx == 0:
            for i in cutlass.range_constexpr(4):
                # 128 cp.async arrivals (noinc) + 128 plain arrivals of the producer
                cute.arch.mbarrier_init(ready + i, 2 * WG_THREADS)
                cute.arch.mbarrier_init(free + i, WG_THREADS)
            cute.arch.mbarrier_init(q_ready, 2 * WG_THREADS)
            cute.arch.mbarrier_init(q_free, 2 * WG_THREADS)  # both consumer warpgroups
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        if wg == 2:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce(m_q, m_kv, m_idx, m_len, s_q, s_kv_all, s_valid, kv_copy, ready, free,
                         q_ready, q_free, bid, grid, n_mine, tidx % WG_THREADS)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            s_kv = cute.size(m_kv, mode=[0])
            if wg == 0:
                self.consume(0, m_idx, m_len, m_sink, tma_o, m_out, m_lse, scale_log2, s_q,
                             s_kv_all, s_v_layout, s_p0, s_p1, s_max, s_sum, s_valid, ready, free,
                             q_ready, q_free, mma_s, mma_pv, mma_pv_rs, bid, grid, n_mine, s_kv,
                             tidx)
            else:
                self.consume(1, m_idx, m_len, m_sink, tma_o, m_out, m_lse, scale_log2, s_q,
                             s_kv_all, s_v_layout, s_p1, s_p0, s_max, s_sum, s_valid, ready, free,
                             q_ready, q_free, mma_s, mma_pv, mma_pv_rs, bid, grid, n_mine, s_kv,
                             tidx)

    def tile_rows(self, tile: Int32, m_idx: cute.Tensor, m_len: cute.Tensor,
                  n_kv: Int32) -> tuple:
        """Tile ``tile``'s query row, head block, number of slots to walk and of pairs of blocks
        (call while tracing; :meth:`row_slots`). The head blocks of a row are neighbouring tiles
        of neighbouring CTAs, so they run together and the second gather of the row's KV rows hits
        in L2."""
        n = head_blocks(self.heads)
        t, hb = tile, Int32(0)
        if n > 1:
            t, hb = tile // n, tile % n
        return t, hb, *self.row_slots(t, m_idx, m_len, 2 * BLOCK_N, n_kv)

    # ---- producer ----------------------------------------------------------------------------

    @cute.jit
    def produce(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_idx: cute.Tensor,
                m_len: cute.Tensor, s_q: cute.Tensor, s_kv_all: cute.Tensor,
                s_valid: cute.Tensor, kv_copy: cute.TiledCopy, ready: cute.Pointer,
                free: cute.Pointer, q_ready: cute.Pointer, q_free: cute.Pointer, bid: Int32,
                grid: Int32, n_mine: Int32, wtid: Int32) -> None:
        """Per tile: Q once the consumers are done with the previous one, then blocks
        ``2k`` / ``2k + 1`` into buffers 0 / 1, half by half (0L, 1R, 0R, 1L)."""
        d = self.d_qk
        s_kv = cute.size(m_kv, mode=[0])
        thr_kv = kv_copy.get_slice(wtid)
        p_row = wtid // (TILE // VEC)
        t_s_q = thr_kv.partition_D(s_q)  # (CPY, 4, T)
        row_stride = m_kv.stride[0]
        row_bytes = Int64(row_stride) * 2
        kv_base = m_kv.iterator.toint()
        s_kv_base = s_kv_all.iterator.toint()
        pairs_done = Int32(0)  # blocks pairs of the earlier tiles: the mbarrier phases
        for i in cutlass.range(n_mine, unroll=1):
            t, hb, n_valid, n_pairs = self.tile_rows(bid + i * grid, m_idx, m_len, s_kv)
            # Q of this tile (head rows past ``heads`` zero-filled)
            t_g_q = thr_kv.partition_S(cute.local_tile(m_q[t, None, None], (BLOCK_H, d),
                                                       (hb, 0)))
            # the first pair's indices are loaded before the wait for the consumers, and each
            # pair's one pair ahead, so no gather waits on an index load
            idx0 = producer_idx(0, t, m_idx, n_valid, p_row, BLOCK_N)
            idx1 = producer_idx(1, t, m_idx, n_valid, p_row, BLOCK_N)
            cute.arch.mbarrier_wait(q_free, (i % 2) ^ 1)
            self.copy_head_rows(kv_copy, t_g_q, t_s_q, p_row)
            cute.arch.cp_async_mbarrier_arrive_noinc(q_ready)
            cute.arch.mbarrier_arrive(q_ready)
            for k in cutlass.range(n_pairs, unroll=1):
                nxt0 = producer_idx(2 * k + 2, t, m_idx, n_valid, p_row, BLOCK_N)
                nxt1 = producer_idx(2 * k + 3, t, m_idx, n_valid, p_row, BLOCK_N)
                phase = ((pairs_done + k) % 2) ^ 1
                for buf, half in ((0, 0), (1, 1), (0, 1), (1, 0)):
                    idx = idx0 if buf == 0 else idx1
                    cute.arch.mbarrier_wait(free + 2 * buf + half, phase)
                    # a buffer's first half carries its validity flags
                    gather_half(idx, buf, p_row, s_kv, row_bytes, kv_base, s_kv_base, d,
                                *half_tiles(half, d), s_valid, buf * BLOCK_N, wtid, half == buf)
                    cute.arch.cp_async_mbarrier_arrive_noinc(ready + 2 * buf + half)
                    cute.arch.mbarrier_arrive(ready + 2 * buf + half)
                idx0 = nxt0
                idx1 = nxt1
            pairs_done = pairs_done + n_pairs
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

    # ---- consumers ---------------------------------------------------------------------------

    @cute.jit
    def consume(self, w: cutlass.Constexpr, m_idx: cute.Tensor, m_len: cute.Tensor,
                m_sink: cute.Tensor, tma_o: cute.CopyAtom, m_out: cute.Tensor,
                m_lse: cute.Tensor, scale_log2: Float32, s_q: cute.Tensor,
                s_kv_all: cute.Tensor, s_v_layout: cute.ComposedLayout, s_p_own: cute.Tensor,
                s_p_peer: cute.Tensor, s_max: cute.Tensor, s_sum: cute.Tensor,
                s_valid: cute.Tensor, ready: cute.Pointer, free: cute.Pointer,
                q_ready: cute.Pointer, q_free: cute.Pointer, mma_s: cute.TiledMma,
                mma_pv: cute.TiledMma, mma_pv_rs: cute.TiledMma, bid: Int32, grid: Int32,
                n_mine: Int32, n_kv: Int32, tidx: Int32) -> None:
        """Consumer warpgroup ``w``: the blocks of buffer ``w``, value columns ``256 w ..``,
        tile after tile."""
        heads = self.heads
        wtid = tidx % WG_THREADS
        lane = cute.arch.lane_idx()
        peer = 1 - w
        wg_s = mma_s.get_slice(0)
        r_q = mma_s.make_fragment_A(wg_s.partition_A(s_q))             # (MMA, 1, D/16)
        r_k = mma_s.make_fragment_B(wg_s.partition_B(s_kv_all))        # (MMA, 1, D/16, 2)
        thr_s = mma_s.get_slice(wtid)
        c_s_mn = wg_rows_cols(thr_s.partition_C(cute.make_identity_tensor((BLOCK_H, BLOCK_N))))
        s_v = cute.make_tensor(s_kv_all.iterator + w * (HALF * BLOCK_N), s_v_layout.outer)
        wg_pv = mma_pv.get_slice(0)
        r_v = mma_pv.make_fragment_B(wg_pv.partition_B(s_v))           # (MMA, 1, 4, 2)
        r_p_peer = mma_pv.make_fragment_A(wg_pv.partition_A(s_p_peer))  # (MMA, 1, 4)
        r_v_rs = mma_pv_rs.make_fragment_B(mma_pv_rs.get_slice(0).partition_B(s_v))
        thr_pv = mma_pv.get_slice(wtid)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((BLOCK_H, HALF)), Float32)
        acc_o_mn = wg_rows_cols(acc_o)
        c_o = thr_pv.partition_C(cute.make_identity_tensor((BLOCK_H, HALF)))
        c_o_mn = wg_rows_cols(c_o)
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((BLOCK_H, BLOCK_N)), Float32)
        acc_s_mn = wg_rows_cols(acc_s)
        r_pb = cute.make_fragment_like(acc_s, BFloat16)  # this block's P, bf16
        r_pa = wg_acc_as_a(r_pb)                         # ... as the A operand of P V
        store_p = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                             BFloat16), mma_s)
        thr_store_p = store_p.get_slice(wtid)
        t_s_p = thr_store_p.partition_D(s_p_own)
        rows = cute.size(acc_s_mn, mode=[0])
        row_max = cute.make_rmem_tensor(rows, Float32)
        row_sum = cute.make_rmem_tensor(rows, Float32)

        pairs_done = Int32(0)  # block pairs of the earlier tiles: the mbarrier phases
        for i in cutlass.range(n_mine, unroll=1):
            t, hb, _, n_pairs = self.tile_rows(bid + i * grid, m_idx, m_len, n_kv)
            row_max.fill(M_FLOOR)
            row_sum.fill(0.0)
            acc_o.fill(0.0)
            cute.arch.mbarrier_wait(q_ready, i % 2)
            for k in cutlass.range(n_pairs, unroll=1):
                phase = (pairs_done + k) % 2
                if cutlass.const_expr(w == 0):
                    if k == 0:
                        self.issue_qk(0, 0, acc_s, r_q, r_k, mma_s, ready, phase, True)
                        self.issue_qk(0, 1, acc_s, r_q, r_k, mma_s, ready, phase, False)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)
                else:
                    self.issue_qk(1, 1, acc_s, r_q, r_k, mma_s, ready, phase, True)
                    self.issue_qk(1, 0, acc_s, r_q, r_k, mma_s, ready, phase, False)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                if k + 1 == n_pairs:  # the tile's last score GEMM is done: Q's bytes are free
                    cute.arch.mbarrier_arrive(q_free)
                part = self.masked_row_max(w, acc_s_mn, c_s_mn, s_valid, scale_log2)
                if cutlass.const_expr(w == 1):
                    # fold in warpgroup 0's max of its block: the pair's max
                    cute.arch.barrier(barrier_id=BAR_MAX0, number_of_threads=THREADS)
                    for r in cutlass.range_constexpr(rows):
                        part[r] = cute.arch.fmax(part[r], s_max[c_s_mn[r, 0][0]])
                    cute.arch.sync_warp()  # every lane has read s_max before it is overwritten
                m_new = [cute.arch.fmax(row_max[r], part[r]) for r in range(rows)]
                self.online_softmax(acc_s_mn, acc_o_mn, row_max, row_sum, m_new)
                if lane % 4 == 0:
                    for r in cutlass.range_constexpr(rows):
                        s_max[c_s_mn[r, 0][0]] = m_new[r]
                if cutlass.const_expr(w == 0):
                    cute.arch.barrier_arrive(barrier_id=BAR_MAX0, number_of_threads=THREADS)
                else:
                    cute.arch.barrier_arrive(barrier_id=BAR_MAX1, number_of_threads=THREADS)
                r_pb.store(acc_s.load().to(BFloat16))
                if cutlass.const_expr(w == 1):  # P is final: hand it over before it is in flight
                    cute.copy(store_p, thr_store_p.retile(r_pb), t_s_p)
                    cute.arch.fence_view_async_shared()  # P stores -> the peer's wgmma reads
                    cute.arch.barrier_arrive(barrier_id=BAR_P1, number_of_threads=THREADS)
                # O += P V with this warpgroup's P from registers
                wg_gemm(mma_pv_rs, acc_o, r_pa, r_v_rs, w, BLOCK_N // 16)
                if cutlass.const_expr(w == 0):
                    warpgroup.wait_group(0)
                    cute.arch.mbarrier_arrive(free + 0)  # 0L: read by this P V last
                    # the pair's max from warpgroup 1: rescale P, O and the row sum to it
                    cute.arch.barrier(barrier_id=BAR_MAX1, number_of_threads=THREADS)
                    rescale = cute.make_rmem_tensor(rows, Float32)
                    for r in cutlass.range_constexpr(rows):
                        m_pair = s_max[c_s_mn[r, 0][0]]
                        rescale[r] = cute.math.exp2(row_max[r] - m_pair, fastmath=True)
                        row_max[r] = m_pair
                        acc_s_mn[r, None] = acc_s_mn[r, None].load() * rescale[r]
                    r_pb.store(acc_s.load().to(BFloat16))
                    cute.copy(store_p, thr_store_p.retile(r_pb), t_s_p)
                    cute.arch.fence_view_async_shared()  # P stores -> the peer's wgmma reads
                    cute.arch.barrier_arrive(barrier_id=BAR_P0, number_of_threads=THREADS)
                    cute.arch.barrier(barrier_id=BAR_P1, number_of_threads=THREADS)
                    for r in cutlass.range_constexpr(rows):
                        acc_o_mn[r, None] = acc_o_mn[r, None].load() * rescale[r]
                        row_sum[r] = row_sum[r] * rescale[r]
                    warpgroup.fence()
                    self.issue_pv_peer(1, acc_o, r_p_peer, r_v, mma_pv)
                    if k + 1 < n_pairs:
                        nxt = (pairs_done + k + 1) % 2
                        self.issue_qk(0, 0, acc_s, r_q, r_k, mma_s, ready, nxt, True)
                        warpgroup.commit_group()
                        warpgroup.wait_group(1)
                        cute.arch.mbarrier_arrive(free + 2)  # 1L: read by the P V above last
                        self.issue_qk(0, 1, acc_s, r_q, r_k, mma_s, ready, nxt, False)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)
                    else:  # 1L stages this warpgroup's out: freed after the epilogue
                        warpgroup.wait_group(0)
                else:
                    cute.arch.barrier(barrier_id=BAR_P0, number_of_threads=THREADS)
                    self.issue_pv_peer(0, acc_o, r_p_peer, r_v, mma_pv)
                    warpgroup.wait_group(1)
                    cute.arch.mbarrier_arrive(free + 3)  # 1R: read by this warpgroup's P V last
                    warpgroup.wait_group(0)
                    if k + 1 < n_pairs:  # 0R (and warpgroup 0's P): the peer P V; the last
                        cute.arch.mbarrier_arrive(free + 1)  # pair's stages out first

            # ---- epilogue: the two row sums (same final max), lse, sink weight, out ------------
            # alternate halves of s_sum, tile by tile: no second barrier
            sums = cute.make_tensor(s_sum.iterator + (i % 2) * (2 * BLOCK_H),
                                    cute.make_layout(2 * BLOCK_H))
            for r in cutlass.range_constexpr(rows):
                total = quad_sum(row_sum[r])
                if lane % 4 == 0:
                    sums[w * BLOCK_H + c_o_mn[r, 0][0]] = total
            cute.arch.barrier(barrier_id=BAR_SUM, number_of_threads=THREADS)
            for r in cutlass.range_constexpr(rows):
                row = c_o_mn[r, 0][0]
                head = hb * BLOCK_H + row
                lse_val, factor = row_lse_and_factor(row_max[r], sums[row] + sums[BLOCK_H + row],
                                                     head, heads, m_sink)
                acc_o_mn[r, None] = acc_o_mn[r, None].load() * factor
                if cutlass.const_expr(w == 0):
                    if (lane % 4 == 0) & (head < heads):
                        m_lse[t, head] = lse_val
            if n_pairs > 0:
                # through the KV half this warpgroup read last (1L / 0R, columns 0-255 / 256-511
                # of its buffer), while the producer already loads the next tile's Q
                s_o = cute.local_tile(s_kv_all[None, None, 1 - w], (BLOCK_H, HALF), (0, w))
                self.store_out_tma(w, acc_o, mma_pv, s_o, tma_o, m_out, t, hb, wtid,
                                   free + 2 - w)
            else:  # no block, so no KV half of this tile: through Q's bytes
                s_o = cute.local_tile(s_q, (BLOCK_H, HALF), (0, w))
                self.store_out_tma(w, acc_o, mma_pv, s_o, tma_o, m_out, t, hb, wtid, q_free)
            pairs_done = pairs_done + n_pairs
        if wtid == 0:  # the last tile's out stores complete before the CTA exits
            cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def store_out_tma(self, w: cutlass.Constexpr, acc_o: cute.Tensor, mma_pv: cute.TiledMma,
                      s_o: cute.Tensor, tma_o: cute.CopyAtom, m_out: cute.Tensor, t: Int32,
                      hb: Int32, wtid: Int32, release: cute.Pointer) -> None:
        """Store warpgroup ``w``'s 64 x 256 half of ``out`` (fp32 ``acc_o``, final) as bf16
        through ``s_o``, a 64 x 256 shared tile no longer read (a KV half, or half of Q's bytes
        for a tile without blocks): register pairs into the 128-byte swizzled tile, then four
        64 x 64 TMA stores issued by one thread (head rows past ``heads`` clipped by the
        unit), which arrives on ``release`` once the unit has read the tile; the others arrive
        at once. The consumer warps issue no global stores, and the unit's global writes
        overlap the next tile."""
        r_o = cute.make_fragment_like(acc_o, BFloat16)
        r_o.store(acc_o.load().to(BFloat16))
        store_o = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                             BFloat16), mma_pv)
        thr_store = store_o.get_slice(wtid)
        cute.copy(store_o, thr_store.retile(r_o), thr_store.partition_D(s_o))
        cute.arch.fence_proxy("async.shared", space="cta")  # the stores -> the TMA unit's reads
        cute.arch.barrier(barrier_id=BAR_OUT[w], number_of_threads=WG_THREADS)
        if wtid == 0:
            g_o = m_out[None, None, t]
            for j in cutlass.range_constexpr(HALF_TILES):
                t_s, t_g = cpasync.tma_partition(
                    tma_o, 0, cute.make_layout(1),
                    cute.group_modes(cute.local_tile(s_o, (BLOCK_H, TILE), (0, j)), 0, 2),
                    cute.group_modes(cute.local_tile(g_o, (BLOCK_H, TILE),
                                                     (hb, w * HALF_TILES + j)), 0, 2))
                cute.copy(tma_o, t_s, t_g)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.mbarrier_arrive(release)

    @cute.jit
    def copy_head_rows(self, copy: cute.TiledCopy, src: cute.Tensor, dst: cute.Tensor,
                       row0: Int32) -> None:
        """Copy a thread's ``(CPY, passes, tiles)`` partitions of a 64-head tile, one pass of
        16 head rows at a time (its row in the first pass: ``row0``). Rows past ``heads`` are
        zero-filled in ``dst``."""
        for m in cutlass.range_constexpr(BLOCK_H // WS_ROWS_PER_PASS):
            if cutlass.const_expr(self.heads >= BLOCK_H):
                cute.copy(copy, src[None, m, None], dst[None, m, None])
            else:
                if row0 + m * WS_ROWS_PER_PASS < self.heads:
                    cute.copy(copy, src[None, m, None], dst[None, m, None])
                else:
                    dst[None, m, None].fill(0)

    @cute.jit
    def issue_qk(self, buf: cutlass.Constexpr, half: cutlass.Constexpr, acc_s: cute.Tensor,
                 r_q: cute.Tensor, r_k: cute.Tensor, mma_s: cute.TiledMma, ready: cute.Pointer,
                 phase: Int32, first: cutlass.Constexpr) -> None:
        """Wait for ``half`` of KV buffer ``buf`` and issue its part of ``S = Q K^T`` (no commit);
        ``first`` zero-fills the accumulator and fences it."""
        if cutlass.const_expr(first):
            acc_s.fill(0.0)
            warpgroup.fence()
        cute.arch.mbarrier_wait(ready + 2 * buf + half, phase)
        cute.arch.fence_view_async_shared()  # gathered rows (and zero-fills) -> wgmma reads
        lo, hi = half_tiles(half, self.d_qk)
        for kk in cutlass.range_constexpr(lo * (TILE // 16), hi * (TILE // 16)):
            cute.gemm(mma_s, acc_s, r_q[None, None, kk], r_k[None, None, kk, buf], acc_s)

    @cute.jit
    def issue_pv_peer(self, buf: cutlass.Constexpr, acc_o: cute.Tensor, r_p_peer: cute.Tensor,
                      r_v: cute.Tensor, mma_pv: cute.TiledMma) -> None:
        """``O += P_peer V`` over this warpgroup's value columns of buffer ``buf`` (committed)."""
        for kk in cutlass.range_constexpr(BLOCK_N // 16):
            cute.gemm(mma_pv, acc_o, r_p_peer[None, None, kk], r_v[None, None, kk, buf], acc_o)
        warpgroup.commit_group()

    @cute.jit
    def masked_row_max(self, buf: cutlass.Constexpr, acc_s_mn: cute.Tensor,
                       c_s_mn: cute.Tensor, s_valid: cute.Tensor, scale_log2: Float32) -> list:
        """Scale the scores into base-2 units, set invalid slots to -inf (before any exp) and
        return each row's max over the block."""
        rows = cute.size(acc_s_mn, mode=[0])
        cols = cute.size(acc_s_mn, mode=[1])
        # every row of this thread has the same columns: one flag load per column
        valid = [s_valid[buf * BLOCK_N + c_s_mn[0, j][1]] for j in range(cols)]
        out = []
        for r in cutlass.range_constexpr(rows):
            part = Float32(-_INF)
            for j in cutlass.range_constexpr(cols):
                val = acc_s_mn[r, j] * scale_log2
                if valid[j] == 0:
                    val = Float32(-_INF)
                acc_s_mn[r, j] = val
                part = cute.arch.fmax(part, val)
            out.append(quad_max(part))
        return out

    @cute.jit
    def online_softmax(self, acc_s_mn: cute.Tensor, acc_o_mn: cute.Tensor,
                       row_max: cute.Tensor, row_sum: cute.Tensor, m_new: list) -> None:
        """``P = exp2(S - m_new)`` in place; ``O`` and the row sum rescaled to ``m_new``."""
        for r in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[0])):
            corr = cute.math.exp2(row_max[r] - m_new[r], fastmath=True)
            psum = Float32(0.0)
            for j in cutlass.range_constexpr(cute.size(acc_s_mn, mode=[1])):
                p = cute.math.exp2(acc_s_mn[r, j] - m_new[r], fastmath=True)
                acc_s_mn[r, j] = p
                psum = psum + p
            row_sum[r] = row_sum[r] * corr + psum
            row_max[r] = m_new[r]
            acc_o_mn[r, None] = acc_o_mn[r, None].load() * corr


@cute.jit
def gather_half(idx: list, buf: cutlass.Constexpr, p_row: Int32, s_kv: Int32,
                row_bytes: Int64, kv_base: Int64, s_kv_base: Int32, d: cutlass.Constexpr,
                lo: cutlass.Constexpr, hi: cutlass.Constexpr, s_flags: cute.Tensor,
                flag_base: Int32, wtid: Int32, flags: cutlass.Constexpr) -> None:
    """A producer thread's share of column tiles ``[lo, hi)`` of KV buffer ``buf``'s block:
    16-byte chunk ``wtid % 8`` of each 128-byte tile of its rows ``p_row + 16 m`` (row
    ``idx[m]`` of KV) into the buffer's 64-row slabs (the KV layout of
    :func:`~dsa_aot.kernels.cutedsl_fwd.wg_smem_layouts`), branch-free
    (:func:`~dsa_aot.kernels.cutedsl_common.gather_row_zfill`); with ``flags``, each row's
    validity into ``s_flags[flag_base + row]``."""
    j = wtid % (TILE // VEC)
    for m in cutlass.range_constexpr(BLOCK_N // WS_ROWS_PER_PASS):
        row = p_row + m * WS_ROWS_PER_PASS
        valid, _ = gather_row_zfill(idx[m], s_kv, j, row, kv_base, row_bytes,
                                    s_kv_base + buf * (BLOCK_N * d * 2), BLOCK_N, lo, hi)
        if cutlass.const_expr(flags):
            if j == 0:
                s_flags[flag_base + row] = Int32(1) if valid else Int32(0)


def head_blocks(heads: int) -> int:
    """CTAs per query row: one per block of 64 heads."""
    return (heads + BLOCK_H - 1) // BLOCK_H


def cta_count(s_q: Int32, heads: int, num_sms: Int32) -> Int32:
    """The persistent grid: one CTA per SM (``num_sms``, at least one per head block), at most
    one per tile; a multiple of the head blocks per row, so CTA ``b`` and its neighbours run the
    head blocks of one row at every step."""
    n = head_blocks(heads)
    ctas = cutlass.max(num_sms - num_sms % n, Int32(n))
    return cutlass.min(s_q * n, ctas)


def half_tiles(half: int, d_qk: int) -> tuple[int, int]:
    """The 64-column tiles ``[lo, hi)`` of half ``half`` of a KV buffer (L: value columns 0-255;
    R: 256 to the end, RoPE included)."""
    return (0, HALF_TILES) if half == 0 else (HALF_TILES, d_qk // TILE)


class SparseMlaFwdSplitCompact(SparseMlaFwdSplit):
    """Entry point of the compact layout (``topk_length`` given)."""

    @cute.jit
    def __call__(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor,
                 topk_length: cute.Tensor, attn_sink: cute.Tensor, out: cute.Tensor,
                 lse: cute.Tensor, softmax_scale: Float32, num_sms: Int32,
                 stream: cuda.CUstream) -> None:
        self.launch(q, kv, topk_idxs, topk_length, attn_sink, out, lse, softmax_scale, num_sms,
                    stream)


class SparseMlaFwdSplitNoncompact(SparseMlaFwdSplit):
    """Entry point of the noncompact layout (padding marked by out-of-range indices)."""

    @cute.jit
    def __call__(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor,
                 attn_sink: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
                 softmax_scale: Float32, num_sms: Int32, stream: cuda.CUstream) -> None:
        self.launch(q, kv, topk_idxs, topk_idxs, attn_sink, out, lse, softmax_scale, num_sms,
                    stream)


def compile_fwd_split(arch: str, d_qk: int, heads: int, layout: str,
                      kv_stages: int | None = None, impl: str = IMPL,
                      extra_options: str = "") -> tuple[object, dict[str, object]]:
    """``cute.compile`` this flavour for ``arch`` (sm_90a; ``CUTE_DSL_ARCH`` set before import);
    see :func:`~dsa_aot.kernels.cutedsl_fwd.compile_entry`."""
    return compile_entry(SparseMlaFwdSplitCompact, SparseMlaFwdSplitNoncompact, arch, d_qk,
                         heads, layout, kv_stages, impl, extra_options)


__all__ = ["IMPL", "SparseMlaFwdSplit", "SparseMlaFwdSplitCompact", "SparseMlaFwdSplitNoncompact",
           "compile_fwd_split"]
