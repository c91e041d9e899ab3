"""The serving path: a first call's kernel from a prebuilt root, with no compiler and no pydantic.

A serving image has no compiler installed, so the loader (:mod:`dsa_aot.loader`) serves it by
runtime identity. This module makes the same decision for that common case from the entries'
JSON alone (pydantic's import and the record models cost tens of milliseconds, more than the
rest of a first call), and answers None (the loader decides, logs and quarantines) for anything
else. It serves an entry only when the loader would serve that same entry:

* no remote tier and no trusted keys (signatures) are configured, and no root is writable by
  others (the loader's permission checks, repeated on the entry's folders);
* the variant's backends, in the catalog's order, are walked as the loader walks them: a
  backend with nothing stored in any root is passed over; the first one with a stored entry
  decides. It must load without pydantic (:attr:`~dsa_aot.backends.base.KernelBackend.loads_sealed`),
  have none of its compiler distributions installed nor its compiler importable (the loader
  would then look the build key up), and its newest entry in the first prebuilt root holding
  one must carry this process's runtime identity, the nvcc installed here (if any) as its
  builder's, an intact payload digest and a consistent manifest; every file is sha256-checked
  before it is loaded;
* only read-only prebuilt roots (``DSA_AOT_PREBUILT_DIR``) are served; an entry found first in
  the writable cache is left to the loader.

The records a build wrote (validated by their models then, sealed by the entry's payload digest
since) are read as attribute views by the backend's :meth:`load_sealed`. Importing this module
(which ``import dsa_aot`` does once torch is imported) imports those backends' load code.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import sys
import threading
import types
from pathlib import Path
from typing import Any

from dsa_aot import settings as _settings
from dsa_aot.backends import BACKENDS, KernelBackend
from dsa_aot.backends.base import MANIFEST_FORMAT
from dsa_aot.cache.layout import _NAME, ENTRY_FORMAT, META, CorruptArtifact, payload_sha256, shared_writable_reason
from dsa_aot.specs.shapes import D_V, SpecFields, spec_id
from dsa_aot.specs.sources import identity_key

log = logging.getLogger("dsa_aot")

_LOGGED: set[str] = set()
_LOCK = threading.Lock()


class _Defer(Exception):
    """This call is the loader's to resolve (the reason is kept for tests and debugging)."""


def serve(op: str, arch: str, d_qk: int, heads: int, layout: str, device_index: int,
          deterministic: bool = False) -> tuple[Any, str] | None:
    """``(kernel, "prebuilt:<root>")`` for one call shape, or None: ask the loader."""
    try:
        return _serve(op, arch, d_qk, heads, layout, device_index, deterministic)
    except _Defer as why:
        log.debug("dsa-aot: serving path: %s", why)
        return None
    except Exception as exc:  # never a failure of its own: the loader handles the call
        log.debug("dsa-aot: serving path: %s: %s", type(exc).__name__, exc)
        return None


def why_not(op: str, arch: str, d_qk: int, heads: int, layout: str, deterministic: bool = False) -> str | None:
    """Why :func:`serve` would leave this call shape to the loader before loading anything (None:
    it would serve it, up to the file checks and the load). For tests and ``dsa-aot doctor``."""
    try:
        if _pick(op, arch, d_qk, heads, layout, deterministic) is None:
            return "no ranked backend has an entry stored"
    except _Defer as why:
        return str(why)
    return None


