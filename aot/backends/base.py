"""The backend contract: what every kernel backend tells the build side and the loader.

A backend is one subpackage of :mod:`dsa_aot.backends` whose ``__init__`` exposes ``BACKEND``,
an instance of a :class:`KernelBackend` subclass. It declares, as data, which ops it implements
(its stages per op), which kernel module builds each stage, which modules hold its build and its
load code, and which compiler distributions it builds with; from these the key of each spec is
derived (:mod:`dsa_aot.specs.keys`). It implements three methods: :meth:`~KernelBackend.check_spec`
(refuse a spec field it cannot honour), :meth:`~KernelBackend.build` (compile a spec into files
and stage records; may import a compiler) and :meth:`~KernelBackend.load` (turn stored files into
a callable kernel; never imports a compiler). Locking, keys, publishing and fallback belong to
:mod:`dsa_aot.build` and :mod:`dsa_aot.loader`, not to backends.
"""

from __future__ import annotations

import importlib.util
import re
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from dsa_aot.artifact import ArtifactManifest
    from dsa_aot.backends.stage import StageArtifact
    from dsa_aot.specs.models import KernelSpec

#: Parameter names each stage may take (the kernel files' naming contract).
STAGE_PARAMS: dict[str, frozenset[str]] = {
    "fwd": frozenset({"q", "kv", "topk_idxs", "topk_length", "attn_sink", "out", "lse",
                      "softmax_scale", "s_q", "s_kv", "topk"}),
    "bwd_preprocess": frozenset({"out", "dout", "lse", "attn_sink", "delta", "lse_sink", "d_sink",
                                 "d_sink_acc", "softmax_scale", "s_q"}),
    "bwd_main": frozenset({"q", "kv", "dout", "topk_idxs", "topk_length", "lse_sink", "delta", "dq",
                           "dkv_acc", "dkv_rows", "dkv_fixed", "softmax_scale", "s_q", "s_kv", "topk",
                           "row_start", "row_step", "row_count", "fixed_measure"}),
    "bwd_postprocess": frozenset({"dkv_acc", "dkv_rows", "row_order", "row_offsets", "dkv",
                                  "d_sink_acc", "d_sink", "row_group", "s_kv", "dkv_fixed",
                                  "fixed_step", "fixed_bound"}),
}


#: ``format`` of every artifact manifest (:class:`~dsa_aot.artifact.ArtifactManifest`).
MANIFEST_FORMAT = "dsa-aot.artifact.v2"

#: The stages of each op, in launch order (every backend implements an op with these stages).
OP_STAGES: dict[str, tuple[str, ...]] = {"fwd": ("fwd",), "bwd": ("bwd_preprocess", "bwd_main", "bwd_postprocess")}


def stage_modules(prefix: str, **names: str) -> dict[str, str]:
    """``{stage: prefix + file}`` for the stages of :data:`OP_STAGES`; ``names`` overrides a
    stage's file name (default: the stage name), e.g. ``bwd_main="bwd"``."""
    stages = dict.fromkeys(s for op in OP_STAGES.values() for s in op)
    return {stage: prefix + names.get(stage, stage) for stage in stages}


class BuildError(RuntimeError):
    """Compiling a spec failed; the message carries the compiler's first error line."""


class CudaError(RuntimeError):
    """A CUDA driver or runtime call failed while loading or launching; the message names it."""


@dataclass(frozen=True)
class Built:
    """What :meth:`KernelBackend.build` returns: the files of one entry and their stage records."""

    files: dict[str, bytes]
    stages: tuple[StageArtifact, ...]
    build_seconds: float
    sources: dict[str, str] = field(default_factory=dict)  # stage -> generated source file, kept to inspect
    features: dict[str, bool | None] = field(default_factory=dict)  # probed code paths compiled in


