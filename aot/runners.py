"""Callables that run a loaded artifact on torch tensors (the per-call path)."""

from __future__ import annotations

import bisect
import operator
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dsa_aot.kernels.dkv_interleave import FIXED_BITS, FIXED_K_LIMIT
from dsa_aot.specs.shapes import D_V, SpecFields

if TYPE_CHECKING:
    from dsa_aot.specs.models import KernelSpec
    from dsa_aot.backends.cutedsl.runtime import CuteDslKernel
    from dsa_aot.backends.tilelang.launch import CubinKernel


class FwdKernel(ABC):
    @abstractmethod
    def __call__(self, q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor,
                 topk_length: torch.Tensor | None, attn_sink: torch.Tensor, softmax_scale: float,
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...


class BwdKernel(ABC):
    @abstractmethod
    def __call__(self, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                 lse: torch.Tensor, topk_idxs: torch.Tensor, topk_length: torch.Tensor | None,
                 attn_sink: torch.Tensor, softmax_scale: float,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


try:  # the raw cudaStream_t of the current stream, without building a Stream object
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - older torch
    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


def current_stream(device: torch.device) -> int:
    """The caller's current CUDA stream on ``device``, as an int handle."""
    return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())


def pad_topk(topk_idxs: torch.Tensor, topk_length: torch.Tensor | None, width: int,
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``topk_idxs`` [S_q, K] padded with -1 to ``width`` columns; in the compact layout the lengths
    are clamped to K, so the padded slots never count. Unchanged when K is the width already."""
    k = topk_idxs.shape[1]
    if k == width:
        return topk_idxs, topk_length
    padded = torch.nn.functional.pad(topk_idxs, (0, width - k), value=-1)
    return padded, None if topk_length is None else torch.clamp(topk_length, max=k)


class TopkBuckets:
    """One backend whose kernels are specialised on the top-k width, as one fwd or bwd kernel.

    A call of width K runs the narrowest stored bucket >= K (``load(width)``, no compile), else
    compiles the narrowest fitting bucket (``jit(width)``, when allowed), with ``topk_idxs`` padded
    by :func:`pad_topk`; a K wider than every bucket, or a miss, goes to ``fallback()`` (the next
    backends of the ranking). Each width is resolved once per process.
    """

    def __init__(self, op: str, widths: list[int], load: Callable[[int], Any | None],
                 jit: Callable[[int], Any | None], fallback: Callable[[], Any]) -> None:
        self.op, self.widths = op, sorted(widths)
        self._load, self._jit, self._fallback = load, jit, fallback
        self._idx = 2 if op == "fwd" else 5  # topk_idxs' position; topk_length follows it
        self._by_k: dict[int, tuple[Any, int | None]] = {}
        self._lock = threading.Lock()

    def kernel_for(self, k: int) -> tuple[Any, int | None]:
        """``(kernel, bucket width)`` for a call of width ``k`` (width None: the fallback's kernel)."""
        hit = self._by_k.get(k)
        if hit is not None:
            return hit
        with self._lock:
            if k not in self._by_k:
                fitting = self.widths[bisect.bisect_left(self.widths, k):]
                found = next(((kern, w) for w in fitting if (kern := self._load(w)) is not None), None)
                if found is None and fitting and (kern := self._jit(fitting[0])) is not None:
                    found = (kern, fitting[0])
                self._by_k[k] = found or (self._fallback(), None)
            return self._by_k[k]

    def __call__(self, *args: Any) -> Any:
        i = self._idx
        kernel, width = self.kernel_for(args[i].shape[1])
        if width is None:
            return kernel(*args)
        idxs, lengths = pad_topk(args[i], args[i + 1], width)
        return kernel(*args[:i], idxs, lengths, *args[i + 2:])


class CubinFwd(FwdKernel):
    def __init__(self, kernel: CubinKernel, spec: KernelSpec | SpecFields) -> None:
        self.kernel = kernel
        self.spec = spec

    def __call__(self, q, kv, topk_idxs, topk_length, attn_sink, softmax_scale):
        s_q, heads, _ = q.shape
        dev = q.device
        out = torch.empty((s_q, heads, D_V), dtype=torch.bfloat16, device=dev)
        lse = torch.empty((s_q, heads), dtype=torch.float32, device=dev)
        self.kernel.launch(current_stream(dev), {
            "q": q.data_ptr(), "kv": kv.data_ptr(), "topk_idxs": topk_idxs.data_ptr(),
            "topk_length": _ptr(topk_length), "attn_sink": attn_sink.data_ptr(),
            "out": out.data_ptr(), "lse": lse.data_ptr(), "softmax_scale": softmax_scale,
            "s_q": s_q, "s_kv": kv.shape[0], "topk": topk_idxs.shape[1]})
        return out, lse


class CuteFwd(FwdKernel):
    """The forward as one exported CuTe DSL kernel (tensors by name, ``softmax_scale`` by value;
    a persistent kernel also takes ``num_sms``, the GPU's SM count)."""

    #: The tensors a forward call has, in the order :meth:`__call__` collects them.
    TENSORS = ("q", "kv", "topk_idxs", "topk_length", "attn_sink", "out", "lse")

    def __init__(self, kernel: CuteDslKernel, spec: KernelSpec | SpecFields) -> None:
        self.kernel = kernel
        self.spec = spec
        self._names = kernel.tensor_names
        self._pick = _picker(self.TENSORS, self._names)
        self._persistent = "num_sms" in kernel.scalar_names

    def __call__(self, q, kv, topk_idxs, topk_length, attn_sink, softmax_scale):
        s_q, heads, _ = q.shape
        dev = q.device
        out = torch.empty((s_q, heads, D_V), dtype=torch.bfloat16, device=dev)
        lse = torch.empty((s_q, heads), dtype=torch.float32, device=dev)
        scalars = {"softmax_scale": softmax_scale}
        if self._persistent:
            scalars["num_sms"] = _sm_count(dev)
        self.kernel(*self._pick((q, kv, topk_idxs, topk_length, attn_sink, out, lse)),
                    stream=current_stream(dev), **scalars)
        return out, lse


def _picker(order: tuple[str, ...], names: list[str]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """``values -> the values of names``, ``values`` given in ``order``, in one C call."""
    index = [order.index(n) for n in names]
    if len(index) == 1:
        return lambda values: (values[index[0]],)
    return operator.itemgetter(*index)


#: A loaded backward stage: a cubin (pointer/scalar arguments by name) or an exported CuTe
#: DSL kernel (tensors by name, stream as keyword).
BwdStage = "CubinKernel | CuteDslKernel"


class StagedBwd(BwdKernel):
    """Backward as three stages on the caller's stream: preprocess, main, postprocess.

    The runtime allocates every intermediate and zeroes the accumulators the kernels add into
    (``d_sink``, ``dkv_acc``); each stage reads its arguments by the contract's names, so a
    cubin and a CuTe DSL stage mix freely.
    """

    #: The tensors a backward call has, in the order :meth:`__call__` collects them.
    TENSORS = ("q", "kv", "out", "dout", "lse", "topk_idxs", "topk_length", "attn_sink", "delta",
               "lse_sink", "dq", "dkv", "dkv_acc", "dkv_max", "dkv_scale", "d_sink_acc", "d_sink")

    def __init__(self, pre: BwdStage, main: BwdStage, post: BwdStage, spec: KernelSpec | SpecFields) -> None:
        from dsa_aot.backends.tilelang.launch import CubinKernel  # ctypes only; no compiler

        self.pre, self.main, self.post = pre, main, post
        self.spec = spec
        self._stages = [(k, None if isinstance(k, CubinKernel)
                         else (_picker(self.TENSORS, k.tensor_names), k.scalar_names))
                        for k in (pre, main, post)]
        self._cubin = any(names is None for _, names in self._stages)

    def __call__(self, q, kv, out, dout, lse, topk_idxs, topk_length, attn_sink, softmax_scale):
        s_q, heads, d_qk = q.shape
        s_kv = kv.shape[0]
        dev = q.device
        delta = torch.empty((s_q, heads), dtype=torch.float32, device=dev)
        lse_sink = torch.empty((s_q, heads), dtype=torch.float32, device=dev)
        dq = torch.empty_like(q)
        dkv = torch.empty((s_kv, d_qk), dtype=torch.bfloat16, device=dev)
        if self.spec.deterministic:
            dkv_acc = torch.zeros((s_kv, d_qk), dtype=torch.int64, device=dev)
            # the preprocess finds the maxima and writes dkv_scale (fixed_point_scale's rule)
            work = torch.zeros(8, dtype=torch.int32, device=dev)
            dkv_max, dkv_scale = work[:5], work[6:].view(torch.float32)
            d_sink_acc = torch.empty((d_sink_parts(s_q), heads), dtype=torch.float32, device=dev)
            d_sink = torch.empty((heads,), dtype=torch.float32, device=dev)
        else:
            dkv_acc = torch.zeros((s_kv, d_qk), dtype=torch.float32, device=dev)
            dkv_max = dkv_scale = d_sink_acc = None
            d_sink = torch.zeros((heads,), dtype=torch.float32, device=dev)
        tensors = (q, kv, out, dout, lse, topk_idxs, topk_length, attn_sink, delta, lse_sink, dq, dkv,
                   dkv_acc, dkv_max, dkv_scale, d_sink_acc, d_sink)
        scalars = {"softmax_scale": softmax_scale, "s_q": s_q, "s_kv": s_kv, "topk": topk_idxs.shape[1]}
        args: dict[str, int | float] = {}
        if self._cubin:  # cubin stages take every pointer by name
            args = {name: _ptr(t) for name, t in zip(self.TENSORS, tensors)
                    if t is not None or name not in ("d_sink_acc", "dkv_max", "dkv_scale")}
            args.update(scalars)
        stream = current_stream(dev)
        for kernel, names in self._stages:
            if names is None:
                kernel.launch(stream, args)
            else:
                kernel(*names[0](tensors), stream=stream, **{n: scalars[n] for n in names[1]})
        return dq, dkv, d_sink


def d_sink_parts(s_q: int) -> int:
    """Partial sums of ``d_sink`` a deterministic backward call folds in order: one per CTA of
    the deterministic preprocess (16 query rows each, at most 1024). The order of every sum,
    hence every bit of the result, depends on the inputs only."""
    return max(1, min(1024, -(-s_q // 16)))


def fixed_point_scale(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                      softmax_scale: float) -> torch.Tensor:
    """The deterministic backward's fixed-point scale ``[2^k, 2^-k]`` (fp32, on ``q``'s device),
    in torch: the reference of what the deterministic preprocess kernel computes on the GPU
    (:mod:`dsa_aot.kernels.cutedsl_bwd_preprocess`; same arithmetic, same order, so the same
    bits). The main kernel adds ``rni(v * 2^k)`` as int64, the fold multiplies the sums by
    ``2^-k``.

    ``k`` is chosen from a bound ``B`` on every partial sum of dkv, so no sum can overflow:
    per element, a (row, head, slot) adds ``dS q + P dO`` with ``0 <= P <= 1``, ``sum_slots P <=
    1`` per (row, head), and ``|dS| <= P (|dP| + |delta|) scale <= P 512 max|dout| (max|kv| +
    max|out|) scale``; over all rows and heads ``B = 2 s_q H (512 max|dout| (max|kv| + max|out|)
    scale max|q| + max|dout|)`` (2x margin for rounding; fp64; ``scale`` as the fp32 the kernels
    get). ``2^k`` is the largest power of two with ``B 2^k <= 2^61`` (``ceil(log2 B)`` exactly,
    from ``frexp``): each value is rounded to ``2^-k`` (~``2^-61 B``), finer than fp32's ``2^-24
    |sum|`` for any sum above ``2^-37 B``. A non-finite input (or a bound beyond ``2^181``, which
    fp32 products of such inputs would overflow anyway) leaves no safe scale: the multiplier is
    then 1 and the inverse NaN, so dkv is NaN, as a fast call's would be.
    """
    maxes = torch.stack([_abs_max(t) for t in (q, kv, out, dout)]).double()
    m_q, m_kv, m_out, m_dout = maxes.unbind()
    s_q, heads = q.shape[0], q.shape[1]
    scale = abs(torch.tensor(softmax_scale, dtype=torch.float32).item())
    bound = 2.0 * s_q * heads * (D_V * m_dout * (m_kv + m_out) * scale * m_q + m_dout)
    mant, exp = torch.frexp(bound.clamp_min(2.0 ** -100))  # bound = mant 2^exp, 0.5 <= mant < 1
    exp = (exp - (mant == 0.5).int()).double()  # ceil(log2 bound)
    k = torch.clamp(FIXED_BITS - exp, max=float(FIXED_K_LIMIT))
    ok = torch.isfinite(bound) & (k >= -FIXED_K_LIMIT)  # fp32 holds 2^k and 2^-k
    k = torch.where(ok, k, torch.zeros_like(k))
    mult = torch.exp2(k)
    unit = torch.where(ok, torch.exp2(-k), torch.full_like(k, float("nan")))
    return torch.stack([mult, unit]).float()


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SM_COUNT.get(index)
    if sms is None:
        sms = _SM_COUNT.setdefault(index, torch.cuda.get_device_properties(index).multi_processor_count)
    return sms


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    """``max |t|`` as an fp32 scalar tensor (0 for an empty tensor; NaN if ``t`` holds one)."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.maximum(-lo, hi).float()


class CubinBwd(StagedBwd):
    """Backward from three cubins (the TileLang backend)."""

    def __init__(self, pre: CubinKernel, main: CubinKernel, post: CubinKernel, spec: KernelSpec | SpecFields) -> None:
        super().__init__(pre, main, post, spec)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.is_cuda else torch.float64


class ReferenceFwd(FwdKernel):
    def __call__(self, q, kv, topk_idxs, topk_length, attn_sink, softmax_scale):
        from dsa_aot.kernels.reference import sparse_mla_fwd_ref

        out, lse = sparse_mla_fwd_ref(q, kv, topk_idxs, topk_length, attn_sink, softmax_scale,
                                      compute_dtype=_compute_dtype(q))
        return out.to(torch.bfloat16), lse.to(torch.float32)


class ReferenceBwd(BwdKernel):
    def __call__(self, q, kv, out, dout, lse, topk_idxs, topk_length, attn_sink, softmax_scale):
        from dsa_aot.kernels.reference import sparse_mla_bwd_ref

        dq, dkv, d_sink = sparse_mla_bwd_ref(q, kv, out, dout, lse, topk_idxs, topk_length, attn_sink,
                                             softmax_scale, compute_dtype=_compute_dtype(q))
        if d_sink is None:
            d_sink = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)
        return dq.to(torch.bfloat16), dkv.to(torch.bfloat16), d_sink.to(torch.float32)
