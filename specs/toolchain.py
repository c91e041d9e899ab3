"""The installed compiler toolchain, described without importing any compiler.

An artifact (cubin + launch record, CuTe DSL library) is valid for the compilers that built it;
which of them a spec's key covers, and which of our sources, is decided per spec in
:mod:`dsa_aot.specs.keys`. :meth:`Toolchain.current` describes the installed toolchain
without importing any compiler (no ``tilelang``, ``tvm``, ``tvm_ffi`` or ``cutlass``): package
versions and content hashes come from each distribution's metadata (``RECORD`` lists the
sha256 of every installed file), the nvcc version from the toolkit's version files (spawning
``nvcc --version`` only as a fallback). Nothing is keyed on paths or mtimes.

When an input cannot be read (a missing ``RECORD``, an editable compiler install, an nvcc that
does not answer), the toolchain is marked ``complete=False`` with reasons; callers must then
skip the disk cache rather than trust a weakened key.

The nvcc is the one :func:`dsa_aot.toolkit.resolve_nvcc` finds (``DSA_AOT_NVCC``, then as
TileLang resolves it); TileLang's path overrides (``settings.tilelang_path_overrides``) make the
toolchain incomplete when they point outside the installed ``tilelang``, because their contents
are not hashed.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsa_aot.specs.installed import (  # noqa: F401  (re-exported)
    NVCC_TIMEOUT_S, TOOLCHAIN_MEMO, _installed_distributions, _memo_get, _memo_put, _normalize,
    _nvcc_version_from_files, _nvcc_version_spawned, driver_cuda_version, dsl_cuda_choice, dsl_cuda_majors,
    file_identity, memo_get, memo_put_many, nvcc_version, nvcc_version_of)
from dsa_aot.toolkit import resolve_nvcc  # noqa: F401  (re-exported)

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from dsa_aot.specs.probes import Features

#: Bump to invalidate every cached artifact when the meaning of a field changes.
SCHEMA_VERSION = 2

#: Prefix of the CuTe DSL distributions (meta package, libs-base, libs-core, libs-cu12, ...).
CUTLASS_DSL_PREFIX = "nvidia-cutlass-dsl"


# CPython extension modules: built per interpreter (cpython-311, abi3 on 3.12, ...); hashing
# them would split the key per Python version although their sources are identical.
_PY_EXTENSION = re.compile(r"\.(?:abi3|cpython-[^./]+|cp\d+-[^./]+|pypy[^./]*)\.(?:so|pyd)$|\.pyd$")
_NATIVE = re.compile(r"\.(?:so(?:\.\d+)*|dylib|dll)$")
_SKIPPED_SOURCE_SUFFIXES = (".pyc", ".pyo", "~")
_METADATA_VERSION = re.compile(r"^Version:[ \t]*(\S.*)$", re.M)


class Distribution(BaseModel):
    """One installed Python distribution, identified by name, version and content."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="normalized distribution name, e.g. 'nvidia-cutlass-dsl-libs-base'")
    version: str = Field(description="version from the distribution's metadata")
    content_sha256: str | None = Field(
        None, description="sha256 over the RECORD lines of its installed files (see "
        "record_digest); None where only the version is keyed")


