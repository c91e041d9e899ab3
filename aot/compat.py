"""``dsa-aot compat``: what still compiles, and what falls back, under other toolchains.

For each toolchain of a matrix file (``specs/compat_matrix.toml``; every row pins the whole
compiler set), a virtualenv is built from the registry under ``--envs-dir`` (``torch`` first,
then the pins, then our runtime dependencies), keyed by a hash of that set and reused by later
runs. Inside it, with this checkout on ``PYTHONPATH``, the feature probes run
(:mod:`dsa_aot.specs.probes`) and then that environment's ``dsa-aot prebuild`` compiles the
selected specs into a cache of its own. The result is one report, ``<out>.json`` and
``<out>.md``: a row per spec and a column per toolchain (built / skipped-by-feature and why /
failed and the first compiler error line), the probes per toolchain, the date, the matrix and
the machine.

The next environment is built while the current one compiles (one pip process beside the
compilers, mostly download and unpack). Everything a toolchain does runs in subprocesses of
its own interpreter; this module imports no compiler.
"""

from __future__ import annotations

import concurrent.futures
import datetime as _dt
import fnmatch
import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dsa_aot.specs.models import Arch, KernelSpec

SCHEMA_VERSION = 1
ENV_FORMAT = 1
ENV_MARKER = "compat-env.json"
DEFAULT_ENVS_DIR = Path(".compat-envs")
DEFAULT_OUT = Path("docs/compat")
ENV_TIMEOUT_S = 3600.0
PROBE_TIMEOUT_S = 1800.0
PREBUILD_TIMEOUT_S = 4 * 3600.0

#: Variables that must not leak from this process into a toolchain's processes: an imported
#: TileLang exports the first four (pointing into *our* tilelang), CuTe DSL reads the arch once.
_SCRUBBED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TL_TEMPLATE_PATH", "TL_CUTLASS_PATH",
                 "TVM_LIBRARY_PATH", "TVM_IMPORT_PYTHON_PATH", "CUTE_DSL_ARCH", "DSA_AOT_PREBUILT_DIR",
                 "DSA_AOT_REQUIRE_PREBUILT", "DSA_AOT_ARCH_LIST", "PIP_CONSTRAINT")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)$")
_PROBLEM_LINE = re.compile(r"^\s{2}(\S+)\s{2,}(failed|skipped-by-feature)\s{2,}(.*)$")
_FINGERPRINT_LINE = re.compile(r"^toolchain ([0-9a-f]{16})\s")

CellStatus = Literal["built", "skipped-by-feature", "failed", "not-run"]


class CompatError(RuntimeError):
    """The matrix cannot be run as asked; the message says what to change."""


# --- the matrix file ---------------------------------------------------------------------------

def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class ToolchainRow(BaseModel):
    """One toolchain: an exact pin for every package of the compiler set."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="column title")
    pins: tuple[str, ...] = Field(min_length=1, description="'name==version' for every package")
    note: str = ""
    required: bool = Field(False, description="every selected spec must build (the shipped pins)")
    expect: dict[str, Any] = Field(default_factory=dict,
                                   description="Features field -> measured value (per-arch dicts allowed)")

    @field_validator("pins")
    @classmethod
    def _exact_pins(cls, pins: tuple[str, ...]) -> tuple[str, ...]:
        seen = set()
        for pin in pins:
            match = _PIN.match(pin.strip())
            if match is None:
                raise ValueError(f"pin {pin!r} is not 'name==version'; every package of a toolchain "
                                 "is pinned exactly (see specs/compat_matrix.toml)")
            name = _normalize(match.group(1))
            if name in seen:
                raise ValueError(f"{name} is pinned twice")
            seen.add(name)
        if "tilelang" not in seen:
            raise ValueError("a toolchain pins tilelang")
        return tuple(sorted(p.strip() for p in pins))

    @field_validator("expect")
    @classmethod
    def _known_probes(cls, expect: dict[str, Any]) -> dict[str, Any]:
        from dsa_aot.specs.probes import Features

        unknown = set(expect) - (set(Features.model_fields) - {"schema_version", "toolchain", "archs", "errors"})
        if unknown:
            raise ValueError(f"expect: unknown probe(s) {sorted(unknown)}")
        return expect

    def pinned(self) -> dict[str, str]:
        """Normalized package name -> pinned version."""
        return {_normalize(m.group(1)): m.group(2) for m in map(_PIN.match, self.pins) if m}


class Slice(BaseModel):
    """A named subset of the matrix (e.g. what CI runs): toolchain names and spec globs."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    toolchains: tuple[str, ...] = Field(min_length=1)
    only: tuple[str, ...] = ()


