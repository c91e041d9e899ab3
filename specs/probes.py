"""Feature probes: what the installed compilers can do, asked in throw-away subprocesses.

Each probe runs in its own process (``sys.executable`` for Python probes, nvcc for the arch
probes) with a timeout, so a compiler that aborts or hangs cannot take the caller down; its
result and any error text are recorded in :class:`Features`. Probes are slow (TileLang import
and compiles, seconds), so :func:`load_or_probe` keeps one JSON file per toolchain fingerprint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsa_aot.specs.toolchain import Toolchain, resolve_nvcc

log = logging.getLogger(__name__)

FEATURES_SCHEMA_VERSION = 1
DEFAULT_PROBE_TIMEOUT_S = 300.0
_ARCH = re.compile(r"^sm_\d+[af]?$")
_MARK = "DSA_AOT_PROBE "
_NVCC_RELEASE = re.compile(r"release \d+\.\d+, V(\d+(?:\.\d+)+)")
#: How nvcc refuses an arch it does not know (12.x/13.x, and older releases' option check).
_NVCC_REFUSES_ARCH = re.compile(r"Unsupported gpu architecture|is not defined for option '(?:gpu-architecture|arch)'")
_ERROR_CHARS = 2000


class Features(BaseModel):
    """Probe results for one toolchain. ``None`` means the probe could not answer; those whose
    reason may pass (a timeout, a crash, a full disk) are also named in :attr:`unsettled`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = FEATURES_SCHEMA_VERSION
    toolchain: str | None = Field(None, description="fingerprint of the toolchain probed")
    archs: tuple[str, ...] = Field(description="archs the per-arch probes covered, sorted")
    tilelang_importable: bool
    cutlass_dsl_importable: bool
    cute_math_isfinite: bool | None = Field(
        description="cutlass.cute.math has isfinite (4.6.0+); None without nvidia-cutlass-dsl")
    tilelang_bool_fragment_ok: dict[str, bool | None] = Field(
        description="per arch: a vectorized bool fragment (boolx8) compiles; False reproduces "
        "'Cannot convert type boolx8 to CUDA type'; None if the int32 control also failed")
    nvcc_version: str | None = Field(description="as `nvcc --version` reports it")
    nvcc_archs: dict[str, bool | None] = Field(description="per arch: nvcc builds a cubin for it")
    errors: dict[str, str] = Field(default_factory=dict, description="probe name -> error text")
    unsettled: tuple[str, ...] = Field(
        (), description="probes that could not answer for a reason that may pass (a timeout, a "
        "crash, nvcc failing on something other than the arch, such as a full disk); features "
        "with any are never saved, and a prebuild fails the specs they block")

    def key_dict(self) -> dict[str, Any]:
        """The results alone (no error text, no toolchain id): what artifacts may depend on."""
        return self.model_dump(mode="json", exclude={"errors", "toolchain", "unsettled"})

    def why(self, probe: str, missing: str = "no detail") -> str:
        """The last line of ``probe``'s error text (at most 200 characters), or ``missing``."""
        lines = self.errors.get(probe, "").strip().splitlines()
        return lines[-1][:200] if lines else missing

    def covers(self, archs: Sequence[str]) -> bool:
        """Every arch was probed by both per-arch probes."""
        return all(a in self.tilelang_bool_fragment_ok and a in self.nvcc_archs for a in archs)


# --- probe programs ------------------------------------------------------------------------

_PRELUDE = f"""
import json, sys
def emit(value, error=None):
    print({_MARK!r} + json.dumps(dict(value=value, error=error)), flush=True)
"""

_TILELANG_IMPORT = _PRELUDE + """
try:
    import tilelang
except Exception as e:
    emit(False, f"{type(e).__name__}: {e}")
else:
    emit(True)
"""

_CUTLASS_IMPORT = _PRELUDE + """
try:
    import cutlass
    import cutlass.cute
except Exception as e:
    emit(False, f"{type(e).__name__}: {e}")
else:
    emit(True)
"""

_CUTE_ISFINITE = _PRELUDE + """
try:
    import cutlass.cute as cute
except ModuleNotFoundError as e:
    if e.name and e.name.split(".")[0] == "cutlass":
        emit(None, "nvidia-cutlass-dsl is not installed")
    else:
        emit(None, f"{type(e).__name__}: {e}")
except Exception as e:
    emit(None, f"{type(e).__name__}: {e}")
else:
    emit(hasattr(cute.math, "isfinite"))
"""