class Toolchain(BaseModel):
    """Everything outside the kernel spec that decides whether a cached artifact is valid.

    ``torch`` is deliberately absent: artifacts are cubins launched by our own launcher and
    CuTe DSL objects, neither links torch. Build with :meth:`current` (memoized) or
    :meth:`collect`; derive variants with ``model_copy(update=...)``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = Field(SCHEMA_VERSION, description="key format; bump to drop old entries")
    tilelang: Distribution | None = Field(
        description="TileLang (compiler, CUDA templates, bundled CUTLASS headers), content-hashed")
    tvm_ffi: Distribution | None = Field(description="apache-tvm-ffi, content-hashed")
    cutlass_dsl: tuple[Distribution, ...] = Field(
        (), description="every installed nvidia-cutlass-dsl* distribution, sorted by name, "
        "content-hashed (CPython extension modules excluded, as for every distribution)")
    cutlass_dsl_cuda: int | None = Field(
        None, description="CUDA major of the CuTe DSL build (nvidia-cutlass-dsl-libs-cu<N>) the DSL "
        "loads here, as it chooses by the driver (the newest installed without one); None when "
        "none is installed or the driver supports none. The same packages compile different code "
        "with cu12 and cu13")
    other_compilers: tuple[Distribution, ...] = Field(
        (), description="compiler distributions other backends declare, content-hashed, by name")
    nvcc_version: str | None = Field(description="what `nvcc --version` reports, e.g. '13.0.88'")
    cuda_driver_min: str | None = Field(
        description="CUDA release nvcc targets, e.g. '13.0': the cubins need a driver that "
        "supports at least this release")
    python_abi: str | None = Field(
        None, description="interpreter tag (e.g. 'cpython-311') for artifacts that load a "
        "CPython extension; None for ours: cubins + launch records and CuTe DSL objects are C ABI")
    host: str = Field(description="OS and CPU of the host code in artifacts, e.g. 'linux-x86_64' "
                      "(CuTe DSL objects contain host code)")
    features: dict[str, Any] | None = Field(
        None, description="probe results (Features.key_dict()) when artifacts depend on them")
    complete: bool = Field(True, description="False when a key input could not be read")
    incomplete_reasons: tuple[str, ...] = Field((), description="why complete is False")

    def canonical_json(self) -> str:
        """Canonical JSON of every field (sorted keys, no whitespace)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @property
    def fingerprint(self) -> str:
        """First 16 hex chars of the sha256 of :meth:`canonical_json`."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    def with_features(self, features: Features) -> Toolchain:
        """A copy keyed on probe results too, for artifacts whose code depends on them."""
        return self.model_copy(update={"features": features.key_dict()})

    @classmethod
    def current(cls) -> Toolchain:
        """The installed toolchain, computed once per process (see :meth:`collect`)."""
        return _current()

    @classmethod
    def collect(cls, *, nvcc: Path | None = None, spawn_nvcc: bool = False, python_abi: bool = False,
                search_path: Sequence[str] | None = None,
                compilers: Sequence[str] = ()) -> Toolchain:
        """Describe the installed toolchain now, without importing any compiler.

        ``nvcc`` defaults to :func:`~dsa_aot.toolkit.resolve_nvcc`; ``spawn_nvcc`` asks nvcc
        itself instead of the toolkit's version files; ``search_path`` replaces ``sys.path``
        when looking for distributions; ``compilers`` names further distributions (``prefix*``
        patterns allowed) that backends build with, content-hashed into ``other_compilers``.
        Never raises for an unreadable input: the result is then ``complete=False`` with reasons.
        """
        reasons: list[str] = []
        dists = _installed_distributions(sys.path if search_path is None else search_path)
        tilelang = _hashed_distribution(dists, "tilelang", reasons, expect_native=True)
        tvm_ffi = _hashed_distribution(dists, "apache-tvm-ffi", reasons, expect_native=True)
        cutlass = tuple(_hashed_distribution(dists, name, reasons, expect_native=False)
                        for name in sorted(dists) if name.startswith(CUTLASS_DSL_PREFIX))
        named = {"tilelang", "apache-tvm-ffi"}
        others = sorted({name for name in dists for pattern in compilers
                         if name not in named and not name.startswith(CUTLASS_DSL_PREFIX)
                         and (name == pattern or (pattern.endswith("*") and name.startswith(pattern[:-1])))})
        other = tuple(_hashed_distribution(dists, name, reasons, expect_native=False) for name in others)
        if tilelang is not None:
            _check_tilelang_overrides(dists["tilelang"], reasons)
        nvcc_ver = nvcc_version_of(nvcc, spawn_nvcc, reasons)
        dsl_cuda = dsl_cuda_majors(d.name for d in cutlass)
        return cls(
            tilelang=tilelang,
            tvm_ffi=tvm_ffi,
            cutlass_dsl=cutlass,
            cutlass_dsl_cuda=dsl_cuda_choice(dsl_cuda, driver_cuda_version()) if dsl_cuda else None,
            other_compilers=other,
            nvcc_version=nvcc_ver,
            cuda_driver_min=None if nvcc_ver is None else ".".join(nvcc_ver.split(".")[:2]),
            python_abi=sys.implementation.cache_tag if python_abi else None,
            host=f"{sys.platform}-{_machine()}",
            complete=not reasons,
            incomplete_reasons=tuple(reasons),
        )


@functools.lru_cache(maxsize=1)
def _current() -> Toolchain:
    from dsa_aot.backends import declared_compilers

    return Toolchain.collect(compilers=declared_compilers())



def _machine() -> str:
    try:
        return os.uname().machine
    except AttributeError:  # Windows
        import platform
        return platform.machine()


# --- distributions -------------------------------------------------------------------------


def _version(path: Path, name: str, reasons: list[str]) -> str:
    """The ``Version:`` header of the distribution's METADATA (or PKG-INFO)."""
    version = None
    for fname in ("METADATA", "PKG-INFO"):
        try:
            with open(path / fname, encoding="utf-8", errors="replace") as f:
                head = f.read(8192)  # the version is among the first headers
        except OSError:
            continue
        match = _METADATA_VERSION.search(head.partition("\n\n")[0])
        if match is None:  # an unusual layout: let the stdlib parse all of it
            try:
                version = md.PathDistribution(path).version
            except Exception as e:  # a broken METADATA file
                reasons.append(f"{name}: cannot read its version from {path.name}: {e}")
        else:
            version = match.group(1).strip()
        break
    else:
        reasons.append(f"{name}: {path.name} has no METADATA")
    return version or "unknown"


