"""What a cache entry holds for one spec: the manifest (JSON payload) and its stage files.

A stage is one kernel of an op, stored as one file in one of two formats:

* ``cubin``: a CUDA binary plus its :class:`~dsa_aot.launch.LaunchRecord`, launched by
  :class:`~dsa_aot.launch.CubinKernel` (TileLang kernels);
* ``cutedsl_so``: a self-contained shared library exported from CuTe DSL (host launcher with the
  cubin embedded, CUDA runtime linked in statically) plus its
  :class:`~dsa_aot.cutedsl_backend.CuteExportRecord`, run by
  :class:`~dsa_aot.cutedsl_runtime.CuteDslKernel`.

The ``format`` field tags the stage; each format carries exactly its own record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsa_aot.cutedsl_backend import CuteExportRecord
from dsa_aot.launch import LaunchRecord
from dsa_aot.specs.models import KernelSpec

if TYPE_CHECKING:
    from dsa_aot.specs.toolchain import Toolchain


class CubinStage(BaseModel):
    """One compiled kernel as a cubin plus how to launch it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    format: Literal["cubin"] = "cubin"
    file: str
    launch: LaunchRecord


class CuteDslStage(BaseModel):
    """One CuTe DSL kernel exported and linked into a shared library (``dlopen``-ed at load)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    format: Literal["cutedsl_so"] = "cutedsl_so"
    file: str
    cute: CuteExportRecord

    @model_validator(mode="after")
    def _record_matches_stage(self) -> CuteDslStage:
        if self.cute.kernel != self.name:
            raise ValueError(f"stage {self.name!r} holds a record of kernel {self.cute.kernel!r}")
        if not self.file.endswith(".so"):
            raise ValueError(f"stage {self.name!r}: file {self.file!r} is not a shared library (.so)")
        return self


#: A stage of any format, told apart by its ``format`` field.
StageArtifact = Annotated[Union[CubinStage, CuteDslStage], Field(discriminator="format")]


class ArtifactManifest(BaseModel):
    """The payload of a cache entry's ``meta.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal["dsa-aot.artifact.v1"] = "dsa-aot.artifact.v1"
    spec: KernelSpec
    fingerprint: str
    stages: tuple[StageArtifact, ...] = Field(min_length=1)
    build_seconds: float
    sources: dict[str, str] = {}  # stage -> CUDA source file name, kept for inspection
    features: dict[str, bool | None] = Field(
        default_factory=dict,
        description="feature-probed code paths the stages were compiled with, e.g. "
        "{'cute_math_isfinite': True}; the toolchain fingerprint keys the compilers that decide them")
    toolchain: dict[str, Any] | None = Field(
        None, description="the builder's Toolchain (JSON) whose fingerprint keys this entry; a "
        "process without a CUDA toolkit recognises the builder's key by it (see dsa_aot.loader)")

    def stamped(self, toolchain: Toolchain) -> ArtifactManifest:
        """This manifest with the builder's ``toolchain`` recorded (it must be the keyed one)."""
        if toolchain.fingerprint != self.fingerprint:
            raise ValueError(f"toolchain {toolchain.fingerprint} is not the manifest's {self.fingerprint}")
        return self.model_copy(update={"toolchain": toolchain.model_dump(mode="json")})

    @model_validator(mode="after")
    def _unique_stage_files(self) -> ArtifactManifest:
        names = [s.name for s in self.stages]
        files = [s.file for s in self.stages]
        if len(set(names)) != len(names) or len(set(files)) != len(files):
            raise ValueError(f"stage names {names} and files {files} must be unique")
        return self

    def stage(self, name: str) -> CubinStage | CuteDslStage:
        for st in self.stages:
            if st.name == name:
                return st
        raise KeyError(f"{self.spec.id} has no stage {name!r}; stages: {[s.name for s in self.stages]}")
