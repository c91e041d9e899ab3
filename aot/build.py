"""The one build path: check, lock, re-check, build, publish. ``prebuild`` and run-time JIT share it.

Nothing here imports the loader. A build runs only when :func:`build_blocker` finds no reason
against it; :func:`build_and_publish` then takes the key's file lock, looks again (another
process may have published meanwhile), compiles, and publishes the files with a manifest that
records the spec's build identity (its key) and runtime identity, signed when
``DSA_AOT_SIGNING_KEY`` is set. With a writable remote tier the compile is also single across the
fleet (:func:`dsa_aot.fleet.single_compile`): another node's result is pulled instead, and this
node's is pushed before its lease is released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from dsa_aot.artifact import ArtifactManifest
from dsa_aot.backends import get as get_backend
from dsa_aot.backends.base import KernelBackend
from dsa_aot.cache.store import ArtifactStore, CacheError, Entry, EntryMeta
from dsa_aot.identity import build_identity, can_key_builds, runtime_identity
from dsa_aot.specs.models import KernelSpec
from dsa_aot.specs.toolchain import Toolchain

if TYPE_CHECKING:
    from dsa_aot.cache.remote import RemoteStore

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
    process had stored it first, or another node: ``pulled_from`` names the remote); ``files``
    is set only when the store could not keep them."""

    status: Literal["built", "cached", "memory"]
    manifest: ArtifactManifest
    entry: Entry | None = None
    files: dict[str, bytes] | None = None
    error: str | None = None
    pulled_from: str | None = None

    def read(self, store: ArtifactStore | None):
        """A ``read(name) -> bytes`` over the stored (sha256-checked) or in-memory files."""
        if self.entry is not None and store is not None:
            return lambda name: store.read_file(self.entry, name)
        assert self.files is not None
        return self.files.__getitem__


def build_and_publish(store: ArtifactStore | None, spec: KernelSpec, toolchain: Toolchain, *,
                      remote: RemoteStore | None = None,
                      accept: Callable[[EntryMeta], str | None] | None = None) -> Published:
    """Compile ``spec`` and publish it into ``store`` under its key, once across processes
    (and across the fleet with a writable ``remote``).

    Under the key's lock the store is looked up again first; an entry there that ``accept``
    (the trust check) refuses is quarantined and rebuilt. ``store=None`` (no writable root)
    or a toolchain that cannot key the build (:func:`~dsa_aot.identity.can_key_builds`)
    compiles in memory. A failure to store (disk full, read-only) keeps the files in memory and
    says why in ``error``. Raises :class:`~dsa_aot.backends.base.BuildError` when compiling
    fails, ``TimeoutError`` when another builder holds the lock (or the fleet lease) too long.
    """
    backend = get_backend(spec.backend)
    key = build_identity(backend, spec, toolchain).key()
    unkeyable = can_key_builds(backend, toolchain)
    if store is None or unkeyable:  # never file an entry under a weakened key
        built = backend.build(spec)
        why = f"its build key cannot be computed here ({unkeyable})" if store is not None else None
        return Published("memory", manifest_for(backend, spec, toolchain, built), files=built.files, error=why)
    from dsa_aot.fleet import signer, single_compile

    sign = signer()
    with store.lock(key, spec.arch, spec.id):
        entry = store.lookup(key, spec.arch, spec.id)
        refused = accept(entry.meta) if entry is not None and accept is not None else None
        if refused:
            store.quarantine(entry, refused)
        elif entry is not None:
            try:
                return Published("cached", ArtifactManifest.model_validate(entry.meta.payload), entry)
            except ValueError:
                store.quarantine(entry, "unreadable manifest")
        store.sweep_staging()  # debris of builders that died mid-publish
        if remote is None or not remote.writable:
            return _build_and_store(backend, spec, toolchain, store, key, sign)
        with single_compile(remote, store, key, spec.arch, spec.id, accept=accept) as pulled:
            if pulled is not None:
                return Published("cached", ArtifactManifest.model_validate(pulled.meta.payload), pulled,
                                 pulled_from=remote.root)
            done = _build_and_store(backend, spec, toolchain, store, key, sign)
            if done.entry is not None:  # pushed before the lease is released
                try:
                    remote.push_entry(store, done.entry)
                except CacheError as exc:
                    log.warning("dsa-aot: could not push %s to %s: %s", spec.id, remote.root, exc)
            return done


def _build_and_store(backend: KernelBackend, spec: KernelSpec, toolchain: Toolchain, store: ArtifactStore,
                     key: str, sign: Any) -> Published:
    built = backend.build(spec)
    manifest = manifest_for(backend, spec, toolchain, built)
    try:
        entry = store.publish(key, spec.arch, spec.id, built.files, manifest.model_dump(mode="json"), signer=sign)
    except (OSError, CacheError) as exc:  # disk full, read-only root: keep it in memory
        return Published("memory", manifest, files=built.files, error=str(exc))
    return Published("built", manifest, entry)
