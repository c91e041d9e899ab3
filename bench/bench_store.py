"""Hot-cache lookup throughput: the artifact store and the per-call memo, from 8 threads.

    python bench/bench_store.py [--out bench/results/store_<host>.json]

1. ``ArtifactStore.lookup`` + sha256-checked ``read_file`` of a 6 KB cubin, 8 threads released
   together (the path a process takes once per variant);
2. the ops memo (``dsa_aot.ops._kernel``), 8 threads (the path every call takes).

Each is the best of ``--rounds`` rounds; the machine's load is reported beside the numbers.
Correctness under threads is asserted by ``tests/reliability/test_load.py``; this script only
measures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

THREADS = 8


def hammer(fn, per_thread: int) -> float:
    """Calls per second of ``fn`` from :data:`THREADS` threads released together."""
    start = threading.Barrier(THREADS + 1)

    def worker() -> None:
        start.wait()
        for _ in range(per_thread):
            fn()

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return THREADS * per_thread / (time.perf_counter() - t0)


def store_rate(rounds: int) -> float:
    from dsa_aot.cache.store import ArtifactStore

    with tempfile.TemporaryDirectory(prefix="dsa-aot-bench-") as tmp:
        store = ArtifactStore(Path(tmp) / "cache")
        cubin = b"\x7fELF" + os.urandom(6000)
        key, arch, spec_id = "0123456789abcdef", "sm_90a", "fwd-sm_90a-d576-h64-noncompact-tilelang"
        store.publish(key, arch, spec_id, {"fwd.cubin": cubin, "fwd.cu": os.urandom(30000)},
                      {"stages": [{"name": "fwd", "params": list(range(12))}], "x": "y" * 400})
        want = hashlib.sha256(cubin).hexdigest()

        def lookup_and_read() -> None:
            entry = store.lookup(key, arch, spec_id)
            assert hashlib.sha256(store.read_file(entry, "fwd.cubin")).hexdigest() == want

        return max(hammer(lookup_and_read, 1250) for _ in range(rounds))


def memo_rate(rounds: int) -> float:
    import torch

    from dsa_aot import ops

    cpu = torch.device("cpu")
    ops._clear()
    ops._kernel("fwd", cpu, 576, 64, "noncompact")
    return max(hammer(lambda: ops._kernel("fwd", cpu, 576, 64, "noncompact"), 12_500)
               for _ in range(rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args()
    result = {
        "command": "python bench/bench_store.py" + (f" --out {args.out}" if args.out else ""),
        "host": platform.node(), "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
        "store_lookup_read_per_s": round(store_rate(args.rounds)),
        "ops_memo_per_s": round(memo_rate(args.rounds)),
    }
    print(f"store lookup + sha256-checked read, {THREADS} threads: "
          f"{result['store_lookup_read_per_s']:,}/s")
    print(f"ops memo, {THREADS} threads: {result['ops_memo_per_s']:,}/s "
          f"(load average {result['load_avg_1m']:.2f} on {result['cpus']} cpus)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
