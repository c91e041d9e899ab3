"""Which stored entry of a spec the loader may serve, by what is installed in the process.

* The spec's compilers (and the CUDA toolkit) installed: only the exact build key is looked up;
  an entry of the same spec built by another toolchain is stale (logged, never served).
* Not installed (a serving image): the newest entry whose recorded runtime identity (our load
  code, the spec's kernel sources, arch, host) equals this process's, and whose builder used
  the same version and content of every compiler part installed here (e.g. the same TileLang
  in an image without nvcc). Any other entry is refused, with the reason logged.

Entries here carry real v2 manifests (identities computed by :mod:`dsa_aot.identity`) over a
stand-in cubin; the backend's ``load`` is replaced by a recorder, so the rule is observed
without a GPU.
"""

from __future__ import annotations

import logging
import shutil

import pytest

from dsa_aot.cache.store import ArtifactStore
from dsa_aot.identity import build_identity, can_key_builds, runtime_identity
from dsa_aot.specs.keys import RuntimeIdentity
from dsa_aot.specs.toolchain import Distribution, Toolchain
from stored_entries import CUBIN, SPEC, loader_with, manifest, publish



@pytest.fixture
def loads(backend, monkeypatch) -> list:
    """Replace the backend's load: record (spec id, cubin bytes as read through the store)."""
    calls: list = []

    def load(manifest, read, device_index):
        calls.append((manifest.spec.id, read(manifest.stages[0].file)))
        return f"kernel:{manifest.spec.id}"

    monkeypatch.setattr(backend, "load", load)
    return calls


def _other_tilelang(toolchain: Toolchain) -> Toolchain:
    """The same TileLang version with other content (a rebuilt or patched install)."""
    tl = toolchain.tilelang
    return toolchain.model_copy(update={"tilelang": Distribution(name=tl.name, version=tl.version,
                                                                 content_sha256="0" * 64)})


# --- (a) the compilers are installed: the exact build key only -------------------------------

def test_installed_compilers_look_up_the_exact_key(cache_root, backend, builder, loads):
    store = ArtifactStore(cache_root)
    mine = publish(store, manifest(backend, builder))
    publish(store, manifest(backend, _other_tilelang(builder)), b"\x7fELF other build")  # newer
    loader = loader_with(builder)
    assert loader.key_of(SPEC) == build_identity(backend, SPEC, builder).key() == mine.meta.fingerprint
    match = loader.find(store, SPEC)
    assert match is not None and match.rule == "build key" and match.entry.path == mine.path
    kernel, source, rule = loader.try_load(SPEC, 0)
    assert (kernel, source, rule) == (f"kernel:{SPEC.id}", f"cache:{cache_root}", "build key")
    assert loads == [(SPEC.id, CUBIN)]


@pytest.mark.parametrize("other", ["tilelang content", "tvm-ffi version", "nvcc version"])
def test_another_toolchains_entry_is_stale(cache_root, backend, builder, loads, caplog, other):
    """Same spec, same sources and runtime identity, built by another toolchain: a miss."""
    theirs = {
        "tilelang content": _other_tilelang(builder),
        "tvm-ffi version": builder.model_copy(update={"tvm_ffi": builder.tvm_ffi.model_copy(
            update={"version": "0.0.1"})}),
        "nvcc version": builder.model_copy(update={"nvcc_version": "12.8.93", "cuda_driver_min": "12.8"}),
    }[other]
    store = ArtifactStore(cache_root)
    stale = publish(store, manifest(backend, theirs))
    assert stale.meta.fingerprint != build_identity(backend, SPEC, builder).key()
    assert runtime_identity(backend, SPEC).mismatch(
        RuntimeIdentity.model_validate(stale.meta.payload["runtime"])) is None  # would match by runtime
    loader = loader_with(builder)
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        assert loader.find(store, SPEC) is None
        assert loader.try_load(SPEC, 0) is None
    assert f"stale: {stale.key}" in caplog.text
    assert loads == [] and store.quarantined() == []  # not loaded, not damaged either


# --- (b) the backend's compiler is not installed: runtime identity -----------------------------

@pytest.fixture
def no_compiler(backend, builder, monkeypatch) -> Toolchain:
    """A process without TileLang: find_spec of the compiler module finds nothing."""
    monkeypatch.setattr(backend, "compiler_module", "dsa_aot_test_no_such_compiler")
    assert backend.missing_compiler() is not None
    return builder.model_copy(update={"tilelang": None})


def test_without_the_compiler_the_runtime_identity_is_served(cache_root, backend, builder, no_compiler, loads,
                                                             caplog):
    store = ArtifactStore(cache_root)
    entry = publish(store, manifest(backend, builder))
    loader = loader_with(no_compiler)
    assert loader.key_of(SPEC) is None
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        match = loader.find(store, SPEC)
        assert match is not None and match.rule == "runtime identity" and match.entry.path == entry.path
        kernel, source, rule = loader.try_load(SPEC, 0)
    assert (source, rule) == (f"cache:{cache_root}", "runtime identity")
    assert loads == [(SPEC.id, CUBIN)]
    assert f"serving {entry.key} by runtime identity" in caplog.text and "is not installed" in caplog.text


