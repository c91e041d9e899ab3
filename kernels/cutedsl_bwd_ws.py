"""CuTe DSL sparse MLA backward, main stage, warpgroups by role (``impl="wgmma_ws"``, sm_90a).

The same arguments, C ABI and semantics as :mod:`dsa_aot.kernels.cutedsl_bwd_main` (see there:
``q``, ``kv``, ``dout``, ``topk_idxs``, [``topk_length``], ``lse_sink``, ``delta``, ``dq``,
``dkv_acc``, ``softmax_scale``, stream), for 64 and 128 heads (:data:`HEADS`).

Why: the ``wgmma`` flavour runs both warpgroups through the same phases in step (score GEMMs,
softmax gradient, dQ, then the dKV chunks and their atomics), so the L2 has no atomics to do
during the first half of every block and the tensor cores idle during the second: at D 576 the
atomics keep the L2 busy only 66% of the time. Here the two warpgroups take different roles and
run one block apart, so the dKV atomics of block ``b`` stream while block ``b + 1`` is gathered
and scored:

* warpgroup 0, *score*: gathers the block's KV rows (16-byte ``cp.async``; an invalid slot is
  zero-filled and flagged), ``S = Q K^T`` and ``dP = dO V^T`` (64 heads x 64 slots, k-steps
  interleaved, the first overwriting: wgmma scale-d 0), ``P = exp2(S scale log2 e - lse)``
  (invalid slots ``-inf`` before the ``exp2``), ``dS = P (dP - delta) scale``; stores ``P`` and
  ``dS`` (bf16) for warpgroup 1 and accumulates ``dQ`` columns 0-255 with ``dS`` straight from
  its registers (the A operand);
* warpgroup 1, *dKV*: accumulates the other ``dQ`` columns (``dS`` from shared memory), then
  ``dKV = dS^T Q + P^T dO`` in 64-column chunks (9 at D 576, 8 at D 512: no padding), the chunk
  GEMMs alternating between two 32-register accumulators so that chunk ``c``'s MMAs overlap
  chunk ``c - 1``'s 4-wide ``red.global.add.v4.f32`` atomics in the interleaved column order
  (:meth:`SparseMlaBwdMain.scatter_chunk`).

Hand-offs (named barriers joining all 256 threads; ``->`` arrive, ``<-`` wait), per block ``b``:

- warpgroup 0: ``S``, ``dP``, softmax gradient; ``<- PDS_EMPTY`` (block ``b - 1``'s ``P`` / ``dS``
  read by warpgroup 1's MMAs); ``P``, ``dS`` to shared; ``-> PDS_FULL``; its ``dQ`` MMAs;
  ``<- KV_EMPTY``; gather block ``b + 1`` into the one KV tile;
- warpgroup 1: ``<- PDS_FULL``; its ``dQ`` MMAs and the first dKV chunk; ``-> KV_EMPTY`` once the
  ``dQ`` MMAs are done (the KV tile's last reader); the other chunks and their atomics;
  ``-> PDS_EMPTY`` when the last chunk's MMAs are done; the last chunk's atomics.

The slot indices are double-buffered (warpgroup 1 adds block ``b`` while block ``b + 1``'s are
written). Shared memory: ``q``, ``dout``, one KV tile, ``P``, ``dS`` (229,376 bytes at D 576),
indices, ``lse`` and ``delta``: one CTA of two warpgroups per SM, one per query row and block of
64 heads (H 128: two CTAs per row, neighbours in the one-dimensional grid, so the second
gathers the row's KV rows from L2). ``dQ`` stays in registers over the
row (64 x 256 fp32 in warpgroup 0, 64 x 320 at D 576 / 64 x 256 at D 512 in warpgroup 1) and is
stored as bf16 at the end (0 for a row without a valid slot).

Deterministic mode (``deterministic=True``): warpgroup 1 stores each valid slot's dKV row of
this CTA's 64 heads (bf16) into ``dkv_rows`` [s_q * topk, head blocks, D]
(:meth:`SparseMlaBwdMain.scatter_chunk`), one writer per row; the deterministic postprocess sums
every KV row's stored rows in a fixed order. With ``impl="wgmma_ws_fixed"`` (``fixed_point``)
warpgroup 1 adds int32 fixed point into
``dkv_fixed`` [s_kv + 1, D + 8] instead of fp32 into ``dkv_acc``
(:mod:`dsa_aot.kernels.cutedsl_fixed_point`, layout :mod:`dsa_aot.kernels.fixed_point`): the same
whole-line adds, order-free; a launch whose control word is set returns at once. At D 576 the
score warpgroup takes a fifth dQ tile (the adds need warpgroup 1's registers). dQ is a per-row
register sum, fixed order, in both modes.

Fast variants (same arguments): ``impl="wgmma_ws_persistent"`` (opt-in, noncompact) takes up to
:data:`PERSISTENT_MAX_ROWS` consecutive query rows a CTA as one stream of blocks: in a row's last
block warpgroup 1 loads the next row's ``q`` / ``dout`` columns as each dKV chunk's MMAs finish
(``BAR_QDO_FULL`` once they are in) while warpgroup 0 gathers the next row's first block;
``impl="wgmma_ws_staggered"`` (H 128, the sm_90a default there, with a stored-rows
deterministic mode; the fixed-point mode walks the same order) starts a row's second head block
at the middle of the row (:meth:`SparseMlaBwdWs.block_at`). Measured in
``bench/results/h100_bwd_persistent_staggered.md`` and ``bench/results/h100_bwd_staggered.md``.

L2 cache policies (class switches, off by default): :attr:`SparseMlaBwdWs.STREAM_EVICT_FIRST`
issues the ``q`` / ``dout`` row copies (the gather's branch-free 16-byte ``cp.async``, rows =
heads) and the dQ stores with an ``L2::evict_first`` policy, and
:attr:`~dsa_aot.kernels.cutedsl_bwd_main.SparseMlaBwdMain.KV_EVICT_LAST` the KV gather with
``L2::evict_last``. Streams evict-first bring the L2 misses below the cuDNN frontend's kernel
(a quarter less DRAM traffic) without changing the time: the kernel is bound by the L2's work,
not its misses (``bench/results/h100_bwd_l2_policies.md``). Off, the PTX is the same as without
them.

:attr:`SparseMlaBwdWs.DQ_STAGED` (off by default) stores dQ through shared memory: each
warpgroup writes its tiles into the same columns of the KV tile once its last dQ MMAs are done,
then each warp stores its 16 rows as whole 128-byte lines. The default stores 4 bytes per column
pair, half a 32-byte sector in each of 8 rows, so the L2 gets twice the frontend's write sectors
and about four times its write requests; the L2's input crossbar is the kernel's busiest unit
(``bench/results/h100_ncu_bwd_l2_limiter.md``).

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
from dsa_aot.kernels.cutedsl_bwd_main import (BLOCK_H, BLOCK_N, LOG2E, DeterministicCompactEntry,
                                              DeterministicNoncompactEntry,
                                              FixedPointCompactEntry,
                                              FixedPointNoncompactEntry, SparseMlaBwdMain,
                                              SparseMlaBwdMainCompact, SparseMlaBwdMainNoncompact,
                                              compile_flavour, score_gemms, wg_gemm)
from dsa_aot.kernels.cutedsl_fixed_point import (add_fixed, chunk_max, fixed_scales, flush_max,
                                                 fold_max, launch_skipped)
from dsa_aot.kernels.cutedsl_common import (D_QK_CHOICES, D_V, LAYOUTS, VEC, gather_row_zfill,
                                            l2_policy, store_bf16x2_hint, store_staged_row,
                                            wg_acc_as_a, wg_rows_cols)

#: The ``impl`` name of this flavour (the build's ``tile.flavour``), and of its deterministic
#: mode with fixed-point adds (the default deterministic mode stores rows).
IMPL = "wgmma_ws"
FIXED_IMPL = "wgmma_ws_fixed"
#: The fast mode with several query rows a CTA (noncompact layout): the next row's q, dout and
#: first KV block load while the last block's dKV chunks are added.
PERSISTENT_IMPL = "wgmma_ws_persistent"
#: Most query rows a CTA of the persistent mode takes, and the CTAs per head block it keeps
#: (about two waves of 132 SMs): rows_per_cta = clamp(s_q // PERSISTENT_MIN_CTAS, 1, MAX).
PERSISTENT_MAX_ROWS = 4
PERSISTENT_MIN_CTAS = 264
#: The fast mode at H128 with the second head block of a row walking its blocks from the
#: middle of the row: the two CTAs of a row add into different dKV rows at any one time.
STAGGERED_IMPL = "wgmma_ws_staggered"
#: The fast mode's default order (:data:`IMPL` at H64, :data:`STAGGERED_IMPL` at H128) with
#: dQ stored in whole 128-byte lines through shared memory (:attr:`SparseMlaBwdWs.DQ_STAGED`);
#: at H16/H32 the slot-major default's (``cutedsl_bwd_ws_slot_major.compile_bwd_dq_lines``
#: builds every head count).
DQ_LINES_IMPL = "wgmma_ws_dq_lines"
#: Head counts this flavour supports (whole 64-head blocks).
HEADS = (64, 128)
WG_THREADS = 128
THREADS = 2 * WG_THREADS
#: dQ column tile and dKV column chunk (MMA N): one 64-wide 128-byte swizzle atom.
TILE = 64
#: dQ column tiles of warpgroup 0 (the rest are warpgroup 1's).
SCORE_DQ_TILES = 4
#: Named barriers (0 is __syncthreads): the three hand-offs, warpgroup 0's own, and the
#: persistent mode's next-row q / dout (warpgroup 1 -> warpgroup 0, once a row).
BAR_PDS_FULL, BAR_PDS_EMPTY, BAR_KV_EMPTY, BAR_SCORE, BAR_QDO_FULL = 1, 2, 3, 4, 5

assert main.THREADS == THREADS and main.BLOCK_H == TILE and main.BLOCK_N == TILE

_INF = float("inf")


def check_params(d_qk: int, heads: int, layout: str, arch: str = "sm_90a") -> None:
    """Raise ``ValueError`` naming the compile-time parameter this flavour cannot take."""
    main.check_params(d_qk, heads, layout)
    if heads not in HEADS:
        raise ValueError(f"heads={heads!r}: impl={IMPL!r} supports heads {HEADS}; use "
                         "impl='wgmma_ws_slot_major' (or leave impl unset) for fewer heads")
    if arch != "sm_90a":
        raise ValueError(f"impl={IMPL!r} needs sm_90a, not {arch}; use impl='mma'")


def can_implement(d_qk: int, heads: int, layout: str) -> bool:
    """Whether this flavour supports the compile-time parameters (no exception)."""
    return d_qk in D_QK_CHOICES and heads in HEADS and layout in LAYOUTS


def ws_smem_layouts(d_qk: int, heads: int = BLOCK_H) -> dict[str, cute.ComposedLayout]:
    """Shared-memory layouts (call while tracing a ``cute.jit`` function) of a CTA's ``heads``
    heads (64 here; 16 or 32 in :mod:`.cutedsl_bwd_ws_slot_major`).

    K-major tiles of 128-byte swizzled 8 x 64 atoms, rows first: ``q`` [heads, d_qk], ``dout``
    [heads, 512], ``kv`` [64 slots, d_qk] and ``p`` (also ``dS``) [heads, 64 slots]. ``q_t``,
    ``dout_t``, ``kv_t`` and ``p_t`` are MN-major views of the same bytes with the modes swapped
    (64 x 8 atoms), every 64-wide tile of the first mode contiguous.
    """
    k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, BFloat16)
    return {
        "q": cute.tile_to_shape(k_atom, (heads, d_qk), (0, 1)),
        "dout": cute.tile_to_shape(k_atom, (heads, D_V), (0, 1)),
        "kv": cute.tile_to_shape(k_atom, (BLOCK_N, d_qk), (0, 1)),
        "p": cute.tile_to_shape(k_atom, (heads, BLOCK_N), (0, 1)),
        "q_t": cute.tile_to_shape(mn_atom, (d_qk, heads), (1, 0)),
        "dout_t": cute.tile_to_shape(mn_atom, (D_V, heads), (1, 0)),
        "kv_t": cute.tile_to_shape(mn_atom, (d_qk, BLOCK_N), (1, 0)),
        "p_t": cute.tile_to_shape(mn_atom, (BLOCK_N, heads), (1, 0)),
    }


def shared_storage(d_qk: int, heads: int = BLOCK_H,
                   fixed_point: bool = False) -> tuple[dict[str, cute.ComposedLayout], type]:
    """The layouts of :func:`ws_smem_layouts` and the kernel's shared-memory struct (call while
    tracing; ``size_in_bytes()`` is the dynamic shared memory of one CTA). ``fixed_point``: also
    the dKV warpgroup's per-block-row maxima and KV rows (512 bytes)."""
    lay = ws_smem_layouts(d_qk, heads)
    align, mem = cute.struct.Align, cute.struct.MemRange
    fields = {f"s_{name}": align[mem[BFloat16, cute.cosize(lay[key].outer)], 1024]
              for name, key in (("q", "q"), ("do", "dout"), ("kv", "kv"), ("p", "p"),
                                ("ds", "p"))}
    fields |= {"s_idx": align[mem[Int32, 2 * BLOCK_N], 16],
               "s_valid": align[mem[Int32, 2 * BLOCK_N], 16],
               "s_lse": align[mem[Float32, heads], 16],
               "s_delta": align[mem[Float32, heads], 16]}
    if fixed_point:
        fields |= {"s_max": align[mem[Float32, BLOCK_N], 16],
                   "s_rows": align[mem[Int32, BLOCK_N], 16]}
    # built from a dict: this module's annotations are strings (postponed evaluation)
    SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
    return lay, SharedStorage


