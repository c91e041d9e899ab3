"""Sparse MLA backward, main stage (TileLang): dq and the fp32 dkv accumulator.

One CTA owns one query row and a block of 64 heads (fewer heads are padded to 64 so every
GEMM keeps the 64-row warpgroup shape; padded heads carry ``lse = +inf`` and contribute
nothing). It walks the row's top-k slots ``block_i`` at a time:

* ``s = q k^T``, ``dp = dout v^T``; ``p = exp2(s * scale * log2e - lse_sink * log2e)`` where a
  masked slot's exponent is ``-inf`` before the ``exp2`` (no ``inf * 0`` can arise);
* ``ds = p * (dp - delta) * scale``; ``dq += ds k``;
* ``dkv[idx] += ds^T q + p^T dout`` (the second term on the first ``d_v`` columns), computed in
  column chunks and added with fp32 atomics at valid indices only.

A slot is valid iff its index is in ``[0, s_kv)`` and, in the compact layout, it lies before
the row's clamped ``topk_length`` (the loop stops there). Invalid slots get a zero KV row
(cp.async zero-fill, nothing is read) and never reach an atomic. Rows without a valid slot
write ``dq = 0``.

Pipeline (hand-written; the two stages are "compute block i" and "fetch block i+1"): the next
block's indices are loaded during the score GEMMs, and its KV rows stream into shared memory
with cp.async while the dkv GEMMs and atomics of the current block run. On Hopper the dkv
chunk GEMMs are asynchronous WGMMAs that ping-pong between two accumulators, so chunk c's
MMAs overlap chunk c-1's atomics. Shared memory: q, dout, one KV tile and p/ds, about 226 KiB
for ``d_qk = 576``, hence one CTA per SM.
"""

from typing import Any

from dsa_aot.specs.models import KernelSpec

_LOG2E = 1.4426950408889634
#: Supported tile configuration, per arch: top-k slots per step, pipeline depth, threads.
#: The kernel is written for exactly these (64-row MMA tiles in both GEMM orientations, a
#: two-stage hand-written pipeline, two warpgroups).
_DEFAULTS = {
    "sm_90a": {"block_i": 64, "num_stages": 2, "threads": 256},
    "sm_100a": {"block_i": 64, "num_stages": 2, "threads": 256},
}
#: dkv columns per chunk (one accumulator of ``block_i x _BLOCK_D`` fp32).
_BLOCK_D = 128


def _tile(spec: KernelSpec) -> tuple[int, int]:
    """``(block_i, threads)`` for ``spec``; a tile field other than None or the default is refused."""
    defaults = _DEFAULTS[spec.arch]
    for field, default in defaults.items():
        value = getattr(spec.tile, field)
        if value is not None and value != default:
            raise ValueError(f"tilelang sparse_mla_bwd supports only {field}={default} on {spec.arch} "
                             f"(got {value}); leave tile.{field} unset")
    return defaults["block_i"], defaults["threads"]


