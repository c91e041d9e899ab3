"""Toolchain-upgrade compatibility, on the CPU, with real compiles and the real store.

* Isolation: an artifact built under toolchain A (this environment) is not served under a
  toolchain B that differs in ONE component (kernel sources, nvcc, tilelang / tvm-ffi /
  cutlass-dsl venv): ``dsa-aot status`` says "stale" there; it is served again under A, and
  reclaimed by ``dsa-aot gc`` under B. Each switch runs real processes of the CLI.
* Feature gating: a toolkit whose nvcc rejects sm_100a makes ``dsa-aot prebuild`` report the
  sm_100a variant "skipped-by-feature" (not "failed") and the loader fall back for it.
* ``tools/compat.py`` (marker ``compat``): the matrix's CI slice, two toolchains in their own
  virtualenvs built from the registry, tiny spec subset; the report must be complete. It drives
  each toolchain through ``dsa-aot doctor --probes`` / ``prebuild --json`` / ``gc`` only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsa_aot.cache.store import ArtifactStore
from dsa_aot.settings import TILELANG_PATH_VARS
from dsa_aot.specs.probes import Features
from dsa_aot.specs.toolchain import Distribution, Toolchain
from dsa_aot.toolkit import resolve_nvcc

REPO = Path(__file__).resolve().parents[1]
COMPAT_TOOL = REPO / "tools" / "compat.py"


def _load_tool(path: Path, name: str = "dsa_aot_compat_tool"):
    """``tools/compat.py`` as a module (developer tooling: not part of the installed package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pydantic resolves the models' annotations through it
    spec.loader.exec_module(module)
    return module


compat = _load_tool(COMPAT_TOOL)
ENVS_DIR = REPO / ".compat-envs"  # the CLI's default: envs built by `make compat` are reused
SPEC, ARCH = "fwd-sm_90a-d512-h16-compact-tilelang", "sm_90a"
SPEC_100 = "fwd-sm_100a-d512-h16-compact-tilelang"
NVCC = resolve_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None or not NVCC.exists(), reason="no nvcc on this machine")


def base_env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DSA_AOT_") and k not in ("PYTHONPATH", "CUTE_DSL_ARCH")}
    env.update(DSA_AOT_CACHE_DIR=str(root), TILELANG_PRINT_ON_COMPILATION="0", **extra)
    return env


