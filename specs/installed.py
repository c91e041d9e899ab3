"""What is installed, read without pydantic or a compiler: distributions on the import path,
the nvcc builds would use and its version, and the memo of facts derived from installed files.

Shared by :mod:`dsa_aot.specs.toolchain` (the build key's toolchain model) and the serving path
(:mod:`dsa_aot.serving`), which must answer the same questions in a process that never imports
pydantic.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import json
import os
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dsa_aot.toolkit import file_head, resolve_nvcc, wrapper_target

NVCC_TIMEOUT_S = 30.0

_NVCC_RELEASE = re.compile(r"release (\d+)\.(\d+), V(\d+(?:\.\d+)+)")
_VERSION = re.compile(r"^\d+\.\d+(?:\.\d+)*$")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def matches_compiler(name: str, pattern: str) -> bool:
    """Whether distribution ``name`` is the one a backend's ``compilers`` entry names
    (``prefix*`` names every distribution with that prefix)."""
    return name == pattern or (pattern.endswith("*") and name.startswith(pattern[:-1]))


def _installed_distributions(search_path: Iterable[str]) -> dict[str, Path]:
    """Normalized name -> metadata dir; the first entry of ``search_path`` wins, as for imports."""
    found: dict[str, Path] = {}
    for entry in search_path:
        root = Path(entry or ".")
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for child in names:
            stem, dot, kind = child.rpartition(".")
            if not dot or kind not in ("dist-info", "egg-info"):
                continue
            name = _normalize(stem.split("-", 1)[0])
            found.setdefault(name, root / child)
    return found



# --- the CuTe DSL's CUDA build ---------------------------------------------------------------

#: One CuTe DSL build per CUDA major, each its own distribution (``nvidia-cutlass-dsl-libs-cu13``).
DSL_CUDA_LIBS = re.compile(r"^nvidia-cutlass-dsl-libs-cu(\d+)$")


@functools.lru_cache(maxsize=1)
def driver_cuda_version() -> int | None:
    """The driver's ``cuDriverGetVersion`` (``13000`` for CUDA 13.0), or None without a driver.
    Needs ``libcuda.so.1`` only, no GPU; read once per process."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        return version.value if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 else None
    except (OSError, AttributeError):
        return None


def dsl_cuda_majors(distributions: Iterable[str]) -> tuple[int, ...]:
    """The CUDA majors of the CuTe DSL builds among ``distributions`` (normalized names), sorted."""
    return tuple(sorted({int(m.group(1)) for name in distributions if (m := DSL_CUDA_LIBS.match(name))}))


