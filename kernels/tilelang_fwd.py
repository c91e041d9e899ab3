"""TileLang sparse MLA forward (one latent KV head, gathered top-k keys).

One CTA owns one query token and a block of 64 heads (H=128 uses two CTAs per token; H<64
pads the head block with zero rows that are never read from or written to global memory).
The main loop walks the token's top-k slots in tiles of ``block_i`` gathered KV rows with an
online softmax in base 2.

Two implementations share the contract:

* ``ws`` (sm_90a default, 384 threads): warp-specialised. Warpgroup 2 gathers KV rows with
  predicated ``cp.async`` into a ring of ``num_stages`` buffers (invalid slots are zero-filled,
  never read) and publishes each tile's 0/1 validity flags; warpgroup 0 computes the scores,
  the online softmax and the left half of ``P @ V``; warpgroup 1 the right half of ``P @ V``.
  mbarriers order the three roles; ``setmaxnreg`` moves producer registers to warpgroup 0.
* ``pipelined`` (sm_100a default, and any non-384 thread count): one role, ``T.Pipelined``.

Masking: a slot is valid iff it lies below ``topk`` (and below ``clamp(topk_length, 0, topk)``
in the compact layout) and ``0 <= idx < s_kv``. Its score is -inf before any max/exp (the
score accumulator starts at -inf for it), and the running max starts at a finite floor so an
all-masked tile never forms inf-inf. An invalid slot is never read: its row is zero-filled
(predicated cp.async with source size 0, or a predicated load of row 0). The sink is folded in at the end, ``out *= 1/(1+exp(sink-lse))``: 0 for
sink=+inf, 1 for sink=-inf, finite for every finite sink; a row without a valid slot stores
out=0 and lse=+inf. ``softmax_scale`` must be positive.
"""

from typing import Any

from dsa_aot.specs.models import KernelSpec

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: Finite floor of the running max (base-2 units): an all-masked tile keeps m finite.
M_FLOOR = -1.0e30
#: Heads per CTA: one wgmma M block.
HEADS_PER_CTA = 64
#: Named barrier joining the two consumer warpgroups before the epilogue (TileLang reserves
#: 0-2 and allocates its own from 3 upwards).
EPILOGUE_BARRIER = 15
#: setmaxnreg budget of the warp-specialised kernel. ptxas compiles each role for its budget;
#: WG1 keeps the launch value (65536 / 384 -> 168). An increase is served only from registers
#: released by the decrease, so WG0 + WG1 + producer must stay <= 3 * 168 or WG0 waits forever.
WG0_REGS, WG1_REGS, PRODUCER_REGS = 240, 168, 80
#: Shared memory of one CTA on sm_90a / sm_100a (227 KiB).
SMEM_LIMIT = 232448

#: Per-arch defaults: (block_i, num_stages, threads); threads=384 is the warp-specialised kernel.
_DEFAULTS = {
    "sm_90a": (64, 2, 384),
    "sm_100a": (64, 2, 256),
}


def resolve_tile(spec: KernelSpec) -> tuple[str, int, int, int]:
    """``(impl, block_i, num_stages, threads)`` from ``spec.tile``, ``None`` -> the arch default.

    384 threads select the warp-specialised wgmma kernel (sm_90a only), 128 or 256 the
    software-pipelined one.
    """
    block_i, stages, threads = _DEFAULTS[spec.arch]
    block_i = spec.tile.block_i or block_i
    stages = spec.tile.num_stages if spec.tile.num_stages is not None else stages
    threads = spec.tile.threads or threads
    impl = "ws" if threads == 384 else "pipelined"
    if impl == "ws" and spec.arch != "sm_90a":
        raise ValueError(f"threads={threads} (warp-specialised wgmma kernel) needs sm_90a, not {spec.arch}")
    if impl == "ws" and block_i not in (32, 64):
        raise ValueError(f"block_i={block_i}: the warp-specialised kernel supports 32 or 64")
    if impl == "ws" and not 2 <= stages <= 4:
        raise ValueError(f"num_stages={stages}: the warp-specialised kernel supports 2 to 4")
    if impl == "pipelined" and threads not in (128, 256):
        raise ValueError(f"threads={threads}: use 128 or 256 (pipelined) or 384 (warp-specialised)")
    if block_i % 16 != 0:
        raise ValueError(f"block_i={block_i} must be a multiple of 16")
    kv_stages = stages if impl == "ws" else 1
    smem = (2 * (HEADS_PER_CTA * spec.d_qk + kv_stages * block_i * spec.d_qk + HEADS_PER_CTA * block_i)
            + 4 * kv_stages * block_i + 1024)
    if smem > SMEM_LIMIT:
        raise ValueError(f"block_i={block_i}, num_stages={stages} needs ~{smem} B of shared memory for "
                         f"d_qk={spec.d_qk}; the limit is {SMEM_LIMIT}")
    return impl, block_i, stages, threads