def run(argv: list[str], env: dict[str, str], python: str = sys.executable, check: bool = True,
        timeout: float = 1800) -> subprocess.CompletedProcess:
    proc = subprocess.run([python, *argv], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


class Side:
    """One toolchain as processes see it: an interpreter and its environment variables."""

    def __init__(self, name: str, env: dict[str, str], python: str = sys.executable):
        self.name, self.env, self.python = name, env, python

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run(["-m", "dsa_aot.cli", *args], self.env, self.python, check=check)

    def status(self, spec_id: str = SPEC) -> str:
        return json.loads(self.cli("status", "--json", "--only", spec_id).stdout)[spec_id]

    def doctor(self) -> dict:
        return json.loads(self.cli("doctor").stdout)

    def package(self) -> str:
        return run(["-c", "import dsa_aot; print(dsa_aot.__file__)"], self.env, self.python).stdout.strip()


def stored_keys(root: Path, spec_id: str = SPEC, arch: str = ARCH) -> list[str]:
    """The key directories of ``root`` that hold an entry of ``spec_id`` (``<key>/<arch>/<id>``)."""
    return sorted(p.parent.parent.parent.name for p in root.glob(f"*/{arch}/{spec_id}/meta.json"))


@pytest.fixture(scope="module")
def artifact_a(tmp_path_factory) -> Path:
    """A real artifact of SPEC built by ``dsa-aot prebuild`` under this environment (A)."""
    root = tmp_path_factory.mktemp("built-a") / "cache"
    proc = run(["-m", "dsa_aot.cli", "prebuild", "-q", "--only", SPEC], base_env(root))
    assert f"built{'':<15}{1:>5}" in proc.stdout, proc.stdout
    return root


@pytest.fixture
def root_a(artifact_a, tmp_path) -> Path:
    """A private copy of A's cache root (gc under B destroys it)."""
    root = tmp_path / "cache"
    shutil.copytree(artifact_a, root)
    return root


def _edited_package(dest: Path) -> Path:
    """This checkout on a PYTHONPATH, with one kernel source edited (a comment appended)."""
    path = compat.project_pythonpath(dest)
    pkg = path / "dsa_aot"
    link = pkg if pkg.is_symlink() else pkg / "kernels"
    target = link.resolve()
    link.unlink()
    shutil.copytree(target, link, ignore=shutil.ignore_patterns("__pycache__"))
    kernel = pkg / "kernels" / "tilelang_fwd.py"
    kernel.write_text(kernel.read_text() + "\n# edited: toolchain B's kernel sources\n")
    return path


def _nvcc_wrapper(path: Path, release: str, reject: str | None = None, full_disk: Path | None = None) -> Path:
    """A script standing in for another nvcc release: reports ``release``, runs the real one.
    ``reject``: refuses that arch as nvcc does; ``full_disk``: while that file exists, every
    compile fails as nvcc does when its output cannot be written."""
    major_minor = ".".join(release.split(".")[:2])
    refuse = (f'case "$*" in *{reject}*) echo "nvcc fatal   : Unsupported gpu architecture '
              f"'compute_{reject[3:]}'\" >&2; exit 1;; esac\n") if reject else ""
    if full_disk is not None:
        refuse += (f'if [ -e "{full_disk}" ]; then echo "nvcc fatal   : Could not write file '
                   '\'probe.cubin\': No space left on device" >&2; exit 1; fi\n')
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n"
                    'case "$*" in *--version*) echo "nvcc: NVIDIA (R) Cuda compiler driver"; '
                    f'echo "Cuda compilation tools, release {major_minor}, V{release}"; exit 0;; esac\n'
                    f'{refuse}exec "{NVCC}" "$@"\n')
    path.chmod(0o755)
    return path


def _side_b(component: str, root: Path, tmp_path: Path) -> Side:
    """Toolchain B, differing from A (this environment) in ``component`` only."""
    if component == "kernel sources":
        path = _edited_package(tmp_path / "b-package")
        return Side("B", base_env(root, PYTHONPATH=str(path)))
    if component == "nvcc":
        wrapper = _nvcc_wrapper(tmp_path / "b-nvcc" / "nvcc", "12.9.41")
        return Side("B", base_env(root, DSA_AOT_NVCC=str(wrapper)))
    if component == "tilelang+tvm-ffi+cutlass-dsl venv":
        matrix = compat.load_matrix()
        older = [t for t in matrix.slices["ci"].toolchains if t != _running_row(matrix)]
        env_dir = next((p for p in (compat.env_path(matrix_row(matrix, n), ENVS_DIR, matrix.torch)
                                    for n in older) if p is not None), None)
        if env_dir is None:
            pytest.skip(f"no older toolchain environment under {ENVS_DIR} (run `make compat` or the compat test)")
        env = compat.load_env(env_dir)
        environ = compat.toolchain_environ(env, compat.project_pythonpath(tmp_path / "b-path"), root)
        return Side("B", environ, str(env.python))
    raise AssertionError(component)


def matrix_row(matrix: compat.CompatMatrix, name: str) -> compat.ToolchainRow:
    return next(t for t in matrix.toolchain if t.name == name)


def _running_row(matrix: compat.CompatMatrix) -> str | None:
    """The matrix row whose pins are what this environment has installed, if any."""
    import importlib.metadata as md

    for row in matrix.toolchain:
        try:
            if all(md.version(n) == v for n, v in row.pinned().items()):
                return row.name
        except md.PackageNotFoundError:
            continue
    return None


# --- the CI slice: two toolchains, each in its own registry-built environment -------------------

