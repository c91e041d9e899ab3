"""Callables that run a loaded artifact on torch tensors (the per-call path)."""

from __future__ import annotations

import bisect
import operator
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dsa_aot.fixed_point import fixed_point_dkv
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
    cubin and a CuTe DSL stage mix freely. The deterministic mode (CuTe DSL stages) runs the
    main and postprocess stages per chunk of query rows (:meth:`_deterministic`).
    """

    #: The tensors a backward call has, in the order :meth:`__call__` collects them.
    TENSORS = ("q", "kv", "out", "dout", "lse", "topk_idxs", "topk_length", "attn_sink", "delta",
               "lse_sink", "dq", "dkv", "dkv_acc", "d_sink_acc", "d_sink", "dkv_rows", "row_order",
               "row_offsets", "dkv_fixed")

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
            return self._deterministic(q, kv, out, dout, lse, topk_idxs, topk_length, attn_sink,
                                       softmax_scale, delta, lse_sink, dq, dkv)
        dkv_acc = torch.zeros((s_kv, d_qk), dtype=torch.float32, device=dev)
        d_sink = torch.zeros((heads,), dtype=torch.float32, device=dev)
        tensors = (q, kv, out, dout, lse, topk_idxs, topk_length, attn_sink, delta, lse_sink, dq, dkv,
                   dkv_acc, None, d_sink, None, None, None)
        scalars = {"softmax_scale": softmax_scale, "s_q": s_q, "s_kv": s_kv, "topk": topk_idxs.shape[1]}
        args: dict[str, int | float] = {}
        if self._cubin:  # cubin stages take every pointer by name
            args = {name: _ptr(t) for name, t in zip(self.TENSORS, tensors)
                    if t is not None or name not in ("d_sink_acc", "dkv_rows", "row_order", "row_offsets")}
            args.update(scalars)
        stream = current_stream(dev)
        for kernel, names in self._stages:
            if names is None:
                kernel.launch(stream, args)
            else:
                kernel(*names[0](tensors), stream=stream, **{n: scalars[n] for n in names[1]})
        return dq, dkv, d_sink

    def _deterministic(self, q, kv, out, dout, lse, topk_idxs, topk_length, attn_sink, softmax_scale,
                       delta, lse_sink, dq, dkv):
        """The deterministic mode (CuTe DSL stages): the preprocess once, then either

        * (fixed-point kernels) the main kernel over a sample and each group of query rows,
          adding dKV as exact integers, the postprocess guessing each group's scales before it
          and folding its sums after it, the last fold writing ``dkv`` and ``d_sink``
          (:func:`~dsa_aot.fixed_point.fixed_point_dkv`), or
        * per chunk of query rows the main kernel stores each valid slot's dKV row
          (``dkv_rows``), and the postprocess sums every KV row's stored rows in the order
          :func:`dkv_row_order` gives into ``dkv_acc`` (fp32, the running total) and ``dkv``.
          Chunks hold at most ``deterministic_workspace`` bytes of rows
          (:func:`deterministic_chunk_rows`).

        Every sum has an order (or none that matters) fixed by the inputs."""
        from dsa_aot import settings as _settings

        s_q, heads, d_qk = q.shape
        s_kv, topk = kv.shape[0], topk_idxs.shape[1]
        dev = q.device
        hb = head_blocks(heads)
        d_sink_acc = torch.empty((d_sink_parts(s_q), heads), dtype=torch.float32, device=dev)
        d_sink = torch.empty((heads,), dtype=torch.float32, device=dev)
        stream = current_stream(dev)
        scalars = {"softmax_scale": softmax_scale, "s_q": s_q, "s_kv": s_kv, "topk": topk,
                   "row_group": max(1, DET_GROUP_ROWS * topk * hb)}
        (pre, pre_names), (main, main_names), (post, post_names) = self._stages

        def launch(kernel, names, tensors):
            kernel(*names[0](tensors), stream=stream, **{n: scalars[n] for n in names[1]})

        fixed_point = "dkv_fixed" in main.tensor_names  # the fixed-point kernels
        dkv_acc = None if fixed_point else torch.zeros((s_kv, d_qk), dtype=torch.float32, device=dev)
        whole = (q, kv, out, dout, lse, topk_idxs, topk_length, attn_sink, delta, lse_sink, dq, dkv,
                 dkv_acc, d_sink_acc, d_sink, None, None, None)
        launch(pre, pre_names, whole)
        if fixed_point:
            def run_group(rows: range, fixed: torch.Tensor, measure: bool) -> None:
                # the whole tensors and the rows as scalars: slicing costs host time, which
                # before the first group's launch the GPU waits for
                main(*main_names[0]((q, kv, None, dout, None, topk_idxs, topk_length, None, delta,
                                     lse_sink, dq, None, None, None, None, None, None, None,
                                     fixed)),
                     stream=stream, softmax_scale=softmax_scale, row_start=rows.start,
                     row_step=rows.step, row_count=len(rows), fixed_measure=int(measure))

            def run_post(fixed, total, dkv_, d_sink_acc_, d_sink_, step: int, bound: int) -> None:
                post(*post_names[0]((None, None, None, None, None, None, None, None, None, None,
                                     None, dkv_, total, d_sink_acc_, d_sink_, None, None, None,
                                     fixed)),
                     stream=stream, fixed_step=step, fixed_bound=bound)

            fixed_point_dkv(run_group, run_post, dkv, d_sink_acc, d_sink, s_q, hb)
            return dq, dkv, d_sink
        rows_per_chunk = deterministic_chunk_rows(s_q, topk, hb, d_qk,
                                                  _settings.get().deterministic_workspace)
        if s_q == 0:  # no row: dkv is the zero sum, d_sink the fold of the (empty) partials
            empty = torch.empty((0, d_qk), dtype=torch.bfloat16, device=dev)
            order = torch.empty((0,), dtype=torch.int32, device=dev)
            offsets = torch.zeros((s_kv + 1,), dtype=torch.int32, device=dev)
            launch(post, post_names, whole[:15] + (empty, order, offsets))
            return dq, dkv, d_sink
        rows = torch.empty((min(rows_per_chunk, s_q) * topk, hb, d_qk), dtype=torch.bfloat16,
                           device=dev)
        for r0 in range(0, s_q, rows_per_chunk):
            r1 = min(s_q, r0 + rows_per_chunk)
            part = slice(r0, r1)
            chunk_rows = rows[:(r1 - r0) * topk]
            length = None if topk_length is None else topk_length[part]
            launch(main, main_names, (q[part], kv, None, dout[part], None, topk_idxs[part], length,
                                      None, delta[part], lse_sink[part], dq[part], None, None,
                                      None, None, chunk_rows, None, None))
            order, offsets = dkv_row_order(topk_idxs[part], length, s_kv, hb)
            launch(post, post_names, whole[:15] + (chunk_rows.view(-1, d_qk), order, offsets))
        return dq, dkv, d_sink


def head_blocks(heads: int) -> int:
    """CTAs of the backward per query row: one per block of 64 heads."""
    return -(-heads // 64)


#: The deterministic postprocess sums each KV row's stored dKV rows per group of this many query
#: rows, then the groups in order; chunks of a call are whole groups, so the bits of dkv depend
#: on the inputs only, not on ``deterministic_workspace``.
DET_GROUP_ROWS = 64


def deterministic_chunk_rows(s_q: int, topk: int, head_blocks: int, d_qk: int,
                             workspace: int) -> int:
    """Query rows per chunk of the deterministic backward: the most whole groups of
    :data:`DET_GROUP_ROWS` that keep ``dkv_rows`` (bf16, ``topk * head_blocks * d_qk`` values a
    row) within ``workspace`` bytes; at least one group."""
    per_group = max(1, DET_GROUP_ROWS * topk * head_blocks * d_qk * 2)
    groups = max(1, workspace // per_group)
    return min(groups * DET_GROUP_ROWS, max(s_q, 1))


def dkv_row_order(topk_idxs: torch.Tensor, topk_length: torch.Tensor | None, s_kv: int,
                  head_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which stored dKV rows each KV row sums, in a fixed order: ``(order, offsets)``, int32.

    Row ``(t * topk + slot) * head_blocks + h`` of the deterministic main kernel's ``dkv_rows``
    holds slot ``slot`` of query row ``t`` (head block ``h``); KV row ``j`` sums the rows
    ``order[offsets[j]:offsets[j + 1]]``: those of every valid slot (``0 <= index < s_kv``, and
    below ``topk_length`` when given) with index ``j``, by increasing query row, slot and head
    block. A stable sort of the indices gives it, so it depends on the indices only.
    """
    s_q, topk = topk_idxs.shape
    valid = (topk_idxs >= 0) & (topk_idxs < s_kv)
    if topk_length is not None:
        slots = torch.arange(topk, device=topk_idxs.device, dtype=torch.int32)
        valid &= slots < topk_length.clamp(0, topk).to(torch.int32)[:, None]
    # int16 keys where they fit: the radix sort then makes 2 passes instead of 4
    key_type = torch.int16 if s_kv < torch.iinfo(torch.int16).max else torch.int32
    keys = torch.where(valid, topk_idxs, s_kv).to(key_type).flatten()
    sorted_keys, position = torch.sort(keys, stable=True)
    bounds = torch.arange(s_kv + 1, device=keys.device, dtype=key_type)
    offsets = torch.searchsorted(sorted_keys, bounds, out_int32=True)
    if head_blocks > 1:
        blocks = torch.arange(head_blocks, device=keys.device, dtype=position.dtype)
        position = (position[:, None] * head_blocks + blocks).flatten()
        offsets = offsets * head_blocks
    return position.to(torch.int32), offsets


def d_sink_parts(s_q: int) -> int:
    """Partial sums of ``d_sink`` a deterministic backward call folds in order: one per CTA of
    the deterministic preprocess (16 query rows each, at most 1024). The order of every sum,
    hence every bit of the result, depends on the inputs only."""
    return max(1, min(1024, -(-s_q // 16)))


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SM_COUNT.get(index)
    if sms is None:
        sms = _SM_COUNT.setdefault(index, torch.cuda.get_device_properties(index).multi_processor_count)
    return sms


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
