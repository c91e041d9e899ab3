"""Stored entries for the lookup tests: real v2 manifests (identities computed by
:mod:`dsa_aot.identity`) over a stand-in cubin of one TileLang forward spec, published into a
real store, and a loader that sees a given toolchain. Used by the loader's and the serving
path's tests (``tests/unit/loader/``)."""

from __future__ import annotations

import time

import pytest

from dsa_aot.artifact import ArtifactManifest
from dsa_aot.backends.stage import StageArtifact
from dsa_aot.backends.tilelang.records import LaunchRecord
from dsa_aot.cache.store import ArtifactStore, Entry
from dsa_aot.identity import build_identity, can_key_builds, runtime_identity
from dsa_aot.loader import Loader
from dsa_aot.specs.keys import RuntimeIdentity
from dsa_aot.specs.models import KernelSpec
from dsa_aot.specs.toolchain import Toolchain

SPEC = KernelSpec.from_id("fwd-sm_90a-d576-h64-noncompact-tilelang")
CUBIN = b"\x7fELF stand-in cubin"


def builder_toolchain(backend) -> Toolchain:
    """The toolchain that builds the entries: this one, with TileLang and an nvcc (else skip)."""
    t = Toolchain.current()
    if t.tilelang is None or can_key_builds(backend, t) is not None:
        pytest.skip(f"needs TileLang and nvcc installed: {can_key_builds(backend, t)}")
    return t


def manifest(backend, toolchain: Toolchain, runtime: RuntimeIdentity | None = None,
             edited: str | None = None) -> ArtifactManifest:
    """A manifest of ``SPEC`` built under ``toolchain`` (from an ``edited`` source file: another key)."""
    identity = build_identity(backend, SPEC, toolchain)
    if edited is not None:
        assert edited in identity.sources
        identity = identity.model_copy(update={"sources": {**identity.sources, edited: "e" * 64}})
    record = LaunchRecord(entry="sparse_mla_fwd_kernel", params=(), grid=("1", "1", "1"), block=(128, 1, 1))
    stage = StageArtifact(name="fwd", format="cubin", file="fwd.cubin", record=record.model_dump(mode="json"))
    return ArtifactManifest(spec=SPEC, key=identity.key(), build=identity,
                            runtime=runtime or runtime_identity(backend, SPEC), stages=(stage,),
                            cuda_driver_min=toolchain.cuda_driver_min, build_seconds=1.0)


def publish(store: ArtifactStore, manifest: ArtifactManifest, cubin: bytes = CUBIN) -> Entry:
    entry = store.publish(manifest.key, SPEC.arch, SPEC.id, {"fwd.cubin": cubin}, manifest.model_dump(mode="json"))
    time.sleep(0.01)  # distinct creation times: candidates() orders newest first
    return entry


def loader_with(toolchain: Toolchain) -> Loader:
    """A fresh loader that sees ``toolchain`` as this process's."""
    loader = Loader()
    loader._toolchain = toolchain
    return loader
