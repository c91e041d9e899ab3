"""The deterministic backward's fixed-point protocol (dsa_aot.fixed_point) on the CPU.

``launch`` here models the main kernel's side of the contract exactly: per group of query rows,
every valid slot adds its dKV row's values as the bits of ``fma(v, 2^k_j, 1.5 * 2^23)``, two
neighbouring words at a time as one uint64 less ``PAIR_MAGIC`` (modulo 2^64), counts its add,
``red.max``-es the fp32 bits of the largest ``|v|`` into word ``D + WORD_MAX`` and does
nothing when the control row's skip word is set; a measuring launch (the sample) adds no
value. Its dKV rows are random, with magnitudes that
differ by row and by group (the cases that force a re-launch), so the test checks the scales
the runtime picks, the re-launch, the fold and the bits, not a kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsa_aot import fixed_point as fp
from dsa_aot.kernels.dkv_interleave import dkv_acc_column
from dsa_aot.kernels.fixed_point import (CONTROL_SKIP, FOLD_FIRST, FOLD_LAST, MAGIC, MAGIC_BITS,
                                         PAIR_MAGIC, SINK_ROWS, STEP_CHECK, STEP_FOLD, STEP_GUESS, WORD_COUNT,
                                         WORD_MAX, WORD_SCALE, WORD_SEEN, row_words)

D = 64


class ModelKernel:
    """The main kernel's fixed-point adds for given per-slot dKV rows (``rows[t, slot, h]``,
    natural columns), in a chosen add order."""

    def __init__(self, idx: torch.Tensor, rows: torch.Tensor, s_kv: int, order_seed: int = 0):
        self.idx, self.rows, self.s_kv = idx, rows, s_kv
        self.rng = np.random.default_rng(order_seed)
        self.launches = 0
        self.skipped = 0
        self.log: list[tuple[int, int, bool]] = []  # (first row, end, skipped) per launch
        self.sampled: list[range] = []
        self.interleaved = [dkv_acc_column(c) for c in range(D)]

    def __call__(self, rows: range, fixed: torch.Tensor, measure: bool) -> None:
        self.launches += 1
        skipped = int(fixed[self.s_kv, CONTROL_SKIP]) != 0
        self.log.append((rows.start, rows.stop, skipped))
        assert measure == (rows.step != 1 or not self.sampled)  # the first launch: the sample
        if measure:
            self.sampled.append(rows)
        if skipped:
            self.skipped += 1
            return
        assert fixed.shape == (self.s_kv + 1 + SINK_ROWS, row_words(D))
        assert fixed.stride() == (fp.row_stride(D), 1)  # rows on 128-byte lines
        words = fixed.numpy().view(np.uint32)
        adds = [(t, s, h) for t in rows for s in range(self.idx.shape[1])
                for h in range(self.rows.shape[2]) if 0 <= int(self.idx[t, s]) < self.s_kv]
        for t in rows:  # an invalid slot's adds go to a sink row: anything, unread
            for s in range(self.idx.shape[1]):
                if not 0 <= int(self.idx[t, s]) < self.s_kv and not measure:
                    sink = self.s_kv + 1 + (t * 64 + s % 64) % SINK_ROWS
                    words[sink] += self.rng.integers(0, 2**32, words.shape[1], dtype=np.uint32)
        for n in self.rng.permutation(len(adds)):
            t, s, h = adds[n]
            j = int(self.idx[t, s])
            v = self.rows[t, s, h].numpy().astype(np.float32)
            scale = words[j, D + WORD_SCALE:D + WORD_SCALE + 1].view(np.float32)[0]
            bits = (v * np.float32(scale) + np.float32(MAGIC)).astype(np.float32).view(np.uint32)
            stored = np.zeros(D, dtype=np.uint32)
            stored[self.interleaved] = bits
            pairs = words[j, :D].view(np.uint64)
            if not measure:  # a measuring launch adds nothing
                pairs += stored.view(np.uint64) - np.uint64(PAIR_MAGIC)  # numpy wraps uint64
            words[j, D + WORD_COUNT] += 1
            peak = np.abs(v).max().view(np.uint32) if not np.isnan(v).any() else np.uint32(0x7FFFFFFF)
            words[j, D + WORD_MAX] = max(words[j, D + WORD_MAX], peak)


def case(s_q: int, s_kv: int, topk: int, heads: int, seed: int = 0, spread: float = 8.0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-2, s_kv, (s_q, topk), generator=g, dtype=torch.int32)
    # per KV row a magnitude 2^[-spread, spread], per query row another factor: later groups
    # see rows much larger than the first one did
    row_mag = torch.exp2((torch.rand(s_kv, generator=g) * 2 - 1) * spread)
    q_mag = torch.exp2(torch.rand(s_q, generator=g) * 6 - 3)
    rows = torch.randn((s_q, topk, heads, D), generator=g)
    rows *= row_mag[idx.clamp(0, s_kv - 1).long()][..., None, None] * q_mag[:, None, None, None]
    return idx, rows


def reference(idx, rows, s_kv):
    ref = torch.zeros((s_kv, D), dtype=torch.float64)
    for t in range(idx.shape[0]):
        for s in range(idx.shape[1]):
            j = int(idx[t, s])
            if 0 <= j < s_kv:
                ref[j] += rows[t, s].double().sum(0)
    return ref


def run(kernel, s_q: int, s_kv: int, heads: int) -> torch.Tensor:
    """One call's dKV in fp32 (``dkv`` given as fp32, so the fold's total shows unrounded), the
    postprocess steps done by their torch definition; ``dkv`` starts as NaN."""
    dkv = torch.full((s_kv, D), float("nan"))
    d_sink_acc = torch.randn(3, 2)
    d_sink = torch.full((2,), float("nan"))
    fp.fixed_point_dkv(kernel, fp.post_reference, dkv, d_sink_acc, d_sink, s_q, heads)
    assert torch.equal(d_sink, d_sink_acc[0] + d_sink_acc[1] + d_sink_acc[2])
    return dkv


def redone(kernel: ModelKernel, r0: int) -> bool:
    """Whether the group starting at query row ``r0`` was launched a second time (not skipped)."""
    second = [skipped for a, _, skipped in kernel.log if a == r0][-1]
    return not second


@pytest.fixture(autouse=True)
def small_groups(monkeypatch):
    """A sample of 4 query rows, groups of 8: several groups in a small case."""
    monkeypatch.setattr(fp, "SAMPLE_ROWS", 4)
    monkeypatch.setattr(fp, "GROUP_ROWS", 8)


@pytest.mark.parametrize("heads", [1, 2])
def test_sums_match_the_fp64_reference_and_bits_ignore_the_add_order(heads):
    idx, rows = case(s_q=30, s_kv=12, topk=6, heads=heads)
    out = [run(ModelKernel(idx, rows, 12, order_seed=o), idx.shape[0], 12, heads)
           for o in range(3)]
    assert all(torch.equal(out[0], o) for o in out[1:])
    ref = reference(idx, rows, 12)
    err = float((out[0].double() - ref).norm() / ref.norm())
    assert not torch.isnan(out[0]).any()
    assert err < 1e-5, err


def test_a_later_group_far_above_the_first_is_redone_and_exact():
    idx, rows = case(s_q=20, s_kv=6, topk=5, heads=1, spread=1.0)
    rows[12:] *= 2.0 ** 12  # the third group's values: 4096x anything seen before
    kernel = ModelKernel(idx, rows, 6)
    out = run(kernel, idx.shape[0], 6, 1)
    ref = reference(idx, rows, 6)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5
    # the sample (rows 0, 5, 10, 15), then groups [0, 8), [8, 16), [16, 20): rows 12.. overflow
    # the guess of the second group, which is redone; the third group's guess has seen them
    assert kernel.log[0] == (0, 20, False) and kernel.sampled == [range(0, 20, 5)]
    assert kernel.launches == 7
    assert redone(kernel, 8) and not redone(kernel, 16)


def test_a_later_group_far_below_the_first_is_redone_for_precision():
    idx, rows = case(s_q=20, s_kv=6, topk=5, heads=1, spread=1.0)
    rows[12:] *= 2.0 ** -20
    kernel = ModelKernel(idx, rows, 6)
    out = run(kernel, idx.shape[0], 6, 1)
    part = reference(idx[12:], rows[12:], 6)
    small = run(ModelKernel(idx[12:], rows[12:], 6), idx[12:].shape[0], 6, 1)
    assert redone(kernel, 16)  # all of its rows 2^20 below the guess: redone for precision
    assert float((small.double() - part).norm() / part.norm()) < 1e-5
    assert float((out.double() - reference(idx, rows, 6)).norm()) < 1e-5 * float(
        reference(idx, rows, 6).norm())


def test_a_guess_a_few_bits_high_is_kept_and_stays_accurate():
    """A later group 2^-4 below what was seen keeps its guess (within :data:`SLACK_BITS` plus the
    margin), and the call's sums stay as close to the fp64 reference as an exact guess's."""
    idx, rows = case(s_q=20, s_kv=6, topk=5, heads=1, spread=1.0)
    rows[12:] *= 2.0 ** -4
    kernel = ModelKernel(idx, rows, 6)
    out = run(kernel, idx.shape[0], 6, 1)
    assert not redone(kernel, 8) and not redone(kernel, 16)
    ref = reference(idx, rows, 6)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


def test_compact_lengths_and_padding_add_nothing():
    idx, rows = case(s_q=10, s_kv=8, topk=6, heads=1)
    length = torch.tensor([0, 6, 3, 9, -1, 2, 6, 1, 4, 5], dtype=torch.int32)
    masked = idx.clone()
    masked[torch.arange(6)[None, :] >= length.clamp(0, 6)[:, None]] = -1
    out = run(ModelKernel(masked, rows, 8), idx.shape[0], 8, 1)
    ref = reference(masked, rows, 8)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[masked[masked >= 0].long()] = False
    assert torch.equal(out[untouched], torch.zeros_like(out[untouched]))


def test_a_non_finite_value_makes_its_row_nan_only():
    idx, rows = case(s_q=10, s_kv=8, topk=4, heads=1)
    t, s = 5, 1
    idx[t, s] = 3
    rows[t, s, 0, 7] = float("inf")
    out = run(ModelKernel(idx, rows, 8), idx.shape[0], 8, 1)
    assert torch.isnan(out[3]).all()
    others = [j for j in range(8) if j != 3]
    assert not torch.isnan(out[others]).any()


def test_the_count_bound_keeps_every_int32_sum_in_range():
    adds = torch.tensor([1, 2, 3, 4, 511, 512, 513, 65597, 1 << 20], dtype=torch.int32)
    base = fp.value_bits_bound(adds)
    assert base.tolist() == [22, 22, 22, 22, 22, 21, 21, 14, 10]
    assert all(a * 2 ** b < 2 ** 31 for a, b in zip(adds.tolist(), base.tolist()))
    assert all(a * 2 ** (b + 1) >= 2 ** 31 for a, b in zip(adds.tolist(), base.tolist()) if b < 22)


@pytest.mark.parametrize("adds", [1, 3, 600, 4096])
def test_integer_sums_split_each_pair_into_its_two_words_sums(adds):
    """Pairs of sums up to the int32 edges, made as the kernel makes them (``adds`` values ``|n|
    < 2^22`` a word; each add the uint64 of two words' ``MAGIC_BITS + n`` less ``PAIR_MAGIC``),
    come back exactly."""
    edge = min(2**31 - 1, adds * (2**22 - 1))
    sums = [(0, 0), (-5, 3), (edge, -edge), (-edge, edge), (-1, -1), (edge, edge), (-edge, -edge),
            (1, -1), (-(edge // 2), edge // 2 + 7)]
    totals = []
    for pair in sums:
        n = []
        for s_word in pair:  # `adds` values summing to s_word
            parts = np.full(adds, s_word // adds, dtype=np.int64)
            parts[: s_word - int(parts.sum())] += 1
            n.append(parts)
        total = 0
        for lo, hi in zip(*n):
            assert abs(lo) < 2**22 and abs(hi) < 2**22
            total += ((int(lo) + MAGIC_BITS) | ((int(hi) + MAGIC_BITS) << 32)) - PAIR_MAGIC
        totals.append(total % 2**64)
    fixed = torch.zeros((len(sums), 8), dtype=torch.int32)  # padded rows, as in dkv_fixed
    fixed[:, :2] = torch.from_numpy(np.array(totals, dtype=np.uint64).view(np.int32).reshape(-1, 2))
    got = fp.integer_sums(fixed[:, :2])
    assert got.data_ptr() == fixed.data_ptr()  # in place
    assert got.tolist() == [list(t) for t in sums]


def test_exponents_scales_and_the_median_guess():
    bits = torch.tensor([0, 0x3F800000, 0x3FFFFFFF, 0x7F800000, 0x7FC00000, 0x00000001],
                        dtype=torch.int32)
    e = fp.biased_exponent(bits)  # |v| < 2^(E - 126)
    assert e.tolist() == [fp.UNSEEN, 127, 127, fp.NONFINITE, fp.NONFINITE, fp.UNSEEN]
    # base 22, |v| < 2 (E 127): k = 21; |v| < 2^-30 (E 96): k = 52; nothing seen: k = 126
    k = fp.scale_for(22, torch.tensor([127, 96, 0, 1, 255], dtype=torch.int32)) - 127
    assert k.tolist() == [21, 52, 126, 126, -107]
    assert (fp.scale_for(torch.tensor([22, 18]), torch.tensor([127, 127])) - 127).tolist() == [21, 17]
    scales = (torch.tensor([1, 126, 127, 132, 253], dtype=torch.int32) << 23).numpy().view(np.float32)
    assert scales.tolist() == [2.0 ** -126, 0.5, 1.0, 32.0, 2.0 ** 126]

    def guessed_e(seen):  # the exponent e = E - 126 the guess's scale assumes, less the margin
        k = fp.guessed_scale(torch.tensor(seen, dtype=torch.int32), 22) - 127
        return (22 - k - fp.MARGIN_BITS).tolist()

    # 0: not seen; seen E 129, 121, 136: e 3, -5, 10, median 3
    assert guessed_e([129, 0, 121, 136, 0]) == [3, 3, -5, 10, 3]
    assert guessed_e([0, 134, 128, 0, 131, 127]) == [2, 8, 2, 2, 5, 1]  # lower middle of 1 2 5 8
    assert guessed_e([0, 255, 129, 0]) == [3, 129, 3, 3]  # a non-finite row: the largest
    assert guessed_e([]) == []
    assert guessed_e([0, 0, 0]) == [22 - 126 - fp.MARGIN_BITS] * 3  # none seen: the largest scale


def test_group_bounds():
    assert fp.group_bounds(0) == []
    assert fp.group_bounds(3) == [(0, 3)]
    assert fp.group_bounds(21) == [(0, 8), (8, 16), (16, 21)]


class OpLog(TorchDispatchMode):
    """Every aten op run inside the block that computes something, by name (views such as
    slices and selects launch nothing on a GPU and are left out)."""

    VIEWS = ("slice", "select", "view", "unsqueeze", "expand", "detach", "alias")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not name.split(".")[1].startswith(self.VIEWS):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_no_host_read_and_few_torch_ops_a_group(monkeypatch):
    """The protocol is launches only (the sample, then per group the guess, the group, the
    check, the re-launch and the fold) after allocating its workspace: no torch op between them
    (before the first group's launch the GPU waits for the host) and no device value brought to
    the host (``.item()``: a host sync on a GPU, and no CUDA-graph capture)."""
    idx, rows = case(s_q=30, s_kv=12, topk=6, heads=1)
    counts = []
    for group_rows in (64, 8):  # one group, four groups
        monkeypatch.setattr(fp, "GROUP_ROWS", group_rows)
        sinks = torch.empty(12, D), torch.zeros(3, 2), torch.empty(2)
        with OpLog() as log:
            at = []
            fp.fixed_point_dkv(lambda rows, fixed, measure: at.append(("main", len(log.ops))),
                               lambda *args: at.append(("post", len(log.ops))), *sinks, 30, 1)
        assert not [op for op in log.ops if "_local_scalar_dense" in op or "item" in op]
        assert [kind for kind, _ in at[:6]] == ["main", "post", "main", "post", "main", "post"], at
        assert at[0][1] == 2 and at[-1][1] == 2, at  # the workspace, then launches only
        counts.append(len(log.ops))
    assert counts == [2, 2], counts  # the int32 words and the running fp32 total


def test_no_query_row_launches_no_main_kernel_and_sums_to_zero():
    steps = []
    dkv = torch.full((5, D), float("nan"))
    d_sink_acc, d_sink = torch.randn(2, 3), torch.full((3,), float("nan"))

    def post(*args):
        steps.append(args[-2])
        fp.post_reference(*args)

    fp.fixed_point_dkv(lambda rows, fixed, measure: pytest.fail("no query row: nothing to launch"), post,
                       dkv, d_sink_acc, d_sink, 0, 2)
    assert steps == [STEP_FOLD | FOLD_FIRST | FOLD_LAST]
    assert torch.equal(dkv, torch.zeros(5, D)) and torch.equal(d_sink, d_sink_acc[0] + d_sink_acc[1])


def fixed_rows(s_kv: int, seed: int = 0) -> torch.Tensor:
    """A ``dkv_fixed`` with random words, scales, maxima, counts and seen exponents."""
    g = torch.Generator().manual_seed(seed)
    fixed = torch.randint(-2**31, 2**31, (s_kv + 1 + SINK_ROWS, D + 8), generator=g, dtype=torch.int32)
    fixed[:s_kv, D + WORD_SCALE] = torch.randint(100, 160, (s_kv,), generator=g, dtype=torch.int32) << 23
    fixed[:s_kv, D + WORD_MAX] = torch.randint(0, 140, (s_kv,), generator=g, dtype=torch.int32) << 23
    fixed[:s_kv, D + WORD_SEEN] = torch.randint(0, 140, (s_kv,), generator=g, dtype=torch.int32)
    return fixed


def test_the_guess_step_merges_what_was_seen_and_clears_the_stats():
    fixed = fixed_rows(6)
    fixed[:6, D + WORD_MAX] = torch.tensor([0, 129, 0, 0x7FC00000 >> 23, 121, 0], dtype=torch.int32) << 23
    fixed[:6, D + WORD_SEEN] = torch.tensor([0, 127, 0, 0, 125, 136], dtype=torch.int32)
    fixed[6, CONTROL_SKIP] = 1
    words = fixed[:, :D].clone()
    sinks = fixed[7:].clone()
    fp.post_reference(fixed, torch.empty(0, D), torch.empty(6, D), torch.zeros(1, 1), torch.zeros(1),
                      STEP_GUESS, 20)
    seen = [0, 129, 0, 255, 125, 136]
    assert fixed[:6, D + WORD_SEEN].tolist() == seen
    assert torch.equal(fixed[:6, D + WORD_SCALE], fp.guessed_scale(torch.tensor(seen, dtype=torch.int32), 20) << 23)
    # unseen rows get the lower median of 125 129 136 255: 129
    assert (fixed[[0, 2, 5], D + WORD_SCALE] >> 23).tolist() == [20 - fp.MARGIN_BITS + 253 - 129,
                                                                 20 - fp.MARGIN_BITS + 253 - 129,
                                                                 20 - fp.MARGIN_BITS + 253 - 136]
    assert not fixed[:6, D + WORD_MAX:D + WORD_COUNT + 1].any() and int(fixed[6, CONTROL_SKIP]) == 0
    assert torch.equal(fixed[:6, :D], words[:6]) and torch.equal(fixed[7:], sinks)


def test_the_check_step_keeps_a_fitting_guess_and_redoes_a_wrong_one():
    """After a group's first launch: guesses that fit (within the slack above the measured
    max) set the skip word and change nothing; one row's overflow (or, alone, a row's guess far
    too high) makes every row take its exact scale, with its words, max and count cleared."""
    def fixed_with(offsets):  # the guess this many bits above each row's exact scale
        fixed = fixed_rows(4)
        adds = torch.tensor([5, 1, 300, 0], dtype=torch.int32)
        fixed[:4, D + WORD_COUNT] = adds
        e = fixed[:4, D + WORD_MAX] >> 23
        exact = fp.scale_for(fp.value_bits_bound(adds), e)
        fixed[:4, D + WORD_SCALE] = (exact + torch.tensor(offsets, dtype=torch.int32)) << 23
        return fixed, exact

    def check(fixed):
        fp.post_reference(fixed, torch.empty(0, D), torch.empty(4, D), torch.zeros(1, 1),
                          torch.zeros(1), STEP_CHECK, 0)

    fixed, _ = fixed_with([0, -fp.SLACK_BITS, -3, 40])  # row 3 has no add: its guess is free
    kept = fixed.clone()
    check(fixed)
    assert int(fixed[4, CONTROL_SKIP]) == 1
    fixed[4, CONTROL_SKIP] = kept[4, CONTROL_SKIP]
    assert torch.equal(fixed, kept)
    for offsets in ([0, 1, 0, 0], [0, 0, -fp.SLACK_BITS - 1, 0]):  # an overflow; a wasted guess
        fixed, exact = fixed_with(offsets)
        seen, sinks = fixed[:4, D + WORD_SEEN].clone(), fixed[5:].clone()
        check(fixed)
        assert int(fixed[4, CONTROL_SKIP]) == 0
        assert torch.equal(fixed[:4, D + WORD_SCALE] >> 23, exact)
        assert not fixed[:4, :D + 1].any() and not fixed[:4, D + WORD_MAX:D + WORD_COUNT + 1].any()
        assert torch.equal(fixed[:4, D + WORD_SEEN], seen) and torch.equal(fixed[5:], sinks)


def test_folds_add_the_groups_in_order_and_keep_a_nan_row():
    """Three groups folded: the total is each group's integer sums times 2^-k in natural column
    order, added in group order; a row with a non-finite max in the second group ends NaN; a
    fold that is not the last clears its words, max and count and keeps the max in the seen
    word."""
    s_kv = 4
    total = torch.empty(s_kv, D)
    dkv = torch.full((s_kv, D), float("nan"), dtype=torch.bfloat16)
    d_sink_acc, d_sink = torch.randn(5, 3), torch.empty(3)
    order = [dkv_acc_column(c) for c in range(D)]
    want = torch.zeros(s_kv, D, dtype=torch.float64)
    for g, step in enumerate((FOLD_FIRST, 0, FOLD_LAST)):
        fixed = fixed_rows(s_kv, seed=g)
        fixed[:s_kv, :D] = torch.randint(-2**20, 2**20, (s_kv, D), dtype=torch.int32)  # S_hi + borrow: small pairs
        if g == 1:
            fixed[2, D + WORD_MAX] = 0x7F800000
        sums = fp.integer_sums(fixed[:s_kv, :D].clone()).double()
        want += sums[:, order] * torch.exp2(127.0 - (fixed[:s_kv, D + WORD_SCALE] >> 23).double())[:, None]
        seen = torch.maximum(fixed[:s_kv, D + WORD_SEEN], fixed[:s_kv, D + WORD_MAX] >> 23)
        fp.post_reference(fixed, total, dkv, d_sink_acc, d_sink, STEP_FOLD | step, 0)
        if not step & FOLD_LAST:
            assert not fixed[:s_kv, :D].any() and not fixed[:s_kv, D + WORD_MAX:D + WORD_COUNT + 1].any()
            assert torch.equal(fixed[:s_kv, D + WORD_SEEN], seen)
    assert torch.isnan(dkv[2]).all() and not torch.isnan(dkv[[0, 1, 3]]).any()
    keep = [0, 1, 3]
    assert torch.allclose(dkv[keep].double(), want[keep], rtol=2**-8, atol=0)
    assert torch.equal(d_sink, d_sink_acc[0] + d_sink_acc[1] + d_sink_acc[2] + d_sink_acc[3] + d_sink_acc[4])


def test_the_sample_spreads_over_the_call():
    assert fp.sample_rows(0) == range(0) and fp.sample_rows(3) == range(0, 3)
    assert fp.sample_rows(20) == range(0, 20, 5)  # SAMPLE_ROWS 4 here
    for s_q in (1, 4, 5, 17, 4096):
        rows = fp.sample_rows(s_q)
        assert 0 < len(rows) <= fp.SAMPLE_ROWS and rows[0] == 0 and rows[-1] >= s_q - rows.step


@pytest.mark.parametrize("d_qk", [64, 512, 576])
def test_fixed_rows_start_on_128_byte_lines(d_qk):
    """``dkv_fixed`` is a zeroed view whose rows each start on an L2 line: a stride the main
    kernel (a multiple of 4 words) and the postprocess (of 8) both accept."""
    fixed = fp.fixed_rows(7, d_qk, torch.device("cpu"))
    stride = fp.row_stride(d_qk)
    assert fixed.shape == (7, row_words(d_qk)) and fixed.stride() == (stride, 1)
    assert stride % fp.ROW_ALIGN_WORDS == 0 and stride % 8 == 0
    assert row_words(d_qk) <= stride < row_words(d_qk) + fp.ROW_ALIGN_WORDS
    assert {(fixed[r].data_ptr() - fixed.data_ptr()) % 128 for r in range(7)} == {0}
    assert fixed.dtype == torch.int32 and not fixed.any()
