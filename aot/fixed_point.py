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
  (the kernel ``red.max``-es every row's largest ``|v|`` and adds nothing);
* every group is launched with a guess (the postprocess kernel's guess step,
  :mod:`dsa_aot.kernels.cutedsl_bwd_fixed_point_post`; :func:`guessed_scale` is its rule):
  ``e_j`` from the sample and the earlier groups (their median for a row not seen yet; the
  largest scale when the sample saw no row) plus :data:`MARGIN_BITS`, and ``base_j`` for at most one add per query row and head block
  (distinct indices), so that nothing but the guess has to be ready before the launch. A second
  launch redoes the group with the measured ``e_j`` and the counted adds when a row overflowed
  (its ``e_j`` above the guess, or more adds than the bound) or lost more than
  :data:`SLACK_BITS` bits to a guess too high. The kernel reads a skip flag from the control
  row, so the second launch is always queued and returns at once when not needed: no host sync
  anywhere, and the call can be captured in a CUDA graph;
* the words start at zero; the kernel adds two neighbouring words at a time as one exact int64
  (``n_lo + 2^32 n_hi``), which the postprocess's fold step splits back into the two words' sums
  (:func:`integer_sums`) before each group's sums are folded into an fp32 total, ``sum *
  2^-k_j``, groups in order, and the last group's total becomes bf16 dKV.

:func:`post_reference` is the postprocess in torch, bit for bit: the GPU tests hold the kernel
to it and the CPU tests launch it in the kernel's place.

Every decision depends on the inputs only (maxima are order-free), so the bits do too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsa_aot.kernels.dkv_interleave import natural_order
from dsa_aot.kernels.fixed_point import (CONTROL_SKIP, FOLD_FIRST, FOLD_LAST, MARGIN_BITS, SINK_ROWS,
                                         SLACK_BITS, STEP_CHECK, STEP_FOLD, STEP_GUESS, VALUE_BITS,
                                         WORD_COUNT, WORD_MAX, WORD_SCALE, WORD_SEEN, row_words)

#: Query rows launched once only to measure the rows' magnitudes (the first guesses), and the
#: query rows of each group.
SAMPLE_ROWS = 128
GROUP_ROWS = 4096
#: ``dkv_fixed``'s row stride is a multiple of this many words (128 bytes: one L2 line).
ROW_ALIGN_WORDS = 32
#: Biased fp32 exponent ``k + 127`` of a scale ``2^k``, ``k`` in ``[-126, 126]``.
S_MIN, S_MAX = 1, 253
#: Biased exponent ``E`` of a row's largest ``|v|`` (:func:`biased_exponent`) that no value (or
#: only zeros) reached yet, and of a non-finite maximum.
UNSEEN, NONFINITE = 0, 255

#: Launches the main kernel over the query rows ``rows`` (a ``range``, its step 1 but for the
#: sample) with ``dkv_fixed``; ``measure``: the sample's launch, which adds nothing and only
#: measures the KV rows' largest values.
MainLaunch = Callable[[range, torch.Tensor, bool], None]
#: Launches the postprocess step ``fixed_step`` (:data:`STEP_GUESS` with the group's bound on a
#: value's bits as ``fixed_bound``, or a fold) with the arguments of :func:`post_reference`
#: (``dkv_fixed``, the running total ``dkv_acc``, ``dkv``, ``d_sink_acc``, ``d_sink``).
PostLaunch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int,
                       int], None]


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


def biased_exponent(max_bits: torch.Tensor) -> torch.Tensor:
    """``E``, the biased exponent of the fp32 bits of a row's largest ``|v|``: ``|v| < 2^(E -
    126)``; :data:`UNSEEN` (0) for zero or a subnormal, :data:`NONFINITE` (255) for inf or NaN."""
    return max_bits >> 23


def scale_for(base: torch.Tensor | int, e: torch.Tensor) -> torch.Tensor:
    """``k + 127`` of the scale ``2^k`` that keeps a row's values within ``base`` bits: ``k =
    base - (E - 126)`` for ``|v| < 2^(E - 126)``, clamped to ``[-126, 126]``."""
    return torch.clamp(base + 253 - e, S_MIN, S_MAX)


