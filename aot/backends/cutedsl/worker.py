"""The CuTe DSL compile worker: ``python -m dsa_aot.backends.cutedsl.worker REQUEST.json``.

The only code of the backend that imports ``cutlass``. It runs in its own process whose
environment has ``CUTE_DSL_ARCH=<arch>`` before ``cutlass`` is imported (the DSL reads it once,
at import, and otherwise assumes sm_100). Each job names the kernel module and compile function
of one stage and its compile-time parameters, all derived from the kernel spec by
:func:`dsa_aot.backends.cutedsl.build.requests_for`; the worker ``cute.compile``s the stage over
dynamic-shape fake tensors, calls ``export_to_c`` (a ``.h`` and a ``.o``) and writes a JSON reply
for the parent (:func:`dsa_aot.backends.cutedsl.build.build_cutedsl`), which links and records
the result. Kernel modules are imported by the names in the job, so this file imports none.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from dsa_aot.backends.cutedsl.records import DSL_RUNTIME_LIB, CuteBuildError

_DTYPES = {"BFloat16": "bfloat16", "Float16": "float16", "Float32": "float32",
           "Int32": "int32", "Int64": "int64"}


def _dim_record(entry: object) -> dict[str, object]:
    if isinstance(entry, int):
        return {"value": entry}
    return {"symbol": getattr(entry, "symbol", None), "divisibility": int(entry.divisibility)}


def _describe_args(fakes: dict[str, object]) -> list[dict[str, object]]:
    import cuda.bindings.driver as cuda

    from cutlass import Float32, Int32

    args: list[dict[str, object]] = []
    for name, fake in fakes.items():
        if isinstance(fake, cuda.CUstream):
            args.append({"kind": "stream", "name": name})
            continue
        if isinstance(fake, (Float32, Int32)):
            dtype = "float32" if isinstance(fake, Float32) else "int32"
            args.append({"kind": "scalar", "name": name, "dtype": dtype})
            continue
        dtype = _DTYPES.get(fake.element_type.__name__)
        if dtype is None:
            raise CuteBuildError(f"argument {name}: element type {fake.element_type} unsupported")
        shape = [_dim_record(e) for e in fake.shape]
        stride = [_dim_record(e) for e in fake.stride]
        widths = {e.width for e in fake.shape if not isinstance(e, int)}
        args.append({"kind": "tensor", "name": name, "dtype": dtype, "shape": shape,
                     "stride": stride, "shape_ctype": "int64" if widths == {64} else "int32",
                     "stride_ctype": "int32" if fake._use_32bit_stride else "int64",
                     "align": int(fake._assumed_align or 1)})
    return args


def _worker_compile(job: dict[str, object], arch: str) -> dict[str, object]:
    """Compile and export one job; returns its reply (name, probed isfinite, argument records)."""
    start = time.perf_counter()
    module = importlib.import_module(str(job["module"]))
    params = dict(job["params"])  # type: ignore[arg-type]
    if "use_isfinite" in params and params["use_isfinite"] is None:
        params["use_isfinite"] = module.probe_cute_isfinite()  # the DSL that compiles decides
    compiled, fakes = getattr(module, str(job["function"]))(arch, **params)
    compiled_at = time.perf_counter()
    name = str(job["name"]).replace("{isfinite}", "isfinite" if params.get("use_isfinite") else "infcmp")
    compiled.export_to_c(job["dir"], name, name)
    return {"name": name, "use_isfinite": params.get("use_isfinite"), "args": _describe_args(fakes),
            "compile_seconds": compiled_at - start,
            "export_seconds": time.perf_counter() - compiled_at}


def _worker_main(request_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    arch = request["arch"]
    if os.environ.get("CUTE_DSL_ARCH") != arch:
        print(json.dumps({"error": f"CUTE_DSL_ARCH={os.environ.get('CUTE_DSL_ARCH')!r}, "
                                   f"expected {arch!r} before importing cutlass"}))
        return 2
    try:
        import cutlass
        from cutlass.cute.export import aot_config

        results = [_worker_compile(job, arch) for job in request["jobs"]]
        lib_paths = [p for p in aot_config.get_lib_paths(enable_tvm_ffi=False)
                     if Path(p).name == DSL_RUNTIME_LIB]
        reply = {"results": results, "dsl_version": cutlass.__version__,
                 "libdir": aot_config.get_libdir(),
                 "runtime_lib": lib_paths[0] if lib_paths else None}
    except Exception:  # noqa: BLE001 - reported to the parent with the traceback
        reply = {"error": traceback.format_exc()}
    Path(request["reply"]).write_text(json.dumps(reply))
    return 0 if "error" not in reply else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(f"usage: python -m dsa_aot.backends.cutedsl.worker REQUEST.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(_worker_main(sys.argv[1]))
