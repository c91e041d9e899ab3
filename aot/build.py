"""The one build path: check, lock, re-check, build, publish. ``prebuild`` and run-time JIT share it.

Nothing here imports the loader. A build runs only when :func:`build_blocker` finds no reason
against it; :func:`build_and_publish` then takes the key's file lock, looks again (another
process may have published meanwhile), compiles, and publishes the files with a manifest that
records the spec's build identity (its key) and runtime identity.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from dsa_aot.artifact import ArtifactManifest
from dsa_aot.backends import get as get_backend
from dsa_aot.backends.base import KernelBackend
from dsa_aot.cache.store import ArtifactStore, CacheError, Entry
from dsa_aot.identity import build_identity, can_key_builds, runtime_identity
from dsa_aot.specs.models import KernelSpec
from dsa_aot.specs.toolchain import Toolchain

log = logging.getLogger("dsa_aot")


def build_blocker(backend: KernelBackend, spec: KernelSpec, toolchain: Toolchain,
                  features: Any | None) -> str | None:
    """Why ``spec`` cannot be built here (compiler missing, key unreadable, a probed feature
    or a spec field the backend refuses); None when it can. The one feature check."""
    return can_key_builds(backend, toolchain) or backend.unsupported_reason(spec, features)


def manifest_for(backend: KernelBackend, spec: KernelSpec, toolchain: Toolchain, built: Any) -> ArtifactManifest:
    """The manifest of a fresh build of ``spec`` under ``toolchain``."""
    identity = build_identity(backend, spec, toolchain)
    return ArtifactManifest(spec=spec, key=identity.key(), build=identity,
                            runtime=runtime_identity(backend, spec), stages=built.stages,
                            cuda_driver_min=toolchain.cuda_driver_min if backend.uses_cuda_toolkit else None,
                            build_seconds=built.build_seconds, sources=built.sources, features=built.features)


@dataclass(frozen=True)
class Published:
    """What :func:`build_and_publish` did: ``built`` (compiled and stored) or ``cached`` (another
    process had stored it first); ``files`` is set only when the store could not keep them."""

    status: Literal["built", "cached", "memory"]
    manifest: ArtifactManifest
    entry: Entry | None = None
    files: dict[str, bytes] | None = None
    error: str | None = None

    def read(self, store: ArtifactStore | None):
        """A ``read(name) -> bytes`` over the stored (sha256-checked) or in-memory files."""
        if self.entry is not None and store is not None:
            return lambda name: store.read_file(self.entry, name)
        assert self.files is not None
        return self.files.__getitem__


def build_and_publish(store: ArtifactStore | None, spec: KernelSpec, toolchain: Toolchain) -> Published:
    """Compile ``spec`` and publish it into ``store`` under its key, once across processes.

    Under the key's lock the store is looked up again first. ``store=None`` (no writable root)
    or a toolchain that cannot key the build (:func:`~dsa_aot.identity.can_key_builds`)
    compiles in memory. A failure to store (disk full, read-only) keeps the files in memory and
    says why in ``error``. Raises :class:`~dsa_aot.backends.base.BuildError` when compiling
    fails, ``TimeoutError`` when another builder holds the lock too long.
    """
    backend = get_backend(spec.backend)
    key = build_identity(backend, spec, toolchain).key()
    unkeyable = can_key_builds(backend, toolchain)
    if store is None or unkeyable:  # never file an entry under a weakened key
        built = backend.build(spec)
        why = f"its build key cannot be computed here ({unkeyable})" if store is not None else None
        return Published("memory", manifest_for(backend, spec, toolchain, built), files=built.files, error=why)
    with store.lock(key, spec.arch, spec.id):
        entry = store.lookup(key, spec.arch, spec.id)
        if entry is not None:
            try:
                return Published("cached", ArtifactManifest.model_validate(entry.meta.payload), entry)
            except ValueError:
                store.quarantine(entry, "unreadable manifest")
        store.sweep_staging()  # debris of builders that died mid-publish
        built = backend.build(spec)
        manifest = manifest_for(backend, spec, toolchain, built)
        try:
            entry = store.publish(key, spec.arch, spec.id, built.files, manifest.model_dump(mode="json"))
        except (OSError, CacheError) as exc:  # disk full, read-only root: keep it in memory
            return Published("memory", manifest, files=built.files, error=str(exc))
    return Published("built", manifest, entry)