def guessed_scale(seen: torch.Tensor, bound: int) -> torch.Tensor:
    """``k + 127`` of each row's first scale in a group whose values stay within ``bound`` bits,
    from ``seen``, the rows' largest ``E`` so far: the row's own, else (:data:`UNSEEN`) the lower
    median over the seen rows, plus :data:`MARGIN_BITS`. With no row seen every row gets the
    largest scale (a group with a nonzero value is then redone with the measured ones). No host
    sync and no sort: ``nanmedian`` along a dimension is one selection kernel, and ``seen / (seen
    != 0)`` makes the unseen rows NaN, which it skips."""
    if not seen.numel():  # no KV row (the median of nothing is an error)
        return seen.clone()
    median = torch.nanmedian(seen / (seen != UNSEEN), dim=0).values.nan_to_num_(0.0)
    return scale_for(bound - MARGIN_BITS, torch.where(seen == UNSEEN, median.to(seen.dtype), seen))


def integer_sums(words: torch.Tensor) -> torch.Tensor:
    """A group's integer sums, in place, from its rows' words (``[s_kv, D]`` int32, rows 8-byte
    aligned). The kernel adds each word pair ``(2m, 2m + 1)`` as the int64 ``n_lo + 2^32 n_hi``,
    so the pair holds ``S_lo + 2^32 S_hi`` (both sums in ``(-2^31, 2^31)``). Adding ``2^31``
    leaves ``S_lo + 2^31`` in the low word, with no borrow into the high one, which is then
    ``S_hi``; flipping bit 31 gives back ``S_lo``. Returns ``words``."""
    words.view(torch.int64).add_(1 << 31).bitwise_xor_(1 << 31)
    return words


