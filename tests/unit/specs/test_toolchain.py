"""Key coverage of the toolchain fingerprint: change one input at a time, the key must change.

The fingerprint identifies the installed compiler set only (TileLang, tvm-ffi, CuTe DSL and
other declared compilers by content, nvcc); our own sources key each spec separately (see
``test_keys.py``). Most tests build a small installed environment on disk (dist-info folders
with real RECORD files, a toolkit with version.json) and run the real ``Toolchain.collect``
over it, so every input reaches the key through the code that reads it.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dsa_aot.specs.installed as installed
import dsa_aot.specs.toolchain as tc
from dsa_aot import settings
from dsa_aot.specs.probes import Features
from dsa_aot.specs.toolchain import Distribution, Toolchain, hash_sources, resolve_nvcc
from dsa_aot.toolkit import resolve_nvcc as toolkit_resolve_nvcc


def _record_line(rel: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{rel},sha256={digest},{len(data)}"


class FakeEnv:
    """A site-packages folder and a CUDA toolkit under one root."""

    def __init__(self, root: Path):
        self.root = root
        self.site = root / "site"
        self.nvcc = root / "cuda" / "bin" / "nvcc"
        self.site.mkdir(parents=True)
        self.nvcc.parent.mkdir(parents=True)
        self.nvcc.write_bytes(b"\x7fELF" + b"\0" * 60)  # the cheap path only checks the magic
        self.set_nvcc_version("12.8.93")
        self.install("tilelang", "0.1.15", {
            "tilelang/__init__.py": b"__version__ = '0.1.15'\n",
            "tilelang/lib/libtilelang.so": b"\x7fELF tilelang compiler",
            "tilelang/lib/libtvm_runtime.so": b"\x7fELF tvm runtime",
            "tilelang/src/tl_templates/cuda/common.h": b"#pragma once\n",
        }, extra=["../../../bin/tilelang-cli,sha256=abc,10",
                  "tilelang/__pycache__/__init__.cpython-311.pyc,,"])
        self.install("apache-tvm-ffi", "0.1.12", {
            "tvm_ffi/__init__.py": b"",
            "tvm_ffi/lib/libtvm_ffi.so": b"\x7fELF ffi",
            "tvm_ffi/core.cpython-311-x86_64-linux-gnu.so": b"\x7fELF ext",
        })
        self.install("nvidia-cutlass-dsl", "4.8.1", {})
        self.install("nvidia-cutlass-dsl-libs-base", "4.8.1",
                     {"nvidia_cutlass_dsl/lib/libx.so": b"\x7fELF x"})
        self.install("other-compiler", "2.0", {"other_compiler/__init__.py": b""})
        self.install("unrelated-package", "1.0", {"unrelated/__init__.py": b""})

    def dist_info(self, name: str) -> Path:
        (found,) = self.site.glob(f"{name.replace('-', '_')}-*.dist-info")
        return found

    def install(self, name: str, version: str, files: dict[str, bytes], extra: list[str] = ()) -> None:
        info = self.site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        for rel, data in files.items():
            (self.site / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.site / rel).write_bytes(data)
        lines = [_record_line(rel, data) for rel, data in files.items()]
        lines += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,", *extra]
        (info / "RECORD").write_text("\n".join(lines) + "\n")

    def set_version(self, name: str, version: str) -> None:
        meta = self.dist_info(name) / "METADATA"
        meta.write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")

    def replace_file(self, name: str, rel: str, data: bytes) -> None:
        """Reinstall one file of a distribution: new content and its RECORD line."""
        (self.site / rel).parent.mkdir(parents=True, exist_ok=True)
        (self.site / rel).write_bytes(data)
        record = self.dist_info(name) / "RECORD"
        lines = [ln for ln in record.read_text().splitlines() if not ln.startswith(rel + ",")]
        record.write_text("\n".join(lines + [_record_line(rel, data)]) + "\n")

    def set_nvcc_version(self, version: str) -> None:
        (self.nvcc.parent.parent / "version.json").write_text(json.dumps({
            "cuda": {"name": "CUDA SDK", "version": version},
            "cuda_nvcc": {"name": "CUDA NVCC", "version": version}}))

    def collect(self, **kw) -> Toolchain:
        kw = {"nvcc": self.nvcc, "search_path": [str(self.site)], "compilers": ("other-*",), **kw}
        return Toolchain.collect(**kw)


def _setenv(monkeypatch, name: str, value: str) -> None:
    """Set a variable the settings read, and re-read them."""
    monkeypatch.setenv(name, value)
    settings.reload()


@pytest.fixture
def env(tmp_path, monkeypatch) -> FakeEnv:
    for var in (*settings.TILELANG_PATH_VARS, "DSA_AOT_NVCC"):  # an imported tilelang sets some of these
        monkeypatch.delenv(var, raising=False)
    settings.reload()
    yield FakeEnv(tmp_path / "env")
    monkeypatch.undo()
    settings.reload()


def test_fake_environment_is_read(env):
    t = env.collect()
    assert t.complete, t.incomplete_reasons
    assert t.tilelang.version == "0.1.15" and len(t.tilelang.content_sha256) == 64
    assert t.tvm_ffi.name == "apache-tvm-ffi" and t.tvm_ffi.content_sha256
    assert [d.name for d in t.cutlass_dsl] == ["nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base"]
    assert all(len(d.content_sha256) == 64 for d in t.cutlass_dsl)  # CuTe DSL is content-hashed too
    assert [(d.name, d.version) for d in t.other_compilers] == [("other-compiler", "2.0")]
    assert t.other_compilers[0].content_sha256
    assert env.collect(compilers=()).other_compilers == ()  # only declared compilers count
    assert (t.nvcc_version, t.cuda_driver_min) == ("12.8.93", "12.8")
    assert t.python_abi is None and t.features is None


def test_identical_recomputation_gives_same_fingerprint(env):
    a, b = env.collect(), env.collect()
    assert a == b and a.fingerprint == b.fingerprint


CHANGES = {
    "tilelang version": lambda e: e.set_version("tilelang", "0.1.16"),
    "tilelang native lib": lambda e: e.replace_file(
        "tilelang", "tilelang/lib/libtilelang.so", b"\x7fELF rebuilt"),
    "tilelang template header": lambda e: e.replace_file(
        "tilelang", "tilelang/src/tl_templates/cuda/common.h", b"#pragma once\n// fix\n"),
    "tilelang new file": lambda e: e.replace_file("tilelang", "tilelang/lib/libextra.so", b"\x7fELF"),
    "tvm-ffi version": lambda e: e.set_version("apache-tvm-ffi", "0.1.13"),
    "tvm-ffi native lib": lambda e: e.replace_file(
        "apache-tvm-ffi", "tvm_ffi/lib/libtvm_ffi.so", b"\x7fELF v2"),
    "cutlass-dsl version": lambda e: e.set_version("nvidia-cutlass-dsl-libs-base", "4.5.3"),
    "cutlass-dsl native lib": lambda e: e.replace_file(
        "nvidia-cutlass-dsl-libs-base", "nvidia_cutlass_dsl/lib/libx.so", b"\x7fELF x rebuilt"),
    "cutlass-dsl package added": lambda e: e.install("nvidia-cutlass-dsl-libs-cu13", "4.8.1", {}),
    "other compiler version": lambda e: e.set_version("other-compiler", "2.1"),
    "other compiler content": lambda e: e.replace_file(
        "other-compiler", "other_compiler/__init__.py", b"# patched\n"),
    "other compiler added": lambda e: e.install("other-compiler-libs", "2.0", {"other_libs/x.py": b""}),
    "tilelang uninstalled": lambda e: shutil.rmtree(e.dist_info("tilelang")),
    "nvcc version": lambda e: e.set_nvcc_version("12.9.41"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_each_input_changes_fingerprint(env, change):
    before = env.collect()
    CHANGES[change](env)
    after = env.collect()
    assert after.complete, after.incomplete_reasons
    assert after.fingerprint != before.fingerprint, change


NO_OPS = {
    "tilelang rewritten unchanged": lambda e: e.replace_file(
        "tilelang", "tilelang/__init__.py", b"__version__ = '0.1.15'\n"),
    "unrelated package": lambda e: e.set_version("unrelated-package", "2.0"),
    "CPython extension rebuilt": lambda e: e.replace_file(
        "apache-tvm-ffi", "tvm_ffi/core.cpython-311-x86_64-linux-gnu.so", b"\x7fELF for 3.11 again"),
    "extension for another Python": lambda e: e.replace_file(
        "apache-tvm-ffi", "tvm_ffi/core.abi3.so", b"\x7fELF abi3"),
    "bytecode listed in RECORD": lambda e: e.replace_file(
        "tilelang", "tilelang/__pycache__/__init__.cpython-312.pyc", b"pyc"),
}


@pytest.mark.parametrize("change", sorted(NO_OPS))
def test_no_op_changes_keep_fingerprint(env, change):
    before = env.collect()
    NO_OPS[change](env)
    assert env.collect().fingerprint == before.fingerprint


def test_fingerprint_does_not_depend_on_location(env, tmp_path):
    before = env.collect()
    moved = tmp_path / "elsewhere"
    shutil.copytree(env.root, moved, symlinks=True)
    env.root, env.site = moved, moved / "site"
    env.nvcc = moved / "cuda" / "bin" / "nvcc"
    assert env.collect().fingerprint == before.fingerprint


def test_nvcc_reported_by_spawning_when_no_version_file(env, tmp_path):
    script = tmp_path / "wrapper" / "nvcc"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                      "echo 'Cuda compilation tools, release 12.9, V12.9.41'\n")
    script.chmod(0o755)
    t = env.collect(nvcc=script)
    assert t.complete, t.incomplete_reasons
    assert (t.nvcc_version, t.cuda_driver_min) == ("12.9.41", "12.9")


def test_spawned_answer_is_remembered_for_that_binary_only(tmp_path, monkeypatch):
    """A toolkit without version files: the first process spawns nvcc, later ones read the memo;
    a rewritten nvcc (new ctime/size) is asked again."""
    monkeypatch.setenv("DSA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    settings.reload()
    runs = tmp_path / "runs"
    nvcc = tmp_path / "tk" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)

    def install(release: str) -> None:
        nvcc.write_text(f"#!/bin/sh\necho run >> {runs}\n"
                        f"echo 'Cuda compilation tools, release {release[:4]}, V{release}'\n")
        nvcc.chmod(0o755)

    def ask() -> str | None:
        tc._nvcc_version_spawned.cache_clear()  # as a fresh process would
        return tc.nvcc_version(nvcc)[0]

    try:
        install("12.9.41")
        assert [ask(), ask(), ask()] == ["12.9.41"] * 3
        assert runs.read_text().count("run") == 1
        memo = json.loads((tmp_path / "cache" / tc.TOOLCHAIN_MEMO).read_text())
        assert list(memo["nvcc"].values()) == ["12.9.41"]
        install("13.0.88")  # an upgrade in place
        assert ask() == "13.0.88" and runs.read_text().count("run") == 2
        assert tc.nvcc_version(nvcc, spawn=True)[0] == "13.0.88" and runs.read_text().count("run") == 2
    finally:
        monkeypatch.undo()
        settings.reload()


def test_record_digest_is_remembered_for_that_record_file_only(env, tmp_path, monkeypatch):
    """A later process reuses the digest of an unchanged RECORD (its identity), still checks the
    native libraries' sizes, and recomputes once the RECORD is rewritten."""
    import importlib.metadata as md

    monkeypatch.setenv("DSA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    settings.reload()
    try:
        dist = md.PathDistribution(env.dist_info("tilelang"))
        digest, problems = tc.record_digest(dist, expect_native=True)
        assert problems == [] and digest
        memo_file = tmp_path / "cache" / tc.TOOLCHAIN_MEMO
        memo = json.loads(memo_file.read_text())
        (identity, fact), = memo["record"].items()
        assert identity == tc.file_identity(env.dist_info("tilelang") / "RECORD") and fact["digest"] == digest
        fact["digest"] = "remembered"
        memo_file.write_text(json.dumps(memo))
        installed._memo_cache = None  # as a fresh process
        assert tc.record_digest(dist, expect_native=True) == ("remembered", [])
        (env.site / "tilelang/lib/libtilelang.so").write_bytes(b"\x7fELF longer build")
        assert "rebuilt in place" in tc.record_digest(dist, expect_native=True)[1][0]
        env.replace_file("tilelang", "tilelang/lib/libtilelang.so", b"\x7fELF longer build")
        fresh, problems = tc.record_digest(dist, expect_native=True)
        assert problems == [] and fresh not in ("remembered", digest)
    finally:
        monkeypatch.undo()
        settings.reload()
        installed._memo_cache = None


def test_exec_wrapper_is_followed_to_the_toolkit_it_runs(env, tmp_path):
    """``exec /abs/bin/nvcc "$@"`` wrappers (e.g. /usr/local/bin/nvcc) read the target's
    version file instead of spawning; a wrapper doing anything else is spawned."""
    script = tmp_path / "wrapper" / "bin" / "nvcc"
    script.parent.mkdir(parents=True)
    script.write_text(f'#!/bin/sh\n# generated\nexec {env.nvcc} "$@"\n')
    script.chmod(0o755)
    assert tc._nvcc_version_from_files(script) == "12.8.93"
    assert env.collect(nvcc=script).nvcc_version == "12.8.93"
    env.set_nvcc_version("12.9.41")
    assert env.collect(nvcc=script).nvcc_version == "12.9.41"
    script.write_text(f'#!/bin/sh\nexport X=1\nexec {env.nvcc} "$@"\n')  # more than an exec
    assert tc._nvcc_version_from_files(script) is None


# --- unreadable inputs mark the toolchain incomplete ----------------------------------------

def _broken_nvcc(e: FakeEnv) -> None:
    e.nvcc.parent.parent.joinpath("version.json").unlink()
    e.nvcc.write_text("#!/bin/sh\necho garbage\nexit 3\n")
    e.nvcc.chmod(0o755)


INCOMPLETE = {
    "RECORD missing": (lambda e: (e.dist_info("tilelang") / "RECORD").unlink(), "RECORD is missing"),
    "editable install": (lambda e: (e.dist_info("tilelang") / "direct_url.json").write_text(
        json.dumps({"url": "file:///src/tilelang", "dir_info": {"editable": True}})), "editable"),
    "lib rebuilt in place": (
        lambda e: (e.site / "tilelang/lib/libtilelang.so").write_bytes(b"\x7fELF longer build"),
        "rebuilt in place"),
    "lib deleted": (lambda e: (e.site / "tilelang/lib/libtilelang.so").unlink(), "unreadable"),
    "no native lib": (lambda e: (e.dist_info("apache-tvm-ffi") / "RECORD").write_text(
        _record_line("tvm_ffi/__init__.py", b"") + "\n"), "no native library"),
    "unhashed file": (lambda e: (e.dist_info("tilelang") / "RECORD").open("a").write(
        "tilelang/extra.py,,\n"), "no hash"),
    "nvcc unreadable": (_broken_nvcc, "--version"),
    "cutlass-dsl unhashed file": (lambda e: (e.dist_info("nvidia-cutlass-dsl-libs-base") / "RECORD").open("a").write(
        "nvidia_cutlass_dsl/extra.py,,\n"), "no hash"),
    "other compiler RECORD missing": (lambda e: (e.dist_info("other-compiler") / "RECORD").unlink(),
                                      "RECORD is missing"),
}


@pytest.mark.parametrize("case", sorted(INCOMPLETE))
def test_unreadable_input_marks_incomplete(env, case):
    breaker, reason = INCOMPLETE[case]
    breaker(env)
    t = env.collect()
    assert not t.complete
    assert any(reason in r for r in t.incomplete_reasons), t.incomplete_reasons


def test_template_override_outside_tilelang_is_incomplete(env, monkeypatch, tmp_path):
    _setenv(monkeypatch, "TL_TEMPLATE_PATH", str(env.site / "tilelang" / "src"))
    assert env.collect().complete
    _setenv(monkeypatch, "TL_TEMPLATE_PATH", str(tmp_path))
    t = env.collect()
    assert not t.complete and "TL_TEMPLATE_PATH" in t.incomplete_reasons[0]


def test_named_nvcc_that_does_not_exist_is_incomplete(env, monkeypatch, tmp_path):
    _setenv(monkeypatch, "DSA_AOT_NVCC", str(tmp_path / "no" / "nvcc"))
    t = env.collect(nvcc=None)
    assert not t.complete and "does not exist" in t.incomplete_reasons[0]


def test_absent_packages_are_none_not_incomplete(env, tmp_path, monkeypatch):
    _setenv(monkeypatch, "CUDA_HOME", str(tmp_path / "no-toolkit"))  # resolve_nvcc() finds none
    t = env.collect(search_path=[str(tmp_path / "empty")], nvcc=None)
    assert t.complete
    assert (t.tilelang, t.tvm_ffi, t.cutlass_dsl, t.other_compilers, t.nvcc_version) == (None, None, (), (), None)


# --- the model itself ------------------------------------------------------------------------

def _features(**update) -> Features:
    base = Features(archs=("sm_100a", "sm_90a"), tilelang_importable=True, cutlass_dsl_importable=True,
                    cute_math_isfinite=True, tilelang_bool_fragment_ok={"sm_90a": True, "sm_100a": False},
                    nvcc_version="13.0.88", nvcc_archs={"sm_90a": True, "sm_100a": True},
                    errors={"tilelang_bool_fragment_ok[sm_100a]": "Cannot convert type boolx8"})
    return base.model_copy(update=update)


FIELD_CHANGES = {
    "schema_version": 3,
    "tilelang": Distribution(name="tilelang", version="0.1.15", content_sha256="0" * 64),
    "tvm_ffi": None,
    "cutlass_dsl": (),
    "cutlass_dsl_cuda": 12,
    "other_compilers": (Distribution(name="other-compiler", version="2.0", content_sha256="1" * 64),),
    "nvcc_version": "13.0.89",
    "cuda_driver_min": "13.1",
    "python_abi": "cpython-312",
    "host": "linux-aarch64",
    "features": _features().key_dict(),
    "complete": False,
    "incomplete_reasons": ("x",),
}


def test_every_field_is_in_the_fingerprint(env):
    assert set(FIELD_CHANGES) == set(Toolchain.model_fields), "a new field needs a key-coverage case"
    base = env.collect()
    prints = {base.fingerprint}
    for name, value in FIELD_CHANGES.items():
        assert getattr(base, name) != value, name
        prints.add(base.model_copy(update={name: value}).fingerprint)
    assert len(prints) == len(FIELD_CHANGES) + 1


def test_fingerprint_is_sha256_of_sorted_canonical_json(env):
    t = env.collect()
    text = t.canonical_json()
    assert list(json.loads(text)) == sorted(Toolchain.model_fields)
    assert t.fingerprint == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert Toolchain.model_validate_json(text) == t


def test_probe_results_change_fingerprint_but_error_text_does_not(env):
    base = env.collect()
    with_f = base.with_features(_features())
    flipped = base.with_features(_features(cute_math_isfinite=False))
    bool_fixed = base.with_features(_features(tilelang_bool_fragment_ok={"sm_90a": True, "sm_100a": True}))
    reworded = base.with_features(_features(errors={"x": "other text"}, toolchain="abc"))
    assert len({base.fingerprint, with_f.fingerprint, flipped.fingerprint, bool_fixed.fingerprint}) == 4
    assert reworded.fingerprint == with_f.fingerprint


def test_hash_sources_takes_explicit_paths(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("x = 1\n")
    assert hash_sources({"kernels/a.py": a}) == hash_sources([("kernels/a.py", b)])  # content, not path
    assert hash_sources({"kernels/a.py": a}) != hash_sources({"kernels/b.py": a})    # the name counts
    both = {"kernels/a.py": a, "kernels/b.py": b}
    assert hash_sources(both) == hash_sources(dict(reversed(list(both.items()))))
    b.write_text("x = 2\n")
    assert hash_sources(both) != hash_sources({"kernels/a.py": a, "kernels/b.py": a})


# --- nvcc resolution ------------------------------------------------------------------------

def test_resolve_nvcc_order(tmp_path):
    assert resolve_nvcc is toolkit_resolve_nvcc  # moved to dsa_aot.toolkit, still re-exported here
    toolkit = tmp_path / "cuda-12.8"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    linked = tmp_path / "local" / "bin"
    linked.mkdir(parents=True)
    (linked / "nvcc").symlink_to(toolkit / "bin" / "nvcc")
    assert resolve_nvcc({"DSA_AOT_NVCC": "/x/nvcc", "CUDA_HOME": str(toolkit)}) == Path("/x/nvcc")
    assert resolve_nvcc({"CUDA_HOME": str(toolkit), "PATH": str(linked)}) == toolkit / "bin" / "nvcc"
    assert resolve_nvcc({"CUDA_PATH": str(toolkit), "PATH": ""}) == toolkit / "bin" / "nvcc"
    # On PATH through a symlink: the real toolkit, unless the visible root has the headers.
    assert resolve_nvcc({"PATH": str(linked)}) == toolkit / "bin" / "nvcc"
    (linked.parent / "include").mkdir()
    (linked.parent / "include" / "cuda_runtime.h").write_text("")
    assert resolve_nvcc({"PATH": str(linked)}) == linked / "nvcc"


@pytest.mark.skipif(resolve_nvcc() is None, reason="no nvcc on this machine")
def test_version_files_agree_with_nvcc_itself():
    candidates = {resolve_nvcc(), Path("/usr/local/cuda/bin/nvcc")}
    for nvcc in sorted(p for p in candidates if p.exists()):
        cheap = tc.nvcc_version(nvcc)
        spawned = tc.nvcc_version(nvcc, spawn=True)
        assert cheap == spawned and spawned[1] is None, (nvcc, cheap, spawned)


# --- the real environment ---------------------------------------------------------------------

def test_current_is_memoized_and_matches_collect():
    assert Toolchain.current() is Toolchain.current()
    from dsa_aot.backends import declared_compilers

    # current() content-hashes every compiler a backend declares (e.g. the cudnn backend's frontend)
    assert Toolchain.current().fingerprint == Toolchain.collect(compilers=declared_compilers()).fingerprint


def test_current_in_fresh_process_imports_no_compiler():
    code = textwrap.dedent("""
        import json, sys, time
        from dsa_aot.specs.toolchain import Toolchain
        t0 = time.perf_counter()
        t = Toolchain.current()
        ms = (time.perf_counter() - t0) * 1e3
        heavy = sorted(m for m in sys.modules
                       if m.split(".")[0] in ("tilelang", "tvm", "tvm_ffi", "cutlass", "cudnn", "torch"))
        print(json.dumps({"fingerprint": t.fingerprint, "heavy": heavy, "ms": ms}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert result["fingerprint"] == Toolchain.current().fingerprint  # stable across processes


@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang not installed")
def test_importing_tilelang_does_not_change_the_key():
    # TileLang exports TL_TEMPLATE_PATH, TL_CUTLASS_PATH, TVM_LIBRARY_PATH at import; they point
    # into the installed package, so the key must stay complete and equal.
    code = textwrap.dedent("""
        import json
        from dsa_aot.specs.toolchain import Toolchain
        before = Toolchain.collect()
        import tilelang  # noqa: F401
        after = Toolchain.collect()
        print(json.dumps([before.fingerprint, after.fingerprint, after.complete, after.incomplete_reasons]))
    """)
    env = {k: v for k, v in os.environ.items() if k not in settings.TILELANG_PATH_VARS}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    before, after, complete, reasons = json.loads(out.stdout.strip().splitlines()[-1])
    assert complete, reasons
    assert before == after


def _digest_by_csv(text: str) -> str:
    """The documented rule, spelled the slow way: csv rows, skip, sort, sha256."""
    import csv

    rows = [(r + ["", ""])[:3] for r in csv.reader(text.splitlines()) if r and r[0]]
    kept = sorted(",".join(r) for r in rows if not tc._skipped_record_path(r[0]))
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()


@pytest.mark.parametrize("dist_name", ["tilelang", "apache-tvm-ffi", "pydantic"])
def test_record_digest_matches_csv_rule_on_installed_records(dist_name):
    import importlib.metadata as md

    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        pytest.skip(f"{dist_name} not installed")
    text = dist.read_text("RECORD")
    digest, problems = tc.record_digest(dist)
    assert problems == [] and digest == _digest_by_csv(text)


def test_record_digest_quoted_and_plain_lines_agree(env):
    """A quoted path (csv branch) and the substring filter give the same key for the same files."""
    import importlib.metadata as md

    record = env.dist_info("tilelang") / "RECORD"
    plain = record.read_text()
    extra = ["tilelang/deep/__pycache__/x.cpython-312.pyc,,", "tilelang/ext.cpython-312-x86_64-linux-gnu.so,sha256=e,1",
             "tilelang/ext.abi3.so,sha256=f,2", "/abs/script,sha256=g,3", "tilelang/a.pyo,sha256=h,4",
             "tilelang/so_data/file.txt,sha256=i,5"]
    record.write_text(plain + "\n".join(extra) + "\n")
    dist = md.PathDistribution(record.parent)
    fast, _ = tc.record_digest(dist)
    assert fast == _digest_by_csv(record.read_text())
    quoted = record.read_text() + '"tilelang/a,b.txt",sha256=j,6\n'
    record.write_text(quoted)
    slow, _ = tc.record_digest(dist)
    assert slow == _digest_by_csv(quoted) and slow != fast


# --- which CUDA build of the CuTe DSL the build uses ---------------------------------------------

def test_dsl_cuda_choice_follows_the_dsls_own_rule():
    assert installed.dsl_cuda_choice([12, 13], 13000) == 13
    assert installed.dsl_cuda_choice([13, 12], 13010) == 13
    assert installed.dsl_cuda_choice([12, 13], 12090) == 12  # a CUDA 12 driver cannot run cu13
    assert installed.dsl_cuda_choice([12, 13], None) == 13   # no driver (a CPU builder): the newest
    assert installed.dsl_cuda_choice([13], 12090) is None    # none usable: the DSL refuses to load
    assert installed.dsl_cuda_choice([], 13000) is None
    assert installed.dsl_cuda_majors(["nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13",
                                      "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-cu12"]) == (12, 13)


@pytest.mark.parametrize("driver, expect", [(None, 13), (13000, 13), (12090, 12), (11080, None)])
def test_toolchain_names_the_dsl_cuda_build_the_driver_selects(env, monkeypatch, driver, expect):
    assert env.collect().cutlass_dsl_cuda is None  # no libs-cu<N> installed: nothing to choose
    env.install("nvidia-cutlass-dsl-libs-cu12", "4.8.1", {"nvidia_cutlass_dsl/cu12/lib/a.so": b"\x7fELF 12"})
    env.install("nvidia-cutlass-dsl-libs-cu13", "4.8.1", {"nvidia_cutlass_dsl/cu13/lib/a.so": b"\x7fELF 13"})
    monkeypatch.setattr(tc, "driver_cuda_version", lambda: driver)
    t = env.collect()
    assert t.cutlass_dsl_cuda == expect and t.complete
    # the same packages on a host whose driver picks the other build: another fingerprint
    other = env.collect().model_copy(update={"cutlass_dsl_cuda": 12 if expect == 13 else 13})
    assert other.fingerprint != t.fingerprint


def test_build_key_names_the_dsl_cuda_build_for_dsl_backends_only():
    from dsa_aot.backends import BACKENDS
    from dsa_aot.identity import build_identity, recorded_compilers_agree
    from dsa_aot.specs.models import KernelSpec

    spec = KernelSpec(op="fwd", arch="sm_90a", d_qk=576, heads=64, layout="noncompact", backend="cutedsl")
    cu13 = Toolchain.current().model_copy(update={"cutlass_dsl_cuda": 13})
    cu12 = cu13.model_copy(update={"cutlass_dsl_cuda": 12})
    cute = BACKENDS["cutedsl"]
    assert build_identity(cute, spec, cu13).cutlass_dsl_cuda == 13
    assert build_identity(cute, spec, cu13).key() != build_identity(cute, spec, cu12).key()
    assert recorded_compilers_agree(cute, build_identity(cute, spec, cu13), cu13) is None
    why = recorded_compilers_agree(cute, build_identity(cute, spec, cu13), cu12)
    assert why is not None and "cu13" in why and "cu12" in why, why
    tl = BACKENDS["tilelang"]  # TileLang does not compile with the CuTe DSL: its key ignores it
    tl_spec = spec.model_copy(update={"backend": "tilelang"})
    assert build_identity(tl, tl_spec, cu13).cutlass_dsl_cuda is None
    assert build_identity(tl, tl_spec, cu13).key() == build_identity(tl, tl_spec, cu12).key()
