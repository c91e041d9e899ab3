"""The cudnn backend: the cuDNN frontend's DeepSeek Sparse Attention kernels (CuTe DSL, from
``nvidia-cudnn-frontend``) compiled ahead of time, served like our CuTe DSL kernels.

* sm_90a backward: the frontend's SM90 preprocess, main and postprocess kernels, exported as one
  function; sm_100a backward: the SM100 variant its plan selects for a B200 (generic M64, H16
  M128, H32, H128 two-CTA); sm_100a forward: its head64 / head128 sparse-prefill kernels.
  The frontend has no SM90 forward.
* The backward is specialised on the top-k width: its specs carry a ``topk`` bucket and the
  loader pads a call's ``topk_idxs`` with -1 to the narrowest stored bucket that fits.
* Build: :mod:`.build` (one job for the CuTe DSL backend's worker, its header check and link),
  :mod:`.kernels` (the compile functions; the only code importing ``cudnn``). Load:
  :mod:`.runtime` (the CuTe DSL runtime's sealed-memfd ``dlopen`` and call frames).
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dsa_aot.backends.base import BuildError, Built, KernelBackend, first_error_line

if TYPE_CHECKING:
    from dsa_aot.artifact import ArtifactManifest
    from dsa_aot.specs.models import KernelSpec


#: The frontend module whose kernels each (op, arch) compiles; a release without it cannot build
#: the spec (1.28 has no SM100 forward).
FRONTEND_MODULES = {
    ("fwd", "sm_100a"): "deepseek_sparse_attention/sparse_attention_forward/_interface_sm100.py",
    ("bwd", "sm_90a"): "deepseek_sparse_attention/sparse_attention_backward/_interface_sm90.py",
    ("bwd", "sm_100a"): "deepseek_sparse_attention/sparse_attention_backward/_interface_sm100.py",
}


def missing_frontend_module(op: str, arch: str) -> str | None:
    """Why the installed frontend lacks the kernels of (op, arch), or None; reads the package's
    files only (``import cudnn`` is not needed to know)."""
    import importlib.util
    from pathlib import Path

    wanted = FRONTEND_MODULES.get((op, arch))
    found = importlib.util.find_spec("cudnn")
    if wanted is None or found is None or not found.submodule_search_locations:
        return None  # not this backend's shape, or no frontend at all (missing_compiler says so)
    if any((Path(root) / wanted).is_file() for root in found.submodule_search_locations):
        return None
    from importlib import metadata

    try:
        version = metadata.version("nvidia-cudnn-frontend")
    except metadata.PackageNotFoundError:
        version = "?"
    module = "cudnn." + wanted.removesuffix(".py").replace("/", ".")
    return f"nvidia-cudnn-frontend {version} has no {module} (its {op} kernels for {arch})"


class CudnnBackend(KernelBackend):
    name = "cudnn"
    stages = {"fwd": ("fwd",), "bwd": ("bwd_main",)}
    kernel_modules = {"fwd": "dsa_aot.backends.cudnn.kernels", "bwd_main": "dsa_aot.backends.cudnn.kernels"}
    build_modules = ("dsa_aot.backends.cudnn.build", "dsa_aot.backends.cutedsl.worker")
    runtime_module = "dsa_aot.backends.cudnn.runtime"
    compilers = ("nvidia-cudnn-frontend", "nvidia-cutlass-dsl*")
    compiler_module = "cudnn"
    topk_ops = frozenset({"bwd"})

    def check_spec(self, spec: KernelSpec) -> None:
        from dsa_aot.backends.cudnn.build import plan

        super().check_spec(spec)
        plan(spec)

    def missing_compiler(self) -> str | None:
        reason = super().missing_compiler()
        if reason:
            return reason
        from dsa_aot.backends.cutedsl import BACKEND as CUTEDSL

        return CUTEDSL.missing_compiler()  # the DSL, the toolkit's static runtime, a C compiler to link

    def unsupported_reason(self, spec: KernelSpec, features: Any | None) -> str | None:
        reason = super().unsupported_reason(spec, features)
        if reason:
            return reason
        if features is not None and not getattr(features, "cutlass_dsl_importable", True):
            return "the CuTe DSL is not importable"
        return missing_frontend_module(spec.op, spec.arch)

    def build(self, spec: KernelSpec) -> Built:
        """Compile ``spec``'s one stage in a CuTe DSL worker. Raises :class:`BuildError`."""
        from dsa_aot.backends.cudnn.build import CudnnBuildError, build_spec, stage_of

        start = time.perf_counter()
        name = stage_of(spec)
        with tempfile.TemporaryDirectory(prefix="dsa-aot-cudnn-") as tmp:
            try:
                record, library = build_spec(spec, tmp)
            except ValueError as exc:
                raise BuildError(str(exc)) from exc
            except (CudnnBuildError, OSError) as exc:
                raise BuildError(f"{spec.id}: cudnn build failed: {first_error_line(exc)}") from exc
            data = library.read_bytes()
        if hashlib.sha256(data).hexdigest() != record.export.library_sha256:
            raise BuildError(f"{spec.id}: {library.name} changed after linking")
        from dsa_aot.backends.stage import StageArtifact

        stage = StageArtifact(name=name, format="cutedsl_so", file=f"{name}.so", record=record.model_dump(mode="json"))
        return Built(files={stage.file: data}, stages=(stage,), build_seconds=round(time.perf_counter() - start, 3))

    def load(self, manifest: ArtifactManifest, read: Callable[[str], bytes], device_index: int) -> Any:
        from dsa_aot.backends.cudnn.runtime import load

        return load(manifest, read, device_index)


BACKEND = CudnnBackend()
