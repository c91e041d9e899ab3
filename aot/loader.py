"""The runtime loader: spec -> key -> artifact -> loaded kernel, with a feature-checked fallback.

Lookup order for a call shape, over the backends of the catalog's ranking:
  1. each backend's stored artifact, in ranking order: the read-only prebuilt roots
     (``DSA_AOT_PREBUILT_DIR``), then the writable cache (``DSA_AOT_CACHE_DIR``), under the
     current toolchain fingerprint; every file is sha256-checked before it is loaded, a bad
     entry is quarantined and counts as a miss;
  2. none stored: ``DSA_AOT_REQUIRE_PREBUILT=1`` raises :class:`MissingPrebuiltError`; else JIT
     compile each backend in ranking order (unless ``DSA_AOT_JIT=0``, or the compiler or a
     probed feature is missing), publish into the writable cache under a per-key file lock,
     and load;
  3. finally the torch reference, with a loud warning.
Each fallback step is logged once per process with its reason. Nothing here imports a
compiler unless a JIT build actually runs.
"""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsa_aot import settings as _settings
from dsa_aot.artifact import ArtifactManifest
from dsa_aot.backends import BACKENDS, BuildError, ReferenceBackend
from dsa_aot.cache.store import (META, ArtifactStore, CacheError, CorruptArtifact, Entry, mkdirs,
                                  shared_writable_reason)
from dsa_aot.launch import CudaError
from dsa_aot.specs.models import KernelSpec

log = logging.getLogger("dsa_aot")

_CAPABILITY_ARCH = {(9, 0): "sm_90a", (10, 0): "sm_100a"}


class MissingPrebuiltError(RuntimeError):
    """``DSA_AOT_REQUIRE_PREBUILT=1`` and no prebuilt artifact matches the call."""


class UnsupportedDeviceError(RuntimeError):
    """The GPU's architecture has no kernels (only sm_90a and sm_100a are built)."""


def arch_of_capability(major: int, minor: int) -> str | None:
    return _CAPABILITY_ARCH.get((major, minor))


def prebuild_command(spec: KernelSpec) -> str:
    return f"dsa-aot prebuild --arch {spec.arch} --only '{spec.id}'"


@dataclass(frozen=True)
class Resolution:
    """What the loader picked for a spec, and why (for ``dsa-aot doctor`` and logs)."""

    spec: KernelSpec
    source: str  # "prebuilt:<root>", "cache:<root>", "jit:<root>", "jit:memory", "reference"
    reasons: tuple[str, ...] = ()


