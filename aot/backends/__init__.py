"""Kernel backends, one subpackage each, found by listing this package (nothing to register).

A subpackage whose ``__init__`` defines ``BACKEND`` (a :class:`~.base.KernelBackend`) is a
backend: adding one is adding a folder here and its lines in the catalog. Importing a backend
package imports no compiler. The torch reference (:mod:`.reference`) is not a backend: it
builds nothing and ends every fallback chain.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading

from dsa_aot.backends.base import BuildError, CudaError, KernelBackend
from dsa_aot.backends.reference import ReferenceBackend

__all__ = ["BACKENDS", "BuildError", "CudaError", "KernelBackend", "ReferenceBackend", "declared_compilers",
           "get", "names"]

_FOUND: dict[str, KernelBackend] | None = None
_LOCK = threading.Lock()


def _discover() -> dict[str, KernelBackend]:
    global _FOUND
    if _FOUND is None:
        with _LOCK:
            if _FOUND is None:
                found: dict[str, KernelBackend] = {}
                for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
                    if not info.ispkg:
                        continue
                    backend = getattr(importlib.import_module(f"{__name__}.{info.name}"), "BACKEND", None)
                    if isinstance(backend, KernelBackend):
                        found[backend.name] = backend
                _FOUND = found
    return _FOUND


def names() -> tuple[str, ...]:
    """Names of the installed backends, sorted."""
    return tuple(_discover())


def get(name: str) -> KernelBackend:
    """The backend called ``name``; ``KeyError`` names the installed ones."""
    try:
        return _discover()[name]
    except KeyError:
        raise KeyError(f"no backend {name!r}; installed: {', '.join(names())}") from None


def declared_compilers() -> tuple[str, ...]:
    """Every compiler distribution (pattern) any backend builds with."""
    return tuple(dict.fromkeys(c for b in _discover().values() for c in b.compilers))


class _Backends(dict):
    """``BACKENDS[name]``: a read-only view of the discovered backends."""

    def __missing__(self, name: str) -> KernelBackend:
        return get(name)

    def __iter__(self):
        return iter(_discover())

    def __contains__(self, name: object) -> bool:
        return name in _discover()

    def __len__(self) -> int:
        return len(_discover())

    def items(self):
        return _discover().items()

    def values(self):
        return _discover().values()

    def keys(self):
        return _discover().keys()


BACKENDS = _Backends()