def row_stride(d_qk: int) -> int:
    """int32 words from one ``dkv_fixed`` row to the next: :func:`row_words` rounded up to
    :data:`ROW_ALIGN_WORDS`."""
    return -(-row_words(d_qk) // ROW_ALIGN_WORDS) * ROW_ALIGN_WORDS


def fixed_rows(rows: int, d_qk: int, device: torch.device) -> torch.Tensor:
    """A zeroed ``dkv_fixed`` (``[rows, row_words(d_qk)]`` int32) whose rows start on
    :data:`ROW_ALIGN_WORDS`-word boundaries: a view of a wider allocation, so that a warp's
    64-bit adds into a row span whole 128-byte lines (the kernels take the row stride at run
    time)."""
    return torch.zeros((rows, row_stride(d_qk)), dtype=torch.int32, device=device)[:, :row_words(d_qk)]


def fixed_point_dkv(launch: MainLaunch, post: PostLaunch, dkv: torch.Tensor,
                    d_sink_acc: torch.Tensor, d_sink: torch.Tensor, s_q: int,
                    head_blocks: int) -> None:
    """Run the main kernel once over the sample rows, then twice over every group
    (:func:`launch`), each group between the postprocess's guess and fold steps (:func:`post`),
    whose last fold writes ``dkv`` (``[s_kv, D]``, natural columns, NaN rows where a non-finite
    value was added) and ``d_sink`` (the preprocess's partials ``d_sink_acc`` added in order).

    After the workspace, launches only: between the sample's launch and the first group's the
    GPU waits for the host, and the re-launch decision (the check step) stays on the GPU. The
    sample only measures (it adds nothing; the guess step clears the max and count words it has
    read)."""
    s_kv, d_qk = dkv.shape
    fixed = fixed_rows(s_kv + 1 + SINK_ROWS, d_qk, dkv.device)
    groups = group_bounds(s_q)
    # the running fp32 total of a call with several groups (else the last fold writes dkv alone)
    total = torch.empty((s_kv if len(groups) > 1 else 0, d_qk), dtype=torch.float32, device=dkv.device)
    sinks = (dkv, d_sink_acc, d_sink)
    if not groups:  # no query row: dkv is the zero sum, d_sink the fold of the partials
        post(fixed, total, *sinks, STEP_FOLD | FOLD_FIRST | FOLD_LAST, 0)
        return
    launch(sample_rows(s_q), fixed, True)
    for g, (r0, r1) in enumerate(groups):
        # the guess needs no count: a group adds at most once a query row and head block to a
        # row (distinct indices); the kernel counts the adds, and a group with more is redone
        post(fixed, total, *sinks, STEP_GUESS,
             min(VALUE_BITS, 31 - ((r1 - r0) * head_blocks).bit_length()))
        launch(range(r0, r1), fixed, False)
        post(fixed, total, *sinks, STEP_CHECK, 0)  # the scales checked: redo or skip
        launch(range(r0, r1), fixed, False)  # returns at once unless redo
        post(fixed, total, *sinks, STEP_FOLD | (FOLD_FIRST if g == 0 else 0)
             | (FOLD_LAST if g == len(groups) - 1 else 0), 0)


def post_reference(dkv_fixed: torch.Tensor, dkv_acc: torch.Tensor, dkv: torch.Tensor,
                   d_sink_acc: torch.Tensor, d_sink: torch.Tensor, fixed_step: int,
                   fixed_bound: int) -> None:
    """The postprocess's step ``fixed_step`` in torch, with the kernel's arguments and bits
    (:mod:`dsa_aot.kernels.cutedsl_bwd_fixed_point_post` has the steps)."""
    s_kv, d_qk = dkv.shape
    seen_word = dkv_fixed[:s_kv, d_qk + WORD_SEEN]
    scale_word = dkv_fixed[:s_kv, d_qk + WORD_SCALE]
    stats = dkv_fixed[:s_kv, d_qk + WORD_MAX:d_qk + WORD_COUNT + 1]
    measured = biased_exponent(dkv_fixed[:s_kv, d_qk + WORD_MAX])
    if fixed_step == STEP_CHECK:
        adds = dkv_fixed[:s_kv, d_qk + WORD_COUNT]
        scale = scale_word >> 23
        exact = scale_for(value_bits_bound(adds), measured)
        off = exact - scale  # < 0: the guess overflowed; > SLACK_BITS: it wasted precision
        redo = bool(((adds > 0) & ((off < 0) | (off > SLACK_BITS))).any())
        if redo:  # what a launch adds to starts afresh, with the measured scales
            dkv_fixed[:s_kv, :d_qk + WORD_COUNT + 1] = 0
            torch.bitwise_left_shift(exact, 23, out=scale_word)
        dkv_fixed[s_kv, CONTROL_SKIP] = 0 if redo else 1
        return
    if fixed_step == STEP_GUESS:
        seen_word.copy_(torch.maximum(seen_word, measured))
        torch.bitwise_left_shift(guessed_scale(seen_word.clone(), fixed_bound), 23, out=scale_word)
        stats.zero_()
        dkv_fixed[s_kv, CONTROL_SKIP] = 0
        return
    inverse = ((254 - (scale_word >> 23)) << 23).view(torch.float32)[:, None]  # 2^-k
    part = integer_sums(dkv_fixed[:s_kv, :d_qk].clone()) * inverse
    order = torch.tensor(natural_order(d_qk), dtype=torch.int64, device=dkv.device)
    total = part[:, order] if fixed_step & FOLD_FIRST else dkv_acc + part[:, order]
    total[measured == NONFINITE] = float("nan")
    if fixed_step & FOLD_LAST:
        dkv.copy_(total)
        folded = torch.zeros_like(d_sink)
        for partial in d_sink_acc:  # in index order
            folded = folded + partial
        d_sink.copy_(folded)
        return
    dkv_acc.copy_(total)
    seen_word.copy_(torch.maximum(seen_word, measured))
    dkv_fixed[:s_kv, :d_qk].zero_()
    stats.zero_()


__all__ = ["GROUP_ROWS", "MARGIN_BITS", "MainLaunch", "NONFINITE", "PostLaunch", "SAMPLE_ROWS",
           "SLACK_BITS", "S_MAX", "S_MIN", "UNSEEN", "biased_exponent", "fixed_point_dkv",
           "group_bounds", "guessed_scale", "integer_sums", "post_reference", "sample_rows", "scale_for",
           "value_bits_bound"]
