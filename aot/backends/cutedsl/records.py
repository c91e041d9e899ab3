"""Records of the CuTe DSL backend: what one exported, linked kernel library is and how to call it.

JSON only (pydantic); this module imports neither ``cutlass`` nor ``torch``. The build side
(:mod:`.build`, :mod:`.worker`) writes and checks records with these models, the loader validates
them before loading; the load code (:mod:`.runtime`) reads them as attribute views, pydantic-free.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from dsa_aot.backends.cutedsl.flavours import (  # noqa: F401  (re-exported)
    BWD_MAIN_DEFAULT_IMPL, BWD_MAIN_DEFAULT_IMPL_BY_HEADS, BWD_MAIN_HEADS, BWD_MAIN_IMPLS,
    BWD_SLOT_MAJOR_HEADS, BWD_WS_HEADS, DETERMINISTIC_BWD_MAIN_IMPLS, FIXED_POINT_IMPLS,
    FIXED_POINT_POST, FLAVOUR_KERNELS,
    FWD_DEFAULT_IMPL, FWD_DEFAULT_KV_STAGES, KERNELS, Arch, BwdMainImpl, CuteKernel, FwdImpl, FwdLayout,
    bwd_main_default_impl, kernel_entry, stage_impl)
from dsa_aot.backends.cutedsl.names import DSL_RUNTIME_LIB, RECORD_FILE, sha256_file  # noqa: F401  (re-exported)

LinkMode = Literal["dsl_runtime", "static_cudart"]
CType = Literal["int32", "int64"]

RECORD_FORMAT = 1
_DSL_STATIC_SHIMS = "libcuda_dialect_runtime_static.a"
WORKER_MODULE = "dsa_aot.backends.cutedsl.worker"


class CuteBuildError(RuntimeError):
    """A CuTe DSL build, export or link step failed; the message says which and why."""


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------

class DimRecord(BaseModel):
    """One shape or stride entry: a compile-time ``value``, or run-time (``value`` None)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    value: int | None = None
    symbol: str | None = Field(None, description="run-time dims sharing a symbol must be equal")
    divisibility: int = Field(1, ge=1, description="a run-time value must be a multiple of it")


class TensorArgRecord(BaseModel):
    """A tensor argument, passed as ``{void *data; shapes[n]; strides[m]}`` (run-time dims only)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["tensor"] = "tensor"
    name: str
    dtype: Literal["bfloat16", "float16", "float32", "int32", "int64"]
    shape: tuple[DimRecord, ...]
    stride: tuple[DimRecord, ...]
    shape_ctype: CType = "int32"
    stride_ctype: CType = "int64"
    align: int = Field(ge=1, description="byte alignment the kernel assumes for the data pointer")

    @property
    def dynamic_shape_dims(self) -> tuple[int, ...]:
        return tuple(i for i, d in enumerate(self.shape) if d.value is None)

    @property
    def dynamic_stride_dims(self) -> tuple[int, ...]:
        return tuple(i for i, d in enumerate(self.stride) if d.value is None)


class StreamArgRecord(BaseModel):
    """A ``cudaStream_t`` argument."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["stream"] = "stream"
    name: str


class ScalarArgRecord(BaseModel):
    """A scalar passed by value (``&value`` in the packed argument array)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["scalar"] = "scalar"
    name: str
    dtype: Literal["float32", "int32"]


ArgRecord = Annotated[Union[TensorArgRecord, StreamArgRecord, ScalarArgRecord],
                      Field(discriminator="kind")]


class RuntimeLibRecord(BaseModel):
    """A shared library the artifact needs loaded (``RTLD_GLOBAL``) before it is opened."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(description="file name, also its SONAME, e.g. libcute_dsl_runtime.so")
    distribution: str = Field(description="pip distribution that ships it")
    package_path: str = Field(description="path inside site-packages")
    size: int
    sha256: str


class CuteSymbols(BaseModel):
    """Entry points of the exported object (MLIR C interface: ``void f(void **args[, n])``).

    ``init(&{&library, &err})`` loads the embedded cubin once per process;
    ``load_to_device(&{&library, &device, &err})`` prepares one device;
    ``entry(args, n)`` launches, ``args`` being one pointer per argument (a tensor descriptor,
    ``&stream``) followed by ``&ret`` (int32, a CUDA error code; 0 on success).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    init: str
    load_to_device: str
    entry: str


class CuteExportRecord(BaseModel):
    """One exported, linked CuTe DSL kernel (``record.json`` beside ``library``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal[1] = RECORD_FORMAT
    name: str
    kernel: CuteKernel
    arch: Arch
    prefix: str = Field(description="C symbol prefix given to export_to_c")
    library: str = Field(description="linked shared library, relative to the record")
    object_file: str
    header: str
    symbols: CuteSymbols
    args: tuple[ArgRecord, ...]
    link: LinkMode
    runtime_libs: tuple[RuntimeLibRecord, ...] = ()
    cudart_version: int | None = Field(None, description="static CUDA runtime linked in, if any")
    use_isfinite: bool | None = Field(None, description="finiteness via cute.math.isfinite "
                                      "(True) or +-inf compares (False); None if not used")
    d_qk: int | None = Field(None, description="fwd: query/key head dim (512 or 576)")
    heads: int | None = Field(None, description="fwd: number of query heads")
    layout: FwdLayout | None = Field(None, description="fwd: topk_length given (compact) or not")
    kv_stages: int | None = Field(None, description="fwd: gathered KV tiles in flight (1 or 2)")
    impl: FwdImpl | BwdMainImpl | None = Field(
        None, description="fwd: mma.sync (any arch), wgmma, wgmma_pipe, wgmma_ws or wgmma_split "
        "(sm_90a); bwd_main: mma, wgmma, wgmma_slot_major, wgmma_ws, wgmma_ws_slot_major, "
        "wgmma_ws_staggered, wgmma_ws_persistent, wgmma_ws_cols, wgmma_ws_dq_lines or a _fixed "
        "mode (sm_90a)")
    deterministic: bool = Field(False, description="backward: the deterministic variant (the "
                                "main kernel stores per-slot dKV rows, dkv_rows, that the "
                                "postprocess sums in the order of row_order / row_offsets; "
                                "d_sink_acc [parts, H] folded in order)")
    dsl_version: str
    library_sha256: str
    build_seconds: float = Field(description="compile + export in the worker, then link")
