"""CuTe DSL backward preprocess of sparse MLA: ``delta``, ``lse_sink`` and ``d_sink``.

For ``out``/``dout`` [s_q, H, 512] bf16, ``lse`` [s_q, H] fp32 (natural log, KV only, +inf for
an empty row) and ``attn_sink`` [H] fp32 the kernel writes

* ``delta[t, h] = sum_d out[t, h, d] * dout[t, h, d]`` (fp32 accumulation),
* ``lse_sink[t, h] = logaddexp(lse[t, h], sink[h])``, shifted by the max only while the max is
  finite (an infinite max already is the result; shifting it would be inf - inf),
* ``d_sink[h] += -sum_t p_sink[t, h] * delta[t, h]`` with ``p_sink = exp(sink - lse_sink)``,
  defined as 1 for ``sink = +inf`` and 0 for ``sink = -inf`` or ``lse_sink = +inf`` so it is
  finite for every legal input. The caller zeroes ``d_sink``; the kernel adds with atomics.
  Deterministic mode (:class:`SparseMlaBwdPreprocessDeterministic`): each CTA stores its partial
  sum ``d_sink_acc[c, h]`` instead, over a fixed set of rows, and the postprocess adds them in
  order.

Deterministic mode also computes the fixed-point scale of the main kernel's int64 dkv sums,
``dkv_scale = [2^k, 2^-k]`` (:func:`dsa_aot.runners.fixed_point_scale` is its torch reference and
explains the bound): while reading ``out`` and ``dout`` each warp keeps ``max |x|``, reads its
rows of ``q`` and a share of ``kv`` for theirs, and adds the four maxima to ``dkv_max`` with
integer ``atomicMax`` on the bits of ``|x|`` (order-free, and a NaN's bits exceed every number's,
so a NaN anywhere reaches the scale). The last CTA to finish (a ticket counter in ``dkv_max[4]``)
turns the maxima into ``k`` in fp64, exactly as the reference does, and writes ``dkv_scale``.
No host work and no extra launch: the caller only zeroes ``dkv_max``.

``s_q`` and ``H`` are run-time sizes (one compiled artifact serves every shape); the head
dimension is fixed at 512 and must be contiguous, row and head strides are run-time values
(multiples of 8 elements, 16-byte aligned base pointers).

"Is this finite" is spelled with ``cute.math.isfinite`` where the DSL has it (nvidia-cutlass-dsl
>= 4.6) and with explicit +-inf compares otherwise; :func:`probe_cute_isfinite` tells which, and
``use_isfinite`` forces either (both agree on every non-NaN input).

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Float64, Int32, Int64
from cutlass._mlir.dialects import llvm

from dsa_aot.kernels.dkv_interleave import FIXED_BITS, FIXED_K_LIMIT

#: Value head dim of MLA; the only size that is fixed at compile time.
D_V = 512
#: bf16 elements per 16-byte vector load.
VEC = 8
#: One warp per head; a CTA covers ``WARPS`` heads ...
WARPS = 4
#: ... and ``ROWS_PER_CTA`` query rows, so each warp does one ``d_sink`` atomic per CTA.
ROWS_PER_CTA = 16

_INF = float("inf")

#: ``dkv_max`` words: the bits of max |q|, |kv|, |out|, |dout|, then the CTA ticket counter.
MAX_Q, MAX_KV, MAX_OUT, MAX_DOUT, TICKET = range(5)


def _abs_bits(x: Float32) -> Int32:
    """The bits of ``|x|`` as a non-negative int: integer order is float order, NaN above inf."""
    return Int32(llvm.bitcast(Int32.mlir_type, Float32(x).ir_value())) & Int32(0x7FFFFFFF)


def _f32_of_bits(b: Int32) -> Float32:
    return Float32(llvm.bitcast(Float32.mlir_type, Int32(b).ir_value()))


def _bits_of_f64(x: Float64) -> Int64:
    return Int64(llvm.bitcast(Int64.mlir_type, Float64(x).ir_value()))


@cutlass.dsl_user_op
def _f64_rn(op: str, a: Float64, b: Float64, *, loc=None, ip=None) -> Float64:
    """``a op b`` (``op`` ``mul`` or ``add``) as its own correctly rounded fp64 instruction: an
    explicit ``.rn`` is never fused into an FMA, so the bound rounds exactly as the torch
    reference's separate operations do."""
    return Float64(llvm.inline_asm(
        Float64.mlir_type, [Float64(a).ir_value(loc=loc, ip=ip), Float64(b).ir_value(loc=loc, ip=ip)],
        f"{op}.rn.f64 $0, $1, $2;", "=d,d,d", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cute.jit
def _peak(vec: cute.TensorSSA, peak: Int32) -> Int32:
    """``max(peak, bits of |v|)`` over the 8 values of ``vec``."""
    for i in cutlass.range_constexpr(VEC):
        peak = cutlass.max(peak, _abs_bits(vec[i]))
    return peak


@cute.jit
def _warp_peak(peak: Int32) -> Int32:
    for offset in cutlass.range_constexpr(5):
        peak = cutlass.max(peak, cute.arch.shuffle_sync_bfly(peak, offset=16 >> offset))
    return peak


def probe_cute_isfinite() -> bool:
    """True when the installed CuTe DSL provides ``cute.math.isfinite`` (4.6 and later).

    Imports ``cutlass`` (no GPU needed); callers run it in a subprocess.
    """
    return callable(getattr(cute.math, "isfinite", None))


class SparseMlaBwdPreprocess:
    """The preprocess kernel; ``use_isfinite`` picks how finiteness is tested (see module doc)."""

    def __init__(self, use_isfinite: bool) -> None:
        if use_isfinite and not probe_cute_isfinite():
            raise ValueError("use_isfinite=True, but this CuTe DSL has no cute.math.isfinite "
                             "(added in nvidia-cutlass-dsl 4.6); build with use_isfinite=False")
        self.use_isfinite = use_isfinite

    def _finite(self, x: Float32) -> Boolean:
        if self.use_isfinite:
            return Boolean(cute.math.isfinite(x))
        return (x != Float32(_INF)) & (x != Float32(-_INF))

    @cute.jit
    def __call__(self, out: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor,
                 attn_sink: cute.Tensor, delta: cute.Tensor, lse_sink: cute.Tensor,
                 d_sink: cute.Tensor, stream: cuda.CUstream) -> None:
        self.launch(out, dout, lse, attn_sink, delta, lse_sink, d_sink, stream)

    @cute.jit
    def launch(self, out: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor,
               attn_sink: cute.Tensor, delta: cute.Tensor, lse_sink: cute.Tensor,
               d_sink: cute.Tensor, stream: cuda.CUstream) -> None:
        s_q = cute.size(out, mode=[0])
        heads = cute.size(out, mode=[1])
        ctas = (s_q + ROWS_PER_CTA - 1) // ROWS_PER_CTA
        if s_q > 0:
            self.kernel(out, dout, lse, attn_sink, delta, lse_sink, d_sink).launch(
                grid=[ctas, (heads + WARPS - 1) // WARPS, 1],
                block=[32 * WARPS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, out: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor,
               attn_sink: cute.Tensor, delta: cute.Tensor, lse_sink: cute.Tensor,
               d_sink: cute.Tensor) -> None:
        s_q = cute.size(out, mode=[0])
        heads = cute.size(out, mode=[1])
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, by, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        h = by * WARPS + warp
        if h < heads:
            acc = self.sum_rows(out, dout, lse, attn_sink, delta, lse_sink, h, lane, bx, ctas)
            if lane == 0:
                cute.arch.atomic_add((d_sink.iterator + h).llvm_ptr, acc)

    @cute.jit
    def sum_rows(self, out: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor,
                 attn_sink: cute.Tensor, delta: cute.Tensor, lse_sink: cute.Tensor, h: Int32,
                 lane: Int32, first: Int32, step: Int32, peaks: cute.Tensor = None,
                 q: cute.Tensor = None) -> Float32:
        """:meth:`row` over chunks ``first, first + step, ...`` of head ``h``'s rows, in order
        (fast: one chunk per CTA); returns ``-sum p_sink * delta``. With ``peaks`` and ``q``
        (deterministic mode), also folds the bits of this lane's ``|q|`` into ``peaks[MAX_Q]``."""
        s_q = cute.size(out, mode=[0])
        sink = attn_sink[h]
        acc = Float32(0.0)
        n_chunks = (s_q + ROWS_PER_CTA - 1) // ROWS_PER_CTA
        for chunk in cutlass.range(first, n_chunks, step, unroll=1):
            row_end = cutlass.min(chunk * ROWS_PER_CTA + ROWS_PER_CTA, s_q)
            for t in cutlass.range(chunk * ROWS_PER_CTA, row_end):
                acc = acc - self.row(out, dout, lse, delta, lse_sink, sink, t, h, lane, peaks)
                if cutlass.const_expr(q is not None):
                    q_row = q[t, h, None]
                    for v in cutlass.range(lane, cute.size(q, mode=[2]) // VEC, 32, unroll=1):
                        vec = cute.local_tile(q_row, (VEC,), (v,)).load().to(Float32)
                        peaks[MAX_Q] = _peak(vec, peaks[MAX_Q])
        return acc

    @cute.jit
    def row(self, out: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor, delta: cute.Tensor,
            lse_sink: cute.Tensor, sink: Float32, t: Int32, h: Int32, lane: Int32,
            peaks: cute.Tensor = None) -> Float32:
        """Write ``delta`` and ``lse_sink`` of ``(t, h)``; return ``p_sink * delta``. With
        ``peaks`` (deterministic mode), also fold this lane's ``|out|`` / ``|dout|`` bits into
        ``peaks[MAX_OUT]`` / ``peaks[MAX_DOUT]``."""
        o_row = out[t, h, None]
        g_row = dout[t, h, None]
        dot = Float32(0.0)
        for k in cutlass.range_constexpr(D_V // (32 * VEC)):
            o_vec = cute.local_tile(o_row, (VEC,), (lane + 32 * k,)).load().to(Float32)
            g_vec = cute.local_tile(g_row, (VEC,), (lane + 32 * k,)).load().to(Float32)
            dot = dot + (o_vec * g_vec).reduce(cute.ReductionOp.ADD, Float32(0.0),
                                              reduction_profile=0)
            if cutlass.const_expr(peaks is not None):
                peaks[MAX_OUT] = _peak(o_vec, peaks[MAX_OUT])
                peaks[MAX_DOUT] = _peak(g_vec, peaks[MAX_DOUT])
        dot = cute.arch.warp_reduction_sum(dot)

        row_lse = lse[t, h]
        top = cutlass.max(row_lse, sink)
        merged = top  # an infinite max is already logaddexp; never shift by it
        if self._finite(top):
            merged = top + cute.math.log(cute.math.exp(row_lse - top)
                                         + cute.math.exp(sink - top))
        p_sink = Float32(0.0)
        if sink == Float32(_INF):
            p_sink = Float32(1.0)
        elif self._finite(sink) & self._finite(merged):
            p_sink = cute.math.exp(sink - merged)
        if lane == 0:
            delta[t, h] = dot
            lse_sink[t, h] = merged
        return p_sink * dot


class SparseMlaBwdPreprocessDeterministic(SparseMlaBwdPreprocess):
    """Deterministic mode: CTA ``c`` of ``d_sink_acc.shape[0]`` sums its row chunks in order and
    stores its partial ``d_sink_acc[c, h]`` (no atomics; the postprocess folds them in order),
    and the CTAs together compute ``dkv_scale`` from ``max |q|``, ``|kv|``, ``|out|``, ``|dout|``
    (``dkv_max``: five zeroed int32, see the module doc)."""

    @cute.jit
    def __call__(self, out: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor,
                 attn_sink: cute.Tensor, delta: cute.Tensor, lse_sink: cute.Tensor,
                 d_sink_acc: cute.Tensor, q: cute.Tensor, kv: cute.Tensor, dkv_max: cute.Tensor,
                 dkv_scale: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream) -> None:
        s_q = cute.size(out, mode=[0])
        heads = cute.size(out, mode=[1])
        if s_q > 0:
            self.kernel_det(out, dout, lse, attn_sink, delta, lse_sink, d_sink_acc, q, kv,
                            dkv_max, dkv_scale, softmax_scale).launch(
                grid=[cute.size(d_sink_acc, mode=[0]), (heads + WARPS - 1) // WARPS, 1],
                block=[32 * WARPS, 1, 1], stream=stream)

    @cute.kernel
    def kernel_det(self, out: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor,
                   attn_sink: cute.Tensor, delta: cute.Tensor, lse_sink: cute.Tensor,
                   d_sink_acc: cute.Tensor, q: cute.Tensor, kv: cute.Tensor,
                   dkv_max: cute.Tensor, dkv_scale: cute.Tensor, softmax_scale: Float32) -> None:
        s_q = cute.size(out, mode=[0])
        heads = cute.size(out, mode=[1])
        q_vecs = cute.size(q, mode=[2]) // VEC
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, by, _ = cute.arch.block_idx()
        ctas_x, ctas_y, _ = cute.arch.grid_dim()
        h = by * WARPS + warp
        peaks = cute.make_rmem_tensor(4, Int32)
        peaks.fill(0)
        if h < heads:
            acc = self.sum_rows(out, dout, lse, attn_sink, delta, lse_sink, h, lane, bx, ctas_x,
                                peaks, q)
            if lane == 0:
                d_sink_acc[bx, h] = acc
        # kv rows are shared out over every warp of the grid
        warps = ctas_x * ctas_y * WARPS
        for r in cutlass.range((by * ctas_x + bx) * WARPS + warp, cute.size(kv, mode=[0]), warps,
                               unroll=1):
            kv_row = kv[r, None]
            for v in cutlass.range(lane, q_vecs, 32, unroll=1):
                vec = cute.local_tile(kv_row, (VEC,), (v,)).load().to(Float32)
                peaks[MAX_KV] = _peak(vec, peaks[MAX_KV])
        for i in cutlass.range_constexpr(4):
            peak = _warp_peak(peaks[i])
            if (lane == 0) & (peak != 0):
                cute.arch.atomic_max((dkv_max.iterator + i).llvm_ptr, peak, sem="relaxed",
                                     scope="gpu")
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if warp == 0 and lane == 0:
            ticket = cute.arch.atomic_add((dkv_max.iterator + TICKET).llvm_ptr, Int32(1),
                                          sem="acq_rel", scope="gpu")
            if ticket == ctas_x * ctas_y - 1:  # every other CTA's maxima are in
                self.write_scale(dkv_max, dkv_scale, softmax_scale, s_q, heads)

    @cute.jit
    def write_scale(self, dkv_max: cute.Tensor, dkv_scale: cute.Tensor, softmax_scale: Float32,
                    s_q: Int32, heads: Int32) -> None:
        """``dkv_scale = [2^k, 2^-k]`` from the final maxima (the reference's arithmetic, in
        fp64, in its order; ``ceil(log2 B)`` from the bits of ``B``)."""
        m = [Float64(_f32_of_bits(cute.arch.atomic_max((dkv_max.iterator + i).llvm_ptr, Int32(0),
                                                        sem="acquire", scope="gpu")))
             for i in range(4)]
        m_q, m_kv, m_out, m_dout = m
        scale = Float64(cutlass.max(softmax_scale, -softmax_scale))
        mul, add = (lambda a, b: _f64_rn("mul", a, b)), (lambda a, b: _f64_rn("add", a, b))
        term = mul(mul(mul(mul(Float64(D_V), m_dout), add(m_kv, m_out)), scale), m_q)
        bound = mul(Float64(2.0) * Float64(s_q) * Float64(heads), add(term, m_dout))  # exact ints
        finite = bound < Float64(_INF)  # False for NaN and inf
        if bound < Float64(2.0 ** -100):
            bound = Float64(2.0 ** -100)
        bits = _bits_of_f64(bound)
        exp = Int32((bits >> 52) & 0x7FF) - 1023 + Int32((bits & ((1 << 52) - 1)) != 0)
        k = cutlass.min(FIXED_BITS - exp, FIXED_K_LIMIT)
        ok = finite & (k >= -FIXED_K_LIMIT)
        mult = Float32(1.0)
        unit = Float32(float("nan"))
        if ok:
            mult = _f32_of_bits((k + 127) << 23)
            unit = _f32_of_bits((127 - k) << 23)
        dkv_scale[0] = mult
        dkv_scale[1] = unit


def fake_arguments(deterministic: bool = False) -> dict[str, object]:
    """Dynamic-shape stand-ins for every argument, in call order (``s_q``, ``H`` run-time;
    deterministic: ``d_sink_acc`` [parts, H] with a run-time number of partial sums, ``q`` and
    ``kv`` with a run-time ``D_qk``, ``dkv_max`` [5] int32, ``dkv_scale`` [2] fp32 and
    ``softmax_scale``)."""
    s_q = cute.sym_int32(symbol="s_q")
    heads = cute.sym_int32(symbol="heads")

    def vec_stride() -> object:
        return cute.sym_int64(divisibility=VEC)

    def rows(dtype: type) -> object:  # [s_q, H], heads contiguous, run-time row stride
        return cute.runtime.make_fake_tensor(dtype, (s_q, heads), (cute.sym_int64(), 1),
                                             assumed_align=4)

    def per_head() -> object:
        return cute.runtime.make_fake_tensor(Float32, (heads,), (1,), assumed_align=4)

    def values() -> object:  # [s_q, H, 512] bf16
        return cute.runtime.make_fake_tensor(BFloat16, (s_q, heads, D_V),
                                             (vec_stride(), vec_stride(), 1), assumed_align=16)

    if not deterministic:
        return {"out": values(), "dout": values(), "lse": rows(Float32), "attn_sink": per_head(),
                "delta": rows(Float32), "lse_sink": rows(Float32), "d_sink": per_head(),
                "stream": cuda.CUstream(0)}
    d_qk = cute.sym_int32(divisibility=VEC, symbol="d_qk")
    return {"out": values(), "dout": values(), "lse": rows(Float32), "attn_sink": per_head(),
            "delta": rows(Float32), "lse_sink": rows(Float32),
            "d_sink_acc": cute.runtime.make_fake_tensor(
                Float32, (cute.sym_int32(symbol="parts"), heads), (cute.sym_int64(), 1),
                assumed_align=4),
            "q": cute.runtime.make_fake_tensor(BFloat16, (s_q, heads, d_qk),
                                               (vec_stride(), vec_stride(), 1), assumed_align=16),
            "kv": cute.runtime.make_fake_tensor(BFloat16, (cute.sym_int32(symbol="s_kv"), d_qk),
                                                (vec_stride(), 1), assumed_align=16),
            "dkv_max": cute.runtime.make_fake_tensor(Int32, (TICKET + 1,), (1,), assumed_align=4),
            "dkv_scale": cute.runtime.make_fake_tensor(Float32, (2,), (1,), assumed_align=4),
            "softmax_scale": Float32(1.0), "stream": cuda.CUstream(0)}


def compile_bwd_preprocess(arch: str, use_isfinite: bool | None = None,
                           extra_options: str = "", deterministic: bool = False,
                           ) -> tuple[object, dict[str, object]]:
    """``cute.compile`` the kernel for ``arch``; ``use_isfinite=None`` follows the probe.

    Returns the compiled function and the fake arguments it was compiled with. The process must
    have ``CUTE_DSL_ARCH=<arch>`` in its environment before ``cutlass`` was first imported.
    """
    if use_isfinite is None:
        use_isfinite = probe_cute_isfinite()
    fakes = fake_arguments(deterministic)
    cls = SparseMlaBwdPreprocessDeterministic if deterministic else SparseMlaBwdPreprocess
    compiled = cute.compile(cls(use_isfinite), *fakes.values(),
                            options=f"--gpu-arch {arch} {extra_options}".strip())
    return compiled, fakes