@pytest.mark.compat
@needs_nvcc
def test_compat_ci_slice_two_toolchains(tmp_path):
    matrix = compat.load_matrix()
    ci = matrix.slices["ci"]
    out = tmp_path / "compat"
    start = time.perf_counter()
    proc = run([str(COMPAT_TOOL), "--slice", "ci", "--envs-dir", str(ENVS_DIR), "--out", str(out)],
               base_env(tmp_path / "unused-cache"), check=False, timeout=3600)
    wall = time.perf_counter() - start
    print(f"tools/compat.py --slice ci: {wall:.0f} s\n{proc.stdout}\n{proc.stderr[-3000:]}")
    report = compat.CompatReport.model_validate_json(out.with_name("compat.json").read_text())
    assert proc.returncode == 0, report.problems or proc.stderr[-3000:]
    names = [t.name for t in report.toolchains]
    assert names == [t for t in (r.name for r in matrix.toolchain) if t in ci.toolchains]
    assert sorted(r.id for r in report.specs) == sorted(ci.only)
    assert report.machine["cpus"] and report.generated and report.matrix["slice"] == "ci"
    assert report.matrix["ranking"] == compat.loader_ranking(environ={})

    by_name = {t.name: t for t in report.toolchains}
    shipped = by_name[_running_row(matrix)]
    assert shipped.fingerprint == Toolchain.current().fingerprint  # same key as this venv's
    assert all(report.cell(s, shipped.name).status == "built" for s in ci.only)
    assert len({t.fingerprint for t in report.toolchains}) == 2
    for t in report.toolchains:  # each toolchain's prebuild ran, through the CLI, in its own venv
        assert t.prebuild_exit in (0, 1) and t.seconds.get("prebuild") is not None, t
        log = ENVS_DIR / t.env_key / "logs" / "prebuild.log"
        assert f"{ENVS_DIR / t.env_key}/bin/python -m dsa_aot.cli prebuild -q --json" in log.read_text()
        assert t.probes is not None and t.expect_mismatches == [], (t.name, t.expect_mismatches)
        row = matrix_row(matrix, t.name)
        assert t.installed["tilelang"] == row.pinned()["tilelang"]
        assert t.probes["cute_math_isfinite"] is row.expect["cute_math_isfinite"]
        assert t.probes["nvcc_archs"] == {"sm_90a": True, "sm_100a": True}
        if row.expect.get("tilelang_bool_fragment_ok", {}).get("sm_100a") is False:
            assert "boolx8" in t.probe_errors["tilelang_bool_fragment_ok[sm_100a]"]
        for spec_id in ci.only:
            cell = report.cell(spec_id, t.name)
            assert cell is not None and cell.status in ("built", "skipped-by-feature", "failed")
            assert (cell.status == "built") == (cell.detail == ""), (spec_id, t.name, cell)
            assert (cell.status == "built") == (cell.loader_uses is None), (spec_id, t.name, cell)
    text = out.with_name("compat.md").read_text()
    assert "| spec | " + " | ".join(names) + " |" in text
    assert all(f"| `{s}` |" in text for s in ci.only)


@needs_nvcc
@pytest.mark.parametrize("component", ["kernel sources", "nvcc", "tilelang+tvm-ffi+cutlass-dsl venv"])
def test_switching_one_component_isolates_artifacts(component, root_a, tmp_path):
    a = Side("A", base_env(root_a))
    b = _side_b(component, root_a, tmp_path)
    key_a = stored_keys(root_a)
    assert len(key_a) == 1, key_a
    doctor_a = a.doctor()
    assert doctor_a["toolchain"]["complete"], doctor_a["toolchain"]
    assert a.status() == "cached"

    doctor_b = b.doctor()  # B: a complete key of its own, and A's entry is not served
    assert doctor_b["toolchain"]["complete"], doctor_b["toolchain"]
    assert b.status() == "stale"
    if component == "kernel sources":  # same compilers; the spec's sources differ
        assert b.package().startswith(str(tmp_path)), b.package()  # really the edited copy
    else:
        assert doctor_b["fingerprint"] != doctor_a["fingerprint"]

    assert a.status() == "cached"  # switching back serves A's entry again
    assert stored_keys(root_a) == key_a

    b.cli("gc")  # B's gc reclaims A's entry: B would never serve it
    assert stored_keys(root_a) == []
    assert not (root_a / key_a[0]).exists()
    assert a.status() == "missing"


