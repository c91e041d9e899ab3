"""dsa-aot: ahead-of-time compiled DeepSeek Sparse Attention (sparse MLA) kernels.

``import dsa_aot`` loads no compiler; kernels come from the prebuilt cache (see README).
In a process that has already imported torch, the API modules are bound at import, so the
first call does only per-variant work (fingerprint, lookup, load, launch). Otherwise they
are imported on first use, so the CLI starts without torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["sparse_mla", "sparse_mla_fwd", "sparse_mla_bwd", "InputError", "MissingPrebuiltError",
           "UnsupportedDeviceError"]

_LAZY = {
    "sparse_mla": "dsa_aot.ops", "sparse_mla_fwd": "dsa_aot.ops", "sparse_mla_bwd": "dsa_aot.ops",
    "InputError": "dsa_aot.validate", "MissingPrebuiltError": "dsa_aot.loader",
    "UnsupportedDeviceError": "dsa_aot.loader",
}


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
        for name in __all__:
            __getattr__(name)


_bind_if_torch_loaded()
