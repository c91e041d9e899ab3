"""Cold-start and dispatch cost of a prebuilt hit, beside the JIT compile time it replaces.

    DSA_AOT_PREBUILT_DIR=<prebuilt cache> DSA_AOT_REQUIRE_PREBUILT=1 python bench/bench_startup.py
    python bench/bench_startup.py --import-only --wheel bench/results/import_cpu.json   # no GPU
    python bench/bench_startup.py --first-call-cpu --wheel --python .lean-venv/bin/python \
        --prebuilt <prebuilt root> bench/results/first_call_cpu.json                      # no GPU

0. ``--import-only`` (any machine): ``import dsa_aot`` after ``import torch`` in fresh
   processes (median, max; wall and CPU time, the latter robust to a busy machine), what it
   imports (no pydantic), and where the CPU time goes (the API module ``dsa_aot.ops`` with the
   serving path; then what a lookup left to the loader adds: pydantic itself, the loader and its
   record models); then the first call's input check (its part before the lookup). ``--wheel`` measures the checkout's
   wheel installed by pip (bytecode compiled) instead of the installed (e.g. editable) package;
0b. ``--first-call-cpu`` (any machine): the first call's kernel lookup from a prebuilt root up
   to the CUDA driver, in fresh processes of ``--python`` (a serving venv without compilers:
   the serving path serves it by runtime identity, without pydantic), per case: TileLang only, the default ranking (CuTe DSL
   forward), and TileLang after ``dsa_aot.preload()``; ``--prebuilt`` is a root holding
   ``fwd-sm_90a-d512-h16-noncompact-{tilelang,cutedsl}`` (``dsa-aot prebuild --arch sm_90a --only ...``);
1. fresh process: time from the first ``sparse_mla_fwd`` call to its result (a prebuilt hit:
   the serving path's lookup and checks, sha256 of every file, module load, launch; or the
   loader's, with pydantic's import, when the serving path defers), which path served it, and
   which compiler modules got imported (none may be); ``--fresh-cache`` gives each process an
   empty cache dir (a fresh container: nothing remembered); ``--preload`` calls
   ``dsa_aot.preload()`` at startup, before that clock (its time is reported apart);
2. per-call dispatch overhead of ``sparse_mla_fwd`` over the raw cubin launch, on a tiny shape;
3. the JIT compile time of the same variant, read from the artifact's manifest (it was
   measured when the artifact was built).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMPILERS = ("tilelang", "tvm", "tvm_ffi", "cutlass")

IMPORT_CHILD = textwrap.dedent("""
    import json, sys, time
    T, C = time.perf_counter, time.process_time
    t0 = T()
    import torch
    t1, c1 = T(), C()
    before = set(sys.modules)
    import dsa_aot
    t2, c2 = T(), C()
    new = sorted(set(sys.modules) - before)
    from dsa_aot.validate import check_fwd
    q = torch.randn(4, 16, 576).bfloat16()
    kv = torch.randn(8, 576).bfloat16()
    idx = torch.randint(0, 8, (4, 4), dtype=torch.int32)
    before = set(sys.modules)
    t3 = T()
    check_fwd(q, kv, idx, None, None, None)
    t4 = T()
    by_check = sorted(set(sys.modules) - before)
    print(json.dumps({
        "import_torch_ms": (t1 - t0) * 1e3, "import_dsa_aot_ms": (t2 - t1) * 1e3,
        "import_dsa_aot_cpu_ms": (c2 - c1) * 1e3,
        "first_check_fwd_ms": (t4 - t3) * 1e3,
        "modules_imported": len(new), "dsa_aot_modules": [m for m in new if m.startswith("dsa_aot")],
        "pydantic_imported": "pydantic" in new,
        "compiler_modules_imported": [m for m in new if m.split(".")[0] in %r],
        "modules_imported_by_first_check": by_check,
        "torch_ops_defined": all(hasattr(torch.ops.dsa_aot, n) for n in ("sparse_mla_fwd", "sparse_mla_bwd")),
        "api_bound": all(n in vars(dsa_aot) for n in dsa_aot.__all__)}))
""" % (COMPILERS,))

# Where ``import dsa_aot``'s time goes, and what the first kernel lookup adds: the package is
# imported before torch (so nothing is bound), then each layer in dependency order, each timed
# (CPU time) on top of the previous ones. The last two are not part of ``import dsa_aot``.
IMPORT_BREAKDOWN = textwrap.dedent("""
    import json, time
    import dsa_aot
    import torch
    T = time.process_time  # CPU time of this process: what a busy machine's other work leaves alone
    marks = [("start", T())]
    import dsa_aot.ops
    marks.append(("dsa_aot.ops (API, input checks, torch.library ops)", T()))
    from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
    marks.append(("first lookup: pydantic (its own import)", T()))
    import dsa_aot.loader
    marks.append(("first lookup: dsa_aot.loader and its record models", T()))
    print(json.dumps({name: (t - marks[i][1]) * 1e3 for i, (name, t) in enumerate(marks[1:])}))
