"""Compile functions of the cudnn backend: the cuDNN frontend's DSA kernel classes, compiled
ahead of time over dynamic-shape fake tensors.

Each ``compile_*(arch, **params)`` returns ``(compiled, fake_arguments)`` like the CuTe DSL
backend's kernel modules, so :mod:`dsa_aot.backends.cutedsl.worker` runs them unchanged
(``CUTE_DSL_ARCH`` set before ``cutlass`` is imported). The frontend's classes are instantiated
and called, never copied: a small ``@cute.jit`` adapter per op gives the exported C function
our argument names, builds what the frontend passes as Python values (its problem-shape tuple,
``seqlen_k``, the byte views of its workspaces) from the tensors, and drops the arguments the
frontend passes as ``None``. One exported function runs the whole op: on sm_90a the frontend's
preprocess, main and postprocess kernels in that order, on sm_100a its backward (which launches
its own stages) or its forward.

Nothing here queries a device: the target arch is the ``arch`` argument, and the frontend's
SM100 variant choice is made for the B200 capability (10, 0) of ``sm_100a``. Where the frontend
would read the SM count (the H128 D576 two-CTA backward's short-batch split), the artifact is
built for ``split_count = 1``, the frontend's own choice whenever ``S_q`` fills the GPU.

This module imports ``cutlass`` and ``cudnn``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint8

from dsa_aot.backends.cudnn.records import (
    D_V, SM90_DKV_COLS_MULTIPLE, SM90_ROWS_MULTIPLE, check_bwd_params, check_fwd_params, sm100_bwd_variant,
    sm100_workspace_shapes)

#: The compute capability the frontend's variant selection is asked about, per arch.
CAPABILITY = {"sm_90a": (9, 0), "sm_100a": (10, 0)}


def _fake(dtype: type, shape: tuple, div: int, align: int = 16) -> object:
    """Row-major fake tensor: run-time strides (multiples of ``div`` elements), last dim contiguous."""
    stride = tuple(cute.sym_int64(divisibility=div) for _ in shape[:-1]) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=align)


def _compact(dtype: type, shape: tuple, align: int = 16) -> object:
    """Compact row-major fake tensor (strides follow the shape), as the frontend's SM100 plans use."""
    return cute.runtime.make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
                                                 assumed_align=align)


def _present(fakes: dict[str, object]) -> dict[str, object]:
    """The arguments that reach the exported C function (``None`` ones are compile-time absent)."""
    return {name: value for name, value in fakes.items() if value is not None}


# --- sm_90a backward ------------------------------------------------------------------------

class _Sm90Bwd:
    """The frontend's SM90 preprocess, main and postprocess kernels behind one entry point."""

    def __init__(self, pre: object, main: object, post: object) -> None:
        self.pre, self.main, self.post = pre, main, post

    @cute.jit
    def __call__(self, q: cute.Tensor, kv: cute.Tensor, out: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor,
                 attn_sink: cute.Tensor, topk_idxs: cute.Tensor, topk_length: cute.Tensor, dq: cute.Tensor,
                 d_sink: cute.Tensor, dpsum: cute.Tensor, lse_log2: cute.Tensor, dkv_acc: cute.Tensor,
                 dkv: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream) -> None:
        self.pre(out, dout, dpsum, lse, lse_log2, attn_sink, d_sink, None, None, None, stream)
        self.main(q, kv, dout, lse_log2, dpsum, dq, dkv_acc, topk_idxs, topk_length, softmax_scale, stream)
        self.post(dkv_acc, dkv, kv.shape[1], stream)


