"""dsa-aot: ahead-of-time compiled DeepSeek Sparse Attention (sparse MLA) kernels.

``import dsa_aot`` loads no compiler and no pydantic; kernels come from the prebuilt cache (see
README). In a process that has already imported torch, the API is bound at import (input
checks, the ``torch.ops.dsa_aot`` ops, the serving path that loads a prebuilt hit without
pydantic); the loader and its record models are imported by the first call the serving path
leaves to it, or ahead by :func:`preload`. Without torch the API modules are imported on first
use, so the CLI starts without torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["sparse_mla", "sparse_mla_fwd", "sparse_mla_bwd", "preload", "InputError", "MissingPrebuiltError",
           "UnsupportedDeviceError", "DeterminismUnavailableError"]

_LAZY = {
    "sparse_mla": "dsa_aot.ops", "sparse_mla_fwd": "dsa_aot.ops", "sparse_mla_bwd": "dsa_aot.ops",
    "InputError": "dsa_aot.validate", "MissingPrebuiltError": "dsa_aot.errors",
    "UnsupportedDeviceError": "dsa_aot.errors", "DeterminismUnavailableError": "dsa_aot.errors",
}


def preload() -> None:
    """Read what a first call needs once per process (the installed distributions, nvcc, the
    catalog's ranking; the cache roots and toolchain), and import the kernel loader and its record
    models, so a first call does only per-variant work even when the serving path leaves it to
    the loader (a build image with compilers, a remote tier, signatures). Tens of milliseconds
    of CPU, mostly pydantic's import. Makes no CUDA call and imports no compiler."""
    from dsa_aot import serving
    from dsa_aot.loader import get_loader

    serving.prepare()
    get_loader().prepare()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dsa_aot' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _bind_if_torch_loaded() -> None:
    import sys

    if "torch" in sys.modules:
        for name in _LAZY:
            __getattr__(name)


_bind_if_torch_loaded()
