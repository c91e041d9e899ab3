"""A runtime image without a CUDA toolkit serves the builder's artifacts, and only those.

The builder's key includes its nvcc version; a process with no nvcc cannot know it, so the
loader adopts the key of the builder whose recorded toolchain equals its own in every other
field (:func:`dsa_aot.loader.builder_fingerprint`). These tests publish entries stamped with a
toolchain and check which key each process would look up.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dsa_aot.cache.store import ArtifactStore
from dsa_aot.loader import Loader, builder_fingerprint
from dsa_aot.specs.toolchain import Toolchain

ARCH, SPEC = "sm_90a", "fwd-sm_90a-d576-h64-noncompact-tilelang"


@pytest.fixture
def builder() -> Toolchain:
    return Toolchain.current().model_copy(update={"nvcc_version": "13.0.88", "cuda_driver_min": "13.0"})


def _runtime(builder: Toolchain, **change: object) -> Toolchain:
    return builder.model_copy(update={"nvcc_version": None, "cuda_driver_min": None, **change})


def _publish(root: Path, toolchain: Toolchain, *, stamp: dict | None | str = "same") -> ArtifactStore:
    store = ArtifactStore(root)
    recorded = toolchain.model_dump(mode="json") if stamp == "same" else stamp
    payload = {"fingerprint": toolchain.fingerprint} | ({"toolchain": recorded} if recorded else {})
    store.publish(toolchain.fingerprint, ARCH, SPEC, {"fwd.cubin": b"\x7fELF"}, payload)
    return store


def test_runtime_without_nvcc_adopts_the_builders_key(tmp_path, builder):
    store = _publish(tmp_path, builder)
    runtime = _runtime(builder)
    assert runtime.fingerprint != builder.fingerprint
    assert builder_fingerprint(store, runtime) == builder.fingerprint
    loader = Loader()
    loader._toolchain = runtime
    assert loader.fingerprint_in(store) == builder.fingerprint
    assert store.lookup(loader.fingerprint_in(store), ARCH, SPEC) is not None


@pytest.mark.parametrize("change", [
    {"kernel_sources_sha256": "0" * 64},                       # other kernel sources
    {"host": "linux-aarch64"},                                 # other host code
    {"cutlass_dsl": ()},                                       # another DSL install
])
def test_any_other_difference_still_misses(tmp_path, builder, change):
    store = _publish(tmp_path, builder)
    runtime = _runtime(builder, **change)
    assert builder_fingerprint(store, runtime) == runtime.fingerprint


def test_a_process_with_nvcc_never_adopts(tmp_path, builder):
    store = _publish(tmp_path, builder)
    other_nvcc = builder.model_copy(update={"nvcc_version": "13.1.20", "cuda_driver_min": "13.1"})
    assert builder_fingerprint(store, other_nvcc) == other_nvcc.fingerprint


def test_unstamped_or_inconsistent_entries_are_not_adopted(tmp_path, builder):
    runtime = _runtime(builder)
    assert builder_fingerprint(_publish(tmp_path / "a", builder, stamp=None), runtime) == runtime.fingerprint
    lying = builder.model_copy(update={"nvcc_version": "12.9.41"}).model_dump(mode="json")
    assert builder_fingerprint(_publish(tmp_path / "b", builder, stamp=lying), runtime) == runtime.fingerprint
    assert builder_fingerprint(ArtifactStore(tmp_path / "missing"), runtime) == runtime.fingerprint


def test_manifest_stamp_must_be_the_keyed_toolchain(builder):
    from dsa_aot.artifact import ArtifactManifest
    from dsa_aot.launch import LaunchRecord
    from dsa_aot.specs.models import KernelSpec

    launch = LaunchRecord(entry="k", params=(), grid=("1", "1", "1"), block=(1, 1, 1))
    manifest = ArtifactManifest(spec=KernelSpec.from_id(SPEC), fingerprint=builder.fingerprint,
                                stages=({"format": "cubin", "name": "fwd", "file": "fwd.cubin",
                                         "launch": launch},), build_seconds=1.0)
    assert Toolchain.model_validate(manifest.stamped(builder).toolchain) == builder
    with pytest.raises(ValueError, match="is not the manifest's"):
        manifest.stamped(_runtime(builder))
