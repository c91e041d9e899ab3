"""The runtime loader: spec -> key -> artifact -> loaded kernel, with a feature-checked fallback.

Lookup order for a call shape, over the backends of the catalog's ranking:
  1. each backend's stored artifact, in ranking order: the read-only prebuilt roots
     (``DSA_AOT_PREBUILT_DIR``), then the writable cache (``DSA_AOT_CACHE_DIR``). Which entry
     matches depends on what is installed (see :func:`Loader.find`):
     * the spec's compilers are installed: the entry under the spec's build key (compilers by
       content, nvcc, exactly the sources its build imports); an entry of the same spec built
       by another toolchain is stale and logged as such;
     * they are not (a serving image): an entry whose recorded runtime identity (our runtime
       code, the spec's kernel sources, arch, host) equals this process's, and whose builder
       used the same version of any compiler part that is installed here.
     Every file is sha256-checked before it is loaded; a bad entry is quarantined and misses;
     then the remote tier (``DSA_AOT_REMOTE_URL``) by the same rules: its entry is fetched,
     every byte checked against its manifest, loaded from those verified bytes, and published
     into the writable cache on a background thread (the call does not wait for the disk). A
     remote failure is a logged miss. With ``DSA_AOT_TRUSTED_KEYS`` set, an entry of any of
     them whose signature does not verify is refused (and never copied from the remote);
  2. none stored: ``DSA_AOT_REQUIRE_PREBUILT=1`` raises :class:`MissingPrebuiltError`; else JIT
     each backend in ranking order through :func:`dsa_aot.build.build_and_publish` (unless
     ``DSA_AOT_JIT=0``, or a compiler or probed feature is missing), which pushes the result
     and compiles once across the fleet when ``DSA_AOT_REMOTE_WRITE=1``;
  3. finally the torch reference, with a loud warning.
Each step is logged once per process with its reason. Nothing here imports a compiler unless a
JIT build actually runs.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

from dsa_aot import settings as _settings
from dsa_aot.artifact import ArtifactManifest
from dsa_aot.backends import BACKENDS, BuildError, CudaError, KernelBackend, ReferenceBackend
from dsa_aot.cache.store import (META, ArtifactStore, CacheError, CorruptArtifact, Entry, mkdirs,
                                 shared_writable_reason)
from dsa_aot.errors import (DeterminismUnavailableError, MissingPrebuiltError,  # noqa: F401  (re-exported)
                            UnsupportedDeviceError)
from dsa_aot.specs.keys import RuntimeIdentity
from dsa_aot.specs.installed import driver_cuda_version
from dsa_aot.specs.models import KernelSpec, arch_of_capability  # noqa: F401  (re-exported)

log = logging.getLogger("dsa_aot")

#: Seconds a process keeps feature probes that could not answer before a miss probes again.
UNSETTLED_RETRY_S = 60.0


def prebuild_command(spec: KernelSpec) -> str:
    return f"dsa-aot prebuild --arch {spec.arch} --only '{spec.id}'"


@dataclass(frozen=True)
class Resolution:
    """What the loader picked for a spec, and why (for ``dsa-aot doctor`` and logs)."""

    spec: KernelSpec
    source: str  # "prebuilt:<root>", "cache:<root>", "remote:<url>", "jit:<root>", "jit:memory", "reference"
    reasons: tuple[str, ...] = ()
    rule: str = ""  # "build key" or "runtime identity" for a stored hit


@dataclass(frozen=True)
class Match:
    """A stored entry the loader may serve, and the rule that matched it."""

    store: ArtifactStore
    entry: Entry
    rule: str


def driver_too_old(cuda_driver_min: str | None) -> str | None:
    """Why this driver cannot run an artifact built for CUDA ``cuda_driver_min`` (e.g. '13.0'),
    with the fix; None when it can or either version is unknown (the load then decides)."""
    have = driver_cuda_version()
    if cuda_driver_min is None or have is None:
        return None
    try:
        need = tuple(int(part) for part in cuda_driver_min.split(".")[:2])
    except ValueError:
        return None
    if (have // 1000, have % 1000 // 10) >= need:
        return None
    have_text = f"{have // 1000}.{have % 1000 // 10}"
    return (f"built with the CUDA {cuda_driver_min} toolkit, and this NVIDIA driver supports CUDA "
            f"{have_text} at most: update the driver, or prebuild with a CUDA {have_text} toolkit "
            "(DSA_AOT_NVCC)")

class Loader:
    """Resolves specs to loaded kernels. One per process (see :func:`get_loader`)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._logged: set[str] = set()
        self._toolchain = None
        self._features = None
        self._features_at = 0.0  # time.monotonic() of the last probe
        self._stores: list[ArtifactStore] | None = None
        self._ranking: tuple[dict[str, list[str]], list[dict[str, list]]] | None = None
        self._buckets: dict[tuple[str, str, str], list[int]] | None = None
        self._keys: dict[str, tuple[str | None, str | None]] = {}

    # -- environment -----------------------------------------------------------------------
    def toolchain(self):
        if self._toolchain is None:
            from dsa_aot.specs.toolchain import Toolchain

            self._toolchain = Toolchain.current()
        return self._toolchain

    def fingerprint(self) -> str:
        """The installed compiler toolchain's fingerprint (probes are kept per fingerprint)."""
        return self.toolchain().fingerprint

    def stores(self) -> list[ArtifactStore]:
        """Read-only prebuilt roots first, then the writable cache root, then the remote tier."""
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
            if cfg.remote_url is not None:
                from dsa_aot.fleet import remote_store

                stores.append(remote_store())
            self._stores = stores
        return self._stores

    def writable_store(self) -> ArtifactStore | None:
        for store in self.stores():
            if not store.read_only and store.writable():
                return store
        return None

    def features(self):
        """Probed features of this toolchain (probes run once per fingerprint, on a miss only).
        Features with probes that could not answer (:attr:`~dsa_aot.specs.probes.Features.unsettled`:
        a full disk, a timeout) are kept for :data:`UNSETTLED_RETRY_S` only: a later miss probes
        again, so a long-running process recovers once the cause is gone."""
        if self._features is not None and self._features.unsettled \
                and time.monotonic() - self._features_at >= UNSETTLED_RETRY_S:
            self._features = None
        if self._features is None:
            from dsa_aot.specs.probes import load_or_probe, run_probes

            store = self.writable_store()
            if store is None:  # nowhere to keep the results: probe for this process only
                self._features = run_probes(["sm_90a", "sm_100a"])
            else:
                path = store.features_path(self.fingerprint())
                mkdirs(path.parent)  # 0755, like the entries (a umask 002 must not open it to the group)
                self._features = load_or_probe(path, ["sm_90a", "sm_100a"])
            self._features_at = time.monotonic()
        return self._features

    def ranking(self, op: str, arch: str | None = None, d_qk: int | None = None,
                heads: int | None = None) -> list[str]:
        """Backends to try for a variant, fastest first: ``DSA_AOT_BACKENDS`` when set, else the
        catalog's first ``[[prefer]]`` table matching the variant, else its ``[ranking]`` of
        ``op``. Without ``arch``: every backend any table ranks for ``op``, the op's order first."""
        forced = _settings.get().backends  # DSA_AOT_BACKENDS replaces the catalog's ranking
        if forced is not None:
            return [b for b in forced if b in BACKENDS]
        if self._ranking is None:
            from dsa_aot.specs.catalog import load_preferences, load_ranking

            self._ranking = (load_ranking(), load_preferences())
        from dsa_aot.specs.catalog import ranked

        ranking, preferences = self._ranking
        if arch is None:
            found = list(ranking.get(op, ["tilelang"]))
            found += [b for rule in preferences if op in rule.get("ops", [op]) for b in rule["backends"]]
            order = list(dict.fromkeys(found))
        else:
            order = ranked(ranking, preferences, op, arch, int(d_qk or 0), int(heads or 0))
        return [b for b in order if b in BACKENDS]

    def topk_widths(self, backend: str, op: str, arch: str) -> list[int]:
        """The catalog's top-k buckets of a backend whose ``op`` kernels are specialised on the width."""
        if self._buckets is None:
            from dsa_aot.specs.catalog import load_topk_buckets

            self._buckets = load_topk_buckets()
        return self._buckets.get((backend, op, arch), [])

    def prepare(self) -> None:
        """The per-process part of a first call, done now: the stores, the toolchain, the
        catalog's ranking and the load code (with its record models) of every ranked backend.
        Nothing per variant, no CUDA call, no compiler import."""
        import importlib

        with self._lock:
            self.stores()
            self.toolchain()
            for name in dict.fromkeys(self.ranking("fwd") + self.ranking("bwd")):
                importlib.import_module(BACKENDS[name].runtime_module)

    def reset(self) -> None:
        """Forget everything derived from settings and the environment."""
        with self._lock:
            self._toolchain = self._features = self._stores = self._ranking = self._buckets = None
            self._keys = {}

    def _once(self, message: str, level: int = logging.INFO) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.log(level, "dsa-aot: %s", message)

    # -- which entry a spec may be served from ------------------------------------------------
    def key_of(self, spec: KernelSpec) -> str | None:
        """The spec's build key, or None when this process cannot compute it (no compiler, an
        unreadable key input): it then looks entries up by runtime identity."""
        if spec.id not in self._keys:
            from dsa_aot.identity import build_identity, can_key_builds

            backend = BACKENDS[spec.backend]
            why = can_key_builds(backend, self.toolchain())
            self._keys[spec.id] = (None, why) if why else (build_identity(backend, spec, self.toolchain()).key(), None)
        return self._keys[spec.id][0]

    def find(self, store: ArtifactStore, spec: KernelSpec) -> Match | None:
        """The entry of ``spec`` that ``store`` may serve to this process, or None.

        With the spec's compilers installed, only the entry under its build key; one built by
        another toolchain is reported stale. Without them, the newest entry whose runtime
        identity is this process's and whose builder agrees with every compiler part installed
        here (e.g. the same TileLang in an image without a CUDA toolkit).
        """
        from dsa_aot.identity import recorded_compilers_agree, runtime_identity

        key = self.key_of(spec)
        if key is not None:
            entry = store.lookup(key, spec.arch, spec.id)
            if entry is not None:
                return Match(store, entry, "build key")
            for other in store.candidates(spec.arch, spec.id):
                self._once(f"stale: {other.key} in {store.root} was built by another toolchain or "
                           f"from other sources than this process's (key {key}); not used")
                break
            return None
        backend = BACKENDS[spec.backend]
        mine = runtime_identity(backend, spec)
        for entry in store.candidates(spec.arch, spec.id):
            why = self._runtime_mismatch(backend, entry, mine)
            if why is None:
                self._once(f"{spec.id}: serving {entry.key} by runtime identity ("
                           f"{self._keys[spec.id][1]}, so its build key cannot be computed here)")
                return Match(store, entry, "runtime identity")
            self._once(f"not serving {entry.key}: {why}")
        return None

    def _runtime_mismatch(self, backend: KernelBackend, entry: Entry, mine: RuntimeIdentity) -> str | None:
        from dsa_aot.identity import recorded_compilers_agree
        from dsa_aot.specs.keys import BuildIdentity

        try:
            recorded = RuntimeIdentity.model_validate(entry.meta.payload.get("runtime"))
            build = BuildIdentity.model_validate(entry.meta.payload.get("build"))
        except ValueError:
            return "its manifest records no runtime identity (built by an older dsa-aot)"
        field = mine.mismatch(recorded)
        if field is not None:
            return f"its {field} differs from this process's (another dsa-aot, other kernel sources or host)"
        return recorded_compilers_agree(backend, build, self.toolchain())

    # -- lookup ------------------------------------------------------------------------------
    def try_load(self, spec: KernelSpec, device_index: int) -> tuple[Any, str, str] | None:
        """``(kernel, source, rule)`` from the first store holding a verified artifact, or None.

        Artifact problems (missing, corrupt, unloadable) are a logged miss, never an exception.
        """
        for store in self.stores():
            match = self.find(store, spec)
            if match is None:
                continue
            local, entry = store, match.entry
            if getattr(store, "remote", False):  # load the verified bytes; the local copy follows
                try:
                    local, entry = store.pull(entry, self.writable_store(), self.trust_check(), background=True)
                except CacheError as exc:
                    self._once(f"remote miss for {entry.key} on {store.root}: {exc}", logging.WARNING)
                    continue
            kernel = self._load_entry(local, entry, device_index)
            if kernel is not None:
                kind = "remote" if local is not store else "prebuilt" if store.read_only else "cache"
                return kernel, f"{kind}:{store.root}", match.rule
        return None

    def trust_check(self):
        """``reason(meta)`` under ``DSA_AOT_TRUSTED_KEYS``, or None when no key is configured."""
        if not _settings.get().trusted_keys:
            return None
        from dsa_aot.fleet import trust_check

        return trust_check()

    def _load_entry(self, store: ArtifactStore, entry: Entry, device_index: int) -> Any | None:
        trust = self.trust_check()
        refused = trust(entry.meta) if trust is not None else None
        if refused:
            store.quarantine(entry, refused)  # a read-only root: logged only
            self._once(f"refused {entry.key} from {store.root}: {refused}", logging.WARNING)
            return None
        if not _settings.get().allow_shared_cache and isinstance(store, ArtifactStore):
            # the root was checked in stores(); now its subtree
            for path in (entry.path.parent.parent, entry.path.parent, entry.path, entry.path / META):
                reason = shared_writable_reason(path)
                if reason:
                    self._once(f"not loading {entry.key}: {reason}; fix its permissions (chmod go-w) "
                               "or set DSA_AOT_ALLOW_SHARED_CACHE=1", logging.WARNING)
                    return None
        try:
            manifest = ArtifactManifest.model_validate(entry.meta.payload)
            if (manifest.spec.id, manifest.spec.arch, manifest.key) != (
                    entry.meta.spec_id, entry.meta.arch, entry.meta.fingerprint):
                raise CorruptArtifact(f"{entry.key}: its manifest describes {manifest.key}/"
                                      f"{manifest.spec.arch}/{manifest.spec.id}")
            too_old = driver_too_old(manifest.cuda_driver_min)
            if too_old:
                self._once(f"not loading {entry.key}: {too_old}", logging.WARNING)
                return None
            kernel = BACKENDS[manifest.spec.backend].load(
                manifest, lambda name: store.read_file(entry, name), device_index)
        except CorruptArtifact as exc:
            store.quarantine(entry, str(exc))
            self._once(f"refused {entry.key}: {exc}", logging.WARNING)
            return None
        except Exception as exc:  # an unloadable artifact is a miss, not a crash
            self._once(f"could not load {entry.key}: {exc}", logging.WARNING)
            return None
        store.record_hit(entry, later=True)  # the advisory index: off the call path
        return kernel

    def build_and_load(self, spec: KernelSpec, device_index: int) -> tuple[Any, str]:
        """JIT: :func:`~dsa_aot.build.build_and_publish`, then load. Raises BuildError."""
        from dsa_aot.build import build_and_publish

        store = self.writable_store()
        if store is None:
            self._once(f"no writable cache root; {spec.id} is compiled in memory only", logging.WARNING)
        else:
            self._once(f"JIT compiling {spec.id} (run `{prebuild_command(spec)}` at image build time to avoid this)")
        cfg = _settings.get()
        remote = None
        if cfg.remote_url is not None and cfg.remote_write:
            from dsa_aot.fleet import remote_store

            remote = remote_store()
        done = build_and_publish(store, spec, self.toolchain(), remote=remote, accept=self.trust_check())
        if done.error:
            self._once(f"could not store {spec.id} in {store.root}: {done.error}; using it from memory",
                       logging.WARNING)
        kernel = BACKENDS[spec.backend].load(done.manifest, done.read(store), device_index)
        source = {"built": f"jit:{store.root if store else ''}", "cached": f"cache:{store.root if store else ''}",
                  "memory": "jit:memory"}[done.status]
        if done.pulled_from:
            source = f"remote:{done.pulled_from}"
        return kernel, source

    def resolve(self, op: str, arch: str, d_qk: int, heads: int, layout: str, device_index: int, *,
                skip: frozenset[str] = frozenset(), deterministic: bool = False) -> tuple[Any, Resolution]:
        """The kernel to run for one call shape, walking the fallback chain.

        Every backend's stored artifact (in ranking order) is tried before anything is
        compiled: a prebuilt kernel of the second backend beats a JIT build of the first.
        A backend whose kernels are specialised on the top-k width is served through
        :class:`~dsa_aot.runners.TopkBuckets` (its spec here is its widest catalog bucket) once
        any bucket is stored, or can be compiled; ``skip`` leaves backends out. ``deterministic``
        walks only the backends with a deterministic kernel for ``arch`` and never ends at the
        reference (:class:`DeterminismUnavailableError` instead).
        """
        with self._lock:
            specs = [self._spec(op, arch, d_qk, heads, layout, name, deterministic) for name in self.ranking(op, arch, d_qk, heads)
                     if BACKENDS[name].implements(op) and name not in skip
                     and (not deterministic or arch in BACKENDS[name].deterministic_archs)]
            for spec in specs:
                hit = self._stored_buckets(spec, device_index, skip) if spec.topk else self.try_load(spec, device_index)
                if hit is not None:
                    if spec is not specs[0]:
                        self._once(f"{specs[0].id} is not stored; using the stored {spec.id}")
                    return hit[0], Resolution(spec, hit[1], (), hit[2])
            if _settings.get().require_prebuilt and specs:
                raise MissingPrebuiltError(self._missing_message(specs))
            return self._jit_or_reference(op, arch, d_qk, heads, layout, specs, device_index, skip,
                                          deterministic)

    def _spec(self, op: str, arch: str, d_qk: int, heads: int, layout: str, backend: str,
              deterministic: bool = False) -> KernelSpec:
        widths = self.topk_widths(backend, op, arch) if op in BACKENDS[backend].topk_ops else []
        flavour = BACKENDS[backend].call_flavour(heads, deterministic)
        tile = {"tile": {"flavour": flavour}} if flavour else {}
        return KernelSpec(op=op, arch=arch, d_qk=d_qk, heads=heads, layout=layout, backend=backend,
                          topk=widths[-1] if widths else None, deterministic=deterministic, **tile)

    def _stored_buckets(self, spec: KernelSpec, device_index: int, skip: frozenset[str]) -> tuple[Any, str, str] | None:
        """The top-k buckets of ``spec``'s backend when any of them is stored (loaded per width on use)."""
        for width in self.topk_widths(spec.backend, spec.op, spec.arch):
            if any(self.find(store, spec.model_copy(update={"topk": width})) for store in self.stores()):
                return self._buckets_of(spec, device_index, skip), "buckets", "per bucket"
        return None

    def _buckets_of(self, spec: KernelSpec, device_index: int, skip: frozenset[str]) -> Any:
        from dsa_aot.runners import TopkBuckets

        def at(width: int) -> KernelSpec:
            return KernelSpec(**{**spec.model_dump(), "topk": width})

        def load(width: int) -> Any | None:
            hit = self.try_load(at(width), device_index)
            return None if hit is None else hit[0]

        def jit(width: int) -> Any | None:
            wanted = at(width)
            reason = "not prebuilt (DSA_AOT_REQUIRE_PREBUILT=1)" if _settings.get().require_prebuilt else \
                self._jit_blocker(wanted)
            if reason is None:
                try:
                    return self.build_and_load(wanted, device_index)[0]
                except (BuildError, OSError, CacheError, TimeoutError, CudaError) as exc:
                    reason = f"JIT build failed: {exc}"
            self._once(f"{wanted.id}: {reason}; trying the next backend", logging.WARNING)
            return None

        def fallback() -> Any:
            self._once(f"no {spec.backend} {spec.op} bucket of {self.topk_widths(spec.backend, spec.op, spec.arch)} "
                       f"serves a call of {spec.id[:spec.id.rindex('-')]}; using the next backend")
            return self.resolve(spec.op, spec.arch, spec.d_qk, spec.heads, spec.layout, device_index,
                                skip=skip | {spec.backend}, deterministic=spec.deterministic)[0]

        return TopkBuckets(spec.op, self.topk_widths(spec.backend, spec.op, spec.arch), load, jit, fallback)

    def _missing_message(self, specs: list[KernelSpec]) -> str:
        wanted = " or ".join(s.id for s in specs)
        return (f"no prebuilt artifact for {wanted} in {[str(s.root) for s in self.stores()]} that "
                "this process may serve (see the log for stale or mismatched entries); "
                "DSA_AOT_REQUIRE_PREBUILT=1 forbids compiling at run time. Fix: run "
                f"`{prebuild_command(specs[0])}` in the image build with this dsa-aot version, or "
                "unset DSA_AOT_REQUIRE_PREBUILT.")

    def _jit_or_reference(self, op: str, arch: str, d_qk: int, heads: int, layout: str,
                          specs: list[KernelSpec], device_index: int,
                          skip: frozenset[str] = frozenset(), deterministic: bool = False,
                          ) -> tuple[Any, Resolution]:
        reasons: list[str] = []
        for spec in specs:
            reason = self._jit_blocker(spec)
            if reason is None and spec.topk:  # compiled per bucket on first use
                return self._buckets_of(spec, device_index, skip), Resolution(spec, "jit:buckets", tuple(reasons))
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
        if deterministic:
            having = sorted(n for n, b in BACKENDS.items() if arch in b.deterministic_archs)
            raise DeterminismUnavailableError(
                f"deterministic=True: no deterministic {op} kernel for {arch} could be served ("
                + ("; ".join(f"{s.id}: {r}" for s, r in zip(specs, reasons)) or f"no backend builds one for {arch}")
                + "); backends with one "
                f"for {arch}: {', '.join(having) or 'none'}. Fix: prebuild its -det specs (`dsa-aot "
                f"prebuild --arch {arch} --only '*-det*'`), or call with deterministic=False.")
        spec = specs[0] if specs else KernelSpec(op=op, arch=arch, d_qk=d_qk, heads=heads, layout=layout)
        message = (f"no compiled kernel for {spec.id} ({'; '.join(reasons) or 'no backend'}); "
                   "falling back to the slow torch reference. "
                   f"Run `{prebuild_command(spec)}` to fix.")
        if message not in self._logged:
            self._logged.add(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)
            log.warning("dsa-aot: %s", message)
        return ReferenceBackend.kernel(op), Resolution(spec, "reference", tuple(reasons))

    def _jit_blocker(self, spec: KernelSpec) -> str | None:
        from dsa_aot.build import build_blocker

        if not _settings.get().jit:
            return "not prebuilt and DSA_AOT_JIT=0"
        from dsa_aot.identity import can_key_builds, missing_build_tools

        backend = BACKENDS[spec.backend]
        reason = missing_build_tools(backend, self.toolchain())
        if reason:
            return f"not prebuilt and cannot JIT: {reason}"
        unkeyable = can_key_builds(backend, self.toolchain())
        if unkeyable:  # build_and_publish compiles it in memory, filed nowhere
            self._once(f"{spec.id}: the build key cannot be computed ({unkeyable}); compiling in memory only",
                       logging.WARNING)
            return backend.unsupported_reason(spec, None)
        try:
            features = self.features()
        except Exception as exc:
            return f"feature probes failed: {exc}"
        return build_blocker(backend, spec, self.toolchain(), features)


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
