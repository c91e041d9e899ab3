"""CuTe DSL sparse MLA backward, main stage, slot-major with warpgroups by role
(``impl="wgmma_ws_slot_major"``, sm_90a, H 16 / 32).

The same arguments, C ABI and semantics as :mod:`dsa_aot.kernels.cutedsl_bwd_main` (see there:
``q``, ``kv``, ``dout``, ``topk_idxs``, [``topk_length``], ``lse_sink``, ``delta``, ``dq``,
``dkv_acc``, ``softmax_scale``, stream), for the small head counts :data:`HEADS` only.

Why: :mod:`.cutedsl_bwd_slot_major` runs both warpgroups through the same phases in step, so the
L2 gets no dKV atomics while a block is gathered, scored and its ``dQ^T`` accumulated (85% busy
at H 32 D 576, where the atomics alone are the floor). :mod:`.cutedsl_bwd_ws` hides that phase
at H 64 / 128 by giving the two warpgroups different roles one block apart; this kernel does the
same in the slot-major orientation (the gathered slots on the MMA M dimension, the heads on N:
nothing padded):

* warpgroup 0, *score*: gathers the block's 64 KV rows (16-byte ``cp.async``, invalid slots
  zero-filled and flagged); ``S^T [slots x H] = K Q^T`` and ``dP^T = V dO^T`` (A: the KV tile,
  B: ``q`` / ``dout``, k-steps interleaved, the first overwriting: wgmma scale-d 0);
  ``P^T`` and ``dS^T`` (:func:`~dsa_aot.kernels.cutedsl_bwd_slot_major.softmax_grad_slot_major`);
  stores ``P`` and ``dS`` (bf16, ``[H, slots]`` tiles) for warpgroup 1; then every ``dQ^T``
  row tile ``+= K^T dS^T`` (A: the KV tile viewed MN-major, B: ``dS``), so the KV tile has no
  other reader and the next block's gather follows its own ``dQ^T`` MMAs without a hand-off;
* warpgroup 1, *dKV*: ``dKV = dS^T Q + P^T dO`` in 64-column chunks (A: ``dS^T`` / ``P^T``, the
  ``P`` / ``dS`` tiles viewed MN-major; B: ``q`` / ``dout`` viewed MN-major; K: the heads), the
  chunk GEMMs alternating between two accumulators so that chunk ``c``'s MMAs overlap chunk
  ``c - 1``'s 4-wide ``red.global.add.v4.f32`` atomics
  (:meth:`~dsa_aot.kernels.cutedsl_bwd_main.SparseMlaBwdMain.scatter_chunk`); it never waits on
  a gather, so the atomics of block ``b`` stream while block ``b + 1`` is gathered and scored.

Hand-offs (named barriers of all 256 threads; ``->`` arrive, ``<-`` wait), per block ``b``:

- warpgroup 0: gather ``b`` in; ``S^T``, ``dP^T``, softmax gradient; ``<- PDS_EMPTY`` (block
  ``b - 1``'s ``P`` / ``dS`` read by warpgroup 1's MMAs, and its slot indices read); ``P``, ``dS``
  to shared; ``-> PDS_FULL``; its ``dQ^T`` MMAs; gather ``b + 1`` (indices into the other half
  of the double-buffered index arrays);
- warpgroup 1: ``<- PDS_FULL``; the dKV chunks and their atomics; ``-> PDS_EMPTY`` when the last
  chunk's MMAs are done; the last chunk's atomics.

Shared memory: :mod:`.cutedsl_bwd_ws`'s struct for H heads (``q`` [H, d], ``dout`` [H, 512],
one 64-slot KV tile, ``P`` and ``dS`` [H, 64], indices, ``lse`` and ``delta``: 151,552 bytes of
tiles at H 32 D 576), one CTA of two warpgroups per SM (registers: 198-236 a thread). ``dQ^T``
(``D x H`` fp32) stays in warpgroup 0's registers over the row and is stored as bf16 at the end
(0 for a row without a valid slot); in ``impl="wgmma_ws_dq_lines"``
(:attr:`~dsa_aot.kernels.cutedsl_bwd_ws.SparseMlaBwdWs.DQ_STAGED`, :func:`compile_bwd_dq_lines`)
it goes out through the free KV tile, head ``h`` into KV row ``h``, then 16 bytes a lane in
whole 128-byte lines instead of 2 bytes an element. Warpgroup 1 is
:meth:`~dsa_aot.kernels.cutedsl_bwd_ws.SparseMlaBwdWs.dkv_warpgroup` with no ``dQ`` tiles.

Deterministic mode (``deterministic=True``): each valid slot's dKV row is stored (bf16) into
``dkv_rows`` [s_q * topk, 1, D] instead of added atomically, as in :mod:`.cutedsl_bwd_ws`. With
``impl="wgmma_ws_slot_major_fixed"``: int32 fixed-point adds into ``dkv_fixed``, as there; the dKV warpgroup first copies the block's KV rows out of the
double-buffered index array (the score warpgroup refills it for block ``b + 2`` once
``PDS_EMPTY`` is passed, which is before the last chunk's adds).

Status: the sm_90a fast mode's default at H16/H32 (1.15x the cuDNN frontend at H32 D576 on the
H200, where ``wgmma_slot_major`` gives 1.05x; ``bench/results/h200_bwd_ws_slot_major.md``). Its
stored-rows deterministic mode is opt-in: without atomics to hide, ``wgmma_slot_major``'s even
split of the work is faster.

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import hopper_helpers as sm90_utils

from dsa_aot.kernels import cutedsl_bwd_main as main
from dsa_aot.kernels import cutedsl_bwd_ws as ws
from dsa_aot.kernels.cutedsl_bwd_main import (LOG2E, DeterministicCompactEntry,
                                              DeterministicNoncompactEntry,
                                              FixedPointCompactEntry,
                                              FixedPointNoncompactEntry, SparseMlaBwdMain,
                                              SparseMlaBwdMainCompact, SparseMlaBwdMainNoncompact,
                                              compile_flavour, score_gemms)
from dsa_aot.kernels.cutedsl_bwd_slot_major import (slot_major_tiled_ops,
                                                    softmax_grad_slot_major)
from dsa_aot.kernels.cutedsl_bwd_ws import (BAR_PDS_EMPTY, BAR_PDS_FULL, BAR_SCORE, BLOCK_N,
                                            LAYOUT_ORDER, THREADS, TILE, WG_THREADS,
                                            SparseMlaBwdWs)
from dsa_aot.kernels.cutedsl_common import (D_QK_CHOICES, LAYOUTS, VEC, store_staged_row,
                                            wg_rows_cols)

#: The ``impl`` name of this flavour (the build's ``tile.flavour``).
IMPL = "wgmma_ws_slot_major"
#: ... and of its fixed-point deterministic mode (the default deterministic mode stores rows)
FIXED_IMPL = "wgmma_ws_slot_major_fixed"
#: Head counts this flavour supports (the MMA N of the score and ``dQ^T`` GEMMs).
HEADS = (16, 32)

# 64-slot blocks (``BLOCK_N``, the MMA M of the score and dKV GEMMs), 64-wide ``dQ^T`` row
# tiles and dKV chunks (``TILE``), 2 x 128 threads and the named barriers: those of
# :mod:`.cutedsl_bwd_ws` (``BAR_KV_EMPTY`` unused: warpgroup 0 is the KV tile's only reader)


def check_params(d_qk: int, heads: int, layout: str, arch: str = "sm_90a") -> None:
    """Raise ``ValueError`` naming the compile-time parameter this flavour cannot take."""
    main.check_params(d_qk, heads, layout)
    if heads not in HEADS:
        raise ValueError(f"heads={heads!r}: impl={IMPL!r} supports heads {HEADS}; use "
                         "impl='wgmma_ws' (or leave impl unset) for more heads")
    if arch != "sm_90a":
        raise ValueError(f"impl={IMPL!r} needs sm_90a, not {arch}; use impl='mma'")


def can_implement(d_qk: int, heads: int, layout: str) -> bool:
    """Whether this flavour supports the compile-time parameters (no exception)."""
    return d_qk in D_QK_CHOICES and heads in HEADS and layout in LAYOUTS


def ws_slot_major_smem_layouts(d_qk: int, heads: int) -> dict[str, cute.ComposedLayout]:
    """Shared-memory layouts (call while tracing a ``cute.jit`` function): those of
    :func:`~dsa_aot.kernels.cutedsl_bwd_ws.ws_smem_layouts` for ``heads`` heads (``q`` [H, d_qk],
    ``dout`` [H, 512], ``kv`` [64 slots, d_qk], ``p`` / ``dS`` [H, 64 slots] and their MN-major
    views ``q_t``, ``dout_t``, ``kv_t``, ``p_t``)."""
    return ws.ws_smem_layouts(d_qk, heads)


def shared_storage(d_qk: int, heads: int,
                   fixed_point: bool = False) -> tuple[dict[str, cute.ComposedLayout], type]:
    """The layouts of :func:`ws_slot_major_smem_layouts` and the kernel's shared-memory struct
    (call while tracing; ``size_in_bytes()`` is the dynamic shared memory of one CTA)."""
    return ws.shared_storage(d_qk, heads, fixed_point)


class SparseMlaBwdWsSlotMajor(SparseMlaBwdWs):
    """The slot-major backward main kernel with a score and a dKV warpgroup, for one
    ``(d_qk, heads, layout)``: warpgroup 1 is :meth:`SparseMlaBwdWs.dkv_warpgroup` with every
    ``dQ^T`` tile on warpgroup 0."""

    def __init__(self, d_qk: int, heads: int, layout: str, atomic_width: int = 4,
                 scatter: bool = True, deterministic: bool = False,
                 fixed_point: bool = False) -> None:
        check_params(d_qk, heads, layout)
        SparseMlaBwdMain.__init__(self, d_qk, heads, layout, atomic_width=atomic_width,
                                  scatter=scatter, impl="wgmma", deterministic=deterministic)
        self.impl = IMPL
        self.fixed_point = deterministic and fixed_point
        self.copy_rows = True  # block b + 2's gather follows PDS_EMPTY (see dkv_warpgroup)
        self.gather_threads = WG_THREADS  # warpgroup 0 gathers, 64 rows a block
        self.score_dq_tiles = d_qk // TILE  # every dQ^T tile: warpgroup 1 computes none
        self.cta_heads = heads

    # ---------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def launch(self, q: cute.Tensor, kv: cute.Tensor, dout: cute.Tensor, topk_idxs: cute.Tensor,
               topk_length: cute.Tensor, lse_sink: cute.Tensor, delta: cute.Tensor,
               dq: cute.Tensor, dkv_acc: cute.Tensor, softmax_scale: Float32,
               stream: cuda.CUstream, rows: tuple | None = None) -> None:
        heads = self.heads
        # q / dout rows by one warpgroup each; S^T / dP^T (64 slots, H); dQ^T (64 rows of D, H)
        row_copy, mma_s, mma_dq = slot_major_tiled_ops(heads)
        # dKV chunk: (64 slots, 64 columns), A = dS^T / P^T (MN-major views of the [H, slots]
        # tiles), B = q / dout viewed (columns, heads) (MN-major)
        mma_kv = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (BLOCK_N, TILE))
        def kernel_args() -> tuple:
            lay, SharedStorage = shared_storage(self.d_qk, heads, self.fixed_point)
            # warpgroup 1 takes no dQ^T tile: mma_dq is the score warpgroup's alone
            return (q, kv, dout, topk_idxs, topk_length, lse_sink, delta, dq, dkv_acc,
                    softmax_scale, *(lay[name] for name in LAYOUT_ORDER), row_copy, mma_s, mma_dq,
                    mma_dq, mma_kv), SharedStorage

        self.launch_rows(kernel_args, cute.size(q, mode=[0]), 1, rows, stream)

    # ---------------------------------------------------------------------------------------
    # Device side (the entry is :meth:`SparseMlaBwdWs.kernel_ws`)
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def load_query_row(self, t: Int32, hb: Int32, m_q: cute.Tensor, m_do: cute.Tensor,
                       m_lse: cute.Tensor, m_delta: cute.Tensor, sm: dict,
                       row_copy: cute.TiledCopy, tidx: Int32, wtid: Int32, wg: Int32) -> None:
        """``q`` by warpgroup 0, ``dout`` by warpgroup 1 (``cp.async``, 16 rows a pass), and
        row ``t``'s ``lse`` (base 2) and ``delta`` (no commit)."""
        thr_row = row_copy.get_slice(wtid)
        if wg == 0:
            cute.copy(row_copy, thr_row.partition_S(m_q[t, None, None]),
                      thr_row.partition_D(sm["q"]))
        else:
            cute.copy(row_copy, thr_row.partition_S(m_do[t, None, None]),
                      thr_row.partition_D(sm["do"]))
        if tidx < self.heads:
            sm["lse"][tidx] = m_lse[t, tidx] * Float32(LOG2E)
            sm["delta"][tidx] = m_delta[t, tidx]

    @cute.jit
    def score_warpgroup(self, t: Int32, hb: Int32, n_blocks: Int32, n_slots: Int32,
                        m_idx: cute.Tensor, m_dq: cute.Tensor, softmax_scale: Float32, sm: dict,
                        gather_args: list, mma_s: cute.TiledMma, mma_dq: cute.TiledMma,
                        wtid: Int32) -> None:
        """Warpgroup 0 over the row's blocks: the gathers, ``S^T``, ``dP^T``, ``P``, ``dS`` and
        every ``dQ^T`` tile; stores ``dq`` at the end (``hb`` is 0: one CTA a row)."""
        d = self.d_qk
        heads = self.heads
        n_tiles = d // TILE
        scale_log2 = softmax_scale * Float32(LOG2E)
        mma_dq.set(warpgroup.Field.ACCUMULATE, True)
        wg_s = mma_s.get_slice(0)
        wg_dq = mma_dq.get_slice(0)
        r_k = mma_s.make_fragment_A(wg_s.partition_A(sm["kv"]))      # (MMA, 1, d/16)
        r_q = mma_s.make_fragment_B(wg_s.partition_B(sm["q"]))       # (MMA, 1, d/16)
        r_do = mma_s.make_fragment_B(wg_s.partition_B(sm["do"]))     # (MMA, 1, 32)
        r_dsb = mma_dq.make_fragment_B(wg_dq.partition_B(sm["ds"]))  # (MMA, 1, 4)
        r_kt = [mma_dq.make_fragment_A(wg_dq.partition_A(                # (MMA, 1, 4) each
            cute.local_tile(sm["kt"], (TILE, BLOCK_N), (i, 0)))) for i in range(n_tiles)]
        thr_s = mma_s.get_slice(wtid)
        thr_dq = mma_dq.get_slice(wtid)
        acc_shape = thr_s.partition_shape_C((BLOCK_N, heads))
        acc_dq = [cute.make_rmem_tensor(thr_dq.partition_shape_C((TILE, heads)), Float32)
                  for _ in range(n_tiles)]
        for i in cutlass.range_constexpr(n_tiles):
            acc_dq[i].fill(0.0)
        coords = wg_rows_cols(thr_s.partition_C(cute.make_identity_tensor((BLOCK_N, heads))))
        store_c = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                             BFloat16), mma_s)
        thr_store_c = store_c.get_slice(wtid)
        t_s_p_c = thr_store_c.partition_D(sm["pt"])    # P^T / dS^T stored through the
        t_s_ds_c = thr_store_c.partition_D(sm["dst"])  # (slot, h) views of the [h, slot] tiles
        row_in_pass = wtid // (TILE // VEC)

        for b in cutlass.range(n_blocks, unroll=1):
            buf = (b % 2) * BLOCK_N
            upcoming = self.load_indices(b + 1, t, m_idx, n_slots, row_in_pass)
            if b > 0:  # this warpgroup's gather of block b is in; make it visible to all of it
                cute.arch.cp_async_wait_group(0)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=BAR_SCORE, number_of_threads=WG_THREADS)

            # S^T = K Q^T and dP^T = V dO^T, interleaved k-steps; k = 0 overwrites
            acc_s, acc_dp = score_gemms(mma_s, acc_shape, r_q, r_do, r_k, d, kv_is_a=True)
            softmax_grad_slot_major(acc_s, acc_dp, coords, sm["valid"], buf, sm["lse"],
                                    sm["delta"], scale_log2, softmax_scale)
            r_p16 = cute.make_fragment_like(acc_s, BFloat16)
            r_p16.store(acc_s.load().to(BFloat16))
            r_ds16 = cute.make_fragment_like(acc_dp, BFloat16)
            r_ds16.store(acc_dp.load().to(BFloat16))

            # hand P and dS over once warpgroup 1's MMAs of the previous block are done (it has
            # read that block's indices too: the next gather may overwrite them)
            if b > 0:
                cute.arch.barrier(barrier_id=BAR_PDS_EMPTY, number_of_threads=THREADS)
            cute.copy(store_c, thr_store_c.retile(r_p16), t_s_p_c)
            cute.copy(store_c, thr_store_c.retile(r_ds16), t_s_ds_c)
            cute.arch.fence_view_async_shared()  # P / dS stores -> wgmma reads (both warpgroups)
            cute.arch.barrier_arrive(barrier_id=BAR_PDS_FULL, number_of_threads=THREADS)
            cute.arch.barrier(barrier_id=BAR_SCORE, number_of_threads=WG_THREADS)

            # dQ^T += K^T dS^T, every row tile of D; the KV tile's last read of this block
            warpgroup.fence()
            for i in cutlass.range_constexpr(n_tiles):
                for k in cutlass.range_constexpr(BLOCK_N // 16):
                    cute.gemm(mma_dq, acc_dq[i], r_kt[i][None, None, k], r_dsb[None, None, k],
                              acc_dq[i])
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            # the next block into the KV tile (every warp of this warpgroup is past its dQ^T
            # MMAs: a warp's wait covers its own wgmmas only)
            if b + 1 < n_blocks:
                cute.arch.barrier(barrier_id=BAR_SCORE, number_of_threads=WG_THREADS)
                self.gather(upcoming, BLOCK_N - buf, *gather_args)
                cute.arch.cp_async_commit_group()

        # ---- dq[t, h, d] = dQ^T[d, h] in bf16 -------------------------------------------------
        if cutlass.const_expr(self.DQ_STAGED):
            self.store_dq_t_staged(t, m_dq, acc_dq, mma_dq, sm, wtid)
        else:
            c_dq = thr_dq.partition_C(cute.make_identity_tensor((TILE, heads)))
            g_dq = m_dq[t, None, None]  # (h, d)
            for i in cutlass.range_constexpr(n_tiles):
                r_o = cute.make_fragment_like(acc_dq[i], BFloat16)
                r_o.store(acc_dq[i].load().to(BFloat16))
                for e in cutlass.range_constexpr(cute.size(r_o)):
                    g_dq[c_dq[e][1], i * TILE + c_dq[e][0]] = r_o[e]

    @cute.jit
    def store_dq_t_staged(self, t: Int32, m_dq: cute.Tensor, acc_dq: list,
                          mma_dq: cute.TiledMma, sm: dict, wtid: Int32) -> None:
        """Row ``t``'s dq through the KV tile (:attr:`DQ_STAGED`): each ``dQ^T`` tile as bf16
        into the tile's MN-major view, so that head ``h`` lands in KV row ``h`` (the default
        writes 2 bytes an element, a quarter sector in each of 4 heads a store); then each row
        read back and stored 16 bytes a lane, 8 lanes a 128-byte line. The KV tile is free: its
        only reader is this warpgroup's ``dQ^T`` MMAs, done once every warp has passed the
        first barrier."""
        heads = self.heads
        copy_c = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                            BFloat16), mma_dq)
        thr_c = copy_c.get_slice(wtid)
        cute.arch.barrier(barrier_id=BAR_SCORE, number_of_threads=WG_THREADS)
        for i in cutlass.range_constexpr(len(acc_dq)):
            r_o = cute.make_fragment_like(acc_dq[i], BFloat16)
            r_o.store(acc_dq[i].load().to(BFloat16))
            s_tile = cute.local_tile(sm["kt"], (TILE, heads), (i, 0))  # (d, h) of KV rows 0..H
            cute.copy(copy_c, thr_c.retile(r_o), thr_c.partition_D(s_tile))
        cute.arch.barrier(barrier_id=BAR_SCORE, number_of_threads=WG_THREADS)
        chunk = wtid % (TILE // VEC)
        s_base = sm["kv"].iterator.toint()
        g_base = m_dq.iterator.toint() + Int64(t) * Int64(m_dq.stride[0]) * 2 + chunk * VEC * 2
        rows_a_pass = WG_THREADS // (TILE // VEC)
        for p in cutlass.range_constexpr(heads // rows_a_pass):
            r = p * rows_a_pass + wtid // (TILE // VEC)
            store_staged_row(s_base, BLOCK_N, r, chunk, range(len(acc_dq)),
                             g_base + Int64(r) * Int64(m_dq.stride[1]) * 2)


class SparseMlaBwdWsSlotMajorCompact(SparseMlaBwdWsSlotMajor, SparseMlaBwdMainCompact):
    """Entry point of the compact layout (``topk_length`` given)."""


class SparseMlaBwdWsSlotMajorNoncompact(SparseMlaBwdWsSlotMajor, SparseMlaBwdMainNoncompact):
    """Entry point of the noncompact layout (padding marked by out-of-range indices)."""


class SparseMlaBwdWsSlotMajorCompactDeterministic(DeterministicCompactEntry,
                                                  SparseMlaBwdWsSlotMajor):
    """Entry point of the deterministic mode (stored rows), compact layout."""


class SparseMlaBwdWsSlotMajorNoncompactDeterministic(DeterministicNoncompactEntry,
                                                     SparseMlaBwdWsSlotMajor):
    """Entry point of the deterministic mode (stored rows), noncompact layout."""


class SparseMlaBwdWsSlotMajorCompactFixedPoint(FixedPointCompactEntry, SparseMlaBwdWsSlotMajor):
    """Entry point of the fixed-point deterministic mode, compact layout."""


class SparseMlaBwdWsSlotMajorNoncompactFixedPoint(FixedPointNoncompactEntry,
                                                  SparseMlaBwdWsSlotMajor):
    """Entry point of the fixed-point deterministic mode, noncompact layout."""


class SparseMlaBwdWsSlotMajorCompactDqLines(ws.DqLinesEntry, SparseMlaBwdWsSlotMajorCompact):
    """Entry point of ``impl=wgmma_ws_dq_lines`` at H16/H32, compact layout."""


class SparseMlaBwdWsSlotMajorNoncompactDqLines(ws.DqLinesEntry, SparseMlaBwdWsSlotMajorNoncompact):
    """Entry point of ``impl=wgmma_ws_dq_lines`` at H16/H32, noncompact layout."""


def compile_bwd_ws_slot_major(arch: str, d_qk: int, heads: int, layout: str,
                              atomic_width: int = 4, scatter: bool = True, impl: str = IMPL,
                              extra_options: str = "",
                              deterministic: bool = False) -> tuple[object, dict[str, object]]:
    """``cute.compile`` this kernel for ``arch`` (sm_90a; ``CUTE_DSL_ARCH`` set before import).
    Returns the compiled function and the fake arguments (those of
    :func:`~dsa_aot.kernels.cutedsl_bwd_main.fake_arguments`) it was compiled with. ``impl`` is
    the build's flavour name, this module's (:data:`IMPL`, or :data:`FIXED_IMPL` for the
    fixed-point deterministic mode)."""
    entries = {(False, "compact"): SparseMlaBwdWsSlotMajorCompact,
               (False, "noncompact"): SparseMlaBwdWsSlotMajorNoncompact,
               (True, "compact"): SparseMlaBwdWsSlotMajorCompactDeterministic,
               (True, "noncompact"): SparseMlaBwdWsSlotMajorNoncompactDeterministic,
               (True, "compact", True): SparseMlaBwdWsSlotMajorCompactFixedPoint,
               (True, "noncompact", True): SparseMlaBwdWsSlotMajorNoncompactFixedPoint}
    return compile_flavour(entries, IMPL, check_params, arch, d_qk, heads, layout, atomic_width,
                           scatter, impl, extra_options, deterministic)


def compile_bwd_dq_lines(arch: str, d_qk: int, heads: int, layout: str, atomic_width: int = 4,
                         scatter: bool = True, impl: str = ws.DQ_LINES_IMPL, extra_options: str = "",
                         deterministic: bool = False) -> tuple[object, dict[str, object]]:
    """``cute.compile`` ``impl=wgmma_ws_dq_lines`` (:data:`~.cutedsl_bwd_ws.DQ_LINES_IMPL`) at
    any head count: the fast mode's default kernel of that count (this module's at H16/H32,
    :mod:`.cutedsl_bwd_ws`'s at H64/H128, staggered at H128) with dQ stored through the KV tile
    in whole 128-byte lines. Returns what :func:`compile_bwd_ws_slot_major` returns."""
    if heads in ws.HEADS:
        return ws.compile_bwd_ws(arch, d_qk, heads, layout, atomic_width, scatter, impl,
                                 extra_options, deterministic)
    if deterministic:
        raise ValueError(f"impl={impl!r} is a fast mode: pass deterministic=False (the "
                         f"deterministic modes store no dQ differently)")
    entries = {(False, "compact"): SparseMlaBwdWsSlotMajorCompactDqLines,
               (False, "noncompact"): SparseMlaBwdWsSlotMajorNoncompactDqLines}
    return compile_flavour(entries, ws.DQ_LINES_IMPL, check_params, arch, d_qk, heads, layout,
                           atomic_width, scatter, impl, extra_options, deterministic)


__all__ = ["FIXED_IMPL", "HEADS", "IMPL", "SparseMlaBwdWsSlotMajor", "SparseMlaBwdWsSlotMajorCompact",
           "SparseMlaBwdWsSlotMajorCompactDeterministic", "SparseMlaBwdWsSlotMajorNoncompact",
           "SparseMlaBwdWsSlotMajorNoncompactDeterministic", "can_implement", "check_params",
           "SparseMlaBwdWsSlotMajorCompactDqLines", "SparseMlaBwdWsSlotMajorNoncompactDqLines",
           "compile_bwd_dq_lines", "compile_bwd_ws_slot_major", "ws_slot_major_smem_layouts"]
