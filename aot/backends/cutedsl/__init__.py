"""The CuTe DSL backend: our sparse MLA forward and backward (pre, main, post) in CuTe DSL,
compiled in a per-arch worker process, exported and linked with the static CUDA runtime into
self-contained ~1 MiB shared libraries, loaded from sealed memfds with ctypes.

Build code: :mod:`.build` (requests, link, records) and :mod:`.worker` (the only code that
imports ``cutlass``). Load code: :mod:`.runtime`. Records: :mod:`.records`.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsa_aot.backends.base import OP_STAGES, stage_modules, BuildError, Built, KernelBackend, check_params, first_error_line

if TYPE_CHECKING:
    from dsa_aot.artifact import ArtifactManifest
    from dsa_aot.backends.stage import StageArtifact
    from dsa_aot.backends.cutedsl.records import CuteExportRecord
    from dsa_aot.specs.models import KernelSpec


class CuteDslBackend(KernelBackend):
    name = "cutedsl"
    stages = OP_STAGES
    kernel_modules = stage_modules("dsa_aot.kernels.cutedsl_")
    build_modules = ("dsa_aot.backends.cutedsl.build", "dsa_aot.backends.cutedsl.worker")
    runtime_module = "dsa_aot.backends.cutedsl.runtime"
    compilers = ("nvidia-cutlass-dsl*",)
    loads_sealed = True
    compiler_module = "cutlass"
    #: Link mode of every stage: self-contained libraries (see :mod:`.build`).
    link = "static_cudart"
    deterministic_archs = frozenset({"sm_90a"})

    def stage_module(self, spec: KernelSpec, stage: str) -> str:
        from dsa_aot.backends.cutedsl.flavours import kernel_entry, stage_impl

        impl = stage_impl(stage, spec.arch, spec.heads, spec.tile.flavour, spec.deterministic)
        return kernel_entry(stage, impl)[0]

    def call_flavour(self, heads: int, deterministic: bool) -> str | None:
        """A deterministic call the setting serves in the fixed-point mode
        (:func:`~dsa_aot.settings.deterministic_mode_for`) uses the fixed-point flavours (their
        own ``-det`` specs)."""
        from dsa_aot import settings

        mode = settings.deterministic_mode_for(settings.get().deterministic_mode, heads)
        if not deterministic or mode != "fixed_point":
            return None
        from dsa_aot.backends.cutedsl.flavours import FIXED_POINT_IMPL_BY_HEADS

        return FIXED_POINT_IMPL_BY_HEADS.get(heads)

    def check_spec(self, spec: KernelSpec) -> None:
        from dsa_aot.backends.cutedsl.build import requests_for

        super().check_spec(spec)
        requests_for(spec, self.stages[spec.op], link=self.link)

    def missing_compiler(self) -> str | None:
        reason = super().missing_compiler()
        if reason:
            return reason
        from dsa_aot import settings
        from dsa_aot.backends.cutedsl.build import CuteBuildError, cuda_home

        try:
            cuda_home()  # the static CUDA runtime the link step needs
        except CuteBuildError as exc:
            return str(exc)
        cc = settings.get().cc
        if shutil.which(cc) is None:
            return f"no C compiler {cc!r} to link the CuTe DSL objects (set CC)"
        return None

    def unsupported_reason(self, spec: KernelSpec, features: Any | None) -> str | None:
        reason = super().unsupported_reason(spec, features)
        if reason or features is None:
            return reason
        if not getattr(features, "cutlass_dsl_importable", True):
            why = features.why("cutlass_dsl_importable", missing="")
            return "the CuTe DSL is not importable" + (f" ({why})" if why else "")
        return None

    def build(self, spec: KernelSpec, *, use_isfinite: bool | None = None) -> Built:
        """Compile ``spec``'s stages in one worker. ``use_isfinite`` forces the preprocess
        finiteness test; None lets the worker probe ``cute.math.isfinite`` in the DSL that
        compiles. Raises :class:`BuildError`."""
        from dsa_aot.backends.cutedsl.build import CuteBuildError, build_cutedsl, requests_for

        start = time.perf_counter()
        names = self.stages[spec.op]
        try:
            requests = requests_for(spec, names, link=self.link, use_isfinite=use_isfinite)
        except ValueError as exc:
            raise BuildError(str(exc)) from exc
        files: dict[str, bytes] = {}
        stages = []
        with tempfile.TemporaryDirectory(prefix="dsa-aot-cutedsl-") as tmp:
            try:
                records = build_cutedsl(requests, tmp)
            except (CuteBuildError, OSError, ValueError) as exc:
                raise BuildError(f"{spec.id}: CuTe DSL build failed: {first_error_line(exc)}") from exc
            for name, record in zip(names, records):
                stage, files[f"{name}.so"] = self._stage(spec, name, record, Path(tmp) / record.name)
                stages.append(stage)
        isfinite = {r.use_isfinite for r in records if r.use_isfinite is not None}
        if len(isfinite) > 1:
            raise BuildError(f"{spec.id}: CuTe DSL stages disagree on use_isfinite")
        return Built(files=files, stages=tuple(stages), build_seconds=round(time.perf_counter() - start, 3),
                     features={"cute_math_isfinite": isfinite.pop()} if isfinite else {})

    def _stage(self, spec: KernelSpec, name: str, record: CuteExportRecord,
               folder: Path) -> tuple[StageArtifact, bytes]:
        if record.link != self.link or record.runtime_libs:
            raise BuildError(f"{spec.id} stage {name}: expected a self-contained {self.link} library")
        check_params(spec, name, {a.name for a in record.args if a.kind == "tensor"})
        data = (folder / record.library).read_bytes()
        if hashlib.sha256(data).hexdigest() != record.library_sha256:
            raise BuildError(f"{spec.id} stage {name}: {record.library} changed after linking")
        from dsa_aot.backends.stage import StageArtifact

        return StageArtifact(name=name, format="cutedsl_so", file=f"{name}.so",
                             record=record.model_dump(mode="json")), data

    def load(self, manifest: ArtifactManifest, read: Callable[[str], bytes], device_index: int) -> Any:
        from dsa_aot.backends.cutedsl.runtime import load

        return load(manifest, read, device_index)

    def load_sealed(self, spec: Any, stages: Any, read: Callable[[str], bytes], device_index: int,
                    digests: Mapping[str, str] | None = None) -> Any:
        from dsa_aot.backends.cutedsl.runtime import load_sealed

        return load_sealed(spec, stages, read, device_index, digests)


BACKEND = CuteDslBackend()
