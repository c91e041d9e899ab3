"""CuTe DSL sparse MLA backward, main stage, slot-major (``impl="wgmma_slot_major"``, sm_90a).

The same arguments, C ABI and semantics as :mod:`dsa_aot.kernels.cutedsl_bwd_main` (see there:
``q``, ``kv``, ``dout``, ``topk_idxs``, [``topk_length``], ``lse_sink``, ``delta``, ``dq``,
``dkv_acc``, ``softmax_scale``, stream), for the small head counts :data:`HEADS` (16, 32) only.

Why: the ``wgmma`` flavour puts 64 heads on the MMA M dimension, so at H 16 / 32 three quarters /
half of its tensor-core work multiplies zero padding. Here the gathered top-k *slots* are the M
dimension and the heads the N dimension (a warpgroup MMA's N may be 16 or 32), so nothing is
padded:

* ``S^T [slots x H] = K_blk Q^T`` and ``dP^T = V_blk dO^T`` (A: the gathered KV tile, K-major;
  B: ``q`` / ``dout``, K-major);
* ``P^T = exp2(S^T * scale * log2 e - lse_sink[h] * log2 e)`` (an invalid slot's exponent is
  ``-inf`` before the ``exp2``), ``dS^T = P^T * (dP^T - delta[h]) * scale``: ``lse`` and
  ``delta`` are per column (head);
* ``dKV_blk [slots x D] = dS^T Q (+ P^T dO, the first 512 columns)`` in 64-column chunks, with
  ``dS^T`` / ``P^T`` as the A operand straight from the registers that computed them (B: ``q`` /
  ``dout`` viewed MN-major); each chunk is added to ``dkv_acc`` at valid slots with the 4-wide
  ``red.global.add.v4.f32`` of :meth:`SparseMlaBwdMain.scatter_chunk`, and the chunk GEMMs
  alternate between two accumulators so chunk ``c``'s MMAs overlap chunk ``c - 1``'s atomics;
  the first k-step of the ``S^T``, ``dP^T`` and dKV GEMMs overwrites the accumulator (wgmma
  scale-d 0, no zero-fill), ``S^T`` and ``dP^T`` interleaving their k-steps;
* ``dQ^T [D x H] += K_blk^T dS^T`` (A: the KV tile viewed MN-major, 64 rows of ``D`` per MMA;
  B: ``dS`` [H x slots] from shared memory, K-major), in registers over the whole row, written as
  bf16 at the end (0 for a row without a valid slot).

Block shape (why): one CTA of two warpgroups per query row (all H heads), the row's slots walked
in blocks of :data:`SLOTS` = 128, warpgroup ``w`` owning slots ``64 w .. 64 w + 63`` of a block
for ``S^T``, ``dP^T``, ``P``/``dS`` and its dKV rows. Owning a full 64 x H slab lets each
warpgroup feed its dKV GEMMs from registers (no ``P`` tile in shared memory, no barrier before
them). ``dQ^T`` needs every slot of the block, so ``dS`` goes to shared memory once and the 64-row
tiles of ``D`` are split between the warpgroups (tiles ``w, w + 2, ...``; at D 576 the odd 9th
tile is computed by both and stored by warpgroup 0 only, which keeps every MMA branch-free): 80
accumulator registers per thread at H 32 D 576, where a single warpgroup would need 144 for dQ
alone. Shared memory (one 128-slot KV tile, ``q``, ``dout``, ``dS``, indices): 228,352 bytes
at H 32 D 576 (the most; 207,872 at H 32 D 512, 189,440 at H 16 D 576, 171,008 at H 16 D 512),
plus the 1 KiB the compiler reserves, within an sm_90a CTA's 227 KiB: one CTA (8 warps) per SM.
Registers (ptxas 13.0, no spills): 200-212 a thread at H 32, 190-196 at H 16. The KV tile is read
only by ``S^T``, ``dP^T`` and ``dQ^T``: once both warpgroups are past ``dQ^T`` the next gather
(``cp.async``; invalid slots zero-filled and never read) is issued and streams in while the dKV
chunk GEMMs and their atomics run. Not chosen: one warpgroup per CTA over 64-slot blocks (two
CTAs per SM at H 16, but 144 dQ accumulator registers a thread at H 32, and half the warps).

Status: the sm_90a deterministic mode's default at H16/H32 (opt-in in the fast mode, where
:mod:`.cutedsl_bwd_ws_slot_major` is faster), checked on the H200 by the GPU suites (fast and
deterministic modes) and timed by ``bench/`` (``bench/results/h200_bwd_versions.md``).

Deterministic mode (``deterministic=True``): each valid slot's dKV row is stored (bf16) into
``dkv_rows`` [s_q * topk, 1, D] instead of added atomically, as in :mod:`.cutedsl_bwd_ws`; the
deterministic postprocess sums them per KV row in a fixed order.

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import hopper_helpers as sm90_utils

from dsa_aot.kernels import cutedsl_bwd_main as main
from dsa_aot.kernels.cutedsl_bwd_main import (LOG2E, DeterministicCompactEntry,
                                              DeterministicNoncompactEntry, SparseMlaBwdMain,
                                              SparseMlaBwdMainCompact, SparseMlaBwdMainNoncompact,
                                              compile_flavour)
from dsa_aot.kernels.cutedsl_common import (D_QK_CHOICES, D_V, LAYOUTS, VEC, wg_acc_as_a,
                                            wg_rows_cols)

#: The ``impl`` name of this flavour (the build's ``tile.flavour``).
IMPL = "wgmma_slot_major"
#: Head counts this flavour supports (the MMA N of the score GEMMs).
HEADS = (16, 32)
#: Top-k slots per block, 64 per warpgroup (the MMA M of the score and dKV GEMMs).
SLOTS = 128
WG_SLOTS = 64
#: Two warpgroups; the gather helpers of :class:`SparseMlaBwdMain` assume the same count.
WG_THREADS = 128
THREADS = 2 * WG_THREADS
#: dQ^T row tile (MMA M) and dKV column chunk (MMA N): one 64-wide 128-byte swizzle atom.
TILE = 64

# gather() and load_indices() build on the wgmma flavour's: 256 threads, 32 rows a pass
assert main.THREADS == THREADS and main.VEC == VEC and 2 * main.BLOCK_N == SLOTS

_INF = float("inf")


def check_params(d_qk: int, heads: int, layout: str, arch: str = "sm_90a") -> None:
    """Raise ``ValueError`` naming the compile-time parameter this flavour cannot take."""
    main.check_params(d_qk, heads, layout)
    if heads not in HEADS:
        raise ValueError(f"heads={heads!r}: impl={IMPL!r} supports heads {HEADS}; use impl='wgmma' "
                         "for more heads")
    if arch != "sm_90a":
        raise ValueError(f"impl={IMPL!r} needs sm_90a, not {arch}; use impl='mma'")


def can_implement(d_qk: int, heads: int, layout: str) -> bool:
    """Whether this flavour supports the compile-time parameters (no exception)."""
    return d_qk in D_QK_CHOICES and heads in HEADS and layout in LAYOUTS


def slot_major_smem_layouts(d_qk: int, heads: int) -> dict[str, cute.ComposedLayout]:
    """Shared-memory layouts (call while tracing a ``cute.jit`` function).

    K-major tiles of 128-byte swizzled 8 x 64 atoms, rows first: ``q`` [H, d_qk], ``dout``
    [H, 512], ``kv`` [128 slots, d_qk] and ``ds`` [H, 128 slots]. ``q_t`` (d_qk, H), ``dout_t``
    (512, H), ``kv_t`` (d_qk, 128) and ``ds_t`` (128, H) are MN-major views of the same bytes
    with the two modes swapped (64 x 8 atoms, the swapped mode first).
    """
    k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, BFloat16)
    return {
        "q": cute.tile_to_shape(k_atom, (heads, d_qk), (0, 1)),
        "dout": cute.tile_to_shape(k_atom, (heads, D_V), (0, 1)),
        "kv": cute.tile_to_shape(k_atom, (SLOTS, d_qk), (0, 1)),
        "ds": cute.tile_to_shape(k_atom, (heads, SLOTS), (0, 1)),
        "q_t": cute.tile_to_shape(mn_atom, (d_qk, heads), (1, 0)),
        "dout_t": cute.tile_to_shape(mn_atom, (D_V, heads), (1, 0)),
        "kv_t": cute.tile_to_shape(mn_atom, (d_qk, SLOTS), (1, 0)),
        "ds_t": cute.tile_to_shape(mn_atom, (SLOTS, heads), (1, 0)),
    }


def shared_storage(d_qk: int, heads: int) -> tuple[dict[str, cute.ComposedLayout], type]:
    """The layouts of :func:`slot_major_smem_layouts` and the kernel's shared-memory struct
    (call while tracing; ``size_in_bytes()`` is the dynamic shared memory of one CTA)."""
    lay = slot_major_smem_layouts(d_qk, heads)

    align, mem = cute.struct.Align, cute.struct.MemRange
    fields = {f"s_{name}": align[mem[BFloat16, cute.cosize(lay[key].outer)], 1024]
              for name, key in (("kv", "kv"), ("q", "q"), ("do", "dout"), ("ds", "ds"))}
    fields |= {"s_idx": align[mem[Int32, 2 * SLOTS], 16],
               "s_valid": align[mem[Int32, 2 * SLOTS], 16],
               "s_lse": align[mem[Float32, heads], 16],
               "s_delta": align[mem[Float32, heads], 16]}
    # built from a dict: this module's annotations are strings (postponed evaluation)
    SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
    return lay, SharedStorage


def slot_major_tiled_ops(heads: int) -> tuple[cute.TiledCopy, cute.TiledMma, cute.TiledMma]:
    """The copy and MMAs of the slot-major orientation (call while tracing): ``row_copy``, one
    warpgroup's ``q`` or ``dout`` rows into shared memory (16 rows x 64 columns a pass, 16-byte
    ``cp.async``); ``mma_s``, ``S^T`` / ``dP^T`` (64 slots, H) with A = the KV rows (K-major), B =
    ``q`` / ``dout`` (K-major); ``mma_dq``, ``dQ^T`` (64 rows of D, H) with A = the KV tile viewed
    (D, slots) (MN-major), B = ``dS`` (K-major)."""
    g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                              BFloat16, num_bits_per_copy=128)
    vecs = TILE // VEC
    row_copy = cute.make_tiled_copy_tv(
        g2s, cute.make_layout((WG_THREADS // vecs, vecs), stride=(vecs, 1)),
        cute.make_layout((1, VEC)))
    mma_s = sm90_utils.make_trivial_tiled_mma(
        BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
        Float32, (1, 1, 1), (WG_SLOTS, heads))
    mma_dq = sm90_utils.make_trivial_tiled_mma(
        BFloat16, BFloat16, warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.K,
        Float32, (1, 1, 1), (TILE, heads))
    return row_copy, mma_s, mma_dq


@cute.jit
def softmax_grad_slot_major(acc_s: cute.Tensor, acc_dp: cute.Tensor, coords: cute.Tensor,
                            s_valid: cute.Tensor, first: Int32, s_lse: cute.Tensor,
                            s_delta: cute.Tensor, scale_log2: Float32,
                            softmax_scale: Float32) -> None:
    """In place on the ``(slots, heads)`` score accumulators ``S^T`` / ``dP^T`` of one warpgroup
    (``coords``: the row/column view of their identity partition): ``P^T = exp2(s * scale * log2e
    - lse[h] * log2e)``, an invalid slot (``s_valid[first + row] == 0``) ``-inf`` before the
    ``exp2``; ``dS^T = P^T * (dP^T - delta[h]) * scale``. ``s_lse`` holds ``lse`` in base 2."""
    acc_s_rc = wg_rows_cols(acc_s)
    acc_dp_rc = wg_rows_cols(acc_dp)
    rows_per_thread = cute.size(coords, mode=[0])
    cols_per_thread = cute.size(coords, mode=[1])
    lse_c = [s_lse[coords[0, j][1]] for j in range(cols_per_thread)]
    delta_c = [s_delta[coords[0, j][1]] for j in range(cols_per_thread)]
    for r in cutlass.range_constexpr(rows_per_thread):
        row_ok = s_valid[first + coords[r, 0][0]]
        for j in cutlass.range_constexpr(cols_per_thread):
            x = acc_s_rc[r, j] * scale_log2 - lse_c[j]
            if row_ok == 0:
                x = Float32(-_INF)
            p = cute.math.exp2(x, fastmath=True)
            acc_s_rc[r, j] = p
            acc_dp_rc[r, j] = p * (acc_dp_rc[r, j] - delta_c[j]) * softmax_scale


class SparseMlaBwdSlotMajor(SparseMlaBwdMain):
    """The slot-major backward main kernel for one ``(d_qk, heads, layout)``."""

    def __init__(self, d_qk: int, heads: int, layout: str, atomic_width: int = 4,
                 scatter: bool = True, deterministic: bool = False) -> None:
        check_params(d_qk, heads, layout)
        super().__init__(d_qk, heads, layout, atomic_width=atomic_width, scatter=scatter,
                         impl="wgmma", deterministic=deterministic)
        self.impl = IMPL
        self.kv_tile_rows = SLOTS  # a block is 128 slots, gathered 32 rows a pass

    # ---------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def launch(self, q: cute.Tensor, kv: cute.Tensor, dout: cute.Tensor, topk_idxs: cute.Tensor,
               topk_length: cute.Tensor, lse_sink: cute.Tensor, delta: cute.Tensor,
               dq: cute.Tensor, dkv_acc: cute.Tensor, softmax_scale: Float32,
               stream: cuda.CUstream) -> None:
        d = self.d_qk
        heads = self.heads
        row_copy, mma_s, mma_dq = slot_major_tiled_ops(heads)
        # dKV: (64 slots, 64 columns), A = dS^T / P^T in registers, B = q / dout viewed (D, H)
        mma_kv = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (WG_SLOTS, TILE), a_source=warpgroup.OperandSource.RMEM)
        s_q_rows = cute.size(q, mode=[0])
        if s_q_rows > 0:
            lay, SharedStorage = shared_storage(d, heads)  # (inside: a struct is no run-time value)
            self.kernel_slot_major(
                q, kv, dout, topk_idxs, topk_length, lse_sink, delta, dq, dkv_acc, softmax_scale,
                lay["q"], lay["dout"], lay["kv"], lay["ds"], lay["q_t"], lay["dout_t"],
                lay["kv_t"], lay["ds_t"], row_copy, mma_s, mma_dq, mma_kv,
                SharedStorage).launch(grid=[s_q_rows, 1, 1], block=[THREADS, 1, 1],
                                      smem=SharedStorage.size_in_bytes(), stream=stream)

    # ---------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------

    @cute.kernel
    def kernel_slot_major(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_do: cute.Tensor,
                          m_idx: cute.Tensor, m_len: cute.Tensor, m_lse: cute.Tensor,
                          m_delta: cute.Tensor, m_dq: cute.Tensor, m_dkv: cute.Tensor,
                          softmax_scale: Float32,
                          s_q_layout: cute.ComposedLayout,
                          s_do_layout: cute.ComposedLayout, s_kv_layout: cute.ComposedLayout,
                          s_ds_layout: cute.ComposedLayout, s_qt_layout: cute.ComposedLayout,
                          s_dot_layout: cute.ComposedLayout, s_kt_layout: cute.ComposedLayout,
                          s_dst_layout: cute.ComposedLayout, row_copy: cute.TiledCopy, mma_s: cute.TiledMma, mma_dq: cute.TiledMma,
                          mma_kv: cute.TiledMma, SharedStorage: cutlass.Constexpr) -> None:
        d = self.d_qk
        heads = self.heads
        n_tiles = d // TILE                  # dQ^T row tiles and dKV column chunks (9 or 8)
        n_mine = (n_tiles + 1) // 2          # dQ^T tiles per warpgroup
        n_v_chunks = D_V // TILE
        # dQ^T accumulates over the blocks (zero-filled once); the other GEMMs set the field per
        # k-step: the first overwrites the accumulator (wgmma scale-d 0, no zero-fill)
        mma_dq.set(warpgroup.Field.ACCUMULATE, True)
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        wtid = tidx % WG_THREADS
        lane = cute.arch.lane_idx()
        topk = cute.size(m_idx, mode=[1])
        n_slots = self.used_slots(t, m_idx, m_len, cute.size(m_kv, mode=[0]))
        n_blocks = (n_slots + SLOTS - 1) // SLOTS
        scale_log2 = softmax_scale * Float32(LOG2E)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        s_q = storage.s_q.get_tensor(s_q_layout.outer, swizzle=s_q_layout.inner)
        s_do = storage.s_do.get_tensor(s_do_layout.outer, swizzle=s_do_layout.inner)
        s_kv_t = storage.s_kv.get_tensor(s_kv_layout.outer, swizzle=s_kv_layout.inner)
        s_ds = storage.s_ds.get_tensor(s_ds_layout.outer, swizzle=s_ds_layout.inner)
        s_qt = cute.make_tensor(s_q.iterator, s_qt_layout.outer)      # (d, h)
        s_dot = cute.make_tensor(s_do.iterator, s_dot_layout.outer)   # (512, h)
        s_kt = cute.make_tensor(s_kv_t.iterator, s_kt_layout.outer)   # (d, slot)
        s_dst = cute.make_tensor(s_ds.iterator, s_dst_layout.outer)   # (slot, h)
        s_idx = storage.s_idx.get_tensor(cute.make_layout(2 * SLOTS))
        s_valid = storage.s_valid.get_tensor(cute.make_layout(2 * SLOTS))
        s_lse = storage.s_lse.get_tensor(cute.make_layout(heads))
        s_delta = storage.s_delta.get_tensor(cute.make_layout(heads))

        # ---- q (warpgroup 0), dout (warpgroup 1) -> shared (cp.async); lse, delta -> shared --
        thr_row = row_copy.get_slice(wtid)
        if wg == 0:
            cute.copy(row_copy, thr_row.partition_S(m_q[t, None, None]), thr_row.partition_D(s_q))
        else:
            cute.copy(row_copy, thr_row.partition_S(m_do[t, None, None]),
                      thr_row.partition_D(s_do))
        if tidx < heads:
            s_lse[tidx] = m_lse[t, tidx] * Float32(LOG2E)
            s_delta[tidx] = m_delta[t, tidx]

        row_in_pass = tidx // (TILE // VEC)
        kv_gather = self.kv_gather_args(m_kv, s_kv_t, s_idx, s_valid, row_in_pass, tidx)

        # ---- warpgroup MMA operands (descriptors over shared memory) and accumulators -------
        wg_s = mma_s.get_slice(0)
        wg_dq = mma_dq.get_slice(0)
        wg_kv = mma_kv.get_slice(0)
        r_k = mma_s.make_fragment_A(wg_s.partition_A(            # (MMA, 1, d/16): own slots
            cute.local_tile(s_kv_t, (WG_SLOTS, d), (wg, 0))))
        r_q = mma_s.make_fragment_B(wg_s.partition_B(s_q))        # (MMA, 1, d/16)
        r_do = mma_s.make_fragment_B(wg_s.partition_B(s_do))      # (MMA, 1, 32)
        r_dsb = mma_dq.make_fragment_B(wg_dq.partition_B(s_ds))   # (MMA, 1, 8)
        r_qt = [mma_kv.make_fragment_B(wg_kv.partition_B(
            cute.local_tile(s_qt, (TILE, heads), (c, 0)))) for c in range(n_tiles)]
        r_dot = [mma_kv.make_fragment_B(wg_kv.partition_B(
            cute.local_tile(s_dot, (TILE, heads), (c, 0)))) for c in range(n_v_chunks)]
        thr_s = mma_s.get_slice(wtid)
        thr_dq = mma_dq.get_slice(wtid)
        thr_kv = mma_kv.get_slice(wtid)
        acc_shape = thr_s.partition_shape_C((WG_SLOTS, heads))
        dq_shape = thr_dq.partition_shape_C((TILE, heads))
        kv_shape = thr_kv.partition_shape_C((WG_SLOTS, TILE))
        acc_dq = [cute.make_rmem_tensor(dq_shape, Float32) for _ in range(n_mine)]
        for i in cutlass.range_constexpr(n_mine):
            acc_dq[i].fill(0.0)
        # this warpgroup's dQ^T tiles: w, w + 2, ...; past the end, the last one again (MMAs
        # stay branch-free; only the owner stores it)
        dq_tile = [cutlass.min(wg + 2 * i, n_tiles - 1) for i in range(n_mine)]
        r_kt = [mma_dq.make_fragment_A(wg_dq.partition_A(                 # (MMA, 1, 8) each
            cute.local_tile(s_kt, (TILE, SLOTS), (dq_tile[i], 0)))) for i in range(n_mine)]
        coords = wg_rows_cols(thr_s.partition_C(cute.make_identity_tensor((WG_SLOTS, heads))))
        kv_coords = wg_rows_cols(thr_kv.partition_C(cute.make_identity_tensor((WG_SLOTS, TILE))))
        store_c = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                             BFloat16), mma_s)
        thr_store_c = store_c.get_slice(wtid)
        t_s_ds_c = thr_store_c.partition_D(cute.local_tile(s_dst, (WG_SLOTS, heads), (wg, 0)))
        acc_s = cute.make_rmem_tensor(acc_shape, Float32)
        acc_dp = cute.make_rmem_tensor(acc_shape, Float32)
        r_p16 = cute.make_fragment_like(acc_s, BFloat16)   # P^T, bf16
        r_ds16 = cute.make_fragment_like(acc_dp, BFloat16)  # dS^T * scale, bf16
        r_pa = wg_acc_as_a(r_p16)                          # ... as the A operand of dKV
        r_dsa = wg_acc_as_a(r_ds16)
        acc_kv = [cute.make_rmem_tensor(kv_shape, Float32) for _ in range(2)]

        # ---- prologue: block 0 in flight ---------------------------------------------------
        self.gather_first(n_blocks, t, m_idx, n_slots, kv_gather)

        for b in cutlass.range(n_blocks, unroll=1):
            buf = (b % 2) * SLOTS
            mine = buf + wg * WG_SLOTS  # this warpgroup's first slot in s_idx / s_valid
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()  # cp.async / zero-fill writes -> wgmma reads
            cute.arch.barrier()
            upcoming = self.load_indices(b + 1, t, m_idx, n_slots, row_in_pass)

            # S^T = K Q^T and dP^T = V dO^T (this warpgroup's 64 slots, every head)
            # interleaved k-steps (each K descriptor feeds both GEMMs back to back); k = 0
            # overwrites the accumulators (wgmma scale-d 0: no zero-fill)
            warpgroup.fence()
            for k in cutlass.range_constexpr(d // 16):
                mma_s.set(warpgroup.Field.ACCUMULATE, k > 0)
                cute.gemm(mma_s, acc_s, r_k[None, None, k], r_q[None, None, k], acc_s)
                if cutlass.const_expr(k < D_V // 16):
                    cute.gemm(mma_s, acc_dp, r_k[None, None, k], r_do[None, None, k], acc_dp)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            softmax_grad_slot_major(acc_s, acc_dp, coords, s_valid, mine, s_lse, s_delta,
                                    scale_log2, softmax_scale)
            r_p16.store(acc_s.load().to(BFloat16))
            r_ds16.store(acc_dp.load().to(BFloat16))
            cute.copy(store_c, thr_store_c.retile(r_ds16), t_s_ds_c)  # dS [h, slot] in smem
            cute.arch.fence_view_async_shared()  # dS stores -> wgmma reads
            cute.arch.barrier()

            # dQ^T += K^T dS^T (every slot of the block), then the first dKV chunk; the next
            # gather waits for dQ^T only
            warpgroup.fence()
            for i in cutlass.range_constexpr(n_mine):
                for k in cutlass.range_constexpr(SLOTS // 16):
                    cute.gemm(mma_dq, acc_dq[i], r_kt[i][None, None, k], r_dsb[None, None, k],
                              acc_dq[i])
            warpgroup.commit_group()
            slots = self.dkv_slots(mine, kv_coords, lane)
            row_ok = [s_valid[s] for s in slots]
            row_ptr = self.dkv_row_ptrs(m_dkv, s_idx, slots, buf, b * SLOTS, t, Int32(0), topk)
            # dKV chunks (A: dS^T / P^T from registers); the next gather waits for dQ^T only
            self.dkv_chunks(mma_kv, acc_kv, r_dsa, r_pa, r_qt, r_dot, heads // 16, TILE,
                            kv_coords, row_ok, row_ptr, lane, None,
                            b + 1 < n_blocks,
                            [upcoming, SLOTS - buf, *kv_gather])

        # ---- epilogue: dq[t, h, d] = dQ^T[d, h] in bf16 ----------------------------------------
        cute.arch.cp_async_wait_group(0)
        c_dq = thr_dq.partition_C(cute.make_identity_tensor((TILE, heads)))
        g_dq = m_dq[t, None, None]  # (h, d)
        for i in cutlass.range_constexpr(n_mine):
            r_o = cute.make_fragment_like(acc_dq[i], BFloat16)
            r_o.store(acc_dq[i].load().to(BFloat16))
            col0 = dq_tile[i] * TILE
            if cutlass.const_expr(2 * i + 1 < n_tiles):  # both warpgroups own a tile here
                for e in cutlass.range_constexpr(cute.size(r_o)):
                    g_dq[c_dq[e][1], col0 + c_dq[e][0]] = r_o[e]
            else:  # the odd last tile: warpgroup 0's
                if wg == 0:
                    for e in cutlass.range_constexpr(cute.size(r_o)):
                        g_dq[c_dq[e][1], col0 + c_dq[e][0]] = r_o[e]

    @cute.jit
    def load_indices(self, block: Int32, t: Int32, m_idx: cute.Tensor, n_slots: Int32,
                     row_in_pass: Int32) -> list:
        """The top-k indices of this thread's 4 gather rows of 128-slot block ``block`` (-1 past
        the end): those of the wgmma flavour's 64-slot blocks ``2 block`` and ``2 block + 1``."""
        return (SparseMlaBwdMain.load_indices(self, 2 * block, t, m_idx, n_slots, row_in_pass)
                + SparseMlaBwdMain.load_indices(self, 2 * block + 1, t, m_idx, n_slots,
                                                row_in_pass))


