"""Run the cudnn backend's artifacts without a compiler: the CuTe DSL runtime opens each library
from a sealed memfd and packs its call frames; the runners here allocate what the frontend's
kernels expect (its batch=1 views, workspaces, the zeroed accumulators) on the caller's stream.

Conventions are ours and the frontend's alike: ``lse`` natural-log over the valid slots without
the sink, ``q`` [S_q, H, D], ``kv`` [S_kv, D], ``out`` / ``dout`` [S_q, H, 512], ``attn_sink`` [H]
fp32, ``topk_idxs`` int32 (-1 and other out-of-range values are padding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dsa_aot.backends.cudnn.records import (
    SM100_MAX_ELEMENTS, TOPK_MULTIPLE, CudnnStageRecord, round_up, sm90_workspace_shapes, sm100_workspace_shapes)
from dsa_aot.backends.cutedsl.runtime import CuteDslKernel, open_cute_library
from dsa_aot.runners import BwdKernel, FwdKernel, current_stream, pad_topk

if TYPE_CHECKING:
    from collections.abc import Callable

    from dsa_aot.artifact import ArtifactManifest
    from dsa_aot.specs.models import KernelSpec

_F32 = torch.float32


def _call(kernel: CuteDslKernel, names: list[str], tensors: dict[str, torch.Tensor | None], dev: torch.device,
          softmax_scale: float) -> None:
    kernel(*[tensors[n] for n in names], stream=current_stream(dev), softmax_scale=softmax_scale)


class CudnnSm90Bwd(BwdKernel):
    """The frontend's SM90 backward (preprocess, main, postprocess in one call)."""

    def __init__(self, kernel: CuteDslKernel, spec: KernelSpec, record: CudnnStageRecord) -> None:
        self.kernel, self.spec, self.record = kernel, spec, record
        self._names = kernel.tensor_names

    def __call__(self, q, kv, out, dout, lse, topk_idxs, topk_length, attn_sink, softmax_scale):
        s_q, heads, d_qk = q.shape
        s_kv, dev = kv.shape[0], q.device
        dq, dkv, d_sink = _gradients(q, kv)
        if s_q == 0 or s_kv == 0:
            return dq, dkv, d_sink
        stats, acc = sm90_workspace_shapes(s_q, s_kv, d_qk, heads)
        tensors = {"q": q.unsqueeze(0), "kv": kv[None, :, None], "out": out.unsqueeze(0), "dout": dout.unsqueeze(0),
                   "lse": lse.unsqueeze(0), "attn_sink": attn_sink, "topk_idxs": topk_idxs.unsqueeze(0),
                   "topk_length": None if topk_length is None else topk_length.unsqueeze(0),
                   "dq": dq.unsqueeze(0), "d_sink": d_sink, "dpsum": torch.empty(stats, dtype=_F32, device=dev),
                   "lse_log2": torch.empty(stats, dtype=_F32, device=dev),
                   "dkv_acc": torch.zeros(acc, dtype=_F32, device=dev), "dkv": dkv[None, :, None]}
        _call(self.kernel, self._names, tensors, dev, softmax_scale)
        return dq, dkv, d_sink


