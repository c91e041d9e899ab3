"""Records and shared facts of the cudnn backend (JSON only; imports neither ``cutlass``, nor
``cudnn``, nor ``torch``): what each spec builds, the stage record, and the workspace sizes the
run time allocates for the frontend's kernels."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dsa_aot.backends.cutedsl.records import CuteExportRecord

D_V = 512
SUPPORTED_D_QK = (512, 576)
SUPPORTED_HEADS = (16, 32, 64, 128)
#: Top-k buckets must be multiples of this (the frontend's sparse block).
TOPK_MULTIPLE = 64
#: (heads, D_qk) pairs the frontend's SM100 forward has kernels for (head64, head128 small top-k).
SM100_FWD_SHAPES = ((64, 512), (64, 576), (128, 512))
#: SM90 backward workspaces: rows of ``dpsum`` / ``lse_log2`` and of ``dkv_acc`` are rounded up
#: to this, ``dkv_acc`` columns to :data:`SM90_DKV_COLS_MULTIPLE`.
SM90_ROWS_MULTIPLE = 64
SM90_DKV_COLS_MULTIPLE = 32
#: SM100 backward workspaces: rows and columns rounded up to this.
SM100_ROWS_MULTIPLE = 8
#: The frontend's SM100 two-CTA kernels take only these top-k widths (others use generic_m64).
SM100_TWO_CTA_TOPK = (128, 512, 1024, 1152, 2048)
#: A compact SM100 plan addresses every tensor with 32-bit offsets (the frontend switches to its
#: wide-addressing variant above this many elements; that variant is not built).
SM100_MAX_ELEMENTS = 1 << 31

Variant = Literal["sm90", "generic_m64", "h16_m128", "h32_m64", "h128_2cta_m64", "h128_d576_2cta_m64", "sm100_fwd"]


class CudnnBuildError(RuntimeError):
    """A cudnn build step failed; the message says which and why."""


def check_bwd_params(d_qk: int, heads: int, layout: str, topk: int | None) -> None:
    """Raise ``ValueError`` for a backward shape the frontend's kernels are not built for here."""
    if d_qk not in SUPPORTED_D_QK or heads not in SUPPORTED_HEADS or layout not in ("compact", "noncompact"):
        raise ValueError(f"no cudnn backward for D{d_qk} H{heads} {layout}")
    if topk is None or topk <= 0 or topk % TOPK_MULTIPLE:
        raise ValueError(f"cudnn backward buckets are positive multiples of {TOPK_MULTIPLE}, not topk={topk}")


def check_fwd_params(d_qk: int, heads: int, layout: str) -> None:
    """Raise ``ValueError`` for a forward shape the frontend has no kernel for."""
    if (heads, d_qk) not in SM100_FWD_SHAPES or layout not in ("compact", "noncompact"):
        shapes = ", ".join(f"H{h} D{d}" for h, d in SM100_FWD_SHAPES)
        raise ValueError(f"the cuDNN frontend's forward has kernels for {shapes} only, not H{heads} D{d_qk}")


def sm100_bwd_variant(d_qk: int, heads: int, topk: int) -> Variant:
    """The frontend's SM100 backward variant for a B200, BF16, contiguous, non-deterministic plan
    (the build checks that the installed frontend selects the same)."""
    if heads == 128 and topk in SM100_TWO_CTA_TOPK:
        return "h128_2cta_m64" if d_qk == 512 else "h128_d576_2cta_m64"
    if d_qk == 576 and heads == 16:
        return "h16_m128"
    if d_qk == 576 and heads == 32:
        return "h32_m64"
    return "generic_m64"


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def sm90_workspace_shapes(s_q: int, s_kv: int, d_qk: int, heads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """fp32 shapes of ``dpsum`` / ``lse_log2`` and of ``dkv_acc`` for one SM90 launch."""
    rows = round_up(s_q, SM90_ROWS_MULTIPLE)
    acc = round_up(s_kv, SM90_ROWS_MULTIPLE) * round_up(d_qk, SM90_DKV_COLS_MULTIPLE)
    return (1, rows, heads), (1, 1, acc)


def sm100_workspace_shapes(s_q: int, s_kv: int, d_qk: int, heads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """fp32 shapes of the SM100 ``ws_lse`` (sum(O*dO) and scaled LSE per head and row) and
    ``ws_dkv`` (the dKV accumulator, cleared by the kernel)."""
    return ((1, heads, round_up(s_q, SM100_ROWS_MULTIPLE), 2),
            (1, 1, round_up(s_kv, SM100_ROWS_MULTIPLE), round_up(d_qk, SM100_ROWS_MULTIPLE)))


class CudnnStageRecord(BaseModel):
    """One stage of a cudnn artifact: the exported, linked library (its CuTe DSL record) and what
    the run time needs beyond it to call the frontend's kernel."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal[1] = 1
    export: CuteExportRecord
    variant: Variant = Field(description="the frontend's kernel: sm90 (its preprocess, main and postprocess), "
                             "an SM100 backward variant, or its SM100 forward")
    topk: int | None = Field(description="the top-k width the kernel is compiled for (None: any multiple of 64)")
    frontend_version: str = Field(description="nvidia-cudnn-frontend that provided the kernel classes")
