"""Sparse MLA backward, stage 1 (TileLang): delta, sink-folded lse and the sink gradient.

Per query row t and head h:

* ``delta[t, h] = sum_d out[t, h, d] * dout[t, h, d]`` (fp32 accumulation);
* ``lse_sink[t, h] = logaddexp(lse[t, h], attn_sink[h])`` in natural log, shifting by the max
  only while the max is finite (an infinite max is already the answer, never ``inf - inf``);
* ``d_sink[h] += -p_sink * delta[t, h]`` with ``p_sink = 1 / (1 + exp(lse - sink))``, the
  sigmoid form of ``exp(sink - lse_sink)``, finite for every legal input: ``sink = +inf``
  gives 1, ``sink = -inf`` gives 0, an empty row (``lse = +inf``) with a finite sink gives 0.

One CTA handles ``_BLOCK_T`` query rows and all heads, reduces its sink gradient over those
rows and adds it to ``d_sink`` with one atomic per head (the runtime zeroes ``d_sink`` first).
The stage reads ``out``/``dout`` once (bandwidth-bound); ``spec.tile`` tunes the main stage
only and is ignored here.
"""

from typing import Any

from dsa_aot.specs.models import KernelSpec

#: Query rows per CTA; the sink gradient is reduced over them before the atomics.
_BLOCK_T = 8
#: Columns of ``out``/``dout`` loaded per step.
_BLOCK_D = 128
_THREADS = 256


def build_bwd_preprocess(spec: KernelSpec) -> tuple[Any, dict[str, Any]]:
    """Return the preprocess ``PrimFunc`` for ``spec`` (heads matter, not d_qk) and its pass configs."""
    import tilelang.language as T

    heads, d_v = spec.heads, spec.d_v
    block_t, block_d = _BLOCK_T, _BLOCK_D
    threads = _THREADS
    if d_v % block_d:
        raise ValueError(f"d_v={d_v} must be a multiple of {block_d}")
    s_q = T.dynamic("s_q")
    log2e = 1.4426950408889634
    f32 = T.float32

    @T.prim_func
    def sparse_mla_bwd_preprocess(
        out: T.Tensor([s_q, heads, d_v], T.bfloat16),
        dout: T.Tensor([s_q, heads, d_v], T.bfloat16),
        lse: T.Tensor([s_q, heads], f32),
        attn_sink: T.Tensor([heads], f32),
        delta: T.Tensor([s_q, heads], f32),
        lse_sink: T.Tensor([s_q, heads], f32),
        d_sink: T.Tensor([heads], f32),
    ):
        with T.Kernel(T.ceildiv(s_q, block_t), threads=threads) as bx:
            acc = T.alloc_fragment([heads, block_d], f32)
            row = T.alloc_fragment([heads], f32)
            delta_s = T.alloc_shared([block_t, heads], f32)
            grad_s = T.alloc_shared([block_t, heads], f32)
            for tt in T.serial(block_t):
                t = bx * block_t + tt
                T.clear(acc)
                if t < s_q:
                    for k in T.serial(d_v // block_d):
                        for h, d in T.Parallel(heads, block_d):
                            acc[h, d] += T.cast(out[t, h, k * block_d + d], f32) * T.cast(
                                dout[t, h, k * block_d + d], f32)
                T.reduce_sum(acc, row, dim=1)
                for h in T.Parallel(heads):
                    delta_s[tt, h] = row[h]
            for tt, h in T.Parallel(block_t, heads):
                t = bx * block_t + tt
                if t < s_q:
                    x = lse[t, h]
                    sink = attn_sink[h]
                    m = T.max(x, sink)
                    # logaddexp, shifted by the max only while the max is finite
                    folded = T.if_then_else(
                        (m == T.infinity(f32)) or (m == -T.infinity(f32)), m,
                        m + T.log(T.exp(x - m) + T.exp(sink - m)))
                    # p_sink = sigmoid(sink - lse); exp2 of +inf gives inf and 1/inf = 0
                    p_sink = T.if_then_else(
                        sink == T.infinity(f32), T.float32(1.0),
                        T.if_then_else(
                            (x == T.infinity(f32)) or (sink == -T.infinity(f32)), T.float32(0.0),
                            T.float32(1.0) / (T.float32(1.0) + T.exp2((x - sink) * log2e))))
                    delta[t, h] = delta_s[tt, h]
                    lse_sink[t, h] = folded
                    grad_s[tt, h] = -p_sink * delta_s[tt, h]
                else:
                    grad_s[tt, h] = T.float32(0.0)
            for h in T.Parallel(heads):
                total = T.alloc_var(f32)
                total = T.float32(0.0)
                for tt in T.serial(block_t):
                    total += grad_s[tt, h]
                T.atomic_add(d_sink[h], total)

    return sparse_mla_bwd_preprocess, {}
