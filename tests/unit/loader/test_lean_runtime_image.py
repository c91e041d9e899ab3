"""A serving image: ``pip install dsa-aot`` without ``[build]`` (no TileLang, no CuTe DSL) loads
what ``prebuild`` made with the full toolchain, up to the CUDA driver call.

Real parts only: a prebuilt root compiled here by the build venv (one fwd and one bwd spec per
backend), and a second virtualenv holding torch, pydantic, diskcache, filelock and a regular
(non-editable) install of this package. In it, with ``DSA_AOT_REQUIRE_PREBUILT=1``, every spec
must be found by runtime identity, every file read sha256-checked, and loading must stop at the
driver (this machine has none) with no compiler module imported. The venv is kept under
``.lean-venv/`` and reused; the package is reinstalled each run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
LEAN = REPO / ".lean-venv"
SPECS = ["fwd-sm_90a-d512-h16-noncompact-tilelang", "bwd-sm_90a-d512-h16-noncompact-tilelang",
         "fwd-sm_90a-d512-h16-noncompact-cutedsl", "bwd-sm_90a-d512-h16-noncompact-cutedsl"]
TORCH = os.environ.get("TORCH_SPEC", "torch==2.13.0")

CHILD = textwrap.dedent('''
    import importlib.util, json, sys
    from dsa_aot.backends import BACKENDS, CudaError
    from dsa_aot.artifact import ArtifactManifest
    from dsa_aot.loader import Loader
    from dsa_aot.specs.models import KernelSpec
    report = {"compilers": {m: importlib.util.find_spec(m) is not None for m in ("tilelang", "cutlass", "tvm_ffi")},
              "specs": {}}
    loader = Loader()
    for spec_id in sys.argv[1:]:
        spec = KernelSpec.from_id(spec_id)
        (store,) = [s for s in loader.stores() if s.read_only]
        match = loader.find(store, spec)
        row = {"rule": match.rule if match else None, "read": []}
        if match is not None:
            manifest = ArtifactManifest.model_validate(match.entry.meta.payload)
            def read(name, entry=match.entry):
                data = store.read_file(entry, name)  # sha256-checked
                row["read"].append(name)
                return data
            try:
                BACKENDS[spec.backend].load(manifest, read, 0)
                row["load"] = "loaded"
            except CudaError as exc:
                row["load"] = "driver: " + str(exc)[:200]
            row["files"] = sorted(s.file for s in manifest.stages)
        report["specs"][spec_id] = row
    report["imported"] = sorted(m for m in ("tilelang", "tvm", "tvm_ffi", "cutlass") if m in sys.modules)
    print(json.dumps(report))
''')


# A first call through the public path (dsa_aot.ops), the device faked as an H200 and stopped at
# its first dlopen (TileLang: libcuda for the cubin; CuTe DSL: the sealed memfd of the library):
# by then every check ran and every file was read and sha256-checked.
FIRST_CALL = textwrap.dedent('''
    import ctypes, json, sys
    import torch
    import dsa_aot
    from dsa_aot import ops, serving

    class Driver(BaseException):  # not an Exception: nothing on the way may catch it
        pass

    reached = []

    def stop(self, name, *args, **kwargs):
        reached.append(str(name))
        raise Driver()

    torch.cuda.get_device_capability = lambda index=None: (9, 0)
    ops._current_device = lambda: 0
    import dsa_aot.specs.sources as sources

    def refuse(data, module, *args):  # the wheel ships every module's imports: nothing is parsed
        raise AssertionError(f"parsed {module}")

    sources.parse_facts = refuse
    op = sys.argv[1]
    why = serving.why_not(op, "sm_90a", 512, 16, "noncompact")
    ctypes.CDLL.__init__ = stop
    try:
        ops._kernel(op, torch.device("cuda", 0), 512, 16, "noncompact")
    except Driver:
        pass
    print(json.dumps({"why_not": why, "reached": reached, "pydantic": "pydantic" in sys.modules,
                      "loader": "dsa_aot.loader" in sys.modules}))
''')


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def lean_python(tmp_path_factory) -> Path:
    """The serving venv: its dependencies once, then this checkout's wheel (built by the build
    venv, as an image's builder stage would) reinstalled."""
    python = LEAN / "bin" / "python"
    if not (LEAN / ".deps-installed").exists():
        _run([sys.executable, "-m", "venv", str(LEAN)])
        _run([str(python), "-m", "pip", "install", "-q", TORCH, "pydantic>=2.6,<3", "diskcache>=5.6",
              "filelock>=3.12"], timeout=1800)
        (LEAN / ".deps-installed").write_text("")
    wheels = tmp_path_factory.mktemp("wheels")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
          str(REPO)], timeout=900)
    (wheel,) = wheels.glob("dsa_aot-*.whl")
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], timeout=900)
    return python


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prebuilt")
    env = {**os.environ, "DSA_AOT_CACHE_DIR": str(root)}
    cmd = [sys.executable, "-m", "dsa_aot.cli", "prebuild", "--arch", "sm_90a", "--jobs", "2", "--json"]
    for spec in SPECS:
        cmd += ["--only", spec]
    summary = json.loads(_run(cmd, env=env, timeout=1800).stdout)
    assert {s["id"]: s["status"] for s in summary["specs"]} == {s: "built" for s in SPECS}
    return root