def build_bwd_main(spec: KernelSpec) -> tuple[Any, dict[str, Any]]:
    """Return the main backward ``PrimFunc`` for ``spec`` and its TileLang pass configs."""
    import tilelang
    import tilelang.language as T

    block_i, threads = _tile(spec)
    heads, d_qk, d_v = spec.heads, spec.d_qk, spec.d_v
    d_tail = d_qk - d_v
    compact = spec.layout == "compact"
    block_h = 64
    padded_h = max(heads, block_h)
    n_hblk = padded_h // block_h
    pad_heads = heads < block_h
    block_d = _BLOCK_D

    s_q = T.dynamic("s_q")
    s_kv = T.dynamic("s_kv")
    topk = T.dynamic("topk")
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    inf = T.infinity(f32)

    def row_limit(topk_length, t):
        """Slots of row ``t`` to visit: the clamped ``topk_length`` (compact) or all of them.

        Always inlined, never bound to a name: a binding of the bare ``topk`` would be hoisted
        to the host and turn into an extra kernel parameter.
        """
        return T.min(T.max(topk_length[t], 0), topk) if compact else topk

    hopper = spec.arch == "sm_90a"
    gemm_async = T.wgmma_gemm if hopper else T.gemm
    n_chunks = d_v // block_d

    @T.macro
    def load_idx(topk_idxs, topk_length, t, it, raw_f):
        for j in T.Parallel(block_i):
            col = it * block_i + j
            raw_f[j] = T.if_then_else(col < row_limit(topk_length, t), topk_idxs[t, col], -1)

    @T.macro
    def store_idx(raw_f, idx_s, ok_s, slot):
        for j in T.Parallel(block_i):
            ok = (raw_f[j] >= 0) and (raw_f[j] < s_kv)
            ok_s[slot, j] = T.if_then_else(ok, 1, 0)
            idx_s[slot, j] = T.if_then_else(ok, raw_f[j], -1)

    @T.macro
    def gather_pass(kv, dst, idx_s, slot, rows_l, col0, width):
        """Issue cp.async for ``block_i`` KV rows, columns ``[col0, col0 + width)``, into ``dst``.

        Thread ``tx`` copies 16-byte vectors of rows ``r * per_pass + tx // vecs``; the row
        indices are read from shared memory into registers first, so the copy loop itself
        touches no shared memory but its destination (no barriers between the copies).
        """
        tx = T.get_thread_binding()
        vecs = width // 8
        per_pass = threads // vecs
        n_pass = block_i // per_pass
        group = min(n_pass, 8)
        for g in T.unroll(n_pass // group):
            for r in T.unroll(group):
                rows_l[r] = idx_s[slot, (g * group + r) * per_pass + tx // vecs]
            for r in T.unroll(group):
                # an invalid slot (-1) gets a zero row (cp.async zero-fill; nothing is read):
                # finite, and masked before exp2 anyway
                T.ptx_cp_async(
                    T.access_ptr(dst[(g * group + r) * per_pass + tx // vecs, (tx % vecs) * 8], "w", 8),
                    T.access_ptr(kv[T.max(rows_l[r], 0), col0 + (tx % vecs) * 8], "r", 8),
                    8, rows_l[r] >= 0)

    @T.macro
    def gather(kv, kv_s, kvt_s, idx_s, slot, rows_l):
        gather_pass(kv, kv_s, idx_s, slot, rows_l, 0, d_v)
        if d_tail:
            gather_pass(kv, kvt_s, idx_s, slot, rows_l, d_v, d_tail)
        T.ptx_commit_group()

    @T.macro
    def scatter(dkv_acc, acc, idx_s, ok_s, slot, col0, width):
        for j, d in T.Parallel(block_i, width):
            if ok_s[slot, j] != 0:
                T.atomic_add(dkv_acc[idx_s[slot, j], col0 + d], acc[j, d])

    @T.macro
    def body(q, kv, dout, topk_idxs, topk_length, lse_sink, delta, dq, dkv_acc, softmax_scale):
        with T.Kernel(s_q, n_hblk, threads=threads) as (t, hb):
            q_s = T.alloc_shared([block_h, d_v], bf16)
            do_s = T.alloc_shared([block_h, d_v], bf16)
            kv_s = T.alloc_shared([block_i, d_v], bf16)
            p_s = T.alloc_shared([block_h, block_i], bf16)
            ds_s = T.alloc_shared([block_h, block_i], bf16)
            idx_s = T.alloc_shared([2, block_i], i32)
            ok_s = T.alloc_shared([2, block_i], i32)
            lse_s = T.alloc_shared([block_h], f32)
            delta_s = T.alloc_shared([block_h], f32)
            raw_f = T.alloc_fragment([block_i], i32)
            rows_l = T.alloc_local([8], i32)
            acc_s = T.alloc_fragment([block_h, block_i], f32)
            acc_dp = T.alloc_fragment([block_h, block_i], f32)
            acc_dq = T.alloc_fragment([block_h, d_v], f32)
            acc_kv0 = T.alloc_fragment([block_i, block_d], f32)
            acc_kv1 = T.alloc_fragment([block_i, block_d], f32) if hopper else None
            qt_s = None
            kvt_s = None
            if d_tail:
                qt_s = T.alloc_shared([block_h, d_tail], bf16)
                kvt_s = T.alloc_shared([block_i, d_tail], bf16)
                acc_dqt = T.alloc_fragment([block_h, d_tail], f32)
                acc_kvt = T.alloc_fragment([block_i, d_tail], f32)

            h0 = hb * block_h
            scale_log2 = softmax_scale * _LOG2E
            for h, d in T.Parallel(block_h, d_v):
                if pad_heads:
                    q_s[h, d] = T.if_then_else(h < heads, q[t, h0 + h, d], T.cast(0, bf16))
                    do_s[h, d] = T.if_then_else(h < heads, dout[t, h0 + h, d], T.cast(0, bf16))
                else:
                    q_s[h, d] = q[t, h0 + h, d]
                    do_s[h, d] = dout[t, h0 + h, d]
            if d_tail:
                for h, d in T.Parallel(block_h, d_tail):
                    if pad_heads:
                        qt_s[h, d] = T.if_then_else(h < heads, q[t, h0 + h, d_v + d], T.cast(0, bf16))
                    else:
                        qt_s[h, d] = q[t, h0 + h, d_v + d]
            for h in T.Parallel(block_h):
                if pad_heads:
                    lse_s[h] = T.if_then_else(h < heads, lse_sink[t, h0 + h] * _LOG2E, inf)
                    delta_s[h] = T.if_then_else(h < heads, delta[t, h0 + h], T.float32(0))
                else:
                    lse_s[h] = lse_sink[t, h0 + h] * _LOG2E
                    delta_s[h] = delta[t, h0 + h]
            T.clear(acc_dq)
            if d_tail:
                T.clear(acc_dqt)

            load_idx(topk_idxs, topk_length, t, 0, raw_f)
            store_idx(raw_f, idx_s, ok_s, 0)
            T.sync_threads()
            gather(kv, kv_s, kvt_s, idx_s, 0, rows_l)
            for it in T.serial(T.ceildiv(row_limit(topk_length, t), block_i)):
                cur = it % 2
                # indices of the next block: loaded now, stored to shared memory after the
                # score GEMMs so the global load latency hides behind them
                load_idx(topk_idxs, topk_length, t, it + 1, raw_f)
                T.ptx_wait_group(0)
                T.sync_threads()
                gemm_async(q_s, kv_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                if d_tail:
                    gemm_async(qt_s, kvt_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                gemm_async(do_s, kv_s, acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                if hopper:
                    T.wait_wgmma(0)
                for h, j in T.Parallel(block_h, block_i):
                    # masked slots get -inf in the exponent, before exp2
                    p = T.exp2(T.if_then_else(ok_s[cur, j] != 0, acc_s[h, j] * scale_log2 - lse_s[h], -inf))
                    acc_s[h, j] = p
                    acc_dp[h, j] = p * (acc_dp[h, j] - delta_s[h]) * softmax_scale
                store_idx(raw_f, idx_s, ok_s, 1 - cur)
                T.copy(acc_s, p_s)
                T.copy(acc_dp, ds_s)

                gemm_async(ds_s, kv_s, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                if d_tail:
                    gemm_async(ds_s, kvt_s, acc_dqt, policy=T.GemmWarpPolicy.FullCol)
                if hopper:
                    T.wait_wgmma(0)
                T.sync_threads()
                # the next block's KV rows stream in while the dkv GEMMs and atomics run
                if it + 1 < T.ceildiv(row_limit(topk_length, t), block_i):
                    gather(kv, kv_s, kvt_s, idx_s, 1 - cur, rows_l)

                # dkv in column chunks. On Hopper the chunk GEMMs are asynchronous and ping-pong
                # between two accumulators: chunk c's WGMMAs run while chunk c-1's atomics issue.
                accs = [acc_kv0, acc_kv1] if hopper else [acc_kv0, acc_kv0]
                for c in list(range(n_chunks + (1 if d_tail else 0))):
                    if c < n_chunks:
                        gemm_async(ds_s, q_s[:, c * block_d:(c + 1) * block_d], accs[c % 2], transpose_A=True,
                                   policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                        gemm_async(p_s, do_s[:, c * block_d:(c + 1) * block_d], accs[c % 2], transpose_A=True,
                                   policy=T.GemmWarpPolicy.FullCol)
                    else:
                        gemm_async(ds_s, qt_s, acc_kvt, transpose_A=True, policy=T.GemmWarpPolicy.FullCol,
                                   clear_accum=True)
                    if hopper:
                        if c > 0:
                            scatter(dkv_acc, accs[(c - 1) % 2], idx_s, ok_s, cur, (c - 1) * block_d, block_d)
                        T.wait_wgmma(0)
                    elif c < n_chunks:
                        scatter(dkv_acc, accs[c % 2], idx_s, ok_s, cur, c * block_d, block_d)
                if d_tail:
                    scatter(dkv_acc, acc_kvt, idx_s, ok_s, cur, d_v, d_tail)
                elif hopper:
                    scatter(dkv_acc, accs[(n_chunks - 1) % 2], idx_s, ok_s, cur, d_v - block_d, block_d)

            T.ptx_wait_group(0)  # the prologue's copies when the loop ran zero times
            for h, d in T.Parallel(block_h, d_v):
                if (not pad_heads) or h < heads:
                    dq[t, h0 + h, d] = T.cast(acc_dq[h, d], bf16)
            if d_tail:
                for h, d in T.Parallel(block_h, d_tail):
                    if (not pad_heads) or h < heads:
                        dq[t, h0 + h, d_v + d] = T.cast(acc_dqt[h, d], bf16)

    if compact:
        @T.prim_func
        def sparse_mla_bwd(
            q: T.Tensor([s_q, heads, d_qk], bf16),
            kv: T.Tensor([s_kv, d_qk], bf16),
            dout: T.Tensor([s_q, heads, d_v], bf16),
            topk_idxs: T.Tensor([s_q, topk], i32),
            topk_length: T.Tensor([s_q], i32),
            lse_sink: T.Tensor([s_q, heads], f32),
            delta: T.Tensor([s_q, heads], f32),
            dq: T.Tensor([s_q, heads, d_qk], bf16),
            dkv_acc: T.Tensor([s_kv, d_qk], f32),
            softmax_scale: T.float32,
        ):
            body(q, kv, dout, topk_idxs, topk_length, lse_sink, delta, dq, dkv_acc, softmax_scale)
    else:
        @T.prim_func
        def sparse_mla_bwd(
            q: T.Tensor([s_q, heads, d_qk], bf16),
            kv: T.Tensor([s_kv, d_qk], bf16),
            dout: T.Tensor([s_q, heads, d_v], bf16),
            topk_idxs: T.Tensor([s_q, topk], i32),
            lse_sink: T.Tensor([s_q, heads], f32),
            delta: T.Tensor([s_q, heads], f32),
            dq: T.Tensor([s_q, heads, d_qk], bf16),
            dkv_acc: T.Tensor([s_kv, d_qk], f32),
            softmax_scale: T.float32,
        ):
            body(q, kv, dout, topk_idxs, None, lse_sink, delta, dq, dkv_acc, softmax_scale)

    configs = {
        tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
        tilelang.PassConfigKey.TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE: True,
    }
    return sparse_mla_bwd, configs