class CompatMatrix(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    archs: tuple[Arch, ...] = ("sm_90a", "sm_100a")
    torch: str = Field("torch==2.13.0", description="installed first in every environment")
    only: tuple[str, ...] = Field((), description="spec-id globs; empty = the whole catalog")
    jobs: int | None = Field(None, ge=1, description="prebuild --jobs (default: CPU count)")
    toolchain: tuple[ToolchainRow, ...] = Field(min_length=1)
    slices: dict[str, Slice] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _unique_and_known(self) -> CompatMatrix:
        names = [t.name for t in self.toolchain]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"toolchain names must be unique: {dupes}")
        for sname, sl in self.slices.items():
            missing = sorted(set(sl.toolchains) - set(names))
            if missing:
                raise ValueError(f"slice {sname!r} names unknown toolchain(s) {missing}")
        return self


def default_matrix_path() -> Path:
    return Path(str(resources.files("dsa_aot.specs").joinpath("compat_matrix.toml")))


def load_matrix(path: Path | str | None = None) -> CompatMatrix:
    """Parse and validate a matrix file (the packaged one when ``path`` is None)."""
    path = Path(path) if path is not None else default_matrix_path()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"compat matrix {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"compat matrix {path} is not valid TOML: {exc}") from None
    return CompatMatrix.model_validate(data)


def select_toolchains(matrix: CompatMatrix, *, slice_name: str | None = None,
                      names: Sequence[str] | None = None,
                      shard: tuple[int, int] | None = None) -> list[ToolchainRow]:
    """The rows to run: a slice's, or those named (globs), then shard ``i`` of ``n`` (1-based)."""
    rows = list(matrix.toolchain)
    if slice_name is not None:
        if slice_name not in matrix.slices:
            raise CompatError(f"no slice {slice_name!r} in the matrix; have {sorted(matrix.slices)}")
        wanted = matrix.slices[slice_name].toolchains
        rows = [r for r in rows if r.name in wanted]
    if names:
        rows = [r for r in rows if any(fnmatch.fnmatchcase(r.name, n) for n in names)]
        if not rows:
            raise CompatError(f"--toolchain {list(names)} matches no toolchain of the matrix")
    if shard is not None:
        i, n = shard
        rows = [r for k, r in enumerate(rows) if k % n == i - 1]
    return rows


# --- environments ------------------------------------------------------------------------------

def runtime_requirements() -> tuple[str, ...]:
    """Our own run-time dependencies (from the installed metadata), torch excepted."""
    try:
        reqs = md.requires("dsa-aot") or []
    except md.PackageNotFoundError:
        reqs = []
    out = []
    for req in reqs:
        spec, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        name = re.split(r"[<>=!~ \[]", spec.strip(), maxsplit=1)[0]
        if _normalize(name) != "torch":
            out.append(spec.strip().replace(" ", ""))
    return tuple(sorted(out)) or ("diskcache>=5.6", "filelock>=3.12", "pydantic>=2.6,<3")


