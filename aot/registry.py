"""Which kernel files make up each (backend, op): the stages an artifact holds, in launch order."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Literal

#: How a stage is compiled: ``tilelang`` (in process, to a cubin) or ``cutedsl`` (in a
#: ``CUTE_DSL_ARCH`` worker process, to a shared library; see :mod:`dsa_aot.cutedsl_backend`).
StageKind = Literal["tilelang", "cutedsl"]


@dataclass(frozen=True)
class StageDef:
    """One kernel of an op, built by ``builder`` in ``module``.

    ``tilelang`` stages: ``builder(spec) -> (prim_func, pass_configs)``, resolved in the build
    process. ``cutedsl`` stages name their kernel module and compile function for reference
    only: they are compiled by :func:`dsa_aot.cutedsl_backend.build_cutedsl` in a worker whose
    ``CUTE_DSL_ARCH`` is set before ``cutlass`` is imported, so they are never resolved here.
    """

    name: str
    module: str
    builder: str
    kind: StageKind = "tilelang"

    def resolve(self) -> Callable[..., Any]:
        if self.kind != "tilelang":
            raise TypeError(f"stage {self.name} is a {self.kind} stage; it is compiled in a worker "
                            "process (dsa_aot.cutedsl_backend.build_cutedsl), not resolved in this one")
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
    ("cutedsl", "fwd"): (
        StageDef("fwd", "dsa_aot.kernels.cutedsl_fwd", "compile_fwd", kind="cutedsl"),
    ),
    ("cutedsl", "bwd"): (
        StageDef("bwd_preprocess", "dsa_aot.kernels.cutedsl_bwd_preprocess", "compile_bwd_preprocess",
                 kind="cutedsl"),
        StageDef("bwd_main", "dsa_aot.kernels.cutedsl_bwd_main", "compile_bwd_main", kind="cutedsl"),
        StageDef("bwd_postprocess", "dsa_aot.kernels.cutedsl_bwd_postprocess", "compile_bwd_postprocess",
                 kind="cutedsl"),
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