def _build_key(toolchain: Toolchain, spec_id: str = SPEC) -> str:
    from dsa_aot.backends import get as get_backend
    from dsa_aot.identity import build_identity
    from dsa_aot.specs.catalog import load_catalog

    spec = next(s for s in load_catalog().specs() if s.id == spec_id)
    return build_identity(get_backend(spec.backend), spec, toolchain).key()


@needs_nvcc
@pytest.mark.parametrize("package", ["tilelang", "tvm_ffi", "cutlass_dsl"])
def test_other_compiler_release_misses_and_is_collected(package, root_a):
    """B = A with one compiler distribution of another release (a Toolchain copy)."""
    a = Toolchain.current()
    key_a = _build_key(a)
    store = ArtifactStore(root_a)
    assert stored_keys(root_a) == [key_a]  # the key a prebuild process filed SPEC under
    assert store.lookup(key_a, ARCH, SPEC) is not None
    if package == "cutlass_dsl":
        other = tuple(d.model_copy(update={"version": "4.5.3", "content_sha256": "0" * 64}) for d in a.cutlass_dsl) \
            or (Distribution(name="nvidia-cutlass-dsl", version="4.5.3"),)
    else:
        old = getattr(a, package)
        assert old is not None, f"{package} is not installed here"
        other = old.model_copy(update={"version": "0.0.1", "content_sha256": "0" * 64})
    b = a.model_copy(update={package: other})
    assert b.fingerprint != a.fingerprint
    key_b = _build_key(b)
    if package == "cutlass_dsl":  # not a TileLang build input: its artifacts stay valid
        assert key_b == key_a
        cute = "fwd-sm_90a-d512-h16-compact-cutedsl"
        assert _build_key(b, cute) != _build_key(a, cute)
        return
    assert key_b != key_a
    assert store.lookup(key_b, ARCH, SPEC) is None
    assert store.lookup(key_a, ARCH, SPEC) is not None  # back to A: a hit
    report = store.gc({key_b})  # keep only what B serves
    assert report.removed_fingerprints == [key_a]
    assert store.lookup(key_a, ARCH, SPEC) is None


# --- a missing feature: skipped, not failed, and the loader falls back ---------------------------

def _toolkit(home: Path, release: str, **wrapper) -> Path:
    """A CUDA toolkit root at ``home``: the real one's files, with ``_nvcc_wrapper`` as nvcc."""
    if NVCC is None or not NVCC.exists():
        pytest.skip("no nvcc on this machine")
    real = NVCC.resolve().parent.parent
    home.mkdir(parents=True, exist_ok=True)
    for child in real.iterdir():
        if child.name != "bin":
            (home / child.name).symlink_to(child)
    (home / "bin").mkdir()
    for tool in (real / "bin").iterdir():
        if tool.name != "nvcc":
            (home / "bin" / tool.name).symlink_to(tool)
    _nvcc_wrapper(home / "bin" / "nvcc", release, **wrapper)
    return home


def _toolkit_env(root: Path, home: Path) -> dict[str, str]:
    env = base_env(root, CUDA_HOME=str(home))
    for var in (*TILELANG_PATH_VARS, "CUDA_PATH"):
        env.pop(var, None)
    return env


@pytest.fixture(scope="module")
def toolkit_without_sm100(tmp_path_factory) -> Path:
    """A CUDA toolkit root whose nvcc (an older release, 12.6) refuses sm_100a."""
    return _toolkit(tmp_path_factory.mktemp("cuda-12.6"), "12.6.85", reject="sm_100a")


@pytest.fixture(scope="module")
def prebuilt_without_sm100(toolkit_without_sm100, tmp_path_factory):
    root = tmp_path_factory.mktemp("no-sm100") / "cache"
    env = _toolkit_env(root, toolkit_without_sm100)
    proc = run(["-m", "dsa_aot.cli", "prebuild", "-q", "--json", "--only", SPEC, "--only", SPEC_100], env,
               check=False)
    return root, env, proc