def build_fwd(spec: KernelSpec) -> tuple[Any, dict[str, Any]]:
    """``(prim_func, pass_configs)`` of the forward kernel ``sparse_mla_fwd`` for ``spec``."""
    if spec.op != "fwd":
        raise ValueError(f"build_fwd got a {spec.op!r} spec")
    impl, block_i, stages, threads = resolve_tile(spec)
    compact = spec.layout == "compact"
    if impl == "ws":
        func = _build_ws(spec.d_qk, spec.d_v, spec.heads, compact, block_i, stages)
    else:
        func = _build_pipelined(spec.d_qk, spec.d_v, spec.heads, compact, block_i, stages, threads)
    return func, {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def _signature(T: Any, compact: bool, body: Any, d_qk: int, d_v: int, heads: int) -> Any:
    """Wrap ``body`` (a ``T.macro``) in the layout's parameter list."""
    s_q = T.dynamic("s_q")
    s_kv = T.dynamic("s_kv")
    topk = T.dynamic("topk")
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32

    if compact:
        @T.prim_func
        def sparse_mla_fwd(
            q: T.Tensor([s_q, heads, d_qk], bf16),
            kv: T.Tensor([s_kv, d_qk], bf16),
            topk_idxs: T.Tensor([s_q, topk], i32),
            topk_length: T.Tensor([s_q], i32),
            attn_sink: T.Tensor([heads], f32),
            out: T.Tensor([s_q, heads, d_v], bf16),
            lse: T.Tensor([s_q, heads], f32),
            softmax_scale: T.float32,
        ):
            body(q, kv, topk_idxs, topk_length, attn_sink, out, lse, softmax_scale, s_q, s_kv, topk)
    else:
        @T.prim_func
        def sparse_mla_fwd(
            q: T.Tensor([s_q, heads, d_qk], bf16),
            kv: T.Tensor([s_kv, d_qk], bf16),
            topk_idxs: T.Tensor([s_q, topk], i32),
            attn_sink: T.Tensor([heads], f32),
            out: T.Tensor([s_q, heads, d_v], bf16),
            lse: T.Tensor([s_q, heads], f32),
            softmax_scale: T.float32,
        ):
            body(q, kv, topk_idxs, None, attn_sink, out, lse, softmax_scale, s_q, s_kv, topk)
    return sparse_mla_fwd


def _build_pipelined(d_qk: int, d_v: int, heads: int, compact: bool, block_i: int, num_stages: int,
                     threads: int) -> Any:
    import tilelang.language as T

    hb = HEADS_PER_CTA
    rep = max(1, heads // hb)
    pad_heads = heads < hb
    bi = block_i
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32

    @T.macro
    def body(q, kv, topk_idxs, topk_length, attn_sink, out, lse, softmax_scale, s_q, s_kv, topk):
        with T.Kernel(s_q * rep, threads=threads) as bx:
            q_s = T.alloc_shared([hb, d_qk], bf16)
            kv_s = T.alloc_shared([bi, d_qk], bf16)
            p_s = T.alloc_shared([hb, bi], bf16)
            valid_s = T.alloc_shared([bi], i32)
            acc_o = T.alloc_fragment([hb, d_v], f32)
            acc_s = T.alloc_fragment([hb, bi], f32)
            m_i = T.alloc_fragment([hb], f32)
            m_prev = T.alloc_fragment([hb], f32)
            m_tile = T.alloc_fragment([hb], f32)
            l_i = T.alloc_fragment([hb], f32)
            l_tile = T.alloc_fragment([hb], f32)
            alpha = T.alloc_fragment([hb], f32)
            fac = T.alloc_fragment([hb], f32)

            tok = bx // rep
            h0 = (bx % rep) * hb
            sc = softmax_scale * LOG2E
            # (never bind a dynamic size to a new Python name: the builder would rename it)
            n_cols = T.min(T.max(topk_length[tok], 0), topk) if compact else T.max(topk, 0)

            for h, d in T.Parallel(hb, d_qk):
                if pad_heads:
                    q_s[h, d] = T.if_then_else(h < heads, q[tok, T.min(h, heads - 1), d], T.cast(0, bf16))
                else:
                    q_s[h, d] = q[tok, h0 + h, d]
            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(m_i, M_FLOOR)

            for it in T.Pipelined(T.ceildiv(n_cols, bi), num_stages=num_stages):
                for j in T.Parallel(bi):
                    col = it * bi + j
                    raw = topk_idxs[tok, T.min(col, topk - 1)]
                    valid_s[j] = T.if_then_else((col < n_cols) & (raw >= 0) & (raw < s_kv), 1, 0)
                for j, d in T.Parallel(bi, d_qk):
                    col = it * bi + j
                    raw = topk_idxs[tok, T.min(col, topk - 1)]
                    ok = (col < n_cols) & (raw >= 0) & (raw < s_kv)
                    kv_s[j, d] = T.if_then_else(ok, kv[T.if_then_else(ok, raw, 0), d], T.cast(0, bf16))
                for h, j in T.Parallel(hb, bi):
                    acc_s[h, j] = T.if_then_else(valid_s[j] != 0, T.cast(0, f32), -T.infinity(f32))
                T.gemm(q_s, kv_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(m_i, m_prev)
                T.reduce_max(acc_s, m_tile, dim=1, clear=True)
                for h in T.Parallel(hb):
                    m_i[h] = T.max(m_prev[h], m_tile[h] * sc)
                for h in T.Parallel(hb):
                    alpha[h] = T.exp2(m_prev[h] - m_i[h])
                for h, j in T.Parallel(hb, bi):
                    acc_s[h, j] = T.exp2(acc_s[h, j] * sc - m_i[h])
                T.reduce_sum(acc_s, l_tile, dim=1)
                for h in T.Parallel(hb):
                    l_i[h] = l_i[h] * alpha[h] + l_tile[h]
                for h, d in T.Parallel(hb, d_v):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
                T.copy(acc_s, p_s)
                T.gemm(p_s, kv_s[:, 0:d_v], acc_o, policy=T.GemmWarpPolicy.FullRow)

            for h in T.Parallel(hb):
                has = l_i[h] > 0
                l_safe = T.if_then_else(has, l_i[h], T.cast(1, f32))
                lse_nat = (T.log2(l_safe) + m_i[h]) * LN2
                sink = attn_sink[T.min(h0 + h, heads - 1)]
                w = 1.0 / (1.0 + T.exp2((sink - lse_nat) * LOG2E))
                fac[h] = T.if_then_else(has, w / l_safe, T.cast(0, f32))
                if h0 + h < heads:
                    lse[tok, h0 + h] = T.if_then_else(has, lse_nat, T.infinity(f32))
            for h, d in T.Parallel(hb, d_v):
                if h0 + h < heads:
                    out[tok, h0 + h, d] = T.cast(acc_o[h, d] * fac[h], bf16)

    return _signature(T, compact, body, d_qk, d_v, heads)


def _build_ws(d_qk: int, d_v: int, heads: int, compact: bool, block_i: int, num_stages: int) -> Any:
    """Warp-specialised kernel (sm_90a, wgmma, 384 threads).

    WG0: scores, online softmax, lse and the left half of P@V; WG1: the right half of P@V;
    WG2: the gather producer. (A fourth warpgroup freeing WG0 from P@V was tried: at 512
    threads ptxas refuses the 64x256 fp32 accumulator wgmma, which needs >= 154 registers.)
    """
    import tilelang.language as T

    hb = HEADS_PER_CTA
    rep = max(1, heads // hb)
    pad_heads = heads < hb
    bi = block_i
    ns = num_stages
    half = d_v // 2            # P @ V is split by columns between two warpgroups
    d_t = d_qk - d_v           # rope tail (0 for D_qk = 512)
    n_cons = 256               # consumer threads (WG0 + WG1)
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    # cp.async without commit/wait: completion is tracked by cp.async.mbarrier.arrive.noinc.
    gather = {"parallel_prefer_async": True, "parallel_async_without_async_commit_wait": True}

    @T.macro
    def pv_role(p_s, alpha_s, fac_s, kv_half, acc, full, p_full, p_free, empty, out, tok, h0, col0,
                n_tiles):
        """WG1: acc = alpha*acc + P @ V[:, col0:col0+half] per tile, then the scaled store."""
        T.fill(acc, 0)
        for t in T.serial(n_tiles):
            st = t % ns
            T.barrier_wait(full[st], (t // ns) % 2)
            T.barrier_wait(p_full[0], t % 2)
            for h, d in T.Parallel(hb, half):
                acc[h, d] = acc[h, d] * alpha_s[h]
            T.gemm(p_s, kv_half[st, :, :], acc)
            T.barrier_arrive(p_free[0])
            T.barrier_arrive(empty[st])
        T.sync_threads(EPILOGUE_BARRIER, n_cons)
        for h, d in T.Parallel(hb, half):
            if h0 + h < heads:
                out[tok, h0 + h, col0 + d] = T.cast(acc[h, d] * fac_s[h], bf16)

    @T.macro
    def online_softmax(sbuf, m_i, m_prev, m_tile, l_i, l_tile, alpha, acc, sc):
        """Base-2 online softmax of one score tile in place; rescales ``acc`` by alpha."""
        T.copy(m_i, m_prev)
        T.reduce_max(sbuf, m_tile, dim=1, clear=True)
        for h in T.Parallel(hb):
            m_i[h] = T.max(m_prev[h], m_tile[h] * sc)
        for h in T.Parallel(hb):
            alpha[h] = T.exp2(m_prev[h] - m_i[h])
        for h, j in T.Parallel(hb, bi):
            sbuf[h, j] = T.exp2(sbuf[h, j] * sc - m_i[h])
        T.reduce_sum(sbuf, l_tile, dim=1)
        for h in T.Parallel(hb):
            l_i[h] = l_i[h] * alpha[h] + l_tile[h]
        for h, d in T.Parallel(hb, half):
            acc[h, d] = acc[h, d] * alpha[h]

    @T.macro
    def body(q, kv, topk_idxs, topk_length, attn_sink, out, lse, softmax_scale, s_q, s_kv, topk):
        with T.Kernel(s_q * rep, threads=384) as bx:
            q_l = T.alloc_shared([hb, half], bf16)
            q_r = T.alloc_shared([hb, half], bf16)
            kv_l = T.alloc_shared([ns, bi, half], bf16)
            kv_r = T.alloc_shared([ns, bi, half], bf16)
            if d_t > 0:
                q_t = T.alloc_shared([hb, d_t], bf16)
                k_t = T.alloc_shared([ns, bi, d_t], bf16)
            valid_s = T.alloc_shared([ns, bi], i32)
            p_s = T.alloc_shared([hb, bi], bf16)
            alpha_s = T.alloc_shared([hb], f32)
            fac_s = T.alloc_shared([hb], f32)

            acc_o_l = T.alloc_fragment([hb, half], f32)
            acc_o_r = T.alloc_fragment([hb, half], f32)
            acc_s = T.alloc_fragment([hb, bi], f32)
            m_i = T.alloc_fragment([hb], f32)
            m_prev = T.alloc_fragment([hb], f32)
            m_tile = T.alloc_fragment([hb], f32)
            l_i = T.alloc_fragment([hb], f32)
            l_tile = T.alloc_fragment([hb], f32)
            alpha = T.alloc_fragment([hb], f32)
            fac = T.alloc_fragment([hb], f32)

            # full[s]: 128 cp.async arrivals + 128 plain arrivals (validity flags) from the producer.
            full = T.alloc_barrier([256] * ns)
            # empty[s]: both consumer warpgroups are done with stage s.
            empty = T.alloc_barrier([256] * ns)
            p_full = T.alloc_barrier(128)   # P and alpha of the current tile are in shared memory
            p_free = T.alloc_barrier(128)   # WG1 has consumed them

            tx = T.get_thread_binding()
            tok = bx // rep
            h0 = (bx % rep) * hb
            sc = softmax_scale * LOG2E
            # (never bind a dynamic size to a new Python name: the builder would rename it)
            n_cols = T.min(T.max(topk_length[tok], 0), topk) if compact else T.max(topk, 0)
            n_tiles = T.ceildiv(n_cols, bi)

            if tx < 256:
                for h, d in T.Parallel(hb, half):
                    if pad_heads:
                        q_l[h, d] = T.if_then_else(h < heads, q[tok, T.min(h, heads - 1), d], T.cast(0, bf16))
                        q_r[h, d] = T.if_then_else(h < heads, q[tok, T.min(h, heads - 1), half + d],
                                                   T.cast(0, bf16))
                    else:
                        q_l[h, d] = q[tok, h0 + h, d]
                        q_r[h, d] = q[tok, h0 + h, half + d]
                if d_t > 0:
                    for h, d in T.Parallel(hb, d_t):
                        if pad_heads:
                            q_t[h, d] = T.if_then_else(h < heads, q[tok, T.min(h, heads - 1), d_v + d],
                                                       T.cast(0, bf16))
                        else:
                            q_t[h, d] = q[tok, h0 + h, d_v + d]
            T.sync_threads()

            if tx < 128:
                # Scores, online softmax, left half of P@V, lse and the per-row output factor.
                T.set_max_nreg(WG0_REGS, 1)
                T.fill(acc_o_l, 0)
                T.fill(l_i, 0)
                T.fill(m_i, M_FLOOR)
                for t in T.serial(n_tiles):
                    st = t % ns
                    T.barrier_wait(full[st], (t // ns) % 2)
                    # Invalid slots start at -inf, so their scores are -inf before any max/exp.
                    for h, j in T.Parallel(hb, bi):
                        acc_s[h, j] = T.if_then_else(valid_s[st, j] != 0, T.cast(0, f32), -T.infinity(f32))
                    T.wgmma_gemm(q_l, kv_l[st, :, :], acc_s, transpose_B=True)
                    T.wgmma_gemm(q_r, kv_r[st, :, :], acc_s, transpose_B=True)
                    if d_t > 0:
                        T.wgmma_gemm(q_t, k_t[st, :, :], acc_s, transpose_B=True)
                    T.wait_wgmma(0)
                    online_softmax(acc_s, m_i, m_prev, m_tile, l_i, l_tile, alpha, acc_o_l, sc)
                    if t > 0:
                        T.barrier_wait(p_free[0], (t - 1) % 2)
                    T.copy(alpha, alpha_s)
                    T.copy(acc_s, p_s)
                    # P is read by WG1's wgmma (async proxy): fence before publishing it.
                    T.fence_proxy_async()
                    T.barrier_arrive(p_full[0])
                    T.gemm(p_s, kv_l[st, :, :], acc_o_l)
                    T.barrier_arrive(empty[st])
                for h in T.Parallel(hb):
                    has = l_i[h] > 0
                    l_safe = T.if_then_else(has, l_i[h], T.cast(1, f32))
                    lse_nat = (T.log2(l_safe) + m_i[h]) * LN2
                    sink = attn_sink[T.min(h0 + h, heads - 1)]
                    w = 1.0 / (1.0 + T.exp2((sink - lse_nat) * LOG2E))
                    fac[h] = T.if_then_else(has, w / l_safe, T.cast(0, f32))
                    fac_s[h] = fac[h]
                    if h0 + h < heads:
                        lse[tok, h0 + h] = T.if_then_else(has, lse_nat, T.infinity(f32))
                T.sync_threads(EPILOGUE_BARRIER, n_cons)
                for h, d in T.Parallel(hb, half):
                    if h0 + h < heads:
                        out[tok, h0 + h, d] = T.cast(acc_o_l[h, d] * fac[h], bf16)
            elif tx < 256:
                pv_role(p_s, alpha_s, fac_s, kv_r, acc_o_r, full, p_full, p_free, empty, out, tok, h0, half,
                        n_tiles)
            else:
                # Producer: 0/1 flags, then the gathered rows (zero fill, no read, when invalid).
                T.set_max_nreg(PRODUCER_REGS, 0)
                for t in T.serial(n_tiles):
                    st = t % ns
                    T.barrier_wait(empty[st], ((t // ns) % 2) ^ 1)
                    for j in T.Parallel(bi):
                        col = t * bi + j
                        raw = topk_idxs[tok, T.min(col, topk - 1)]
                        valid_s[st, j] = T.if_then_else((col < n_cols) & (raw >= 0) & (raw < s_kv), 1, 0)
                    for j, d in T.Parallel(bi, half, annotations=gather):
                        col = t * bi + j
                        raw = topk_idxs[tok, T.min(col, topk - 1)]
                        ok = (col < n_cols) & (raw >= 0) & (raw < s_kv)
                        src = T.if_then_else(ok, raw, 0)
                        kv_l[st, j, d] = T.if_then_else(ok, kv[src, d], T.cast(0, bf16))
                        kv_r[st, j, d] = T.if_then_else(ok, kv[src, half + d], T.cast(0, bf16))
                    if d_t > 0:
                        for j, d in T.Parallel(bi, d_t, annotations=gather):
                            col = t * bi + j
                            raw = topk_idxs[tok, T.min(col, topk - 1)]
                            ok = (col < n_cols) & (raw >= 0) & (raw < s_kv)
                            src = T.if_then_else(ok, raw, 0)
                            k_t[st, j, d] = T.if_then_else(ok, kv[src, d_v + d], T.cast(0, bf16))
                    T.cp_async_barrier_noinc(full[st])
                    T.barrier_arrive(full[st])

    return _signature(T, compact, body, d_qk, d_v, heads)