#: The order in which a ws kernel takes the layouts of :func:`ws_smem_layouts`.
LAYOUT_ORDER = ("q", "dout", "kv", "p", "q_t", "dout_t", "kv_t", "p_t")


def ws_smem_views(storage: object, layouts: tuple, heads: int, fixed_point: bool = False) -> dict:
    """The tiles of a ws kernel's shared-memory ``storage`` (:func:`shared_storage`) and their
    MN-major views, by the names the warpgroups use; ``layouts`` in :data:`LAYOUT_ORDER`."""
    q_lay, do_lay, kv_lay, p_lay, qt_lay, dot_lay, kt_lay, pt_lay = layouts
    s_q = storage.s_q.get_tensor(q_lay.outer, swizzle=q_lay.inner)
    s_do = storage.s_do.get_tensor(do_lay.outer, swizzle=do_lay.inner)
    s_kv = storage.s_kv.get_tensor(kv_lay.outer, swizzle=kv_lay.inner)
    s_p = storage.s_p.get_tensor(p_lay.outer, swizzle=p_lay.inner)
    s_ds = storage.s_ds.get_tensor(p_lay.outer, swizzle=p_lay.inner)
    return {
        "q": s_q, "do": s_do, "kv": s_kv, "p": s_p, "ds": s_ds,
        "qt": cute.make_tensor(s_q.iterator, qt_lay.outer),       # (d, h)
        "dot": cute.make_tensor(s_do.iterator, dot_lay.outer),    # (512, h)
        "kt": cute.make_tensor(s_kv.iterator, kt_lay.outer),      # (d, slot)
        "pt": cute.make_tensor(s_p.iterator, pt_lay.outer),       # (slot, h)
        "dst": cute.make_tensor(s_ds.iterator, pt_lay.outer),     # (slot, h)
        "idx": storage.s_idx.get_tensor(cute.make_layout(2 * BLOCK_N)),
        "valid": storage.s_valid.get_tensor(cute.make_layout(2 * BLOCK_N)),
        "lse": storage.s_lse.get_tensor(cute.make_layout(heads)),
        "delta": storage.s_delta.get_tensor(cute.make_layout(heads)),
    } | ({"max": storage.s_max.get_tensor(cute.make_layout(BLOCK_N)),
          "rows": storage.s_rows.get_tensor(cute.make_layout(BLOCK_N))}
         if fixed_point else {})


