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

from dsa_aot.backends.base import BuildError, Built, KernelBackend, StageArtifact, first_error_line

if TYPE_CHECKING:
    from dsa_aot.artifact import ArtifactManifest
    from dsa_aot.specs.models import KernelSpec


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
        if reason or features is None:
            return reason
        if not getattr(features, "cutlass_dsl_importable", True):
            return "the CuTe DSL is not importable"
        return None

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
        stage = StageArtifact(name=name, format="cutedsl_so", file=f"{name}.so", record=record.model_dump(mode="json"))
        return Built(files={stage.file: data}, stages=(stage,), build_seconds=round(time.perf_counter() - start, 3))

    def load(self, manifest: ArtifactManifest, read: Callable[[str], bytes], device_index: int) -> Any:
        from dsa_aot.backends.cudnn.runtime import load

        return load(manifest, read, device_index)


BACKEND = CudnnBackend()
