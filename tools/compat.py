#!/usr/bin/env python3
"""What still compiles, and what falls back, under other toolchains (``make compat``).

Developer tooling, not part of the installed package. For each toolchain of a matrix file
(``specs/compat_matrix.toml``; every row pins the whole compiler set), a virtualenv is built
from the registry under ``--envs-dir`` (``torch`` first, then the pins, then our runtime
dependencies), keyed by a hash of that set and reused by later runs. Inside it, with this
checkout on ``PYTHONPATH``, the product is driven through its command line only:
``dsa-aot doctor --probes`` (fingerprint, feature probes), ``dsa-aot prebuild --json`` (the
selected specs, into a cache of that environment's own) and ``dsa-aot gc``. The specs come from
``dsa-aot list --json`` of this checkout. The result is one report, ``<out>.json`` and
``<out>.md``: a row per spec and a column per toolchain (built / skipped-by-feature and why /
failed and the first compiler error line), the probes per toolchain, the date, the matrix and
the machine.

The next environment is built while the current one compiles (one pip process beside the
compilers, mostly download and unpack). This module imports nothing of ``dsa_aot``: what it
needs to know comes from the checkout's files (``pyproject.toml``, the catalog's ``[ranking]``)
and from the command line's JSON.

    python tools/compat.py [--slice ci] [--toolchain GLOB] [--only GLOB] [--shard i/n] [--jobs N]
    python tools/compat.py --merge shard1.json shard2.json --out docs/compat
"""

from __future__ import annotations

import argparse
import ast
import atexit
import concurrent.futures
import datetime as _dt
import fnmatch
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

REPO = Path(__file__).resolve().parents[1]
SCHEMA_VERSION = 1
ENV_FORMAT = 1
ENV_MARKER = "compat-env.json"
DEFAULT_MATRIX = REPO / "specs" / "compat_matrix.toml"
DEFAULT_ENVS_DIR = Path(".compat-envs")
DEFAULT_OUT = Path("docs/compat")
ENV_TIMEOUT_S = 3600.0
PROBE_TIMEOUT_S = 1800.0
PREBUILD_TIMEOUT_S = 4 * 3600.0
CLI_TIMEOUT_S = 600.0

#: Variables that must not leak from this process into a toolchain's processes: an imported
#: TileLang exports the first four (pointing into *our* tilelang), CuTe DSL reads the arch once.
_SCRUBBED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TL_TEMPLATE_PATH", "TL_CUTLASS_PATH",
                 "TVM_LIBRARY_PATH", "TVM_IMPORT_PYTHON_PATH", "CUTE_DSL_ARCH", "DSA_AOT_PREBUILT_DIR",
                 "DSA_AOT_REQUIRE_PREBUILT", "DSA_AOT_ARCH_LIST", "PIP_CONSTRAINT")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)$")
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
#: The probe results a row's ``expect`` may name (the result fields of ``dsa-aot doctor --probes``).
PROBE_FIELDS = ("tilelang_importable", "cutlass_dsl_importable", "cute_math_isfinite",
                "tilelang_bool_fragment_ok", "nvcc_version", "nvcc_archs")

CellStatus = Literal["built", "skipped-by-feature", "failed", "not-run", "not-selected"]


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
    only: tuple[str, ...] = Field((), description="spec-id globs narrowing the matrix's selection for this "
                                  "row (e.g. the cudnn specs for a frontend-only row); the others are "
                                  "not selected in its column")

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
        unknown = set(expect) - set(PROBE_FIELDS)
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
    archs: tuple[Literal["sm_90a", "sm_100a"], ...] = ("sm_90a", "sm_100a")
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


def load_matrix(path: Path | str | None = None) -> CompatMatrix:
    """Parse and validate a matrix file (this checkout's ``specs/compat_matrix.toml`` by default)."""
    path = Path(path) if path is not None else DEFAULT_MATRIX
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


# --- processes ---------------------------------------------------------------------------------

