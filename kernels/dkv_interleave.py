"""Column order of the CuTe DSL backward's fp32 ``dkv_acc`` accumulator (no ``cutlass`` import).

The main kernel adds dKV into ``dkv_acc`` with 16-byte atomics whose columns are interleaved
within each aligned group of 32: column ``8 j + 2 q + e`` (MMA 8-column block ``j`` of the group,
quad lane ``q``, value ``e`` of a pair) is stored at ``16 (j // 2) + 4 q + 2 (j % 2) + e``. The
four values a lane holds for one row in two neighbouring blocks are then 16 contiguous bytes,
and the 8 lanes of a quad pair cover a whole 128-byte line: one L2 request per row and atomic
instead of four. The postprocess reads the natural order back.

The deterministic mode's stored bf16 dKV rows use the same column order (the postprocess
reads it back).
"""

from __future__ import annotations

#: Columns of one interleave group (D_qk must be a multiple of it).
DKV_GROUP = 32


def dkv_acc_column(col):
    """Where natural column ``col`` of dKV sits in a ``dkv_acc`` row (Python ``int`` or DSL
    ``Int32``: bit operations only)."""
    return ((col >> 5) << 5) | (((col >> 4) & 1) << 4) | (((col >> 1) & 3) << 2) \
        | (((col >> 3) & 1) << 1) | (col & 1)


def natural_order(width: int) -> list[int]:
    """For each natural column ``c < width``, its index in a ``dkv_acc`` row: ``acc[..., order]``
    is dKV in natural order (``width`` a multiple of :data:`DKV_GROUP`)."""
    if width % DKV_GROUP:
        raise ValueError(f"width={width}: must be a multiple of {DKV_GROUP}")
    return [dkv_acc_column(c) for c in range(width)]