def env_key(row: ToolchainRow, torch_spec: str, runtime: Sequence[str]) -> str:
    """16 hex chars naming the environment of ``row`` on this interpreter and platform."""
    ident = {"format": ENV_FORMAT, "python": sys.implementation.cache_tag,
             "platform": f"{sys.platform}-{platform.machine()}", "torch": torch_spec,
             "pins": sorted(row.pins), "runtime": sorted(runtime)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


class EnvInfo(BaseModel):
    """``compat-env.json``: written last, so an environment without it is incomplete."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: int = ENV_FORMAT
    key: str
    name: str
    pins: tuple[str, ...]
    torch: str
    python: str
    created: str
    build_seconds: float
    installed: dict[str, str] = Field(description="every distribution in the environment -> version")


class Env(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    path: Path
    info: EnvInfo
    reused: bool = False
    seconds: float = 0.0

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def _log(message: str) -> None:
    print(f"[compat] {message}", file=sys.stderr, flush=True)


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run(argv: Sequence[str], *, log: Path, timeout_s: float, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run argv, appending its output to ``log``; a timeout kills its process group (rc 124)."""
    from dsa_aot.specs.probes import run_killable

    args = [str(a) for a in argv]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as fh:
        fh.write(f"$ {' '.join(args)}\n")
        fh.flush()
        rc, out, err = run_killable(args, timeout_s, env=env, cwd=None if cwd is None else str(cwd))
        if rc is None:
            fh.write(out + err + f"\n[timed out after {timeout_s:g} s]\n")
            return subprocess.CompletedProcess(args, 124, out, err + f"\ntimed out after {timeout_s:g} s")
        fh.write(out + err + f"[exit {rc}]\n")
    return subprocess.CompletedProcess(args, rc, out, err)


def _pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _read_env(path: Path, key: str) -> EnvInfo | None:
    try:
        info = EnvInfo.model_validate_json((path / ENV_MARKER).read_bytes())
    except (OSError, ValueError):
        return None
    if info.key != key or not (path / "bin" / "python").exists():
        return None
    return info


def ensure_env(row: ToolchainRow, envs_dir: Path, *, torch_spec: str,
               runtime: Sequence[str] | None = None) -> Env:
    """The environment of ``row``: reused when complete, else built from the registry.

    Built in place under a per-key file lock: a virtualenv of this interpreter, ``torch_spec``
    first, then the pins (wheels only) with ``torch`` held by a constraint, then ``runtime``.
    The pinned versions are checked in the result, and ``compat-env.json`` is written last.
    Raises :class:`CompatError` with pip's last lines when an install fails.
    """
    from filelock import FileLock

    runtime = tuple(runtime if runtime is not None else runtime_requirements())
    key = env_key(row, torch_spec, runtime)
    envs_dir = Path(envs_dir).absolute()
    envs_dir.mkdir(parents=True, exist_ok=True)
    ignore = envs_dir / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# virtualenvs built by `dsa-aot compat`; never committed\n*\n")
    path = envs_dir / key
    start = time.perf_counter()
    with FileLock(str(envs_dir / f".{key}.lock"), timeout=ENV_TIMEOUT_S):
        info = _read_env(path, key)
        if info is not None:
            return Env(path=path, info=info, reused=True, seconds=time.perf_counter() - start)
        if path.exists():
            shutil.rmtree(path)
        log = path / "logs" / "env.log"
        _log(f"{row.name}: building environment {path} ({', '.join(row.pins)})")
        step = _run([sys.executable, "-m", "venv", str(path)], log=log, timeout_s=600, env=_pip_env())
        if step.returncode != 0:
            raise CompatError(f"{row.name}: python -m venv failed: {_tail(step.stderr or step.stdout, 5)}")
        constraints = path / "compat-constraints.txt"
        constraints.write_text(torch_spec + "\n")  # nothing after the first step may move torch
        pip = [str(path / "bin" / "python"), "-m", "pip", "install", "--no-input", "--only-binary=:all:"]
        steps = [("torch", pip + [torch_spec]),
                 ("pins", pip + ["-c", str(constraints), *row.pins]),
                 ("runtime", pip + ["-c", str(constraints), *runtime])]
        for what, argv in steps:
            done = _run(argv, log=log, timeout_s=ENV_TIMEOUT_S, env=_pip_env())
            if done.returncode != 0:
                raise CompatError(f"{row.name}: pip install ({what}) failed, see {log}: "
                                  f"{_tail(done.stderr or done.stdout, 3)}")
        installed = _installed(path, log)
        wrong = {n: (v, installed.get(n)) for n, v in row.pinned().items() if installed.get(n) != v}
        if wrong:
            raise CompatError(f"{row.name}: installed versions differ from the pins: "
                              + ", ".join(f"{n} {got} (pinned {want})" for n, (want, got) in wrong.items()))
        info = EnvInfo(key=key, name=row.name, pins=row.pins, torch=torch_spec,
                       python=platform.python_version(), created=_now(),
                       build_seconds=round(time.perf_counter() - start, 1), installed=installed)
        tmp = path / f".{ENV_MARKER}.tmp"
        tmp.write_text(info.model_dump_json(indent=1))
        os.replace(tmp, path / ENV_MARKER)
    _log(f"{row.name}: environment ready in {info.build_seconds:.0f} s")
    return Env(path=path, info=info, reused=False, seconds=info.build_seconds)


def _installed(path: Path, log: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: d.version "
            "for d in m.distributions()}))")
    done = _run([path / "bin" / "python", "-c", code], log=log, timeout_s=120, env=_pip_env())
    if done.returncode != 0:
        raise CompatError(f"cannot list the packages of {path}: {_tail(done.stderr, 3)}")
    return {_normalize(k): v for k, v in sorted(json.loads(done.stdout.strip().splitlines()[-1]).items())}


def env_path(row: ToolchainRow, envs_dir: Path, torch_spec: str = "torch==2.13.0") -> Path | None:
    """The complete environment of ``row`` under ``envs_dir`` if one was built, else None."""
    key = env_key(row, torch_spec, runtime_requirements())
    path = Path(envs_dir).absolute() / key
    return path if _read_env(path, key) is not None else None


# --- this checkout on a toolchain's PYTHONPATH ---------------------------------------------------

def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise CompatError(f"cannot locate the {module} package")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def project_pythonpath(dest: Path) -> Path:
    """A directory that makes ``import dsa_aot`` load this checkout, for another interpreter.

    The editable install maps ``aot/``, ``kernels/``, ``specs/`` and ``cache/`` to one package;
    here that mapping is rebuilt from symlinks (``dest/dsa_aot/*``), so a cached environment
    never bakes in the path of the checkout that built it.
    """
    dest = Path(dest)
    pkg = dest / "dsa_aot"
    if pkg.is_symlink():
        pkg.unlink()
    elif pkg.exists():
        shutil.rmtree(pkg)
    dest.mkdir(parents=True, exist_ok=True)
    root = _package_dir("dsa_aot")
    subs = {name: _package_dir(f"dsa_aot.{name}") for name in ("kernels", "specs", "cache")}
    if all(p.parent == root for p in subs.values()):  # a regular install: one tree
        pkg.symlink_to(root, target_is_directory=True)
        return dest
    pkg.mkdir()
    for child in root.iterdir():
        if child.name != "__pycache__" and child.name not in subs:
            (pkg / child.name).symlink_to(child)
    for name, path in subs.items():
        (pkg / name).symlink_to(path, target_is_directory=True)
    return dest


def toolchain_environ(env: Env, pythonpath: Path, cache_dir: Path) -> dict[str, str]:
    """The environment variables a toolchain's processes run with."""
    out = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    out.update(PYTHONPATH=str(pythonpath), VIRTUAL_ENV=str(env.path), DSA_AOT_CACHE_DIR=str(cache_dir),
               TILELANG_CACHE_DIR=str(env.path / "tilelang-cache"), TILELANG_PRINT_ON_COMPILATION="0",
               PATH=f"{env.path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    return out


# --- the report --------------------------------------------------------------------------------

class Cell(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    status: CellStatus
    detail: str = ""
    loader_uses: str | None = Field(None, description="when not built: the backend the loader's "
                                    "ranking falls back to for this call shape, or 'reference'")


class ToolchainResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    note: str = ""
    required: bool = False
    pins: tuple[str, ...]
    env_key: str | None = None
    env_reused: bool | None = None
    installed: dict[str, str] = Field(default_factory=dict, description="compiler-set versions found")
    fingerprint: str | None = None
    same_as_running: bool | None = Field(None, description="fingerprint equals the toolchain of the "
                                         "process that ran the matrix (a reproducible key)")
    probes: dict[str, Any] | None = None
    probe_errors: dict[str, str] = Field(default_factory=dict)
    expect_mismatches: list[str] = Field(default_factory=list)
    prebuild_exit: int | None = None
    counts: dict[str, int] = Field(default_factory=dict)
    seconds: dict[str, float] = Field(default_factory=dict, description="env / probes / prebuild")
    error: str | None = None


class SpecRow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    results: dict[str, Cell] = Field(default_factory=dict, description="toolchain name -> cell")


class CompatReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    generated: str
    matrix: dict[str, Any]
    machine: dict[str, Any]
    toolchains: list[ToolchainResult]
    specs: list[SpecRow]
    wall_seconds: float = 0.0
    problems: list[str] = Field(default_factory=list,
                                description="what makes `dsa-aot compat` exit 1")

    def cell(self, spec_id: str, toolchain: str) -> Cell | None:
        for row in self.specs:
            if row.id == spec_id:
                return row.results.get(toolchain)
        return None


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def machine_info() -> dict[str, Any]:
    """What the report ran on: OS, CPU, memory, Python, nvcc, GPUs (no host name)."""
    from dsa_aot.prebuild import detect_gpu_archs
    from dsa_aot.specs.toolchain import resolve_nvcc

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        kib = int(next(ln for ln in Path("/proc/meminfo").read_text().splitlines()
                       if ln.startswith("MemTotal")).split()[1])
        mem_gib = round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    nvcc = resolve_nvcc()
    nvcc_version = None
    if nvcc is not None and nvcc.exists():
        from dsa_aot.specs.toolchain import nvcc_version as _nvcc_version

        nvcc_version = _nvcc_version(nvcc)[0]
    return {"os": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(), "memory_gib": mem_gib,
            "python": platform.python_version(), "nvcc": str(nvcc) if nvcc else None,
            "nvcc_version": nvcc_version, "gpu_archs": detect_gpu_archs()}


def check_expectations(expect: dict[str, Any], probes: dict[str, Any] | None,
                       archs: Sequence[str]) -> list[str]:
    """Human-readable differences between a row's ``expect`` and what its probes measured."""
    if probes is None:
        return ["probes did not run"] if expect else []
    out = []
    for field, want in sorted(expect.items()):
        got = probes.get(field)
        if isinstance(want, dict):
            for arch, value in sorted(want.items()):
                if arch in archs and (got or {}).get(arch) != value:
                    out.append(f"{field}[{arch}]: expected {value}, measured {(got or {}).get(arch)}")
        elif got != want:
            out.append(f"{field}: expected {want}, measured {got}")
    return out


# --- running one toolchain ---------------------------------------------------------------------

_PROBE_CODE = """
import json, sys
from pathlib import Path
from dsa_aot.specs.probes import load_or_probe
from dsa_aot.specs.toolchain import Toolchain
cache, archs = Path(sys.argv[1]), sys.argv[2].split(",")
tc = Toolchain.current()
features = load_or_probe(cache / tc.fingerprint / "features.json", archs, toolchain=tc)
print("DSA_AOT_COMPAT " + json.dumps({"fingerprint": tc.fingerprint, "complete": tc.complete,
      "incomplete": list(tc.incomplete_reasons), "features": features.model_dump(mode="json")}))
"""


def _marked_json(stdout: str, mark: str = "DSA_AOT_COMPAT ") -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(mark):
            try:
                return json.loads(line[len(mark):])
            except ValueError:
                return None
    return None


def parse_prebuild_output(stdout: str) -> tuple[str | None, dict[str, tuple[str, str]]]:
    """``(fingerprint, {spec id: (status, message)})`` from ``dsa-aot prebuild``'s summary table."""
    fingerprint = None
    problems: dict[str, tuple[str, str]] = {}
    for line in stdout.splitlines():
        m = _FINGERPRINT_LINE.match(line)
        if m and fingerprint is None:
            fingerprint = m.group(1)
            continue
        m = _PROBLEM_LINE.match(line)
        if m:
            problems[m.group(1)] = (m.group(2), m.group(3).strip())
    return fingerprint, problems


def run_toolchain(row: ToolchainRow, env: Env, spec_ids: dict[str, KernelSpec], *, archs: Sequence[str],
                  only: Sequence[str], jobs: int, pythonpath: Path) -> tuple[ToolchainResult, dict[str, Cell]]:
    """Probes, then ``dsa-aot prebuild`` of ``spec_ids`` (id -> spec), inside ``env``.

    Never raises for a compiler problem: each spec becomes a cell. "built" means an entry
    exists under the fingerprint prebuild printed (built now, or by an earlier run).
    """
    result = ToolchainResult(name=row.name, note=row.note, required=row.required, pins=row.pins,
                             env_key=env.info.key, env_reused=env.reused,
                             installed={n: v for n, v in env.info.installed.items()
                                        if n in row.pinned() or n.startswith(("nvidia-cutlass-dsl", "torch"))},
                             seconds={"env": round(env.seconds, 1)})
    cache = env.path / "dsa-aot-cache"
    logs = env.path / "logs"
    for name in ("probes.log", "prebuild.log"):  # this run's output only
        (logs / name).unlink(missing_ok=True)
    environ = toolchain_environ(env, pythonpath, cache)
    py = str(env.python)

    start = time.perf_counter()
    probe = _run([py, "-c", _PROBE_CODE, str(cache), ",".join(archs)], log=logs / "probes.log",
                 timeout_s=PROBE_TIMEOUT_S, env=environ, cwd=env.path)
    result.seconds["probes"] = round(time.perf_counter() - start, 1)
    data = _marked_json(probe.stdout)
    if data is None:
        result.error = f"probes did not run: {_tail(probe.stderr or probe.stdout, 3)}"
    else:
        result.fingerprint = data["fingerprint"]
        features = dict(data["features"])
        result.probe_errors = {k: _tail(v, 3)[:500] for k, v in features.pop("errors", {}).items()}
        features.pop("toolchain", None)
        result.probes = features
        if not data["complete"]:
            result.error = "toolchain fingerprint incomplete: " + "; ".join(data["incomplete"])
    result.expect_mismatches = check_expectations(row.expect, result.probes, archs)
    _log(f"{row.name}: probes in {result.seconds['probes']:.0f} s, fingerprint {result.fingerprint}")

    cells: dict[str, Cell] = {}
    if not spec_ids:
        return result, cells
    argv = [py, "-m", "dsa_aot.cli", "prebuild", "-q", "--cache-dir", str(cache), "--jobs", str(jobs)]
    argv += [a for arch in archs for a in ("--arch", arch)]
    argv += [a for pat in only for a in ("--only", pat)]  # none: the whole catalog
    start = time.perf_counter()
    _log(f"{row.name}: prebuild of {len(spec_ids)} specs (--jobs {jobs})")
    pre = _run(argv, log=logs / "prebuild.log", timeout_s=PREBUILD_TIMEOUT_S, env=environ, cwd=env.path)
    result.seconds["prebuild"] = round(time.perf_counter() - start, 1)
    result.prebuild_exit = pre.returncode
    fingerprint, problems = parse_prebuild_output(pre.stdout)
    if fingerprint and result.fingerprint and fingerprint != result.fingerprint:
        result.error = f"prebuild keyed {fingerprint}, probes {result.fingerprint}: sources changed mid-run"
    if pre.returncode not in (0, 1):
        why = _tail(pre.stderr or pre.stdout, 1) or f"exit {pre.returncode}"
        return result, {s: Cell(status="failed", detail=f"prebuild did not run: {why}") for s in spec_ids}
    from dsa_aot.cache.store import ArtifactStore

    store = ArtifactStore(cache, read_only=True)  # entries under the key prebuild printed
    for spec_id, spec in spec_ids.items():
        if spec_id in problems:
            kind, message = problems[spec_id]
            if message.startswith(spec_id):  # "<id> stage fwd: ...": the row names the spec
                message = message[len(spec_id):].lstrip(" :")
            cells[spec_id] = Cell(status=kind, detail=message)  # type: ignore[arg-type]
        elif fingerprint and store.lookup(fingerprint, spec.arch, spec_id) is not None:
            cells[spec_id] = Cell(status="built")
        else:
            cells[spec_id] = Cell(status="failed", detail=f"no artifact and no reason (see {logs / 'prebuild.log'})")
    if fingerprint:  # keep this key's artifacts for the next run, drop older keys'
        ArtifactStore(cache).gc(fingerprint)
    for kind in ("built", "skipped-by-feature", "failed"):
        result.counts[kind] = sum(c.status == kind for c in cells.values())
    _log(f"{row.name}: prebuild in {result.seconds['prebuild']:.0f} s: "
         + ", ".join(f"{n} {k}" for k, n in result.counts.items()))
    return result, cells


def plan_specs(archs: Sequence[str], only: Sequence[str]) -> dict[str, KernelSpec]:
    """Spec id -> spec for this checkout's catalog, selected by ``archs`` and ``only``."""
    from dsa_aot import registry
    from dsa_aot.specs.catalog import load_catalog, select

    specs = load_catalog().specs(implemented=registry.implemented())
    return {s.id: s for s in select(specs, archs=list(archs), only=list(only) or None)}


def _mark_fallbacks(report: CompatReport, specs: dict[str, KernelSpec]) -> None:
    """For each cell not built: what the loader would serve that call shape with instead.

    The loader tries the catalog's ranking for the op in order and ends at the torch
    reference; only the specs in this report count as available.
    """
    from dsa_aot.specs.catalog import load_catalog

    ranking = load_catalog().ranking
    shapes: dict[tuple, dict[str, str]] = {}
    for spec in specs.values():
        shape = (spec.op, spec.arch, spec.d_qk, spec.heads, spec.layout, spec.tile)
        shapes.setdefault(shape, {})[spec.backend] = spec.id
    rows = {r.id: r for r in report.specs}
    for row in report.specs:
        spec = specs[row.id]
        same_shape = shapes[(spec.op, spec.arch, spec.d_qk, spec.heads, spec.layout, spec.tile)]
        for name, cell in list(row.results.items()):
            if cell.status == "built":
                continue
            served = next((b for b in ranking.get(spec.op, []) if b in same_shape
                           and getattr(rows[same_shape[b]].results.get(name), "status", None) == "built"),
                          "reference")
            row.results[name] = cell.model_copy(update={"loader_uses": served})


def run_compat(matrix_path: Path | None = None, *, envs_dir: Path = DEFAULT_ENVS_DIR,
               slice_name: str | None = None, toolchains: Sequence[str] | None = None,
               shard: tuple[int, int] | None = None, only: Sequence[str] | None = None,
               jobs: int | None = None) -> CompatReport:
    """Build/reuse every selected toolchain's environment, probe and prebuild in it, report."""
    start = time.perf_counter()
    path = Path(matrix_path) if matrix_path is not None else default_matrix_path()
    matrix = load_matrix(path)
    rows = select_toolchains(matrix, slice_name=slice_name, names=toolchains, shard=shard)
    if not rows:
        raise CompatError("no toolchain selected (empty shard?)")
    globs = tuple(only) if only else (matrix.slices[slice_name].only if slice_name and
                                      matrix.slices[slice_name].only else matrix.only)
    spec_ids = plan_specs(matrix.archs, globs)
    jobs = jobs or matrix.jobs or os.cpu_count() or 1
    runtime = runtime_requirements()
    report = CompatReport(
        generated=_now(), machine=machine_info(), toolchains=[], specs=[SpecRow(id=s) for s in spec_ids],
        matrix={"path": _display_path(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "archs": list(matrix.archs), "only": list(globs), "slice": slice_name,
                "shard": f"{shard[0]}/{shard[1]}" if shard else None, "torch": matrix.torch,
                "toolchains": [r.name for r in rows], "jobs": jobs})
    by_id = {r.id: r for r in report.specs}
    from dsa_aot.specs.toolchain import Toolchain

    running = Toolchain.current().fingerprint
    workdir = Path(tempfile.mkdtemp(prefix="dsa-aot-compat-"))
    try:
        pythonpath = project_pythonpath(workdir / "path")
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as builder:
            pending = [builder.submit(ensure_env, r, Path(envs_dir), torch_spec=matrix.torch, runtime=runtime)
                       for r in rows]  # one pip at a time, ahead of the compilers
            for row, future in zip(rows, pending):
                try:
                    env = future.result()
                except (CompatError, OSError, subprocess.SubprocessError) as exc:
                    result = ToolchainResult(name=row.name, note=row.note, required=row.required,
                                             pins=row.pins, error=f"environment: {exc}")
                    report.toolchains.append(result)
                    for spec in report.specs:
                        spec.results[row.name] = Cell(status="not-run", detail="environment could not be built")
                    report.problems.append(f"{row.name}: {result.error}")
                    _log(f"{row.name}: {result.error}")
                    continue
                result, cells = run_toolchain(row, env, spec_ids, archs=matrix.archs, only=globs,
                                              jobs=jobs, pythonpath=pythonpath)
                result.same_as_running = result.fingerprint == running if result.fingerprint else None
                report.toolchains.append(result)
                for spec_id, cell in cells.items():
                    by_id[spec_id].results[row.name] = cell
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    _mark_fallbacks(report, spec_ids)
    report.problems += _problems(report)
    report.wall_seconds = round(time.perf_counter() - start, 1)
    return report


def _problems(report: CompatReport) -> list[str]:
    out = []
    for t in report.toolchains:
        out += [f"{t.name}: probe {m}" for m in t.expect_mismatches]
        if t.required and t.counts.get("failed"):
            out.append(f"{t.name}: {t.counts['failed']} spec(s) failed under the shipped pins")
        if t.error and not t.error.startswith("environment"):  # those are listed already
            out.append(f"{t.name}: {t.error}")
    seen: dict[str, str] = {}
    for t in report.toolchains:
        if t.fingerprint and t.fingerprint in seen:
            out.append(f"{t.name} and {seen[t.fingerprint]} share fingerprint {t.fingerprint}: "
                       "their artifacts would be confused")
        elif t.fingerprint:
            seen[t.fingerprint] = t.name
    return out


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def merge_reports(paths: Iterable[Path]) -> CompatReport:
    """One report from the per-shard reports of one matrix (columns in shard order)."""
    reports = [CompatReport.model_validate_json(Path(p).read_bytes()) for p in paths]
    if not reports:
        raise CompatError("nothing to merge")
    if len({r.matrix["sha256"] for r in reports}) != 1:
        raise CompatError("the reports come from different matrix files")
    merged = reports[0].model_copy(deep=True)
    merged.matrix = dict(merged.matrix, shard=None,
                         toolchains=[t for r in reports for t in r.matrix["toolchains"]])
    merged.toolchains = [t for r in reports for t in r.toolchains]
    rows: dict[str, SpecRow] = {}
    for r in reports:
        for row in r.specs:
            rows.setdefault(row.id, SpecRow(id=row.id)).results.update(row.results)
    merged.specs = list(rows.values())
    merged.problems = [p for r in reports for p in r.problems]
    merged.wall_seconds = round(sum(r.wall_seconds for r in reports), 1)
    merged.generated = max(r.generated for r in reports)
    return merged


# --- rendering ---------------------------------------------------------------------------------

def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    return str(value)


def render_markdown(report: CompatReport) -> str:
    """``docs/compat.md``: toolchains, probes, and the spec x toolchain table with footnotes."""
    names = [t.name for t in report.toolchains]
    m, mach = report.matrix, report.machine
    lines = [
        "# Toolchain compatibility",
        "",
        f"Generated by `dsa-aot compat` on {report.generated} in {report.wall_seconds / 60:.1f} min "
        f"from `{m['path']}` (sha256 `{m['sha256'][:12]}`)"
        + (f", slice `{m['slice']}`" if m.get("slice") else "")
        + (f", shard {m['shard']}" if m.get("shard") else "") + ".",
        f"Archs {', '.join(m['archs'])}; specs: "
        + (", ".join(f"`{g}`" for g in m["only"]) if m["only"] else "the whole catalog")
        + f" ({len(report.specs)}); `{m['torch']}` in every environment; prebuild `--jobs {m['jobs']}`.",
        f"Machine: {mach.get('os')}; {mach.get('cpu')} x {mach.get('cpus')}; "
        f"{mach.get('memory_gib')} GiB; Python {mach.get('python')}; nvcc {mach.get('nvcc_version')} "
        f"(`{mach.get('nvcc')}`); GPUs: {', '.join(mach.get('gpu_archs') or []) or 'none (compile only)'}.",
        "Every toolchain has its own fingerprint, so the artifacts of one are never found under another.",
        "",
        "Regenerate with `make compat` (or `dsa-aot compat --help`). A cell says what "
        "`dsa-aot prebuild` did for the spec under that toolchain: **built**, **skipped** (a probed "
        "feature is missing) or **failed** (first compiler error line in the notes); after the "
        "arrow, what the loader serves that call shape with instead (the next backend of the "
        "catalog's ranking that built, else the torch reference).",
        "",
    ]
    if report.problems:
        lines += ["## Problems", ""] + [f"- {p}" for p in report.problems] + [""]
    lines += ["## Toolchains", "",
              "| toolchain | pins | fingerprint | built | skipped | failed | env / probes / prebuild (s) |",
              "|---|---|---|---|---|---|---|"]
    for t in report.toolchains:
        secs = " / ".join(f"{t.seconds[k]:.0f}" if k in t.seconds else "-" for k in ("env", "probes", "prebuild"))
        reused = " (env reused)" if t.env_reused else ""
        pins = "<br>".join(p.replace("==", " ") for p in t.pins)
        title = f"**{t.name}**" + (" (shipped)" if t.required else "") + (f"<br>{t.note}" if t.note else "")
        same = "<br>(= the running env)" if t.same_as_running else ""
        lines.append(f"| {title} | {pins} | `{t.fingerprint or '-'}`{same} | {t.counts.get('built', 0)} | "
                     f"{t.counts.get('skipped-by-feature', 0)} | {t.counts.get('failed', 0)} | {secs}{reused} |")
    errors = [(t.name, t.error) for t in report.toolchains if t.error]
    if errors:
        lines += [""] + [f"- {n}: {e}" for n, e in errors]

    lines += ["", "## Probes", "", "| probe | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    probe_rows: list[tuple[str, Any]] = [("TileLang imports", ("tilelang_importable", None)),
                                         ("CuTe DSL imports", ("cutlass_dsl_importable", None)),
                                         ("`cute.math.isfinite`", ("cute_math_isfinite", None))]
    probe_rows += [(f"bool fragment (boolx8) {a}", ("tilelang_bool_fragment_ok", a)) for a in m["archs"]]
    probe_rows += [(f"nvcc builds {a}", ("nvcc_archs", a)) for a in m["archs"]]
    probe_rows += [("nvcc version", ("nvcc_version", None))]
    for title, (field, arch) in probe_rows:
        cells = []
        for t in report.toolchains:
            value = None if t.probes is None else t.probes.get(field)
            value = (value or {}).get(arch) if arch else value
            cells.append(_fmt(value))
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    mismatches = [f"- **{t.name}: {m} (the matrix's `expect` is out of date, or the release changed)**"
                  for t in report.toolchains for m in t.expect_mismatches]
    if mismatches:
        lines += [""] + mismatches
    probe_notes = [(t.name, k, v) for t in report.toolchains for k, v in t.probe_errors.items()
                   if not k.startswith("tilelang_bool_fragment_ok") or "boolx8" not in v]
    bool_notes = sorted({t.name for t in report.toolchains
                         for k, v in t.probe_errors.items() if "boolx8" in v})
    if bool_notes:
        lines += ["", "bool fragment **no** = \"Cannot convert type boolx8 to CUDA type\" "
                  f"({', '.join(bool_notes)}); our kernels keep masks in int32 fragments, so no "
                  "spec depends on it."]
    for name, key, text in probe_notes:
        lines.append(f"- {name} `{key}`: {text.splitlines()[-1][:300] if text else ''}")

    notes: dict[str, int] = {}
    lines += ["", "## Specs", "", "| spec | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for row in report.specs:
        cells = []
        for name in names:
            cell = row.results.get(name)
            if cell is None:
                cells.append("-")
                continue
            label = {"built": "built", "skipped-by-feature": "skipped", "failed": "**failed**",
                     "not-run": "not run"}[cell.status]
            if cell.detail:
                ref = notes.setdefault(cell.detail, len(notes) + 1)
                label += f" [{ref}]"
            if cell.loader_uses:
                label += f" → {cell.loader_uses}"
            cells.append(label)
        lines.append(f"| `{row.id}` | " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "### Notes", ""]
        lines += [f"{n}. {text.replace('|', '/')}" for text, n in notes.items()]
    return "\n".join(lines) + "\n"


def write_report(report: CompatReport, out: Path) -> tuple[Path, Path]:
    """Write ``<out>.json`` and ``<out>.md`` atomically; returns both paths."""
    from dsa_aot.specs.probes import write_atomic

    out = Path(out)
    json_path, md_path = out.with_name(out.name + ".json"), out.with_name(out.name + ".md")
    write_atomic(json_path, (report.model_dump_json(indent=1) + "\n").encode())
    write_atomic(md_path, render_markdown(report).encode())
    return json_path, md_path


def format_summary(report: CompatReport) -> str:
    """A few lines for the terminal."""
    lines = []
    for t in report.toolchains:
        lines.append(f"  {t.name:<24} {t.fingerprint or '-':<17} built {t.counts.get('built', 0):>3}  "
                     f"skipped {t.counts.get('skipped-by-feature', 0):>3}  failed {t.counts.get('failed', 0):>3}"
                     + (f"  ({t.error})" if t.error else ""))
    lines += [f"  problem: {p}" for p in report.problems]
    lines.append(f"  {len(report.specs)} specs x {len(report.toolchains)} toolchains in {report.wall_seconds:.0f} s")
    return "\n".join(lines)