""")

# The first call from a prebuilt root up to the CUDA driver, on a machine without a GPU: the
# device is faked (capability 9.0), and the first ``ctypes.CDLL`` after the clock starts (TileLang:
# libcuda for ``cuLibraryLoadData``; CuTe DSL: the ``dlopen`` of the sealed memfd) stops the call.
# Everything before it runs for real: the loader's import, the toolchain, the catalog ranking, the
# runtime identity, ``meta.json`` and manifest validation, every file's sha256, the launch records.
FIRST_CALL_CHILD = textwrap.dedent("""
    import ctypes, json, sys, time
    T, C = time.perf_counter, time.process_time
    import torch
    import dsa_aot
    from dsa_aot import ops

    class Reached(BaseException):  # not an Exception: the loader's miss handling must not catch it
        pass
    reached = []
    def stop(self, name, *args, **kwargs):
        reached.append((T(), C(), str(name)))
        raise Reached()
    torch.cuda.get_device_capability = lambda index=None: (9, 0)
    ops._current_device = lambda: 0
    p0, q0 = T(), C()
    if sys.argv[1] == "preload":  # a version without preload() binds the loader at import
        getattr(dsa_aot, "preload", lambda: None)()
    p1, q1 = T(), C()
    ctypes.CDLL.__init__ = stop
    before = set(sys.modules)
    t0, c0 = T(), C()
    try:
        ops._kernel("fwd", torch.device("cuda", 0), 512, 16, "noncompact")
    except Reached:
        pass
    t1, c1, lib = reached[0] if reached else (T(), C(), None)
    new = sorted(set(sys.modules) - before)
    print(json.dumps({"ms": (t1 - t0) * 1e3, "cpu_ms": (c1 - c0) * 1e3, "preload_cpu_ms": (q1 - q0) * 1e3,
                      "reached": lib, "modules_imported": len(new), "pydantic_imported": "pydantic" in new,
                      "compiler_modules_imported": [m for m in new if m.split(".")[0] in %r]}))
""" % (COMPILERS,))

CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    import dsa_aot
    t2 = time.perf_counter()
    if sys.argv[1:] == ["preload"]:  # at startup, before the clock of the first call
        dsa_aot.preload()
    t2b = time.perf_counter()
    q = torch.randn(64, 64, 576, device="cuda").to(torch.bfloat16)
    kv = torch.randn(4096, 576, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, 4096, (64, 2048), device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    before = set(sys.modules)
    t3 = time.perf_counter()
    out, lse = dsa_aot.sparse_mla_fwd(q, kv, idx)
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    by_first_call = sorted(set(sys.modules) - before)
    out, lse = dsa_aot.sparse_mla_fwd(q, kv, idx)
    torch.cuda.synchronize()
    t5 = time.perf_counter()
    mods = sorted(m for m in sys.modules if m.split(".")[0] in ("tilelang", "tvm", "tvm_ffi", "cutlass"))
    spec = next(iter(dsa_aot.ops._KERNELS.values())).spec
    print(json.dumps({"import_torch_ms": (t1 - t0) * 1e3, "import_dsa_aot_ms": (t2 - t1) * 1e3,
                      "preload_ms": (t2b - t2) * 1e3, "first_call_ms": (t4 - t3) * 1e3, "second_call_ms": (t5 - t4) * 1e3,
                      "compiler_modules_imported": mods, "spec": spec.id, "finite": bool(torch.isfinite(out.float()).all()),
                      "served_by": "loader" if "dsa_aot.loader" in by_first_call else "serving path",
                      "modules_imported_by_first_call": len(by_first_call),
                      "pydantic_imported_by_first_call": "pydantic" in by_first_call}))
""")


