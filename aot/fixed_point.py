"""The deterministic backward's fixed-point dKV (the runtime side; torch only, no compiler).

The main kernel adds every dKV value ``v`` of KV row ``j`` as the int32 ``rni(v * 2^k_j)``
(:mod:`dsa_aot.kernels.fixed_point` has the layout of ``dkv_fixed``). Integer sums do not depend
on the order of the adds, so the result is bit-identical across calls, launches and processes.
What the runtime must get right is ``k_j``: large enough to keep the values' precision, small
enough that no value (``|v 2^k| < 2^22``) and no sum (``< 2^31``) overflows. It works per
*group* of query rows:

* ``adds_j``: the values each word of row ``j`` receives in the group (valid slots with index
  ``j``, times the head blocks; the kernel counts them); ``base_j = min(22, 31 -
  bit_length(adds_j))`` bounds one value so that ``adds_j`` of them cannot overflow;
* with ``e_j`` the exponent of the row's largest ``|v|`` (``|v| < 2^e_j``), ``k_j = base_j - e_j``;
* :data:`SAMPLE_ROWS` query rows spread over the call are launched once only to measure ``e_j``
  (the kernel ``red.max``-es every row's largest ``|v|``; their scale ``2^-126`` makes the adds
  carry nothing);
* every group is launched with a guess: ``e_j`` from the sample and the earlier groups (their
  median for a row not seen yet) plus :data:`MARGIN_BITS`, and ``base_j`` for at most one add
  per query row and head block (distinct indices), so that nothing but the guess has to be
  ready before the launch. A second launch redoes the group with the measured ``e_j`` and the
  counted adds when a row overflowed (its ``e_j`` above the guess, or more adds than the bound)
  or lost more than :data:`SLACK_BITS` bits to a guess too high. The kernel reads a skip flag from the control row, so the second
  launch is always queued and returns at once when not needed: no host sync anywhere, and the
  call can be captured in a CUDA graph;
* the words start at zero; the kernel adds two neighbouring words at a time as one exact int64
  (``n_lo + 2^32 n_hi``), which :func:`integer_sums` splits back into the two words' sums before
  each group's sums are folded into an fp32 total, ``sum * 2^-k_j``, groups in order.

Every decision depends on the inputs only (maxima are order-free), so the bits do too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsa_aot.kernels.dkv_interleave import natural_order
from dsa_aot.kernels.fixed_point import (CONTROL_SKIP, SINK_ROWS, VALUE_BITS, WORD_COUNT,
                                         WORD_MAX, WORD_SCALE, row_words)

#: Query rows launched once only to measure the rows' magnitudes (the first guesses), and the
#: query rows of each group.
SAMPLE_ROWS = 128
GROUP_ROWS = 4096
#: Headroom of a guessed exponent over the rows' earlier maxima (16x).
MARGIN_BITS = 4
#: A guess this many bits above the measured maximum costs too much precision: redo.
SLACK_BITS = 12
#: fp32 exponent range of a scale ``2^k``.
K_MIN, K_MAX = -126, 126
#: ``e`` of a row without a measurement in any earlier group and no row to take a median of.
DEFAULT_EXPONENT = 0
#: ``e`` of a row that no value (or only zeros) reached yet, and of a non-finite maximum.
UNSEEN_EXPONENT = -126
NONFINITE_EXPONENT = 129

#: Launches the main kernel over the query rows ``rows`` (a ``range``, its step 1 but for the
#: sample) with ``dkv_fixed``.
MainLaunch = Callable[[range, torch.Tensor], None]


_NATURAL: dict[tuple[int, torch.device], torch.Tensor] = {}


def _natural(d_qk: int, dev: torch.device) -> torch.Tensor:
    """The natural column order of a ``dkv_fixed`` row, on ``dev`` (made once: a copy from the
    host inside a captured CUDA graph is not allowed)."""
    key = (d_qk, dev)
    if key not in _NATURAL:
        _NATURAL[key] = torch.tensor(natural_order(d_qk), dtype=torch.int64, device=dev)
    return _NATURAL[key]


def sample_rows(s_q: int) -> range:
    """The query rows of the measuring launch: at most :data:`SAMPLE_ROWS`, spread evenly over
    the call, so that the sample meets KV rows from all of it (in a causal prefill the first
    query rows reach only the first KV rows)."""
    return range(0, s_q, max(1, -(-s_q // SAMPLE_ROWS)))


def group_bounds(s_q: int) -> list[tuple[int, int]]:
    """The query-row groups of a call: :data:`GROUP_ROWS` each."""
    return [(r0, min(s_q, r0 + GROUP_ROWS)) for r0 in range(0, s_q, GROUP_ROWS)]


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


def integer_sums(words: torch.Tensor) -> torch.Tensor:
    """A group's integer sums, in place, from its rows' words (``[s_kv, D]`` int32, rows 8-byte
    aligned). The kernel adds each word pair ``(2m, 2m + 1)`` as the int64 ``n_lo + 2^32 n_hi``,
    so the pair holds ``S_lo + 2^32 S_hi`` (both sums in ``(-2^31, 2^31)``). Adding ``2^31``
    leaves ``S_lo + 2^31`` in the low word, with no borrow into the high one, which is then
    ``S_hi``; flipping bit 31 gives back ``S_lo``. Returns ``words``."""
    words.view(torch.int64).add_(1 << 31).bitwise_xor_(1 << 31)
    return words


def exponent_guess(seen_e: torch.Tensor) -> torch.Tensor:
    """A row's guessed ``e``: its earlier maximum, else (:data:`UNSEEN_EXPONENT`: no value seen)
    the median over the seen rows (:data:`DEFAULT_EXPONENT` when none), plus
    :data:`MARGIN_BITS`. No host sync."""
    unseen = seen_e == UNSEEN_EXPONENT
    n_unseen = unseen.sum()
    ordered = torch.sort(seen_e).values  # the unseen rows first
    middle = ((seen_e.numel() - 1 + n_unseen) // 2).view(1)  # the middle seen row
    median = ordered.index_select(0, middle)  # not ordered[middle]: that reads it on the host
    median = torch.where(n_unseen == seen_e.numel(), DEFAULT_EXPONENT, median)
    return torch.where(unseen, median, seen_e) + MARGIN_BITS


def fixed_point_dkv(launch: MainLaunch, topk_idxs: torch.Tensor, topk_length: torch.Tensor | None,
                    s_kv: int, d_qk: int, head_blocks: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Run the main kernel once over the sample rows, then twice over every group
    (:func:`launch`) and return dKV as fp32 ``[s_kv, d_qk]`` in natural column order (into
    ``out`` when given): the groups' fixed-point sums folded in order, NaN rows where a
    non-finite value was added. Few torch ops: each costs host time between the launches."""
    dev = topk_idxs.device
    s_q = topk_idxs.shape[0]
    fixed = torch.zeros((s_kv + 1 + SINK_ROWS, row_words(d_qk)), dtype=torch.int32, device=dev)
    words = fixed[:s_kv, :d_qk]
    scale_word = fixed[:s_kv, d_qk + WORD_SCALE]
    max_word = fixed[:s_kv, d_qk + WORD_MAX]
    # the sample (scale 2^-126: the adds carry nothing, only the maxima count)
    scale_word.fill_((K_MIN + 127) << 23)
    if s_q:
        launch(sample_rows(s_q), fixed)
    adds = fixed[:s_kv, d_qk + WORD_COUNT]
    launched = fixed[:s_kv, :d_qk + WORD_COUNT + 1]  # what a launch adds to: a redo starts afresh
    skip = fixed[s_kv, CONTROL_SKIP]
    seen_e = magnitude_exponent(max_word)  # UNSEEN_EXPONENT: no value (or only zeros) yet
    total = None
    for r0, r1 in group_bounds(s_q):
        # the guess needs no count: a group adds at most once a query row and head block to a
        # row (distinct indices); the kernel counts the adds, and a group with more is redone
        bound = min(VALUE_BITS, 31 - ((r1 - r0) * head_blocks).bit_length())
        k = torch.clamp(bound - exponent_guess(seen_e), K_MIN, K_MAX)
        fixed.zero_()
        scale_word.copy_(scale_bits(k))
        launch(range(r0, r1), fixed)
        measured = magnitude_exponent(max_word)
        exact = torch.clamp(value_bits_bound(adds) - measured, K_MIN, K_MAX)
        off = exact - k  # < 0: the guess overflowed; > SLACK_BITS: it wasted precision
        redo = ((adds > 0) & ((off < 0) | (off > SLACK_BITS))).any()
        k = torch.where(redo, exact, k)
        launched.masked_fill_(redo, 0)
        scale_word.copy_(scale_bits(k))
        skip.copy_(~redo)
        launch(range(r0, r1), fixed)  # returns at once unless redo
        inverse = scale_bits(-k).view(torch.float32)[:, None]  # 2^-k
        part = integer_sums(words).float().mul_(inverse)  # exact: a power of 2
        total = part if total is None else total.add_(part)
        seen_e = torch.maximum(seen_e, measured)
    if total is None:  # no query row
        total = torch.zeros((s_kv, d_qk), dtype=torch.float32, device=dev)
    result = torch.index_select(total, 1, _natural(d_qk, dev), out=out)
    return result.masked_fill_((seen_e >= NONFINITE_EXPONENT)[:, None], float("nan"))


__all__ = ["DEFAULT_EXPONENT", "GROUP_ROWS", "K_MAX", "K_MIN", "MARGIN_BITS", "NONFINITE_EXPONENT",
           "SAMPLE_ROWS", "SLACK_BITS", "UNSEEN_EXPONENT", "exponent_guess", "fixed_point_dkv",
           "group_bounds", "integer_sums", "magnitude_exponent", "sample_rows", "scale_bits",
           "value_bits_bound"]