class Loader:
    """Resolves specs to loaded kernels. One per process (see :func:`get_loader`)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._logged: set[str] = set()
        self._toolchain = None
        self._features = None
        self._stores: list[ArtifactStore] | None = None
        self._ranking: dict[str, list[str]] | None = None
        self._store_fps: dict[Path, str] = {}

    # -- environment -----------------------------------------------------------------------
    def toolchain(self):
        if self._toolchain is None:
            from dsa_aot.specs.toolchain import Toolchain

            self._toolchain = Toolchain.current()
        return self._toolchain

    def fingerprint(self) -> str:
        return self.toolchain().fingerprint

    def fingerprint_in(self, store: ArtifactStore) -> str:
        """The key to look up in ``store`` (see :func:`builder_fingerprint`), once per root."""
        fp = self._store_fps.get(store.root)
        if fp is None:
            fp = self._store_fps[store.root] = builder_fingerprint(store, self.toolchain())
            if fp != self.fingerprint():
                self._once(f"no CUDA toolkit here; using the artifacts in {store.root} keyed "
                           f"{fp} by the builder whose toolchain matches this one otherwise")
        return fp

    def stores(self) -> list[ArtifactStore]:
        """Read-only prebuilt roots first, then the writable cache root."""
        if self._stores is None:
            cfg = _settings.get()
            stores = []
            for root in (*cfg.prebuilt_dirs, cfg.cache_dir):
                reason = shared_writable_reason(root)
                if reason and not cfg.allow_shared_cache:
                    self._once(f"not loading from {root}: {reason}; fix its permissions (chmod go-w) "
                               "or set DSA_AOT_ALLOW_SHARED_CACHE=1", logging.WARNING)
                    continue
                read_only = root != cfg.cache_dir
                stores.append(ArtifactStore(root, read_only=read_only, lock_timeout_s=cfg.lock_timeout_s))
            self._stores = stores
        return self._stores

    def writable_store(self) -> ArtifactStore | None:
        for store in self.stores():
            if not store.read_only and store.writable():
                return store
        return None

    def features(self):
        """Probed features of this toolchain (probes run once per fingerprint, on a miss only)."""
        if self._features is None:
            from dsa_aot.specs.probes import load_or_probe, run_probes

            store = self.writable_store()
            if store is None:  # nowhere to keep the results: probe for this process only
                self._features = run_probes(["sm_90a", "sm_100a"])
            else:
                mkdirs(store.root / self.fingerprint())  # 0755, like the entries that will live there
                self._features = load_or_probe(store.root / self.fingerprint() / "features.json",
                                               ["sm_90a", "sm_100a"])
        return self._features

    def ranking(self, op: str) -> list[str]:
        forced = _settings.get().backends  # DSA_AOT_BACKENDS replaces the catalog's ranking
        if forced is not None:
            return [b for b in forced if b in BACKENDS]
        if self._ranking is None:
            from dsa_aot.specs.catalog import load_ranking

            self._ranking = load_ranking()
        return [b for b in self._ranking.get(op, ["tilelang"]) if b in BACKENDS]

    def reset(self) -> None:
        """Forget everything derived from settings and the environment."""
        with self._lock:
            self._toolchain = self._features = self._stores = self._ranking = None
            self._store_fps = {}

    def _once(self, message: str, level: int = logging.INFO) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.log(level, "dsa-aot: %s", message)

    # -- lookup ------------------------------------------------------------------------------
    def try_load(self, spec: KernelSpec, device_index: int) -> tuple[Any, str] | None:
        """A loaded kernel from the first store holding a verified artifact, or None.

        Artifact problems (missing, corrupt, unloadable) are a logged miss, never an exception.
        """
        toolchain = self.toolchain()
        if not getattr(toolchain, "complete", True):
            why = "; ".join(toolchain.incomplete_reasons)
            self._once(f"toolchain fingerprint incomplete ({why}); disk cache skipped",
                       logging.WARNING)
            return None
        for store in self.stores():
            entry = store.lookup(self.fingerprint_in(store), spec.arch, spec.id)
            if entry is None:
                continue
            kernel = self._load_entry(store, entry, device_index)
            if kernel is not None:
                kind = "prebuilt" if store.read_only else "cache"
                return kernel, f"{kind}:{store.root}"
        return None

    def _load_entry(self, store: ArtifactStore, entry: Entry, device_index: int) -> Any | None:
        if not _settings.get().allow_shared_cache:  # the root was checked in stores(); now its subtree
            for path in (entry.path.parent.parent, entry.path.parent, entry.path, entry.path / META):
                reason = shared_writable_reason(path)
                if reason:
                    self._once(f"not loading {entry.key}: {reason}; fix its permissions (chmod go-w) "
                               "or set DSA_AOT_ALLOW_SHARED_CACHE=1", logging.WARNING)
                    return None
        try:
            manifest = ArtifactManifest.model_validate(entry.meta.payload)
            if (manifest.spec.id, manifest.spec.arch, manifest.fingerprint) != (
                    entry.meta.spec_id, entry.meta.arch, entry.meta.fingerprint):
                raise CorruptArtifact(f"{entry.key}: its manifest describes {manifest.fingerprint}/"
                                      f"{manifest.spec.arch}/{manifest.spec.id}")
            backend = BACKENDS[manifest.spec.backend]
            kernel = backend.load(manifest, lambda name: store.read_file(entry, name), device_index)
        except CorruptArtifact as exc:
            store.quarantine(entry, str(exc))
            self._once(f"refused {entry.key}: {exc}", logging.WARNING)
            return None
        except Exception as exc:  # an unloadable artifact is a miss, not a crash
            self._once(f"could not load {entry.key}: {exc}", logging.WARNING)
            return None
        store.record_hit(entry)
        return kernel

    def build_and_load(self, spec: KernelSpec, device_index: int) -> tuple[Any, str]:
        """JIT: compile ``spec``, publish it (under the key's lock), load it. Raises BuildError."""
        backend = BACKENDS[spec.backend]
        store = self.writable_store() if self.toolchain().complete else None  # never file under a weak key
        fingerprint = self.fingerprint()
        if store is None:
            self._once(f"no writable cache root (or an incomplete toolchain key); {spec.id} is compiled "
                       "in memory only", logging.WARNING)
            built = backend.build(spec, fingerprint)
            return backend.load(built.manifest, built.files.__getitem__, device_index), "jit:memory"
        with store.lock(fingerprint, spec.arch, spec.id):
            entry = store.lookup(fingerprint, spec.arch, spec.id)  # another process may have won
            if entry is not None:
                kernel = self._load_entry(store, entry, device_index)
                if kernel is not None:
                    return kernel, f"cache:{store.root}"
            store.sweep_staging()  # debris of builders that died mid-publish
            self._once(f"JIT compiling {spec.id} (run `{prebuild_command(spec)}` at image build time to avoid this)")
            built = backend.build(spec, fingerprint)
            try:
                entry = store.publish(fingerprint, spec.arch, spec.id, built.files,
                                      built.manifest.stamped(self.toolchain()).model_dump(mode="json"))
            except (OSError, CacheError) as exc:
                self._once(f"could not store {spec.id} in {store.root}: {exc}; using it from memory",
                           logging.WARNING)
                return backend.load(built.manifest, built.files.__getitem__, device_index), "jit:memory"
        return backend.load(built.manifest, lambda n: store.read_file(entry, n), device_index), f"jit:{store.root}"

    def resolve(self, op: str, arch: str, d_qk: int, heads: int, layout: str, device_index: int) -> tuple[Any, Resolution]:
        """The kernel to run for one call shape, walking the fallback chain.

        Every backend's stored artifact (in ranking order) is tried before anything is
        compiled: a prebuilt kernel of the second backend beats a JIT build of the first.
        """
        with self._lock:
            cfg = _settings.get()
            reasons: list[str] = []
            specs = [KernelSpec(op=op, arch=arch, d_qk=d_qk, heads=heads, layout=layout, backend=name)
                     for name in self.ranking(op) if BACKENDS[name].implements(op)]
            for spec in specs:
                hit = self.try_load(spec, device_index)
                if hit is not None:
                    if spec is not specs[0]:
                        self._once(f"{specs[0].id} is not stored; using the stored {spec.id}")
                    return hit[0], Resolution(spec, hit[1], tuple(reasons))
            if cfg.require_prebuilt and specs:
                wanted = " or ".join(s.id for s in specs)
                raise MissingPrebuiltError(
                    f"no prebuilt artifact for {wanted} (toolchain {self.fingerprint()}) in "
                    f"{[str(s.root) for s in self.stores()]}; DSA_AOT_REQUIRE_PREBUILT=1 forbids compiling "
                    f"at run time. Fix: run `{prebuild_command(specs[0])}` in the image build "
                    f"(same toolchain), or unset DSA_AOT_REQUIRE_PREBUILT.")
            for spec in specs:
                reason = self._jit_blocker(spec)
                if reason is None:
                    try:
                        kernel, source = self.build_and_load(spec, device_index)
                        return kernel, Resolution(spec, source, tuple(reasons))
                    except (BuildError, OSError, CacheError, TimeoutError) as exc:
                        reason = f"JIT build of {spec.id} failed: {exc}"
                    except CudaError as exc:  # e.g. a driver too old for the fresh cubin
                        reason = f"JIT-built {spec.id} could not be loaded: {exc}"
                reasons.append(reason)
                self._once(f"{spec.id}: {reason}; trying the next backend", logging.WARNING)
            first_spec = specs[0] if specs else None
            spec = first_spec or KernelSpec(op=op, arch=arch, d_qk=d_qk, heads=heads, layout=layout)
            message = (f"no compiled kernel for {spec.id} ({'; '.join(reasons) or 'no backend'}); "
                       "falling back to the slow torch reference. "
                       f"Run `{prebuild_command(spec)}` to fix.")
            if message not in self._logged:
                self._logged.add(message)
                warnings.warn(message, RuntimeWarning, stacklevel=3)
                log.warning("dsa-aot: %s", message)
            return ReferenceBackend.kernel(op), Resolution(spec, "reference", tuple(reasons))

    def _jit_blocker(self, spec: KernelSpec) -> str | None:
        if not _settings.get().jit:
            return "not prebuilt and DSA_AOT_JIT=0"
        backend = BACKENDS[spec.backend]
        reason = backend.can_build()
        if reason:
            return f"not prebuilt and cannot JIT: {reason}"
        try:
            features = self.features()
        except Exception as exc:
            return f"feature probes failed: {exc}"
        return backend.unsupported_reason(spec, features)


_NVCC_FIELDS = {"nvcc_version": None, "cuda_driver_min": None}


def builder_fingerprint(store: ArtifactStore, toolchain: Any) -> str:
    """The fingerprint whose entries ``store`` should serve to a process with ``toolchain``.

    Normally ``toolchain.fingerprint``. A runtime image often has no CUDA toolkit (cubins need
    only the driver), so its toolchain cannot know which nvcc built the artifacts and its key
    differs from the builder's. Then, and only then (``nvcc_version`` is None), the builder's
    key is used: the first fingerprint folder (sorted) whose entries record a toolchain equal to
    this one in every field but the nvcc version. Anything else differing (the compiler
    packages, our kernel sources) still misses.
    """
    if toolchain.nvcc_version is not None:
        return toolchain.fingerprint
    try:
        folders = sorted(p for p in store.root.iterdir() if not p.name.startswith(".") and p.is_dir())
    except OSError:
        return toolchain.fingerprint
    mine = toolchain.model_copy(update=_NVCC_FIELDS)
    for folder in folders:
        recorded = _recorded_toolchain(store, folder)
        if (recorded is not None and recorded.fingerprint == folder.name
                and recorded.model_copy(update=_NVCC_FIELDS) == mine):
            return folder.name
    return toolchain.fingerprint


def _recorded_toolchain(store: ArtifactStore, folder: Path) -> Any | None:
    """The builder's toolchain recorded by the first readable entry under ``folder``."""
    from dsa_aot.specs.toolchain import Toolchain

    try:
        arch_dirs = sorted(p for p in folder.iterdir() if p.is_dir())
        for arch_dir in arch_dirs:
            for spec_dir in sorted(p for p in arch_dir.iterdir() if p.is_dir()):
                entry = store.lookup(folder.name, arch_dir.name, spec_dir.name)
                recorded = entry.meta.payload.get("toolchain") if entry is not None else None
                if isinstance(recorded, dict):
                    return Toolchain.model_validate(recorded)
    except (OSError, CacheError, ValueError):
        return None
    return None


_LOADER: Loader | None = None
_LOADER_LOCK = threading.Lock()


def get_loader() -> Loader:
    global _LOADER
    if _LOADER is None:
        with _LOADER_LOCK:
            if _LOADER is None:
                _LOADER = Loader()
    return _LOADER


def _on_settings_change() -> None:
    if _LOADER is not None:
        _LOADER.reset()


_settings.on_change(_on_settings_change)