def _log(message: str) -> None:
    print(f"[compat] {message}", file=sys.stderr, flush=True)


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run(argv: Sequence[str | Path], *, log: Path, timeout_s: float, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run argv in a session of its own, appending its output to ``log``.

    A timeout kills the whole process group (compilers included) and reads as exit 124.
    """
    args = [str(a) for a in argv]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as fh:
        fh.write(f"$ {' '.join(args)}\n")
        fh.flush()
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=None if cwd is None else str(cwd), stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
            fh.write(out + err + f"\n[timed out after {timeout_s:g} s]\n")
            return subprocess.CompletedProcess(args, 124, out, err + f"\ntimed out after {timeout_s:g} s")
        fh.write(out + err + f"[exit {proc.returncode}]\n")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _json_document(stdout: str) -> Any:
    """The JSON document a CLI command printed on stdout (None when there is none)."""
    try:
        return json.loads(stdout)
    except ValueError:
        pass
    lines = stdout.splitlines()
    for k, line in enumerate(lines):  # tolerate stray lines before the document
        if line.startswith(("{", "[")):
            try:
                return json.loads("\n".join(lines[k:]))
            except ValueError:
                continue
    return None


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp.{os.getpid()}.{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --- this checkout on an interpreter's PYTHONPATH -----------------------------------------------

def _package_dirs(repo: Path = REPO) -> dict[str, Path]:
    """Package -> directory of the checkout: ``[tool.setuptools] package-dir`` of its
    ``pyproject.toml``, else the literal ``{"dsa_aot": "aot", ...}`` mapping its ``setup.py``
    passes to setuptools (read, never run)."""
    data = tomllib.loads((repo / "pyproject.toml").read_text())
    mapping = data.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    setup_py = repo / "setup.py"
    if "dsa_aot" not in mapping and setup_py.is_file():
        for node in ast.walk(ast.parse(setup_py.read_text(), str(setup_py))):
            if isinstance(node, ast.Dict):
                try:
                    value = ast.literal_eval(node)
                except (ValueError, TypeError):
                    continue
                if isinstance(value.get("dsa_aot"), str):
                    mapping = value
                    break
    if "dsa_aot" not in mapping:
        raise CompatError(f"cannot tell where the dsa_aot package lives in {repo} "
                          "(no package-dir in pyproject.toml or setup.py)")
    return {name: (repo / rel).resolve() for name, rel in mapping.items()}


def project_pythonpath(dest: Path, repo: Path = REPO) -> Path:
    """A directory that makes ``import dsa_aot`` load this checkout, for another interpreter.

    The wheel maps ``aot/``, ``kernels/``, ``specs/`` and ``cache/`` to one package; here that
    mapping (see :func:`_package_dirs`) is rebuilt from symlinks (``dest/dsa_aot/*``), so a
    cached environment never bakes in the path of the checkout that built it.
    """
    dest = Path(dest)
    pkg = dest / "dsa_aot"
    if pkg.is_symlink():
        pkg.unlink()
    elif pkg.exists():
        shutil.rmtree(pkg)
    pkg.mkdir(parents=True)
    dirs = _package_dirs(repo)
    root = dirs.pop("dsa_aot")
    subs = {name.split(".", 1)[1]: path for name, path in dirs.items() if name.count(".") == 1}
    for child in root.iterdir():
        if child.name != "__pycache__" and child.name not in subs:
            (pkg / child.name).symlink_to(child)
    for name, path in subs.items():
        (pkg / name).symlink_to(path, target_is_directory=True)
    return dest


_HOST_PATH: Path | None = None


def host_environ(pythonpath: Path | None = None) -> dict[str, str]:
    """Variables for this interpreter's own CLI calls, with this checkout on ``PYTHONPATH``."""
    global _HOST_PATH
    if pythonpath is None:
        if _HOST_PATH is None:
            tmp = Path(tempfile.mkdtemp(prefix="dsa-aot-compat-host-"))
            atexit.register(shutil.rmtree, tmp, True)
            _HOST_PATH = project_pythonpath(tmp / "path")
        pythonpath = _HOST_PATH
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env.update(PYTHONPATH=str(pythonpath), TILELANG_PRINT_ON_COMPILATION="0")
    return env


def cli(python: str | Path, args: Sequence[str | Path], *, environ: dict[str, str], log: Path,
        timeout_s: float = CLI_TIMEOUT_S, cwd: Path | None = None) -> tuple[subprocess.CompletedProcess, Any]:
    """``dsa-aot ARGS`` under ``python``; returns the process and the JSON it printed (or None)."""
    proc = _run([python, "-m", "dsa_aot.cli", *args], log=log, timeout_s=timeout_s, env=environ, cwd=cwd)
    return proc, _json_document(proc.stdout)


# --- environments ------------------------------------------------------------------------------

def _requirement(req: str) -> str:
    """``name<spec>`` with the comparison clauses sorted and no spaces (the metadata's form)."""
    req = req.split(";", 1)[0].replace(" ", "")
    match = _REQ_NAME.match(req)
    if match is None:
        return req
    name, spec = match.group(1), req[match.end():]
    return name + ",".join(sorted(s for s in spec.split(",") if s))


def runtime_requirements(repo: Path = REPO) -> tuple[str, ...]:
    """Our own run-time dependencies (``[project] dependencies`` of the checkout), torch excepted."""
    data = tomllib.loads((repo / "pyproject.toml").read_text())
    out = []
    for req in data.get("project", {}).get("dependencies", []):
        spec, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        match = _REQ_NAME.match(spec)
        if match is not None and _normalize(match.group(1)) != "torch":
            out.append(_requirement(spec))
    return tuple(sorted(out))


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
        ignore.write_text("# virtualenvs built by tools/compat.py; never committed\n*\n")
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


def load_env(path: Path) -> Env:
    """An environment built earlier, from its ``compat-env.json``."""
    return Env(path=Path(path), info=EnvInfo.model_validate_json((Path(path) / ENV_MARKER).read_bytes()),
               reused=True)


def toolchain_environ(env: Env, pythonpath: Path, cache_dir: Path) -> dict[str, str]:
    """The environment variables a toolchain's processes run with."""
    out = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    out.update(PYTHONPATH=str(pythonpath), VIRTUAL_ENV=str(env.path), DSA_AOT_CACHE_DIR=str(cache_dir),
               TILELANG_CACHE_DIR=str(env.path / "tilelang-cache"), TILELANG_PRINT_ON_COMPILATION="0",
               PATH=f"{env.path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    return out


# --- what the CLI prints -------------------------------------------------------------------------

class PrebuiltSpec(BaseModel):
    """One row of ``dsa-aot prebuild --json``."""

    model_config = ConfigDict(extra="ignore")
    id: str
    status: Literal["built", "cached", "failed", "skipped-by-feature"]
    seconds: float = 0.0
    message: str = ""


class PrebuildResult(BaseModel):
    """``dsa-aot prebuild --json``: the key its entries went under, and one row per spec."""

    model_config = ConfigDict(extra="ignore")
    fingerprint: str
    root: str
    wall_seconds: float
    specs: list[PrebuiltSpec]


def parse_prebuild_json(stdout: str) -> PrebuildResult | None:
    """The summary ``dsa-aot prebuild --json`` printed, or None when it printed none."""
    data = _json_document(stdout)
    if not isinstance(data, dict):
        return None
    try:
        return PrebuildResult.model_validate(data)
    except ValidationError:
        return None


class ListedSpec(BaseModel):
    """One spec of ``dsa-aot list --json``: the fields that decide which call shape it serves."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    id: str
    op: str
    arch: str
    d_qk: int
    heads: int
    layout: str
    backend: str
    tile: dict[str, Any] = Field(default_factory=dict)

    @property
    def shape(self) -> tuple:
        """What the loader resolves per call: every field but the backend."""
        return (self.op, self.arch, self.d_qk, self.heads, self.layout, json.dumps(self.tile, sort_keys=True))


def plan_specs(archs: Sequence[str], only: Sequence[str], *, environ: dict[str, str] | None = None,
               log: Path | None = None) -> dict[str, ListedSpec]:
    """Spec id -> spec for this checkout's catalog (``dsa-aot list --json``), by ``archs`` and ``only``."""
    args: list[str] = ["list", "--json", *(a for arch in archs for a in ("--arch", arch)),
                       *(a for pat in only for a in ("--only", pat))]
    with tempfile.TemporaryDirectory(prefix="dsa-aot-compat-list-") as tmp:
        proc, data = cli(sys.executable, args, environ=environ or host_environ(),
                         log=log or Path(tmp) / "list.log")
    if proc.returncode != 0 or not isinstance(data, list):
        raise CompatError(f"dsa-aot list failed (exit {proc.returncode}): {_tail(proc.stderr or proc.stdout, 3)}")
    try:
        specs = [ListedSpec.model_validate(item) for item in data]
    except ValidationError as exc:
        raise CompatError(f"dsa-aot list --json printed an unexpected spec: {exc}") from None
    return {s.id: s for s in specs}


#: The loader's ranking for a catalog without a ``[ranking]`` table.
_DEFAULT_RANKING = {"fwd": ["tilelang"], "bwd": ["tilelang"]}


def loader_ranking(catalog: Path | None = None, environ: Mapping[str, str] | None = None) -> dict[str, list[str]]:
    """Backend order per op that the loader tries: ``DSA_AOT_BACKENDS`` if set, else the catalog's
    ``[ranking]`` (this checkout's ``specs/catalog.toml`` by default)."""
    environ = os.environ if environ is None else environ
    path = Path(catalog) if catalog is not None else _package_dirs()["dsa_aot.specs"] / "catalog.toml"
    table = tomllib.loads(path.read_text()).get("ranking", _DEFAULT_RANKING)
    ranking = {op: [str(b) for b in names] for op, names in table.items()}
    forced = environ.get("DSA_AOT_BACKENDS", "").replace(",", " ").split()
    if forced:  # replaces the ranking of every op (a backend without that op is skipped for it)
        return {op: list(dict.fromkeys(forced)) for op in ranking}
    return ranking


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
    problems: list[str] = Field(default_factory=list, description="what makes tools/compat.py exit 1")

    def cell(self, spec_id: str, toolchain: str) -> Cell | None:
        for row in self.specs:
            if row.id == spec_id:
                return row.results.get(toolchain)
        return None


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _nvcc_path() -> str | None:
    """The nvcc this machine offers (``DSA_AOT_NVCC``, ``CUDA_HOME``, ``PATH``), for the report."""
    for candidate in (os.environ.get("DSA_AOT_NVCC"),
                      *(str(Path(os.environ[v]) / "bin" / "nvcc") for v in ("CUDA_HOME", "CUDA_PATH")
                        if os.environ.get(v)),
                      shutil.which("nvcc")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def machine_info(doctor: Mapping[str, Any] | None) -> dict[str, Any]:
    """What the report ran on: OS, CPU, memory, Python, nvcc, GPUs (no host name).

    ``doctor`` is what this checkout's ``dsa-aot doctor`` printed (nvcc version, GPU archs).
    """
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
    doctor = doctor or {}
    return {"os": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(), "memory_gib": mem_gib,
            "python": platform.python_version(), "nvcc": _nvcc_path(),
            "nvcc_version": (doctor.get("toolchain") or {}).get("nvcc_version"),
            "gpu_archs": doctor.get("gpu_archs") or []}


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

def cells_from_prebuild(result: PrebuildResult, spec_ids: Iterable[str], log: Path) -> dict[str, Cell]:
    """One cell per spec from prebuild's JSON: built (now or earlier), skipped, failed."""
    rows = {r.id: r for r in result.specs}
    cells = {}
    for spec_id in spec_ids:
        row = rows.get(spec_id)
        if row is None:
            cells[spec_id] = Cell(status="failed", detail=f"not in prebuild's summary (see {log})")
        elif row.status in ("built", "cached"):
            cells[spec_id] = Cell(status="built")
        else:
            message = row.message
            if message.startswith(spec_id):  # "<id> stage fwd: ...": the row names the spec
                message = message[len(spec_id):].lstrip(" :")
            cells[spec_id] = Cell(status=row.status, detail=message or f"no reason given (see {log})")
    return cells


def run_toolchain(row: ToolchainRow, env: Env, spec_ids: Sequence[str], *, archs: Sequence[str],
                  only: Sequence[str], jobs: int, pythonpath: Path) -> tuple[ToolchainResult, dict[str, Cell]]:
    """``dsa-aot doctor --probes``, ``prebuild --json`` of ``spec_ids`` and ``gc``, inside ``env``.

    Never raises for a compiler problem: each spec becomes a cell.
    """
    result = ToolchainResult(name=row.name, note=row.note, required=row.required, pins=row.pins,
                             env_key=env.info.key, env_reused=env.reused,
                             installed={n: v for n, v in env.info.installed.items()
                                        if n in row.pinned() or n.startswith(("nvidia-cutlass-dsl", "torch"))},
                             seconds={"env": round(env.seconds, 1)})
    cache = env.path / "dsa-aot-cache"
    logs = env.path / "logs"
    for name in ("probes.log", "prebuild.log", "gc.log"):  # this run's output only
        (logs / name).unlink(missing_ok=True)
    environ = toolchain_environ(env, pythonpath, cache)
    py = env.python

    start = time.perf_counter()
    proc, doctor = cli(py, ["doctor", "--probes", "--cache-dir", cache], environ=environ,
                       log=logs / "probes.log", timeout_s=PROBE_TIMEOUT_S, cwd=env.path)
    result.seconds["probes"] = round(time.perf_counter() - start, 1)
    if proc.returncode != 0 or not isinstance(doctor, dict) or "features" not in doctor:
        result.error = f"probes did not run: {_tail(proc.stderr or proc.stdout, 3)}"
    else:
        result.fingerprint = doctor.get("fingerprint")
        features = dict(doctor["features"])
        result.probe_errors = {k: _tail(v, 3)[:500] for k, v in features.pop("errors", {}).items()}
        features.pop("toolchain", None)
        result.probes = features
        toolchain = doctor.get("toolchain") or {}
        if toolchain.get("complete") is False:
            result.error = "toolchain fingerprint incomplete: " + "; ".join(toolchain.get("incomplete_reasons", []))
    result.expect_mismatches = check_expectations(row.expect, result.probes, archs)
    _log(f"{row.name}: probes in {result.seconds['probes']:.0f} s, fingerprint {result.fingerprint}")

    if not spec_ids:
        return result, {}
    args: list[str | Path] = ["prebuild", "-q", "--json", "--cache-dir", cache, "--jobs", str(jobs)]
    args += [a for arch in archs for a in ("--arch", arch)]
    args += [a for pat in only for a in ("--only", pat)]  # none: the whole catalog
    start = time.perf_counter()
    _log(f"{row.name}: prebuild of {len(spec_ids)} specs (--jobs {jobs})")
    log = logs / "prebuild.log"
    proc, _ = cli(py, args, environ=environ, log=log, timeout_s=PREBUILD_TIMEOUT_S, cwd=env.path)
    result.seconds["prebuild"] = round(time.perf_counter() - start, 1)
    result.prebuild_exit = proc.returncode
    summary = parse_prebuild_json(proc.stdout)
    if proc.returncode not in (0, 1) or summary is None:
        why = _tail(proc.stderr or proc.stdout, 1) or f"exit {proc.returncode}"
        return result, {s: Cell(status="failed", detail=f"prebuild did not run: {why}") for s in spec_ids}
    if result.fingerprint and summary.fingerprint != result.fingerprint:
        result.error = f"prebuild keyed {summary.fingerprint}, probes {result.fingerprint}: sources changed mid-run"
    cells = cells_from_prebuild(summary, spec_ids, log)
    gc, _ = cli(py, ["gc", "--cache-dir", cache], environ=environ, log=logs / "gc.log", cwd=env.path)
    if gc.returncode != 0:  # keeps this key's artifacts for the next run, drops older keys'
        _log(f"{row.name}: dsa-aot gc exited {gc.returncode} (see {logs / 'gc.log'})")
    for kind in ("built", "skipped-by-feature", "failed"):
        result.counts[kind] = sum(c.status == kind for c in cells.values())
    _log(f"{row.name}: prebuild in {result.seconds['prebuild']:.0f} s: "
         + ", ".join(f"{n} {k}" for k, n in result.counts.items()))
    return result, cells


def mark_fallbacks(report: CompatReport, specs: Mapping[str, ListedSpec],
                   ranking: Mapping[str, Sequence[str]]) -> None:
    """For each cell not built: what the loader would serve that call shape with instead.

    The loader tries ``ranking`` for the op in order and ends at the torch reference; only the
    specs in this report count as available.
    """
    shapes: dict[tuple, dict[str, str]] = {}
    for spec in specs.values():
        shapes.setdefault(spec.shape, {})[spec.backend] = spec.id
    rows = {r.id: r for r in report.specs}
    for row in report.specs:
        spec = specs[row.id]
        same_shape = shapes[spec.shape]
        for name, cell in list(row.results.items()):
            if cell.status in ("built", "not-selected"):
                continue
            served = "reference"
            for b in ranking.get(spec.op, []):
                status = getattr(rows[same_shape[b]].results.get(name), "status", None) if b in same_shape else None
                if status == "built":
                    served = b
                    break
                if status == "not-selected":  # this column did not try it: say so, not "reference"
                    served = f"{b} (not built in this column)"
                    break
            row.results[name] = cell.model_copy(update={"loader_uses": served})


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def run_compat(matrix_path: Path | None = None, *, envs_dir: Path = DEFAULT_ENVS_DIR,
               slice_name: str | None = None, toolchains: Sequence[str] | None = None,
               shard: tuple[int, int] | None = None, only: Sequence[str] | None = None,
               jobs: int | None = None) -> CompatReport:
    """Build/reuse every selected toolchain's environment, probe and prebuild in it, report."""
    start = time.perf_counter()
    path = Path(matrix_path) if matrix_path is not None else DEFAULT_MATRIX
    matrix = load_matrix(path)
    rows = select_toolchains(matrix, slice_name=slice_name, names=toolchains, shard=shard)
    if not rows:
        raise CompatError("no toolchain selected (empty shard?)")
    globs = tuple(only) if only else (matrix.slices[slice_name].only if slice_name and
                                      matrix.slices[slice_name].only else matrix.only)
    jobs = jobs or matrix.jobs or os.cpu_count() or 1
    runtime = runtime_requirements()
    ranking = loader_ranking()
    workdir = Path(tempfile.mkdtemp(prefix="dsa-aot-compat-"))
    try:
        pythonpath = project_pythonpath(workdir / "path")
        host = host_environ(pythonpath)
        specs = plan_specs(matrix.archs, globs, environ=host, log=workdir / "list.log")
        _, doctor = cli(sys.executable, ["doctor", "--cache-dir", workdir / "cache"], environ=host,
                        log=workdir / "doctor.log")
        running = doctor.get("fingerprint") if isinstance(doctor, dict) else None
        report = CompatReport(
            generated=_now(), machine=machine_info(doctor if isinstance(doctor, dict) else None),
            toolchains=[], specs=[SpecRow(id=s) for s in specs],
            matrix={"path": _display_path(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                    "archs": list(matrix.archs), "only": list(globs), "slice": slice_name,
                    "shard": f"{shard[0]}/{shard[1]}" if shard else None, "torch": matrix.torch,
                    "toolchains": [r.name for r in rows], "jobs": jobs, "ranking": ranking})
        by_id = {r.id: r for r in report.specs}
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
                chosen = row_selection(row, specs, cli_only=bool(only))
                result, cells = run_toolchain(row, env, chosen, archs=matrix.archs,
                                              only=globs if chosen == list(specs) else chosen,
                                              jobs=jobs, pythonpath=pythonpath)
                cells.update({s: Cell(status="not-selected") for s in specs if s not in cells})
                result.same_as_running = result.fingerprint == running if result.fingerprint else None
                report.toolchains.append(result)
                for spec_id, cell in cells.items():
                    by_id[spec_id].results[row.name] = cell
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    mark_fallbacks(report, specs, ranking)
    report.problems += _problems(report)
    report.wall_seconds = round(time.perf_counter() - start, 1)
    return report


def row_selection(row: ToolchainRow, spec_ids: Iterable[str], *, cli_only: bool = False) -> list[str]:
    """The specs of the report that ``row`` builds: all of them, or those its ``only`` globs
    match (an explicit ``--only`` on the command line wins over the row's)."""
    ids = list(spec_ids)
    if cli_only or not row.only:
        return ids
    return [s for s in ids if any(fnmatch.fnmatchcase(s, g) for g in row.only)]


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
    ranking = m.get("ranking") or {}
    lines = [
        "# Toolchain compatibility",
        "",
        f"Generated by `python tools/compat.py` on {report.generated} in {report.wall_seconds / 60:.1f} min "
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
        "Regenerate with `make compat` (or `python tools/compat.py --help`). A cell says what "
        "`dsa-aot prebuild` did for the spec under that toolchain: **built**, **skipped** (a probed "
        "feature is missing) or **failed** (first compiler error line in the notes); after the "
        "arrow, what the loader serves that call shape with instead (the next backend of the "
        "ranking that built, else the torch reference); **–**: not selected for that toolchain "
        "(its row's `only`)"
        + ("; ranking " + ", ".join(f"{op}: {' > '.join(b)}" for op, b in ranking.items()) if ranking else "")
        + ".",
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
    mismatches = [f"- **{t.name}: {mm} (the matrix's `expect` is out of date, or the release changed)**"
                  for t in report.toolchains for mm in t.expect_mismatches]
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
                     "not-run": "not run", "not-selected": "–"}[cell.status]
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
    out = Path(out)
    json_path, md_path = out.with_name(out.name + ".json"), out.with_name(out.name + ".md")
    _write_atomic(json_path, (report.model_dump_json(indent=1) + "\n").encode())
    _write_atomic(md_path, render_markdown(report).encode())
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


# --- command line ------------------------------------------------------------------------------

def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: use i/n, e.g. 1/4") from None
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: need 1 <= i <= n")
    return i, n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/compat.py",
                                description="per toolchain of a matrix: own venv, probes, prebuild; report")
    p.add_argument("--matrix", type=Path, default=None, help=f"matrix TOML (default: {DEFAULT_MATRIX.relative_to(REPO)})")
    p.add_argument("--slice", default=None, help="run a [slices.NAME] of the matrix, e.g. ci")
    p.add_argument("--toolchain", action="append", metavar="GLOB", help="toolchain name glob (repeatable)")
    p.add_argument("--shard", type=_shard, default=None, help="run toolchain shard i of n (1-based), e.g. 1/3")
    p.add_argument("--only", action="append", metavar="GLOB", help="spec id glob (repeatable; default: the matrix's)")
    p.add_argument("--envs-dir", type=Path, default=DEFAULT_ENVS_DIR, help="cached virtualenvs (reused)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="writes OUT.json and OUT.md")
    p.add_argument("--jobs", "-j", type=int, default=None, help="prebuild jobs (default: the matrix's)")
    p.add_argument("--merge", nargs="+", type=Path, metavar="JSON", help="merge shard reports, run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.merge:
            report = merge_reports(args.merge)
        else:
            report = run_compat(args.matrix, envs_dir=args.envs_dir, slice_name=args.slice,
                                toolchains=args.toolchain, shard=args.shard, only=args.only, jobs=args.jobs)
        paths = write_report(report, args.out)
    except (CompatError, FileNotFoundError, ValueError) as exc:
        print(f"tools/compat.py: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(report))
    print("wrote " + " and ".join(str(p) for p in paths))
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