def dsl_cuda_choice(installed: Iterable[int], driver: int | None) -> int | None:
    """The CUDA major of the CuTe DSL build the DSL loads, as it chooses at import: the newest
    installed one the driver supports (driver major at least the build's), the newest installed
    without a driver (a CPU builder). None when none is installed or the driver supports none.
    It compiles with that build's libraries, so the build key names it."""
    majors = sorted(installed)
    if driver is not None:
        majors = [major for major in majors if major <= driver // 1000]
    return majors[-1] if majors else None


def nvcc_version_of(nvcc: Path | None, spawn: bool, reasons: list[str]) -> str | None:
    from dsa_aot import settings

    named = nvcc is not None or settings.get().nvcc is not None
    path = nvcc if nvcc is not None else resolve_nvcc()
    if path is None:
        return None  # no toolkit: nothing can be built here, and nothing is unreadable
    if not path.exists():
        if named:
            reasons.append(f"nvcc {path} (named by DSA_AOT_NVCC or the caller) does not exist")
        return None
    version, error = nvcc_version(path, spawn=spawn)
    if error:
        reasons.append(error)
    return version



# --- nvcc ----------------------------------------------------------------------------------

def nvcc_version(nvcc: Path, *, spawn: bool = False) -> tuple[str | None, str | None]:
    """Version nvcc reports (``'13.0.88'``), read cheaply where the toolkit records it.

    For a real nvcc binary at ``<root>/bin/nvcc``: ``<root>/version.json`` (NVIDIA's
    installers), else the ``nvidia-cuda-nvcc`` wheel metadata that installed it. Otherwise,
    or with ``spawn``, runs ``nvcc --version`` (once per process and path), and remembers the
    answer for this exact binary in ``<cache dir>/.nvcc-versions.json`` so later processes skip
    the spawn. Returns ``(version, None)`` or ``(None, error text)``.
    """
    if spawn:
        return _nvcc_version_spawned(str(nvcc))
    version = _nvcc_version_from_files(nvcc)
    if version is not None:
        return version, None
    identity = file_identity(nvcc)
    remembered = _memo_get("nvcc", identity)
    if isinstance(remembered, str) and _VERSION.match(remembered):
        return remembered, None
    version, error = _nvcc_version_spawned(str(nvcc))
    if version is not None:
        _memo_put("nvcc", identity, version)
    return version, error


#: Derived facts about installed files, kept between processes in ``<cache dir>/<TOOLCHAIN_MEMO>``:
#: ``nvcc``: what a toolkit without version files answered to ``nvcc --version`` (a spawn, ~15 ms);
#: ``record``: a distribution's RECORD digest (parsing TileLang's ~5,000 lines, ~10 ms). Each
#: is filed under :func:`file_identity` of the file it was derived from.
TOOLCHAIN_MEMO = ".toolchain-memo.json"
_MEMO_MAX = 64


def file_identity(path: Path | str) -> str | None:
    """Which file ``path`` is: real path, device, inode, size, mtime and ctime (ns).

    Replacing or rewriting a file changes its inode or ctime (which no user can set back), so a
    fact remembered for one file is never reused for another; the same test decides when a
    compiler cache may trust a compiler unchanged. None when the file cannot be stat-ed.
    """
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return f"{real}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def _memo_path() -> Path | None:
    try:
        from dsa_aot import settings

        return settings.get().cache_dir / TOOLCHAIN_MEMO
    except Exception:  # settings unreadable: no memo, compute as before
        return None


_memo_cache: tuple[Path, dict[str, Any]] | None = None


def _memo_read(path: Path) -> dict[str, Any]:
    global _memo_cache
    if _memo_cache is not None and _memo_cache[0] == path:
        return _memo_cache[1]
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data = data if isinstance(data, dict) else {}
    _memo_cache = (path, data)
    return data


def memo_get(kind: str, identity: str | None) -> Any:
    """A fact remembered for the file ``identity`` (see :func:`file_identity`), or None."""
    return _memo_get(kind, identity)


def _memo_get(kind: str, identity: str | None) -> Any:
    path = _memo_path()
    if identity is None or path is None:
        return None
    table = _memo_read(path).get(kind)
    return table.get(identity) if isinstance(table, dict) else None


def _memo_put(kind: str, identity: str | None, value: Any) -> None:
    """Remember one fact (atomically: a temporary file renamed over the memo); best effort."""
    if identity is not None:
        memo_put_many(kind, {identity: value})


def memo_put_many(kind: str, facts: dict[str, Any], keep: int = _MEMO_MAX) -> None:
    """Remember several facts of one kind in one write (the newest ``keep`` are kept)."""
    global _memo_cache
    path = _memo_path()
    if not facts or path is None:
        return
    _memo_cache = None  # re-read: another process may have added facts
    data = dict(_memo_read(path))
    table = {k: v for k, v in (data.get(kind) or {}).items() if k not in facts}
    data[kind] = dict(list(table.items())[-max(keep - len(facts), 0):]) | facts
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        from dsa_aot.cache.layout import mkdirs  # 0755 levels: a umask 002 must not open the cache root

        mkdirs(path.parent)
        tmp.write_text(json.dumps(data, indent=0))
        os.replace(tmp, path)
    except OSError:  # best effort: a read-only or full cache dir only loses the memo
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # e.g. EROFS: nothing was written
            pass
    _memo_cache = (path, data)


def _nvcc_version_from_files(nvcc: Path, _hops: int = 1) -> str | None:
    head = file_head(nvcc) if nvcc.parent.name == "bin" else None
    if head is None:
        return None
    if head[:4] != b"\x7fELF":
        # a wrapper script: only ``exec /abs/path/bin/nvcc "$@"`` is followed (it is certain
        # which binary runs); anything else is asked by spawning it
        target = wrapper_target(head)
        if target is None or _hops <= 0:
            return None
        return _nvcc_version_from_files(target, _hops - 1)
    root = nvcc.parent.parent
    for read in (_version_json, _toolkit_dist_info, _nvcc_wheel):
        version = read(root, nvcc)
        if isinstance(version, str) and _VERSION.match(version):
            return version
    return None


def _version_json(root: Path, nvcc: Path) -> str | None:
    """NVIDIA's installers write ``<root>/version.json`` (CUDA 11.1+)."""
    try:
        return json.loads((root / "version.json").read_text()).get("cuda_nvcc", {}).get("version")
    except (OSError, ValueError, AttributeError):
        return None


def _toolkit_dist_info(root: Path, nvcc: Path) -> str | None:
    """A toolkit assembled from NVIDIA's wheels, their metadata kept in ``<root>/dist-info``."""
    try:
        children = os.listdir(root / "dist-info")
    except OSError:
        return None
    for child in children:
        if child.endswith(".dist-info") and _normalize(child.split("-", 1)[0]) == "nvidia-cuda-nvcc":
            return md.PathDistribution(root / "dist-info" / child).version
    return None


def _nvcc_wheel(root: Path, nvcc: Path) -> str | None:
    """The ``nvidia-cuda-nvcc`` wheel installed into this environment, if it owns ``nvcc``."""
    try:
        dist = md.distribution("nvidia-cuda-nvcc")
    except md.PackageNotFoundError:
        return None
    if any(f.name == "nvcc" and Path(f.locate()) == nvcc for f in dist.files or []):
        return dist.version
    return None


@functools.lru_cache(maxsize=8)
def _nvcc_version_spawned(nvcc: str) -> tuple[str | None, str | None]:
    try:
        proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"`{nvcc} --version` failed: {e}"
    match = _NVCC_RELEASE.search(proc.stdout)
    if proc.returncode != 0 or match is None:
        tail = (proc.stdout + proc.stderr).strip()[-300:]
        return None, f"`{nvcc} --version` exited {proc.returncode} without a release line: {tail!r}"
    return match.group(3), None


