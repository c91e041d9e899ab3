"""What a cache entry holds for one spec: the manifest (JSON payload) and its stage files."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from dsa_aot.launch import LaunchRecord
from dsa_aot.specs.models import KernelSpec


class StageArtifact(BaseModel):
    """One compiled kernel of an op: a cubin plus how to launch it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    format: Literal["cubin"] = "cubin"
    file: str
    launch: LaunchRecord


class ArtifactManifest(BaseModel):
    """The payload of a cache entry's ``meta.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal["dsa-aot.artifact.v1"] = "dsa-aot.artifact.v1"
    spec: KernelSpec
    fingerprint: str
    stages: tuple[StageArtifact, ...]
    build_seconds: float
    sources: dict[str, str] = {}  # stage -> CUDA source file name, kept for inspection
