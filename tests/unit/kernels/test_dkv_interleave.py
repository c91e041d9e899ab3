"""The interleaved column order of the CuTe DSL backward's fp32 ``dkv_acc``.

The main kernel's atomics rely on it (a lane's 4 values of one row in two neighbouring MMA
blocks are 16 contiguous bytes; the 8 lanes of a quad pair cover one 128-byte line) and the
postprocess undoes it (its per-thread view must be the exact inverse). No GPU, no ``cutlass``.
"""

from __future__ import annotations

import pytest
import torch

from dsa_aot.kernels.dkv_interleave import DKV_GROUP, dkv_acc_column, natural_order


@pytest.mark.parametrize("width", [512, 576])
def test_a_permutation_within_each_group(width: int) -> None:
    order = natural_order(width)
    assert sorted(order) == list(range(width))
    for c, p in enumerate(order):
        assert p // DKV_GROUP == c // DKV_GROUP


def test_lane_values_are_16_contiguous_bytes_and_a_quad_pair_fills_a_line() -> None:
    # wgmma / mma accumulator: lane q of a quad holds columns 8 j + 2 q + e of its row
    for group in range(3):
        line = []
        for half in (0, 1):  # blocks (0, 1) kept by the lower quad, (2, 3) traded to the upper
            for q in range(4):
                cols = [32 * group + 8 * (2 * half + jj) + 2 * q + e for jj in (0, 1) for e in (0, 1)]
                pos = [dkv_acc_column(c) for c in cols]
                assert pos == list(range(pos[0], pos[0] + 4)) and pos[0] % 4 == 0
                assert pos[0] == 32 * group + 16 * half + 4 * q
                line += pos
        assert sorted(line) == list(range(32 * group, 32 * group + 32))


def test_postprocess_view_is_the_inverse() -> None:
    post = pytest.importorskip("dsa_aot.kernels.cutedsl_bwd_postprocess")
    shape, stride = post.INTERLEAVED_VEC_SHAPE, post.INTERLEAVED_VEC_STRIDE
    for vec in range(576 // 8):
        start = post.interleaved_start(vec)
        # element (e, q) of the (2, 4) view is natural column 8 vec + 2 q + e
        for q in range(shape[1]):
            for e in range(shape[0]):
                assert start + e * stride[0] + q * stride[1] == dkv_acc_column(8 * vec + 2 * q + e)


def test_natural_order_reads_an_interleaved_accumulator_back() -> None:
    natural = torch.randn(5, 576)
    acc = torch.empty_like(natural)
    acc[:, natural_order(576)] = natural  # what the kernel's scatter writes
    assert torch.equal(acc[:, natural_order(576)], natural)
    assert not torch.equal(acc, natural)
    with pytest.raises(ValueError, match="width=100"):
        natural_order(100)