def _hashed_distribution(dists: Mapping[str, Path], name: str, reasons: list[str],
                         *, expect_native: bool) -> Distribution | None:
    path = dists.get(name)
    if path is None:
        return None
    version = _version(path, name, reasons)
    digest, problems = record_digest(md.PathDistribution(path), expect_native=expect_native)
    reasons.extend(f"{name}: {p}" for p in problems)
    return Distribution(name=name, version=version, content_sha256=digest)


def _skipped_record_path(path: str) -> bool:
    """Files outside the content key: metadata, bytecode, scripts, CPython extension modules."""
    if path.startswith(("../", "/")) or path.endswith((".pyc", ".pyo")) or "__pycache__/" in path:
        return True  # scripts carry a per-venv shebang; bytecode is derived per install
    if path.partition("/")[0].endswith((".dist-info", ".egg-info")):
        return True
    return path.endswith((".so", ".pyd")) and _PY_EXTENSION.search(path) is not None


def _keyed_line(line: str) -> bool:
    """Whether an unquoted RECORD line's path is keyed: :func:`_skipped_record_path`, made
    cheap for the common line (a plain package file) by substring tests."""
    if "__pycache__/" in line or ".pyc," in line or ".pyo," in line or line[0] == "/":
        return False
    if line.startswith("../") or "-info/" in line or ".so" in line or ".pyd," in line:
        return not _skipped_record_path(line.split(",", 1)[0])
    return True


