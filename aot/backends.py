"""Kernel backends: how a spec is built (compiler imported) and loaded (no compiler).

Each backend answers three questions for the loader: can it serve a spec with the probed
features (:meth:`unsupported_reason`), how to build the spec's files (:meth:`build`, which may
import a compiler), and how to turn a stored artifact into callables (:meth:`load`, which
must not). The loader owns the cache, the locking and the fallback order.
"""

from __future__ import annotations

import importlib.util
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsa_aot import registry
from dsa_aot.artifact import ArtifactManifest, StageArtifact
from dsa_aot.specs.models import KernelSpec

#: Parameter names each stage may take (the kernel files' naming contract).
STAGE_PARAMS: dict[str, frozenset[str]] = {
    "fwd": frozenset({"q", "kv", "topk_idxs", "topk_length", "attn_sink", "out", "lse",
                      "softmax_scale", "s_q", "s_kv", "topk"}),
    "bwd_preprocess": frozenset({"out", "dout", "lse", "attn_sink", "delta", "lse_sink", "d_sink", "s_q"}),
    "bwd_main": frozenset({"q", "kv", "dout", "topk_idxs", "topk_length", "lse_sink", "delta", "dq",
                           "dkv_acc", "softmax_scale", "s_q", "s_kv", "topk"}),
    "bwd_postprocess": frozenset({"dkv_acc", "dkv", "s_kv"}),
}


class BuildError(RuntimeError):
    """Compiling a spec failed; the message carries the compiler's first error line."""


@dataclass(frozen=True)
class Built:
    files: dict[str, bytes]
    manifest: ArtifactManifest


class KernelBackend(ABC):
    name: str

    def implements(self, op: str) -> bool:
        return (self.name, op) in registry.implemented()

    @abstractmethod
    def unsupported_reason(self, spec: KernelSpec, features: Any | None) -> str | None:
        """Why this backend cannot build ``spec`` under the probed ``features`` (None: it can)."""

    def can_build(self) -> str | None:
        """Why this process cannot compile (compiler not installed), or None."""
        return None

    @abstractmethod
    def build(self, spec: KernelSpec, fingerprint: str) -> Built:
        """Compile ``spec``. Imports the compiler. Raises :class:`BuildError`."""

    @abstractmethod
    def load(self, manifest: ArtifactManifest, read: Callable[[str], bytes], device_index: int) -> Any:
        """A :class:`FwdKernel` / :class:`BwdKernel` from stored files. Never imports a compiler."""


# ---------------------------------------------------------------------------------------
class TileLangBackend(KernelBackend):
    """TileLang kernels compiled to cubins, launched through :mod:`dsa_aot.launch`."""

    name = "tilelang"

    def can_build(self) -> str | None:
        if importlib.util.find_spec("tilelang") is None:
            return "tilelang is not installed (pip install 'dsa-aot[build]')"
        return None

    def unsupported_reason(self, spec: KernelSpec, features: Any | None) -> str | None:
        if not self.implements(spec.op):
            return f"tilelang has no {spec.op} kernel"
        if features is not None:
            archs = getattr(features, "nvcc_archs", None)
            if archs is not None and spec.arch not in archs:
                return f"nvcc does not accept {spec.arch} (accepts {', '.join(archs) or 'none'})"
        return None

    def build(self, spec: KernelSpec, fingerprint: str) -> Built:
        from dsa_aot.tilelang_backend import compile_stage

        start = time.perf_counter()
        files: dict[str, bytes] = {}
        stages, sources = [], {}
        for stage in registry.stages(self.name, spec.op):
            try:
                prim_func, configs = stage.resolve()(spec)
                compiled = compile_stage(prim_func, spec.arch, configs)
            except Exception as exc:  # compiler errors come in many types
                raise BuildError(f"{spec.id} stage {stage.name}: {first_error_line(exc)}") from exc
            unknown = {p.name for p in compiled.record.params} - STAGE_PARAMS[stage.name]
            if unknown:
                raise BuildError(f"{spec.id} stage {stage.name}: unknown kernel parameters {sorted(unknown)}")
            files[f"{stage.name}.cubin"] = compiled.cubin
            files[f"{stage.name}.cu"] = compiled.cuda_source.encode()
            sources[stage.name] = f"{stage.name}.cu"
            stages.append(StageArtifact(name=stage.name, file=f"{stage.name}.cubin", launch=compiled.record))
        manifest = ArtifactManifest(spec=spec, fingerprint=fingerprint, stages=tuple(stages),
                                    build_seconds=round(time.perf_counter() - start, 3), sources=sources)
        return Built(files=files, manifest=manifest)

    def load(self, manifest: ArtifactManifest, read: Callable[[str], bytes], device_index: int) -> Any:
        from dsa_aot.launch import CubinKernel
        from dsa_aot.runners import CubinBwd, CubinFwd

        kernels = {st.name: CubinKernel(st.launch, read(st.file), device_index) for st in manifest.stages}
        if manifest.spec.op == "fwd":
            return CubinFwd(kernels["fwd"], manifest.spec)
        return CubinBwd(kernels["bwd_preprocess"], kernels["bwd_main"], kernels["bwd_postprocess"], manifest.spec)


def first_error_line(exc: BaseException) -> str:
    """The most useful single line of a compiler exception."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:
        low = ln.lower()
        if "error" in low and not low.startswith("traceback"):
            return ln[:400]
    return (lines[-1] if lines else type(exc).__name__)[:400]


# ---------------------------------------------------------------------------------------
class ReferenceBackend(KernelBackend):
    """The torch reference: always available, slow. The last step of every fallback chain."""

    name = "reference"

    def implements(self, op: str) -> bool:
        return op in ("fwd", "bwd")

    def unsupported_reason(self, spec: KernelSpec, features: Any | None) -> str | None:
        return None

    def build(self, spec: KernelSpec, fingerprint: str) -> Built:
        raise BuildError("the reference backend has nothing to build")

    def load(self, manifest: ArtifactManifest, read: Callable[[str], bytes], device_index: int) -> Any:
        raise BuildError("the reference backend has no artifacts")

    @staticmethod
    def kernel(op: str) -> Any:
        from dsa_aot.runners import ReferenceBwd, ReferenceFwd

        return ReferenceFwd() if op == "fwd" else ReferenceBwd()


BACKENDS: dict[str, KernelBackend] = {b.name: b for b in (TileLangBackend(), ReferenceBackend())}