BREAKDOWN = textwrap.dedent("""
    import json, time
    import torch
    q = torch.randn(64, 64, 576, device="cuda").to(torch.bfloat16)
    kv = torch.randn(4096, 576, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, 4096, (64, 2048), device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    T = time.perf_counter
    marks = [("start", T())]
    import dsa_aot.ops
    marks.append(("import dsa_aot.ops", T()))
    from dsa_aot.loader import get_loader
    marks.append(("import dsa_aot.loader (pydantic, record models)", T()))
    loader = get_loader()
    loader.fingerprint()
    marks.append(("toolchain fingerprint", T()))
    loader.ranking("fwd")
    marks.append(("catalog ranking", T()))
    kernel, res = loader.resolve("fwd", "sm_90a", 576, 64, "noncompact", 0)
    marks.append(("resolve (lookup, sha256, module load)", T()))
    dsa_aot.ops.sparse_mla_fwd(q, kv, idx)
    torch.cuda.synchronize()
    marks.append(("first sparse_mla_fwd + sync", T()))
    print(json.dumps({name: round((t - marks[i][1]) * 1e3, 2) for i, (name, t) in enumerate(marks[1:])}))
""")


def dispatch_overhead(n: int = 40000, rounds: int = 8) -> dict[str, object]:
    import torch

    import dsa_aot
    from dsa_aot import ops

    q = torch.randn(1, 64, 576, device="cuda").to(torch.bfloat16)
    kv = torch.randn(256, 576, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, 256, (1, 64), device="cuda", dtype=torch.int32)
    dsa_aot.sparse_mla_fwd(q, kv, idx)
    kernel = ops._KERNELS[("fwd", q.device.index, 576, 64, "noncompact", False)]
    raw = kernel.kernel
    sink = ops._sink(64, q.device)
    out = torch.empty(1, 64, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(1, 64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream  # fetched once: the raw-launch floor
    args = {"q": q.data_ptr(), "kv": kv.data_ptr(), "topk_idxs": idx.data_ptr(), "topk_length": 0,
            "attn_sink": sink.data_ptr(), "out": out.data_ptr(), "lse": lse.data_ptr(),
            "softmax_scale": 576 ** -0.5, "s_q": 1, "s_kv": 256, "topk": 64}

    def loop(fn, n_iter: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n_iter):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n_iter * 1e6

    def alloc_and_launch():
        torch.empty(1, 64, 512, device="cuda", dtype=torch.bfloat16)
        torch.empty(1, 64, device="cuda")
        raw.launch(stream, args)

    scale = 576 ** -0.5
    cases = {"raw_launch_us": lambda: raw.launch(stream, args),
             "raw_launch_plus_alloc_us": alloc_and_launch,
             "runner_us": lambda: kernel(q, kv, idx, None, sink, scale),  # allocation, stream, launch
             "sparse_mla_fwd_us": lambda: dsa_aot.sparse_mla_fwd(q, kv, idx)}
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):  # interleaved rounds; the minimum is the least disturbed one
        for name, fn in cases.items():
            samples[name].append(loop(fn, n // rounds))
    results = {name: min(v) for name, v in samples.items()}
    results["overhead_over_raw_plus_alloc_us"] = results["sparse_mla_fwd_us"] - results["raw_launch_plus_alloc_us"]
    results["api_over_runner_us"] = results["sparse_mla_fwd_us"] - results["runner_us"]  # checks, lookup, binding
    results["rounds"] = {name: [round(x, 2) for x in v] for name, v in samples.items()}
    return results


def jit_seconds() -> float | None:
    from dsa_aot.loader import get_loader
    from dsa_aot.specs.models import KernelSpec

    loader = get_loader()
    spec = KernelSpec.from_id("fwd-sm_90a-d576-h64-noncompact-tilelang")
    for store in loader.stores():
        match = loader.find(store, spec)
        if match is not None:
            return float(match.entry.meta.payload.get("build_seconds", 0.0))
    return None


FRESH_PROCESSES = 10
IMPORT_PROCESSES = 20


def _child(code: str, env: dict[str, str], *argv: str, python: str = sys.executable) -> dict:
    proc = subprocess.run([python, "-c", code, *argv], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _stats(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"median": round(statistics.median(v), 2), "min": round(v[0], 2), "max": round(v[-1], 2)}


#: Top-level entries of a checkout that building the wheel does not read (kept out of the copy).
_NOT_BUILT = {"bench", "build", "dist", "docs", "tests"}


def wheel_install(source: Path, dest: Path) -> Path:
    """Build ``source``'s wheel and install it under ``dest`` with pip (bytecode compiled, as
    a wheel install is); returns the folder to put on ``PYTHONPATH``. The build runs on a copy,
    so the checkout gets no build folder."""
    tree = dest / "src"
    tree.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.name.startswith(".") or entry.name in _NOT_BUILT or entry.name.endswith(".egg-info"):
            continue
        if entry.is_dir():
            shutil.copytree(entry, tree / entry.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(entry, tree / entry.name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dest / "wheel"), str(tree)],
                   check=True)
    site = dest / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site),
                    *map(str, (dest / "wheel").glob("*.whl"))], check=True)
    return site


