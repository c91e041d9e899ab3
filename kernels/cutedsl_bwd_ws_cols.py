"""CuTe DSL sparse MLA backward at 128 heads, a CTA pair splitting the columns
(``impl="wgmma_ws_cols"``, sm_90a).

The same arguments, C ABI and semantics as :mod:`dsa_aot.kernels.cutedsl_bwd_main`, for 128
heads (D 512 and 576, both layouts, fast mode only).

Why: at 128 heads :mod:`.cutedsl_bwd_ws` runs two CTAs a query row, one per block of 64 heads,
and each adds its heads' share of every slot's dKV row: twice the fp32 atomics of 64 heads,
and the L2's atomic throughput is what bounds the kernel. Here the two CTAs of a row form a
cluster and split the *columns* instead: CTA ``r`` holds ``q`` and ``dout`` of all 128 heads
for its half of the columns (nope columns ``[256 r, 256 r + 256)``, and at D 576 rope columns
``[512 + 32 r, 544 + 32 r)``), gathers only those columns of each KV row, and adds each slot's
dKV for its columns over all 128 heads at once: every dKV value is added once, and each CTA
gathers half a KV row.

What the split costs is an exchange over distributed shared memory, per block of 64 slots:

* the score warpgroup (0) computes ``S`` and ``dP`` over its columns for the partner's 64
  heads and sends them (fp32, ``st.async`` with the partner's ``x_full`` mbarrier counting the
  bytes), computes them for its own 64 heads and adds what the partner sent (``S`` first, then
  ``dP``, through one 16 KB buffer: ``x_empty`` tells the sender the buffer was read); then the
  softmax gradient of its own heads, ``P`` / ``dS`` (bf16) into its own rows of the 128-head
  ``P`` / ``dS`` tiles and, by one bulk copy each, into the partner's (``pds_full`` counts the
  partner's bytes and the local arrival); the own heads' ``dQ`` over the nope columns (``dS``
  from registers);
  the next block's gather once the KV tile is free (``KV_EMPTY``, a named barrier as in
  :mod:`.cutedsl_bwd_ws`);
* the dKV warpgroup (1) waits ``pds_full``, computes the partner heads' ``dQ`` tiles and both
  head blocks' rope ``dQ`` tiles (``dS`` from shared memory), then ``dKV = dS^T Q + P^T dO`` over 128 heads for its columns in 64-column
  chunks (and a 32-column rope chunk at D 576) with their ``red.global.add.v4.f32`` atomics,
  and arrives on ``pds_empty`` of both CTAs (so neither overwrites ``P`` / ``dS`` the other still
  reads).

Shared memory at D 576: ``q`` 73,728 and ``dout`` 65,536 bytes (128 heads x 288 / 256 columns),
the KV tile 36,864 (64 slots x 288), ``P`` and ``dS`` 32,768 (128 heads x 64 slots), the exchange
buffer 16,384: about 227 KB. The rope columns sit in 64-byte swizzled tiles of their own. ``dQ``
stays in registers over the row (warpgroup 0: the own heads' 64 x 256 nope columns; warpgroup 1:
the partner heads' 64 x 256 and both head blocks' 64 x 32 rope columns, fp32) and is stored as
bf16 at the end. Measured in ``bench/results/h100_bwd_cols.md``: correct, slower than the
default (the exchange puts the score warpgroup on the critical path).

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import hopper_helpers as sm90_utils

from dsa_aot.kernels import cutedsl_bwd_main as main
from dsa_aot.kernels.cutedsl_bwd_main import (BLOCK_H, BLOCK_N, LOG2E, SparseMlaBwdMainCompact,
                                              SparseMlaBwdMainNoncompact, compile_flavour,
                                              wg_gemm)
from dsa_aot.kernels.cutedsl_bwd_ws import SparseMlaBwdWs
from dsa_aot.kernels.cutedsl_common import (D_QK_CHOICES, D_V, LAYOUTS, VEC, cp_async_16_zfill,
                                            gather_row_zfill, wg_acc_as_a, wg_rows_cols)

#: The ``impl`` name of this flavour (the build's ``tile.flavour``).
IMPL = "wgmma_ws_cols"
#: The one head count: two blocks of 64 heads, one CTA pair.
HEADS = (128,)
WG_THREADS = 128
THREADS = 2 * WG_THREADS
#: MMA N of the dQ tiles and dKV chunks over the nope columns (one 128-byte swizzle atom).
TILE = 64
#: Nope (and V) columns of one CTA.
HALF = D_V // 2
#: Named barriers (0 is __syncthreads): the KV tile's last reader done, and each warpgroup's
#: own.
BAR_KV_EMPTY, BAR_WG0, BAR_WG1 = 3, 4, 5
#: Bytes of one exchanged 64 x 64 fp32 partial, and of one CTA's 64 rows of ``P`` (or ``dS``).
X_BYTES = BLOCK_H * BLOCK_N * 4
PDS_BYTES = BLOCK_H * BLOCK_N * 2

_INF = float("inf")


def rope_half(d_qk: int) -> int:
    """Rope columns of one CTA (32 at D 576, none at D 512)."""
    return (d_qk - D_V) // 2


def check_params(d_qk: int, heads: int, layout: str, arch: str = "sm_90a") -> None:
    """Raise ``ValueError`` naming the compile-time parameter this flavour cannot take."""
    main.check_params(d_qk, heads, layout)
    if heads not in HEADS:
        raise ValueError(f"heads={heads!r}: impl={IMPL!r} supports heads {HEADS}; use "
                         "impl='wgmma_ws' (or leave impl unset) for other head counts")
    if arch != "sm_90a":
        raise ValueError(f"impl={IMPL!r} needs sm_90a, not {arch}; use impl='mma'")


def can_implement(d_qk: int, heads: int, layout: str) -> bool:
    """Whether this flavour supports the compile-time parameters (no exception)."""
    return d_qk in D_QK_CHOICES and heads in HEADS and layout in LAYOUTS


def cols_smem_layouts(d_qk: int) -> dict[str, cute.ComposedLayout]:
    """Shared-memory layouts (call while tracing) of one CTA's column half: K-major tiles of
    swizzled atoms, rows first: ``q`` [128 heads, 256], ``dout`` [128, 256], ``kv`` [64 slots,
    256], ``p`` (also ``dS``) [128 heads, 64 slots] (128-byte swizzle); at D 576 ``q_rope``
    [128, 32] and ``kv_rope`` [64, 32] (64-byte swizzle). The ``*_t`` entries are MN-major views
    of the same bytes with the modes swapped."""
    k128 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    mn128 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, BFloat16)
    heads = 2 * BLOCK_H
    lay = {
        "q": cute.tile_to_shape(k128, (heads, HALF), (0, 1)),
        "dout": cute.tile_to_shape(k128, (heads, HALF), (0, 1)),
        "kv": cute.tile_to_shape(k128, (BLOCK_N, HALF), (0, 1)),
        "p": cute.tile_to_shape(k128, (heads, BLOCK_N), (0, 1)),
        "q_t": cute.tile_to_shape(mn128, (HALF, heads), (1, 0)),
        "dout_t": cute.tile_to_shape(mn128, (HALF, heads), (1, 0)),
        "kv_t": cute.tile_to_shape(mn128, (HALF, BLOCK_N), (1, 0)),
        "p_t": cute.tile_to_shape(mn128, (BLOCK_N, heads), (1, 0)),
    }
    rope = rope_half(d_qk)
    if rope:
        k64 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, BFloat16)
        mn64 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW64, BFloat16)
        lay |= {"q_rope": cute.tile_to_shape(k64, (heads, rope), (0, 1)),
                "kv_rope": cute.tile_to_shape(k64, (BLOCK_N, rope), (0, 1)),
                "q_rope_t": cute.tile_to_shape(mn64, (rope, heads), (1, 0)),
                "kv_rope_t": cute.tile_to_shape(mn64, (rope, BLOCK_N), (1, 0))}
    return lay


#: The order in which the kernel takes the layouts of :func:`cols_smem_layouts`.
LAYOUT_ORDER = ("q", "dout", "kv", "p", "q_t", "dout_t", "kv_t", "p_t")
ROPE_ORDER = ("q_rope", "kv_rope", "q_rope_t", "kv_rope_t")


def shared_storage(d_qk: int) -> tuple[dict[str, cute.ComposedLayout], type]:
    """The layouts of :func:`cols_smem_layouts` and the kernel's shared-memory struct (call while
    tracing)."""
    lay = cols_smem_layouts(d_qk)
    align, mem = cute.struct.Align, cute.struct.MemRange
    tiles = [("q", "q"), ("do", "dout"), ("kv", "kv"), ("p", "p"), ("ds", "p")]
    if rope_half(d_qk):
        tiles += [("qr", "q_rope"), ("kvr", "kv_rope")]
    fields = {f"s_{name}": align[mem[BFloat16, cute.cosize(lay[key].outer)], 1024]
              for name, key in tiles}
    fields |= {"s_x": align[mem[Float32, BLOCK_H * BLOCK_N], 1024],
               "s_idx": align[mem[Int32, 2 * BLOCK_N], 16],
               "s_valid": align[mem[Int32, 2 * BLOCK_N], 16],
               "s_lse": align[mem[Float32, BLOCK_H], 16],
               "s_delta": align[mem[Float32, BLOCK_H], 16],
               "mbar": align[mem[Int64, 4], 8]}
    SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
    return lay, SharedStorage


# ---------------------------------------------------------------------------------------------
# Distributed shared memory
# ---------------------------------------------------------------------------------------------

def smem_addr(ptr) -> Int32:
    """The 32-bit shared-memory address of a shared-memory pointer."""
    return Int32(ptr.toint())


def send_f32x4(dst: Int32, mbar: Int32, peer: Int32, v0: Float32, v1: Float32, v2: Float32,
               v3: Float32, *, loc=None, ip=None) -> None:
    """``st.async`` four fp32 values to shared address ``dst`` of CTA ``peer`` of the cluster,
    completing 16 bytes on that CTA's mbarrier at ``mbar`` (both local addresses, mapped)."""
    llvm.inline_asm(None, [Int32(dst).ir_value(loc=loc, ip=ip), Int32(mbar).ir_value(loc=loc, ip=ip),
                           Int32(peer).ir_value(loc=loc, ip=ip)]
                    + [Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)],
                    "{ .reg .b32 ra, rm; mapa.shared::cluster.u32 ra, $0, $2; "
                    "mapa.shared::cluster.u32 rm, $1, $2; "
                    "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [ra], "
                    "{$3, $4, $5, $6}, [rm]; }",
                    "r,r,r,f,f,f,f", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def copy_to_peer(dst: Int32, src: Int32, nbytes: int, mbar: Int32, peer: Int32, *, loc=None,
                 ip=None) -> None:
    """One bulk copy of ``nbytes`` of this CTA's shared memory at ``src`` to shared address
    ``dst`` of CTA ``peer``, completing on that CTA's mbarrier at ``mbar`` (local addresses,
    mapped); committed as a bulk async group."""
    llvm.inline_asm(None, [Int32(dst).ir_value(loc=loc, ip=ip), Int32(src).ir_value(loc=loc, ip=ip),
                           Int32(mbar).ir_value(loc=loc, ip=ip), Int32(peer).ir_value(loc=loc, ip=ip)],
                    "{ .reg .b32 ra, rm; mapa.shared::cluster.u32 ra, $0, $3; "
                    "mapa.shared::cluster.u32 rm, $2, $3; "
                    f"cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes "
                    f"[ra], [$1], {nbytes}, [rm]; cp.async.bulk.commit_group; }}",
                    "r,r,r,r", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def bulk_reads_done(*, loc=None, ip=None) -> None:
    """Wait until this thread's bulk copies have read their sources."""
    llvm.inline_asm(None, [], "cp.async.bulk.wait_group.read 0;", "", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def fence_async_shared(*, loc=None, ip=None) -> None:
    """Order this thread's generic shared-memory writes before async-proxy reads (wgmma, bulk
    copies)."""
    llvm.inline_asm(None, [], "fence.proxy.async.shared::cta;", "", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


class SparseMlaBwdWsCols(SparseMlaBwdWs):
    """The backward main kernel at 128 heads with a CTA pair splitting the columns, for one
    ``(d_qk, layout)``."""

    def __init__(self, d_qk: int, heads: int, layout: str, atomic_width: int = 4,
                 scatter: bool = True, deterministic: bool = False,
                 fixed_point: bool = False) -> None:
        check_params(d_qk, heads, layout)
        if deterministic:
            raise ValueError(f"deterministic=True: impl={IMPL!r} has no deterministic mode; "
                             "impl='wgmma_ws' has")
        super().__init__(d_qk, 64, layout, atomic_width=atomic_width, scatter=scatter)
        self.heads = heads
        self.impl = IMPL
        self.rope = rope_half(d_qk)
        self.gather_threads = WG_THREADS
        self.kv_tile_rows = BLOCK_N

    # ---------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def launch(self, q: cute.Tensor, kv: cute.Tensor, dout: cute.Tensor, topk_idxs: cute.Tensor,
               topk_length: cute.Tensor, lse_sink: cute.Tensor, delta: cute.Tensor,
               dq: cute.Tensor, dkv_acc: cute.Tensor, softmax_scale: Float32,
               stream: cuda.CUstream, rows: tuple | None = None) -> None:
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                  BFloat16, num_bits_per_copy=128)
        vecs = TILE // VEC
        # q / dout: 32 rows x 64 columns per pass over all threads; rope: 64 rows x 32 columns
        row_copy = cute.make_tiled_copy_tv(
            g2s, cute.make_layout((THREADS // vecs, vecs), stride=(vecs, 1)),
            cute.make_layout((1, VEC)))
        rope_copy = cute.make_tiled_copy_tv(
            g2s, cute.make_layout((THREADS // 4, 4), stride=(4, 1)), cute.make_layout((1, VEC)))
        s_q_rows = cute.size(q, mode=[0])
        if s_q_rows > 0:
            lay, SharedStorage = shared_storage(self.d_qk)
            rope_lays = tuple(lay[k] for k in ROPE_ORDER) if self.rope else ()
            self.kernel_cols(q, kv, dout, topk_idxs, topk_length, lse_sink, delta, dq, dkv_acc,
                             softmax_scale, tuple(lay[k] for k in LAYOUT_ORDER), rope_lays,
                             row_copy, rope_copy, SharedStorage).launch(
                grid=[2 * s_q_rows, 1, 1], block=[THREADS, 1, 1], cluster=[2, 1, 1],
                smem=SharedStorage.size_in_bytes(), stream=stream)

    def tiled_mmas(self) -> dict[str, cute.TiledMma]:
        """The warpgroup MMAs by name (call while tracing)."""
        kk, mn = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM
        # S / dP partials: (64 heads, 64 slots), A = q / dout rows, B = the KV tile
        mma_s = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, kk, kk, Float32,
                                                  (1, 1, 1), (BLOCK_H, BLOCK_N))
        # dQ tiles (64 heads, 64 / rope columns): A = dS (registers: own heads; shared: the
        # partner's), B = the KV tile viewed (columns, slots)
        mma_dq_rs = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, kk, mn, Float32,
                                                      (1, 1, 1), (BLOCK_H, TILE), a_source=rmem)
        mma_dq_ss = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, kk, mn, Float32,
                                                      (1, 1, 1), (BLOCK_H, TILE))
        # dKV chunks (64 slots, 64 / rope columns) over 128 heads: A = dS^T / P^T, B = q / dout
        # viewed (columns, heads)
        mma_kv = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, mn, mn, Float32,
                                                   (1, 1, 1), (BLOCK_N, TILE))
        rope = max(self.rope, 8)  # (unused at D 512)
        mma_dq_ss_r = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, kk, mn, Float32,
                                                        (1, 1, 1), (BLOCK_H, rope))
        mma_kv_r = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, mn, mn, Float32,
                                                     (1, 1, 1), (BLOCK_N, rope))
        return {"s": mma_s, "dq_rs": mma_dq_rs, "dq_ss": mma_dq_ss, "kv": mma_kv,
                "dq_ss_r": mma_dq_ss_r, "kv_r": mma_kv_r}

    # ---------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------

    @cute.kernel
    def kernel_cols(self, m_q: cute.Tensor, m_kv: cute.Tensor, m_do: cute.Tensor,
                    m_idx: cute.Tensor, m_len: cute.Tensor, m_lse: cute.Tensor,
                    m_delta: cute.Tensor, m_dq: cute.Tensor, m_dkv: cute.Tensor,
                    softmax_scale: Float32, layouts: tuple, rope_layouts: tuple,
                    row_copy: cute.TiledCopy, rope_copy: cute.TiledCopy,
                    SharedStorage: cutlass.Constexpr) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        t = bid // 2
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        wtid = tidx % WG_THREADS
        topk = cute.size(m_idx, mode=[1])
        n_slots = self.used_slots(t, m_idx, m_len, cute.size(m_kv, mode=[0]))
        n_blocks = (n_slots + BLOCK_N - 1) // BLOCK_N

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sm = self.smem_views(storage, layouts, rope_layouts)
        mbar = storage.mbar.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(mbar + 0, 1)  # x_full: one expect-tx arrival + 16 KB
            cute.arch.mbarrier_init(mbar + 1, 1)  # x_empty: the partner read its buffer
            cute.arch.mbarrier_init(mbar + 2, 1)  # pds_full: local arrival + partner's 16 KB
            cute.arch.mbarrier_init(mbar + 3, 2)  # pds_empty: both dKV warpgroups
        cute.arch.mbarrier_init_fence()

        # ---- q, dout (this CTA's columns, 128 heads), lse / delta (own heads); block 0 ----
        self.load_cols_row(t, rank, m_q, m_do, m_lse, m_delta, sm, row_copy, rope_copy, tidx)
        cute.arch.cp_async_commit_group()
        gather_args = self.cols_gather_args(m_kv, sm, rank, wtid // (TILE // VEC), wtid)
        if wg == 0:
            if n_blocks > 0:
                self.gather_cols(self.load_indices(0, t, m_idx, n_slots, wtid // (TILE // VEC)),
                                 0, *gather_args)
            cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        # both CTAs' barriers initialised before either arrives remotely
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

        # each role compiled for both ranks: the head blocks' tile offsets are constants
        if wg == 0:
            score_args = (t, n_blocks, n_slots, m_idx, m_dq, softmax_scale, sm, mbar,
                          gather_args, wtid)
            if rank == 0:
                self.score_warpgroup_cols(0, *score_args)
            else:
                self.score_warpgroup_cols(1, *score_args)
        else:
            dkv_args = (t, n_blocks, topk, m_dq, m_dkv, sm, mbar, wtid)
            if rank == 0:
                self.dkv_warpgroup_cols(0, *dkv_args)
            else:
                self.dkv_warpgroup_cols(1, *dkv_args)
        # neither CTA leaves while the other may still write into it or arrive on its barriers
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    def smem_views(self, storage: object, layouts: tuple, rope_layouts: tuple) -> dict:
        """The tiles of the shared-memory ``storage`` and their MN-major views by name."""
        q_lay, do_lay, kv_lay, p_lay, qt_lay, dot_lay, kt_lay, pt_lay = layouts
        s_q = storage.s_q.get_tensor(q_lay.outer, swizzle=q_lay.inner)
        s_do = storage.s_do.get_tensor(do_lay.outer, swizzle=do_lay.inner)
        s_kv = storage.s_kv.get_tensor(kv_lay.outer, swizzle=kv_lay.inner)
        s_p = storage.s_p.get_tensor(p_lay.outer, swizzle=p_lay.inner)
        s_ds = storage.s_ds.get_tensor(p_lay.outer, swizzle=p_lay.inner)
        views = {
            "q": s_q, "do": s_do, "kv": s_kv, "p": s_p, "ds": s_ds,
            "qt": cute.make_tensor(s_q.iterator, qt_lay.outer),      # (256, 128 heads)
            "dot": cute.make_tensor(s_do.iterator, dot_lay.outer),   # (256, 128 heads)
            "kt": cute.make_tensor(s_kv.iterator, kt_lay.outer),     # (256, slot)
            "pt": cute.make_tensor(s_p.iterator, pt_lay.outer),      # (slot, 128 heads)
            "dst": cute.make_tensor(s_ds.iterator, pt_lay.outer),    # (slot, 128 heads)
            "x": storage.s_x.get_tensor(cute.make_layout(BLOCK_H * BLOCK_N)),
            "idx": storage.s_idx.get_tensor(cute.make_layout(2 * BLOCK_N)),
            "valid": storage.s_valid.get_tensor(cute.make_layout(2 * BLOCK_N)),
            "lse": storage.s_lse.get_tensor(cute.make_layout(BLOCK_H)),
            "delta": storage.s_delta.get_tensor(cute.make_layout(BLOCK_H)),
        }
        if cutlass.const_expr(self.rope > 0):
            qr_lay, kvr_lay, qrt_lay, kvrt_lay = rope_layouts
            s_qr = storage.s_qr.get_tensor(qr_lay.outer, swizzle=qr_lay.inner)
            s_kvr = storage.s_kvr.get_tensor(kvr_lay.outer, swizzle=kvr_lay.inner)
            views |= {"qr": s_qr, "kvr": s_kvr,
                      "qrt": cute.make_tensor(s_qr.iterator, qrt_lay.outer),   # (32, 128 heads)
                      "krt": cute.make_tensor(s_kvr.iterator, kvrt_lay.outer)}  # (32, slot)
        return views

    @cute.jit
    def load_cols_row(self, t: Int32, rank: Int32, m_q: cute.Tensor, m_do: cute.Tensor,
                      m_lse: cute.Tensor, m_delta: cute.Tensor, sm: dict,
                      row_copy: cute.TiledCopy, rope_copy: cute.TiledCopy, tidx: Int32) -> None:
        """Issue the ``cp.async`` copies of row ``t``'s ``q`` and ``dout`` (128 heads, this CTA's
        columns; no commit) and store its own heads' ``lse`` (base 2) and ``delta``."""
        heads = 2 * BLOCK_H
        thr = row_copy.get_slice(tidx)
        for src, dst in ((m_q, sm["q"]), (m_do, sm["do"])):
            g_src = cute.local_tile(src[t, None, None], (heads, HALF), (0, rank))
            cute.copy(row_copy, thr.partition_S(g_src), thr.partition_D(dst))
        if cutlass.const_expr(self.rope > 0):
            thr_r = rope_copy.get_slice(tidx)
            g_src = cute.local_tile(m_q[t, None, None], (heads, self.rope),
                                    (0, D_V // self.rope + rank))
            cute.copy(rope_copy, thr_r.partition_S(g_src), thr_r.partition_D(sm["qr"]))
        if tidx < BLOCK_H:
            head = rank * BLOCK_H + tidx
            sm["lse"][tidx] = m_lse[t, head] * Float32(LOG2E)
            sm["delta"][tidx] = m_delta[t, head]

    def cols_gather_args(self, m_kv: cute.Tensor, sm: dict, rank: Int32, row_in_pass: Int32,
                         tidx: Int32) -> list:
        """What :meth:`gather_cols` needs besides the indices and the slot buffer."""
        kv_base = Int32(sm["kv"].iterator.toint())
        rope_base = Int32(0)
        if cutlass.const_expr(self.rope > 0):
            rope_base = Int32(sm["kvr"].iterator.toint())
        return [cute.size(m_kv, mode=[0]), m_kv.iterator.toint(), Int64(m_kv.stride[0]) * 2,
                kv_base, rope_base, rank, sm["idx"], sm["valid"], row_in_pass, tidx]

    @cute.jit
    def gather_cols(self, indices: list, buf: Int32, s_kv: Int32, kv_base: Int64,
                    row_bytes: Int64, s_tile_base: Int32, s_rope_base: Int32, rank: Int32,
                    s_idx: cute.Tensor, s_valid: cute.Tensor, row_in_pass: Int32,
                    tidx: Int32) -> None:
        """Issue the ``cp.async`` copies of one block's KV rows, this CTA's columns (no commit),
        and record each slot's index and validity at ``buf``: thread ``j = tidx % 8`` of a row
        copies 16-byte chunk ``j`` of the row's four 64-column tiles and, at D 576, the threads
        ``j < 4`` chunk ``j`` of its 32 rope columns (64-byte swizzle: at ``(j ^ (row / 2) % 4)
        * 16`` of the row's 64 bytes)."""
        j = tidx % (TILE // VEC)
        rows_per_pass = self.gather_threads // (TILE // VEC)
        lo = rank * (HALF // TILE)
        for m in cutlass.range_constexpr(BLOCK_N // rows_per_pass):
            row = row_in_pass + m * rows_per_pass
            ok, src_row = gather_row_zfill(indices[m], s_kv, j, row, kv_base, row_bytes,
                                           s_tile_base, BLOCK_N, 0, HALF // TILE, lo)
            if cutlass.const_expr(self.rope > 0):
                if j < 4:
                    r_src = (kv_base + Int64(src_row) * row_bytes
                             + (D_V + rank * self.rope) * 2 + j * 16)
                    r_dst = s_rope_base + row * 64 + ((j ^ ((row // 2) % 4)) * 16)
                    cp_async_16_zfill(r_dst, r_src, Int32(16) if ok else Int32(0))
            if j == 0:
                s_valid[buf + row] = Int32(1) if ok else Int32(0)
                s_idx[buf + row] = src_row

    # ---------------------------------------------------------------------------------------
    # Warpgroup 0: scores, the exchange, P / dS, own heads' dQ, gathers
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def score_warpgroup_cols(self, rank: cutlass.Constexpr, t: Int32, n_blocks: Int32,
                             n_slots: Int32, m_idx: cute.Tensor, m_dq: cute.Tensor,
                             softmax_scale: Float32, sm: dict, mbar, gather_args: list,
                             wtid: Int32) -> None:
        """Warpgroup 0 over the row's blocks (see the module docstring), in the CTA of cluster
        rank ``rank``."""
        peer = 1 - rank
        mmas = self.tiled_mmas()  # (made here: their fields are set per role and rank)
        mma_s, mma_dq = mmas["s"], mmas["dq_rs"]
        scale_log2 = softmax_scale * Float32(LOG2E)
        mma_dq.set(warpgroup.Field.ACCUMULATE, True)
        wg_s = mma_s.get_slice(0)
        wg_dq = mma_dq.get_slice(0)
        own, other = rank, peer
        # A operands of the own (0) and the partner's (1) heads: q / dout rows
        r_q = [mma_s.make_fragment_A(wg_s.partition_A(
            cute.local_tile(sm["q"], (BLOCK_H, HALF), (hb, 0)))) for hb in (own, other)]
        r_do = [mma_s.make_fragment_A(wg_s.partition_A(
            cute.local_tile(sm["do"], (BLOCK_H, HALF), (hb, 0)))) for hb in (own, other)]
        r_k = mma_s.make_fragment_B(wg_s.partition_B(sm["kv"]))
        r_qr, r_kr = [None, None], None
        if cutlass.const_expr(self.rope > 0):
            r_qr = [mma_s.make_fragment_A(wg_s.partition_A(
                cute.local_tile(sm["qr"], (BLOCK_H, self.rope), (hb, 0))))
                for hb in (own, other)]
            r_kr = mma_s.make_fragment_B(wg_s.partition_B(sm["kvr"]))
        r_kt = [mma_dq.make_fragment_B(wg_dq.partition_B(
            cute.local_tile(sm["kt"], (TILE, BLOCK_N), (i, 0)))) for i in range(HALF // TILE)]
        thr_s = mma_s.get_slice(wtid)
        thr_dq = mma_dq.get_slice(wtid)
        acc_shape = thr_s.partition_shape_C((BLOCK_H, BLOCK_N))
        acc_dq = [cute.make_rmem_tensor(thr_dq.partition_shape_C((BLOCK_H, TILE)), Float32)
                  for _ in range(HALF // TILE)]
        for i in cutlass.range_constexpr(HALF // TILE):
            acc_dq[i].fill(0.0)
        coords = wg_rows_cols(thr_s.partition_C(cute.make_identity_tensor((BLOCK_H, BLOCK_N))))
        rows_per_thread = cute.size(coords, mode=[0])
        cols_per_thread = cute.size(coords, mode=[1])
        store_c = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                             BFloat16), mma_s)
        thr_store_c = store_c.get_slice(wtid)
        t_s_p_c = thr_store_c.partition_D(cute.local_tile(sm["p"], (BLOCK_H, BLOCK_N), (own, 0)))
        t_s_ds_c = thr_store_c.partition_D(cute.local_tile(sm["ds"], (BLOCK_H, BLOCK_N),
                                                           (own, 0)))
        lse_r = [sm["lse"][coords[r, 0][0]] for r in range(rows_per_thread)]
        delta_r = [sm["delta"][coords[r, 0][0]] for r in range(rows_per_thread)]
        x_base = smem_addr(sm["x"].iterator)
        x_full = smem_addr(mbar + 0)
        x_empty_ptr = mbar + 1
        pds_full = smem_addr(mbar + 2)
        p_own = smem_addr(sm["p"].iterator) + own * PDS_BYTES
        ds_own = smem_addr(sm["ds"].iterator) + own * PDS_BYTES
        row_in_pass = wtid // (TILE // VEC)

        for b in cutlass.range(n_blocks, unroll=1):
            buf = (b % 2) * BLOCK_N
            if b > 0:  # this warpgroup's gather of block b is in; make it visible to all
                cute.arch.cp_async_wait_group(0)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=BAR_WG0, number_of_threads=WG_THREADS)
            # S: the partner's heads over these columns -> the partner; own heads + its share
            acc_a = self.partial_gemm(mma_s, acc_shape, r_q[1], r_qr[1], r_k, r_kr)
            self.send_partial(acc_a, x_base, x_full, x_empty_ptr, 1, peer, wtid)
            acc_s = self.partial_gemm(mma_s, acc_shape, r_q[0], r_qr[0], r_k, r_kr)
            self.take_partial(acc_s, sm["x"], mbar, 0, peer, wtid)
            # dP likewise (V: the nope columns)
            acc_a = self.partial_gemm(mma_s, acc_shape, r_do[1], None, r_k, None)
            self.send_partial(acc_a, x_base, x_full, x_empty_ptr, 0, peer, wtid)
            acc_dp = self.partial_gemm(mma_s, acc_shape, r_do[0], None, r_k, None)
            self.take_partial(acc_dp, sm["x"], mbar, 1, peer, wtid)

            # softmax gradient of the own heads
            acc_s_rc = wg_rows_cols(acc_s)
            acc_dp_rc = wg_rows_cols(acc_dp)
            col_ok = [sm["valid"][buf + coords[0, j][1]] for j in range(cols_per_thread)]
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

            # the next block's indices (loaded under the hand-off below)
            upcoming = self.load_indices(b + 1, t, m_idx, n_slots, row_in_pass)
            # P / dS of the own heads: here and into the partner, once both dKV warpgroups
            # are done with the last ones (and this CTA's last copy has read its source)
            cute.arch.mbarrier_wait(mbar + 3, (b + 1) % 2)
            if wtid == 0:
                bulk_reads_done()
            cute.arch.barrier(barrier_id=BAR_WG0, number_of_threads=WG_THREADS)
            cute.copy(store_c, thr_store_c.retile(r_p16), t_s_p_c)
            cute.copy(store_c, thr_store_c.retile(r_ds16), t_s_ds_c)
            fence_async_shared()
            cute.arch.barrier(barrier_id=BAR_WG0, number_of_threads=WG_THREADS)
            if wtid == 0:
                copy_to_peer(p_own, p_own, PDS_BYTES, pds_full, peer)
                copy_to_peer(ds_own, ds_own, PDS_BYTES, pds_full, peer)
                cute.arch.mbarrier_arrive_and_expect_tx(mbar + 2, 2 * PDS_BYTES)

            # dQ of the own heads += dS K, dS from registers
            r_dsa = wg_acc_as_a(r_ds16)
            warpgroup.fence()
            for i in cutlass.range_constexpr(HALF // TILE):
                for k in cutlass.range_constexpr(BLOCK_N // 16):
                    cute.gemm(mma_dq, acc_dq[i], r_dsa[None, None, k], r_kt[i][None, None, k],
                              acc_dq[i])
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            # the next block into the KV tile once warpgroup 1's dQ MMAs are done with it
            if b + 1 < n_blocks:
                cute.arch.barrier(barrier_id=BAR_KV_EMPTY, number_of_threads=THREADS)
                self.gather_cols(upcoming, BLOCK_N - buf, *gather_args)
                cute.arch.cp_async_commit_group()
        if wtid == 0:
            bulk_reads_done()
        self.store_dq_cols(t, own, rank, m_dq, acc_dq, None, thr_dq, None)

    @cute.jit
    def partial_gemm(self, mma_s: cute.TiledMma, acc_shape, r_rows: cute.Tensor, r_rope,
                     r_k: cute.Tensor, r_kr) -> cute.Tensor:
        """``rows K^T`` over this CTA's nope columns, and its rope columns where ``r_rope`` (the
        rows' rope part) is given, the first k-step overwriting (wgmma scale-d 0); waited for."""
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        steps = [(r_rows[None, None, k], r_k[None, None, k]) for k in range(HALF // 16)]
        if cutlass.const_expr(r_rope is not None):
            steps += [(r_rope[None, None, k], r_kr[None, None, k])
                      for k in range(self.rope // 16)]
        warpgroup.fence()
        wg_gemm(mma_s, acc, steps, False)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        return acc

    @cute.jit
    def send_partial(self, acc: cute.Tensor, x_base: Int32, x_full: Int32, x_empty_ptr,
                     empty_phase: cutlass.Constexpr, peer: Int32, wtid: Int32) -> None:
        """Send this thread's 32 values of a 64 x 64 partial into the partner's exchange buffer
        (value ``4 k + i`` at float4 ``k * 128 + wtid``) once the partner has read the last one."""
        cute.arch.mbarrier_wait(x_empty_ptr, empty_phase)
        for k in cutlass.range_constexpr(cute.size(acc) // 4):
            send_f32x4(x_base + (k * WG_THREADS + wtid) * 16, x_full, peer, acc[4 * k],
                       acc[4 * k + 1], acc[4 * k + 2], acc[4 * k + 3])

    @cute.jit
    def take_partial(self, acc: cute.Tensor, s_x: cute.Tensor, mbar, full_phase: cutlass.Constexpr,
                     peer: Int32, wtid: Int32) -> None:
        """Add the partner's partial for this CTA's heads (:meth:`send_partial`) into ``acc``,
        then tell the partner its buffer here is free."""
        if wtid == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar + 0, X_BYTES)
        cute.arch.mbarrier_wait(mbar + 0, full_phase)
        for k in cutlass.range_constexpr(cute.size(acc) // 4):
            for i in cutlass.range_constexpr(4):
                acc[4 * k + i] = acc[4 * k + i] + s_x[(k * WG_THREADS + wtid) * 4 + i]
        cute.arch.barrier(barrier_id=BAR_WG0, number_of_threads=WG_THREADS)
        if wtid == 0:
            cute.arch.mbarrier_arrive(mbar + 1, peer_cta_rank_in_cluster=peer,
                                      scope=nvvm.MemScopeKind.CLUSTER)

    # ---------------------------------------------------------------------------------------
    # Warpgroup 1: the partner heads' dQ, dKV chunks and their atomics
    # ---------------------------------------------------------------------------------------

    @cute.jit
    def dkv_warpgroup_cols(self, rank: cutlass.Constexpr, t: Int32, n_blocks: Int32,
                           topk: Int32, m_dq: cute.Tensor, m_dkv: cute.Tensor, sm: dict, mbar,
                           wtid: Int32) -> None:
        """Warpgroup 1 over the row's blocks (see the module docstring), in the CTA of cluster
        rank ``rank``."""
        peer = 1 - rank
        mmas = self.tiled_mmas()
        mma_dq, mma_dq_r, mma_kv, mma_kv_r = (mmas["dq_ss"], mmas["dq_ss_r"], mmas["kv"],
                                              mmas["kv_r"])
        heads = 2 * BLOCK_H
        n_chunks = HALF // TILE
        lane = cute.arch.lane_idx()
        other = peer
        mma_dq.set(warpgroup.Field.ACCUMULATE, True)
        mma_dq_r.set(warpgroup.Field.ACCUMULATE, True)
        wg_kv = mma_kv.get_slice(0)
        r_dst = mma_kv.make_fragment_A(wg_kv.partition_A(sm["dst"]))  # (MMA, 1, 8)
        r_pt = mma_kv.make_fragment_A(wg_kv.partition_A(sm["pt"]))
        r_qt = [mma_kv.make_fragment_B(wg_kv.partition_B(
            cute.local_tile(sm["qt"], (TILE, heads), (c, 0)))) for c in range(n_chunks)]
        r_dot = [mma_kv.make_fragment_B(wg_kv.partition_B(
            cute.local_tile(sm["dot"], (TILE, heads), (c, 0)))) for c in range(n_chunks)]
        wg_dq = mma_dq.get_slice(0)
        r_ds = mma_dq.make_fragment_A(wg_dq.partition_A(
            cute.local_tile(sm["ds"], (BLOCK_H, BLOCK_N), (other, 0))))  # (MMA, 1, 4)
        r_kt = [mma_dq.make_fragment_B(wg_dq.partition_B(
            cute.local_tile(sm["kt"], (TILE, BLOCK_N), (i, 0)))) for i in range(n_chunks)]
        thr_dq = mma_dq.get_slice(wtid)
        thr_dq_r = mma_dq_r.get_slice(wtid)
        acc_dq = [cute.make_rmem_tensor(thr_dq.partition_shape_C((BLOCK_H, TILE)), Float32)
                  for _ in range(n_chunks)]
        for i in cutlass.range_constexpr(n_chunks):
            acc_dq[i].fill(0.0)
        # rope columns (D 576): both head blocks' dQ tiles here, and the rope dKV chunk
        r_ds_r, r_krt, acc_dq_r, r_dst_r, r_qrt, kv_shape_r, kv_coords_r = (None,) * 7
        thr_kv = mma_kv.get_slice(wtid)
        kv_shape = thr_kv.partition_shape_C((BLOCK_N, TILE))
        kv_coords = wg_rows_cols(thr_kv.partition_C(cute.make_identity_tensor((BLOCK_N, TILE))))
        if cutlass.const_expr(self.rope > 0):
            wg_dq_r = mma_dq_r.get_slice(0)
            r_ds_r = [mma_dq_r.make_fragment_A(wg_dq_r.partition_A(
                cute.local_tile(sm["ds"], (BLOCK_H, BLOCK_N), (hb, 0)))) for hb in (other, rank)]
            r_krt = mma_dq_r.make_fragment_B(wg_dq_r.partition_B(sm["krt"]))
            acc_dq_r = [cute.make_rmem_tensor(thr_dq_r.partition_shape_C((BLOCK_H, self.rope)),
                                              Float32) for _ in range(2)]
            for i in cutlass.range_constexpr(2):
                acc_dq_r[i].fill(0.0)
            wg_kv_r = mma_kv_r.get_slice(0)
            r_dst_r = mma_kv_r.make_fragment_A(wg_kv_r.partition_A(sm["dst"]))
            r_qrt = mma_kv_r.make_fragment_B(wg_kv_r.partition_B(sm["qrt"]))
            thr_kv_r = mma_kv_r.get_slice(wtid)
            kv_shape_r = thr_kv_r.partition_shape_C((BLOCK_N, self.rope))
            kv_coords_r = wg_rows_cols(thr_kv_r.partition_C(
                cute.make_identity_tensor((BLOCK_N, self.rope))))
        k_steps = heads // 16
        col0 = rank * HALF
        for b in cutlass.range(n_blocks, unroll=1):
            buf = (b % 2) * BLOCK_N
            more = b + 1 < n_blocks
            cute.arch.mbarrier_wait(mbar + 2, b % 2)
            # dQ += dS K: the partner heads' nope tiles, both head blocks' rope tiles (dS from
            # shared memory)
            warpgroup.fence()
            for i in cutlass.range_constexpr(n_chunks):
                for k in cutlass.range_constexpr(BLOCK_N // 16):
                    cute.gemm(mma_dq, acc_dq[i], r_ds[None, None, k], r_kt[i][None, None, k],
                              acc_dq[i])
            if cutlass.const_expr(self.rope > 0):
                for i in cutlass.range_constexpr(2):
                    for k in cutlass.range_constexpr(BLOCK_N // 16):
                        cute.gemm(mma_dq_r, acc_dq_r[i], r_ds_r[i][None, None, k],
                                  r_krt[None, None, k], acc_dq_r[i])
            warpgroup.commit_group()
            slots = self.dkv_slots(buf, kv_coords, lane)
            row_ok = [sm["valid"][s] for s in slots]
            row_ptr = self.dkv_row_ptrs(m_dkv, sm["idx"], slots, buf, b * BLOCK_N, t, 0, topk)
            # the rope chunk first (fewer live registers than after the nope chunks)
            acc_r = None
            if cutlass.const_expr(self.rope > 0):
                acc_r = cute.make_rmem_tensor(kv_shape_r, Float32)
                steps = [(r_dst_r[None, None, k], r_qrt[None, None, k]) for k in range(k_steps)]
                warpgroup.fence()
                wg_gemm(mma_kv_r, acc_r, steps, False)
                warpgroup.commit_group()
            acc_kv = [cute.make_rmem_tensor(kv_shape, Float32) for _ in range(2)]
            for c in cutlass.range_constexpr(n_chunks):
                steps = [(r_dst[None, None, k], r_qt[c][None, None, k]) for k in range(k_steps)]
                steps += [(r_pt[None, None, k], r_dot[c][None, None, k]) for k in range(k_steps)]
                warpgroup.fence()
                wg_gemm(mma_kv, acc_kv[c % 2], steps, False)
                warpgroup.commit_group()
                warpgroup.wait_group(1)  # dQ and the rope chunk (c = 0) or chunk c - 1 done
                if cutlass.const_expr(c == 0):
                    if more:  # the KV tile's last reader is done
                        cute.arch.barrier_arrive(barrier_id=BAR_KV_EMPTY,
                                                 number_of_threads=THREADS)
                    if cutlass.const_expr(self.rope > 0):
                        self.scatter_chunk(wg_rows_cols(acc_r), kv_coords_r, row_ok, row_ptr,
                                           D_V + rank * self.rope, lane)
                else:
                    self.scatter_chunk(wg_rows_cols(acc_kv[(c - 1) % 2]), kv_coords, row_ok,
                                       row_ptr, col0 + (c - 1) * TILE, lane)
            warpgroup.wait_group(0)
            # P / dS read for the last time here: both CTAs' score warpgroups may write the next
            cute.arch.barrier(barrier_id=BAR_WG1, number_of_threads=WG_THREADS)
            if wtid == 0:
                cute.arch.mbarrier_arrive(mbar + 3)
                cute.arch.mbarrier_arrive(mbar + 3, peer_cta_rank_in_cluster=peer,
                                          scope=nvvm.MemScopeKind.CLUSTER)
            self.scatter_chunk(wg_rows_cols(acc_kv[(n_chunks - 1) % 2]), kv_coords, row_ok,
                               row_ptr, col0 + (n_chunks - 1) * TILE, lane)
        r_other, r_own = (None, None) if self.rope == 0 else (acc_dq_r[0], acc_dq_r[1])
        self.store_dq_cols(t, other, rank, m_dq, acc_dq, r_other, thr_dq, thr_dq_r)
        if cutlass.const_expr(self.rope > 0):
            self.store_dq_cols(t, rank, rank, m_dq, [], r_own, thr_dq, thr_dq_r)

    @cute.jit
    def store_dq_cols(self, t: Int32, hb: Int32, rank: Int32, m_dq: cute.Tensor, acc_dq: list,
                      acc_dq_r, thr_dq: cute.TiledMma, thr_dq_r: cute.TiledMma) -> None:
        """Store the dQ tiles of head block ``hb`` over this CTA's columns (row ``t``) as bf16."""
        tiles = [(acc_dq[i], thr_dq, cute.local_tile(m_dq[t, None, None], (BLOCK_H, TILE),
                                                     (hb, rank * (HALF // TILE) + i)))
                 for i in range(len(acc_dq))]
        if cutlass.const_expr(acc_dq_r is not None):
            tiles.append((acc_dq_r, thr_dq_r, cute.local_tile(
                m_dq[t, None, None], (BLOCK_H, self.rope), (hb, D_V // self.rope + rank))))
        for acc, thr, g_dq in tiles:
            t_g = thr.partition_C(g_dq)
            r_o = cute.make_fragment_like(acc, BFloat16)
            r_o.store(acc.load().to(BFloat16))
            for e in cutlass.range_constexpr(cute.size(r_o)):
                t_g[e] = r_o[e]


class SparseMlaBwdWsColsCompact(SparseMlaBwdWsCols, SparseMlaBwdMainCompact):
    """Entry point of the compact layout (``topk_length`` given)."""


class SparseMlaBwdWsColsNoncompact(SparseMlaBwdWsCols, SparseMlaBwdMainNoncompact):
    """Entry point of the noncompact layout (padding marked by out-of-range indices)."""


def compile_bwd_ws_cols(arch: str, d_qk: int, heads: int, layout: str, atomic_width: int = 4,
                        scatter: bool = True, impl: str = IMPL, extra_options: str = "",
                        deterministic: bool = False) -> tuple[object, dict[str, object]]:
    """``cute.compile`` this kernel for ``arch`` (sm_90a; ``CUTE_DSL_ARCH`` set before import).
    Returns the compiled function and the fake arguments it was compiled with."""
    if deterministic:
        raise ValueError(f"deterministic=True: impl={IMPL!r} has no deterministic mode; "
                         "impl='wgmma_ws' has")
    entries = {(False, "compact"): SparseMlaBwdWsColsCompact,
               (False, "noncompact"): SparseMlaBwdWsColsNoncompact}
    return compile_flavour(entries, IMPL, check_params, arch, d_qk, heads, layout, atomic_width,
                           scatter, impl, extra_options, deterministic)


__all__ = ["HEADS", "IMPL", "SparseMlaBwdWsCols", "SparseMlaBwdWsColsCompact",
           "SparseMlaBwdWsColsNoncompact", "can_implement", "check_params",
           "cols_smem_layouts", "compile_bwd_ws_cols"]
