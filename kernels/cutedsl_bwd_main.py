"""CuTe DSL sparse MLA backward, main stage: ``dq`` and the fp32 ``dkv`` accumulator.

Arguments, in call order (the TileLang main stage's names): ``q`` [s_q, H, D_qk] bf16, ``kv``
[s_kv, D_qk] bf16, ``dout`` [s_q, H, 512] bf16, ``topk_idxs`` [s_q, K] int32, ``topk_length``
[s_q] int32 (compact layout only), ``lse_sink`` [s_q, H] fp32 (natural-log ``logaddexp(lse,
sink)``, +inf for an empty row), ``delta`` [s_q, H] fp32, ``dq`` [s_q, H, D_qk] bf16 (written),
``dkv_acc`` [s_kv, D_qk] fp32 (zeroed by the caller, accumulated with atomics; columns in the
interleaved order of :mod:`dsa_aot.kernels.dkv_interleave`, which the postprocess undoes), the run-time
scalar ``softmax_scale`` and the stream. ``D_qk`` (512 or 576), ``H`` (16, 32, 64, 128) and the
layout are compile-time; ``s_q``, ``s_kv`` and ``K`` are run-time (any ``K >= 1``).

Per valid slot ``j`` of row ``t`` (``0 <= idx < s_kv`` and, compact, ``j < clamp(topk_length, 0,
K)``): ``p = exp(scale * q.k_j - lse_sink)``, ``dp = dout.v_j``, ``ds = p * (dp - delta)``;
``dq = scale * sum_j ds k_j``; ``dkv_acc[idx_j] += scale * ds * q`` (all ``D_qk`` columns)
``+ p * dout`` (the first 512).

Design (tensor cores through the SM80 warp-level MMA, one source for sm_90a and sm_100a):

* one CTA of 8 warps per query row and block of 64 heads (H < 64: the extra rows of ``q`` and
  ``dout`` are zero and their ``lse`` is +inf, so they add nothing and are never stored);
* the row's slots are walked in blocks of 64: the gathered KV rows are copied with ``cp.async``
  from ``kv[idx]`` into a swizzled shared tile; an invalid slot is never read (zero row) and its
  exponent is ``-inf`` before the ``exp2`` (no ``inf - inf``, no ``inf * 0``);
* per block: ``S = Q K^T`` and ``dP = dO V^T`` share the K/V fragments; ``P`` and ``dS * scale``
  go to shared memory as bf16; ``dQ += dS K`` accumulates in registers (``K^T`` read with
  transposed ``ldmatrix``); after a barrier the next block's gather is issued and ``dKV = dS^T Q
  + P^T dO`` runs in 64-column chunks whose results go to ``dkv_acc`` with fp32 atomics at valid
  slots only (duplicate indices each add);
* epilogue: ``dq`` in bf16 (0 for a row without a valid slot).

Shared memory: ``q``, ``dout``, one KV tile, ``P``, ``dS`` and the slot indices, about 226 KiB for
``D_qk = 576``, hence one CTA per SM. The dkv atomics are 4-wide (``red.global.add.v4.f32``) into
the interleaved column order: with the wgmma flavour, lanes of neighbouring quads trade half
their values so that each atomic instruction adds whole 128-byte lines of 4 rows (one L2
request per row; natural order needs four 32-byte ones, which made the L2 the bottleneck:
453 M red requests against 113 M for the cuDNN frontend's kernel at S_q 2048, H 64, D 576,
K 2048); the ``mma`` flavour adds value pairs. ``atomic_width`` selects 2- or 1-wide ones.

``scatter=False`` skips only the atomics (a timing ablation; ``dkv_acc`` stays untouched).

``impl="wgmma"`` (sm_90a only; the default there at H64/H128): the same algorithm with two warpgroups issuing ``wgmma``
from shared memory (K-major tiles, and MN-major views of the same bytes for the transposed
operands); dq and dkv advance 128 columns per step (D_qk 576 is padded to 640: the padding
columns read the neighbouring buffer, land in accumulator columns >= 576 and are never stored),
and the dkv chunk GEMMs alternate between two accumulators so chunk c's MMAs overlap chunk
c - 1's atomics. The first k-step of the S, dP and dKV chunk GEMMs overwrites its accumulator
(wgmma scale-d 0: no zero-fill); only ``dq``'s is zero-filled, once per row. S and dP issue
their k-steps interleaved (one K descriptor feeds both). Through the public API on an H200
(S_q 4096, S_kv 8192, ``bench/results/h200_bwd.md``): 8.49 ms at H64 D576 K2048 and 7.96 ms at
H128 D512 K1024 (``mma``: 14.1 ms at H64 D576); ``bench/results/h200_bwd_versions.md`` has the
history and what limits it.

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.utils import hopper_helpers as sm90_utils

from dsa_aot.kernels import cutedsl_common as common
from dsa_aot.kernels.cutedsl_common import (D_QK_CHOICES, D_V, HEAD_CHOICES, LAYOUTS, VEC,
                                            acc_rows_cols, fake_tensor, gather_row_zfill,
                                            l2_policy, run_time_sizes, vec_stride, wg_rows_cols)
from dsa_aot.kernels.dkv_interleave import dkv_acc_column
from dsa_aot.kernels.fixed_point import row_words

#: Heads per CTA (MMA M of the score GEMMs) and top-k slots per block.
BLOCK_H = 64
BLOCK_N = 64
#: dq / dkv column chunk (one 64 x 64 fp32 accumulator).
CHUNK = 64
#: 8 warps: 4 along M, 2 along N of every GEMM.
WARPS_M, WARPS_N = 4, 2
THREADS = 32 * WARPS_M * WARPS_N
LOG2E = 1.4426950408889634
#: fp32 values per dkv atomic: ``red.global.add.f32`` / ``.v2.f32`` / ``.v4.f32`` (sm_90+).
ATOMIC_WIDTHS = (1, 2, 4)
#: MMA flavours: warp-level ``mma.sync`` (any arch, the default) or sm_90a warpgroup MMA.
IMPLS = ("mma", "wgmma")
#: wgmma: dq / dkv columns per warpgroup pair step (an MN-major 128-byte swizzle atom is 64
#: columns wide, so each warpgroup's N is a multiple of 64; D_qk = 576 is padded to 640).
WG_CHUNK = 128

_INF = float("inf")


def check_params(d_qk: int, heads: int, layout: str) -> None:
    """Raise ``ValueError`` naming the bad compile-time parameter."""
    common.check_params(d_qk, heads, layout, "backward")


def can_implement(d_qk: int, heads: int, layout: str) -> bool:
    """Whether this kernel supports the compile-time parameters (no exception)."""
    return d_qk in D_QK_CHOICES and heads in HEAD_CHOICES and layout in LAYOUTS


def _transposed(tensor: cute.Tensor, rows: int, cols: int) -> cute.Tensor:
    """The ``(cols, rows)`` view of a ``(rows, cols)`` shared tile (no data moves)."""
    return cute.composition(tensor, cute.make_layout((cols, rows), stride=(rows, 1)))


@cutlass.dsl_user_op
def opaque_i64(value: Int64, *, loc=None, ip=None) -> Int64:
    """``value`` through a ``mov.b64`` the LLVM optimiser cannot look into: a row offset made
    once stays one register (without it, the multiply can be re-done at every atomic that
    uses it when the address arithmetic is sunk into each atomic's branch)."""
    return Int64(llvm.inline_asm(Int64.mlir_type, [Int64(value).ir_value(loc=loc, ip=ip)],
                                 "mov.b64 $0, $1;", "=l,l", has_side_effects=False,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                 loc=loc, ip=ip))


@cutlass.dsl_user_op
def store_bf16x4(addr: Int64, v0: Float32, v1: Float32, v2: Float32, v3: Float32, *, loc=None,
                 ip=None) -> None:
    """Round four fp32 values to bf16 (nearest even) and store them as one 8-byte
    ``st.global.v2.b32`` at ``addr`` (8-byte aligned), ``v0`` first."""
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)]
                    + [Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)],
                    "{ .reg .b32 lo, hi; cvt.rn.bf16x2.f32 lo, $2, $1; "
                    "cvt.rn.bf16x2.f32 hi, $4, $3; st.global.v2.b32 [$0], {lo, hi}; }",
                    "l,f,f,f,f", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def wg_gemm(mma: cute.TiledMma, acc: cute.Tensor, steps: list, accumulate: bool) -> None:
    """Issue ``acc (+)= sum_k A_k B_k`` as one ``cute.gemm`` per ``(A_k, B_k)`` of ``steps`` (no
    fence, no commit). ``accumulate=False``: the first step overwrites ``acc`` (wgmma scale-d 0),
    so the accumulator needs no zero-fill and must not be read before this call. The ACCUMULATE
    field is set before every step (a compile-time constant each time)."""
    for i, (a, b) in enumerate(steps):
        mma.set(warpgroup.Field.ACCUMULATE, accumulate or i > 0)
        cute.gemm(mma, acc, a, b, acc)