def _git_state(source: Path) -> dict[str, object] | None:
    """The checkout's commit and how many tracked files differ from it (None: not a git checkout)."""
    try:
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                               check=True, capture_output=True, text=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": commit, "modified_tracked_files": len(dirty)}


def _header(args: argparse.Namespace, env: dict[str, str], install: str, python: str = sys.executable) -> dict:
    """Command, date, machine, torch and the measured source, for a result file."""
    return {
        "command": "python bench/bench_startup.py " + " ".join(sys.argv[1:]),
        "python": platform.python_version(), "date": datetime.date.today().isoformat(),
        "host": {"cpus": os.cpu_count(), "cpu": _cpu_model(), "load_avg_1m_start": round(os.getloadavg()[0], 2)},
        "torch": _child("import json, torch; print(json.dumps(torch.__version__))", env, python=python),
        "install": install, "source": _git_state(args.source),
    }


def _cpu_model() -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or None
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), None)


def _with_wheel(args: argparse.Namespace, env: dict[str, str], tmp: str) -> str:
    """Put ``--source``'s wheel first on ``PYTHONPATH`` of ``env`` under ``--wheel``; the install's description."""
    if not args.wheel:
        return "as installed"
    root = wheel_install(args.source, Path(tmp))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return f"wheel of {args.source} installed by pip --target (bytecode compiled), first on PYTHONPATH"