def _frontend_sm90_extents(iface: object, s_q: int, s_kv: int, d: int) -> tuple[int, ...] | None:
    """The rounded (S_q, S_kv, D) extents of the frontend's SM90 scratch: its helper (1.32 on),
    else the rounding its interface function spells inline (1.28-1.31), read from its source."""
    helper = getattr(iface, "_workspace_extents", None)
    if helper is not None:
        return tuple(helper(s_q, s_kv, d))
    import inspect
    import re

    source = inspect.getsource(iface.flash_attn_bwd_sm90)
    rows = re.search(r"m_block_size = (\d+)\n", source)
    cols = re.search(r"n_block_size = (\d+)\n", source)
    dims = re.search(r"head_dim_rounded = \(head_dim \+ (\d+) - 1\) // \1 \* \1", source)
    if not (rows and cols and dims):
        return None
    return tuple(-(-v // int(m.group(1))) * int(m.group(1)) for v, m in ((s_q, rows), (s_kv, cols), (d, dims)))


def _check_sm90_workspace() -> None:
    """Our run-time workspace sizes must be the frontend's (a frontend upgrade that changes
    them fails the build instead of corrupting memory)."""
    from cudnn.deepseek_sparse_attention.sparse_attention_backward import _interface_sm90 as iface

    for s_q, s_kv, d in ((1, 1, 512), (63, 95, 576), (4096, 8193, 576)):
        want = (-(-s_q // SM90_ROWS_MULTIPLE) * SM90_ROWS_MULTIPLE, -(-s_kv // SM90_ROWS_MULTIPLE) * SM90_ROWS_MULTIPLE,
                -(-d // SM90_DKV_COLS_MULTIPLE) * SM90_DKV_COLS_MULTIPLE)
        theirs = _frontend_sm90_extents(iface, s_q, s_kv, d)
        if theirs is None:
            raise ValueError("this nvidia-cudnn-frontend's SM90 workspace rounding could not be read (no "
                             "_workspace_extents, no inline rounding in flash_attn_bwd_sm90); not built")
        if theirs != want:
            raise ValueError(f"the frontend's SM90 workspace extents changed: {theirs} "
                             f"for S_q={s_q}, S_kv={s_kv}, D={d}; expected {want}")


def sm90_bwd_arguments(d_qk: int, heads: int, layout: str, topk: int) -> dict[str, object]:
    """Fake arguments of :class:`_Sm90Bwd`, in call order. Tensors carry the frontend's batch=1
    views (``q`` as [1, S_q, H, D], ``kv`` as [1, S_kv, 1, D], ...); the workspaces are
    ``dpsum`` / ``lse_log2`` [1, S_q rounded up to 64, H] and ``dkv_acc`` [1, 1, n] fp32."""
    s_q, s_kv = cute.sym_int32(symbol="s_q"), cute.sym_int32(symbol="s_kv")
    rows = cute.sym_int32(symbol="s_q_rounded")
    return {
        "q": _fake(BFloat16, (1, s_q, heads, d_qk), 8),
        "kv": _fake(BFloat16, (1, s_kv, 1, d_qk), 8),
        "out": _fake(BFloat16, (1, s_q, heads, D_V), 8),
        "dout": _fake(BFloat16, (1, s_q, heads, D_V), 8),
        "lse": _fake(Float32, (1, s_q, heads), 1, align=4),
        "attn_sink": _fake(Float32, (heads,), 1, align=4),
        "topk_idxs": _fake(Int32, (1, s_q, topk), 4),
        "topk_length": _fake(Int32, (1, s_q), 1, align=4) if layout == "compact" else None,
        "dq": _fake(BFloat16, (1, s_q, heads, d_qk), 8),
        "d_sink": _fake(Float32, (heads,), 1, align=4),
        "dpsum": _fake(Float32, (1, rows, heads), 4),
        "lse_log2": _fake(Float32, (1, rows, heads), 4),
        "dkv_acc": _fake(Float32, (1, 1, cute.sym_int32(symbol="dkv_acc_size")), 4),
        "dkv": _fake(BFloat16, (1, s_kv, 1, d_qk), 8),
        "softmax_scale": Float32(1.0),
        "stream": cuda.CUstream(0),
    }


def compile_bwd_sm90(arch: str, d_qk: int, heads: int, layout: str, topk: int) -> tuple[object, dict[str, object]]:
    """``cute.compile`` the frontend's SM90 backward (its ``flash_attn_bwd_sm90`` configuration:
    64x64 tiles, 256 threads, one KV / PdS stage) for one (D, H, layout, top-k width)."""
    from cudnn.deepseek_sparse_attention.sparse_attention_backward.dsa_bwd_sm90 import (
        FlashAttentionDSABackwardSm90, _FlashAttentionDSABackwardPostprocessSm90,
        _FlashAttentionDSABackwardPreprocessSm90)

    if arch != "sm_90a":
        raise ValueError(f"the frontend's SM90 backward is built for sm_90a, not {arch}")
    check_bwd_params(d_qk, heads, layout, topk)
    _check_sm90_workspace()
    tile, threads = 64, 256
    pre = _FlashAttentionDSABackwardPreprocessSm90(BFloat16, D_V, 90, tile, num_threads=threads)
    main = FlashAttentionDSABackwardSm90(BFloat16, d_qk, D_V, heads, tile_m=tile, tile_n=tile, KV_stage=1,
                                         PdS_stage=1, num_threads=threads, have_topk_length=layout == "compact",
                                         max_topk=topk)
    chunk = 64 if d_qk == 576 else min(128, d_qk)
    post = _FlashAttentionDSABackwardPostprocessSm90(BFloat16, hdim_chunk=chunk, tile_n=tile, head_dim=d_qk,
                                                     num_threads=chunk, N_hdim_chunks=d_qk // chunk)
    fakes = sm90_bwd_arguments(d_qk, heads, layout, topk)
    compiled = cute.compile(_Sm90Bwd(pre, main, post), *fakes.values(), options=f"--gpu-arch {arch}")
    return compiled, _present(fakes)


# --- sm_100a backward -----------------------------------------------------------------------

class _Sm100Bwd:
    """The frontend's SM100 backward behind our argument names: the problem-shape tuple comes
    from the tensors and the fp32 workspaces are handed over as the byte tensors it expects."""

    def __init__(self, kernel: object, d_qk: int, heads: int, two_cta_d576: bool) -> None:
        self.kernel, self.d_qk, self.heads, self.two_cta_d576 = kernel, d_qk, heads, two_cta_d576

    @cute.jit
    def __call__(self, q: cute.Tensor, kv: cute.Tensor, out: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor,
                 attn_sink: cute.Tensor, topk_idxs: cute.Tensor, topk_length: cute.Tensor, dq: cute.Tensor,
                 dkv: cute.Tensor, d_sink: cute.Tensor, ws_lse: cute.Tensor, ws_dkv: cute.Tensor,
                 softmax_scale: Float32, stream: cuda.CUstream) -> None:
        problem = (q.shape[0], kv.shape[0], Int32(self.d_qk), (Int32(self.heads), Int32(1)))
        ws_lse_bytes = cute.recast_tensor(ws_lse, Uint8)
        ws_dkv_bytes = cute.recast_tensor(ws_dkv, Uint8)
        if cutlass.const_expr(self.two_cta_d576):
            self.kernel(problem, q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, dq, dkv, d_sink,
                        ws_lse_bytes, ws_dkv_bytes, softmax_scale, Int32(1), stream, False)
        else:
            self.kernel(problem, q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, dq, dkv, d_sink,
                        ws_lse_bytes, ws_dkv_bytes, softmax_scale, stream)


def _check_sm100_workspace(kernel_cls: type) -> None:
    """Our run-time workspace shapes must be the frontend's (see :func:`_check_sm90_workspace`)."""
    for s_q, s_kv, d, h in ((1, 1, 512, 16), (63, 95, 576, 128), (4097, 8193, 576, 64)):
        theirs = (tuple(kernel_cls._get_workspace_size_LSE_OdO(s_q, d, h, 1, Float32)),
                  tuple(kernel_cls._get_workspace_size_dKV(s_kv, d, 1, Float32)))
        lse, dkv = sm100_workspace_shapes(s_q, s_kv, d, h)
        ours = ((*lse[:3], lse[3] * 4), (*dkv[:3], dkv[3] * 4))  # fp32 elements -> bytes
        if theirs != ours:
            raise ValueError(f"the frontend's SM100 workspace shapes changed: {theirs}, expected {ours}")


def sm100_bwd_arguments(d_qk: int, heads: int, layout: str, topk: int, flat_workspace: bool) -> dict[str, object]:
    """Fake arguments of :class:`_Sm100Bwd`, in call order: the frontend plan's compact tensors;
    ``ws_lse`` [1, H, S_q rounded up to 8, 2] and ``ws_dkv`` [1, 1, S_kv rounded up to 8, D]
    fp32 (flat for the two-CTA D576 kernel, whose workspaces are byte vectors)."""
    s_q, s_kv = cute.sym_int(symbol="s_q"), cute.sym_int(symbol="s_kv")
    if flat_workspace:
        ws_lse = _compact(Float32, (cute.sym_int64(symbol="ws_lse_size"),))
        ws_dkv = _compact(Float32, (cute.sym_int64(symbol="ws_dkv_size"),))
    else:
        ws_lse = _compact(Float32, (1, heads, cute.sym_int(symbol="s_q_rounded"), 2))
        ws_dkv = _compact(Float32, (1, 1, cute.sym_int(symbol="s_kv_rounded"), d_qk))
    return {
        "q": _compact(BFloat16, (s_q, heads, d_qk)),
        "kv": _compact(BFloat16, (s_kv, d_qk)),
        "out": _compact(BFloat16, (s_q, heads, D_V)),
        "dout": _compact(BFloat16, (s_q, heads, D_V)),
        "lse": _compact(Float32, (s_q, heads), align=8),
        "attn_sink": _compact(Float32, (heads,)),
        "topk_idxs": _compact(Int32, (s_q, topk)),
        "topk_length": _compact(Int32, (s_q,), align=4) if layout == "compact" else None,
        "dq": _compact(BFloat16, (s_q, heads, d_qk)),
        "dkv": _compact(BFloat16, (s_kv, d_qk)),
        "d_sink": _compact(Float32, (heads,)),
        "ws_lse": ws_lse,
        "ws_dkv": ws_dkv,
        "softmax_scale": Float32(1.0),
        "stream": cuda.CUstream(0),
    }


def compile_bwd_sm100(arch: str, d_qk: int, heads: int, layout: str, topk: int) -> tuple[object, dict[str, object]]:
    """``cute.compile`` the frontend's SM100 backward variant that its plan selects for a B200
    (``_select_sm100_backend`` at capability (10, 0), non-deterministic, contiguous inputs)."""
    import torch
    from cudnn.deepseek_sparse_attention.sparse_attention_backward import _interface_sm100 as iface

    if arch != "sm_100a":
        raise ValueError(f"the frontend's SM100 backward is built for sm_100a, not {arch}")
    check_bwd_params(d_qk, heads, layout, topk)
    backend, block_tile = iface._select_sm100_backend(heads, d_qk, head_dim_v=D_V, dtype=torch.bfloat16, max_topk=topk,
                                                      device_capability=CAPABILITY[arch])
    if backend != sm100_bwd_variant(d_qk, heads, topk):
        raise ValueError(f"the frontend selects {backend} for H{heads} D{d_qk} K{topk}; this dsa-aot expects "
                         f"{sm100_bwd_variant(d_qk, heads, topk)}")
    cls = iface._get_sm100_kernel_class(backend)
    _check_sm100_workspace(iface.FlashAttentionDSABackwardSm100)
    two_cta_d576 = backend == "h128_d576_2cta_m64"
    kwargs = {"single_query": False, "num_heads": heads} if two_cta_d576 else {}
    kernel = cls(element_dtype=BFloat16, head_dim=d_qk, head_dim_v=D_V, block_tile=block_tile, max_topk=topk,
                 **kwargs)
    fakes = sm100_bwd_arguments(d_qk, heads, layout, topk, flat_workspace=two_cta_d576)
    compiled = cute.compile(_Sm100Bwd(kernel, d_qk, heads, two_cta_d576), *fakes.values(),
                            options=f"--gpu-arch {arch}")
    return compiled, _present(fakes)


# --- sm_100a forward ------------------------------------------------------------------------

class _Sm100Fwd:
    """The frontend's SM100 sparse-prefill forward behind our argument names (no indexer LSE)."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel

    @cute.jit
    def __call__(self, q: cute.Tensor, kv: cute.Tensor, topk_idxs: cute.Tensor, out: cute.Tensor,
                 max_logits: cute.Tensor, lse: cute.Tensor, attn_sink: cute.Tensor, topk_length: cute.Tensor,
                 softmax_scale: Float32, stream: cuda.CUstream) -> None:
        self.kernel(q, kv, topk_idxs, out, max_logits, lse, None, attn_sink, topk_length, softmax_scale, stream)


def sm100_fwd_arguments(d_qk: int, heads: int, layout: str) -> dict[str, object]:
    """Fake arguments of :class:`_Sm100Fwd`, in call order. ``topk_idxs`` is [S_q, K] with K a
    run-time multiple of 64 (the run time pads with -1) and 32-byte aligned rows."""
    s_q, s_kv = cute.sym_int32(symbol="s_q"), cute.sym_int32(symbol="s_kv")
    return {
        "q": _fake(BFloat16, (s_q, heads, d_qk), d_qk),
        "kv": _fake(BFloat16, (s_kv, d_qk), d_qk),
        "topk_idxs": _fake(Int32, (s_q, cute.sym_int32(divisibility=64, symbol="topk")), 64, align=32),
        "out": _fake(BFloat16, (s_q, heads, D_V), D_V),
        "max_logits": _fake(Float32, (s_q, heads), 1, align=4),
        "lse": _fake(Float32, (s_q, heads), 1, align=4),
        "attn_sink": _fake(Float32, (heads,), 1, align=4),
        "topk_length": _fake(Int32, (s_q,), 1, align=4) if layout == "compact" else None,
        "softmax_scale": Float32(1.0),
        "stream": cuda.CUstream(0),
    }


def compile_fwd_sm100(arch: str, d_qk: int, heads: int, layout: str) -> tuple[object, dict[str, object]]:
    """``cute.compile`` the frontend's SM100 forward (head64 for H64, small-top-k head128 for
    H128 D512) as its interface does: no indexer top-k, ``--opt-level 2``."""
    from cudnn.deepseek_sparse_attention.sparse_attention_forward import _interface_sm100 as iface

    if arch != "sm_100a":
        raise ValueError(f"the frontend's forward is built for sm_100a, not {arch}")
    check_fwd_params(d_qk, heads, layout)
    kernel = iface._make_kernel(iface._kernel_variant(heads, d_qk), d_qk, 0)
    fakes = sm100_fwd_arguments(d_qk, heads, layout)
    compiled = cute.compile(_Sm100Fwd(kernel), *fakes.values(), options=f"--gpu-arch {arch} --opt-level 2")
    return compiled, _present(fakes)


__all__ = ["CAPABILITY", "compile_bwd_sm90", "compile_bwd_sm100", "compile_fwd_sm100", "sm90_bwd_arguments",
           "sm100_bwd_arguments", "sm100_fwd_arguments"]
