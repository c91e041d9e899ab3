"""The public API: sparse MLA forward and backward, and a differentiable op.

Each call validates its inputs, then looks its kernel up in a per-process dict keyed by
(op, device, D_qk, heads, layout); only the first call of a key looks a kernel up: first by the
serving path (:mod:`dsa_aot.serving`: a prebuilt hit in a process without compilers, read
without pydantic), else by the loader, imported then with pydantic and the record models (or
ahead by ``dsa_aot.preload()``). This module imports the serving path (a few small modules,
no pydantic), not the loader.

The ops ``torch.ops.dsa_aot.sparse_mla_fwd`` / ``sparse_mla_bwd`` are defined here with
``torch.library.Library``: a schema, one kernel for every device, a shape-only ``Meta`` kernel
(what fake tensors under ``torch.compile`` run) and an autograd formula. Unlike
``torch.library.custom_op`` this reads no source code and scans no module list at import.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from dsa_aot import serving as _serving
from dsa_aot import settings as _settings
from dsa_aot.errors import UnsupportedDeviceError
from dsa_aot.specs.shapes import arch_of_capability
from dsa_aot.validate import check_bwd, check_fwd

_KERNELS: dict[tuple, object] = {}
_SINKS: dict[tuple, torch.Tensor] = {}
_LOCK = threading.Lock()


def _clear() -> None:
    _KERNELS.clear()


_settings.on_change(_clear)


_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _elsewhere(device: torch.device) -> bool:
    """True for a CUDA device that is not the calling thread's current one (cheap: a CUDA
    tensor exists, so CUDA is initialized and the raw query needs no lazy-init check)."""
    return device.type == "cuda" and device.index is not None and device.index != _current_device()


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` the current CUDA device for a load or launch, restoring the caller's after.

    The launch paths use the calling thread's current device: the TileLang cubins launch as
    ``CUkernel`` handles in the current context, the CuTe DSL libraries' own CUDA runtime picks
    the module loaded for its current device. Tensors on ``cuda:1`` while ``cuda:0`` is current
    must bind ``cuda:1`` first. A no-op (no CUDA call) for non-CUDA tensors and when the device
    is already current, which is every call of a single-GPU process.
    """
    return torch.cuda.device(device.index) if _elsewhere(device) else contextlib.nullcontext()


def _kernel(op: str, device: torch.device, d_qk: int, heads: int, layout: str,
            deterministic: bool = False):
    key = (op, device.index, d_qk, heads, layout, deterministic)
    kernel = _KERNELS.get(key)
    if kernel is not None:
        return kernel
    with _LOCK:
        kernel = _KERNELS.get(key)
        if kernel is None:
            if device.type != "cuda":
                from dsa_aot.backends import ReferenceBackend

                kernel = ReferenceBackend.kernel(op)
            else:
                index = device.index if device.index is not None else torch.cuda.current_device()
                major, minor = torch.cuda.get_device_capability(index)
                arch = arch_of_capability(major, minor)
                if arch is None:
                    raise UnsupportedDeviceError(
                        f"GPU {torch.cuda.get_device_name(index)} is sm_{major}{minor}; dsa-aot kernels are built "
                        "for sm_90a (Hopper) and sm_100a (Blackwell B200/GB200)")
                with on_device(device):  # a library's load must not move the caller's current device
                    kernel = _resolve(op, arch, d_qk, heads, layout, index, deterministic)
            _KERNELS[key] = kernel
    return kernel


def _resolve(op: str, arch: str, d_qk: int, heads: int, layout: str, index: int, deterministic: bool):
    """The serving path's prebuilt hit (no pydantic), else the loader's answer."""
    hit = _serving.serve(op, arch, d_qk, heads, layout, index, deterministic)
    if hit is not None:
        return hit[0]
    from dsa_aot.loader import get_loader

    return get_loader().resolve(op, arch, d_qk, heads, layout, index, deterministic=deterministic)[0]