def score_gemms(mma_s: cute.TiledMma, acc_shape, r_q: cute.Tensor, r_do: cute.Tensor,
                r_k: cute.Tensor, d_qk: int,
                kv_is_a: bool = False) -> tuple[cute.Tensor, cute.Tensor]:
    """``S = Q K^T`` and ``dP = dO V^T`` for one block, waited for: the k-steps interleaved, so
    each K descriptor feeds both GEMMs back to back (no long live ranges); k = 0 overwrites the
    accumulators (wgmma scale-d 0, no zero-fill). ``kv_is_a``: the slot-major orientation,
    ``S^T = K Q^T`` and ``dP^T = V dO^T`` (the KV tile the A operand). Returns
    ``(acc_s, acc_dp)``."""
    acc_s = cute.make_rmem_tensor(acc_shape, Float32)
    acc_dp = cute.make_rmem_tensor(acc_shape, Float32)
    warpgroup.fence()
    for k in range(d_qk // 16):  # a plain function: Python loops unroll while tracing
        mma_s.set(warpgroup.Field.ACCUMULATE, k > 0)
        pairs = [(acc_s, r_q)] + ([(acc_dp, r_do)] if k < D_V // 16 else [])
        for acc, rows in pairs:
            a, b = (r_k, rows) if kv_is_a else (rows, r_k)
            cute.gemm(mma_s, acc, a[None, None, k], b[None, None, k], acc)
    warpgroup.commit_group()
    warpgroup.wait_group(0)
    return acc_s, acc_dp


def wgmma_smem_layouts(d_qk: int) -> dict[str, cute.ComposedLayout]:
    """Shared-memory layouts of the wgmma flavour (call while tracing a ``cute.jit`` function).

    ``q`` [64, d_qk], ``dout`` [64, 512], ``kv`` [64, d_qk] and ``p`` (also dS) [64, 64]: K-major
    tiles of 128-byte swizzled 8 x 64 atoms, rows first. ``q_t``, ``dout_t``, ``kv_t`` and ``p_t``
    are MN-major views of the same bytes with the two modes swapped; ``q_t`` and ``kv_t`` run on
    to the padded width (a multiple of :data:`WG_CHUNK`), the extra columns addressing the
    buffer allocated next.
    """
    k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, BFloat16)
    d_pad = (d_qk + WG_CHUNK - 1) // WG_CHUNK * WG_CHUNK
    return {
        "q": cute.tile_to_shape(k_atom, (BLOCK_H, d_qk), (0, 1)),
        "dout": cute.tile_to_shape(k_atom, (BLOCK_H, D_V), (0, 1)),
        "kv": cute.tile_to_shape(k_atom, (BLOCK_N, d_qk), (0, 1)),
        "p": cute.tile_to_shape(k_atom, (BLOCK_H, BLOCK_N), (0, 1)),
        "q_t": cute.tile_to_shape(mn_atom, (d_pad, BLOCK_H), (1, 0)),
        "dout_t": cute.tile_to_shape(mn_atom, (D_V, BLOCK_H), (1, 0)),
        "kv_t": cute.tile_to_shape(mn_atom, (d_pad, BLOCK_N), (1, 0)),
        "p_t": cute.tile_to_shape(mn_atom, (BLOCK_N, BLOCK_H), (1, 0)),
    }


class SparseMlaBwdMain:
    """The backward main kernel for one ``(d_qk, heads, layout)``."""

    #: Whether the KV gather's reads carry an L2 evict-last policy (KV is the hot set).
    KV_EVICT_LAST = False

    def __init__(self, d_qk: int, heads: int, layout: str, atomic_width: int = 4,
                 scatter: bool = True, impl: str = "mma", deterministic: bool = False) -> None:
        check_params(d_qk, heads, layout)
        if deterministic and atomic_width != 4:
            raise ValueError(f"atomic_width={atomic_width!r}: the deterministic mode stores dKV "
                             "rows with the 4-wide lane trades; use atomic_width=4")
        if atomic_width not in ATOMIC_WIDTHS:
            raise ValueError(f"atomic_width={atomic_width!r}: use one of {ATOMIC_WIDTHS}")
        if impl not in IMPLS:
            raise ValueError(f"impl={impl!r}: use one of {IMPLS}")
        #: the deterministic mode: each slot's dKV row stored (bf16) for a fixed-order reduction
        #: instead of added atomically; only the flavours that have it pass True
        #: (:mod:`.cutedsl_bwd_ws`, :mod:`.cutedsl_bwd_slot_major`)
        self.deterministic = deterministic
        #: the deterministic mode adds int32 fixed point into ``dkv_fixed`` instead of storing
        #: rows (:mod:`.cutedsl_fixed_point`; the flavours with a dKV warpgroup set it)
        self.fixed_point = False
        self.impl = impl
        self.d_qk = d_qk
        self.heads = heads
        self.compact = layout == "compact"
        self.atomic_width = atomic_width
        #: False skips the dkv atomics, nothing else (timing diagnosis only: dkv_acc untouched)
        self.scatter = scatter
        #: threads that gather a KV block (:meth:`load_indices`, :meth:`gather`): all of them here
        self.gather_threads = THREADS
        #: rows of the KV tile a block is gathered into (the M or N of its GEMMs)
        self.kv_tile_rows = BLOCK_N

    # ---------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def launch(self, q: cute.Tensor, kv: cute.Tensor, dout: cute.Tensor, topk_idxs: cute.Tensor,
               topk_length: cute.Tensor, lse_sink: cute.Tensor, delta: cute.Tensor,
               dq: cute.Tensor, dkv_acc: cute.Tensor, softmax_scale: Float32,
               stream: cuda.CUstream) -> None:
        if cutlass.const_expr(self.impl == "wgmma"):
            self.launch_wgmma(q, kv, dout, topk_idxs, topk_length, lse_sink, delta, dq, dkv_acc,
                              softmax_scale, stream)
        else:
            self.launch_mma(q, kv, dout, topk_idxs, topk_length, lse_sink, delta, dq, dkv_acc,
                            softmax_scale, stream)

    @cute.jit
    def launch_mma(self, q: cute.Tensor, kv: cute.Tensor, dout: cute.Tensor,
                   topk_idxs: cute.Tensor, topk_length: cute.Tensor, lse_sink: cute.Tensor,
                   delta: cute.Tensor, dq: cute.Tensor, dkv_acc: cute.Tensor,
                   softmax_scale: Float32, stream: cuda.CUstream) -> None:
        d = self.d_qk
        atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0,
                                         cute.make_layout((8, 64), stride=(64, 1)))
        s_q_layout = cute.tile_to_shape(atom, (BLOCK_H, d), (0, 1))
        s_do_layout = cute.tile_to_shape(atom, (BLOCK_H, D_V), (0, 1))
        s_kv_layout = cute.tile_to_shape(atom, (BLOCK_N, d), (0, 1))
        s_p_layout = cute.tile_to_shape(atom, (BLOCK_H, BLOCK_N), (0, 1))

        @cute.struct
        class SharedStorage:
            s_q: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(s_q_layout)], 1024]
            s_do: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(s_do_layout)], 1024]
            s_kv: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(s_kv_layout)], 1024]
            s_p: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(s_p_layout)], 1024]
            s_ds: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(s_p_layout)], 1024]
            s_idx: cute.struct.Align[cute.struct.MemRange[Int32, 2 * BLOCK_N], 16]
            s_valid: cute.struct.Align[cute.struct.MemRange[Int32, 2 * BLOCK_N], 16]
            s_lse: cute.struct.Align[cute.struct.MemRange[Float32, BLOCK_H], 16]
            s_delta: cute.struct.Align[cute.struct.MemRange[Float32, BLOCK_H], 16]

        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=128)
        vecs = 64 // VEC
        gmem_copy = cute.make_tiled_copy_tv(
            g2s, cute.make_layout((THREADS // vecs, vecs), stride=(vecs, 1)),
            cute.make_layout((1, VEC)))
        # 64 x 32 x 16 per step: warp (m, n) owns rows 16 m.. and columns 16 n.. of each 32
        tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)),
                                        (WARPS_M, WARPS_N, 1),
                                        permutation_mnk=(WARPS_M * 16, WARPS_N * 16, 16))
        s_q_rows = cute.size(q, mode=[0])
        if s_q_rows > 0:
            self.kernel(q, kv, dout, topk_idxs, topk_length, lse_sink, delta, dq, dkv_acc,
                        softmax_scale, s_q_layout, s_do_layout, s_kv_layout, s_p_layout,
                        gmem_copy, tiled_mma, SharedStorage).launch(
                grid=[s_q_rows, (self.heads + BLOCK_H - 1) // BLOCK_H, 1],
                block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    # ---------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_do: cute.Tensor, m_idx: cute.Tensor,
               m_len: cute.Tensor, m_lse: cute.Tensor, m_delta: cute.Tensor, m_dq: cute.Tensor,
               m_dkv: cute.Tensor, softmax_scale: Float32, s_q_layout: cute.ComposedLayout,
               s_do_layout: cute.ComposedLayout, s_kv_layout: cute.ComposedLayout,
               s_p_layout: cute.ComposedLayout, gmem_copy: cute.TiledCopy,
               tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr) -> None:
        d = self.d_qk
        heads = self.heads
        n_dq_chunks = d // CHUNK
        n_v_chunks = D_V // CHUNK
        tidx, _, _ = cute.arch.thread_idx()
        t, hb, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        topk = cute.size(m_idx, mode=[1])
        n_slots = self.used_slots(t, m_idx, m_len, cute.size(m_kv, mode=[0]))
        n_blocks = (n_slots + BLOCK_N - 1) // BLOCK_N
        scale_log2 = softmax_scale * Float32(LOG2E)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        s_q = storage.s_q.get_tensor(s_q_layout)
        s_do = storage.s_do.get_tensor(s_do_layout)
        s_kv_t = storage.s_kv.get_tensor(s_kv_layout)
        s_p = storage.s_p.get_tensor(s_p_layout)
        s_ds = storage.s_ds.get_tensor(s_p_layout)
        s_idx = storage.s_idx.get_tensor(cute.make_layout(2 * BLOCK_N))
        s_valid = storage.s_valid.get_tensor(cute.make_layout(2 * BLOCK_N))
        s_lse = storage.s_lse.get_tensor(cute.make_layout(BLOCK_H))
        s_delta = storage.s_delta.get_tensor(cute.make_layout(BLOCK_H))

        # ---- q, dout -> shared (cp.async), lse/delta -> shared --------------------------------
        thr_copy = gmem_copy.get_slice(tidx)
        row_in_pass = tidx // (64 // VEC)
        self.load_row(t, hb, m_q, m_do, m_lse, m_delta, s_q, s_do, s_lse, s_delta, thr_copy,
                      gmem_copy, row_in_pass, tidx)

        kv_gather = self.kv_gather_args(m_kv, s_kv_t, s_idx, s_valid, row_in_pass, tidx)

        # ---- MMA partitions -----------------------------------------------------------------
        thr_mma = tiled_mma.get_slice(tidx)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                   BFloat16)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                     BFloat16)
        copy_a = cute.make_tiled_copy_A(ldsm, tiled_mma)
        copy_at = cute.make_tiled_copy_A(ldsm_t, tiled_mma)
        copy_b = cute.make_tiled_copy_B(ldsm, tiled_mma)
        copy_bt = cute.make_tiled_copy_B(ldsm_t, tiled_mma)
        thr_a = copy_a.get_slice(tidx)
        thr_at = copy_at.get_slice(tidx)
        thr_b = copy_b.get_slice(tidx)
        thr_bt = copy_bt.get_slice(tidx)

        # S = Q K^T and dP = dO V^T: one 16-wide k slice of A and B in registers at a time
        t_s_q_a = thr_a.partition_S(s_q)      # (CPY, M, d/16)
        t_s_do_a = thr_a.partition_S(s_do)    # (CPY, M, 32)
        t_s_k_b = thr_b.partition_S(s_kv_t)   # (CPY, N, d/16)
        k_slice_a = cute.local_tile(s_q, (BLOCK_H, 16), (0, 0))
        r_qa = thr_mma.make_fragment_A(thr_mma.partition_A(k_slice_a))
        r_doa = thr_mma.make_fragment_A(thr_mma.partition_A(k_slice_a))
        r_kb = thr_mma.make_fragment_B(thr_mma.partition_B(cute.local_tile(s_kv_t, (BLOCK_N, 16),
                                                                           (0, 0))))
        r_qa_v = thr_a.retile(r_qa)
        r_doa_v = thr_a.retile(r_doa)
        r_kb_v = thr_b.retile(r_kb)

        # dQ += dS K: A = dS (whole 64 x 64 tile), B = K^T (transposed ldmatrix)
        t_s_ds_a = thr_a.partition_S(s_ds)
        r_ds = thr_mma.make_fragment_A(thr_mma.partition_A(s_ds))
        r_ds_v = thr_a.retile(r_ds)
        s_kt = _transposed(s_kv_t, BLOCK_N, d)          # (d, n)
        s_qt = _transposed(s_q, BLOCK_H, d)             # (d, h)
        s_dot = _transposed(s_do, BLOCK_H, D_V)         # (512, h)
        s_dst = _transposed(s_ds, BLOCK_H, BLOCK_N)     # (n, h)
        s_pt = _transposed(s_p, BLOCK_H, BLOCK_N)       # (n, h)
        r_bt = thr_mma.make_fragment_B(thr_mma.partition_B(cute.local_tile(s_kt, (CHUNK, 16),
                                                                           (0, 0))))
        r_bt_v = thr_bt.retile(r_bt)

        # dKV = dS^T Q + P^T dO: A = dS^T / P^T (transposed ldmatrix), B = Q^T / dO^T
        t_s_dst_a = thr_at.partition_S(s_dst)
        t_s_pt_a = thr_at.partition_S(s_pt)
        r_dst = thr_mma.make_fragment_A(thr_mma.partition_A(s_dst))
        r_pt = thr_mma.make_fragment_A(thr_mma.partition_A(s_pt))
        r_dst_v = thr_at.retile(r_dst)
        r_pt_v = thr_at.retile(r_pt)

        acc_shape = thr_mma.partition_shape_C((BLOCK_H, BLOCK_N))
        acc_dq = [cute.make_rmem_tensor(acc_shape, Float32) for _ in range(n_dq_chunks)]
        for c in cutlass.range_constexpr(n_dq_chunks):
            acc_dq[c].fill(0.0)
        coords = acc_rows_cols(thr_mma.partition_C(cute.make_identity_tensor((BLOCK_H, BLOCK_N))))

        store_c = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                             BFloat16), tiled_mma)
        thr_store_c = store_c.get_slice(tidx)
        t_s_p_c = thr_store_c.partition_D(s_p)
        t_s_ds_c = thr_store_c.partition_D(s_ds)

        # ---- prologue: block 0 in flight ---------------------------------------------------
        self.gather_first(n_blocks, t, m_idx, n_slots, kv_gather)

        for b in cutlass.range(n_blocks, unroll=1):
            buf = (b % 2) * BLOCK_N
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            # the next block's indices: loaded now, used after the GEMMs (latency hidden)
            upcoming = self.load_indices(b + 1, t, m_idx, n_slots, row_in_pass)

            # S and dP (K and V share the B fragment: V = the first 512 columns of K)
            acc_s = cute.make_rmem_tensor(acc_shape, Float32)
            acc_dp = cute.make_rmem_tensor(acc_shape, Float32)
            acc_s.fill(0.0)
            acc_dp.fill(0.0)
            for k in cutlass.range_constexpr(d // 16):
                cute.copy(copy_b, t_s_k_b[None, None, k], r_kb_v[None, None, 0])
                cute.copy(copy_a, t_s_q_a[None, None, k], r_qa_v[None, None, 0])
                cute.gemm(tiled_mma, acc_s, r_qa[None, None, 0], r_kb[None, None, 0], acc_s)
                if cutlass.const_expr(k < D_V // 16):
                    cute.copy(copy_a, t_s_do_a[None, None, k], r_doa_v[None, None, 0])
                    cute.gemm(tiled_mma, acc_dp, r_doa[None, None, 0], r_kb[None, None, 0],
                              acc_dp)

            self.p_ds_to_shared(acc_s, acc_dp, acc_rows_cols(acc_s), acc_rows_cols(acc_dp), coords,
                                s_valid, buf, s_lse, s_delta, scale_log2, softmax_scale,
                                [store_c, thr_store_c, t_s_p_c, t_s_ds_c])
            cute.arch.barrier()

            # dQ += dS K
            cute.copy(copy_a, t_s_ds_a, r_ds_v)
            for c in cutlass.range_constexpr(n_dq_chunks):
                t_s_kt = thr_bt.partition_S(cute.local_tile(s_kt, (CHUNK, BLOCK_N), (c, 0)))
                for k in cutlass.range_constexpr(BLOCK_N // 16):
                    cute.copy(copy_bt, t_s_kt[None, None, k], r_bt_v[None, None, 0])
                    cute.gemm(tiled_mma, acc_dq[c], r_ds[None, None, k], r_bt[None, None, 0],
                              acc_dq[c])
            cute.arch.barrier()  # every warp is done with the KV tile

            # the next block's rows stream in while dKV is computed and scattered
            if b + 1 < n_blocks:
                self.gather(upcoming, BLOCK_N - buf, *kv_gather)
            cute.arch.cp_async_commit_group()

            # dKV = dS^T Q + P^T dO, 64 columns at a time, atomically added at valid slots
            cute.copy(copy_at, t_s_dst_a, r_dst_v)
            cute.copy(copy_at, t_s_pt_a, r_pt_v)
            slots = self.dkv_slots(buf, coords, lane)
            row_ok = [s_valid[s] for s in slots]
            row_ptr = [m_dkv.iterator + Int64(s_idx[s]) * m_dkv.stride[0] for s in slots]
            for c in cutlass.range_constexpr(n_dq_chunks):
                acc_kv = cute.make_rmem_tensor(acc_shape, Float32)
                acc_kv.fill(0.0)
                t_s_qt = thr_bt.partition_S(cute.local_tile(s_qt, (CHUNK, BLOCK_H), (c, 0)))
                for k in cutlass.range_constexpr(BLOCK_H // 16):
                    cute.copy(copy_bt, t_s_qt[None, None, k], r_bt_v[None, None, 0])
                    cute.gemm(tiled_mma, acc_kv, r_dst[None, None, k], r_bt[None, None, 0], acc_kv)
                if cutlass.const_expr(c < n_v_chunks):
                    t_s_dot = thr_bt.partition_S(cute.local_tile(s_dot, (CHUNK, BLOCK_H), (c, 0)))
                    for k in cutlass.range_constexpr(BLOCK_H // 16):
                        cute.copy(copy_bt, t_s_dot[None, None, k], r_bt_v[None, None, 0])
                        cute.gemm(tiled_mma, acc_kv, r_pt[None, None, k], r_bt[None, None, 0],
                                  acc_kv)
                self.scatter_chunk(acc_rows_cols(acc_kv), coords, row_ok, row_ptr, c * CHUNK,
                                   lane)

        # ---- epilogue: dq in bf16 ------------------------------------------------------------
        cute.arch.cp_async_wait_group(0)
        g_dq = cute.local_tile(m_dq[t, None, None], (BLOCK_H, d), (hb, 0))
        c_full = thr_mma.partition_C(cute.make_identity_tensor((BLOCK_H, BLOCK_N)))
        for c in cutlass.range_constexpr(n_dq_chunks):
            t_g = thr_mma.partition_C(cute.local_tile(g_dq, (BLOCK_H, CHUNK), (0, c)))
            r_o = cute.make_fragment_like(acc_dq[c], BFloat16)
            r_o.store(acc_dq[c].load().to(BFloat16))
            for i in cutlass.range_constexpr(cute.size(r_o)):
                if cutlass.const_expr(heads >= BLOCK_H):
                    t_g[i] = r_o[i]
                else:
                    if c_full[i][0] < heads:
                        t_g[i] = r_o[i]

    # ---------------------------------------------------------------------------------------
    # sm_90a: warpgroup MMA from shared memory
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def launch_wgmma(self, q: cute.Tensor, kv: cute.Tensor, dout: cute.Tensor,
                     topk_idxs: cute.Tensor, topk_length: cute.Tensor, lse_sink: cute.Tensor,
                     delta: cute.Tensor, dq: cute.Tensor, dkv_acc: cute.Tensor,
                     softmax_scale: Float32, stream: cuda.CUstream) -> None:
        d = self.d_qk
        layouts = wgmma_smem_layouts(d)
        s_q_layout, s_do_layout = layouts["q"], layouts["dout"]
        s_kv_layout, s_p_layout = layouts["kv"], layouts["p"]
        s_qt_layout, s_dot_layout = layouts["q_t"], layouts["dout_t"]
        s_kt_layout, s_pt_layout = layouts["kv_t"], layouts["p_t"]

        @cute.struct
        class SharedStorage:
            s_q: cute.struct.Align[cute.struct.MemRange[BFloat16,
                                                         cute.cosize(s_q_layout.outer)], 1024]
            s_do: cute.struct.Align[cute.struct.MemRange[BFloat16,
                                                          cute.cosize(s_do_layout.outer)], 1024]
            s_kv: cute.struct.Align[cute.struct.MemRange[BFloat16,
                                                          cute.cosize(s_kv_layout.outer)], 1024]
            s_p: cute.struct.Align[cute.struct.MemRange[BFloat16,
                                                         cute.cosize(s_p_layout.outer)], 1024]
            s_ds: cute.struct.Align[cute.struct.MemRange[BFloat16,
                                                          cute.cosize(s_p_layout.outer)], 1024]
            s_idx: cute.struct.Align[cute.struct.MemRange[Int32, 2 * BLOCK_N], 16]
            s_valid: cute.struct.Align[cute.struct.MemRange[Int32, 2 * BLOCK_N], 16]
            s_lse: cute.struct.Align[cute.struct.MemRange[Float32, BLOCK_H], 16]
            s_delta: cute.struct.Align[cute.struct.MemRange[Float32, BLOCK_H], 16]

        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=128)
        vecs = 64 // VEC
        gmem_copy = cute.make_tiled_copy_tv(
            g2s, cute.make_layout((THREADS // vecs, vecs), stride=(vecs, 1)),
            cute.make_layout((1, VEC)))
        # two warpgroups side by side along N of every GEMM
        mma_s = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (1, 2, 1), (BLOCK_H, BLOCK_N // 2))
        mma_dq = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (1, 2, 1), (BLOCK_H, WG_CHUNK // 2))
        mma_kv = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.MN,
            Float32, (1, 2, 1), (BLOCK_N, WG_CHUNK // 2))
        s_q_rows = cute.size(q, mode=[0])
        n_hb = (self.heads + BLOCK_H - 1) // BLOCK_H
        if s_q_rows > 0:
            self.kernel_wgmma(q, kv, dout, topk_idxs, topk_length, lse_sink, delta, dq, dkv_acc,
                              softmax_scale, s_q_layout, s_do_layout, s_kv_layout, s_p_layout,
                              s_qt_layout, s_dot_layout, s_kt_layout, s_pt_layout, gmem_copy,
                              mma_s, mma_dq, mma_kv, SharedStorage).launch(
                grid=[s_q_rows, n_hb, 1],
                block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel_wgmma(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_do: cute.Tensor,
                     m_idx: cute.Tensor, m_len: cute.Tensor, m_lse: cute.Tensor,
                     m_delta: cute.Tensor, m_dq: cute.Tensor, m_dkv: cute.Tensor,
                     softmax_scale: Float32, s_q_layout: cute.ComposedLayout,
                     s_do_layout: cute.ComposedLayout, s_kv_layout: cute.ComposedLayout,
                     s_p_layout: cute.ComposedLayout, s_qt_layout: cute.ComposedLayout,
                     s_dot_layout: cute.ComposedLayout, s_kt_layout: cute.ComposedLayout,
                     s_pt_layout: cute.ComposedLayout, gmem_copy: cute.TiledCopy,
                     mma_s: cute.TiledMma, mma_dq: cute.TiledMma, mma_kv: cute.TiledMma,
                     SharedStorage: cutlass.Constexpr) -> None:
        d = self.d_qk
        heads = self.heads
        n_chunks = (d + WG_CHUNK - 1) // WG_CHUNK
        d_pad = n_chunks * WG_CHUNK
        n_v_chunks = D_V // WG_CHUNK
        # dQ accumulates over the blocks (zero-filled once per row); the other GEMMs set the
        # field per k-step: the first overwrites the accumulator (wgmma scale-d 0, no zero-fill)
        mma_dq.set(warpgroup.Field.ACCUMULATE, True)
        tidx, _, _ = cute.arch.thread_idx()
        t, hb, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        lane = cute.arch.lane_idx()
        topk = cute.size(m_idx, mode=[1])
        scale_log2 = softmax_scale * Float32(LOG2E)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        s_q = storage.s_q.get_tensor(s_q_layout.outer, swizzle=s_q_layout.inner)
        s_do = storage.s_do.get_tensor(s_do_layout.outer, swizzle=s_do_layout.inner)
        s_kv_t = storage.s_kv.get_tensor(s_kv_layout.outer, swizzle=s_kv_layout.inner)
        s_p = storage.s_p.get_tensor(s_p_layout.outer, swizzle=s_p_layout.inner)
        s_ds = storage.s_ds.get_tensor(s_p_layout.outer, swizzle=s_p_layout.inner)
        s_qt = cute.make_tensor(s_q.iterator, s_qt_layout.outer)      # (d, h)
        s_dot = cute.make_tensor(s_do.iterator, s_dot_layout.outer)   # (512, h)
        s_kt = cute.make_tensor(s_kv_t.iterator, s_kt_layout.outer)   # (d, n)
        s_pt = cute.make_tensor(s_p.iterator, s_pt_layout.outer)      # (n, h)
        s_dst = cute.make_tensor(s_ds.iterator, s_pt_layout.outer)    # (n, h)
        s_idx = storage.s_idx.get_tensor(cute.make_layout(2 * BLOCK_N))
        s_valid = storage.s_valid.get_tensor(cute.make_layout(2 * BLOCK_N))
        s_lse = storage.s_lse.get_tensor(cute.make_layout(BLOCK_H))
        s_delta = storage.s_delta.get_tensor(cute.make_layout(BLOCK_H))
        thr_copy = gmem_copy.get_slice(tidx)
        row_in_pass = tidx // (64 // VEC)
        kv_gather = self.kv_gather_args(m_kv, s_kv_t, s_idx, s_valid, row_in_pass, tidx)

        # ---- warpgroup MMA operands (descriptors over shared memory) and accumulators -------
        wg_s = mma_s.get_slice(wg * 128)
        wg_dq = mma_dq.get_slice(wg * 128)
        wg_kv = mma_kv.get_slice(wg * 128)
        r_q = mma_s.make_fragment_A(wg_s.partition_A(s_q))        # (MMA, 1, d/16)
        r_do = mma_s.make_fragment_A(wg_s.partition_A(s_do))      # (MMA, 1, 32)
        r_k = mma_s.make_fragment_B(wg_s.partition_B(s_kv_t))     # (MMA, 1, d/16)
        r_ds = mma_dq.make_fragment_A(wg_dq.partition_A(s_ds))    # (MMA, 1, 4)
        r_kt = mma_dq.make_fragment_B(wg_dq.partition_B(s_kt))    # (MMA, d_pad/128, 4)
        r_dst = mma_kv.make_fragment_A(wg_kv.partition_A(s_dst))  # (MMA, 1, 4)
        r_pt = mma_kv.make_fragment_A(wg_kv.partition_A(s_pt))    # (MMA, 1, 4)
        r_qt = [mma_kv.make_fragment_B(wg_kv.partition_B(
            cute.local_tile(s_qt, (WG_CHUNK, BLOCK_H), (c, 0)))) for c in range(n_chunks)]
        r_dot = [mma_kv.make_fragment_B(wg_kv.partition_B(
            cute.local_tile(s_dot, (WG_CHUNK, BLOCK_H), (c, 0)))) for c in range(n_v_chunks)]
        thr_s = mma_s.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)
        thr_kv = mma_kv.get_slice(tidx)
        acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C((BLOCK_H, d_pad)), Float32)
        acc_shape = thr_s.partition_shape_C((BLOCK_H, BLOCK_N))
        kv_shape = thr_kv.partition_shape_C((BLOCK_N, WG_CHUNK))
        coords = wg_rows_cols(thr_s.partition_C(cute.make_identity_tensor((BLOCK_H, BLOCK_N))))
        kv_coords = wg_rows_cols(thr_kv.partition_C(cute.make_identity_tensor((BLOCK_N,
                                                                                WG_CHUNK))))
        store_c = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                             BFloat16), mma_s)
        thr_store_c = store_c.get_slice(tidx)
        t_s_p_c = thr_store_c.partition_D(s_p)
        t_s_ds_c = thr_store_c.partition_D(s_ds)
        c_dq = thr_dq.partition_C(cute.make_identity_tensor((BLOCK_H, d_pad)))

        n_slots = self.used_slots(t, m_idx, m_len, cute.size(m_kv, mode=[0]))
        n_blocks = (n_slots + BLOCK_N - 1) // BLOCK_N

        # ---- q, dout -> shared (cp.async), lse/delta -> shared ----------------------------
        self.load_row(t, hb, m_q, m_do, m_lse, m_delta, s_q, s_do, s_lse, s_delta, thr_copy,
                      gmem_copy, row_in_pass, tidx)
        acc_dq.fill(0.0)

        # ---- prologue: block 0 in flight -----------------------------------------------
        self.gather_first(n_blocks, t, m_idx, n_slots, kv_gather)

        for b in cutlass.range(n_blocks, unroll=1):
            buf = (b % 2) * BLOCK_N
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()  # cp.async / zero-fill writes -> wgmma reads
            cute.arch.barrier()
            upcoming = self.load_indices(b + 1, t, m_idx, n_slots, row_in_pass)

            # S = Q K^T and dP = dO V^T (this warpgroup's 32 slots)
            acc_s, acc_dp = score_gemms(mma_s, acc_shape, r_q, r_do, r_k, d)

            self.p_ds_to_shared(acc_s, acc_dp, wg_rows_cols(acc_s), wg_rows_cols(acc_dp), coords,
                                s_valid, buf, s_lse, s_delta, scale_log2, softmax_scale,
                                [store_c, thr_store_c, t_s_p_c, t_s_ds_c])
            cute.arch.fence_view_async_shared()  # P / dS stores -> wgmma reads
            cute.arch.barrier()

            # dQ += dS K, then the first dKV chunk; the next gather waits for dQ only
            warpgroup.fence()
            for k in cutlass.range_constexpr(BLOCK_N // 16):
                cute.gemm(mma_dq, acc_dq, r_ds[None, None, k], r_kt[None, None, k], acc_dq)
            warpgroup.commit_group()
            slots = self.dkv_slots(buf, kv_coords, lane)
            row_ok = [s_valid[s] for s in slots]
            row_ptr = self.dkv_row_ptrs(m_dkv, s_idx, slots, buf, b * BLOCK_N, t, hb, topk)
            acc_kv = [cute.make_rmem_tensor(kv_shape, Float32) for _ in range(2)]
            self.dkv_chunks(mma_kv, acc_kv, r_dst, r_pt, r_qt, r_dot, BLOCK_H // 16, WG_CHUNK,
                            kv_coords, row_ok, row_ptr, lane,
                            d if d < d_pad else None, b + 1 < n_blocks,
                            [upcoming, BLOCK_N - buf, *kv_gather])

        # ---- epilogue: dq in bf16 --------------------------------------------------------
        cute.arch.cp_async_wait_group(0)
        g_dq = cute.local_tile(m_dq[t, None, None], (BLOCK_H, d_pad), (hb, 0))
        t_g = thr_dq.partition_C(g_dq)
        r_o = cute.make_fragment_like(acc_dq, BFloat16)
        r_o.store(acc_dq.load().to(BFloat16))
        for i in cutlass.range_constexpr(cute.size(r_o)):
            if cutlass.const_expr(heads >= BLOCK_H and d == d_pad):
                t_g[i] = r_o[i]
            else:
                if (c_dq[i][0] < heads) & (c_dq[i][1] < d):
                    t_g[i] = r_o[i]

    @cute.jit
    def p_ds_to_shared(self, acc_s: cute.Tensor, acc_dp: cute.Tensor, acc_s_rc: cute.Tensor,
                       acc_dp_rc: cute.Tensor, coords: cute.Tensor, s_valid: cute.Tensor,
                       buf: Int32, s_lse: cute.Tensor, s_delta: cute.Tensor, scale_log2: Float32,
                       softmax_scale: Float32, store: list) -> None:
        """In place, ``P = exp2(s * scale * log2e - lse * log2e)`` (masked slots ``-inf`` before
        the ``exp2``) and ``dS = P * (dP - delta) * scale`` on the score accumulators (``*_rc``:
        their (row, column) views, ``coords`` the same view of the identity tensor), then both
        as bf16 to shared memory by ``store`` = ``[tiled copy, its slice, P tile, dS tile]``."""
        store_c, thr_store_c, t_s_p_c, t_s_ds_c = store
        rows_per_thread = cute.size(coords, mode=[0])
        cols_per_thread = cute.size(coords, mode=[1])
        col_ok = [s_valid[buf + coords[0, j][1]] for j in range(cols_per_thread)]
        for r in cutlass.range_constexpr(rows_per_thread):
            row = coords[r, 0][0]
            lse_r = s_lse[row]
            delta_r = s_delta[row]
            for j in cutlass.range_constexpr(cols_per_thread):
                x = acc_s_rc[r, j] * scale_log2 - lse_r
                if col_ok[j] == 0:
                    x = Float32(-_INF)
                p = cute.math.exp2(x, fastmath=True)
                acc_s_rc[r, j] = p
                acc_dp_rc[r, j] = p * (acc_dp_rc[r, j] - delta_r) * softmax_scale
        r_p16 = cute.make_fragment_like(acc_s, BFloat16)
        r_p16.store(acc_s.load().to(BFloat16))
        r_ds16 = cute.make_fragment_like(acc_dp, BFloat16)
        r_ds16.store(acc_dp.load().to(BFloat16))
        cute.copy(store_c, thr_store_c.retile(r_p16), t_s_p_c)
        cute.copy(store_c, thr_store_c.retile(r_ds16), t_s_ds_c)

    @cute.jit
    def dkv_chunks(self, mma_kv: cute.TiledMma, acc_kv: list, ds_a: cute.Tensor, p_a: cute.Tensor,
                   q_b: list, dout_b: list, k_steps: cutlass.Constexpr, chunk: cutlass.Constexpr,
                   coords: cute.Tensor, row_ok: list, row_ptr: list,
                   lane: Int32, limit: cutlass.Constexpr, more: cutlass.Boolean,
                   gather_next: list) -> None:
        """One block's ``dKV = dS^T Q + P^T dO`` column chunks (``chunk`` columns each, ``len(q_b)``
        of them; ``P^T dO`` in the first ``len(dout_b)``), the wgmmas alternating between the two
        accumulators of ``acc_kv`` so that chunk ``c``'s MMAs overlap chunk ``c - 1``'s atomics.
        The dQ wgmmas were committed just before: once they are done (the first chunk's wait) the
        KV tile is free, and the next block's gather (:meth:`gather` with ``gather_next``) is
        issued when ``more``. The last chunk's columns from ``limit`` on are not stored."""
        n_chunks = len(q_b)
        for c in cutlass.range_constexpr(n_chunks):
            acc = acc_kv[c % 2]
            steps = [(ds_a[None, None, k], q_b[c][None, None, k]) for k in range(k_steps)]
            if cutlass.const_expr(c < len(dout_b)):
                steps += [(p_a[None, None, k], dout_b[c][None, None, k]) for k in range(k_steps)]
            warpgroup.fence()
            wg_gemm(mma_kv, acc, steps, False)  # the first step overwrites (no zero-fill)
            warpgroup.commit_group()
            warpgroup.wait_group(1)  # dQ (c = 0) or chunk c - 1 is done
            if cutlass.const_expr(c == 0):
                cute.arch.barrier()  # both warpgroups are past dQ: the KV tile is free
                if more:
                    self.gather(*gather_next)
                cute.arch.cp_async_commit_group()
            else:
                self.scatter_chunk(wg_rows_cols(acc_kv[(c - 1) % 2]), coords, row_ok, row_ptr,
                                   (c - 1) * chunk, lane)
        warpgroup.wait_group(0)
        self.scatter_chunk(wg_rows_cols(acc_kv[(n_chunks - 1) % 2]), coords, row_ok, row_ptr,
                           (n_chunks - 1) * chunk, lane, limit)

    def dkv_slots(self, base: Int32, coords: cute.Tensor, lane: Int32) -> list:
        """The slots (``base`` + accumulator row) whose ``dkv_acc`` rows this thread's
        :meth:`scatter_chunk` adds to, in the order it expects its ``row_ok`` / ``row_ptr``.

        Warpgroup flavours with 4-wide atomics: the lower and upper row of this lane's quad pair
        for each of its two fragment rows (``[A0, B0, A1, B1]``); otherwise this lane's own rows.
        """
        rows = cute.size(coords, mode=[0])
        if cutlass.const_expr(self.atomic_width == 4 and self.impl != "mma"):
            upper = (lane // 4) % 2
            found = []
            for r in range(rows):
                lower = base + coords[r, 0][0] - upper
                found += [lower, lower + 1]
            return found
        return [base + coords[r, 0][0] for r in range(rows)]

    def dkv_row_ptrs(self, m_dkv: cute.Tensor, s_idx: cute.Tensor, slots: list, buf: Int32,
                     first_slot: Int32, t: Int32, hb: Int32, topk: Int32) -> list:
        """Where :meth:`scatter_chunk` puts the dKV row of each slot of ``slots`` (positions in
        ``s_idx``, block buffer ``buf``; the block's first top-k slot is ``first_slot``): the
        ``dkv_acc`` row of the slot's KV index, or in the deterministic mode this CTA's own row
        of ``dkv_rows`` [s_q * topk, head blocks, D] (query row ``t``, slot, head block
        ``hb``)."""
        if cutlass.const_expr(self.deterministic):
            return [m_dkv.iterator + opaque_i64(
                (Int64(t) * Int64(topk) + Int64(first_slot + s - buf)) * m_dkv.stride[0]
                + Int64(hb) * m_dkv.stride[1]) for s in slots]
        return [m_dkv.iterator + opaque_i64(Int64(s_idx[s]) * m_dkv.stride[0]) for s in slots]

    @cute.jit
    def scatter_chunk(self, acc: cute.Tensor, coords: cute.Tensor, row_ok: list, row_ptr: list,
                      col0: Int32, lane: Int32, limit: cutlass.Constexpr = None) -> None:
        """Add one ``(64 slots, N columns)`` dKV accumulator to ``dkv_acc`` at valid slots (and
        columns below ``limit``, when given), in the interleaved column order of
        :func:`~dsa_aot.kernels.dkv_interleave.dkv_acc_column`; ``row_ok`` / ``row_ptr`` are
        per slot of :meth:`dkv_slots` (:meth:`dkv_row_ptrs`).

        Warpgroup flavours, ``atomic_width=4``: per 32-column group and fragment row, a lane
        keeps the 4 values of its first two 8-column blocks and trades the other 4 with the
        lane of the neighbouring quad (``lane ^ 4``, the next or previous row); then one
        ``red.global.add.v4.f32`` adds the lower row (the lower quad its own values, the upper
        quad the traded ones: 128 contiguous bytes per row) and one the upper row. The ``mma``
        flavour (each warp owns 16 of every 32 columns) adds value pairs with ``.v2`` atomics
        for ``atomic_width`` 2 or 4; ``atomic_width=1`` adds single values.

        Deterministic mode (``dkv_rows`` bf16, one writer per row): the same lane trades, then
        each lane stores its 4 values rounded to bf16 (:func:`store_bf16x4`, 8 bytes; a quad
        pair writes 64 contiguous bytes of a row) at the same interleaved columns; a
        fixed-order reduction sums the rows afterwards.

        ``scatter=False`` keeps every instruction but the atomics, behind a run-time test that
        never passes (the dKV GEMMs stay live: a timing ablation of the atomics alone).
        """
        rows = cute.size(acc, mode=[0])
        cols = cute.size(acc, mode=[1])
        if cutlass.const_expr(not self.scatter):
            row_ok = [ok // 2 for ok in row_ok]  # the flags are 0 or 1 (the compiler can't tell)
        if cutlass.const_expr(self.atomic_width == 4 and self.impl != "mma"):
            upper = (lane // 4) % 2
            quad_col = 4 * (lane % 4)
            own = cute.make_rmem_tensor(4, Float32)
            got = cute.make_rmem_tensor(4, Float32)
            vals = cute.make_rmem_tensor(4, Float32)
            for r in cutlass.range_constexpr(rows):
                for g in cutlass.range_constexpr(cols // 8):
                    for i in cutlass.range_constexpr(4):  # blocks 4g, 4g+1 kept; 4g+2, 4g+3 traded
                        own[i] = acc[r, 8 * g + i]
                        got[i] = cute.arch.shuffle_sync_bfly(acc[r, 8 * g + 4 + i], offset=4)
                    # the group's first column (a multiple of 32) relative to the chunk
                    group = col0 + coords[r, 8 * g][1] - 2 * (lane % 4)
                    for side in cutlass.range_constexpr(2):  # 0: the pair's lower row, 1: upper
                        for i in cutlass.range_constexpr(4):
                            vals[i] = own[i] if upper == side else got[i]
                        col = group + quad_col + 16 * (upper ^ side)
                        ok = row_ok[2 * r + side] != 0
                        if cutlass.const_expr(limit is not None):  # whole groups are padding
                            ok = ok & (group < limit)
                        if ok:
                            if cutlass.const_expr(self.deterministic):
                                store_bf16x4((row_ptr[2 * r + side] + col).toint(), vals[0],
                                             vals[1], vals[2], vals[3])
                            else:
                                cute.arch.red((row_ptr[2 * r + side] + col).llvm_ptr,
                                              vals.load(), op="add", dtype="f32",
                                              sem="relaxed", scope="gpu")
        elif cutlass.const_expr(self.atomic_width >= 2):
            vals = cute.make_rmem_tensor(2, Float32)
            for r in cutlass.range_constexpr(rows):
                if row_ok[r] != 0:
                    for jp in cutlass.range_constexpr(cols // 2):
                        vals[0] = acc[r, 2 * jp]
                        vals[1] = acc[r, 2 * jp + 1]
                        col = col0 + coords[r, 2 * jp][1]
                        dst = row_ptr[r] + dkv_acc_column(col)
                        if cutlass.const_expr(limit is None):
                            cute.arch.red(dst.llvm_ptr, vals.load(), op="add", dtype="f32",
                                          sem="relaxed", scope="gpu")
                        elif col < limit:
                            cute.arch.red(dst.llvm_ptr, vals.load(), op="add", dtype="f32",
                                          sem="relaxed", scope="gpu")
        else:
            for r in cutlass.range_constexpr(rows):
                if row_ok[r] != 0:
                    for j in cutlass.range_constexpr(cols):
                        col = col0 + coords[r, j][1]
                        dst = row_ptr[r] + dkv_acc_column(col)
                        if cutlass.const_expr(limit is None):
                            cute.arch.atomic_add(dst.llvm_ptr, acc[r, j])
                        elif col < limit:
                            cute.arch.atomic_add(dst.llvm_ptr, acc[r, j])

    @cute.jit
    def load_row(self, t: Int32, hb: Int32, m_q: cute.Tensor, m_do: cute.Tensor, m_lse: cute.Tensor,
                 m_delta: cute.Tensor, s_q: cute.Tensor, s_do: cute.Tensor, s_lse: cute.Tensor,
                 s_delta: cute.Tensor, thr_copy: cute.TiledCopy, gmem_copy: cute.TiledCopy,
                 row_in_pass: Int32, tidx: Int32) -> None:
        """Issue the ``cp.async`` copies of query row ``t``'s ``q`` and ``dout`` (head block ``hb``;
        zero rows past ``H``) and store its ``lse`` (base 2) and ``delta`` in shared memory."""
        d = self.d_qk
        heads = self.heads
        rows_per_pass = THREADS // (64 // VEC)
        for src, dst, width in ((m_q, s_q, d), (m_do, s_do, D_V)):
            g_src = cute.local_tile(src[t, None, None], (BLOCK_H, width), (hb, 0))
            t_g = thr_copy.partition_S(g_src)
            t_s = thr_copy.partition_D(dst)
            for m in cutlass.range_constexpr(cute.size(t_s, mode=[1])):
                if cutlass.const_expr(heads >= BLOCK_H):
                    cute.copy(gmem_copy, t_g[None, m, None], t_s[None, m, None])
                else:
                    if row_in_pass + m * rows_per_pass < heads:
                        cute.copy(gmem_copy, t_g[None, m, None], t_s[None, m, None])
                    else:
                        t_s[None, m, None].fill(0)
        if tidx < BLOCK_H:
            head = hb * BLOCK_H + tidx
            lse_val = Float32(_INF)
            delta_val = Float32(0.0)
            if head < heads:
                lse_val = m_lse[t, head] * Float32(LOG2E)
                delta_val = m_delta[t, head]
            s_lse[tidx] = lse_val
            s_delta[tidx] = delta_val

    def used_slots(self, t: Int32, m_idx: cute.Tensor, m_len: cute.Tensor, n_kv: Int32) -> Int32:
        """The slots of row ``t`` that the kernel walks
        (:func:`~dsa_aot.kernels.cutedsl_common.walked_slots`)."""
        return common.walked_slots(m_idx, m_len, t, n_kv, self.compact)

    @cute.jit
    def load_indices(self, block: Int32, t: Int32, m_idx: cute.Tensor, n_slots: Int32,
                     row_in_pass: Int32) -> list:
        """The top-k indices of this thread's gather rows of block ``block`` (-1 past the end)."""
        found = []
        rows_per_pass = self.gather_threads // (64 // VEC)
        for m in cutlass.range_constexpr(BLOCK_N // rows_per_pass):
            slot = block * BLOCK_N + row_in_pass + m * rows_per_pass
            idx = Int32(-1)
            if slot < n_slots:
                idx = m_idx[t, slot]
            found.append(idx)
        return found

    def kv_gather_args(self, m_kv: cute.Tensor, s_kv_t: cute.Tensor, s_idx: cute.Tensor,
                       s_valid: cute.Tensor, row_in_pass: Int32, tidx: Int32) -> list:
        """What :meth:`gather` needs besides the indices and the slot buffer: KV's row count,
        base address and row pitch (bytes), the KV tile's shared address, the slot index and
        validity arrays, this thread's first row and its thread index."""
        return [cute.size(m_kv, mode=[0]), m_kv.iterator.toint(), Int64(m_kv.stride[0]) * 2,
                s_kv_t.iterator.toint(), s_idx, s_valid, row_in_pass, tidx]

    @cute.jit
    def gather_first(self, n_blocks: Int32, t: Int32, m_idx: cute.Tensor, n_slots: Int32,
                     kv_gather: list) -> None:
        """Issue and commit block 0's gather into buffer 0 (an empty group when the row has no
        block): :meth:`load_indices` then :meth:`gather` (``kv_gather``: :meth:`kv_gather_args`)."""
        if n_blocks > 0:
            first = self.load_indices(0, t, m_idx, n_slots, kv_gather[-2])
            self.gather(first, 0, *kv_gather)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def gather(self, indices: list, buf: Int32, s_kv: Int32, kv_base: Int64, row_bytes: Int64,
               s_tile_base: Int32, s_idx: cute.Tensor, s_valid: cute.Tensor, row_in_pass: Int32,
               tidx: Int32) -> None:
        """Issue the ``cp.async`` copies of one block's KV rows into the KV tile (no commit) and
        record each slot's index and validity at ``buf`` in ``s_idx`` / ``s_valid``.

        A thread copies 16-byte chunk ``tidx % 8`` of every 64-column tile of its rows
        ``row_in_pass + p m`` (``p``: :attr:`gather_threads` / 8 rows a pass) into the tile's
        :attr:`kv_tile_rows`-row slabs, branch-free
        (:func:`~dsa_aot.kernels.cutedsl_common.gather_row_zfill`)."""
        j = tidx % (64 // VEC)
        rows_per_pass = self.gather_threads // (64 // VEC)
        policy = l2_policy("evict_last") if cutlass.const_expr(self.KV_EVICT_LAST) else None
        for m in cutlass.range_constexpr(self.kv_tile_rows // rows_per_pass):
            row = row_in_pass + m * rows_per_pass
            ok, src_row = gather_row_zfill(indices[m], s_kv, j, row, kv_base, row_bytes,
                                           s_tile_base, self.kv_tile_rows, 0, self.d_qk // 64,
                                           policy=policy)
            if j == 0:
                s_valid[buf + row] = Int32(1) if ok else Int32(0)
                if cutlass.const_expr(self.fixed_point):  # -1: no fixed-point add
                    s_idx[buf + row] = src_row if ok else Int32(-1)
                else:
                    s_idx[buf + row] = src_row


class SparseMlaBwdMainCompact(SparseMlaBwdMain):
    """Entry point of the compact layout (``topk_length`` given)."""

    @cute.jit
    def __call__(self, q: cute.Tensor, kv: cute.Tensor, dout: cute.Tensor,
                 topk_idxs: cute.Tensor, topk_length: cute.Tensor, lse_sink: cute.Tensor,
                 delta: cute.Tensor, dq: cute.Tensor, dkv_acc: cute.Tensor,
                 softmax_scale: Float32, stream: cuda.CUstream) -> None:
        self.launch(q, kv, dout, topk_idxs, topk_length, lse_sink, delta, dq, dkv_acc,
                    softmax_scale, stream)


class SparseMlaBwdMainNoncompact(SparseMlaBwdMain):
    """Entry point of the noncompact layout (padding marked by out-of-range indices)."""

    @cute.jit
    def __call__(self, q: cute.Tensor, kv: cute.Tensor, dout: cute.Tensor,
                 topk_idxs: cute.Tensor, lse_sink: cute.Tensor, delta: cute.Tensor,
                 dq: cute.Tensor, dkv_acc: cute.Tensor, softmax_scale: Float32,
                 stream: cuda.CUstream) -> None:
        self.launch(q, kv, dout, topk_idxs, topk_idxs, lse_sink, delta, dq, dkv_acc,
                    softmax_scale, stream)


class DeterministicCompactEntry:
    """Entry point of the deterministic mode, compact layout: ``dkv_rows`` [s_q * topk, head
    blocks, D] bf16 (every valid slot's dKV row of this CTA's heads, interleaved columns) in
    place of ``dkv_acc``. Mixed into a flavour that has the mode."""

    @cute.jit
    def __call__(self, q: cute.Tensor, kv: cute.Tensor, dout: cute.Tensor,
                 topk_idxs: cute.Tensor, topk_length: cute.Tensor, lse_sink: cute.Tensor,
                 delta: cute.Tensor, dq: cute.Tensor, dkv_rows: cute.Tensor,
                 softmax_scale: Float32, stream: cuda.CUstream) -> None:
        self.launch(q, kv, dout, topk_idxs, topk_length, lse_sink, delta, dq, dkv_rows,
                    softmax_scale, stream)


class DeterministicNoncompactEntry:
    """Entry point of the deterministic mode, noncompact layout (see
    :class:`DeterministicCompactEntry`)."""

    @cute.jit
    def __call__(self, q: cute.Tensor, kv: cute.Tensor, dout: cute.Tensor,
                 topk_idxs: cute.Tensor, lse_sink: cute.Tensor, delta: cute.Tensor,
                 dq: cute.Tensor, dkv_rows: cute.Tensor, softmax_scale: Float32,
                 stream: cuda.CUstream) -> None:
        self.launch(q, kv, dout, topk_idxs, topk_idxs, lse_sink, delta, dq, dkv_rows,
                    softmax_scale, stream)


class FixedPointCompactEntry:
    """Entry point of the fixed-point deterministic mode, compact layout: ``dkv_fixed`` [s_kv + 1,
    D + 8] int32 (:mod:`dsa_aot.kernels.fixed_point`) in place of ``dkv_acc``; the query rows
    ``row_start + i row_step`` (``i < row_count``) of the whole tensors, and ``fixed_measure``
    (nonzero: measure the KV rows' largest values, add nothing). Mixed into a flavour that has
    the mode."""

    @cute.jit
    def __call__(self, q: cute.Tensor, kv: cute.Tensor, dout: cute.Tensor,
                 topk_idxs: cute.Tensor, topk_length: cute.Tensor, lse_sink: cute.Tensor,
                 delta: cute.Tensor, dq: cute.Tensor, dkv_fixed: cute.Tensor,
                 softmax_scale: Float32, row_start: Int32, row_step: Int32, row_count: Int32,
                 fixed_measure: Int32, stream: cuda.CUstream) -> None:
        self.launch(q, kv, dout, topk_idxs, topk_length, lse_sink, delta, dq, dkv_fixed,
                    softmax_scale, stream, (row_start, row_step, row_count, fixed_measure))


class FixedPointNoncompactEntry:
    """Entry point of the fixed-point deterministic mode, noncompact layout (see
    :class:`FixedPointCompactEntry`)."""

    @cute.jit
    def __call__(self, q: cute.Tensor, kv: cute.Tensor, dout: cute.Tensor,
                 topk_idxs: cute.Tensor, lse_sink: cute.Tensor, delta: cute.Tensor,
                 dq: cute.Tensor, dkv_fixed: cute.Tensor, softmax_scale: Float32,
                 row_start: Int32, row_step: Int32, row_count: Int32, fixed_measure: Int32,
                 stream: cuda.CUstream) -> None:
        self.launch(q, kv, dout, topk_idxs, topk_idxs, lse_sink, delta, dq, dkv_fixed,
                    softmax_scale, stream, (row_start, row_step, row_count, fixed_measure))


def head_blocks(heads: int) -> int:
    """CTAs per query row: one per block of 64 heads (the rows of ``dkv_rows`` per slot)."""
    return (heads + BLOCK_H - 1) // BLOCK_H


def fake_arguments(d_qk: int, heads: int, layout: str, deterministic: bool = False,
                   fixed_point: bool = False) -> dict[str, object]:
    """Dynamic-shape stand-ins for every argument, in call order.

    ``s_q``, ``s_kv`` and ``topk`` are run-time; heads and head dims are compile-time. The last
    dim of every tensor is contiguous; bf16 row/head strides are run-time multiples of 8
    elements (16-byte aligned rows for ``cp.async``), the ``dkv_acc`` row stride a multiple of 4
    (16-byte aligned rows for the vector atomics), other strides any run-time value.
    ``deterministic``: ``dkv_rows`` [s_q * topk, head blocks, D] bf16 instead of ``dkv_acc``
    (row strides run-time multiples of 8 elements); with ``fixed_point`` too, ``dkv_fixed``
    [s_kv + 1, D + 8] int32 instead (row stride a run-time multiple of 4 words).
    """
    check_params(d_qk, heads, layout)
    s_q, s_kv, topk = run_time_sizes()
    fake = fake_tensor

    args: dict[str, object] = {
        "q": fake(BFloat16, (s_q, heads, d_qk), (vec_stride(), vec_stride(), 1), 16),
        "kv": fake(BFloat16, (s_kv, d_qk), (vec_stride(), 1), 16),
        "dout": fake(BFloat16, (s_q, heads, D_V), (vec_stride(), vec_stride(), 1), 16),
        "topk_idxs": fake(Int32, (s_q, topk), (cute.sym_int64(), 1), 4),
    }
    if layout == "compact":
        args["topk_length"] = fake(Int32, (s_q,), (cute.sym_int64(),), 4)
    args |= {
        "lse_sink": fake(Float32, (s_q, heads), (cute.sym_int64(), 1), 4),
        "delta": fake(Float32, (s_q, heads), (cute.sym_int64(), 1), 4),
        "dq": fake(BFloat16, (s_q, heads, d_qk), (vec_stride(), vec_stride(), 1), 16),
    }
    if deterministic and fixed_point:  # the fixed-point sums, scales, maxima, control row
        args["dkv_fixed"] = fake(Int32, (cute.sym_int32(symbol="kv_rows"), row_words(d_qk)),
                                 (cute.sym_int64(divisibility=4), 1), 16)
    elif deterministic:  # one row per (query row, slot, head block)
        args["dkv_rows"] = fake(BFloat16, (cute.sym_int32(symbol="positions"), head_blocks(heads),
                                           d_qk), (vec_stride(), vec_stride(), 1), 16)
    else:  # 16-byte aligned rows for the 4-wide atomics
        args["dkv_acc"] = fake(Float32, (s_kv, d_qk), (cute.sym_int64(divisibility=4), 1), 16)
    args["softmax_scale"] = Float32(1.0)
    if deterministic and fixed_point:  # the launch's query rows, and whether it only measures
        args |= {"row_start": Int32(0), "row_step": Int32(1), "row_count": Int32(0),
                 "fixed_measure": Int32(0)}
    args["stream"] = cuda.CUstream(0)
    return args


def compile_bwd_main(arch: str, d_qk: int, heads: int, layout: str, atomic_width: int = 4,
                     scatter: bool = True, impl: str = "mma", extra_options: str = "",
                     deterministic: bool = False) -> tuple[object, dict[str, object]]:
    """``cute.compile`` the kernel for ``arch`` (``CUTE_DSL_ARCH=<arch>`` set before import).

    ``impl="wgmma"`` (sm_90a only) selects the warpgroup-MMA flavour (the slot-major one lives in
    :mod:`.cutedsl_bwd_slot_major`, the one with a score and a dKV warpgroup in
    :mod:`.cutedsl_bwd_ws`). Returns the compiled function and the fake arguments it was
    compiled with.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: this module builds {IMPLS}; impl='wgmma_slot_major' is "
                         "dsa_aot.kernels.cutedsl_bwd_slot_major.compile_bwd_slot_major, "
                         "impl='wgmma_ws' dsa_aot.kernels.cutedsl_bwd_ws.compile_bwd_ws, "
                         "impl='wgmma_ws_slot_major' dsa_aot.kernels.cutedsl_bwd_ws_slot_major."
                         "compile_bwd_ws_slot_major")
    if impl == "wgmma" and arch != "sm_90a":
        raise ValueError(f"impl='wgmma' needs sm_90a, not {arch}; use impl='mma'")
    if deterministic:
        raise ValueError(f"deterministic=True: impl={impl!r} has no deterministic mode; "
                         "impl='wgmma_ws' (H64/H128) and 'wgmma_slot_major' (H16/H32) have")
    fakes = fake_arguments(d_qk, heads, layout)
    cls = SparseMlaBwdMainCompact if layout == "compact" else SparseMlaBwdMainNoncompact
    kernel = cls(d_qk, heads, layout, atomic_width=atomic_width, scatter=scatter, impl=impl)
    compiled = cute.compile(kernel, *fakes.values(),
                            options=f"--gpu-arch {arch} {extra_options}".strip())
    return compiled, fakes


def compile_flavour(entries: dict[tuple, type], module_impl: str, check,
                    arch: str, d_qk: int, heads: int, layout: str, atomic_width: int,
                    scatter: bool, impl: str, extra_options: str,
                    deterministic: bool) -> tuple[object, dict[str, object]]:
    """``cute.compile`` the entry class ``entries[deterministic, layout]`` of a flavour module
    whose flavour is ``module_impl`` (``entries[True, layout, True]`` for ``impl=module_impl +
    "_fixed"``, the fixed-point deterministic mode, and ``entries[deterministic, layout, name]``
    for a variant ``impl=module_impl + "_" + name`` such as ``_persistent``, where the module
    has them): refuses another ``impl``, then parameters that ``check(d_qk, heads, layout,
    arch)`` refuses. Returns the compiled function and the fake arguments it was compiled
    with."""
    fixed = impl == module_impl + "_fixed" and (True, layout, True) in entries
    variants = {module_impl + "_" + key[2] for key in entries
                if len(key) == 3 and isinstance(key[2], str)}
    variant = impl in variants
    if impl != module_impl and not (fixed or variant):
        raise ValueError(f"impl={impl!r}: this module builds impl={module_impl!r}"
                         + (f" or {module_impl + '_fixed'!r}" if (True, layout, True) in entries
                            else "") + "; compile_bwd_main builds the others")
    if fixed and not deterministic:
        raise ValueError(f"impl={impl!r} is a deterministic mode: pass deterministic=True, or "
                         f"impl={module_impl!r} for the fast mode")
    key = (deterministic, layout, impl[len(module_impl) + 1:])
    if variant and key not in entries:
        modes = sorted(f"layout={k[1]!r} with deterministic={k[0]}" for k in entries
                       if k[2:] == key[2:])
        raise ValueError(f"impl={impl!r} is built for {' or '.join(modes)}, not "
                         f"layout={layout!r} with deterministic={deterministic}; use "
                         f"impl={module_impl!r}")
    check(d_qk, heads, layout, arch)
    entry = (entries[(True, layout, True)] if fixed else entries[key] if variant else
             entries[deterministic, layout])
    fakes = fake_arguments(d_qk, heads, layout, deterministic, fixed)
    extra = {"fixed_point": True} if fixed else {}
    kernel = entry(d_qk, heads, layout, atomic_width=atomic_width, scatter=scatter,
                   deterministic=deterministic, **extra)
    compiled = cute.compile(kernel, *fakes.values(),
                            options=f"--gpu-arch {arch} {extra_options}".strip())
    return compiled, fakes


__all__ = ["DeterministicCompactEntry", "DeterministicNoncompactEntry", "FixedPointCompactEntry",
           "FixedPointNoncompactEntry", "SparseMlaBwdMain",
           "SparseMlaBwdMainCompact", "SparseMlaBwdMainNoncompact",
           "can_implement", "check_params", "compile_bwd_main", "compile_flavour",
           "fake_arguments", "wgmma_smem_layouts"]
