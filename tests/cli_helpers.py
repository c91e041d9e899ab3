"""Helpers shared by the tests: run the CLI or a CuTe DSL script in a subprocess, read a cubin,
check built CuTe DSL libraries (no spills; they open without ``cutlass``)."""

from __future__ import annotations

import importlib.util
import os
import struct
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

#: Whether nvidia-cutlass-dsl is installed (the tests that compile CuTe DSL kernels need it).
HAS_CUTE_DSL = importlib.util.find_spec("cutlass") is not None
needs_cute_dsl = pytest.mark.skipif(not HAS_CUTE_DSL, reason="needs nvidia-cutlass-dsl to compile")


def cli(*args: str, root: Path, check: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m dsa_aot.cli ARGS`` with ``root`` as the only cache root (plus ``env``)."""
    base = dict(os.environ)
    base.pop("DSA_AOT_PREBUILT_DIR", None)
    env = dict(base, DSA_AOT_CACHE_DIR=str(root), TILELANG_PRINT_ON_COMPILATION="0", **(env or {}))
    proc = subprocess.run([sys.executable, "-m", "dsa_aot.cli", *args], env=env, capture_output=True,
                          text=True, timeout=1800)
    if check and proc.returncode != 0:
        raise AssertionError(f"dsa-aot {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def sm_of_elf(data: bytes) -> int:
    """The SM number a CUDA ELF (cubin) is built for, from its e_flags."""
    assert data[:4] == b"\x7fELF"
    return (struct.unpack_from("<I", data, 48)[0] >> 8) & 0xFF


def embedded_cubin(obj: bytes) -> bytes:
    """The device ELF embedded in an exported host object (the second ELF magic in the file)."""
    start = obj.find(b"\x7fELF", 1)
    assert start > 0, "no embedded cubin"
    shoff, = struct.unpack_from("<Q", obj, start + 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, start + 0x3A)
    return obj[start:start + shoff + shentsize * shnum]


def run_dsl_script(code: str, folder: Path, arch: str = "sm_90a",
                   timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with ``CUTE_DSL_ARCH=arch`` (the DSL reads it once, at
    import), from a file in ``folder``: ``cute.jit`` reads its functions' source."""
    script = folder / "dsl_script.py"
    script.write_text(code)
    env = dict(os.environ, CUTE_DSL_ARCH=arch)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """REGCOUNT (``regs``, attribute 0x2f) and FRAME_SIZE (``frame``, 0x11, local memory such as
    spills) from the cubin's ``.nv.info`` sections: the largest over its kernels."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = heads[shstrndx][4]
    found: dict[str, int] = {}
    for name, _, _, _, off, size, *_ in heads:
        sec = cubin[names_at + name:cubin.index(b"\0", names_at + name)].decode()
        if not sec.startswith(".nv.info"):
            continue
        pos = off
        while pos < off + size:
            fmt, attr = cubin[pos], cubin[pos + 1]
            length = struct.unpack_from("<H", cubin, pos + 2)[0] if fmt == 4 else 0
            payload = cubin[pos + 4:pos + 4 + length]
            pos += 4 + length
            if attr in (0x2f, 0x11):  # per kernel: the largest over the cubin's kernels
                key = "regs" if attr == 0x2f else "frame"
                found[key] = max(found.get(key, 0), struct.unpack_from("<II", payload)[1])
    return found


def assert_spill_free(objects: Iterable[Path], max_regs: int = 255) -> None:
    """Each exported host object's embedded cubin uses no local memory (no spills) and between 1
    and ``max_regs`` registers a thread (at least one object)."""
    checked = 0
    for obj in objects:
        found = cubin_resources(embedded_cubin(Path(obj).read_bytes()))
        assert found.get("frame") == 0 and 0 < found.get("regs", 0) <= max_regs, (str(obj), found)
        checked += 1
    assert checked, "no object to check"


_OPEN_WITHOUT_CUTLASS = """
import sys
from dsa_aot.backends.cutedsl.runtime import load_kernel
for folder in sys.argv[1:]:
    k = load_kernel(folder)
    print(','.join(k.tensor_names + k.scalar_names))
assert 'cutlass' not in sys.modules and 'torch' not in sys.modules
"""


def open_without_cutlass(folders: Iterable[Path]) -> list[str]:
    """Open each built CuTe DSL library folder in a fresh process through the runtime (ctypes only),
    check that neither ``cutlass`` nor ``torch`` got imported, and return each library's
    argument names (comma-joined, one entry a folder)."""
    proc = subprocess.run([sys.executable, "-c", _OPEN_WITHOUT_CUTLASS, *map(str, folders)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


#: Prelude of the CuTe DSL scripts that check a transposed shared-memory view: ``differ(tile,
#: view, rows, cols)`` counts the ``(r, c)`` where ``tile((r, c)) != view((c, r))``. A layout's
#: offset is the sum of its modes' offsets, so each mode is evaluated once (a call is slow while
#: tracing) and the sum is checked at the far corner.
LAYOUT_DIFFER = """
def differ(tile, view, rows, cols):
    t_r, t_c = [tile((r, 0)) for r in range(rows)], [tile((0, c)) for c in range(cols)]
    v_r, v_c = [view((0, r)) for r in range(rows)], [view((c, 0)) for c in range(cols)]
    assert tile((rows - 1, cols - 1)) == t_r[-1] + t_c[-1]
    return sum(1 for r in range(rows) for c in range(cols) if t_r[r] + t_c[c] != v_r[r] + v_c[c])
"""