def _sink(heads: int, device: torch.device) -> torch.Tensor:
    """A cached all -inf sink (no sink) for ``heads`` on ``device``."""
    key = (device, heads)
    sink = _SINKS.get(key)
    if sink is None:
        if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            # a copy, not a fill kernel: the process's first call need not load torch's fill module
            sink = torch.full((heads,), float("-inf"), dtype=torch.float32).to(device)
        else:
            sink = torch.full((heads,), float("-inf"), dtype=torch.float32, device=device)
        _SINKS[key] = sink
    return sink


def _deterministic(flag: bool | None) -> bool:
    """A call's ``deterministic`` argument, None meaning the process default."""
    if flag is None:
        return _settings.get().deterministic
    if not isinstance(flag, bool):
        from dsa_aot.validate import InputError

        raise InputError(f"deterministic={flag!r}: pass True, False or None (None follows DSA_AOT_DETERMINISTIC)")
    return flag


def _launch(kernel, dev: torch.device, heads: int, attn_sink: torch.Tensor | None, scale: float, *tensors):
    """``kernel(*tensors, sink, scale)`` on ``dev`` (bound first when it is not current)."""
    if _elsewhere(dev):
        with torch.cuda.device(dev.index):  # inside, dev is current: the plain call below
            return _launch(kernel, dev, heads, attn_sink, scale, *tensors)
    return kernel(*tensors, attn_sink if attn_sink is not None else _sink(heads, dev), scale)


def sparse_mla_fwd(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor, *,
                   topk_length: torch.Tensor | None = None, attn_sink: torch.Tensor | None = None,
                   softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA forward.

    q [S_q, H, D_qk] bf16, kv [S_kv, D_qk] bf16, topk_idxs [S_q, K] int32 (global rows of kv;
    out-of-range entries such as -1 are padding), topk_length [S_q] int32 (compact layout:
    only the first clamp(len, 0, K) slots count), attn_sink [H] fp32.
    Returns out [S_q, H, 512] bf16 and lse [S_q, H] fp32 (natural log, sink excluded,
    +inf for rows with no valid slot).
    """
    layout, scale = check_fwd(q, kv, topk_idxs, topk_length, attn_sink, softmax_scale)
    dev = q.device
    _, heads, d_qk = q.shape
    kernel = _kernel("fwd", dev, d_qk, heads, layout)
    return _launch(kernel, dev, heads, attn_sink, scale, q, kv, topk_idxs, topk_length)


def sparse_mla_bwd(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                   lse: torch.Tensor, topk_idxs: torch.Tensor, *, topk_length: torch.Tensor | None = None,
                   attn_sink: torch.Tensor | None = None, softmax_scale: float | None = None,
                   deterministic: bool | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sparse MLA backward from the forward's ``out`` and ``lse``.

    Returns dq [S_q, H, D_qk] bf16, dkv [S_kv, D_qk] bf16 and d_sink [H] fp32 (None when
    ``attn_sink`` is None). ``deterministic=True`` makes every bit of the three reproducible
    for the same inputs on the same GPU model (each slot's dkv row stored, then every KV row's
    summed in a fixed order; slower, and a workspace of up to ``DSA_AOT_DETERMINISTIC_WORKSPACE``
    bytes); None follows ``DSA_AOT_DETERMINISTIC``.
    """
    layout, scale = check_bwd(q, kv, out, dout, lse, topk_idxs, topk_length, attn_sink, softmax_scale)
    dev = q.device
    _, heads, d_qk = q.shape
    kernel = _kernel("bwd", dev, d_qk, heads, layout, _deterministic(deterministic))
    dq, dkv, d_sink = _launch(kernel, dev, heads, attn_sink, scale, q, kv, out, dout, lse, topk_idxs, topk_length)
    return dq, dkv, (d_sink if attn_sink is not None else None)


# -- torch.library ops (torch.compile / CUDA graphs) and autograd ------------------------------
# ``deterministic`` rides on the forward op too: it is the backward's, saved for autograd.
_FWD_SCHEMA = ("sparse_mla_fwd(Tensor q, Tensor kv, Tensor topk_idxs, Tensor? topk_length, Tensor? attn_sink, "
               "float? softmax_scale, bool deterministic=False) -> (Tensor, Tensor)")
_BWD_SCHEMA = ("sparse_mla_bwd(Tensor q, Tensor kv, Tensor out, Tensor dout, Tensor lse, Tensor topk_idxs, "
               "Tensor? topk_length, Tensor? attn_sink, float? softmax_scale, bool deterministic=False) "
               "-> (Tensor, Tensor, Tensor)")


def _fwd_impl(q, kv, topk_idxs, topk_length, attn_sink, softmax_scale, deterministic=False):
    return sparse_mla_fwd(q, kv, topk_idxs, topk_length=topk_length, attn_sink=attn_sink,
                          softmax_scale=softmax_scale)


def _fwd_meta(q, kv, topk_idxs, topk_length, attn_sink, softmax_scale, deterministic=False):
    s_q, heads, _ = q.shape
    return q.new_empty((s_q, heads, 512)), q.new_empty((s_q, heads), dtype=torch.float32)


def _bwd_impl(q, kv, out, dout, lse, topk_idxs, topk_length, attn_sink, softmax_scale, deterministic=False):
    dq, dkv, d_sink = sparse_mla_bwd(q, kv, out, dout, lse, topk_idxs, topk_length=topk_length,
                                     attn_sink=attn_sink, softmax_scale=softmax_scale,
                                     deterministic=deterministic)
    if d_sink is None:
        d_sink = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)
    return dq, dkv, d_sink