def _serve(op: str, arch: str, d_qk: int, heads: int, layout: str, device_index: int,
           deterministic: bool) -> tuple[Any, str] | None:
    picked = _pick(op, arch, d_qk, heads, layout, deterministic)
    if picked is None:
        return None
    backend, spec, root, entry, meta, first = picked
    stages = tuple(types.SimpleNamespace(**st) for st in meta["payload"]["stages"])
    files = meta["files"]

    def read(name: str) -> bytes:
        info = files.get(name)
        if info is None:
            raise CorruptArtifact(f"{entry}: no file {name!r} in {META}")
        data = (entry / name).read_bytes()
        if len(data) != info["size"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise CorruptArtifact(f"{entry}/{name}: sha256 mismatch")
        return data

    try:
        kernel = backend.load_sealed(spec, stages, read, device_index, {n: f["sha256"] for n, f in files.items()})
    except Exception as exc:  # the loader retries it, logs why and quarantines a corrupt entry
        raise _Defer(f"{spec.id}: loading {entry} failed: {exc}") from exc
    key = f"{meta['fingerprint']}/{arch}/{spec.id}"
    if spec.id != first.id:
        _once(f"{first.id} is not stored; using the stored {spec.id}")
    _once(f"{spec.id}: serving {key} by runtime identity (no {backend.name} compiler installed; "
          "read without pydantic)")
    return kernel, f"prebuilt:{root}"


def _pick(op: str, arch: str, d_qk: int, heads: int, layout: str, deterministic: bool):
    """``(backend, spec, root, entry folder, meta, first spec)`` the loader would serve, or None
    when no backend has anything stored (the loader then compiles or falls back); raises
    :class:`_Defer` for every case the loader must decide."""
    cfg = _settings.get()
    if cfg.remote_url is not None:
        raise _Defer("a remote tier is configured")
    if deterministic and _settings.deterministic_mode_for(cfg.deterministic_mode, heads) != "stored_rows":
        raise _Defer(f"deterministic_mode={cfg.deterministic_mode} at {heads} heads (a spec with a flavour)")
    if cfg.trusted_keys:
        raise _Defer("trusted keys are configured (signatures are checked by the loader)")
    roots = [*cfg.prebuilt_dirs, cfg.cache_dir]
    if not cfg.allow_shared_cache and any(shared_writable_reason(r) for r in roots):
        raise _Defer("a cache root is writable by others")
    first = None
    for name in _ranking(op, arch, d_qk, heads):
        backend = BACKENDS[name]
        if not backend.implements(op) or (deterministic and arch not in backend.deterministic_archs):
            continue
        spec = SpecFields(op, arch, d_qk, heads, layout, name, deterministic=deterministic)
        first = first or spec
        ids = ([spec_id(op, arch, d_qk, heads, layout, name, w, deterministic) for w in _buckets(name, op, arch)]
               if op in backend.topk_ops else [spec.id])
        stored = [(root, _entry_dirs(root, arch, ids)) for root in roots]
        if not any(dirs for _, dirs in stored):
            continue  # nothing of this backend anywhere: the loader passes it over too
        if op in backend.topk_ops or not backend.loads_sealed:
            raise _Defer(f"{spec.id}: backend {name} is served by the loader")
        why = _compiler_here(backend)
        if why:
            raise _Defer(f"{spec.id}: {why}; the loader decides (by build key, or by runtime identity "
                         "with what is installed compared to the builder's)")
        root, dirs = next((r, d) for r, d in stored if d)
        if root == cfg.cache_dir:
            raise _Defer(f"{spec.id}: stored in the writable cache only")
        entry, meta = _newest(dirs)
        _check_entry(backend, spec, entry, meta, cfg.allow_shared_cache)
        return backend, spec, root, entry, meta, first
    return None


def _newest(dirs: list[Path]) -> tuple[Path, dict]:
    metas = []
    for d in dirs:
        meta = json.loads((d / META).read_bytes())
        if not isinstance(meta, dict) or meta.get("format") != ENTRY_FORMAT or not isinstance(meta.get("created"), float | int):
            raise _Defer(f"{d}: unreadable {META}")
        metas.append((meta["created"], d, meta))
    metas.sort(key=lambda m: m[0], reverse=True)
    return metas[0][1], metas[0][2]


def _check_entry(backend: KernelBackend, spec: SpecFields, entry: Path, meta: dict, allow_shared: bool) -> None:
    """Raise :class:`_Defer` unless the loader would serve ``entry`` to this process by runtime
    identity (the same checks, on the raw JSON)."""
    key, arch, _ = entry.parts[-3:]
    payload = meta.get("payload")
    if (meta.get("fingerprint"), meta.get("arch"), meta.get("spec_id")) != (key, arch, spec.id):
        raise _Defer(f"{entry}: {META} names another entry")
    if not isinstance(payload, dict) or payload_sha256(payload) != meta.get("payload_sha256"):
        raise _Defer(f"{entry}: payload digest mismatch")
    if not allow_shared:
        for path in (entry.parent.parent, entry.parent, entry, entry / META):
            if shared_writable_reason(path):
                raise _Defer(f"{path} is writable by others")
    if payload.get("runtime") != _runtime_identity(backend, spec):
        raise _Defer(f"{entry}: another runtime identity")
    build = payload.get("build") or {}
    nvcc = _nvcc_version() if backend.uses_cuda_toolkit else None
    if nvcc is not None and nvcc != build.get("nvcc_version"):
        raise _Defer(f"{entry}: built with nvcc {build.get('nvcc_version')}, nvcc {nvcc} is installed here")
    stored = payload.get("spec") or {}
    tile = stored.get("tile") or {}
    stages = payload.get("stages") or []
    if (payload.get("format") != MANIFEST_FORMAT or payload.get("key") != key
            or identity_key(build) != key or build.get("backend") != spec.backend
            or any(v is not None for v in tile.values()) or stored.get("d_v") != D_V
            or stored.get("dtype") != "bfloat16"
            or spec_id(stored.get("op"), stored.get("arch"), stored.get("d_qk"), stored.get("heads"),
                       stored.get("layout"), stored.get("backend"), stored.get("topk"),
                       stored.get("deterministic")) != spec.id):
        raise _Defer(f"{entry}: its manifest does not describe {spec.id} under key {key}")
    names = [st.get("name") for st in stages]
    files = [st.get("file") for st in stages]
    if (not stages or len(set(names)) != len(names) or len(set(files)) != len(files)
            or not set(files) <= set(meta.get("files") or {})):
        raise _Defer(f"{entry}: malformed stages")


def _entry_dirs(root: Path, arch: str, ids: list[str]) -> list[Path]:
    """Every ``<root>/<key>/<arch>/<id>`` folder holding a ``meta.json``."""
    try:
        keys = [p for p in root.iterdir() if not p.name.startswith(".")]
    except OSError:
        return []
    found = []
    for key in keys:
        for sid in ids:
            if (key / arch / sid / META).is_file():
                if not (_NAME.match(key.name) and _NAME.match(sid)):
                    raise _Defer(f"{key / arch / sid}: not a store name")
                found.append(key / arch / sid)
    return found


def _once(message: str) -> None:
    with _LOCK:
        if message in _LOGGED:
            return
        _LOGGED.add(message)
    log.info("dsa-aot: %s", message)


# -- per-process facts (what is installed does not change under a running process) ------------

@functools.lru_cache(maxsize=None)
def _ranking(op: str, arch: str, d_qk: int, heads: int) -> tuple[str, ...]:
    forced = _settings.get().backends
    if forced is not None:
        return tuple(b for b in forced if b in BACKENDS)
    from dsa_aot.specs.ranking import ranked, ranking_tables

    ranking, preferences, _ = ranking_tables()
    return tuple(b for b in ranked(ranking, preferences, op, arch, d_qk, heads) if b in BACKENDS)


@functools.lru_cache(maxsize=None)
def _buckets(backend: str, op: str, arch: str) -> tuple[int, ...]:
    from dsa_aot.specs.ranking import ranking_tables

    return tuple(ranking_tables()[2].get((backend, op, arch), []))


@functools.lru_cache(maxsize=1)
def _distributions() -> tuple[str, ...]:
    from dsa_aot.specs.installed import _installed_distributions

    return tuple(_installed_distributions(sys.path))


@functools.lru_cache(maxsize=None)
def _compiler_here(backend: KernelBackend) -> str | None:
    """What of the backend's compiler is installed (None: nothing; the runtime identity rule)."""
    from dsa_aot.specs.installed import matches_compiler

    for pattern in backend.compilers:  # the backend's own compiler first, as it names them
        for name in _distributions():
            if matches_compiler(name, pattern):
                return f"{name} is installed"
    if importlib.util.find_spec(backend.compiler_module) is not None:
        return f"{backend.compiler_module} is importable"
    return None


@functools.lru_cache(maxsize=1)
def _nvcc_version() -> str | None:
    from dsa_aot.specs.installed import nvcc_version_of

    return nvcc_version_of(None, False, [])


@functools.lru_cache(maxsize=None)
def _runtime_identity(backend: KernelBackend, spec: SpecFields) -> dict:
    from dsa_aot.specs.sources import runtime_identity_fields

    return runtime_identity_fields(backend.name, spec.arch, backend.runtime_module, backend.kernel_sources(spec))


def _import_load_code() -> None:
    """Import what a first call runs: the pydantic-free backends' load code and the identity
    helpers. Done when this module is imported, i.e. at ``import dsa_aot`` in a process that has
    torch (a few ms, no compiler, no pydantic), so the first call does only per-variant work."""
    import importlib

    import dsa_aot.specs.installed  # noqa: F401
    import dsa_aot.specs.ranking  # noqa: F401
    import dsa_aot.specs.sources  # noqa: F401

    try:
        for backend in BACKENDS.values():
            if backend.loads_sealed:
                importlib.import_module(backend.runtime_module)
    except Exception as exc:  # a broken install must not break ``import dsa_aot``: a lookup reports it
        log.debug("dsa-aot: serving path: importing the load code failed: %s", exc)


def prepare() -> None:
    """Read this process's facts now (installed distributions, nvcc, the catalog's tables), as
    :func:`dsa_aot.preload` does for the loader: a first call then reads only its entry."""
    from dsa_aot.specs.ranking import ranking_tables

    ranking_tables()
    _distributions()
    _nvcc_version()


def reset() -> None:
    """Forget the per-process facts (after a settings change)."""
    for cached in (_ranking, _buckets, _distributions, _compiler_here, _nvcc_version, _runtime_identity):
        cached.cache_clear()


_settings.on_change(reset)
_import_load_code()