# A bool fragment of 1024 elements over 128 threads vectorizes to boolx8; 64 would not.
# The same kernel with an int32 0/1 fragment is the control: it must compile for the arch.
_TILELANG_BOOL_FRAGMENT = _PRELUDE + """
arch = sys.argv[1]
try:
    import tilelang
    import tilelang.language as T
except Exception as e:
    emit(None, f"import tilelang: {type(e).__name__}: {e}")
    raise SystemExit(0)

@T.prim_func
def bool_mask(Idx: T.Tensor((4, 1024), "int32"), Out: T.Tensor((4, 1024), "float32")):
    with T.Kernel(4, threads=128) as bx:
        mask = T.alloc_fragment((1024,), "bool")
        acc = T.alloc_fragment((1024,), "float32")
        for i in T.Parallel(1024):
            mask[i] = Idx[bx, i] >= 0
        for i in T.Parallel(1024):
            acc[i] = T.if_then_else(mask[i], 1.0, 0.0)
        T.copy(acc, Out[bx, :])

@T.prim_func
def int_mask(Idx: T.Tensor((4, 1024), "int32"), Out: T.Tensor((4, 1024), "float32")):
    with T.Kernel(4, threads=128) as bx:
        mask = T.alloc_fragment((1024,), "int32")
        acc = T.alloc_fragment((1024,), "float32")
        for i in T.Parallel(1024):
            mask[i] = T.if_then_else(Idx[bx, i] >= 0, 1, 0)
        for i in T.Parallel(1024):
            acc[i] = T.if_then_else(mask[i] != 0, 1.0, 0.0)
        T.copy(acc, Out[bx, :])

target = {"kind": "cuda", "arch": arch}
try:
    tilelang.compile(int_mask, target=target)
except Exception as e:
    emit(None, f"int32 control failed: {type(e).__name__}: {e}")
    raise SystemExit(0)
try:
    tilelang.compile(bool_mask, target=target)
except Exception as e:
    emit(False, f"{type(e).__name__}: {e}")
else:
    emit(True)
"""

_TINY_CU = "__global__ void dsa_aot_probe(int *p) { if (p) *p = 1; }\n"


# --- running -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Outcome:
    value: Any
    error: str | None = None
    settled: bool = True  # False: no answer, for a reason that may pass (timeout, crash, disk)


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _ERROR_CHARS else "..." + text[-_ERROR_CHARS:]


