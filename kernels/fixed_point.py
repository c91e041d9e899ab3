"""Layout of the deterministic backward's int32 fixed-point dKV accumulator (no ``cutlass``
import: the runtime and the kernels share it).

``dkv_fixed`` is int32 ``[s_kv + 1 + SINK_ROWS, D + PAD_WORDS]`` with a run-time row stride (the
runtime starts each row on a 128-byte line, :func:`dsa_aot.fixed_point.row_stride`). Row
``j < s_kv`` holds KV row ``j``:

* words ``[0, D)``: the sums of ``rni(v * 2^k_j)`` over every dKV value ``v`` added to the row,
  in the interleaved column order of :mod:`dsa_aot.kernels.dkv_interleave`, two words at a
  time: the kernel makes each value's ``n = rni(v 2^k_j)`` as the bits of ``fma(v, 2^k_j, 1.5 *
  2^23)`` (``MAGIC_BITS + n`` for ``|v 2^k_j| < 2^22``) and adds the words ``2m, 2m + 1`` as the
  int64 ``n_lo + 2^32 n_hi`` (``red.global.add.u64`` of the pair's bits less ``PAIR_MAGIC``).
  A pair that starts at zero ends at ``S_lo + 2^32 S_hi``, exact while each sum stays within
  int32, which the runtime splits into ``S_lo`` and ``S_hi``. Integer adds commute: the bits
  do not depend on the order of the adds;
* word ``D + WORD_SCALE``: ``2^k_j`` as fp32 bits, written by the runtime before the launch;
* word ``D + WORD_MAX``: the largest ``|v|`` added to the row, as fp32 bits (``red.max.u32``;
  non-finite values order above every finite one), which tells the runtime whether ``k_j``
  was safe and a non-finite value reached the row;
* word ``D + WORD_COUNT``: ``c``, the values each word of the row received (one per valid
  slot and head block);
* word ``D + WORD_SEEN``: the largest biased exponent of the row's ``|v|`` over the call's
  earlier launches (0: none yet), kept by the postprocess steps
  (:mod:`dsa_aot.kernels.cutedsl_bwd_fixed_point_post`) across groups.

Row ``s_kv`` is the control row: word ``CONTROL_SKIP`` nonzero makes every CTA of the launch
return at once (a conditional re-launch decided on the device, with no host sync). The
:data:`SINK_ROWS` rows after it take the adds of invalid slots, which nothing reads: an add
that needs no predicate costs the kernel no branch, and spread over many rows the sink does not
become one hot line.
"""

from __future__ import annotations

#: int32 words after each row's ``D`` values (keeps rows 16-byte aligned at D 512 / 576).
PAD_WORDS = 8
#: Offsets from ``D`` of the scale, the largest-magnitude and the add-count words.
WORD_SCALE = 1
WORD_MAX = 2
WORD_COUNT = 3
WORD_SEEN = 4
#: Rows after the control row that invalid slots add to (64 a CTA, CTAs in turn).
SINK_ROWS = 1024
#: Word of the control row (row ``s_kv``) whose nonzero value skips the launch.
CONTROL_SKIP = 1
#: fp32 bits of ``1.5 * 2^23``: ``fma(v, s, 1.5 * 2^23)`` has ``MAGIC_BITS + rni(v s)`` as bits
#: while ``|v s| < 2^22``.
MAGIC = 12582912.0
MAGIC_BITS = 0x4B400000
#: Two words of ``MAGIC_BITS`` read as one int64 (low word first): what a pair's add subtracts.
PAIR_MAGIC = MAGIC_BITS * (2 ** 32 + 1)
#: Largest ``log2`` of one scaled value: ``|v 2^k| < 2^VALUE_BITS``.
VALUE_BITS = 22
#: Headroom of a guessed exponent over the rows' earlier maxima (16x).
MARGIN_BITS = 4
#: A guess this many bits above the measured maximum costs too much precision: redo.
SLACK_BITS = 12
#: The postprocess's run-time ``fixed_step``: guess a group's scales, check them after the
#: group's first launch (and decide its re-launch), or fold its sums (``STEP_FOLD``, plus
#: ``FOLD_FIRST`` for the call's first group and ``FOLD_LAST`` for its last).
STEP_GUESS = 0
STEP_FOLD = 1
FOLD_FIRST = 2
FOLD_LAST = 4
STEP_CHECK = 8


def row_words(d_qk: int) -> int:
    """int32 words of one ``dkv_fixed`` row."""
    return d_qk + PAD_WORDS


__all__ = ["CONTROL_SKIP", "FOLD_FIRST", "FOLD_LAST", "MAGIC", "MAGIC_BITS", "MARGIN_BITS", "PAD_WORDS",
           "PAIR_MAGIC", "SINK_ROWS", "SLACK_BITS", "STEP_CHECK", "STEP_FOLD", "STEP_GUESS", "VALUE_BITS", "WORD_COUNT",
           "WORD_MAX", "WORD_SCALE", "WORD_SEEN", "row_words"]