def import_only(args: argparse.Namespace) -> dict:
    """``import dsa_aot`` after ``import torch``, in fresh processes (section 0 of the docstring)."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="dsa-aot-wheel-") as tmp:
        install = _with_wheel(args, env, tmp)
        report = _header(args, env, install)
        runs = [_child(IMPORT_CHILD, env) for _ in range(args.processes)]
        breakdown = [_child(IMPORT_BREAKDOWN, env) for _ in range(args.processes)]
    last = runs[-1]
    report["host"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    return {
        **report, "processes": args.processes,
        "import_dsa_aot_ms": _stats([r["import_dsa_aot_ms"] for r in runs]),
        "import_dsa_aot_cpu_ms": _stats([r["import_dsa_aot_cpu_ms"] for r in runs]),
        "import_torch_ms": _stats([r["import_torch_ms"] for r in runs]),
        "import_breakdown_cpu_ms": {k: _stats([b[k] for b in breakdown]) for k in breakdown[0]},
        "first_check_fwd_ms": _stats([r["first_check_fwd_ms"] for r in runs]),
        **{k: last[k] for k in ("modules_imported", "pydantic_imported", "compiler_modules_imported",
                                "modules_imported_by_first_check", "torch_ops_defined", "api_bound",
                                "dsa_aot_modules")},
    }


#: First-call cases: (name, DSA_AOT_BACKENDS, whether ``dsa_aot.preload()`` runs before the clock).
FIRST_CALL_CASES = (("tilelang", "tilelang", False), ("default ranking", "", False),
                    ("tilelang after preload()", "tilelang", True))


def first_call_cpu(args: argparse.Namespace) -> dict:
    """The first ``sparse_mla_fwd`` kernel lookup from ``--prebuilt`` up to the CUDA driver, in
    fresh processes of ``--python`` (e.g. a venv without compilers: found by runtime identity),
    with no nvcc on ``PATH``; one process per case first fills the per-machine memo."""
    python = str(args.python)
    base = {k: v for k, v in os.environ.items() if not k.startswith("DSA_AOT_") and k != "PYTHONPATH"}
    base.update(PATH=f"{Path(python).parent}{os.pathsep}/usr/bin{os.pathsep}/bin", CUDA_HOME="/nonexistent",
                DSA_AOT_PREBUILT_DIR=str(args.prebuilt), DSA_AOT_REQUIRE_PREBUILT="1")
    cases = {}
    with tempfile.TemporaryDirectory(prefix="dsa-aot-first-call-") as tmp:
        install = _with_wheel(args, base, tmp)
        report = _header(args, base, install, python)
        for name, backends, preload in FIRST_CALL_CASES:
            env = dict(base, DSA_AOT_BACKENDS=backends, DSA_AOT_CACHE_DIR=str(Path(tmp, "cache", name)))
            argv = ("preload" if preload else "",)
            first = _child(FIRST_CALL_CHILD, env, *argv, python=python)  # fills the memo
            runs = [_child(FIRST_CALL_CHILD, env, *argv, python=python) for _ in range(args.processes)]
            cases[name] = {
                "first_call_cpu_ms": _stats([r["cpu_ms"] for r in runs]),
                "first_call_wall_ms": _stats([r["ms"] for r in runs]),
                **({"preload_cpu_ms": _stats([r["preload_cpu_ms"] for r in runs])} if preload else {}),
                "first_process_cpu_ms": round(first["cpu_ms"], 2),
                **{k: runs[-1][k] for k in ("reached", "modules_imported", "pydantic_imported",
                                            "compiler_modules_imported")}}
    report["host"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    compilers = _child("import importlib.util, json; print(json.dumps([m for m in %r if importlib.util.find_spec(m)]))"
                       % (COMPILERS,), base, python=python)
    return {**report, "interpreter": python, "compilers_installed": compilers, "prebuilt": str(args.prebuilt),
            "processes": args.processes, "cases": cases}


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import environment

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", type=Path, default=None,
                    help="result file (default: bench/results/startup_h200.json, with --import-only "
                    "bench/results/import_cpu.json)")
    ap.add_argument("--first-call-only", action="store_true",
                    help="only the fresh-process first calls (e.g. with DSA_AOT_BACKENDS=cutedsl)")
    ap.add_argument("--preload", action="store_true",
                    help="call dsa_aot.preload() after the import, before the first call's clock starts")
    ap.add_argument("--import-only", action="store_true",
                    help="only the cost of `import dsa_aot` after torch (no GPU needed)")
    ap.add_argument("--wheel", action="store_true",
                    help="with --import-only or --first-call-cpu: measure --source's wheel installed by pip, "
                    "not the installed package")
    ap.add_argument("--source", type=Path, default=REPO, help="checkout whose wheel --wheel builds (default: this one)")
    ap.add_argument("--first-call-cpu", action="store_true",
                    help="only the first call from --prebuilt up to the CUDA driver (no GPU needed)")
    ap.add_argument("--prebuilt", type=Path, help="with --first-call-cpu: a prebuilt root holding "
                    "fwd-sm_90a-d512-h16-noncompact-{tilelang,cutedsl}")
    ap.add_argument("--python", type=Path, default=Path(sys.executable),
                    help="with --first-call-cpu: the interpreter of the serving environment (e.g. a venv "
                    "without compilers)")
    ap.add_argument("--fresh-cache", action="store_true",
                    help="each fresh process gets its own empty DSA_AOT_CACHE_DIR (a fresh container: "
                    "nothing remembered in the toolchain memo)")
    ap.add_argument("--processes", type=int, default=None,
                    help=f"fresh processes per measurement ({IMPORT_PROCESSES} for --import-only, "
                    f"{FRESH_PROCESSES} otherwise)")
    args = ap.parse_args()
    if args.import_only:
        args.processes = args.processes or IMPORT_PROCESSES
        return _write(args.out or Path("bench/results/import_cpu.json"), import_only(args))
    args.processes = args.processes or FRESH_PROCESSES
    if args.first_call_cpu:
        if args.prebuilt is None:
            ap.error("--first-call-cpu needs --prebuilt")
        return _write(args.out or Path("bench/results/first_call_cpu.json"), first_call_cpu(args))
    out = args.out or Path("bench/results/startup_h200.json")
    argv = ["preload"] if args.preload else []

    def fresh_process() -> dict:
        with tempfile.TemporaryDirectory(prefix="dsa-aot-cache-") as cache:
            env = dict(os.environ, DSA_AOT_CACHE_DIR=cache) if args.fresh_cache else os.environ
            return json.loads(subprocess.run([sys.executable, "-c", CHILD, *argv], check=True, capture_output=True,
                                             text=True, env=env).stdout.strip().splitlines()[-1])

    runs = [fresh_process() for _ in range(args.processes)]
    firsts = sorted(r["first_call_ms"] for r in runs)
    summary = {"median": round(statistics.median(firsts), 2), "min": round(firsts[0], 2),
               "max": round(firsts[-1], 2), "processes": len(firsts), "target": 15.0}
    report = {"command": "python bench/bench_startup.py " + " ".join(sys.argv[1:]),
              "environment": environment(), "backends_env": os.environ.get("DSA_AOT_BACKENDS"),
              "preload": args.preload, "fresh_cache": args.fresh_cache,
              "first_call_ms": summary, "fresh_process_runs": runs}
    if args.first_call_only:
        return _write(out, report)
    breakdown = json.loads(subprocess.run([sys.executable, "-c", BREAKDOWN], check=True, capture_output=True,
                                          text=True, env=os.environ).stdout.strip().splitlines()[-1])
    report.update(first_call_breakdown_ms=breakdown, dispatch=dispatch_overhead(), jit_compile_s=jit_seconds())
    return _write(out, report)


def _write(out: Path, report: dict) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
