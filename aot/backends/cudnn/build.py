"""Build side of the cudnn backend: spec -> one worker job -> exported, linked library + record.

The CuTe DSL backend's machinery does the work: its worker process
(:mod:`dsa_aot.backends.cutedsl.worker`, ``CUTE_DSL_ARCH`` set before ``cutlass`` is imported)
runs the compile function of :mod:`dsa_aot.backends.cudnn.kernels` named in the job and calls
``export_to_c``; this process checks the generated header against the argument records, links
the object with the static CUDA runtime into a self-contained ``.so`` and writes the
:class:`~dsa_aot.backends.cudnn.records.CudnnStageRecord`. Every spec is one stage (one exported
function runs the whole op), named ``cudnn_<op>_<arch>_d<D>_h<H>_<layout>[_k<topk>]_static``.
"""

from __future__ import annotations

import shutil
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from dsa_aot.backends.cudnn.records import (
    CudnnBuildError, CudnnStageRecord, Variant, check_bwd_params, check_fwd_params, sm100_bwd_variant)
from dsa_aot.backends.cutedsl.build import _collect_worker, _link, _spawn_worker, checked_export
from dsa_aot.backends.cutedsl.records import CuteBuildError, CuteExportRecord, sha256_file

if TYPE_CHECKING:
    from dsa_aot.specs.models import KernelSpec

KERNEL_MODULE = "dsa_aot.backends.cudnn.kernels"
FRONTEND = "nvidia-cudnn-frontend"
LINK = "static_cudart"


def stage_of(spec: KernelSpec) -> str:
    """The spec's one stage: ``fwd``, or ``bwd_main`` (the whole backward)."""
    return "fwd" if spec.op == "fwd" else "bwd_main"


def plan(spec: KernelSpec) -> tuple[Variant, str, dict[str, object]]:
    """``(variant, compile function, its parameters)`` for ``spec``; ``ValueError`` names the field
    the frontend's kernels cannot honour."""
    tile = spec.tile.model_dump(exclude_none=True)
    if tile:
        raise ValueError(f"{spec.id}: the cuDNN frontend's kernels have fixed tiles; tile {tile} cannot be "
                         "honoured (leave it unset)")
    params: dict[str, object] = {"d_qk": spec.d_qk, "heads": spec.heads, "layout": spec.layout}
    if spec.op == "fwd":
        if spec.arch != "sm_100a":
            raise ValueError(f"{spec.id}: the cuDNN frontend's forward is SM100-only (no {spec.arch} kernel)")
        try:
            check_fwd_params(spec.d_qk, spec.heads, spec.layout)
        except ValueError as exc:
            raise ValueError(f"{spec.id}: {exc}") from None
        return "sm100_fwd", "compile_fwd_sm100", params
    try:
        check_bwd_params(spec.d_qk, spec.heads, spec.layout, spec.topk)
    except ValueError as exc:
        raise ValueError(f"{spec.id}: {exc}") from None
    params["topk"] = spec.topk
    if spec.arch == "sm_90a":
        return "sm90", "compile_bwd_sm90", params
    return sm100_bwd_variant(spec.d_qk, spec.heads, int(spec.topk)), "compile_bwd_sm100", params


def artifact_name(spec: KernelSpec) -> str:
    name = f"cudnn_{spec.op}_{spec.arch}_d{spec.d_qk}_h{spec.heads}_{spec.layout}"
    if spec.topk is not None:
        name += f"_k{spec.topk}"
    return name + "_static"


def frontend_version() -> str:
    try:
        return metadata.version(FRONTEND)
    except metadata.PackageNotFoundError:
        raise CudnnBuildError(f"{FRONTEND} is not installed (pip install 'dsa-aot[build]')") from None


def build_spec(spec: KernelSpec, out_dir: str | Path, *, python: str | None = None,
               timeout: float = 1800.0) -> tuple[CudnnStageRecord, Path]:
    """Compile, export and link ``spec``'s stage into ``out_dir/<name>/``; returns its record and
    the library path. Raises :class:`CudnnBuildError` naming the step, ``ValueError`` for a spec
    the frontend's kernels cannot honour."""
    variant, function, params = plan(spec)
    version = frontend_version()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    scratch = out / f".build-{uuid.uuid4().hex[:8]}"
    (scratch / "job").mkdir(parents=True)
    name = artifact_name(spec)
    job = {"kernel": stage_of(spec), "module": KERNEL_MODULE, "function": function, "params": params,
           "link": LINK, "dir": str(scratch / "job"), "name": name}
    try:
        proc = _spawn_worker(spec.arch, [job], scratch, python or sys.executable)
        reply = _collect_worker(spec.arch, proc, scratch, timeout)
        result = reply["results"][0]
        start = time.perf_counter()
        folder = scratch / "job"
        args, symbols, obj = checked_export(result, folder)
        lib = folder / f"{name}.so"
        cudart = _link(obj, lib, LINK, Path(str(reply["libdir"])))
        export = CuteExportRecord(
            name=name, kernel=stage_of(spec), arch=spec.arch, prefix=name, library=lib.name, object_file=obj.name,
            header=f"{name}.h", symbols=symbols, args=tuple(args), link=LINK, cudart_version=cudart,
            d_qk=spec.d_qk, heads=spec.heads, layout=spec.layout, dsl_version=str(reply["dsl_version"]),
            library_sha256=sha256_file(lib),
            build_seconds=round(float(result["compile_seconds"]) + float(result["export_seconds"])
                                + time.perf_counter() - start, 3))
        record = CudnnStageRecord(export=export, variant=variant, topk=spec.topk, frontend_version=version)
        final = out / name
        if final.exists():
            shutil.rmtree(final)
        folder.rename(final)
        return record, final / lib.name
    except CuteBuildError as exc:
        raise CudnnBuildError(str(exc)) from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