class KernelBackend(ABC):
    """One way of compiling and running the sparse MLA ops. Subclasses set the class data."""

    #: Name used in specs, the catalog ranking and ``DSA_AOT_BACKENDS``.
    name: ClassVar[str]
    #: Stages of each implemented op, in launch order.
    stages: ClassVar[Mapping[str, tuple[str, ...]]]
    #: Kernel module that builds each stage.
    kernel_modules: ClassVar[Mapping[str, str]]
    #: Modules holding the build code (with the kernel modules: the roots of a spec's key sources).
    build_modules: ClassVar[tuple[str, ...]]
    #: Module holding the load code (the root of the runtime identity's sources).
    runtime_module: ClassVar[str]
    #: Distributions whose installed content keys the build; ``prefix*`` matches every
    #: distribution with that prefix. The first one must be importable to build at all.
    compilers: ClassVar[tuple[str, ...]]
    #: Import name of the compiler that must be installed to build (checked without importing it).
    compiler_module: ClassVar[str]
    #: Whether the CUDA toolkit (nvcc, its static runtime) takes part in the build.
    uses_cuda_toolkit: ClassVar[bool] = True
    #: Ops whose kernels are specialised on the top-k width: their specs name a bucket
    #: (``KernelSpec.topk``) and calls are padded to it; the other ops take any width.
    topk_ops: ClassVar[frozenset[str]] = frozenset()
    #: Archs whose backward this backend also builds as a deterministic variant
    #: (``KernelSpec.deterministic``).
    deterministic_archs: ClassVar[frozenset[str]] = frozenset()
    #: Whether :meth:`load_sealed` loads this backend's entries without pydantic (the serving
    #: path, :mod:`dsa_aot.serving`); otherwise only the loader serves them.
    loads_sealed: ClassVar[bool] = False

    def implements(self, op: str) -> bool:
        return op in self.stages

    def call_flavour(self, heads: int, deterministic: bool) -> str | None:
        """The tile flavour of the spec the loader serves a call from (None: the catalog's
        default spec); a backend whose settings pick other kernels names their flavour."""
        return None

    def stage_module(self, spec: KernelSpec, stage: str) -> str:
        """The kernel module that builds ``stage`` of ``spec`` (a backend whose flavours live in
        modules of their own picks by ``spec.tile``)."""
        return self.kernel_modules[stage]

    def kernel_sources(self, spec: KernelSpec) -> tuple[str, ...]:
        """The kernel modules of ``spec``'s stages, in launch order, without repeats."""
        return tuple(dict.fromkeys(self.stage_module(spec, s) for s in self.stages[spec.op]))

    def source_modules(self, spec: KernelSpec) -> tuple[str, ...]:
        """The modules whose source a build of ``spec`` reads: build code and stage kernels."""
        return self.build_modules + self.kernel_sources(spec)

    def check_spec(self, spec: KernelSpec) -> None:
        """Raise ``ValueError`` naming the field when a field of ``spec`` cannot drive the build."""
        if not self.implements(spec.op):
            raise ValueError(f"{spec.id}: backend {self.name} has no {spec.op} kernel")
        if (spec.topk is not None) != (spec.op in self.topk_ops):
            raise ValueError(f"{spec.id}: the {self.name} {spec.op} kernel " + (
                "is specialised on the top-k width; name its bucket (topk)" if spec.topk is None else
                f"takes any top-k width at run time; topk={spec.topk} cannot be honoured (leave it unset)"))
        if spec.deterministic and spec.arch not in self.deterministic_archs:
            raise ValueError(f"{spec.id}: backend {self.name} has no deterministic {spec.op} kernel for "
                             f"{spec.arch}" + (f" (it has for {', '.join(sorted(self.deterministic_archs))})"
                                               if self.deterministic_archs else ""))

    def missing_compiler(self) -> str | None:
        """Why this process cannot compile for this backend (None: it can)."""
        if importlib.util.find_spec(self.compiler_module) is None:
            return f"{self.compilers[0].rstrip('*')} is not installed (pip install 'dsa-aot[build]')"
        return None

    def unsupported_reason(self, spec: KernelSpec, features: Any | None) -> str | None:
        """Why ``spec`` cannot be built with the probed ``features`` (None: it can)."""
        try:
            self.check_spec(spec)
        except ValueError as exc:
            return str(exc)
        return None

    @abstractmethod
    def build(self, spec: KernelSpec) -> Built:
        """Compile ``spec`` (imports the compiler). Raises :class:`BuildError`."""

    @abstractmethod
    def load(self, manifest: ArtifactManifest, read: Callable[[str], bytes], device_index: int) -> Any:
        """A :class:`~dsa_aot.runners.FwdKernel` / :class:`~dsa_aot.runners.BwdKernel` from stored
        files (``read(name)`` returns sha256-checked bytes). Never imports a compiler. Raises
        :class:`CudaError` for a driver problem and ``CorruptArtifact`` for bad bytes."""

    def load_sealed(self, spec: Any, stages: Any, read: Callable[[str], bytes], device_index: int,
                    digests: Mapping[str, str] | None = None) -> Any:
        """:meth:`load` without pydantic, for :attr:`loads_sealed` backends: ``spec`` a
        :class:`~dsa_aot.specs.shapes.SpecFields`, ``stages`` views of the manifest's stages whose
        records were validated when written and are sealed by the entry's payload digest;
        ``digests`` the sha256 each file was checked against by ``read``."""
        raise NotImplementedError(f"backend {self.name} has no pydantic-free load")


def record_view(data: Any) -> Any:
    """A stored JSON record read as attributes (objects become namespaces, arrays tuples): how
    the load code reads a launch record without pydantic. The record was validated by its
    model when written, and the entry's payload digest seals it since."""
    if isinstance(data, dict):
        return types.SimpleNamespace(**{k: record_view(v) for k, v in data.items()})
    if isinstance(data, list):
        return tuple(record_view(v) for v in data)
    return data


def nvcc_reason(spec: KernelSpec, features: Any | None) -> str | None:
    """Why the probed nvcc cannot build for ``spec.arch`` (None: it can, or nothing was probed)."""
    archs = getattr(features, "nvcc_archs", None)
    if archs is None:
        return None
    ok = archs.get(spec.arch)
    if ok is True:
        return None
    if ok is None:
        why = features.why(f"nvcc_archs[{spec.arch}]", missing="not probed")
        return f"no nvcc could build a test cubin for {spec.arch} ({why})"
    accepted = ", ".join(a for a, good in archs.items() if good) or "none"
    return f"nvcc does not accept {spec.arch} (accepts {accepted})"


def first_error_line(exc: BaseException) -> str:
    """The most useful single line of a compiler exception.

    The exception line of a traceback it carries (``TypeError: ...``, the last one: the cause),
    else a compiler diagnostic (``...: error: ...``), else any line naming an error, else the last.
    """
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    raised = [ln for ln in lines if _EXCEPTION_LINE.match(ln)]
    if raised:
        return raised[-1][:400]
    for ln in lines:
        if "error:" in ln.lower():
            return ln[:400]
    for ln in lines:
        low = ln.lower()
        if "error" in low and not low.startswith(("traceback", "raise ")):
            return ln[:400]
    return (lines[-1] if lines else type(exc).__name__)[:400]


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt): ")


def check_params(spec: KernelSpec, stage: str, names: set[str]) -> None:
    """Refuse a stage whose kernel takes parameters outside the naming contract."""
    unknown = names - STAGE_PARAMS[stage]
    if unknown:
        raise BuildError(f"{spec.id} stage {stage}: unknown kernel parameters {sorted(unknown)}")
