"""Shared pieces of the scenario tests: the CPU-side artifact check, child processes, digests.

What is real here: the store, its file locks, the loader's lookup / build / publish protocol,
TileLang and nvcc (through ``_tiny_kernel``). What is not: loading a cubin into a GPU, which
this CPU machine cannot do. Child processes replace only ``load`` (``CpuCheckedTileLang``): it
reads every stage through the loader's sha256-checked reader, then checks that the bytes are a
CUDA ELF holding the launch record's entry symbol, and records the load. In-process tests keep
the real ``load``, which gets as far as the CUDA driver (absent here) and fails there.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _tiny_kernel import record

HERE = Path(__file__).resolve().parent
CHILD = HERE / "_child.py"
EM_CUDA = 190


@dataclass(frozen=True)
class CpuLoaded:
    """What a CPU-side "load" returns: the spec and the sha256 of each stage's cubin."""

    spec_id: str
    cubins: dict[str, str]


def check_cubin(data: bytes, entry: str) -> None:
    """Raise unless ``data`` is an ELF for the CUDA machine that defines the symbol ``entry``."""
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    if int.from_bytes(data[18:20], "little") != EM_CUDA:
        raise ValueError(f"ELF machine {int.from_bytes(data[18:20], 'little')} is not EM_CUDA")
    if entry.encode() + b"\x00" not in data:
        raise ValueError(f"entry {entry!r} is not in the cubin")


TINY_KERNEL = "_tiny_kernel"  # module standing in for the TileLang fwd kernel (see _tiny_kernel.py)


def make_backend(calls: list | None = None, cpu_load: bool = True, tiny: bool = True):
    """A TileLangBackend that counts its builds (``build`` events). With ``tiny`` its fwd stage
    is built by ``_tiny_kernel`` (class data: the key's sources follow it). With ``cpu_load``
    its ``load`` checks the cubins on the CPU instead of loading them into a GPU; without, the
    real ``load`` runs (on a machine without a driver it fails in ``CubinKernel``)."""
    from dsa_aot.backends.tilelang import TileLangBackend
    from dsa_aot.backends.tilelang.records import LaunchRecord

    kernels = dict(TileLangBackend.kernel_modules, fwd=TINY_KERNEL) if tiny else TileLangBackend.kernel_modules

    class CountingTileLang(TileLangBackend):
        kernel_modules = kernels

        def build(self, spec):
            record("build", spec.id)  # the compile counter
            return super().build(spec)

    class CpuCheckedTileLang(CountingTileLang):
        def load(self, manifest, read: Callable[[str], bytes], device_index: int) -> CpuLoaded:
            cubins = {}
            for stage in manifest.stages:
                data = read(stage.file)  # the loader's reader: sha256-checked store read
                check_cubin(data, LaunchRecord.model_validate(stage.record).entry)
                cubins[stage.name] = hashlib.sha256(data).hexdigest()
            if calls is not None:
                calls.append((manifest.spec.id, cubins))
            record("load", manifest.spec.id)
            return CpuLoaded(manifest.spec.id, cubins)

    return CpuCheckedTileLang() if cpu_load else CountingTileLang()


def install(calls: list | None = None, tiny: bool = True, cpu_load: bool = True) -> Callable[[], None]:
    """Put the counting backend in place of the installed ``tilelang`` one (tiny fwd kernel with
    ``tiny``, CPU-checked loads with ``cpu_load``); returns a function that undoes it."""
    from dsa_aot import backends

    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    found = backends._discover()  # the table behind backends.get / BACKENDS
    old_backend = found["tilelang"]
    found["tilelang"] = make_backend(calls, cpu_load, tiny)

    def undo() -> None:
        found["tilelang"] = old_backend

    return undo


def key_of(spec, toolchain=None) -> str:
    """The build key of ``spec`` for the installed backend under ``toolchain`` (default: current)."""
    from dsa_aot.backends import get
    from dsa_aot.identity import build_identity
    from dsa_aot.specs.toolchain import Toolchain

    return build_identity(get(spec.backend), spec, toolchain or Toolchain.current()).key()


def spec(heads: int = 16, d_qk: int = 512, layout: str = "noncompact", arch: str = "sm_90a"):
    from dsa_aot.specs.models import KernelSpec

    return KernelSpec(op="fwd", arch=arch, d_qk=d_qk, heads=heads, layout=layout)


def events(path: Path, kind: str | None = None) -> list[list[str]]:
    """Lines of an events file split into fields, optionally only one kind."""
    if not path.exists():
        return []
    rows = [ln.split() for ln in path.read_text().splitlines() if ln.strip()]
    return [r for r in rows if kind is None or r[0] == kind]


def child_env(root: Path, events_path: Path, toolchain_json: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSA_AOT_", "REL_"))}
    env.update(DSA_AOT_CACHE_DIR=str(root), REL_EVENTS=str(events_path), REL_TOOLCHAIN=toolchain_json,
               TILELANG_PRINT_ON_COMPILATION="0", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def start_child(config: dict[str, Any], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CHILD), json.dumps(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@dataclass
class ChildResult:
    returncode: int
    result: dict[str, Any] | None
    stderr: str


def finish(proc: subprocess.Popen, timeout_s: float = 120.0) -> ChildResult:
    """Wait for a child (killing it past ``timeout_s``) and parse its last stdout line."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"child timed out after {timeout_s} s; stderr tail:\n{err[-3000:]}") from None
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return ChildResult(proc.returncode, json.loads(lines[-1]) if lines else None, err)


def run_child(config: dict[str, Any], env: dict[str, str], timeout_s: float = 120.0) -> ChildResult:
    return finish(start_child(config, env), timeout_s)


def start_together(configs: list[dict[str, Any]], envs: list[dict[str, str]], tmp_path: Path,
                   timeout_s: float = 120.0) -> list[dict[str, Any] | None]:
    """Start one child per ``(config, env)``, hold them at a gate (files under ``tmp_path``)
    until every one has imported, release them at once, and return their results; a child that
    dies before the start line or exits non-zero fails the test with its stderr."""
    ready, gate = tmp_path / "ready", tmp_path / "gate"
    ready.mkdir()
    procs = [start_child({**c, "ready_dir": str(ready), "gate": str(gate)}, e)
             for c, e in zip(configs, envs, strict=True)]
    deadline = time.monotonic() + timeout_s
    while len(list(ready.iterdir())) < len(procs):
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            gate.touch()
            res = finish(dead[0])
            raise AssertionError(f"a child died before the start line (rc {res.returncode}):\n"
                                 f"{res.stderr[-3000:]}")
        assert time.monotonic() < deadline, "children did not reach the start line"
        time.sleep(0.02)
    gate.touch()
    results = [finish(p, timeout_s) for p in procs]
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    return [r.result for r in results]


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> sha256 (files), 'dir' or 'link -> target' for everything under ``root``."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = f"link -> {os.readlink(p)}"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def staging_leftovers(root: Path) -> list[str]:
    staging = root / ".staging"
    return sorted(p.name for p in staging.iterdir()) if staging.is_dir() else []
