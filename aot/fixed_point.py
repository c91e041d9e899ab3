"""The deterministic backward's fixed-point dKV (the runtime side; torch only, no compiler).

The main kernel adds every dKV value ``v`` of KV row ``j`` as the int32 ``rni(v * 2^k_j)``
(:mod:`dsa_aot.kernels.fixed_point` has the layout of ``dkv_fixed``). Integer sums do not depend
on the order of the adds, so the result is bit-identical across calls, launches and processes.
What the runtime must get right is ``k_j``: large enough to keep the values' precision, small
enough that no value (``|v 2^k| < 2^22``) and no sum (``< 2^31``) overflows. It works per
*group* of query rows:

* ``adds_j``: the values each word of row ``j`` receives in the group (valid slots with index
  ``j``, times the head blocks); ``base_j = min(22, 31 - bit_length(adds_j))`` bounds one value
  so that ``adds_j`` of them cannot overflow;
* with ``e_j`` the exponent of the row's largest ``|v|`` (``|v| < 2^e_j``), ``k_j = base_j - e_j``;
* the first group (:data:`FIRST_GROUP_ROWS`) is launched once only to measure ``e_j`` (the
  kernel ``red.max``-es every row's largest ``|v|``), then again with the exact ``k_j``;
* every later group is launched with a guess, ``e_j`` from the rows' earlier groups (their
  median for a row not seen yet) plus :data:`MARGIN_BITS`; a second launch redoes the group
  with the measured ``e_j`` when a row overflowed (its ``e_j`` was above the guess) or lost more
  than :data:`SLACK_BITS` bits to a guess too high. The kernel reads a skip flag from the
  control row, so the second launch is always queued and returns at once when not needed: no
  host sync anywhere, and the call can be captured in a CUDA graph;
* each group's integer sums are folded into an fp32 total, ``sum * 2^-k_j``, groups in order.

Every decision depends on the inputs only (maxima are order-free), so the bits do too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsa_aot.kernels.dkv_interleave import natural_order
from dsa_aot.kernels.fixed_point import (CONTROL_SKIP, MAGIC_BITS, VALUE_BITS,
                                         WORD_MAX, WORD_SCALE, row_words)

#: Query rows of the first group (measured, then redone: cheap when small), then of each later one.
FIRST_GROUP_ROWS = 128
GROUP_ROWS = 4096
#: Headroom of a guessed exponent over the rows' earlier maxima (16x).
MARGIN_BITS = 4
#: A guess this many bits above the measured maximum costs too much precision: redo.
SLACK_BITS = 12
#: fp32 exponent range of a scale ``2^k``.
K_MIN, K_MAX = -126, 126
#: ``e`` of a row without a measurement in any earlier group and no row to take a median of.
DEFAULT_EXPONENT = 0

#: Launches the main kernel over query rows ``[r0, r1)`` with ``dkv_fixed``.
MainLaunch = Callable[[int, int, torch.Tensor], None]


_NATURAL: dict[tuple[int, torch.device], torch.Tensor] = {}


def _natural(d_qk: int, dev: torch.device) -> torch.Tensor:
    """The natural column order of a ``dkv_fixed`` row, on ``dev`` (made once: a copy from the
    host inside a captured CUDA graph is not allowed)."""
    key = (d_qk, dev)
    if key not in _NATURAL:
        _NATURAL[key] = torch.tensor(natural_order(d_qk), dtype=torch.int64, device=dev)
    return _NATURAL[key]


def group_bounds(s_q: int) -> list[tuple[int, int]]:
    """The query-row groups of a call: :data:`FIRST_GROUP_ROWS`, then :data:`GROUP_ROWS` each."""
    bounds = [(0, min(s_q, FIRST_GROUP_ROWS))] if s_q else []
    r0 = bounds[0][1] if bounds else 0
    while r0 < s_q:
        bounds.append((r0, min(s_q, r0 + GROUP_ROWS)))
        r0 = bounds[-1][1]
    return bounds


def group_adds(topk_idxs: torch.Tensor, topk_length: torch.Tensor | None, s_kv: int,
               head_blocks: int, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """``[groups, s_kv]`` int32: the values each word of a KV row receives per group (valid
    slots, ``0 <= index < s_kv`` and below ``topk_length`` when given, times ``head_blocks``).
    One integer ``index_add_`` (exact, so deterministic; no host sync)."""
    s_q, topk = topk_idxs.shape
    dev = topk_idxs.device
    groups = len(bounds)
    valid = (topk_idxs >= 0) & (topk_idxs < s_kv)
    if topk_length is not None:
        slots = torch.arange(topk, device=dev, dtype=torch.int32)
        valid &= slots < topk_length.clamp(0, topk).to(torch.int32)[:, None]
    group_of_row = torch.empty(s_q, dtype=torch.int64, device=dev)
    for g, (r0, r1) in enumerate(bounds):
        group_of_row[r0:r1] = g
    key = torch.where(valid, group_of_row[:, None] * (s_kv + 1) + topk_idxs.long(),
                      group_of_row[:, None] * (s_kv + 1) + s_kv)
    counts = torch.zeros(groups * (s_kv + 1), dtype=torch.int32, device=dev)
    counts.index_add_(0, key.flatten(), torch.ones(key.numel(), dtype=torch.int32, device=dev))
    return counts.view(groups, s_kv + 1)[:, :s_kv] * head_blocks


def value_bits_bound(adds: torch.Tensor) -> torch.Tensor:
    """``base = min(22, 31 - bit_length(adds))``: with ``|n| <= 2^base``, ``adds`` values sum to
    less than ``2^31`` (int32)."""
    _, length = torch.frexp(adds.clamp(min=1).double())  # adds = m 2^length, m in [0.5, 1)
    return torch.clamp(31 - length, max=VALUE_BITS)


def magnitude_exponent(max_bits: torch.Tensor) -> torch.Tensor:
    """``e`` with ``|v| < 2^e`` from the fp32 bits of the largest ``|v|`` (biased exponent
    ``E``: ``|v| < 2^(E - 126)``; 0, subnormal: -126; non-finite: 129)."""
    return (max_bits >> 23) - 126


def scale_bits(k: torch.Tensor) -> torch.Tensor:
    """fp32 bits of ``2^k`` (``k`` in ``[K_MIN, K_MAX]``)."""
    return ((k + 127) << 23).to(torch.int32)


def preset_words(adds: torch.Tensor) -> torch.Tensor:
    """``-adds * MAGIC_BITS`` mod 2^32 as int32: each added value carries ``MAGIC_BITS``."""
    wrapped = (-adds.long() * MAGIC_BITS) % (1 << 32)
    return (wrapped - ((wrapped >> 31) << 32)).to(torch.int32)


def exponent_guess(seen: torch.Tensor, seen_e: torch.Tensor) -> torch.Tensor:
    """A row's guessed ``e``: its earlier maximum (``seen``), else the median over the seen rows
    (:data:`DEFAULT_EXPONENT` when none), plus :data:`MARGIN_BITS`. No host sync."""
    n = seen.sum()
    big = torch.iinfo(torch.int32).max
    ordered = torch.sort(torch.where(seen, seen_e, big).int()).values
    median = ordered.index_select(0, ((n - 1).clamp(min=0) // 2).view(1))[0]
    median = torch.where(n > 0, median, DEFAULT_EXPONENT)
    return torch.where(seen, seen_e, median) + MARGIN_BITS


def fixed_point_dkv(launch: MainLaunch, topk_idxs: torch.Tensor, topk_length: torch.Tensor | None,
                    s_kv: int, d_qk: int, head_blocks: int) -> torch.Tensor:
    """Run the main kernel over every group (:func:`launch`, twice a group) and return dKV as
    fp32 ``[s_kv, d_qk]`` in natural column order: the groups' fixed-point sums folded in
    order, NaN rows where a non-finite value was added."""
    dev = topk_idxs.device
    bounds = group_bounds(topk_idxs.shape[0])
    adds = group_adds(topk_idxs, topk_length, s_kv, head_blocks, bounds)
    base = value_bits_bound(adds)
    fixed = torch.zeros((s_kv + 1, row_words(d_qk)), dtype=torch.int32, device=dev)
    words = fixed[:s_kv, :d_qk]
    scale_word = fixed[:s_kv, d_qk + WORD_SCALE]
    max_word = fixed[:s_kv, d_qk + WORD_MAX]
    skip = fixed[s_kv, CONTROL_SKIP]
    natural = _natural(d_qk, dev)
    total = torch.zeros((s_kv, d_qk), dtype=torch.float32, device=dev)
    bad = torch.zeros(s_kv, dtype=torch.bool, device=dev)
    seen = torch.zeros(s_kv, dtype=torch.bool, device=dev)
    seen_e = torch.zeros(s_kv, dtype=torch.int32, device=dev)

    for g, (r0, r1) in enumerate(bounds):
        has = adds[g] > 0
        preset = preset_words(adds[g])[:, None].expand(s_kv, d_qk)
        if g == 0:  # measure only (scale 2^-126: the adds carry nothing), then the exact run
            guess_e = torch.full((s_kv,), K_MAX, dtype=torch.int32, device=dev)
        else:
            guess_e = exponent_guess(seen, seen_e)
        k = torch.clamp(base[g] - guess_e, K_MIN, K_MAX)
        words.copy_(preset)
        scale_word.copy_(scale_bits(k))
        max_word.zero_()
        skip.zero_()
        launch(r0, r1, fixed)
        measured = magnitude_exponent(max_word)
        bad |= has & (max_word >= 0x7F800000)
        exact = torch.clamp(base[g] - measured, K_MIN, K_MAX)
        redo = (has & ((k > exact) | (k < exact - SLACK_BITS))).any() | (g == 0)
        k = torch.where(redo, exact, k)
        words.copy_(torch.where(redo, preset, words))
        scale_word.copy_(scale_bits(k))
        skip.copy_((~redo).int())
        launch(r0, r1, fixed)  # returns at once unless redo
        total.addcmul_(words.index_select(1, natural).float(),
                       torch.ldexp(torch.ones_like(total[:, :1]), -k[:, None]))
        seen_e.copy_(torch.where(has & seen, torch.maximum(seen_e, measured),
                                 torch.where(has, measured, seen_e)))
        seen |= has
    return torch.where(bad[:, None], float("nan"), total)  # no boolean indexing: no host sync


__all__ = ["DEFAULT_EXPONENT", "FIRST_GROUP_ROWS", "GROUP_ROWS", "K_MAX", "K_MIN", "MARGIN_BITS",
           "SLACK_BITS", "exponent_guess", "fixed_point_dkv", "group_adds",
           "group_bounds", "magnitude_exponent", "preset_words", "scale_bits", "value_bits_bound"]
