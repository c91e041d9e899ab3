"""The TileLang backend: kernels lowered by TileLang, compiled by nvcc to cubins, launched by our
own driver-API launcher (:mod:`.launch`) with no compiler in the process.

Build code: :mod:`.build` (imports tilelang). Load code: :mod:`.runtime`. Records: the
:class:`~.launch.LaunchRecord` of each cubin.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from dsa_aot.backends.base import OP_STAGES, stage_modules, Built, KernelBackend, nvcc_reason

if TYPE_CHECKING:
    from dsa_aot.artifact import ArtifactManifest
    from dsa_aot.specs.models import KernelSpec

#: Compile function of each stage's kernel module: ``f(spec) -> (prim_func, pass_configs)``.
BUILDERS = {"fwd": "build_fwd", "bwd_preprocess": "build_bwd_preprocess", "bwd_main": "build_bwd_main",
            "bwd_postprocess": "build_bwd_postprocess"}


class TileLangBackend(KernelBackend):
    name = "tilelang"
    stages = OP_STAGES
    kernel_modules = stage_modules("dsa_aot.kernels.tilelang_", bwd_main="bwd")
    build_modules = ("dsa_aot.backends.tilelang.build",)
    runtime_module = "dsa_aot.backends.tilelang.runtime"
    compilers = ("tilelang", "apache-tvm-ffi")
    loads_sealed = True
    compiler_module = "tilelang"

    def check_spec(self, spec: KernelSpec) -> None:
        """TileLang kernels take ``tile.block_i`` / ``num_stages`` / ``threads`` (each kernel
        checks its own ranges when it builds); they have one MMA flavour per arch."""
        super().check_spec(spec)
        if spec.tile.flavour is not None:
            raise ValueError(f"{spec.id}: tile.flavour={spec.tile.flavour!r} names a cutedsl MMA flavour; "
                             "the tilelang kernels pick theirs from tile.threads (leave flavour unset)")

    def unsupported_reason(self, spec: KernelSpec, features: Any | None) -> str | None:
        return super().unsupported_reason(spec, features) or nvcc_reason(spec, features)

    def build(self, spec: KernelSpec) -> Built:
        from dsa_aot.backends.tilelang.build import build_stage

        self.check_spec(spec)
        start = time.perf_counter()
        files: dict[str, bytes] = {}
        stages, sources = [], {}
        for stage in self.stages[spec.op]:
            record, stage_files = build_stage(spec, stage, self.kernel_modules[stage], BUILDERS[stage])
            files.update(stage_files)
            sources[stage] = f"{stage}.cu"
            stages.append(record)
        return Built(files=files, stages=tuple(stages), sources=sources,
                     build_seconds=round(time.perf_counter() - start, 3))

    def load(self, manifest: ArtifactManifest, read: Callable[[str], bytes], device_index: int) -> Any:
        from dsa_aot.backends.tilelang.runtime import load

        return load(manifest, read, device_index)

    def load_sealed(self, spec: Any, stages: Any, read: Callable[[str], bytes], device_index: int,
                    digests: Mapping[str, str] | None = None) -> Any:
        from dsa_aot.backends.tilelang.runtime import load_sealed

        return load_sealed(spec, stages, read, device_index)


BACKEND = TileLangBackend()
