"""What ``import dsa_aot`` and the API module load, checked exactly in fresh processes.

No wall-clock floors here: ``bench/bench_startup.py --import-only`` and ``--first-call-cpu``
measure the time. These tests pin the structure the time depends on: no compiler is imported,
the serving path (pydantic-free) is bound at import while pydantic and the loader wait for a
lookup the serving path leaves to the loader (or ``dsa_aot.preload()``), the torch.library ops are defined without reading source code (what
made ``torch.library.custom_op`` cost milliseconds, more with every module loaded), and the
first input check imports nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

COMPILERS = ("tilelang", "tvm", "tvm_ffi", "cutlass")
SCHEMAS = {
    "sparse_mla_fwd": "dsa_aot::sparse_mla_fwd(Tensor q, Tensor kv, Tensor topk_idxs, Tensor? topk_length, "
                      "Tensor? attn_sink, float? softmax_scale, bool deterministic=False) -> (Tensor, Tensor)",
    "sparse_mla_bwd": "dsa_aot::sparse_mla_bwd(Tensor q, Tensor kv, Tensor out, Tensor dout, Tensor lse, "
                      "Tensor topk_idxs, Tensor? topk_length, Tensor? attn_sink, float? softmax_scale, "
                      "bool deterministic=False) -> (Tensor, Tensor, Tensor)",
}


def _child(code: str, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_after_torch_binds_the_api_and_defines_the_ops_without_a_compiler():
    got = _child("""
        import json, sys
        import torch
        before = set(sys.modules)
        import dsa_aot
        new = sorted(set(sys.modules) - before)
        ops = {n: str(getattr(torch.ops.dsa_aot, n).default._schema) for n in ("sparse_mla_fwd", "sparse_mla_bwd")}
        print(json.dumps({"new": new, "bound": [n for n in dsa_aot.__all__ if n in vars(dsa_aot)],
                          "all": dsa_aot.__all__, "ops": ops}))
    """)
    assert [m for m in got["new"] if m.split(".")[0] in COMPILERS] == []
    assert got["bound"] == got["all"]
    assert got["ops"] == SCHEMAS


def test_import_without_torch_imports_neither_torch_nor_pydantic():
    got = _child("""
        import json, sys
        import dsa_aot
        print(json.dumps(sorted(m for m in ("torch", "pydantic", "dsa_aot.ops", "dsa_aot.loader") if m in sys.modules)))
    """)
    assert got == []


def test_api_module_binds_the_serving_path_and_leaves_the_loader_to_a_lookup():
    got = _child("""
        import json, sys
        import dsa_aot       # before torch: nothing is bound
        import dsa_aot.ops
        import torch
        print(json.dumps({"loaded": sorted(m for m in sys.modules if m.startswith("dsa_aot")),
                          "ops": hasattr(torch.ops.dsa_aot, "sparse_mla_fwd")}))
    """)
    assert got["ops"]
    # the serving path and the load code it runs: the pydantic-free backends' runtimes, runners
    assert {"dsa_aot.serving", "dsa_aot.backends.tilelang.runtime", "dsa_aot.backends.cutedsl.runtime",
            "dsa_aot.runners"} <= set(got["loaded"])
    lazy = ("dsa_aot.loader", "dsa_aot.artifact", "dsa_aot.cache.store", "dsa_aot.backends.cudnn.runtime",
            "dsa_aot.specs.models", "dsa_aot.specs.toolchain")
    assert [m for m in got["loaded"] if m.startswith(lazy) or m.endswith((".records", ".build"))] == []


def test_op_definition_reads_no_source_and_scans_no_module_table():
    got = _child("""
        import inspect, json, sys
        import dsa_aot
        import torch
        import dsa_aot.validate  # its imports (pydantic models) are not under test here

        def refuse(*args, **kwargs):
            raise AssertionError("source inspection while defining the ops")

        inspect.getmodule = inspect.getframeinfo = inspect.getsourcelines = inspect.findsource = refuse
        import dsa_aot.ops
        print(json.dumps(sorted(torch._C._dispatch_has_kernel_for_dispatch_key("dsa_aot::sparse_mla_fwd", k)
                                for k in ("CompositeExplicitAutograd", "Meta", "Autograd"))))
    """)
    assert got == [True, True, True]


def test_first_input_check_imports_nothing():
    got = _child("""
        import json, sys
        import torch
        import dsa_aot
        from dsa_aot.validate import check_fwd
        q = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
        kv = torch.zeros(8, 576, dtype=torch.bfloat16)
        idx = torch.zeros(4, 4, dtype=torch.int32)
        before = set(sys.modules)
        check_fwd(q, kv, idx, None, None, None)
        print(json.dumps(sorted(set(sys.modules) - before)))
    """)
    assert got == []


def test_import_after_torch_binds_the_serving_path_but_leaves_pydantic_and_the_loader_to_a_lookup():
    got = _child("""
        import json, sys
        import torch
        import dsa_aot
        print(json.dumps({"serving": "dsa_aot.serving" in sys.modules, "unwanted": sorted(
            m for m in sys.modules if m.split(".")[0] in ("pydantic", "diskcache", "filelock") or (
                m.startswith("dsa_aot.") and (m.endswith((".records", ".build")) or m in (
                    "dsa_aot.loader", "dsa_aot.cache.store", "dsa_aot.artifact", "dsa_aot.specs.models",
                    "dsa_aot.specs.keys", "dsa_aot.specs.toolchain", "dsa_aot.identity"))))}))
    """)
    assert got == {"serving": True, "unwanted": []}


def test_preload_imports_the_loader_and_every_ranked_backends_load_code_without_a_compiler_or_cuda(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSA_AOT_")}
    env["DSA_AOT_CACHE_DIR"] = str(tmp_path / "cache")
    got = _child("""
        import json, sys
        import torch
        import dsa_aot
        dsa_aot.preload()
        from dsa_aot.backends import BACKENDS
        from dsa_aot.loader import get_loader
        loader = get_loader()
        wanted = {BACKENDS[n].runtime_module for op in ("fwd", "bwd") for n in loader.ranking(op)}
        print(json.dumps({"missing": sorted(m for m in wanted | {"pydantic", "dsa_aot.loader"} if m not in sys.modules),
                          "ranked": len(wanted), "toolchain": loader._toolchain is not None,
                          "compilers": sorted(m for m in sys.modules if m.split(".")[0] in %r),
                          "cuda": torch.cuda.is_initialized()}))
    """ % (COMPILERS,), env)
    assert got["missing"] == [] and got["ranked"] >= 1
    assert got["toolchain"]
    assert got["compilers"] == []
    assert got["cuda"] is False
