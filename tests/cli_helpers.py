"""Helpers shared by the end-to-end tests: run the CLI in a subprocess, read a cubin's SM."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path


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