def _bwd_meta(q, kv, out, dout, lse, topk_idxs, topk_length, attn_sink, softmax_scale, deterministic=False):
    return (torch.empty_like(q), torch.empty_like(kv),
            q.new_empty((q.shape[1],), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, kv, topk_idxs, topk_length, attn_sink, softmax_scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, topk_idxs, topk_length, attn_sink, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, kv, topk_idxs, topk_length, attn_sink, out, lse = ctx.saved_tensors
    dq, dkv, d_sink = _bwd_op(q, kv, out, dout.contiguous(), lse, topk_idxs, topk_length, attn_sink,
                              ctx.softmax_scale, ctx.deterministic)
    return dq, dkv, None, None, (d_sink if attn_sink is not None else None), None, None


def _no_double_backward(ctx, *grads):
    raise RuntimeError("dsa_aot.sparse_mla has no double backward (sparse_mla_bwd is not differentiable)")


_LIB = torch.library.Library("dsa_aot", "FRAGMENT")


def _define(schema: str, impl, meta) -> torch._ops.OpOverload:
    """Define ``dsa_aot::<name>``: one kernel for every device, ``meta`` for shapes only."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    _LIB.impl(name, meta, "Meta")
    return getattr(torch.ops.dsa_aot, name).default


_fwd_op = _define(_FWD_SCHEMA, _fwd_impl, _fwd_meta)
_bwd_op = _define(_BWD_SCHEMA, _bwd_impl, _bwd_meta)
torch.library.register_autograd("dsa_aot::sparse_mla_fwd", _backward, setup_context=_setup_context, lib=_LIB)
torch.library.register_autograd("dsa_aot::sparse_mla_bwd", _no_double_backward, lib=_LIB)


def sparse_mla(q: torch.Tensor, kv: torch.Tensor, topk_idxs: torch.Tensor, *,
               topk_length: torch.Tensor | None = None, attn_sink: torch.Tensor | None = None,
               softmax_scale: float | None = None, deterministic: bool | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable sparse MLA: (out, lse); gradients flow to q, kv and attn_sink (lse is not
    differentiable). ``deterministic`` is the backward's (see :func:`sparse_mla_bwd`; None
    follows ``DSA_AOT_DETERMINISTIC`` when this is called). Works under torch.compile and CUDA
    graph capture once kernels are loaded."""
    return _fwd_op(q, kv, topk_idxs, topk_length, attn_sink, softmax_scale, _deterministic(deterministic))
