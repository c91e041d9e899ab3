"""Column order of the CuTe DSL backward's fp32 ``dkv_acc`` accumulator (no ``cutlass`` import).

The main kernel adds dKV into ``dkv_acc`` with 16-byte atomics whose columns are interleaved
within each aligned group of 32: column ``8 j + 2 q + e`` (MMA 8-column block ``j`` of the group,
quad lane ``q``, value ``e`` of a pair) is stored at ``16 (j // 2) + 4 q + 2 (j % 2) + e``. The
four values a lane holds for one row in two neighbouring blocks are then 16 contiguous bytes,
and the 8 lanes of a quad pair cover a whole 128-byte line: one L2 request per row and atomic
instead of four. The postprocess reads the natural order back.

The deterministic mode's int64 (fixed-point) accumulator uses the same lane trades with 8-byte
values, then a second one between neighbouring quad pairs: of the four values ``i`` (``2 (j % 2) +
e``) of 16-byte slot ``s`` (``4 (j // 2) + q``) of a group, value ``i`` is stored at ``16 (i % 2) +
8 (i // 2) + s``, so each atomic instruction adds whole 128-byte lines (16 lanes a row;
:func:`dkv_fixed_column`; the fold reads it back).
"""

from __future__ import annotations

#: Columns of one interleave group (D_qk must be a multiple of it).
DKV_GROUP = 32
#: Fixed point: headroom of the int64 sums below 63 bits (every partial sum stays below 2^61) ...
FIXED_BITS = 61
#: ... and the largest ``|k|`` of the scale ``2^k``, so ``2^k`` and ``2^-k`` are normal fp32.
FIXED_K_LIMIT = 120


def dkv_acc_column(col):
    """Where natural column ``col`` of dKV sits in a ``dkv_acc`` row (Python ``int`` or DSL
    ``Int32``: bit operations only)."""
    return ((col >> 5) << 5) | (((col >> 4) & 1) << 4) | (((col >> 1) & 3) << 2) \
        | (((col >> 3) & 1) << 1) | (col & 1)


def natural_order(width: int, column=dkv_acc_column) -> list[int]:
    """For each natural column ``c < width``, its index in a ``dkv_acc`` row: ``acc[..., order]``
    is dKV in natural order (``width`` a multiple of :data:`DKV_GROUP`; ``column``:
    :func:`dkv_acc_column`, or :func:`dkv_fixed_column` for the fixed-point accumulator)."""
    if width % DKV_GROUP:
        raise ValueError(f"width={width}: must be a multiple of {DKV_GROUP}")
    return [column(c) for c in range(width)]


def dkv_fixed_column(col):
    """Where natural column ``col`` of dKV sits in a fixed-point (int64) ``dkv_acc`` row: within
    its group of 32, column ``8 j + 2 q + e`` at ``16 e + 8 (j % 2) + 4 (j // 2) + q``."""
    return ((col >> 5) << 5) | ((col & 1) << 4) | (((col >> 3) & 1) << 3) \
        | (((col >> 4) & 1) << 2) | ((col >> 1) & 3)


def fixed_vec_start(vec):
    """Offset in a fixed-point ``dkv_acc`` row of natural column ``8 vec``; column ``8 vec + 2 q
    + e`` is ``16 e + q`` further (Python ints or DSL ``Int32``)."""
    block = vec % 4
    return (vec // 4) * DKV_GROUP + 8 * (block % 2) + 4 * (block // 2)
