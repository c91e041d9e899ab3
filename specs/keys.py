"""Per-spec cache keys, derived from what a spec's build reads, and the runtime identity.

Two identities describe an artifact (both are recorded in its manifest):

* :class:`BuildIdentity`: everything a build of one spec reads besides the spec itself: its
  backend's compiler distributions by content, which of the CuTe DSL's CUDA builds the DSL
  loads (it picks one by the driver), the nvcc that keys the CUDA toolkit, the host,
  and the sha256 of exactly the source files the build imports. Those files come from the
  module graph (:func:`module_sources`): the backend's build modules and the spec's kernel
  modules, followed through every static ``import`` of a ``dsa_aot`` module (parent packages
  included, ``if TYPE_CHECKING:`` blocks excluded), without importing anything. Its hash is the
  entry's key, so editing a kernel file misses exactly the specs built from it.
* :class:`RuntimeIdentity`: what a process must share with the artifact to load it when no
  compiler is installed (a serving image): our runtime code for the backend (the module graph of
  its load code), the spec's kernel sources, arch, host, and the CUDA driver floor.

The spec itself is not in the key: its id (which covers every field) names the entry's folder.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from dsa_aot.specs.sources import (  # noqa: F401  (re-exported)
    KEY_SCHEMA, MEMO_KIND, ROOT_PACKAGE, clear_caches, host_tag, identity_key, module_sources, runtime_identity_fields,
    sources_sha256)
from dsa_aot.specs.toolchain import Distribution


class BuildIdentity(BaseModel):
    """What one spec's build reads besides the spec; :meth:`key` names its cache directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: int = KEY_SCHEMA
    backend: str
    compilers: tuple[Distribution, ...] = Field(description="the backend's compiler distributions, "
                                                "by content (RECORD digest), sorted by name")
    nvcc_version: str | None = Field(description="the CUDA toolkit's nvcc, when the backend uses it")
    cutlass_dsl_cuda: int | None = Field(None, description="CUDA major of the CuTe DSL build the "
                                         "build host's DSL loaded (13: nvidia-cutlass-dsl-libs-cu13), "
                                         "when the backend compiles with the CuTe DSL")
    host: str = Field(description="OS and CPU of host code in artifacts, e.g. 'linux-x86_64'")
    sources: dict[str, str] = Field(description="module file (e.g. 'dsa_aot/kernels/tilelang_fwd.py') "
                                    "-> sha256, for every dsa_aot module the build imports")

    def key(self) -> str:
        """First 16 hex chars of the sha256 of the canonical JSON."""
        return identity_key(self.model_dump(mode="json"))


class RuntimeIdentity(BaseModel):
    """What a compiler-free process must match to load an artifact."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: int = KEY_SCHEMA
    backend: str
    arch: str
    host: str
    runtime_sha256: str = Field(description="hash of the backend's load code (its module graph)")
    kernel_sha256: str = Field(description="hash of the spec's kernel sources (its module graph)")

    def mismatch(self, other: RuntimeIdentity) -> str | None:
        """The first field that differs from ``other`` (None when they match)."""
        mine, theirs = self.model_dump(), other.model_dump()
        for name in mine:
            if mine[name] != theirs[name]:
                return name
        return None