def _gradients(q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dkv, d_sink to be written by a backward (zeros where an empty side writes nothing)."""
    dq = torch.zeros_like(q) if kv.shape[0] == 0 else torch.empty_like(q)
    dkv = torch.zeros_like(kv) if q.shape[0] == 0 else torch.empty_like(kv)
    return dq, dkv, torch.zeros((q.shape[1],), dtype=_F32, device=q.device)


def _check_spans(name: str, q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor) -> None:
    s_q, heads, d_qk = q.shape
    if max(s_q * heads * d_qk, kv.numel(), topk_idxs.numel()) > SM100_MAX_ELEMENTS:
        raise ValueError(f"{name}: tensors above {SM100_MAX_ELEMENTS} elements need the frontend's wide-"
                         "addressing variant, which is not built; split the batch")


class CudnnSm100Bwd(BwdKernel):
    """The frontend's SM100 backward variant (it launches its own stages)."""

    def __init__(self, kernel: CuteDslKernel, spec: KernelSpec, record: CudnnStageRecord) -> None:
        self.kernel, self.spec, self.record = kernel, spec, record
        self._names = kernel.tensor_names
        self._flat = record.variant == "h128_d576_2cta_m64"  # its workspaces are flat vectors

    def __call__(self, q, kv, out, dout, lse, topk_idxs, topk_length, attn_sink, softmax_scale):
        s_q, heads, d_qk = q.shape
        s_kv, dev = kv.shape[0], q.device
        dq, dkv, d_sink = _gradients(q, kv)
        if s_q == 0 or s_kv == 0:
            return dq, dkv, d_sink
        _check_spans(self.spec.id, q, kv, topk_idxs)
        shapes = sm100_workspace_shapes(s_q, s_kv, d_qk, heads)
        ws_lse, ws_dkv = (torch.empty((torch.Size(s).numel(),) if self._flat else s, dtype=_F32, device=dev)
                          for s in shapes)
        tensors = {"q": q, "kv": kv, "out": out, "dout": dout, "lse": lse, "attn_sink": attn_sink,
                   "topk_idxs": topk_idxs, "topk_length": topk_length, "dq": dq, "dkv": dkv, "d_sink": d_sink,
                   "ws_lse": ws_lse, "ws_dkv": ws_dkv}
        _call(self.kernel, self._names, tensors, dev, softmax_scale)
        return dq, dkv, d_sink


class CudnnSm100Fwd(FwdKernel):
    """The frontend's SM100 forward; ``topk_idxs`` is padded with -1 to a multiple of 64."""

    def __init__(self, kernel: CuteDslKernel, spec: KernelSpec, record: CudnnStageRecord) -> None:
        self.kernel, self.spec, self.record = kernel, spec, record
        self._names = kernel.tensor_names

    def __call__(self, q, kv, topk_idxs, topk_length, attn_sink, softmax_scale):
        s_q, heads, _ = q.shape
        dev = q.device
        out = torch.empty((s_q, heads, 512), dtype=torch.bfloat16, device=dev)
        lse = torch.empty((s_q, heads), dtype=_F32, device=dev)
        k = topk_idxs.shape[1]
        if s_q == 0 or k == 0 or kv.shape[0] == 0:
            return out.zero_(), lse.fill_(float("inf"))
        _check_spans(self.spec.id, q, kv, topk_idxs)
        topk_idxs, topk_length = pad_topk(topk_idxs, topk_length, round_up(k, TOPK_MULTIPLE))
        if topk_idxs.data_ptr() % 32:  # 32-byte aligned rows (the head128 kernel's 256-bit loads)
            topk_idxs = topk_idxs.clone()
        tensors = {"q": q, "kv": kv, "topk_idxs": topk_idxs, "out": out, "lse": lse, "attn_sink": attn_sink,
                   "max_logits": torch.empty((s_q, heads), dtype=_F32, device=dev), "topk_length": topk_length}
        _call(self.kernel, self._names, tensors, dev, softmax_scale)
        return out, lse


_RUNNERS = {"sm90": CudnnSm90Bwd, "sm100_fwd": CudnnSm100Fwd}


def load(manifest: ArtifactManifest, read: Callable[[str], bytes], device_index: int) -> Any:
    """Open the spec's one library from its verified bytes (ctypes only) and prepare it on
    ``device_index`` (a CUDA problem surfaces here, as a miss)."""
    from dsa_aot.backends.base import BuildError

    (stage,) = manifest.stages
    if stage.format != "cutedsl_so":
        raise BuildError(f"{manifest.spec.id}: stage {stage.name} is {stage.format}, not a CuTe DSL library")
    record = CudnnStageRecord.model_validate(stage.record)
    if record.export.kernel != stage.name or record.topk != manifest.spec.topk:
        raise BuildError(f"{manifest.spec.id}: stage {stage.name} holds a record of {record.export.kernel} "
                         f"(topk {record.topk})")
    kernel = open_cute_library(record.export, read(stage.file))
    kernel.prepare(device_index)
    return _RUNNERS.get(record.variant, CudnnSm100Bwd)(kernel, manifest.spec, record)
