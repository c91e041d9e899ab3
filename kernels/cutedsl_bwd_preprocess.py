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
from cutlass import BFloat16, Boolean, Float32, Int32

#: Value head dim of MLA; the only size that is fixed at compile time.
D_V = 512
#: bf16 elements per 16-byte vector load.
VEC = 8
#: One warp per head; a CTA covers ``WARPS`` heads ...
WARPS = 4
#: ... and ``ROWS_PER_CTA`` query rows, so each warp does one ``d_sink`` atomic per CTA.
ROWS_PER_CTA = 16

_INF = float("inf")

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
                 lane: Int32, first: Int32, step: Int32) -> Float32:
        """:meth:`row` over chunks ``first, first + step, ...`` of head ``h``'s rows, in order
        (fast: one chunk per CTA); returns ``-sum p_sink * delta``."""
        s_q = cute.size(out, mode=[0])
        sink = attn_sink[h]
        acc = Float32(0.0)
        n_chunks = (s_q + ROWS_PER_CTA - 1) // ROWS_PER_CTA
        for chunk in cutlass.range(first, n_chunks, step, unroll=1):
            row_end = cutlass.min(chunk * ROWS_PER_CTA + ROWS_PER_CTA, s_q)
            for t in cutlass.range(chunk * ROWS_PER_CTA, row_end):
                acc = acc - self.row(out, dout, lse, delta, lse_sink, sink, t, h, lane)
        return acc

    @cute.jit
    def row(self, out: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor, delta: cute.Tensor,
            lse_sink: cute.Tensor, sink: Float32, t: Int32, h: Int32, lane: Int32) -> Float32:
        """Write ``delta`` and ``lse_sink`` of ``(t, h)``; return ``p_sink * delta``."""
        o_row = out[t, h, None]
        g_row = dout[t, h, None]
        dot = Float32(0.0)
        for k in cutlass.range_constexpr(D_V // (32 * VEC)):
            o_vec = cute.local_tile(o_row, (VEC,), (lane + 32 * k,)).load().to(Float32)
            g_vec = cute.local_tile(g_row, (VEC,), (lane + 32 * k,)).load().to(Float32)
            dot = dot + (o_vec * g_vec).reduce(cute.ReductionOp.ADD, Float32(0.0),
                                              reduction_profile=0)
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
    stores its partial ``d_sink_acc[c, h]`` (no atomics; the postprocess folds them in order)."""

    @cute.jit
    def __call__(self, out: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor,
                 attn_sink: cute.Tensor, delta: cute.Tensor, lse_sink: cute.Tensor,
                 d_sink_acc: cute.Tensor, stream: cuda.CUstream) -> None:
        s_q = cute.size(out, mode=[0])
        heads = cute.size(out, mode=[1])
        if s_q > 0:
            self.kernel_det(out, dout, lse, attn_sink, delta, lse_sink, d_sink_acc).launch(
                grid=[cute.size(d_sink_acc, mode=[0]), (heads + WARPS - 1) // WARPS, 1],
                block=[32 * WARPS, 1, 1], stream=stream)

    @cute.kernel
    def kernel_det(self, out: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor,
                   attn_sink: cute.Tensor, delta: cute.Tensor, lse_sink: cute.Tensor,
                   d_sink_acc: cute.Tensor) -> None:
        heads = cute.size(out, mode=[1])
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bx, by, _ = cute.arch.block_idx()
        ctas_x, _, _ = cute.arch.grid_dim()
        h = by * WARPS + warp
        if h < heads:
            acc = self.sum_rows(out, dout, lse, attn_sink, delta, lse_sink, h, lane, bx, ctas_x)
            if lane == 0:
                d_sink_acc[bx, h] = acc


def fake_arguments(deterministic: bool = False) -> dict[str, object]:
    """Dynamic-shape stand-ins for every argument, in call order (``s_q``, ``H`` run-time;
    deterministic: ``d_sink_acc`` [parts, H] with a run-time number of partial sums in place of
    ``d_sink``)."""
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
    return {"out": values(), "dout": values(), "lse": rows(Float32), "attn_sink": per_head(),
            "delta": rows(Float32), "lse_sink": rows(Float32),
            "d_sink_acc": cute.runtime.make_fake_tensor(
                Float32, (cute.sym_int32(symbol="parts"), heads), (cute.sym_int64(), 1),
                assumed_align=4),
            "stream": cuda.CUstream(0)}


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