class SparseMlaBwdWs(SparseMlaBwdMain):
    """The backward main kernel with a score and a dKV warpgroup, for one ``(d_qk, heads,
    layout)``."""

    #: Whether the entry takes several query rows a CTA (:data:`PERSISTENT_IMPL`).
    PERSISTENT = False
    #: Whether head block ``hb`` starts at block ``hb * (blocks // 2)`` (:data:`STAGGERED_IMPL`).
    STAGGER = False
    #: Whether the streams read or written once (q / dout rows, dQ) carry an L2 evict-first
    #: policy, so that they leave the hot set (KV rows, fp32 dKV lines) in the L2.
    STREAM_EVICT_FIRST = False
    #: Whether dQ goes out through shared memory in whole 128-byte lines (:meth:`store_dq`);
    #: one query row a CTA only (the persistent flavour gathers the next row into the KV tile).
    DQ_STAGED = False

    def __init__(self, d_qk: int, heads: int, layout: str, atomic_width: int = 4,
                 scatter: bool = True, deterministic: bool = False,
                 fixed_point: bool = False) -> None:
        check_params(d_qk, heads, layout)
        super().__init__(d_qk, heads, layout, atomic_width=atomic_width, scatter=scatter,
                         impl="wgmma", deterministic=deterministic)
        self.impl = IMPL
        self.fixed_point = deterministic and fixed_point
        #: whether the dKV warpgroup copies a block's KV rows out of the double-buffered
        #: ``s_idx`` (needed where the score warpgroup can refill it first: slot-major)
        self.copy_rows = False
        #: dQ column tiles of warpgroup 0; at D 576 the fixed-point mode moves a fifth one
        #: there (warpgroup 1's adds need the registers: 8 bytes of spills otherwise)
        self.score_dq_tiles = SCORE_DQ_TILES + (1 if self.fixed_point and d_qk == 576 else 0)
        self.gather_threads = WG_THREADS  # warpgroup 0 gathers
        #: the heads of one CTA (the K of the dKV chunk GEMMs)
        self.cta_heads = BLOCK_H

    # ---------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def launch(self, q: cute.Tensor, kv: cute.Tensor, dout: cute.Tensor, topk_idxs: cute.Tensor,
               topk_length: cute.Tensor, lse_sink: cute.Tensor, delta: cute.Tensor,
               dq: cute.Tensor, dkv_acc: cute.Tensor, softmax_scale: Float32,
               stream: cuda.CUstream, rows: tuple | None = None) -> None:
        """``rows`` (the fixed-point mode): ``(row_start, row_step, row_count, fixed_measure)``,
        the query rows ``row_start + i row_step`` for ``i < row_count`` of the whole tensors, and
        whether this launch only measures (:meth:`kernel_measure`)."""
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=128)
        vecs = TILE // VEC
        # q and dout: 32 rows x 64 columns per pass over all threads
        row_copy = cute.make_tiled_copy_tv(
            g2s, cute.make_layout((THREADS // vecs, vecs), stride=(vecs, 1)),
            cute.make_layout((1, VEC)))
        # S / dP: (64 heads, 64 slots), A = q / dout (K-major), B = the KV tile (K-major)
        mma_s = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (1, 1, 1), (BLOCK_H, BLOCK_N))
        # dQ tile: (64 heads, 64 columns), A = dS (registers in warpgroup 0, shared memory in
        # warpgroup 1, K-major), B = the KV tile viewed (columns, slots) (MN-major)
        mma_dq_rs = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (BLOCK_H, TILE), a_source=warpgroup.OperandSource.RMEM)
        mma_dq_ss = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (BLOCK_H, TILE))
        # dKV chunk: (64 slots, 64 columns), A = dS^T / P^T (MN-major views), B = q / dout
        # viewed (columns, heads) (MN-major)
        mma_kv = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (BLOCK_N, TILE))
        def kernel_args() -> tuple:
            lay, SharedStorage = shared_storage(self.d_qk, fixed_point=self.fixed_point)
            return (q, kv, dout, topk_idxs, topk_length, lse_sink, delta, dq, dkv_acc,
                    softmax_scale, lay["q"], lay["dout"], lay["kv"], lay["p"], lay["q_t"],
                    lay["dout_t"], lay["kv_t"], lay["p_t"], row_copy, mma_s, mma_dq_rs, mma_dq_ss,
                    mma_kv), SharedStorage

        if cutlass.const_expr(self.PERSISTENT and not self.deterministic):
            # one warpgroup's copies of a 64 x 64 tile of q or dout: 16 rows a pass
            wg_copy = cute.make_tiled_copy_tv(
                g2s, cute.make_layout((WG_THREADS // vecs, vecs), stride=(vecs, 1)),
                cute.make_layout((1, VEC)))
            self.launch_persistent(kernel_args, cute.size(q, mode=[0]), self.heads // BLOCK_H,
                                   wg_copy, stream)
        else:
            self.launch_rows(kernel_args, cute.size(q, mode=[0]), self.heads // BLOCK_H, rows,
                             stream)

    @cute.jit
    def launch_persistent(self, kernel_args, s_q_rows: Int32, n_hb: cutlass.Constexpr,
                          wg_copy: cute.TiledCopy, stream: cuda.CUstream) -> None:
        """Launch :meth:`kernel_persistent`: ``rows_per_cta`` consecutive query rows a CTA (up
        to :data:`PERSISTENT_MAX_ROWS`, fewer where that would leave under
        :data:`PERSISTENT_MIN_CTAS` CTAs a head block), ``n_hb`` CTAs a row group."""
        if s_q_rows > 0:
            rows_per_cta = cutlass.min(cutlass.max(s_q_rows // PERSISTENT_MIN_CTAS, Int32(1)),
                                       Int32(PERSISTENT_MAX_ROWS))
            groups = (s_q_rows + rows_per_cta - 1) // rows_per_cta
            args, SharedStorage = kernel_args()
            self.kernel_persistent(*args, wg_copy, rows_per_cta, SharedStorage).launch(
                grid=[groups * n_hb, 1, 1], block=[THREADS, 1, 1],
                smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.jit
    def launch_rows(self, kernel_args, s_q_rows: Int32, n_hb: cutlass.Constexpr,
                    rows: tuple | None, stream: cuda.CUstream) -> None:
        """Launch :meth:`kernel_ws` over every query row (``s_q_rows``), or :meth:`kernel_rows`
        (:meth:`kernel_measure` for a measuring launch) over ``rows`` (the fixed-point mode,
        never empty), ``n_hb`` CTAs a row;
        ``kernel_args()``: the kernel's arguments and shared storage (made where they are
        used: a struct cannot cross a run-time ``if``)."""
        if cutlass.const_expr(rows is None):
            if s_q_rows > 0:
                args, SharedStorage = kernel_args()
                self.kernel_ws(*args, SharedStorage).launch(
                    grid=[s_q_rows * n_hb, 1, 1], block=[THREADS, 1, 1],
                    smem=SharedStorage.size_in_bytes(), stream=stream)
        else:
            row_start, row_step, row_count, measure = rows
            if measure != 0:
                args, SharedStorage = kernel_args()
                self.kernel_measure(*args, row_start, row_step, SharedStorage).launch(
                    grid=[row_count * n_hb, 1, 1], block=[THREADS, 1, 1],
                    smem=SharedStorage.size_in_bytes(), stream=stream)
            else:
                args, SharedStorage = kernel_args()
                self.kernel_rows(*args, row_start, row_step, SharedStorage).launch(
                    grid=[row_count * n_hb, 1, 1], block=[THREADS, 1, 1],
                    smem=SharedStorage.size_in_bytes(), stream=stream)

    # ---------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------

    @cute.kernel
    def kernel_ws(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_do: cute.Tensor,
                  m_idx: cute.Tensor, m_len: cute.Tensor, m_lse: cute.Tensor,
                  m_delta: cute.Tensor, m_dq: cute.Tensor, m_dkv: cute.Tensor,
                  softmax_scale: Float32, s_q_layout: cute.ComposedLayout,
                  s_do_layout: cute.ComposedLayout, s_kv_layout: cute.ComposedLayout,
                  s_p_layout: cute.ComposedLayout, s_qt_layout: cute.ComposedLayout,
                  s_dot_layout: cute.ComposedLayout, s_kt_layout: cute.ComposedLayout,
                  s_pt_layout: cute.ComposedLayout, row_copy: cute.TiledCopy,
                  mma_s: cute.TiledMma, mma_dq_rs: cute.TiledMma,
                  mma_dq_ss: cute.TiledMma, mma_kv: cute.TiledMma,
                  SharedStorage: cutlass.Constexpr) -> None:
        self.cta_ws(m_q, m_kv, m_do, m_idx, m_len, m_lse, m_delta, m_dq, m_dkv, softmax_scale,
                    s_q_layout, s_do_layout, s_kv_layout, s_p_layout, s_qt_layout, s_dot_layout,
                    s_kt_layout, s_pt_layout, row_copy, mma_s, mma_dq_rs, mma_dq_ss, mma_kv,
                    SharedStorage)

    @cute.kernel
    def kernel_persistent(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_do: cute.Tensor,
                          m_idx: cute.Tensor, m_len: cute.Tensor, m_lse: cute.Tensor,
                          m_delta: cute.Tensor, m_dq: cute.Tensor, m_dkv: cute.Tensor,
                          softmax_scale: Float32, s_q_layout: cute.ComposedLayout,
                          s_do_layout: cute.ComposedLayout, s_kv_layout: cute.ComposedLayout,
                          s_p_layout: cute.ComposedLayout, s_qt_layout: cute.ComposedLayout,
                          s_dot_layout: cute.ComposedLayout, s_kt_layout: cute.ComposedLayout,
                          s_pt_layout: cute.ComposedLayout, row_copy: cute.TiledCopy,
                          mma_s: cute.TiledMma, mma_dq_rs: cute.TiledMma,
                          mma_dq_ss: cute.TiledMma, mma_kv: cute.TiledMma,
                          wg_copy: cute.TiledCopy, rows_per_cta: Int32,
                          SharedStorage: cutlass.Constexpr) -> None:
        """The persistent mode's entry: CTA ``c`` takes query rows ``(c / head blocks)
        rows_per_cta`` on (up to ``rows_per_cta`` of them) of head block ``c % head blocks``."""
        self.cta_ws(m_q, m_kv, m_do, m_idx, m_len, m_lse, m_delta, m_dq, m_dkv, softmax_scale,
                    s_q_layout, s_do_layout, s_kv_layout, s_p_layout, s_qt_layout, s_dot_layout,
                    s_kt_layout, s_pt_layout, row_copy, mma_s, mma_dq_rs, mma_dq_ss, mma_kv,
                    SharedStorage, None, (rows_per_cta, wg_copy))

    @cute.kernel
    def kernel_rows(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_do: cute.Tensor,
                    m_idx: cute.Tensor, m_len: cute.Tensor, m_lse: cute.Tensor,
                    m_delta: cute.Tensor, m_dq: cute.Tensor, m_dkv: cute.Tensor,
                    softmax_scale: Float32, s_q_layout: cute.ComposedLayout,
                    s_do_layout: cute.ComposedLayout, s_kv_layout: cute.ComposedLayout,
                    s_p_layout: cute.ComposedLayout, s_qt_layout: cute.ComposedLayout,
                    s_dot_layout: cute.ComposedLayout, s_kt_layout: cute.ComposedLayout,
                    s_pt_layout: cute.ComposedLayout, row_copy: cute.TiledCopy,
                    mma_s: cute.TiledMma, mma_dq_rs: cute.TiledMma,
                    mma_dq_ss: cute.TiledMma, mma_kv: cute.TiledMma, row_start: Int32,
                    row_step: Int32, SharedStorage: cutlass.Constexpr) -> None:
        """The fixed-point mode's entry: CTA ``c`` takes query row ``row_start + (c / head
        blocks) row_step`` of the whole tensors (the runtime slices nothing: host time); every
        CTA returns at once when the control row says the launch is not needed."""
        if launch_skipped(m_dkv, cute.size(m_kv, mode=[0])) == 0:
            self.cta_ws(m_q, m_kv, m_do, m_idx, m_len, m_lse, m_delta, m_dq, m_dkv, softmax_scale,
                      s_q_layout, s_do_layout, s_kv_layout, s_p_layout, s_qt_layout, s_dot_layout,
                      s_kt_layout, s_pt_layout, row_copy, mma_s, mma_dq_rs, mma_dq_ss, mma_kv,
                      SharedStorage, (row_start, row_step, False))

    @cute.kernel
    def kernel_measure(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_do: cute.Tensor,
                    m_idx: cute.Tensor, m_len: cute.Tensor, m_lse: cute.Tensor,
                    m_delta: cute.Tensor, m_dq: cute.Tensor, m_dkv: cute.Tensor,
                    softmax_scale: Float32, s_q_layout: cute.ComposedLayout,
                    s_do_layout: cute.ComposedLayout, s_kv_layout: cute.ComposedLayout,
                    s_p_layout: cute.ComposedLayout, s_qt_layout: cute.ComposedLayout,
                    s_dot_layout: cute.ComposedLayout, s_kt_layout: cute.ComposedLayout,
                    s_pt_layout: cute.ComposedLayout, row_copy: cute.TiledCopy,
                    mma_s: cute.TiledMma, mma_dq_rs: cute.TiledMma,
                    mma_dq_ss: cute.TiledMma, mma_kv: cute.TiledMma, row_start: Int32,
                    row_step: Int32, SharedStorage: cutlass.Constexpr) -> None:
        """:meth:`kernel_rows` that only measures each KV row's largest value and adds nothing
        (the sample; a kernel of its own, so the adding one's code is untouched)."""
        if launch_skipped(m_dkv, cute.size(m_kv, mode=[0])) == 0:
            self.cta_ws(m_q, m_kv, m_do, m_idx, m_len, m_lse, m_delta, m_dq, m_dkv, softmax_scale,
                      s_q_layout, s_do_layout, s_kv_layout, s_p_layout, s_qt_layout, s_dot_layout,
                      s_kt_layout, s_pt_layout, row_copy, mma_s, mma_dq_rs, mma_dq_ss, mma_kv,
                      SharedStorage, (row_start, row_step, True))

    @cute.jit
    def cta_ws(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_do: cute.Tensor,
               m_idx: cute.Tensor, m_len: cute.Tensor, m_lse: cute.Tensor,
               m_delta: cute.Tensor, m_dq: cute.Tensor, m_dkv: cute.Tensor,
               softmax_scale: Float32, s_q_layout: cute.ComposedLayout,
               s_do_layout: cute.ComposedLayout, s_kv_layout: cute.ComposedLayout,
               s_p_layout: cute.ComposedLayout, s_qt_layout: cute.ComposedLayout,
               s_dot_layout: cute.ComposedLayout, s_kt_layout: cute.ComposedLayout,
               s_pt_layout: cute.ComposedLayout, row_copy: cute.TiledCopy,
               mma_s: cute.TiledMma, mma_dq_rs: cute.TiledMma,
               mma_dq_ss: cute.TiledMma, mma_kv: cute.TiledMma,
               SharedStorage: cutlass.Constexpr, rows: tuple | None = None,
               persistent: tuple | None = None) -> None:
        """One CTA's query row and head block; ``rows``: ``(row_start, row_step, measure)`` of
        :meth:`kernel_rows`; ``persistent``: ``(rows_per_cta, wg_copy)`` of
        :meth:`kernel_persistent` (its first row here, the others in the warpgroups' loops)."""
        d = self.d_qk
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        n_hb = self.heads // self.cta_heads
        t = bid // n_hb   # the head blocks of a row are neighbours: its second gather hits L2
        hb = bid % n_hb
        measure = False
        if cutlass.const_expr(rows is not None):
            t = rows[0] + t * rows[1]
            measure = rows[2]
        wg_rows = None
        if cutlass.const_expr(persistent is not None):
            t = t * persistent[0]
            wg_rows = cutlass.min(persistent[0], cute.size(m_q, mode=[0]) - t)
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        wtid = tidx % WG_THREADS
        topk = cute.size(m_idx, mode=[1])
        n_slots = topk  # persistent (noncompact only): one block count for all of a CTA's rows
        if cutlass.const_expr(persistent is None):
            n_slots = self.used_slots(t, m_idx, m_len, cute.size(m_kv, mode=[0]))
        n_blocks = (n_slots + BLOCK_N - 1) // BLOCK_N

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        smem_views = ws_smem_views(storage, (s_q_layout, s_do_layout, s_kv_layout, s_p_layout,
                                             s_qt_layout, s_dot_layout, s_kt_layout, s_pt_layout),
                                   self.cta_heads, self.fixed_point)

        # ---- q, dout -> shared, lse / delta; warpgroup 0 gathers block 0 ----
        self.load_query_row(t, hb, m_q, m_do, m_lse, m_delta, smem_views, row_copy, tidx, wtid,
                            wg)
        cute.arch.cp_async_commit_group()
        gather_args = self.kv_gather_args(m_kv, smem_views["kv"], smem_views["idx"],
                                          smem_views["valid"], wtid // (TILE // VEC), wtid)
        if wg == 0:
            if n_blocks > 0:
                self.gather(self.load_indices(self.block_at(0, hb, n_blocks), t, m_idx, n_slots,
                                              wtid // (TILE // VEC)), 0, *gather_args)
            cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()  # cp.async / zero-fill writes -> wgmma reads
        cute.arch.barrier()

        if cutlass.const_expr(persistent is not None):
            if wg == 0:
                self.score_warpgroup(t, hb, n_blocks, n_slots, m_idx, m_dq, softmax_scale,
                                     smem_views, gather_args, mma_s, mma_dq_rs, wtid,
                                     (wg_rows, m_lse, m_delta))
            else:
                self.dkv_warpgroup(t, hb, n_blocks, topk, m_dq, m_dkv, smem_views, mma_dq_ss,
                                   mma_kv, wtid, measure, (wg_rows, m_q, m_do, persistent[1]))
        else:
            if wg == 0:
                self.score_warpgroup(t, hb, n_blocks, n_slots, m_idx, m_dq, softmax_scale,
                                     smem_views, gather_args, mma_s, mma_dq_rs, wtid)
            else:
                self.dkv_warpgroup(t, hb, n_blocks, topk, m_dq, m_dkv, smem_views, mma_dq_ss,
                                   mma_kv, wtid, measure)

    def block_at(self, step, hb: Int32, n_blocks: Int32):
        """The row's block a CTA takes at ``step``: ``step`` itself, or with :attr:`STAGGER`
        ``(step + hb (n_blocks / 2)) % n_blocks`` (in every mode: the stored rows and the
        fixed-point adds do not depend on the order, and dq's fixed order is the fast mode's)."""
        if cutlass.const_expr(self.STAGGER):
            return (step + hb * (n_blocks // 2)) % n_blocks
        return step

    @cute.jit
    def load_query_row(self, t: Int32, hb: Int32, m_q: cute.Tensor, m_do: cute.Tensor,
                       m_lse: cute.Tensor, m_delta: cute.Tensor, sm: dict,
                       row_copy: cute.TiledCopy, tidx: Int32, wtid: Int32, wg: Int32) -> None:
        """Issue the ``cp.async`` copies of row ``t``'s ``q`` and ``dout`` (head block ``hb``),
        all threads, and store its ``lse`` (base 2) and ``delta`` (no commit)."""
        if cutlass.const_expr(self.STREAM_EVICT_FIRST):
            policy = l2_policy("evict_first")
            j = tidx % (TILE // VEC)
            rows_per_pass = THREADS // (TILE // VEC)
            for src, dst, width in ((m_q, sm["q"], self.d_qk), (m_do, sm["do"], D_V)):
                base = (src.iterator.toint() + Int64(t) * Int64(src.stride[0]) * 2
                        + Int64(hb * BLOCK_H) * Int64(src.stride[1]) * 2)
                for m in cutlass.range_constexpr(BLOCK_H // rows_per_pass):
                    row = tidx // (TILE // VEC) + m * rows_per_pass
                    gather_row_zfill(row, Int32(BLOCK_H), j, row, base, Int64(src.stride[1]) * 2,
                                     dst.iterator.toint(), BLOCK_H, 0, width // TILE,
                                     policy=policy)
            if tidx < BLOCK_H:
                head = hb * BLOCK_H + tidx
                sm["lse"][tidx] = m_lse[t, head] * Float32(LOG2E)
                sm["delta"][tidx] = m_delta[t, head]
        else:
            thr_row = row_copy.get_slice(tidx)
            self.load_row(t, hb, m_q, m_do, m_lse, m_delta, sm["q"], sm["do"], sm["lse"],
                          sm["delta"], thr_row, row_copy, tidx // (TILE // VEC), tidx)

    @cute.jit
    def score_warpgroup(self, t: Int32, hb: Int32, n_blocks: Int32, n_slots: Int32,
                        m_idx: cute.Tensor, m_dq: cute.Tensor, softmax_scale: Float32,
                        sm: dict, gather_args: list, mma_s: cute.TiledMma,
                        mma_dq: cute.TiledMma, wtid: Int32, persistent: tuple | None = None) -> None:
        """Warpgroup 0 over the row's blocks: S, dP, P, dS, its dQ tiles, the gathers.

        ``persistent``: ``(rows, lse, delta)``: rows ``t`` to ``t + rows - 1`` as one stream of
        blocks (each row's ``lse`` and ``delta`` read from memory; before a row's first ``S``, its
        ``q`` and ``dout`` from warpgroup 1, ``BAR_QDO_FULL``), the gather after a row's last block
        being the next row's first."""
        d = self.d_qk
        scale_log2 = softmax_scale * Float32(LOG2E)
        mma_dq.set(warpgroup.Field.ACCUMULATE, True)
        wg_s = mma_s.get_slice(0)
        wg_dq = mma_dq.get_slice(0)
        r_q = mma_s.make_fragment_A(wg_s.partition_A(sm["q"]))       # (MMA, 1, d/16)
        r_do = mma_s.make_fragment_A(wg_s.partition_A(sm["do"]))     # (MMA, 1, 32)
        r_k = mma_s.make_fragment_B(wg_s.partition_B(sm["kv"]))      # (MMA, 1, d/16)
        r_kt = [mma_dq.make_fragment_B(wg_dq.partition_B(                # (MMA, 1, 4) each
            cute.local_tile(sm["kt"], (TILE, BLOCK_N), (i, 0))))
            for i in range(self.score_dq_tiles)]
        thr_s = mma_s.get_slice(wtid)
        thr_dq = mma_dq.get_slice(wtid)
        acc_shape = thr_s.partition_shape_C((BLOCK_H, BLOCK_N))
        acc_dq = [cute.make_rmem_tensor(thr_dq.partition_shape_C((BLOCK_H, TILE)), Float32)
                  for _ in range(self.score_dq_tiles)]
        for i in cutlass.range_constexpr(self.score_dq_tiles):
            acc_dq[i].fill(0.0)
        coords = wg_rows_cols(thr_s.partition_C(cute.make_identity_tensor((BLOCK_H, BLOCK_N))))
        rows_per_thread = cute.size(coords, mode=[0])
        cols_per_thread = cute.size(coords, mode=[1])
        store_c = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                             BFloat16), mma_s)
        thr_store_c = store_c.get_slice(wtid)
        t_s_p_c = thr_store_c.partition_D(sm["p"])
        t_s_ds_c = thr_store_c.partition_D(sm["ds"])
        s_valid = sm["valid"]
        row_in_pass = wtid // (TILE // VEC)
        block = [mma_s, acc_shape, r_q, r_do, r_k, coords, s_valid, scale_log2, softmax_scale,
                 store_c, thr_store_c, t_s_p_c, t_s_ds_c, mma_dq, acc_dq, r_kt]

        if cutlass.const_expr(persistent is None):
            lse_r = [sm["lse"][coords[r, 0][0]] for r in range(rows_per_thread)]
            delta_r = [sm["delta"][coords[r, 0][0]] for r in range(rows_per_thread)]
            for b in cutlass.range(n_blocks, unroll=1):
                buf = (b % 2) * BLOCK_N
                upcoming = self.load_indices(self.block_at(b + 1, hb, n_blocks), t, m_idx,
                                             n_slots, row_in_pass)
                if b > 0:  # this warpgroup's gather of block b is in; make it visible to all
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=BAR_SCORE, number_of_threads=WG_THREADS)
                self.score_block(b > 0, buf, lse_r, delta_r, *block)
                # the next block into the KV tile once warpgroup 1's dQ MMAs are done with it
                if b + 1 < n_blocks:
                    cute.arch.barrier(barrier_id=BAR_KV_EMPTY, number_of_threads=THREADS)
                    self.gather(upcoming, BLOCK_N - buf, *gather_args)
                    cute.arch.cp_async_commit_group()
            self.store_dq(t, hb, m_dq, acc_dq, thr_dq, 0, (mma_dq, sm["kv"], wtid))
        else:
            n_rows, m_lse, m_delta = persistent
            total = n_rows * n_blocks
            heads = [hb * BLOCK_H + coords[r, 0][0] for r in range(rows_per_thread)]
            for i in cutlass.range(n_rows, unroll=1):
                row = t + i
                lse_r = [m_lse[row, h] * Float32(LOG2E) for h in heads]
                delta_r = [m_delta[row, h] for h in heads]
                if i > 0:  # this row's q and dout are in (warpgroup 1 loaded them)
                    cute.arch.barrier(barrier_id=BAR_QDO_FULL, number_of_threads=THREADS)
                for b in cutlass.range(n_blocks, unroll=1):
                    g = i * n_blocks + b  # the CTA's block count: the buffer parity runs on
                    buf = (g % 2) * BLOCK_N
                    nxt = g + 1  # this row's next block, or the next row's first (none last)
                    upcoming = self.load_indices(
                        nxt % n_blocks, cutlass.min(t + nxt // n_blocks, t + n_rows - 1), m_idx,
                        n_slots, row_in_pass)
                    if g > 0:
                        cute.arch.cp_async_wait_group(0)
                        cute.arch.fence_view_async_shared()
                        cute.arch.barrier(barrier_id=BAR_SCORE, number_of_threads=WG_THREADS)
                    self.score_block(g > 0, buf, lse_r, delta_r, *block)
                    if nxt < total:
                        cute.arch.barrier(barrier_id=BAR_KV_EMPTY, number_of_threads=THREADS)
                        self.gather(upcoming, BLOCK_N - buf, *gather_args)
                        cute.arch.cp_async_commit_group()
                self.store_dq(row, hb, m_dq, acc_dq, thr_dq, 0)
                for k in cutlass.range_constexpr(self.score_dq_tiles):
                    acc_dq[k].fill(0.0)

    @cute.jit
    def score_block(self, handed_before: cutlass.Boolean, buf: Int32, lse_r: list,
                    delta_r: list, mma_s: cute.TiledMma, acc_shape, r_q: cute.Tensor,
                    r_do: cute.Tensor, r_k: cute.Tensor, coords: cute.Tensor,
                    s_valid: cute.Tensor, scale_log2: Float32, softmax_scale: Float32,
                    store_c: cute.TiledCopy, thr_store_c, t_s_p_c: cute.Tensor,
                    t_s_ds_c: cute.Tensor, mma_dq: cute.TiledMma, acc_dq: list,
                    r_kt: list) -> None:
        """One block of warpgroup 0 (its KV tile gathered, slot flags at ``buf``): ``S``, ``dP``,
        the softmax gradient, ``P`` / ``dS`` to shared memory once warpgroup 1 has read the last
        ones (``BAR_PDS_EMPTY``, when ``handed_before``), ``BAR_PDS_FULL``, its dQ MMAs."""
        d = self.d_qk
        rows_per_thread = cute.size(coords, mode=[0])
        cols_per_thread = cute.size(coords, mode=[1])
        # S = Q K^T and dP = dO V^T, interleaved k-steps; k = 0 overwrites (scale-d 0)
        acc_s, acc_dp = score_gemms(mma_s, acc_shape, r_q, r_do, r_k, d)

        acc_s_rc = wg_rows_cols(acc_s)
        acc_dp_rc = wg_rows_cols(acc_dp)
        col_ok = [s_valid[buf + coords[0, j][1]] for j in range(cols_per_thread)]
        for r in cutlass.range_constexpr(rows_per_thread):
            for j in cutlass.range_constexpr(cols_per_thread):
                x = acc_s_rc[r, j] * scale_log2 - lse_r[r]
                if col_ok[j] == 0:
                    x = Float32(-_INF)
                p = cute.math.exp2(x, fastmath=True)
                acc_s_rc[r, j] = p
                acc_dp_rc[r, j] = p * (acc_dp_rc[r, j] - delta_r[r]) * softmax_scale
        r_p16 = cute.make_fragment_like(acc_s, BFloat16)
        r_p16.store(acc_s.load().to(BFloat16))
        r_ds16 = cute.make_fragment_like(acc_dp, BFloat16)
        r_ds16.store(acc_dp.load().to(BFloat16))

        # hand P and dS over once warpgroup 1's MMAs of the previous block are done
        if handed_before:
            cute.arch.barrier(barrier_id=BAR_PDS_EMPTY, number_of_threads=THREADS)
        cute.copy(store_c, thr_store_c.retile(r_p16), t_s_p_c)
        cute.copy(store_c, thr_store_c.retile(r_ds16), t_s_ds_c)
        cute.arch.fence_view_async_shared()  # P / dS stores -> warpgroup 1's wgmma reads
        cute.arch.barrier_arrive(barrier_id=BAR_PDS_FULL, number_of_threads=THREADS)

        # dQ of its tiles += dS K, dS from registers
        r_dsa = wg_acc_as_a(r_ds16)
        warpgroup.fence()
        for i in cutlass.range_constexpr(self.score_dq_tiles):
            for k in cutlass.range_constexpr(BLOCK_N // 16):
                cute.gemm(mma_dq, acc_dq[i], r_dsa[None, None, k], r_kt[i][None, None, k],
                          acc_dq[i])
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def dkv_warpgroup(self, t: Int32, hb: Int32, n_blocks: Int32, topk: Int32,
                      m_dq: cute.Tensor, m_dkv: cute.Tensor, sm: dict, mma_dq: cute.TiledMma,
                      mma_kv: cute.TiledMma, wtid: Int32, measure: cutlass.Constexpr,
                      persistent: tuple | None = None) -> None:
        """Warpgroup 1 over the row's blocks (:meth:`dkv_block`): the other dQ tiles (none when
        the score warpgroup takes them all), dKV chunks and their atomics (the deterministic
        mode: their stored rows; the fixed-point mode: their integer adds, or with ``measure``
        set only their largest values).

        ``persistent``: ``(rows, q, dout, wg_copy)``: rows ``t`` to ``t + rows - 1`` as one
        stream of blocks; a row's last block loads the next row's ``q`` and ``dout`` chunk by
        chunk, and the row ends with ``BAR_QDO_FULL`` once they are in."""
        d = self.d_qk
        heads = self.cta_heads
        n_dq = d // TILE - self.score_dq_tiles
        n_chunks = d // TILE
        n_v_chunks = D_V // TILE
        lane = cute.arch.lane_idx()
        wg_kv = mma_kv.get_slice(0)
        r_dst = mma_kv.make_fragment_A(wg_kv.partition_A(sm["dst"]))  # (MMA, 1, heads/16)
        r_pt = mma_kv.make_fragment_A(wg_kv.partition_A(sm["pt"]))    # (MMA, 1, heads/16)
        r_qt = [mma_kv.make_fragment_B(wg_kv.partition_B(
            cute.local_tile(sm["qt"], (TILE, heads), (c, 0)))) for c in range(n_chunks)]
        r_dot = [mma_kv.make_fragment_B(wg_kv.partition_B(
            cute.local_tile(sm["dot"], (TILE, heads), (c, 0)))) for c in range(n_v_chunks)]
        thr_kv = mma_kv.get_slice(wtid)
        # without dQ tiles mma_dq is left alone: it is the score warpgroup's (a TiledMma's fields
        # are traced values; set in both branches of the warpgroup split, they escape one)
        acc_dq, r_ds, r_kt, thr_dq = [], None, [], None
        if cutlass.const_expr(n_dq > 0):
            mma_dq.set(warpgroup.Field.ACCUMULATE, True)
            wg_dq = mma_dq.get_slice(0)
            r_ds = mma_dq.make_fragment_A(wg_dq.partition_A(sm["ds"]))   # (MMA, 1, 4)
            r_kt = [mma_dq.make_fragment_B(wg_dq.partition_B(             # (MMA, 1, 4) each
                cute.local_tile(sm["kt"], (TILE, BLOCK_N), (self.score_dq_tiles + i, 0))))
                for i in range(n_dq)]
            thr_dq = mma_dq.get_slice(wtid)
            acc_dq = [cute.make_rmem_tensor(thr_dq.partition_shape_C((BLOCK_H, TILE)), Float32)
                      for _ in range(n_dq)]
            for i in cutlass.range_constexpr(n_dq):
                acc_dq[i].fill(0.0)
        kv_shape = thr_kv.partition_shape_C((BLOCK_N, TILE))
        kv_coords = wg_rows_cols(thr_kv.partition_C(cute.make_identity_tensor((BLOCK_N, TILE))))
        k_steps = heads // 16
        fixed_base = m_dkv.iterator.toint()
        fixed_stride = Int32(m_dkv.stride[0])
        warp_rows = (wtid // 32) * 16
        if cutlass.const_expr(self.fixed_point):  # each warp's 16 block rows: their max slots
            if lane < 16:
                sm["max"][warp_rows + lane] = Float32(0.0)
            cute.arch.sync_warp()

        state = [n_dq, mma_dq, acc_dq, r_ds, r_kt, mma_kv, r_dst, r_pt, r_qt, r_dot, kv_shape,
                 kv_coords, k_steps, fixed_base, fixed_stride, warp_rows, lane, m_dkv, sm, topk,
                 hb, measure]
        if cutlass.const_expr(persistent is None):
            for b in cutlass.range(n_blocks, unroll=1):
                self.dkv_block(self.block_at(b, hb, n_blocks), (b % 2) * BLOCK_N,
                               b + 1 < n_blocks, t, None, *state)
            if cutlass.const_expr(n_dq > 0):
                self.store_dq(t, hb, m_dq, acc_dq, thr_dq, self.score_dq_tiles,
                              (mma_dq, sm["kv"], wtid))
        else:
            n_rows, m_q, m_do, wg_copy = persistent
            total = n_rows * n_blocks
            for i in cutlass.range(n_rows, unroll=1):
                row = t + i
                for b in cutlass.range(n_blocks, unroll=1):
                    g = i * n_blocks + b
                    # in the row's last block (not the CTA's last) the next row's q / dout load
                    self.dkv_block(b, (g % 2) * BLOCK_N, g + 1 < total, row,
                                   ((g + 1 < total) & (b + 1 == n_blocks), row + 1, hb, m_q,
                                    m_do, sm, wg_copy, wtid), *state)
                if i + 1 < n_rows:  # the next row's q and dout are in: warpgroup 0 may score it
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier_arrive(barrier_id=BAR_QDO_FULL, number_of_threads=THREADS)
                if cutlass.const_expr(n_dq > 0):  # (under the next row's first scores)
                    self.store_dq(row, hb, m_dq, acc_dq, thr_dq, self.score_dq_tiles)
                    for k in cutlass.range_constexpr(n_dq):
                        acc_dq[k].fill(0.0)

    @cute.jit
    def dkv_block(self, b: Int32, buf: Int32, more: cutlass.Boolean, t: Int32,
                  reload: tuple | None, n_dq: cutlass.Constexpr, mma_dq: cute.TiledMma,
                  acc_dq: list, r_ds, r_kt: list, mma_kv: cute.TiledMma, r_dst: cute.Tensor,
                  r_pt: cute.Tensor, r_qt: list, r_dot: list, kv_shape, kv_coords: cute.Tensor,
                  k_steps: cutlass.Constexpr, fixed_base, fixed_stride: Int32, warp_rows: Int32,
                  lane: Int32, m_dkv: cute.Tensor, sm: dict, topk: Int32, hb: Int32,
                  measure: cutlass.Constexpr) -> None:
        """Block ``b`` of row ``t`` (slot flags at ``buf``) in warpgroup 1: ``<- PDS_FULL``, its
        dQ MMAs, the dKV chunks and their adds, ``-> KV_EMPTY`` and ``-> PDS_EMPTY`` when
        ``more`` blocks follow. ``reload``: ``(now, row, hb, q, dout, sm, wg_copy, wtid)``; when
        ``now``, each chunk's q / dout columns load for ``row`` once the chunk's MMAs are done
        (one ``cp.async`` group, committed after the last)."""
        d = self.d_qk
        n_chunks = d // TILE
        n_v_chunks = D_V // TILE
        cute.arch.barrier(barrier_id=BAR_PDS_FULL, number_of_threads=THREADS)
        if cutlass.const_expr(n_dq > 0):
            warpgroup.fence()
            for i in cutlass.range_constexpr(n_dq):
                for k in cutlass.range_constexpr(BLOCK_N // 16):
                    cute.gemm(mma_dq, acc_dq[i], r_ds[None, None, k],
                              r_kt[i][None, None, k], acc_dq[i])
            warpgroup.commit_group()
        row_ok, row_ptr, fixed = [], [], []
        rows, first = sm["idx"], buf + warp_rows
        if cutlass.const_expr(self.fixed_point and self.copy_rows):
            # the block's KV rows, this warp's 16, into warpgroup 1's own slots: the adds
            # read them after PDS_EMPTY, when the slot-major score warpgroup may gather
            # block b + 2 into this half of the index buffer (here it waits on KV_EMPTY)
            if lane < 16:
                sm["rows"][warp_rows + lane] = sm["idx"][buf + warp_rows + lane]
            cute.arch.sync_warp()
            rows, first = sm["rows"], warp_rows
        if cutlass.const_expr(self.fixed_point):
            # a warp whose 16 block rows are all invalid slots (padding) adds nothing
            live = cute.arch.vote_any_sync(rows[first + lane % 16] >= 0)
            fixed = [rows, first, fixed_stride, fixed_scales(m_dkv, rows, first, lane, d),
                     fixed_base, Int32(cute.size(m_dkv, mode=[0])), sm["max"], warp_rows, live,
                     measure]
        else:
            slots = self.dkv_slots(buf, kv_coords, lane)
            row_ok = [sm["valid"][s] for s in slots]
            row_ptr = self.dkv_row_ptrs(m_dkv, sm["idx"], slots, buf, b * BLOCK_N, t, hb,
                                        topk)
        acc_kv = [cute.make_rmem_tensor(kv_shape, Float32) for _ in range(2)]
        for c in cutlass.range_constexpr(n_chunks):
            steps = [(r_dst[None, None, k], r_qt[c][None, None, k]) for k in range(k_steps)]
            if cutlass.const_expr(c < n_v_chunks):
                steps += [(r_pt[None, None, k], r_dot[c][None, None, k])
                          for k in range(k_steps)]
            warpgroup.fence()
            wg_gemm(mma_kv, acc_kv[c % 2], steps, False)  # the first step overwrites
            warpgroup.commit_group()
            if cutlass.const_expr(c == 0):
                if cutlass.const_expr(n_dq > 0):
                    warpgroup.wait_group(1)  # dQ is done
                    if more:  # the KV tile's last reader is done
                        cute.arch.barrier_arrive(barrier_id=BAR_KV_EMPTY,
                                                 number_of_threads=THREADS)
            else:
                warpgroup.wait_group(1)  # chunk c - 1 is done
                if cutlass.const_expr(reload is not None):
                    if reload[0]:  # its q / dout columns are free: the next row's
                        self.reload_chunk(c - 1, *reload[1:])
                self.add_chunk(wg_rows_cols(acc_kv[(c - 1) % 2]), kv_coords, row_ok, row_ptr,
                               fixed, (c - 1) * TILE, lane)
        warpgroup.wait_group(0)
        if more:  # P / dS read for the last time: the next block's may land
            cute.arch.barrier_arrive(barrier_id=BAR_PDS_EMPTY, number_of_threads=THREADS)
        if cutlass.const_expr(reload is not None):
            if reload[0]:
                self.reload_chunk(n_chunks - 1, *reload[1:])
                cute.arch.cp_async_commit_group()
        self.add_chunk(wg_rows_cols(acc_kv[(n_chunks - 1) % 2]), kv_coords, row_ok, row_ptr,
                       fixed, (n_chunks - 1) * TILE, lane)
        if cutlass.const_expr(self.fixed_point):
            flush_max(sm["max"], warp_rows, rows, first, fixed_stride, fixed_base,
                      lane, d)

    @cute.jit
    def reload_chunk(self, c: cutlass.Constexpr, row: Int32, hb: Int32, m_q: cute.Tensor,
                     m_do: cute.Tensor, sm: dict, wg_copy: cute.TiledCopy, wtid: Int32) -> None:
        """Issue warpgroup 1's ``cp.async`` copies of row ``row``'s ``q`` (and ``dout`` below
        column 512) columns ``64 c`` to ``64 c + 63`` of head block ``hb`` (no commit)."""
        thr = wg_copy.get_slice(wtid)
        pairs = [(m_q, sm["q"])] + ([(m_do, sm["do"])] if c < D_V // TILE else [])
        for src, dst in pairs:
            g_src = cute.local_tile(src[row, None, None], (BLOCK_H, TILE), (hb, c))
            s_dst = cute.local_tile(dst, (BLOCK_H, TILE), (0, c))
            cute.copy(wg_copy, thr.partition_S(g_src), thr.partition_D(s_dst))

    @cute.jit
    def add_chunk(self, acc: cute.Tensor, coords: cute.Tensor, row_ok: list, row_ptr: list,
                  fixed: list, col0: cutlass.Constexpr, lane: Int32) -> None:
        """One dKV chunk into ``dkv_fixed`` (the fixed-point mode, :func:`add_fixed` with
        ``fixed`` = its ``[s_idx, first, stride, scales, base, rows]``, then :func:`fold_max`
        with ``[s_max, warp_rows]``; nothing when ``fixed[8]`` is false: the warp's rows hold no
        valid slot; with ``fixed[9]`` set the maxima alone, :func:`chunk_max`, no add) or by
        :meth:`scatter_chunk` (the fp32 atomics, or the stored rows)."""
        if cutlass.const_expr(self.fixed_point):
            if fixed[8]:
                if cutlass.const_expr(fixed[9]):
                    fold_max(chunk_max(acc), fixed[6], fixed[7], lane)
                else:
                    fold_max(add_fixed(acc, *fixed[:6], col0, lane), fixed[6], fixed[7], lane)
        else:
            self.scatter_chunk(acc, coords, row_ok, row_ptr, col0, lane)

    @cute.jit
    def store_dq(self, t: Int32, hb: Int32, m_dq: cute.Tensor, acc_dq: list,
                 thr_dq: cute.TiledMma, first_tile: cutlass.Constexpr,
                 staging: tuple | None = None) -> None:
        """Store this warpgroup's dQ column tiles (from ``first_tile`` on) of row ``t`` as bf16.

        ``staging``: ``(mma_dq, s_kv, wtid)``, given where the row is the CTA's last (the KV
        tile is then read only by each warpgroup's own dQ MMAs); with :attr:`DQ_STAGED` the
        tiles go through the same columns of the KV tile and each warp stores the 16 rows it
        holds as whole 128-byte lines (8 lanes a line, 16 bytes each) instead of 4 bytes per
        column pair, half a sector in each of 8 rows."""
        if cutlass.const_expr(self.DQ_STAGED and staging is not None):
            self.store_dq_staged(t, hb, m_dq, acc_dq, first_tile, *staging)
        else:
            for i in cutlass.range_constexpr(len(acc_dq)):
                g_dq = cute.local_tile(m_dq[t, None, None], (BLOCK_H, TILE), (hb, first_tile + i))
                t_g = thr_dq.partition_C(g_dq)
                if cutlass.const_expr(self.STREAM_EVICT_FIRST):
                    policy = l2_policy("evict_first")
                    # (e, e + 1): adjacent columns
                    for e in cutlass.range_constexpr(0, cute.size(t_g), 2):
                        store_bf16x2_hint((t_g.iterator + t_g.layout(e)).toint(), acc_dq[i][e],
                                          acc_dq[i][e + 1], policy)
                else:
                    r_o = cute.make_fragment_like(acc_dq[i], BFloat16)
                    r_o.store(acc_dq[i].load().to(BFloat16))
                    for e in cutlass.range_constexpr(cute.size(r_o)):
                        t_g[e] = r_o[e]

    @cute.jit
    def store_dq_staged(self, t: Int32, hb: Int32, m_dq: cute.Tensor, acc_dq: list,
                        first_tile: cutlass.Constexpr, mma_dq: cute.TiledMma, s_kv: cute.Tensor,
                        wtid: Int32) -> None:
        """:meth:`store_dq` through shared memory: the tiles as bf16 into the KV tile's columns
        (the MMA's C layout, swizzled like the gather's rows), then per warp its 16 rows (the
        accumulator rows it holds, so a warp barrier orders them) read back and stored 16 bytes
        a lane."""
        copy_c = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                            BFloat16), mma_dq)
        thr_c = copy_c.get_slice(wtid)
        for i in cutlass.range_constexpr(len(acc_dq)):
            r_o = cute.make_fragment_like(acc_dq[i], BFloat16)
            r_o.store(acc_dq[i].load().to(BFloat16))
            s_tile = cute.local_tile(s_kv, (BLOCK_H, TILE), (0, first_tile + i))
            cute.copy(copy_c, thr_c.retile(r_o), thr_c.partition_D(s_tile))
        cute.arch.sync_warp()
        lane = wtid % 32
        chunk = lane % (TILE // VEC)
        s_base = s_kv.iterator.toint()
        g_base = m_dq.iterator.toint() + (Int64(t) * Int64(m_dq.stride[0])
                                          + Int64(hb * BLOCK_H) * Int64(m_dq.stride[1])) * 2
        for k in cutlass.range_constexpr(4):
            # 16 rows a warp, 4 rows of 8 lanes a pass
            r = (wtid // 32) * 16 + k * 4 + lane // (TILE // VEC)
            g_row = g_base + Int64(r) * Int64(m_dq.stride[1]) * 2 + chunk * VEC * 2
            store_staged_row(s_base, BLOCK_H, r, chunk, range(first_tile, first_tile + len(acc_dq)),
                             g_row)


class SparseMlaBwdWsCompact(SparseMlaBwdWs, SparseMlaBwdMainCompact):
    """Entry point of the compact layout (``topk_length`` given)."""


class SparseMlaBwdWsNoncompact(SparseMlaBwdWs, SparseMlaBwdMainNoncompact):
    """Entry point of the noncompact layout (padding marked by out-of-range indices)."""


class SparseMlaBwdWsNoncompactPersistent(SparseMlaBwdWsNoncompact):
    """Entry point of the persistent fast mode (:data:`PERSISTENT_IMPL`), noncompact layout."""

    PERSISTENT = True


class SparseMlaBwdWsCompactStaggered(SparseMlaBwdWsCompact):
    """Entry point of the staggered fast mode (:data:`STAGGERED_IMPL`), compact layout."""

    STAGGER = True


class SparseMlaBwdWsNoncompactStaggered(SparseMlaBwdWsNoncompact):
    """Entry point of the staggered fast mode (:data:`STAGGERED_IMPL`), noncompact layout."""

    STAGGER = True


class DqLinesEntry:
    """Mixin of the :data:`DQ_LINES_IMPL` entry points (here and in
    :mod:`.cutedsl_bwd_ws_slot_major`): dQ through shared memory, and at H128 the staggered
    order of the fast mode's default there."""

    DQ_STAGED = True

    def __init__(self, d_qk: int, heads: int, layout: str, **kwargs) -> None:
        super().__init__(d_qk, heads, layout, **kwargs)
        self.STAGGER = heads > BLOCK_H


class SparseMlaBwdWsCompactDqLines(DqLinesEntry, SparseMlaBwdWsCompact):
    """Entry point of :data:`DQ_LINES_IMPL`, compact layout."""


class SparseMlaBwdWsNoncompactDqLines(DqLinesEntry, SparseMlaBwdWsNoncompact):
    """Entry point of :data:`DQ_LINES_IMPL`, noncompact layout."""


class SparseMlaBwdWsCompactDeterministic(DeterministicCompactEntry, SparseMlaBwdWs):
    """Entry point of the deterministic mode (stored rows), compact layout."""


class SparseMlaBwdWsNoncompactDeterministic(DeterministicNoncompactEntry, SparseMlaBwdWs):
    """Entry point of the deterministic mode (stored rows), noncompact layout."""


class SparseMlaBwdWsCompactDeterministicStaggered(SparseMlaBwdWsCompactDeterministic):
    """Entry point of the staggered order's deterministic mode (stored rows), compact layout."""

    STAGGER = True


class SparseMlaBwdWsNoncompactDeterministicStaggered(SparseMlaBwdWsNoncompactDeterministic):
    """Entry point of the staggered order's deterministic mode (stored rows), noncompact layout."""

    STAGGER = True


class SparseMlaBwdWsCompactFixedPoint(FixedPointCompactEntry, SparseMlaBwdWs):
    """Entry point of the fixed-point deterministic mode, compact layout (at H128 in the staggered
    order of the fast mode's default, so dq is the fast mode's bit for bit)."""

    STAGGER = True


class SparseMlaBwdWsNoncompactFixedPoint(FixedPointNoncompactEntry, SparseMlaBwdWs):
    """Entry point of the fixed-point deterministic mode, noncompact layout (staggered at H128,
    as the compact one)."""

    STAGGER = True


def compile_bwd_ws(arch: str, d_qk: int, heads: int, layout: str, atomic_width: int = 4,
                   scatter: bool = True, impl: str = IMPL, extra_options: str = "",
                   deterministic: bool = False) -> tuple[object, dict[str, object]]:
    """``cute.compile`` this kernel for ``arch`` (sm_90a; ``CUTE_DSL_ARCH`` set before import).
    Returns the compiled function and the fake arguments (those of
    :func:`~dsa_aot.kernels.cutedsl_bwd_main.fake_arguments`) it was compiled with. ``impl`` is
    the build's flavour name, this module's (:data:`IMPL`, :data:`PERSISTENT_IMPL` for several
    query rows a CTA, :data:`STAGGERED_IMPL` for H128's head blocks half a row apart, or
    :data:`DQ_LINES_IMPL` for dQ stored in whole lines, or :data:`FIXED_IMPL` for the
    fixed-point deterministic mode)."""
    entries = {(False, "compact"): SparseMlaBwdWsCompact,
               (False, "noncompact"): SparseMlaBwdWsNoncompact,
               (False, "noncompact", "persistent"): SparseMlaBwdWsNoncompactPersistent,
               (False, "compact", "staggered"): SparseMlaBwdWsCompactStaggered,
               (False, "noncompact", "staggered"): SparseMlaBwdWsNoncompactStaggered,
               (False, "compact", "dq_lines"): SparseMlaBwdWsCompactDqLines,
               (False, "noncompact", "dq_lines"): SparseMlaBwdWsNoncompactDqLines,
               (True, "compact"): SparseMlaBwdWsCompactDeterministic,
               (True, "noncompact"): SparseMlaBwdWsNoncompactDeterministic,
               (True, "compact", "staggered"): SparseMlaBwdWsCompactDeterministicStaggered,
               (True, "noncompact", "staggered"): SparseMlaBwdWsNoncompactDeterministicStaggered,
               (True, "compact", True): SparseMlaBwdWsCompactFixedPoint,
               (True, "noncompact", True): SparseMlaBwdWsNoncompactFixedPoint}
    return compile_flavour(entries, IMPL, check_params, arch, d_qk, heads, layout, atomic_width,
                           scatter, impl, extra_options, deterministic)


__all__ = ["DQ_LINES_IMPL", "FIXED_IMPL", "HEADS", "IMPL", "PERSISTENT_IMPL", "STAGGERED_IMPL",
           "SparseMlaBwdWs", "SparseMlaBwdWsCompact", "SparseMlaBwdWsCompactStaggered",
           "SparseMlaBwdWsCompactDqLines", "SparseMlaBwdWsNoncompactDqLines",
           "SparseMlaBwdWsNoncompactPersistent", "SparseMlaBwdWsNoncompactStaggered",
           "SparseMlaBwdWsCompactDeterministic", "SparseMlaBwdWsNoncompact",
           "SparseMlaBwdWsNoncompactDeterministic", "SparseMlaBwdWsCompactDeterministicStaggered",
           "SparseMlaBwdWsNoncompactDeterministicStaggered", "LAYOUT_ORDER",
           "can_implement", "check_params", "compile_bwd_ws", "ws_smem_layouts", "ws_smem_views"]