@pytest.mark.parametrize("field,value,words", [
    ("kernel_sha256", "0" * 64, "kernel_sha256 differs"),    # other kernel sources
    ("runtime_sha256", "1" * 64, "runtime_sha256 differs"),  # other dsa-aot load code
    ("host", "linux-aarch64", "host differs"),               # other host
])
def test_without_the_compiler_another_runtime_identity_is_refused(cache_root, backend, builder, no_compiler,
                                                                  loads, caplog, field, value, words):
    store = ArtifactStore(cache_root)
    good = publish(store, manifest(backend, builder))
    foreign = runtime_identity(backend, SPEC).model_copy(update={field: value})
    edited = "dsa_aot/kernels/tilelang_fwd.py" if field != "runtime_sha256" else "dsa_aot/backends/tilelang/build.py"
    bad = publish(store, manifest(backend, builder, runtime=foreign, edited=edited), b"\x7fELF foreign")  # newer
    assert bad.meta.fingerprint != good.meta.fingerprint
    loader = loader_with(no_compiler)
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        match = loader.find(store, SPEC)
    assert match is not None and match.entry.path == good.path  # the newer, foreign one is skipped
    assert f"not serving {bad.key}: its {words}" in caplog.text

    shutil.rmtree(good.path)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        assert loader_with(no_compiler).try_load(SPEC, 0) is None  # only the foreign one left: refused
    assert f"not serving {bad.key}: its {words}" in caplog.text
    assert loads == []


def test_without_the_compiler_an_entry_without_identities_is_refused(cache_root, backend, no_compiler, loads,
                                                                    caplog):
    store = ArtifactStore(cache_root)
    old = store.publish("0123456789abcdef", SPEC.arch, SPEC.id, {"fwd.cubin": CUBIN}, {"fingerprint": "x"})
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        assert loader_with(no_compiler).try_load(SPEC, 0) is None
    assert f"not serving {old.key}: its manifest records no runtime identity" in caplog.text
    assert loads == []


# --- (c) TileLang installed, no CUDA toolkit -------------------------------------------------

@pytest.fixture
def no_nvcc(builder) -> Toolchain:
    return builder.model_copy(update={"nvcc_version": None, "cuda_driver_min": None})


def test_same_tilelang_without_nvcc_is_served_by_runtime_identity(cache_root, backend, builder, no_nvcc, loads,
                                                                  caplog):
    assert backend.missing_compiler() is None and "nvcc" in can_key_builds(backend, no_nvcc)
    store = ArtifactStore(cache_root)
    entry = publish(store, manifest(backend, builder))
    loader = loader_with(no_nvcc)
    assert loader.key_of(SPEC) is None
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        kernel, source, rule = loader.try_load(SPEC, 0)
    assert rule == "runtime identity" and loads == [(SPEC.id, CUBIN)]
    assert f"serving {entry.key} by runtime identity (no CUDA toolkit" in caplog.text


@pytest.mark.parametrize("other,words", [
    ("tilelang content", "built with tilelang {v} of other content"),
    ("tilelang version", "built with tilelang 0.1.13"),
    ("no tilelang", "built without tilelang"),
])
def test_other_tilelang_without_nvcc_is_refused(cache_root, backend, builder, no_nvcc, loads, caplog, other,
                                                words):
    tl = builder.tilelang
    theirs = {
        "tilelang content": _other_tilelang(builder),
        "tilelang version": builder.model_copy(update={"tilelang": tl.model_copy(update={"version": "0.1.13"})}),
        "no tilelang": builder.model_copy(update={"tilelang": None}),
    }[other]
    store = ArtifactStore(cache_root)
    entry = publish(store, manifest(backend, theirs))
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        assert loader_with(no_nvcc).try_load(SPEC, 0) is None
    assert f"not serving {entry.key}: {words.format(v=tl.version)}, tilelang {tl.version} is installed here" \
        in caplog.text
    assert loads == []


def test_unidentifiable_tilelang_without_nvcc_is_refused(cache_root, backend, builder, no_nvcc, loads, caplog):
    """An installed TileLang whose content cannot be read (an editable install) vouches for nothing."""
    store = ArtifactStore(cache_root)
    entry = publish(store, manifest(backend, builder))
    weak = no_nvcc.model_copy(update={"complete": False, "incomplete_reasons": ("tilelang: editable install",)})
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        assert loader_with(weak).try_load(SPEC, 0) is None
    assert f"not serving {entry.key}: tilelang installed here cannot be identified" in caplog.text
    assert loads == []


# --- the driver floor -----------------------------------------------------------------------------

@pytest.mark.parametrize("driver, served", [(12040, False), (13000, True), (None, True)])
def test_an_entry_for_a_newer_cuda_than_the_driver_is_a_logged_miss(cache_root, backend, builder, loads,
                                                                    caplog, monkeypatch, driver, served):
    import dsa_aot.loader as loader_module

    cuda13 = builder.model_copy(update={"cuda_driver_min": "13.0"})
    store = ArtifactStore(cache_root)
    entry = publish(store, manifest(backend, cuda13))
    monkeypatch.setattr(loader_module, "driver_cuda_version", lambda: driver)
    loader = loader_with(builder)
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        got = loader.try_load(SPEC, 0)
    if served:
        assert got is not None and loads == [(SPEC.id, CUBIN)]
        return
    assert got is None and loads == [] and store.quarantined() == []  # a miss, the entry intact
    assert (f"not loading {entry.key}: built with the CUDA 13.0 toolkit, and this NVIDIA driver "
            "supports CUDA 12.4 at most: update the driver") in caplog.text
