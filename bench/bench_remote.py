"""The remote tier on loopback: a first call served from Redis vs a local hit, and a catalog pull.

    python bench/bench_remote.py --cache <prebuilt cache> [--arch sm_90a] [--runs 10] \
        --out bench/results/remote_cpu.json

A real ``redis-server`` is started on a free loopback port and filled with ``dsa-aot push``
from ``--cache`` (a ``dsa-aot prebuild`` output). Then:

1. first call, fresh process each run: ``Loader.try_load`` of one spec up to the point where
   bytes go to the driver (TileLang: ``cuLibraryLoadData``'s library handle; CuTe DSL: the
   ``dlopen`` of the library), which is spied on and stops the call there (this machine has no
   GPU). ``local``: the spec is in the local cache. ``remote``: the local cache is empty and
   the remote serves it (manifest lookup and blob fetch over the read client, sha256 of every
   byte, the load from those verified bytes; the atomic publish into the local cache runs on a
   background thread, timed as ``local_publish`` but off the call's path, and the run checks it
   landed). torch and ``dsa_aot`` are imported, and the toolchain fingerprint and the spec's
   key computed, before the clock starts in every case (a process pays them alike with or
   without a remote);
2. ``dsa-aot pull --arch A`` of the whole catalog into an empty cache (subprocess wall time and
   the summary's own), repeated ``--pull-runs`` times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SPECS = ("fwd-sm_90a-d512-h16-noncompact-tilelang", "fwd-sm_90a-d576-h64-noncompact-cutedsl",
         "bwd-sm_90a-d576-h64-noncompact-cutedsl")

CHILD = textwrap.dedent("""
    import json, sys, time
    T = time.perf_counter
    import torch  # a training process has torch and the API imported before its first call
    import dsa_aot
    from dsa_aot.backends.cutedsl import runtime as cute_runtime
    from dsa_aot.backends.tilelang import launch
    from dsa_aot.cache import remote as remote_mod, store as store_mod
    from dsa_aot.loader import Loader
    from dsa_aot.specs.models import KernelSpec

    class Reached(Exception):
        pass
    marks = {}
    def stop(*args, **kwargs):
        marks.setdefault("driver", T())
        raise Reached()
    launch._libcuda = stop
    cute_runtime.open_cute_library = stop
    spans = {}
    def timed(name, fn):
        def wrapper(*a, **k):
            t = T()
            try:
                return fn(*a, **k)
            finally:
                spans[name] = spans.get(name, 0.0) + (T() - t) * 1e3
        return wrapper
    R, S = remote_mod.RemoteStore, store_mod.ArtifactStore
    R._client = timed("redis_import_and_client", R._client)
    R._reader = timed("read_client", R._reader)
    R.lookup, R.fetch = timed("remote_lookup", R.lookup), timed("remote_fetch_verify", R.fetch)
    S.publish_entry, S._index_update = timed("local_publish", S.publish_entry), timed("index_update", S._index_update)
    spec = KernelSpec.from_id(sys.argv[1])
    loader = Loader()
    loader.toolchain()  # the toolchain and the spec's key: paid alike with or without a remote
    loader.key_of(spec)
    t0 = T()
    hit = loader.try_load(spec, 0)
    t1 = T()
    print(json.dumps({"ms_to_driver": (marks.get("driver", t1) - t0) * 1e3, "reached_driver": "driver" in marks,
                      "spans_ms": spans}))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSA_AOT_")}
    env.update(TILELANG_PRINT_ON_COMPILATION="0", **extra)
    return env


def _cli(*args: str, env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dsa_aot.cli", *args], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"dsa-aot {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return wall, proc.stdout


def _first_call(spec_id: str, env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, spec_id], env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"first-call child failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _summary(rows: list[dict]) -> dict:
    ms = [r["ms_to_driver"] for r in rows]
    spans = {k: round(statistics.median(r["spans_ms"].get(k, 0.0) for r in rows), 3)
             for k in sorted({k for r in rows for k in r["spans_ms"]})}
    return {"median_ms": round(statistics.median(ms), 2), "min_ms": round(min(ms), 2), "max_ms": round(max(ms), 2),
            "reached_driver": all(r["reached_driver"] for r in rows), "spans_median_ms": spans}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, required=True, help="a prebuilt cache (dsa-aot prebuild output)")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--runs", type=int, default=10, help="fresh processes per first-call case")
    ap.add_argument("--pull-runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    port = _free_port()
    server = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                               "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work)],
                              stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        time.sleep(0.3)
        push_wall, push_out = _cli("push", "-q", "--json", "--arch", args.arch,
                                   env=_env(DSA_AOT_CACHE_DIR=str(args.cache), DSA_AOT_REMOTE_URL=url))
        pushed = json.loads(push_out)
        print(f"pushed {pushed['counts']} ({pushed['bytes'] / 2**20:.1f} MiB) in {push_wall:.2f} s", file=sys.stderr)

        first: dict[str, dict] = {}
        for spec_id in SPECS:
            runs: dict[str, list] = {"local": [], "remote": []}
            for i in range(args.runs):  # interleaved, so load drifts hit every case alike
                runs["local"].append(_first_call(spec_id, _env(DSA_AOT_CACHE_DIR=str(args.cache))))
                empty = work / f"empty-{spec_id}-{i}"
                runs["remote"].append(_first_call(spec_id, _env(DSA_AOT_CACHE_DIR=str(empty), DSA_AOT_REMOTE_URL=url)))
                if not any(empty.rglob("meta.json")):
                    raise SystemExit(f"{spec_id}: the remote run published nothing locally")
            first[spec_id] = {case: _summary(rows) for case, rows in runs.items()}
            first[spec_id]["remote_minus_local_ms"] = round(first[spec_id]["remote"]["median_ms"]
                                                            - first[spec_id]["local"]["median_ms"], 2)
            print(f"{spec_id}: {first[spec_id]}", file=sys.stderr)

        pulls = []
        for i in range(args.pull_runs):
            wall, out = _cli("pull", "-q", "--json", "--arch", args.arch,
                             env=_env(DSA_AOT_CACHE_DIR=str(work / f"pull-{i}"), DSA_AOT_REMOTE_URL=url))
            summary = json.loads(out)
            pulls.append({"process_wall_s": round(wall, 3), "pull_wall_s": summary["wall_seconds"],
                          "counts": summary["counts"], "bytes": summary["bytes"]})
            print(f"pull {i}: {pulls[-1]}", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(work, ignore_errors=True)

    result = {"command": "python bench/bench_remote.py " + " ".join(sys.argv[1:]),
              "date": datetime.date.today().isoformat(), "host": platform.node(), "cpus": os.cpu_count(),
              "python": platform.python_version(), "arch": args.arch, "runs": args.runs,
              "push": {"process_wall_s": round(push_wall, 3), "wall_s": pushed["wall_seconds"],
                       "counts": pushed["counts"], "bytes": pushed["bytes"]},
              "first_call": first, "pull": pulls}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