def test_missing_nvcc_arch_is_skipped_by_feature_not_failed(prebuilt_without_sm100):
    root, env, proc = prebuilt_without_sm100
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout)  # --json: stdout is the summary and nothing else
    parsed = compat.parse_prebuild_json(proc.stdout)
    assert parsed is not None and parsed.fingerprint == summary["fingerprint"]
    fp = parsed.fingerprint
    assert fp != Toolchain.current().fingerprint
    assert Path(parsed.root) == root and parsed.wall_seconds > 0
    assert summary["counts"] == {"built": 1, "cached": 0, "failed": 0, "skipped-by-feature": 1}
    rows = {r.id: r for r in parsed.specs}
    assert set(rows) == {SPEC, SPEC_100}, proc.stdout
    assert rows[SPEC].status == "built" and rows[SPEC].seconds > 0 and rows[SPEC].message == ""
    assert rows[SPEC_100].status == "skipped-by-feature" and "sm_100a" in rows[SPEC_100].message
    cells = compat.cells_from_prebuild(parsed, [SPEC, SPEC_100], root / "log")
    assert cells[SPEC] == compat.Cell(status="built")
    assert cells[SPEC_100].status == "skipped-by-feature" and "sm_100a" in cells[SPEC_100].detail
    doctor = json.loads(run(["-m", "dsa_aot.cli", "doctor", "--probes"], env).stdout)
    assert doctor["fingerprint"] == fp
    assert doctor["features"]["nvcc_archs"] == {"sm_90a": True, "sm_100a": False}
    assert doctor["features"]["nvcc_version"] == "12.6.85"
    states = json.loads(run(["-m", "dsa_aot.cli", "status", "--json", "--only", SPEC, "--only", SPEC_100], env).stdout)
    assert states == {SPEC: "cached", SPEC_100: "missing"}

    again = run(["-m", "dsa_aot.cli", "prebuild", "-q", "--json", "--only", SPEC], env)  # now cached
    assert [(r["id"], r["status"]) for r in json.loads(again.stdout)["specs"]] == [(SPEC, "cached")]
    assert compat.cells_from_prebuild(compat.parse_prebuild_json(again.stdout), [SPEC], root)[SPEC].status == "built"


