"""Which kernel files make up each (backend, op): the stages an artifact holds, in launch order."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class StageDef:
    """One kernel of an op: ``builder(spec) -> (prim_func, pass_configs)`` in ``module``."""

    name: str
    module: str
    builder: str

    def resolve(self) -> Callable[..., Any]:
        return getattr(importlib.import_module(self.module), self.builder)


STAGES: dict[tuple[str, str], tuple[StageDef, ...]] = {
    ("tilelang", "fwd"): (
        StageDef("fwd", "dsa_aot.kernels.tilelang_fwd", "build_fwd"),
    ),
    ("tilelang", "bwd"): (
        StageDef("bwd_preprocess", "dsa_aot.kernels.tilelang_bwd_preprocess", "build_bwd_preprocess"),
        StageDef("bwd_main", "dsa_aot.kernels.tilelang_bwd", "build_bwd_main"),
        StageDef("bwd_postprocess", "dsa_aot.kernels.tilelang_bwd_postprocess", "build_bwd_postprocess"),
    ),
}


def implemented() -> set[tuple[str, str]]:
    """{(backend, op)} pairs that have kernels."""
    return set(STAGES)


def stages(backend: str, op: str) -> tuple[StageDef, ...]:
    try:
        return STAGES[(backend, op)]
    except KeyError:
        raise KeyError(f"backend {backend!r} does not implement op {op!r}; "
                       f"implemented: {sorted(STAGES)}") from None
