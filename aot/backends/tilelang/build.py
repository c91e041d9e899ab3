"""Build side of the TileLang backend: spec -> PrimFunc -> (cubin, LaunchRecord).

Imports tilelang (the compiler) lazily; nothing here runs on the load path. The kernel is
lowered with an explicit target, its one device function is described by a
:class:`~dsa_aot.backends.tilelang.launch.LaunchRecord` (entry, parameters in order, grid expressions, block,
dynamic shared memory), and its CUDA source is compiled to a cubin by nvcc with TileLang's
own flags. Kernels must not use features our launcher cannot reproduce (TMA descriptors made
on the host, clusters, cooperative launch): those are refused here, at build time.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsa_aot.backends.stage import StageArtifact
from dsa_aot.backends.base import BuildError, check_params, first_error_line
from dsa_aot.backends.tilelang.records import LaunchRecord, ParamRecord

if TYPE_CHECKING:
    from dsa_aot.specs.models import KernelSpec

_KIND = {"handle": "ptr", "int32": "i32", "int64": "i64", "float32": "f32"}

#: Pass configs every stage gets: TMA descriptors are built by TileLang's host code, which we
#: do not ship, so TMA lowering stays off (gathered KV rows cannot use TMA anyway).
BASE_PASS_CONFIGS: dict[str, Any] = {"tl.disable_tma_lower": True}


class UnsupportedKernel(RuntimeError):
    """The lowered kernel needs a host-side feature the cubin launcher does not provide."""


@dataclass(frozen=True)
class CompiledStage:
    record: LaunchRecord
    cubin: bytes
    cuda_source: str


def compile_stage(prim_func: Any, arch: str, pass_configs: dict[str, Any] | None = None) -> CompiledStage:
    """Lower ``prim_func`` for ``arch`` (e.g. ``"sm_90a"``) and compile its device code."""
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    import tilelang  # noqa: F401  (registers TileLang's passes and codegen)
    import tvm
    from tilelang.cuda.backend import tilelang_callback_cuda_compile
    from tilelang.jit.adapter.utils import pythonic_expr

    configs = {**BASE_PASS_CONFIGS, **(pass_configs or {})}
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    with tvm.transform.PassContext(opt_level=3, config=configs), target:
        artifact = tilelang.lower(prim_func, target=target)
        for _, host_fn in artifact.host_mod.functions.items():
            if len(host_fn.attrs.get("tma_descriptor_args", None) or {}) > 0:
                raise UnsupportedKernel("kernel uses host-built TMA descriptors; keep tl.disable_tma_lower")
        functions = list(artifact.device_mod.functions.items())
        if len(functions) != 1:
            raise UnsupportedKernel(f"expected one device function, got {[g.name_hint for g, _ in functions]}")
        gvar, fn = functions[0]
        attrs = fn.attrs
        for feature in ("cluster_dims", "use_cooperative_groups"):
            if feature in attrs and attrs[feature]:
                raise UnsupportedKernel(f"kernel {gvar.name_hint} uses {feature}, which the launcher does not support")
        grid = ["1", "1", "1"]
        block = [1, 1, 1]
        for tag, extent in attrs["thread_extent"].items():
            axis = "xyz".index(str(tag)[-1])
            if "blockIdx" in str(tag):
                grid[axis] = pythonic_expr(extent, floor_div_op="//", ignore_cast=True)
            else:
                block[axis] = int(extent)
        params = []
        for p in fn.params:
            kind = _KIND.get(str(p.dtype))
            if kind is None:
                raise UnsupportedKernel(f"parameter {p.name} has unsupported dtype {p.dtype}")
            params.append(ParamRecord(name=p.name, kind=kind))
        smem = int(attrs["dyn_shared_memory_buf"]) if "dyn_shared_memory_buf" in attrs else 0
        record = LaunchRecord(entry=gvar.name_hint, params=tuple(params), grid=tuple(grid),
                              block=tuple(block), dynamic_smem=smem)
        cubin = bytes(tilelang_callback_cuda_compile(artifact.kernel_source, target, configs))
    return CompiledStage(record=record, cubin=cubin, cuda_source=artifact.kernel_source)


def build_stage(spec: KernelSpec, stage: str, module: str, builder: str) -> tuple[StageArtifact, dict[str, bytes]]:
    """Compile one stage of ``spec``: ``module.builder(spec) -> (prim_func, pass_configs)``, then
    a cubin. Returns its stage record and files (the cubin and its CUDA source)."""
    try:
        prim_func, configs = getattr(importlib.import_module(module), builder)(spec)
        compiled = compile_stage(prim_func, spec.arch, configs)
    except Exception as exc:  # compiler errors come in many types
        raise BuildError(f"{spec.id} stage {stage}: {first_error_line(exc)}") from exc
    check_params(spec, stage, {p.name for p in compiled.record.params})
    files = {f"{stage}.cubin": compiled.cubin, f"{stage}.cu": compiled.cuda_source.encode()}
    record = StageArtifact(name=stage, format="cubin", file=f"{stage}.cubin",
                           record=compiled.record.model_dump(mode="json"))
    return record, files
