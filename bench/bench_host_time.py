"""Host (CPU) time of one backward call, by segment, with the GPU kept busy so that nothing waits.

    DSA_AOT_PREBUILT_DIR=<prebuilt cache> DSA_AOT_REQUIRE_PREBUILT=1 \\
        python bench/bench_host_time.py --rows 0 6 --out bench/results/h100_host_time.json

A call's GPU time is its host time wherever the GPU finishes a kernel before the host has queued
the next one: the fixed-point deterministic mode's measuring launch takes 0.06-0.3 ms on the GPU,
and whatever guesses the first group's scales from it has to be queued before the group's
launch. This measures the queueing alone: ahead of every call a ``torch.cuda._sleep`` keeps the
GPU busy for longer than the call's host work, and the host clock is read at the call's start,
at the runner's entry and exit, before and after each main-kernel launch of the fixed-point mode
(1: the sample, then per group its launch and its re-launch) and each launch of its postprocess
(per group: the guess, the check, the fold) and at the end.
Per row of :data:`bench_deterministic.ROWS` (``--rows`` picks some) and mode (fast,
``fixed_point``, ``stored_rows``): the median over ``--reps`` calls of the call's host time and of
each segment between two marks, in microseconds. Writes JSON and a Markdown table (same name,
``.md``) with command, GPU, toolchain and date.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_deterministic import ROWS  # noqa: E402
from common import environment, make_inputs, write_results  # noqa: E402

import dsa_aot  # noqa: E402
import dsa_aot.runners as runners  # noqa: E402
from dsa_aot import settings  # noqa: E402

MODES = ("fast", "fixed_point", "stored_rows")
#: GPU cycles of the sleep ahead of each call (about 10 ms: longer than any call's host work).
SLEEP_CYCLES = 20_000_000


def segments(marks: list[tuple[str, int]]) -> dict[str, float]:
    """Microseconds between consecutive marks ``(name, perf_counter_ns)``, keyed ``"a..b"`` (a
    name that repeats gets its occurrence number: ``launch 2>``)."""
    return {f"{a}..{b}": (tb - ta) / 1e3 for (a, ta), (b, tb) in zip(marks, marks[1:])}


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over the runs that have it, rounded to 0.1 us, in first-seen order."""
    keys = list(dict.fromkeys(k for run in runs for k in run))
    return {k: round(statistics.median(run[k] for run in runs if k in run), 1) for k in keys}


class Marks:
    """The host clock at named points of one call: the runner's entry and exit and, in the
    fixed-point mode, each main-kernel launch (patched in for the duration of a ``with``)."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, int]] = []
        self._launches = 0
        self._posts = 0

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter_ns()))

    def __enter__(self) -> Marks:
        self._call, self._dkv = runners.StagedBwd.__call__, runners.fixed_point_dkv
        call, dkv, marks = self._call, self._dkv, self

        def marked_call(runner, *args, **kwargs):
            marks.mark("runner")
            result = call(runner, *args, **kwargs)
            marks.mark("runner end")
            return result

        def marked_dkv(launch, post, *args, **kwargs):
            def marked_launch(rows, fixed, measure):
                marks._launches += 1
                marks.mark(f"launch {marks._launches}>")
                launch(rows, fixed, measure)
                marks.mark(f"launch {marks._launches}<")

            def marked_post(*post_args):
                marks._posts += 1
                marks.mark(f"post {marks._posts}>")
                post(*post_args)
                marks.mark(f"post {marks._posts}<")
            return dkv(marked_launch, marked_post, *args, **kwargs)

        runners.StagedBwd.__call__ = marked_call
        runners.fixed_point_dkv = marked_dkv
        return self

    def __exit__(self, *exc) -> None:
        runners.StagedBwd.__call__, runners.fixed_point_dkv = self._call, self._dkv

    def run(self, call) -> tuple[float, dict[str, float]]:
        """One call behind a GPU sleep: its host microseconds and its segments."""
        self.marks, self._launches, self._posts = [], 0, 0
        torch.cuda._sleep(SLEEP_CYCLES)
        self.mark("start")
        call()
        self.mark("end")
        torch.cuda.synchronize()
        return (self.marks[-1][1] - self.marks[0][1]) / 1e3, segments(self.marks)


def markdown(doc: dict) -> str:
    env = doc["environment"]
    lines = [f"# Host time of a backward call, {env['gpu']}, {env['date']}", "",
             f"`{doc['command']}`; torch {env['torch']}, CUDA {env['cuda']}, "
             f"nvidia-cutlass-dsl {env['nvidia-cutlass-dsl']}. The GPU sleeps ahead of every call, so "
             "these are the host's microseconds to queue it (median of the calls); `launch n>` / "
             "`launch n<`: before and after the fixed-point mode's n-th main-kernel launch (1: the "
             "sample, 2 and 3: the first group and its re-launch); `post n>` / `post n<`: its n-th "
             "postprocess launch (1-3: the first group's guess, check and fold).", "",
             "| H | D_qk | K | mode | host us | segments (us) |", "|---|---|---|---|---|---|"]
    for r in doc["records"]:
        segs = ", ".join(f"{k} {v}" for k, v in r["segments_us"].items())
        lines.append(f"| {r['heads']} | {r['d_qk']} | {r['topk']} | {r['mode']} | {r['host_us']} | {segs} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/h200_host_time.json"))
    ap.add_argument("--rows", type=int, nargs="+", help="only these row numbers (0-based) of ROWS")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_host_time.py needs a CUDA GPU", file=sys.stderr)
        return 2
    doc = {"command": " ".join(["python", *sys.argv]), "environment": environment(), "records": []}
    for n in args.rows if args.rows is not None else range(len(ROWS)):
        s_q, s_kv, h, d, k = ROWS[n]
        x = make_inputs(s_q, s_kv, h, d, k)
        out, lse = dsa_aot.sparse_mla_fwd(x["q"], x["kv"], x["topk_idxs"], attn_sink=x["attn_sink"])
        for mode in MODES:
            def call(det=mode != "fast"):
                return dsa_aot.sparse_mla_bwd(x["q"], x["kv"], out, x["dout"], lse, x["topk_idxs"],
                                              attn_sink=x["attn_sink"], deterministic=det)
            with settings.scope(deterministic_mode="auto" if mode == "fast" else mode), Marks() as m:
                for _ in range(3):  # warm-up: loads, allocator
                    call()
                torch.cuda.synchronize()
                runs = [m.run(call) for _ in range(args.reps)]
            rec = {"s_q": s_q, "s_kv": s_kv, "heads": h, "d_qk": d, "topk": k, "mode": mode,
                   "host_us": round(statistics.median(t for t, _ in runs), 1),
                   "segments_us": medians([s for _, s in runs])}
            doc["records"].append(rec)
            print(json.dumps(rec), flush=True)
    write_results(args.out, doc, markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
