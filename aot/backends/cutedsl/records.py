"""Records of the CuTe DSL backend: what one exported, linked kernel library is and how to call it.

JSON only (pydantic); this module imports neither ``cutlass`` nor ``torch``, so both the build
side (:mod:`.build`, :mod:`.worker`) and the compiler-free load side (:mod:`.runtime`) share it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

Arch = Literal["sm_90a", "sm_100a"]
CuteKernel = Literal["bwd_preprocess", "bwd_postprocess", "fwd", "bwd_main"]
FwdLayout = Literal["compact", "noncompact"]
FwdImpl = Literal["mma", "wgmma", "wgmma_pipe", "wgmma_ws", "wgmma_split"]
#: The backward main stage's MMA flavours: mma.sync (any arch), wgmma (sm_90a) and the
#: slot-major wgmma kernel for few heads (sm_90a, heads in :data:`BWD_SLOT_MAJOR_HEADS`).
BwdMainImpl = Literal["mma", "wgmma", "wgmma_slot_major"]
#: Head counts of ``impl=wgmma_slot_major`` (``dsa_aot.kernels.cutedsl_bwd_slot_major.HEADS``).
BWD_SLOT_MAJOR_HEADS: tuple[int, ...] = (16, 32)
#: Kernel module and compile function of each stage (``f(arch, **params)`` returns ``(compiled,
#: fake_arguments)``); :data:`FLAVOUR_KERNELS` overrides it for a flavour with a module of its own.
#: A spec's key and runtime identity cover exactly the module its build imports.
KERNELS: dict[str, tuple[str, str]] = {
    "fwd": ("dsa_aot.kernels.cutedsl_fwd", "compile_fwd"),
    "bwd_preprocess": ("dsa_aot.kernels.cutedsl_bwd_preprocess", "compile_bwd_preprocess"),
    "bwd_main": ("dsa_aot.kernels.cutedsl_bwd_main", "compile_bwd_main"),
    "bwd_postprocess": ("dsa_aot.kernels.cutedsl_bwd_postprocess", "compile_bwd_postprocess"),
}
FLAVOUR_KERNELS: dict[tuple[str, str], tuple[str, str]] = {
    ("bwd_main", "wgmma_slot_major"): ("dsa_aot.kernels.cutedsl_bwd_slot_major",
                                       "compile_bwd_slot_major"),
}
#: The forward's MMA flavour per arch when a request names none (wgmma needs sm_90a).
FWD_DEFAULT_IMPL: dict[str, str] = {"sm_90a": "wgmma_split", "sm_100a": "mma"}
#: The backward main stage's MMA flavour per arch when a request names none: wgmma on sm_90a
#: (faster than mma on every benchmark row on the H200, bench/results/h200.md).
BWD_MAIN_DEFAULT_IMPL: dict[str, str] = {"sm_90a": "wgmma", "sm_100a": "mma"}
#: ... except at these (arch, heads): the slot-major kernel, whose MMAs multiply no padded heads.
BWD_MAIN_DEFAULT_IMPL_BY_HEADS: dict[tuple[str, int], str] = {
    ("sm_90a", 16): "wgmma_slot_major", ("sm_90a", 32): "wgmma_slot_major"}


def bwd_main_default_impl(arch: str, heads: int | None, deterministic: bool = False) -> str:
    """The backward main stage's flavour when a request names none (the deterministic variant
    is always the wgmma kernel's)."""
    if deterministic:
        return "wgmma"
    return BWD_MAIN_DEFAULT_IMPL_BY_HEADS.get((arch, heads or 0), BWD_MAIN_DEFAULT_IMPL[arch])


def kernel_entry(stage: str, impl: str | None) -> tuple[str, str]:
    """Module and compile function that build ``stage`` with MMA flavour ``impl``."""
    return FLAVOUR_KERNELS.get((stage, impl or ""), KERNELS[stage])


def stage_impl(stage: str, arch: str, heads: int, flavour: str | None,
               deterministic: bool = False) -> str | None:
    """The MMA flavour a stage is built with: the spec's ``tile.flavour`` or the default for
    its arch and heads (None for stages without flavours)."""
    if stage == "fwd":
        return flavour or FWD_DEFAULT_IMPL[arch]
    if stage == "bwd_main":
        return flavour or bwd_main_default_impl(arch, heads, deterministic)
    return None


#: Gathered KV tiles in flight per flavour when a request names none (measured on the H200:
#: mma 241 vs 208 TFLOPS with one vs two, wgmma 376 vs 353 with two vs one).
FWD_DEFAULT_KV_STAGES: dict[str, int] = {"mma": 1, "wgmma": 2, "wgmma_pipe": 2,
                                         "wgmma_ws": 2, "wgmma_split": 2}
LinkMode = Literal["dsl_runtime", "static_cudart"]
CType = Literal["int32", "int64"]

RECORD_FILE = "record.json"
RECORD_FORMAT = 1
#: The DSL runtime library the ``dsl_runtime`` link mode needs at run time.
DSL_RUNTIME_LIB = "libcute_dsl_runtime.so"
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
        "(sm_90a); bwd_main: mma, wgmma or wgmma_slot_major (sm_90a)")
    deterministic: bool = Field(False, description="backward: the deterministic variant (dkv_acc "
                                "[shards, s_kv, D], d_sink_acc [parts, H], folded in order)")
    dsl_version: str
    library_sha256: str
    build_seconds: float = Field(description="compile + export in the worker, then link")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
