"""The CUDA toolkit: one lookup for the nvcc that keys the cache and the toolkit builds link.

The nvcc whose version keys every artifact and the toolkit whose static CUDA runtime a CuTe DSL
library links are the same toolkit: :func:`toolkit_root` is :func:`resolve_nvcc`'s parent.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

from dsa_aot import settings


def resolve_nvcc(environ: Mapping[str, str] | None = None) -> Path | None:
    """The nvcc that builds use: ``DSA_AOT_NVCC``, else the one TileLang resolves.

    ``environ`` (tests) replaces the process environment; by default the values come from
    :mod:`dsa_aot.settings` (``nvcc``, ``cuda_home``) and ``PATH``.

    TileLang's order: ``CUDA_HOME`` / ``CUDA_PATH``; ``nvcc`` on ``PATH`` (its toolkit root,
    following symlinks unless the visible root has ``include/cuda_runtime.h``); the
    ``nvidia-cuda-nvcc`` wheel; ``/usr/local/cuda``. Returns None when no nvcc exists.
    """
    if environ is None:
        cfg = settings.get()
        explicit, home, path = cfg.nvcc, cfg.cuda_home, os.environ.get("PATH")
    else:
        explicit = environ.get("DSA_AOT_NVCC") or None
        home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
        path = environ.get("PATH")
    if explicit:
        return Path(explicit)
    if home:
        candidate = Path(home, "bin", "nvcc")
        return candidate if candidate.exists() else None
    found = shutil.which("nvcc", path=path)
    if found:
        visible = Path(found).parent.parent
        if (visible / "include" / "cuda_runtime.h").exists():
            return visible / "bin" / "nvcc"
        return Path(os.path.realpath(found)).parent.parent / "bin" / "nvcc"
    try:
        files = md.files("nvidia-cuda-nvcc") or []
    except md.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == "nvcc":
            return Path(f.locate())
    default = Path("/usr/local/cuda/bin/nvcc")
    return default if default.exists() else None


#: ``exec /abs/path/bin/nvcc "$@"`` wrapper scripts (e.g. /usr/local/bin/nvcc) are followed.
EXEC_WRAPPER = re.compile(r'\A#![^\n]*\n(?:\s*(?:#[^\n]*)?\n)*\s*exec\s+(/\S+/bin/nvcc)\s+"\$@"\s*\Z')


def file_head(path: Path, size: int = 4096) -> bytes | None:
    """The first ``size`` bytes of a file (None when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:
        return None


def wrapper_target(head: bytes) -> Path | None:
    """The nvcc an exec-only wrapper script (given its first bytes) runs; None for anything else."""
    if head[:2] != b"#!":
        return None
    match = EXEC_WRAPPER.search(head.decode("utf-8", "replace"))
    return Path(match.group(1)) if match else None


def real_nvcc(nvcc: Path) -> Path:
    """The nvcc binary an exec-only wrapper script runs (``nvcc`` itself otherwise)."""
    head = file_head(nvcc)
    return (wrapper_target(head) if head else None) or nvcc


def toolkit_root() -> Path | None:
    """The root of the toolkit :func:`resolve_nvcc` picks (``<root>/bin/nvcc``), or None."""
    nvcc = resolve_nvcc()
    if nvcc is None or not nvcc.exists():
        return None
    return real_nvcc(nvcc).parent.parent