def test_probe_that_cannot_answer_fails_the_prebuild_and_is_asked_again(tmp_path):
    """nvcc failing on a full disk says nothing about the arch: the spec fails (exit 1), not
    skipped, and no features file keeps the non-answer; the next prebuild probes and builds."""
    full = tmp_path / "disk-is-full"
    full.touch()
    home = _toolkit(tmp_path / "cuda-13.0", "13.0.88", full_disk=full)
    root = tmp_path / "cache"
    env = _toolkit_env(root, home)
    proc = run(["-m", "dsa_aot.cli", "prebuild", "-q", "--json", "--only", SPEC], env, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["counts"] == {"built": 0, "cached": 0, "failed": 1, "skipped-by-feature": 0}
    message = summary["specs"][0]["message"]
    assert "nvcc_archs[sm_90a]" in message and "No space left on device" in message, message
    assert not list(root.glob(".features/*.json"))
    assert "could not answer" in proc.stderr

    full.unlink()  # the disk has room again: same toolchain, probed anew
    proc = run(["-m", "dsa_aot.cli", "prebuild", "-q", "--json", "--only", SPEC], env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["counts"]["built"] == 1
    saved = Features.model_validate_json(next(root.glob(".features/*.json")).read_text())
    assert saved.nvcc_archs == {"sm_90a": True} and saved.unsettled == ()


def test_loader_falls_back_for_the_skipped_variant(prebuilt_without_sm100):
    root, env, _ = prebuilt_without_sm100
    code = textwrap.dedent("""
        import json, warnings
        from dsa_aot.loader import get_loader
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernel, res = get_loader().resolve("fwd", "sm_100a", 512, 16, "compact", 0)
        print(json.dumps({"source": res.source, "reasons": list(res.reasons), "kernel": type(kernel).__name__,
                          "warned": [str(w.message) for w in caught]}))
    """)
    out = json.loads(run(["-c", code], env).stdout.strip().splitlines()[-1])
    assert out["source"] == "reference", out
    assert any("nvcc does not accept sm_100a" in r for r in out["reasons"]), out
    assert out["warned"] and "torch reference" in out["warned"][0]


# --- the matrix file and the report --------------------------------------------------------------

def test_matrix_rows_pin_the_whole_compiler_set():
    matrix = compat.load_matrix()
    names = {t.name for t in matrix.toolchain}
    versions = {(r.pinned()["tilelang"], r.pinned()["nvidia-cutlass-dsl"]) for r in matrix.toolchain}
    assert {v for v, _ in versions} >= {"0.1.11", "0.1.13", "0.1.15"}
    assert {c[:3] for _, c in versions} >= {"4.5", "4.6"} and "4.8.1" in {c for _, c in versions}
    for row in matrix.toolchain:
        pinned = row.pinned()
        assert {"tilelang", "apache-tvm-ffi", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
                "z3-solver"} <= set(pinned), row.name
        cute = pinned["nvidia-cutlass-dsl"]
        assert all(v == cute for n, v in pinned.items() if n.startswith("nvidia-cutlass-dsl")), row.name
        if cute >= "4.6":  # 4.6+ splits the libraries further
            assert {"nvidia-cutlass-dsl-libs-core", "nvidia-cutlass-dsl-libs-cu12"} <= set(pinned), row.name
        if pinned["tilelang"] == "0.1.11":
            assert pinned["apache-tvm-ffi"] == "0.1.10"  # any newer one aborts `import tilelang`
    assert sum(t.required for t in matrix.toolchain) == 1
    ci = matrix.slices["ci"]
    assert len(ci.toolchains) == 2 and set(ci.toolchains) <= names
    assert _running_row(matrix) in ci.toolchains, "CI's slice must include the shipped pins"
    ids = compat.plan_specs(matrix.archs, ci.only)
    assert sorted(ids) == sorted(ci.only), "every CI spec must exist in the catalog"


def test_probe_names_are_what_doctor_reports():
    metadata = {"schema_version", "toolchain", "archs", "errors", "unsettled"}
    assert set(compat.PROBE_FIELDS) == set(Features.model_fields) - metadata


def test_tool_is_outside_the_package_and_imports_none_of_it(tmp_path):
    """The runtime package no longer has a ``compat`` command; the tool imports nothing of dsa_aot."""
    proc = run(["-m", "dsa_aot.cli", "compat", "--help"], base_env(tmp_path), check=False)
    assert proc.returncode == 2 and "invalid choice: 'compat'" in proc.stderr, proc.stderr
    assert importlib.util.find_spec("dsa_aot.compat") is None
    code = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("compat_tool", {str(COMPAT_TOOL)!r})
        tool = sys.modules["compat_tool"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
        tool.load_matrix(), tool.loader_ranking(), tool.runtime_requirements()
        print(sorted(m for m in sys.modules if m == "dsa_aot" or m.startswith("dsa_aot.")))
    """)
    assert run(["-c", code], base_env(tmp_path)).stdout.strip() == "[]"
    help_text = run([str(COMPAT_TOOL), "--help"], base_env(tmp_path)).stdout
    assert "--slice" in help_text and "--merge" in help_text


@pytest.mark.parametrize("bad, match", [
    ({"pins": ["tilelang>=0.1.11"]}, "name==version"),
    ({"pins": ["tilelang==0.1.11", "TileLang==0.1.13"]}, "pinned twice"),
    ({"pins": ["z3-solver==4.15.4.0"]}, "pins tilelang"),
    ({"pins": ["tilelang==0.1.15"], "expect": {"isfinite": True}}, "unknown probe"),
])
def test_matrix_rejects_loose_rows(bad, match):
    with pytest.raises(ValueError, match=match):
        compat.ToolchainRow.model_validate({"name": "x", **bad})


def test_env_key_changes_with_any_pin_and_shards_partition():
    matrix = compat.load_matrix()
    row = matrix.toolchain[0]
    runtime = compat.runtime_requirements()
    key = compat.env_key(row, matrix.torch, runtime)
    assert key == compat.env_key(row.model_copy(update={"note": "renamed"}), matrix.torch, runtime)
    keys = {key, compat.env_key(row, "torch==2.12.0", runtime),
            compat.env_key(row, matrix.torch, (*runtime, "tqdm>=4"))}
    for i, pin in enumerate(row.pins):
        pins = list(row.pins)
        pins[i] = pin + ".post1"
        keys.add(compat.env_key(row.model_copy(update={"pins": tuple(pins)}), matrix.torch, runtime))
    assert len(keys) == 3 + len(row.pins)
    shards = [compat.select_toolchains(matrix, shard=(i, 3)) for i in (1, 2, 3)]
    flat = [r.name for s in shards for r in s]
    assert sorted(flat) == sorted(t.name for t in matrix.toolchain) and len(set(flat)) == len(flat)


def test_expectations_flag_a_changed_probe():
    expect = {"cute_math_isfinite": False, "tilelang_bool_fragment_ok": {"sm_90a": True, "sm_100a": False}}
    measured = {"cute_math_isfinite": False, "tilelang_bool_fragment_ok": {"sm_90a": True, "sm_100a": False}}
    assert compat.check_expectations(expect, measured, ["sm_90a", "sm_100a"]) == []
    fixed = dict(measured, tilelang_bool_fragment_ok={"sm_90a": True, "sm_100a": True})
    assert compat.check_expectations(expect, fixed, ["sm_90a", "sm_100a"]) == [
        "tilelang_bool_fragment_ok[sm_100a]: expected False, measured True"]
    assert compat.check_expectations(expect, fixed, ["sm_90a"]) == []  # arch not in this run
    assert compat.check_expectations(expect, None, ["sm_90a"]) == ["probes did not run"]


_LOADER_RANKING = textwrap.dedent("""
    import json
    from dsa_aot.loader import get_loader
    print(json.dumps({op: get_loader().ranking(op) for op in ("fwd", "bwd")}))
""")

_BWD_TL, _BWD_CUTE = "bwd-sm_90a-d512-h64-compact-tilelang", "bwd-sm_90a-d512-h64-compact-cutedsl"
_FWD_TL, _FWD_CUTE = "fwd-sm_90a-d512-h64-compact-tilelang", "fwd-sm_90a-d512-h64-compact-cutedsl"


@pytest.mark.parametrize("forced, bwd_tilelang_failed, fwd_cutedsl_failed", [
    (None, "cutedsl", "tilelang"),            # the catalog's ranking: (cudnn,) cutedsl, then tilelang
    ("tilelang,cutedsl", "cutedsl", "tilelang"),
    ("tilelang", "reference", "tilelang"),    # cutedsl is never tried, built or not
    ("cutedsl", "cutedsl", "reference"),
])
def test_report_names_what_the_loader_serves_instead(forced, bwd_tilelang_failed, fwd_cutedsl_failed, tmp_path):
    environ = {} if forced is None else {"DSA_AOT_BACKENDS": forced}
    ranking = compat.loader_ranking(environ=environ)
    # the ranking compat uses is the one a real loader process uses under the same settings
    loader = json.loads(run(["-c", _LOADER_RANKING], base_env(tmp_path, **environ)).stdout.strip().splitlines()[-1])
    assert ranking == loader, (ranking, loader)
    if forced is None:
        assert ranking == {"fwd": ["cutedsl", "tilelang"], "bwd": ["cudnn", "cutedsl", "tilelang"]}, \
            "specs/catalog.toml's ranking changed: update the expectations of this test"

    ids = [_BWD_TL, _BWD_CUTE, _FWD_TL, _FWD_CUTE]
    specs = compat.plan_specs(["sm_90a"], ids)
    assert sorted(specs) == sorted(ids)
    built, failed = compat.Cell(status="built"), compat.Cell(status="failed", detail="x")
    skipped = compat.Cell(status="skipped-by-feature", detail="nvcc")
    table = {"one-left": {_BWD_TL: failed, _BWD_CUTE: built, _FWD_TL: skipped, _FWD_CUTE: failed},
             "none-left": {_BWD_TL: failed, _BWD_CUTE: failed, _FWD_TL: built, _FWD_CUTE: failed}}
    report = compat.CompatReport(generated="now", matrix={}, machine={}, toolchains=[],
                                 specs=[compat.SpecRow(id=i, results={t: c[i] for t, c in table.items()}) for i in ids])
    compat.mark_fallbacks(report, specs, ranking)
    uses = {(r.id, t): c.loader_uses for r in report.specs for t, c in r.results.items()}
    assert uses[(_BWD_TL, "one-left")] == bwd_tilelang_failed  # the other backend built
    assert uses[(_FWD_CUTE, "none-left")] == fwd_cutedsl_failed
    assert uses[(_BWD_CUTE, "one-left")] is None and uses[(_FWD_TL, "none-left")] is None  # built
    assert uses[(_FWD_TL, "one-left")] == uses[(_FWD_CUTE, "one-left")] == "reference"  # neither fwd built
    assert uses[(_BWD_TL, "none-left")] == uses[(_BWD_CUTE, "none-left")] == "reference"


def test_frontend_rows_cross_releases_and_build_only_the_cudnn_specs():
    """Two older cuDNN frontend releases with the DSA kernels beside the shipped one, each on a
    CuTe DSL release it accepts; a row's ``only`` narrows its column to the cudnn specs, and a
    spec it does not select is neither built nor given a loader fallback there."""
    matrix = compat.load_matrix()
    frontends = {r.name: r.pinned().get("nvidia-cudnn-frontend") for r in matrix.toolchain}
    shipped = next(r for r in matrix.toolchain if r.required)
    assert shipped.pinned()["nvidia-cudnn-frontend"] == "1.32.0" and not shipped.only
    older = {n: v for n, v in frontends.items() if v and v != "1.32.0"}
    assert len(set(older.values())) >= 2
    assert len({matrix_row.pinned()["nvidia-cutlass-dsl"] for matrix_row in matrix.toolchain
                if matrix_row.name in older}) >= 2, "the older frontends must cross CuTe DSL releases"
    specs = compat.plan_specs(matrix.archs, matrix.only)
    for name in older:
        row = next(r for r in matrix.toolchain if r.name == name)
        chosen = compat.row_selection(row, specs)
        assert chosen and all(specs[s].backend == "cudnn" for s in chosen), name
        assert compat.row_selection(row, specs, cli_only=True) == list(specs)  # --only wins
    row = next(r for r in matrix.toolchain if r.name in older)
    cudnn_id = compat.row_selection(row, specs)[0]
    other = next(s for s in specs if specs[s].shape == specs[cudnn_id].shape and s != cudnn_id)
    report = compat.CompatReport(
        generated="now", matrix={"path": "m", "sha256": "0" * 64, "archs": ["sm_90a"], "only": [], "torch": "t",
                                 "jobs": 1}, machine={},
        toolchains=[compat.ToolchainResult(name=row.name, pins=row.pins)],
        specs=[compat.SpecRow(id=cudnn_id, results={row.name: compat.Cell(status="failed", detail="e")}),
               compat.SpecRow(id=other, results={row.name: compat.Cell(status="not-selected")})])
    backend = specs[other].backend
    compat.mark_fallbacks(report, {s: specs[s] for s in (cudnn_id, other)}, {specs[other].op: ["cudnn", backend]})
    assert report.specs[1].results[row.name].loader_uses is None
    assert report.specs[0].results[row.name].loader_uses == f"{backend} (not built in this column)"
    text = compat.render_markdown(report)
    assert f"| `{other}` | – |" in text
