"""Input checks for the public API: clear errors naming the argument, the value and the fix."""

from __future__ import annotations

import math

import torch

from dsa_aot.specs.shapes import D_V, SUPPORTED_D_QK, SUPPORTED_HEADS


_INT32_LIMIT = 2**31
_D_QK = frozenset(SUPPORTED_D_QK)
_HEADS = frozenset(SUPPORTED_HEADS)


class InputError(ValueError):
    """An argument of a dsa_aot call is unusable; the message says which and how to fix it."""


def _tensor(name: str, t: object, ndim: int, dtype: torch.dtype, q: torch.Tensor | None) -> torch.Tensor:
    """Check one tensor argument; ``q`` (if given) fixes the device. Cheap when it passes."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise InputError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise InputError(f"{name} must be {dtype}, got {t.dtype}; convert with .to({dtype})")
    if q is not None and (t.get_device() != q.get_device() or (not t.is_cuda and t.device != q.device)):
        raise InputError(f"{name} is on {t.device} but q is on {q.device}; move it with .to(q.device)")
    if not t.is_contiguous():
        raise InputError(f"{name} must be contiguous (strides {t.stride()}); call .contiguous()")
    return t


def check_fwd(q, kv, topk_idxs, topk_length, attn_sink, softmax_scale) -> tuple[str, float]:
    """Validate forward inputs; returns (layout, softmax_scale)."""
    _tensor("q", q, 3, torch.bfloat16, None)
    dev = q
    s_q, heads, d_qk = q.shape
    if d_qk not in _D_QK:
        raise InputError(f"q.shape[2] (D_qk) = {d_qk} is not supported; use one of {SUPPORTED_D_QK}")
    if heads not in _HEADS:
        raise InputError(f"q.shape[1] (heads) = {heads} is not supported; use one of {SUPPORTED_HEADS} "
                         "(pad the heads, or split them into supported groups)")
    _tensor("kv", kv, 2, torch.bfloat16, dev)
    if kv.shape[1] != d_qk:
        raise InputError(f"kv.shape[1] = {kv.shape[1]} must equal q.shape[2] = {d_qk}")
    if kv.shape[1] < D_V:
        raise InputError(f"kv.shape[1] = {kv.shape[1]} must be >= D_v = {D_V}")
    _tensor("topk_idxs", topk_idxs, 2, torch.int32, dev)
    if topk_idxs.shape[0] != s_q:
        raise InputError(f"topk_idxs.shape[0] = {topk_idxs.shape[0]} must equal S_q = q.shape[0] = {s_q}")
    if s_q >= _INT32_LIMIT or kv.shape[0] >= _INT32_LIMIT or topk_idxs.shape[1] >= _INT32_LIMIT:
        raise InputError("S_q, S_kv and top-k must each be < 2**31")
    layout = "noncompact"
    if topk_length is not None:
        _tensor("topk_length", topk_length, 1, torch.int32, dev)
        if topk_length.shape[0] != s_q:
            raise InputError(f"topk_length.shape[0] = {topk_length.shape[0]} must equal S_q = {s_q}")
        layout = "compact"
    if attn_sink is not None:
        _tensor("attn_sink", attn_sink, 1, torch.float32, dev)
        if attn_sink.shape[0] != heads:
            raise InputError(f"attn_sink.shape[0] = {attn_sink.shape[0]} must equal heads = {heads}")
    if softmax_scale is None:
        softmax_scale = d_qk ** -0.5
    else:
        try:
            softmax_scale = float(softmax_scale)
        except (TypeError, ValueError):
            raise InputError(f"softmax_scale must be a float, got {softmax_scale!r}") from None
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise InputError(f"softmax_scale = {softmax_scale} must be finite and > 0")
    return layout, softmax_scale


def check_bwd(q, kv, out, dout, lse, topk_idxs, topk_length, attn_sink, softmax_scale) -> tuple[str, float]:
    """Validate backward inputs; returns (layout, softmax_scale)."""
    layout, scale = check_fwd(q, kv, topk_idxs, topk_length, attn_sink, softmax_scale)
    s_q, heads, _ = q.shape
    for name, t in (("out", out), ("dout", dout)):
        _tensor(name, t, 3, torch.bfloat16, q)
        if tuple(t.shape) != (s_q, heads, D_V):
            raise InputError(f"{name}.shape = {tuple(t.shape)} must be (S_q, H, D_v) = {(s_q, heads, D_V)}")
    _tensor("lse", lse, 2, torch.float32, q)
    if tuple(lse.shape) != (s_q, heads):
        raise InputError(f"lse.shape = {tuple(lse.shape)} must be (S_q, H) = {(s_q, heads)}; "
                         "pass the lse returned by sparse_mla_fwd")
    return layout, scale