def run_killable(argv: list[str], timeout_s: float, env: dict[str, str] | None = None,
         cwd: str | None = None) -> tuple[int | None, str, str]:
    """Run argv in its own session; on timeout kill that process group. rc None = timed out."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return None, out, err
    return proc.returncode, out, err


def _python_probe(code: str, args: Sequence[str], timeout_s: float) -> _Outcome:
    """Run a probe program; it reports through one marked JSON line on stdout."""
    with tempfile.TemporaryDirectory(prefix="dsa-aot-probe-") as tmp:
        env = dict(os.environ)
        env.update(TILELANG_CACHE_DIR=os.path.join(tmp, "tilelang-cache"), TILELANG_DISABLE_CACHE="1",
                   TILELANG_PRINT_ON_COMPILATION="0", TMPDIR=tmp)
        script = Path(tmp, "probe.py")  # a file, not -c: TileLang's parser reads the source
        script.write_text(code)
        try:
            rc, out, err = run_killable([sys.executable, str(script), *args], timeout_s, env=env, cwd=tmp)
        except OSError as e:
            return _Outcome(None, f"cannot start {sys.executable}: {e}", settled=False)
    if rc is None:
        return _Outcome(None, f"timed out after {timeout_s:g} s; stderr: {_tail(err)}", settled=False)
    for line in reversed(out.splitlines()):
        if line.startswith(_MARK):
            try:
                data = json.loads(line[len(_MARK):])
                return _Outcome(data["value"], _tail(data["error"]) if data["error"] else None)
            except (ValueError, KeyError, TypeError):
                break
    return _Outcome(None, f"exited {rc} without a result: {_tail(err or out)}", settled=False)


def _nvcc_arch_probe(nvcc: Path | None, arch: str, timeout_s: float) -> _Outcome:
    if nvcc is None:
        return _Outcome(None, "no nvcc found")
    with tempfile.TemporaryDirectory(prefix="dsa-aot-probe-") as tmp:
        Path(tmp, "probe.cu").write_text(_TINY_CU)
        try:
            rc, out, err = run_killable([str(nvcc), "-cubin", f"-arch={arch}", "-o", "probe.cubin", "probe.cu"],
                                timeout_s, cwd=tmp)
        except OSError as e:
            return _Outcome(None, f"cannot run {nvcc}: {e}", settled=False)
        cubin = Path(tmp, "probe.cubin")
        built = rc == 0 and cubin.exists() and cubin.stat().st_size > 0
    if rc is None:
        return _Outcome(None, f"timed out after {timeout_s:g} s", settled=False)
    if built:
        return _Outcome(True)
    detail = _tail(err or out) or f"exited {rc} without a cubin"
    if _NVCC_REFUSES_ARCH.search(err + out):
        return _Outcome(False, detail)
    return _Outcome(None, detail, settled=False)  # a full disk, a broken host compiler, a kill


def _nvcc_version_probe(nvcc: Path | None, timeout_s: float) -> _Outcome:
    if nvcc is None:
        return _Outcome(None, "no nvcc found")
    try:
        rc, out, err = run_killable([str(nvcc), "--version"], timeout_s)
    except OSError as e:
        return _Outcome(None, f"cannot run {nvcc}: {e}", settled=False)
    match = _NVCC_RELEASE.search(out)
    if rc != 0 or match is None:
        return _Outcome(None, f"exited {rc}: {_tail(err or out)}", settled=False)
    return _Outcome(match.group(1))


def _check_archs(archs: Sequence[str]) -> tuple[str, ...]:
    bad = [a for a in archs if not isinstance(a, str) or not _ARCH.match(a)]
    if bad:
        raise ValueError(f"invalid arch name(s) {bad}; expected names like 'sm_90a' or 'sm_100a'")
    return tuple(sorted(set(archs)))


def run_probes(archs: Sequence[str], timeout_s: float = DEFAULT_PROBE_TIMEOUT_S, *,
               nvcc: Path | None = None, max_workers: int | None = None) -> Features:
    """Run every probe now, concurrently, each in its own subprocess with ``timeout_s``.

    ``nvcc`` defaults to :func:`~dsa_aot.specs.toolchain.resolve_nvcc`. Raises ``ValueError``
    for a malformed arch name; a probe that fails, crashes or times out is recorded (its
    result ``None`` or ``False``, its error text in ``errors``), never raised.
    """
    archs = _check_archs(archs)
    nvcc = nvcc if nvcc is not None else resolve_nvcc()
    jobs: dict[str, Callable[[], _Outcome]] = {
        "tilelang_importable": lambda: _python_probe(_TILELANG_IMPORT, (), timeout_s),
        "cutlass_dsl_importable": lambda: _python_probe(_CUTLASS_IMPORT, (), timeout_s),
        "cute_math_isfinite": lambda: _python_probe(_CUTE_ISFINITE, (), timeout_s),
        "nvcc_version": lambda: _nvcc_version_probe(nvcc, timeout_s),
    }
    for arch in archs:
        jobs[f"tilelang_bool_fragment_ok[{arch}]"] = (
            lambda a=arch: _python_probe(_TILELANG_BOOL_FRAGMENT, (a,), timeout_s))
        jobs[f"nvcc_archs[{arch}]"] = lambda a=arch: _nvcc_arch_probe(nvcc, a, timeout_s)
    workers = max_workers or max(2, os.cpu_count() or 2)
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        results = {name: f.result() for name, f in futures.items()}
    errors = {name: r.error for name, r in results.items() if r.error}
    return Features(
        unsettled=tuple(name for name, r in results.items() if not r.settled),
        archs=archs,
        tilelang_importable=results["tilelang_importable"].value is True,
        cutlass_dsl_importable=results["cutlass_dsl_importable"].value is True,
        cute_math_isfinite=results["cute_math_isfinite"].value,
        tilelang_bool_fragment_ok={a: results[f"tilelang_bool_fragment_ok[{a}]"].value for a in archs},
        nvcc_version=results["nvcc_version"].value,
        nvcc_archs={a: results[f"nvcc_archs[{a}]"].value for a in archs},
        errors=errors,
    )


# --- persistence ---------------------------------------------------------------------------

def _read(path: Path) -> Features | None:
    try:
        return Features.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError, ValueError) as e:
        log.warning("ignoring unreadable features file %s (%s); probing again", path, e)
        return None


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp.{os.getpid()}.{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_or_probe(features_path: Path, archs: Sequence[str], *,
                  timeout_s: float = DEFAULT_PROBE_TIMEOUT_S, toolchain: Toolchain | None = None,
                  probe: Callable[..., Features] = run_probes) -> Features:
    """Features from ``features_path`` if it is valid for ``toolchain`` and ``archs``, else probe.

    Valid: it parses, has this schema version, was probed for ``toolchain.fingerprint``
    (default :meth:`Toolchain.current`) and covers every arch. Otherwise ``probe(archs,
    timeout_s)`` runs for the requested archs plus those already in the file, and the result
    is written atomically. An incomplete toolchain is probed every time and nothing is
    written; so are features with :attr:`~Features.unsettled` probes (the next call asks
    again). An unreadable file is a logged miss; a failed write is logged, not raised.
    """
    archs = _check_archs(archs)
    toolchain = toolchain if toolchain is not None else Toolchain.current()
    if not toolchain.complete:
        log.warning("toolchain incomplete (%s); probing without the features file",
                    "; ".join(toolchain.incomplete_reasons))
        return probe(archs, timeout_s).model_copy(update={"toolchain": None})
    features_path = Path(features_path)
    known = _read(features_path)
    stale = (known is None or known.schema_version != FEATURES_SCHEMA_VERSION
             or known.toolchain != toolchain.fingerprint)
    if not stale and known.covers(archs):
        return known
    wanted = sorted(set(archs) | (set(known.archs) if known is not None and not stale else set()))
    features = probe(wanted, timeout_s).model_copy(update={"toolchain": toolchain.fingerprint})
    if features.unsettled:
        log.warning("feature probes %s could not answer (%s); not saving %s, the next run asks again",
                    ", ".join(features.unsettled),
                    "; ".join(features.why(n) for n in features.unsettled),
                    features_path)
        return features
    try:  # always empty when written: files stay readable by releases without the field
        write_atomic(features_path, features.model_dump_json(indent=1, exclude={"unsettled"}).encode())
    except OSError as e:
        log.warning("cannot write features file %s: %s", features_path, e)
    return features