def _serving_env(lean_python: Path, prebuilt: Path, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSA_AOT_")}
    env.update(DSA_AOT_PREBUILT_DIR=str(prebuilt), DSA_AOT_CACHE_DIR=str(tmp_path / "cache"),
               DSA_AOT_REQUIRE_PREBUILT="1", PYTHONPATH="", CUDA_HOME="/nonexistent")
    env["PATH"] = f"{lean_python.parent}:/usr/bin:/bin"  # no nvcc either
    return env


def test_a_venv_without_compilers_resolves_every_prebuilt_spec(lean_python, prebuilt, tmp_path):
    env = _serving_env(lean_python, prebuilt, tmp_path)
    proc = _run([str(lean_python), "-c", CHILD, *SPECS], env=env, cwd=tmp_path, timeout=600)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["compilers"] == {"tilelang": False, "cutlass": False, "tvm_ffi": False}
    assert report["imported"] == []
    for spec_id in SPECS:
        row = report["specs"][spec_id]
        assert row["rule"] == "runtime identity", (spec_id, row)
        assert sorted(row["read"]) == row["files"]  # every stage file read, each sha256-checked
        assert row["load"].startswith("driver: "), (spec_id, row)  # stopped at the CUDA driver

    status = _run([str(lean_python.parent / "dsa-aot"), "status", "--json", "--arch", "sm_90a",
                   *sum((["--only", s] for s in SPECS), [])], env=env, cwd=tmp_path, timeout=300)
    assert json.loads(status.stdout) == {s: "cached" for s in SPECS}
    doctor = json.loads(_run([str(lean_python.parent / "dsa-aot"), "doctor"], env=env, cwd=tmp_path,
                             timeout=300).stdout)
    assert {b["lookup_rule"] for b in doctor["backends"].values()} == {"runtime identity"}


@pytest.mark.parametrize("backend", ["tilelang", "cutedsl"])
@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_a_first_call_is_served_without_pydantic(lean_python, prebuilt, tmp_path, op, backend):
    """The serving path: the first call's lookup, checks and reads import neither pydantic nor
    the loader and parse no source (the wheel's source facts), twice (the first process with an
    empty memo, the second reusing the remembered source graph and ranking)."""
    env = dict(_serving_env(lean_python, prebuilt, tmp_path), DSA_AOT_BACKENDS=backend)
    for _ in range(2):
        proc = _run([str(lean_python), "-c", FIRST_CALL, op], env=env, cwd=tmp_path, timeout=600)
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert report["why_not"] is None, report
        assert not report["pydantic"] and not report["loader"], report
        (first, *_) = report["reached"]
        assert first.endswith("libcuda.so.1") if backend == "tilelang" else first.startswith("/proc/self/fd/"), report