class SparseMlaBwdSlotMajorCompact(SparseMlaBwdSlotMajor, SparseMlaBwdMainCompact):
    """Entry point of the compact layout (``topk_length`` given)."""


class SparseMlaBwdSlotMajorNoncompact(SparseMlaBwdSlotMajor, SparseMlaBwdMainNoncompact):
    """Entry point of the noncompact layout (padding marked by out-of-range indices)."""


class SparseMlaBwdSlotMajorCompactDeterministic(DeterministicCompactEntry, SparseMlaBwdSlotMajor):
    """Entry point of the deterministic mode, compact layout."""


class SparseMlaBwdSlotMajorNoncompactDeterministic(DeterministicNoncompactEntry,
                                                   SparseMlaBwdSlotMajor):
    """Entry point of the deterministic mode, noncompact layout."""


def compile_bwd_slot_major(arch: str, d_qk: int, heads: int, layout: str, atomic_width: int = 4,
                           scatter: bool = True, impl: str = IMPL, extra_options: str = "",
                           deterministic: bool = False) -> tuple[object, dict[str, object]]:
    """``cute.compile`` the slot-major kernel for ``arch`` (sm_90a; ``CUTE_DSL_ARCH`` set before
    import). Returns the compiled function and the fake arguments (those of
    :func:`~dsa_aot.kernels.cutedsl_bwd_main.fake_arguments`) it was compiled with. ``impl`` is
    the build's flavour name, which must be this module's."""
    entries = {(False, "compact"): SparseMlaBwdSlotMajorCompact,
               (False, "noncompact"): SparseMlaBwdSlotMajorNoncompact,
               (True, "compact"): SparseMlaBwdSlotMajorCompactDeterministic,
               (True, "noncompact"): SparseMlaBwdSlotMajorNoncompactDeterministic}
    return compile_flavour(entries, IMPL, check_params, arch, d_qk, heads, layout, atomic_width,
                           scatter, impl, extra_options, deterministic)


__all__ = ["HEADS", "IMPL", "SparseMlaBwdSlotMajor", "SparseMlaBwdSlotMajorCompact",
           "SparseMlaBwdSlotMajorCompactDeterministic", "SparseMlaBwdSlotMajorNoncompact",
           "SparseMlaBwdSlotMajorNoncompactDeterministic", "can_implement", "check_params",
           "compile_bwd_slot_major", "slot_major_smem_layouts", "slot_major_tiled_ops",
           "softmax_grad_slot_major"]
