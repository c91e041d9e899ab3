"""Kernel backends: how a spec is built (compiler imported) and loaded (no compiler).

Each backend answers three questions for the loader: can it serve a spec with the probed
features (:meth:`unsupported_reason`), how to build the spec's files (:meth:`build`, which may
import a compiler), and how to turn a stored artifact into callables (:meth:`load`, which
must not). The loader owns the cache, the locking and the fallback order.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsa_aot import registry
from dsa_aot.artifact import ArtifactManifest, CubinStage, CuteDslStage
from dsa_aot.specs.models import KernelSpec

if TYPE_CHECKING:
    from dsa_aot.cutedsl_backend import CuteExportRecord
    from dsa_aot.cutedsl_runtime import CuteDslKernel

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
def _nvcc_reason(spec: KernelSpec, features: Any | None) -> str | None:
    """Why the probed nvcc cannot build for ``spec.arch`` (None: it can, or nothing was probed)."""
    archs = getattr(features, "nvcc_archs", None)
    if archs is None:
        return None
    ok = archs.get(spec.arch)
    if ok is True:
        return None
    if ok is None:
        why = getattr(features, "errors", {}).get(f"nvcc_archs[{spec.arch}]", "not probed")
        why = (why.strip().splitlines() or ["no detail"])[-1][:200]
        return f"no nvcc could build a test cubin for {spec.arch} ({why})"
    accepted = ", ".join(a for a, good in archs.items() if good) or "none"
    return f"nvcc does not accept {spec.arch} (accepts {accepted})"


def compile_tilelang_stage(spec: KernelSpec, stage: registry.StageDef) -> tuple[CubinStage, dict[str, bytes]]:
    """Compile one TileLang stage to a cubin: its manifest entry and files (cubin + CUDA source)."""
    from dsa_aot.tilelang_backend import compile_stage

    try:
        prim_func, configs = stage.resolve()(spec)
        compiled = compile_stage(prim_func, spec.arch, configs)
    except Exception as exc:  # compiler errors come in many types
        raise BuildError(f"{spec.id} stage {stage.name}: {first_error_line(exc)}") from exc
    unknown = {p.name for p in compiled.record.params} - STAGE_PARAMS[stage.name]
    if unknown:
        raise BuildError(f"{spec.id} stage {stage.name}: unknown kernel parameters {sorted(unknown)}")
    files = {f"{stage.name}.cubin": compiled.cubin, f"{stage.name}.cu": compiled.cuda_source.encode()}
    return CubinStage(name=stage.name, file=f"{stage.name}.cubin", launch=compiled.record), files


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
        return _nvcc_reason(spec, features)

    def build(self, spec: KernelSpec, fingerprint: str) -> Built:
        start = time.perf_counter()
        files: dict[str, bytes] = {}
        stages, sources = [], {}
        for stage in registry.stages(self.name, spec.op):
            artifact, stage_files = compile_tilelang_stage(spec, stage)
            files.update(stage_files)
            sources[stage.name] = f"{stage.name}.cu"
            stages.append(artifact)
        manifest = ArtifactManifest(spec=spec, fingerprint=fingerprint, stages=tuple(stages),
                                    build_seconds=round(time.perf_counter() - start, 3), sources=sources)
        return Built(files=files, manifest=manifest)

    def load(self, manifest: ArtifactManifest, read: Callable[[str], bytes], device_index: int) -> Any:
        from dsa_aot.launch import CubinKernel
        from dsa_aot.runners import CubinBwd, CubinFwd

        kernels = {}
        for st in manifest.stages:
            if not isinstance(st, CubinStage):
                raise BuildError(f"{manifest.spec.id}: stage {st.name} is {st.format}, not a cubin")
            kernels[st.name] = CubinKernel(st.launch, read(st.file), device_index)
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
class CuteDslBackend(KernelBackend):
    """CuTe DSL kernels: the sparse MLA forward, and the backward (preprocess, main,
    postprocess).

    Every stage is exported and linked with the ``static_cudart`` link mode, so each is a
    self-contained shared library (about 1 MiB) that needs neither ``cutlass`` nor the DSL's
    runtime library where it runs. Building spawns one CuTe DSL worker per call
    (:func:`~dsa_aot.cutedsl_backend.build_cutedsl`) with ``CUTE_DSL_ARCH`` set before
    ``cutlass`` is imported, so a JIT build in a user's process is as correct as one in a
    ``prebuild`` worker. A registry entry may still mix in TileLang stages (cubins, compiled
    meanwhile); their needs (tilelang, nvcc) are then checked too.
    """

    name = "cutedsl"
    #: Link mode of the CuTe DSL stages (see :mod:`dsa_aot.cutedsl_backend`).
    link = "static_cudart"

    def can_build(self) -> str | None:
        uses_tilelang = any(self._uses_tilelang(op) for b, op in registry.implemented() if b == self.name)
        for module, dist in (("cutlass", "nvidia-cutlass-dsl"), ("tilelang", "tilelang")):
            if module == "tilelang" and not uses_tilelang:
                continue
            if importlib.util.find_spec(module) is None:
                return f"{dist} is not installed (pip install 'dsa-aot[build]')"
        from dsa_aot.cutedsl_backend import CuteBuildError, _cuda_home

        try:
            _cuda_home()  # the static CUDA runtime the link step needs
        except CuteBuildError as exc:
            return str(exc)
        cc = os.environ.get("CC", "cc")
        if shutil.which(cc) is None:
            return f"no C compiler {cc!r} to link the CuTe DSL objects (set CC)"
        return None

    def unsupported_reason(self, spec: KernelSpec, features: Any | None) -> str | None:
        if not self.implements(spec.op):
            return f"cutedsl has no {spec.op} kernel"
        if features is None:
            return None
        if not getattr(features, "cutlass_dsl_importable", True):
            why = getattr(features, "errors", {}).get("cutlass_dsl_importable", "")
            why = (why.strip().splitlines() or [""])[-1][:200]
            return "the CuTe DSL is not importable" + (f" ({why})" if why else "")
        if not self._uses_tilelang(spec.op):
            return None  # the CuTe DSL brings its own compiler: nvcc is not involved
        if not getattr(features, "tilelang_importable", True):
            return f"tilelang (a {spec.op} stage) is not importable"
        return _nvcc_reason(spec, features)

    def _uses_tilelang(self, op: str) -> bool:
        return any(st.kind == "tilelang" for st in registry.stages(self.name, op))

    def build(self, spec: KernelSpec, fingerprint: str, *, use_isfinite: bool | None = None) -> Built:
        """Compile ``spec``. ``use_isfinite`` forces the preprocess finiteness test; None lets the
        CuTe DSL worker probe ``cute.math.isfinite`` in the process that compiles. Raises
        :class:`BuildError`."""
        from dsa_aot.cutedsl_backend import BuildRequest, CuteBuildError, build_cutedsl

        start = time.perf_counter()
        plan = registry.stages(self.name, spec.op)
        cute_defs = [st for st in plan if st.kind == "cutedsl"]
        shape = {"d_qk": spec.d_qk, "heads": spec.heads, "layout": spec.layout}
        requests = [BuildRequest(kernel=st.name, arch=spec.arch, link=self.link,
                                 **(shape if st.name in ("fwd", "bwd_main") else {"use_isfinite": use_isfinite}))
                    for st in cute_defs]
        files: dict[str, bytes] = {}
        built: dict[str, CubinStage | CuteDslStage] = {}
        sources: dict[str, str] = {}
        with tempfile.TemporaryDirectory(prefix="dsa-aot-cutedsl-") as tmp, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsa-aot-cutedsl") as pool:
            cute_future = pool.submit(build_cutedsl, requests, tmp)  # a worker process; overlaps
            for st in plan:
                if st.kind == "tilelang":
                    built[st.name], stage_files = compile_tilelang_stage(spec, st)
                    files.update(stage_files)
                    sources[st.name] = f"{st.name}.cu"
            try:
                records = cute_future.result()
            except (CuteBuildError, OSError, ValueError) as exc:
                raise BuildError(f"{spec.id}: CuTe DSL build failed: {first_error_line(exc)}") from exc
            for st, record in zip(cute_defs, records):
                built[st.name], files[f"{st.name}.so"] = self._stage(spec, st.name, record, Path(tmp) / record.name)
        isfinite = {r.use_isfinite for r in records if r.use_isfinite is not None}
        if len(isfinite) > 1:
            raise BuildError(f"{spec.id}: CuTe DSL stages disagree on use_isfinite")
        manifest = ArtifactManifest(
            spec=spec, fingerprint=fingerprint, stages=tuple(built[st.name] for st in plan),
            build_seconds=round(time.perf_counter() - start, 3), sources=sources,
            features={"cute_math_isfinite": isfinite.pop()} if isfinite else {})
        return Built(files=files, manifest=manifest)

    def _stage(self, spec: KernelSpec, name: str, record: CuteExportRecord,
               folder: Path) -> tuple[CuteDslStage, bytes]:
        if record.link != self.link or record.runtime_libs:
            raise BuildError(f"{spec.id} stage {name}: expected a self-contained {self.link} library")
        unknown = {a.name for a in record.args if a.kind == "tensor"} - STAGE_PARAMS[name]
        if unknown:
            raise BuildError(f"{spec.id} stage {name}: unknown kernel parameters {sorted(unknown)}")
        data = (folder / record.library).read_bytes()
        if hashlib.sha256(data).hexdigest() != record.library_sha256:
            raise BuildError(f"{spec.id} stage {name}: {record.library} changed after linking")
        return CuteDslStage(name=name, file=f"{name}.so", cute=record), data

    def load(self, manifest: ArtifactManifest, read: Callable[[str], bytes], device_index: int) -> Any:
        """Open the CuTe DSL libraries (from the verified bytes), load the cubin, then prepare
        the libraries on ``device_index``: a CUDA problem surfaces here, as a miss."""
        from dsa_aot.cutedsl_runtime import CuteRuntimeError
        from dsa_aot.launch import CubinKernel, CudaError
        from dsa_aot.runners import CuteFwd, StagedBwd

        kernels: dict[str, Any] = {}
        try:
            for st in manifest.stages:  # ctypes only, no CUDA call
                if isinstance(st, CuteDslStage):
                    kernels[st.name] = open_cute_library(st.cute, read(st.file))
            for st in manifest.stages:
                if isinstance(st, CubinStage):
                    kernels[st.name] = CubinKernel(st.launch, read(st.file), device_index)
            for st in manifest.stages:
                if isinstance(st, CuteDslStage):
                    kernels[st.name].prepare(device_index)
        except CuteRuntimeError as exc:  # the loader treats CUDA load failures as a miss
            raise CudaError(f"{manifest.spec.id}: {exc}") from exc
        if manifest.spec.op == "fwd":
            return CuteFwd(kernels["fwd"], manifest.spec)
        return StagedBwd(kernels["bwd_preprocess"], kernels["bwd_main"], kernels["bwd_postprocess"],
                         manifest.spec)


_CUTE_LIBS: dict[str, CuteDslKernel] = {}
_CUTE_FDS: dict[str, int] = {}  # memfds stay open: their /proc/self/fd name must never be reused
_CUTE_LOCK = threading.Lock()
_SEALS = ("F_SEAL_SEAL", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE")


def open_cute_library(record: CuteExportRecord, data: bytes) -> CuteDslKernel:
    """A CuTe DSL kernel ``dlopen``-ed from exactly ``data`` (already sha256-checked by the store).

    The bytes go into a sealed anonymous file (``memfd_create``; no path another process can
    write, no write after sealing, nothing left on disk, unaffected by a ``noexec`` /tmp) and
    ``/proc/self/fd/<n>`` is opened. Without memfd or /proc, a private temporary folder (mode
    0700) holds the file until it is opened. One instance per distinct library per process:
    identical pre/post-processing libraries of many specs load once. Raises
    :class:`~dsa_aot.cache.store.CorruptArtifact` when ``data`` is not the recorded library.
    """
    from dsa_aot.cache.store import CorruptArtifact

    digest = hashlib.sha256(data).hexdigest()
    if digest != record.library_sha256:
        raise CorruptArtifact(f"{record.name}: library sha256 {digest[:12]} differs from its record "
                              f"({record.library_sha256[:12]})")
    with _CUTE_LOCK:
        kernel = _CUTE_LIBS.get(digest)
        if kernel is None:
            kernel = _open_memfd(record, data, digest)
            if kernel is None:
                kernel = _open_tempfile(record, data)
            _CUTE_LIBS[digest] = kernel
        return kernel


def _open_memfd(record: CuteExportRecord, data: bytes, digest: str) -> CuteDslKernel | None:
    from dsa_aot.cutedsl_runtime import CuteDslKernel

    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return None
    create = getattr(os, "memfd_create", None)
    if create is None or not all(hasattr(fcntl, s) for s in ("F_ADD_SEALS", *_SEALS)):
        return None
    try:
        fd = create(f"dsa-aot-{record.name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        seals = 0
        for name in _SEALS:
            seals |= getattr(fcntl, name)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        folder = Path("/proc/self/fd")
        if not (folder / str(fd)).exists():
            os.close(fd)
            return None
        kernel = CuteDslKernel(folder, record.model_copy(update={"library": str(fd)}))
    except BaseException:
        os.close(fd)
        raise
    _CUTE_FDS[digest] = fd
    return kernel


def _open_tempfile(record: CuteExportRecord, data: bytes) -> CuteDslKernel:
    from dsa_aot.cutedsl_runtime import CuteDslKernel

    folder = Path(tempfile.mkdtemp(prefix="dsa-aot-so-"))  # mode 0700, a unique name per load
    try:
        (folder / record.library).write_bytes(data)
        return CuteDslKernel(folder, record)  # dlopen maps it; the file can go right after
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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


BACKENDS: dict[str, KernelBackend] = {b.name: b for b in (TileLangBackend(), CuteDslBackend(),
                                                            ReferenceBackend())}
