"""Every environment variable the package reads, typed, in one place.

``DSA_AOT_*`` variables, plus the few of other tools whose meaning we share: ``CUDA_HOME`` /
``CUDA_PATH`` (the toolkit), ``CC`` (the linker driver for CuTe DSL libraries) and TileLang's
path overrides (which make the key incomplete when they point outside TileLang).
Read through :func:`get`; tests override with :func:`scope`. Values are parsed once per
process (and again after :func:`scope` or :func:`reload`), never on the per-call hot path.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

ARCHS = ("sm_90a", "sm_100a")
#: TileLang reads templates, headers and libraries from these when set.
TILELANG_PATH_VARS = ("TL_TEMPLATE_PATH", "TL_CUTLASS_PATH", "TVM_LIBRARY_PATH", "TVM_IMPORT_PYTHON_PATH")


#: Values of ``DSA_AOT_DETERMINISTIC_MODE``.
DETERMINISTIC_MODES = ("auto", "stored_rows", "fixed_point")
#: ``auto`` serves deterministic calls with this many heads or more in the fixed-point mode (the
#: warpgroups-by-role kernels), fewer in the stored-rows mode (the slot-major kernels): 16, the
#: fewest heads the kernels have, so fixed point serves every call.
AUTO_FIXED_POINT_HEADS = 16


def deterministic_mode_for(mode: str, heads: int) -> str:
    """The deterministic mode that serves a call with ``heads`` heads under the setting
    ``mode``: ``auto`` is ``fixed_point`` from :data:`AUTO_FIXED_POINT_HEADS` heads on
    (1.12-1.18x the fast mode's time on an H100 at H16-H128, against 1.29-1.32x for stored rows
    at H16/H32, ``bench/results/h100_deterministic_auto_aligned.md``) and ``stored_rows``
    below; the others are themselves."""
    if mode == "auto":
        return "fixed_point" if heads >= AUTO_FIXED_POINT_HEADS else "stored_rows"
    return mode


class SettingsError(ValueError):
    """An environment variable holds a value we cannot use; the message names it."""


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r} is not a boolean; use 1 or 0")


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    low = raw.strip().lower()
    if low not in choices:
        raise SettingsError(f"{name}={raw!r}: use one of {', '.join(choices)}")
    return low


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number") from None
    if value < 0:
        raise SettingsError(f"{name}={raw!r} must be >= 0")
    return value


def _size(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    text = raw.strip().lower().rstrip("b")
    mult = units.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in units else text
    try:
        return int(float(digits) * mult)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a size; use bytes or e.g. 20G") from None


def _archs(name: str) -> tuple[str, ...] | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    archs = tuple(a for a in raw.replace(",", " ").split() if a)
    for arch in archs:
        if arch not in ARCHS:
            raise SettingsError(f"{name}={raw!r}: unknown arch {arch!r}; use {', '.join(ARCHS)}")
    return archs


def _backends(name: str) -> tuple[str, ...] | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    names = tuple(dict.fromkeys(b for b in raw.replace(",", " ").split() if b))
    from dsa_aot.backends import names as backend_names  # the installed backend subpackages

    known = backend_names()
    for backend in names:
        if backend not in known:
            raise SettingsError(f"{name}={raw!r}: unknown backend {backend!r}; use {', '.join(known)}")
    return names


def _path(name: str, *fallbacks: str) -> Path | None:
    for var in (name, *fallbacks):
        raw = os.environ.get(var)
        if raw:
            return Path(raw).expanduser()
    return None


def _remote_url(name: str) -> str | None:
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return None
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(raw)
        parts.port  # noqa: B018  (raises ValueError for a bad port)
    except ValueError as exc:
        raise SettingsError(f"{name}={raw!r} is not a URL: {exc}") from None
    if parts.scheme not in ("redis", "rediss", "unix") or (parts.scheme != "unix" and not parts.hostname):
        raise SettingsError(f"{name}={raw!r}: use redis://host:port/db (or rediss://, unix://)")
    return raw


def _paths(name: str) -> tuple[Path, ...]:
    return tuple(Path(p).expanduser() for p in os.environ.get(name, "").split(os.pathsep) if p)


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsa-aot"


@dataclass(frozen=True)
class Settings:
    #: Writable cache root (JIT results, ``make prebuild`` output). ``DSA_AOT_CACHE_DIR``.
    cache_dir: Path = field(default_factory=_default_cache_dir)
    #: Read-only prebuilt roots searched before ``cache_dir`` (an image layer).
    #: ``DSA_AOT_PREBUILT_DIR``, ``os.pathsep``-separated.
    prebuilt_dirs: tuple[Path, ...] = ()
    #: Compile a missing variant at run time. ``DSA_AOT_JIT`` (default 1).
    jit: bool = True
    #: Any miss is an error naming the ``dsa-aot prebuild`` command. ``DSA_AOT_REQUIRE_PREBUILT``.
    require_prebuilt: bool = False
    #: Archs to prebuild. ``DSA_AOT_ARCH_LIST`` (e.g. ``sm_90a,sm_100a``); None = auto.
    arch_list: tuple[str, ...] | None = None
    #: Seconds a builder waits for another builder of the same key. ``DSA_AOT_LOCK_TIMEOUT``.
    lock_timeout_s: float = 900.0
    #: Size ``dsa-aot gc`` trims the writable cache to. ``DSA_AOT_CACHE_MAX_BYTES`` (e.g. 20G).
    cache_max_bytes: int = 20 << 30
    #: Allow loading from a cache root other users can write to. ``DSA_AOT_ALLOW_SHARED_CACHE``.
    allow_shared_cache: bool = False
    #: Backend preference for every op, replacing the catalog's ranking (backends lacking an
    #: op are skipped for it). ``DSA_AOT_BACKENDS`` (e.g. ``cutedsl,tilelang``); None = catalog.
    backends: tuple[str, ...] | None = None
    #: The nvcc whose version keys the cache (builds use the same toolkit). ``DSA_AOT_NVCC``;
    #: None = as TileLang resolves it (``cuda_home``, ``PATH``, the nvcc wheel, /usr/local/cuda).
    nvcc: Path | None = None
    #: CUDA toolkit root. ``CUDA_HOME``, else ``CUDA_PATH``.
    cuda_home: Path | None = None
    #: C compiler driver that links CuTe DSL objects into shared libraries. ``CC`` (default cc).
    cc: str = "cc"
    #: The CuTe DSL runtime library (a file or a folder holding it) for artifacts linked against
    #: it (the ``dsl_runtime`` link mode). ``DSA_AOT_CUTE_DSL_RUNTIME``.
    cute_dsl_runtime: Path | None = None
    #: TileLang's path overrides that are set, as ``(variable, value)`` pairs (see
    #: :data:`TILELANG_PATH_VARS`); their contents are not hashed, so they make the key incomplete.
    tilelang_path_overrides: tuple[tuple[str, str], ...] = ()
    #: The fleet's shared cache, a Redis server (``redis://host:port/db``); None = no remote
    #: tier. ``DSA_AOT_REMOTE_URL``. Needs the ``redis`` package (``pip install dsa-aot[remote]``).
    remote_url: str | None = None
    #: Let the loader push its JIT results and take fleet compile leases (otherwise the remote
    #: is read-only; ``dsa-aot push`` and ``prebuild --push`` write regardless).
    #: ``DSA_AOT_REMOTE_WRITE`` (default 0).
    remote_write: bool = False
    #: Seconds to connect to the remote. ``DSA_AOT_REMOTE_CONNECT_TIMEOUT`` (default 0.1).
    remote_connect_timeout_s: float = 0.1
    #: Seconds any one read or write on the remote may block. ``DSA_AOT_REMOTE_TIMEOUT`` (0.5).
    remote_timeout_s: float = 0.5
    #: Seconds a pushed entry lives on the remote (every push refreshes it); 0 = no expiry.
    #: ``DSA_AOT_REMOTE_TTL`` (default 14 days).
    remote_ttl_s: float = 14 * 86400.0
    #: Seconds a fleet compile lease lasts without renewal (its holder renews it every third of
    #: that while compiling; a crashed holder's lease expires). ``DSA_AOT_REMOTE_LEASE`` (30).
    remote_lease_s: float = 30.0
    #: Ed25519 private key (PEM) that signs every entry this process publishes.
    #: ``DSA_AOT_SIGNING_KEY``; create one with ``dsa-aot keygen``.
    signing_key: Path | None = None
    #: Ed25519 public keys (PEM files, or folders of ``*.pub``): when set, nothing is loaded or
    #: imported whose signature does not verify under one of them. ``DSA_AOT_TRUSTED_KEYS``,
    #: ``os.pathsep``-separated.
    trusted_keys: tuple[Path, ...] = ()
    #: The backward's default when a call does not say: bit-identical gradients for the same
    #: inputs (``deterministic=True``). ``DSA_AOT_DETERMINISTIC`` (default 0).
    deterministic: bool = False
    #: How the deterministic backward sums dKV: ``stored_rows`` (every slot's row stored as bf16,
    #: then summed in a fixed order), ``fixed_point`` (int32 adds in the fast mode's kernels,
    #: ``dsa_aot.fixed_point``; its own ``-det`` specs with a ``_fixed`` flavour) or ``auto``
    #: (the faster of the two for the head count: :func:`deterministic_mode_for`).
    #: ``DSA_AOT_DETERMINISTIC_MODE`` (default auto).
    deterministic_mode: str = "auto"
    #: Most bytes of the stored-rows mode's per-slot dKV rows (bf16, one per query row, top-k
    #: slot, 64-head block and column) held at once; a larger call runs in chunks of query rows.
    #: ``DSA_AOT_DETERMINISTIC_WORKSPACE`` (default 4G).
    deterministic_workspace: int = 4 << 30

    @classmethod
    def from_env(cls) -> Settings:
        cache = os.environ.get("DSA_AOT_CACHE_DIR")
        prebuilt = os.environ.get("DSA_AOT_PREBUILT_DIR", "")
        return cls(
            cache_dir=Path(cache).expanduser() if cache else _default_cache_dir(),
            prebuilt_dirs=tuple(Path(p).expanduser() for p in prebuilt.split(os.pathsep) if p),
            jit=_bool("DSA_AOT_JIT", True),
            require_prebuilt=_bool("DSA_AOT_REQUIRE_PREBUILT", False),
            arch_list=_archs("DSA_AOT_ARCH_LIST"),
            lock_timeout_s=_float("DSA_AOT_LOCK_TIMEOUT", 900.0),
            cache_max_bytes=_size("DSA_AOT_CACHE_MAX_BYTES", 20 << 30),
            allow_shared_cache=_bool("DSA_AOT_ALLOW_SHARED_CACHE", False),
            backends=_backends("DSA_AOT_BACKENDS"),
            nvcc=_path("DSA_AOT_NVCC"),
            cuda_home=_path("CUDA_HOME", "CUDA_PATH"),
            cc=os.environ.get("CC") or "cc",
            cute_dsl_runtime=_path("DSA_AOT_CUTE_DSL_RUNTIME"),
            tilelang_path_overrides=tuple((v, os.environ[v]) for v in TILELANG_PATH_VARS if os.environ.get(v)),
            remote_url=_remote_url("DSA_AOT_REMOTE_URL"),
            remote_write=_bool("DSA_AOT_REMOTE_WRITE", False),
            remote_connect_timeout_s=_float("DSA_AOT_REMOTE_CONNECT_TIMEOUT", 0.1),
            remote_timeout_s=_float("DSA_AOT_REMOTE_TIMEOUT", 0.5),
            remote_ttl_s=_float("DSA_AOT_REMOTE_TTL", 14 * 86400.0),
            remote_lease_s=_float("DSA_AOT_REMOTE_LEASE", 30.0),
            signing_key=_path("DSA_AOT_SIGNING_KEY"),
            trusted_keys=_paths("DSA_AOT_TRUSTED_KEYS"),
            deterministic=_bool("DSA_AOT_DETERMINISTIC", False),
            deterministic_mode=_choice("DSA_AOT_DETERMINISTIC_MODE", "auto", DETERMINISTIC_MODES),
            deterministic_workspace=_size("DSA_AOT_DETERMINISTIC_WORKSPACE", 4 << 30),
        )


_current: Settings | None = None
_listeners: list = []


def get() -> Settings:
    """The process's settings (parsed from the environment on first use)."""
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


def on_change(callback) -> None:
    """Register ``callback()`` to run whenever settings change (caches drop their state)."""
    _listeners.append(callback)


def reload() -> Settings:
    """Re-read the environment (after it changed in-process)."""
    global _current
    _current = Settings.from_env()
    for callback in _listeners:
        callback()
    return _current


@contextlib.contextmanager
def scope(**overrides: object) -> Iterator[Settings]:
    """Temporarily replace settings fields, e.g. ``with scope(jit=False): ...``."""
    global _current
    names = {f.name for f in fields(Settings)}
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"unknown settings {sorted(unknown)}; known: {sorted(names)}")
    previous = get()
    _current = replace(previous, **overrides)
    for callback in _listeners:
        callback()
    try:
        yield _current
    finally:
        _current = previous
        for callback in _listeners:
            callback()
