"""What a cache entry holds for one spec: the manifest (JSON payload of ``meta.json``) and its files.

A stage is one kernel of an op, stored as one file in a backend-defined ``format`` with that
backend's own launch record (a JSON object validated by the backend when it loads the stage:
a TileLang ``LaunchRecord`` for a cubin, a CuTe DSL ``CuteExportRecord`` for a linked library).
The manifest also records who built it and for what runtime:

* ``build``: the spec's :class:`~dsa_aot.specs.keys.BuildIdentity` (compilers by content, nvcc,
  the exact source files the build imported); its hash is the entry's key;
* ``runtime``: the :class:`~dsa_aot.specs.keys.RuntimeIdentity` a process must have to load the
  entry without compilers (our runtime code, the kernel sources, arch, host, CUDA driver floor).

This module imports no backend, so no backend's key depends on another's records.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsa_aot.backends.base import MANIFEST_FORMAT
from dsa_aot.backends.stage import StageArtifact  # noqa: F401  (re-exported)
from dsa_aot.specs.keys import BuildIdentity, RuntimeIdentity
from dsa_aot.specs.models import KernelSpec


class ArtifactManifest(BaseModel):
    """The payload of a cache entry's ``meta.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal[MANIFEST_FORMAT] = MANIFEST_FORMAT
    spec: KernelSpec
    key: str = Field(description="BuildIdentity.key(): the entry's key directory")
    build: BuildIdentity
    runtime: RuntimeIdentity
    stages: tuple[StageArtifact, ...] = Field(min_length=1)
    cuda_driver_min: str | None = Field(None, description="CUDA release of the toolkit that built "
                                        "it (e.g. '13.0'): the driver must support at least this")
    build_seconds: float
    sources: dict[str, str] = {}  # stage -> generated source file name, kept for inspection
    features: dict[str, bool | None] = Field(
        default_factory=dict,
        description="feature-probed code paths the stages were compiled with, e.g. "
        "{'cute_math_isfinite': True}; the compilers that decide them are in the key")

    @model_validator(mode="after")
    def _consistent(self) -> ArtifactManifest:
        names = [s.name for s in self.stages]
        files = [s.file for s in self.stages]
        if len(set(names)) != len(names) or len(set(files)) != len(files):
            raise ValueError(f"stage names {names} and files {files} must be unique")
        if self.build.key() != self.key:
            raise ValueError(f"key {self.key} is not the hash of its build identity ({self.build.key()})")
        if (self.runtime.arch, self.build.backend) != (self.spec.arch, self.spec.backend):
            raise ValueError("the identities describe another arch or backend than the spec")
        return self

    def stage(self, name: str) -> StageArtifact:
        for st in self.stages:
            if st.name == name:
                return st
        raise KeyError(f"{self.spec.id} has no stage {name!r}; stages: {[s.name for s in self.stages]}")