def record_digest(dist: md.Distribution, *, expect_native: bool = False) -> tuple[str | None, list[str]]:
    """sha256 over the sorted ``path,hash,size`` RECORD lines of ``dist``'s installed files.

    Skipped: metadata, bytecode, scripts and CPython extension modules (see
    :func:`_skipped_record_path`). Returns ``(digest, [])``, or ``(None, problems)`` when
    the RECORD is missing, a kept file has no hash, the install is editable (its RECORD
    does not describe the built libraries), no native library is listed while
    ``expect_native``, or a native library's size on disk differs from its RECORD line.
    """
    direct_url = dist.read_text("direct_url.json")
    if direct_url:
        try:
            editable = bool(json.loads(direct_url).get("dir_info", {}).get("editable"))
        except (ValueError, AttributeError):
            editable = False
        if editable:
            return None, ["editable install; its RECORD does not describe the built libraries"]
    # PathDistribution keeps its metadata folder in _path; others (zip imports) are not memoized
    folder = getattr(dist, "_path", None)
    identity = file_identity(Path(str(folder)) / "RECORD") if folder is not None else None
    remembered = _memo_get("record", identity)
    if isinstance(remembered, dict) and isinstance(remembered.get("digest"), str):
        natives = remembered.get("natives") or []
        problems = _native_problems(dist, natives)
        if expect_native and not natives:
            problems.append("RECORD lists no native library (source or develop install?)")
        return (None, problems) if problems else (remembered["digest"], [])
    text = dist.read_text("RECORD")
    if text is None:
        return None, ["RECORD is missing; its installed files cannot be fingerprinted"]
    if '"' in text:  # csv quoting (a path with a comma or quote): parse every line
        rows = [(r + ["", ""])[:3] for r in csv.reader(text.splitlines()) if r and r[0]]
        rows = [r for r in rows if not _skipped_record_path(r[0])]
    else:  # no quoting, so no comma in any path: filter by substrings (~5,000 lines, ~2 ms)
        rows = [line.rsplit(",", 2) for line in text.splitlines() if line and _keyed_line(line)]
    lines: list[str] = []
    problems: list[str] = []
    natives: list[tuple[str, str]] = []
    for row in rows:
        path, digest, size = row if len(row) == 3 else (row + ["", ""])[:3]
        if not digest:
            problems.append(f"{path} has no hash in RECORD")
            continue
        lines.append(f"{path},{digest},{size}")
        if (".so" in path or ".dylib" in path or ".dll" in path) and _NATIVE.search(path):
            natives.append((path, size))
    problems += _native_problems(dist, natives)
    if expect_native and not natives:
        problems.append("RECORD lists no native library (source or develop install?)")
    if problems:
        return None, problems
    lines.sort()
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    _memo_put("record", identity, {"digest": digest, "natives": natives})
    return digest, []


def _native_problems(dist: md.Distribution, natives: Iterable[Sequence[str]]) -> list[str]:
    """Native libraries listed in RECORD must be on disk with the recorded size."""
    problems = []
    for path, size in natives:
        try:
            actual = os.stat(dist.locate_file(path)).st_size
        except OSError as e:
            problems.append(f"{path} is listed in RECORD but unreadable: {e.strerror}")
            continue
        if size.isdigit() and actual != int(size):
            problems.append(f"{path} is {actual} bytes, RECORD says {size} (rebuilt in place?)")
    return problems


def _check_tilelang_overrides(path: Path, reasons: list[str]) -> None:
    """TileLang reads templates/headers/libraries from these variables when set."""
    from dsa_aot import settings

    package = os.path.realpath(md.PathDistribution(path).locate_file("tilelang"))
    for var, value in settings.get().tilelang_path_overrides:
        if not value:
            continue
        for item in value.split(os.pathsep):
            real = os.path.realpath(item)
            if item and real != package and not real.startswith(package + os.sep):
                reasons.append(f"{var}={value} points outside the installed tilelang ({package}); "
                               "its contents are not in the key")
                break


# --- our sources ---------------------------------------------------------------------------

def _package_dir(module: str) -> Path | None:
    """Directory of a package without executing it (its parent package is imported)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def hash_sources(files: Mapping[str, Path] | Iterable[tuple[str, Path]]) -> str:
    """sha256 (hex) over key names and file contents, independent of order and location."""
    items = files.items() if isinstance(files, Mapping) else files
    h = hashlib.sha256()
    for name, path in sorted(items):
        h.update(f"{name}\0{hashlib.sha256(Path(path).read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()
