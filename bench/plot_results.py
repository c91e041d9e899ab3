"""Draw a benchmark result file as a chart: TFLOPS per shape, our backends beside the peers.

    python bench/plot_results.py bench/results/h200.json [--out bench/results/h200.png]

One panel per op (forward, backward); per shape one bar per dsa-aot backend (and variant) and
one for the peer (FlashMLA forward, cuDNN frontend backward) as measured in the same run as our
fastest row of that shape. Where that row carries a paired ratio (the median of per-call ratios
of the two called alternately), the peer's bar is our TFLOPS divided by it: the peer at the same
clocks as ours, rather than its own median taken seconds apart.
Needs matplotlib (a development tool, not a dependency of the package).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bwd_flops, fwd_flops  # noqa: E402

PEER_NAMES = {"fwd": "FlashMLA", "bwd": "cuDNN frontend"}


def series(records: list[dict], op: str) -> tuple[list[str], dict[str, list[float | None]]]:
    """Shape labels and, per bar series (backend or peer), TFLOPS per shape (None: not run)."""
    rows = [r for r in records if r["op"] == op]
    shapes = list(dict.fromkeys((r["s_q"], r["s_kv"], r["heads"], r["d_qk"], r["topk"]) for r in rows))
    names = list(dict.fromkeys(r["backend"].split("/", 1)[-1] for r in rows))
    bars: dict[str, list[float | None]] = {n: [None] * len(shapes) for n in names}
    peer = [None] * len(shapes)
    flops = fwd_flops if op == "fwd" else bwd_flops
    best = [0.0] * len(shapes)  # the peer bar is the one measured beside our fastest row
    for r in rows:
        i = shapes.index((r["s_q"], r["s_kv"], r["heads"], r["d_qk"], r["topk"]))
        bars[r["backend"].split("/", 1)[-1]][i] = r["tflops"]
        if r.get("peer_ms") and r["tflops"] > best[i]:
            best[i] = r["tflops"]
            if r.get("paired_ratio"):
                peer[i] = r["tflops"] / r["paired_ratio"]
            else:
                peer[i] = flops(r["s_q"], r["heads"], r["topk"], r["d_qk"]) / r["peer_ms"] / 1e9
    if any(v is not None for v in peer):
        bars[PEER_NAMES[op]] = peer
    labels = [f"H{h} D{d} K{k}\nS_q {sq // 1024}k S_kv {skv // 1024}k" for sq, skv, h, d, k in shapes]
    return labels, bars


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = json.loads(args.results.read_text())
    ops = [op for op in ("fwd", "bwd") if any(r["op"] == op for r in records)]
    fig, axes = plt.subplots(len(ops), 1, figsize=(13, 4.2 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        labels, bars = series(records, op)
        width = 0.8 / max(len(bars), 1)
        for j, (name, values) in enumerate(bars.items()):
            xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, [v or 0 for v in values], width, label=name,
                   hatch="//" if name in PEER_NAMES.values() else None)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("TFLOPS")
        ax.set_title(f"sparse MLA {'forward' if op == 'fwd' else 'backward'}")
        ax.legend(fontsize=8, ncols=len(bars))
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out = args.out or args.results.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
