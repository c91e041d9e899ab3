"""Cost of padding ``topk_idxs`` to a top-k bucket (:func:`dsa_aot.runners.pad_topk`), the per-call
work a backend specialised on the width adds (the cudnn backend's buckets 512 / 1024 / 2048).

    python bench/bench_topk_pad.py [--device cuda] [--out results.json]

Per (S_q, K -> bucket, layout): the median of 50 timed calls (CUDA events on a GPU, wall clock on
the CPU), after 5 warm-up calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dsa_aot.runners import pad_topk

CASES = [(4096, 2047, 2048), (4096, 1000, 1024), (4096, 300, 512), (16384, 1536, 2048), (1, 2047, 2048)]


def _time(fn, device: str, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    samples = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for s_q, k, width in CASES:
        idx = torch.randint(0, 8192, (s_q, k), dtype=torch.int32, device=args.device)
        lengths = torch.randint(0, k + 1, (s_q,), dtype=torch.int32, device=args.device)
        for layout, length in (("noncompact", None), ("compact", lengths)):
            us = _time(lambda: pad_topk(idx, length, width), args.device)
            rows.append({"s_q": s_q, "k": k, "bucket": width, "layout": layout, "us": round(us, 1),
                         "bytes_written": s_q * width * 4})
            print(f"S_q {s_q:6d}  K {k:5d} -> {width:5d}  {layout:10s}  {us:8.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
