"""The serving path (:mod:`dsa_aot.serving`) serves a prebuilt entry only when the loader would
serve that same entry to this process, and leaves every other case to the loader.

Entries carry real v2 manifests (identities computed by :mod:`dsa_aot.identity`) over a stand-in
cubin, published into a real prebuilt root; the backend's ``load_sealed`` (and ``load``, for the
loader) is replaced by a recorder, so the decision is observed without a GPU. "No compiler
installed" is made the way the loader's own tests make it: the backend's compiler distribution
and module names point at nothing. The fresh-process, compiler-free check (a serving venv, no
pydantic imported) is in ``test_lean_runtime_image.py``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from dsa_aot import serving, settings
from dsa_aot.cache.store import ArtifactStore
from dsa_aot.identity import runtime_identity
from dsa_aot.specs.toolchain import Toolchain
from stored_entries import CUBIN, SPEC, loader_with, manifest, publish

CALL = ("fwd", "sm_90a", 576, 64, "noncompact")


@pytest.fixture
def roots(tmp_path, monkeypatch, cache_root, backend) -> tuple[ArtifactStore, Path]:
    """A prebuilt root (an image layer) and the writable cache; only TileLang ranked."""
    prebuilt = tmp_path / "prebuilt"
    monkeypatch.setenv("DSA_AOT_PREBUILT_DIR", str(prebuilt))
    monkeypatch.setenv("DSA_AOT_BACKENDS", "tilelang")
    for var in ("DSA_AOT_REMOTE_URL", "DSA_AOT_TRUSTED_KEYS", "DSA_AOT_ALLOW_SHARED_CACHE"):
        monkeypatch.delenv(var, raising=False)
    settings.reload()
    yield ArtifactStore(prebuilt), cache_root
    settings.reload()


@pytest.fixture
def no_compiler(backend, builder, monkeypatch) -> Toolchain:
    """A process without TileLang: no distribution of its name, no importable module."""
    monkeypatch.setattr(backend, "compiler_module", "dsa_aot_test_no_such_compiler")
    monkeypatch.setattr(backend, "compilers", ("dsa-aot-test-no-such-compiler", "dsa-aot-test-no-such-ffi"))
    serving.reset()
    yield builder.model_copy(update={"tilelang": None, "tvm_ffi": None})
    monkeypatch.undo()
    serving.reset()


@pytest.fixture
def loads(backend, monkeypatch) -> list:
    """The backend's loads, recorded: (path taken, spec id, bytes read through the checks)."""
    calls: list = []

    def load_sealed(spec, stages, read, device_index, digests=None):
        calls.append(("serving", spec.id, read(stages[0].file), dict(digests or {})))
        return f"kernel:{spec.id}"

    def load(manifest, read, device_index):
        calls.append(("loader", manifest.spec.id, read(manifest.stages[0].file), {}))
        return f"kernel:{manifest.spec.id}"

    monkeypatch.setattr(backend, "load_sealed", load_sealed)
    monkeypatch.setattr(backend, "load", load)
    return calls


def _rewrite_meta(entry, edit) -> None:
    path = entry.path / "meta.json"
    meta = json.loads(path.read_text())
    edit(meta)
    os.chmod(path, 0o644)
    path.write_text(json.dumps(meta))


# --- served: the entry the loader would serve, every byte checked ---------------------------

def test_a_prebuilt_entry_of_this_runtime_identity_is_served(roots, backend, builder, no_compiler, loads, caplog):
    prebuilt, _ = roots
    entry = publish(prebuilt, manifest(backend, builder))
    assert serving.why_not(*CALL) is None
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        kernel, source = serving.serve(*CALL, 0)
    assert (kernel, source) == (f"kernel:{SPEC.id}", f"prebuilt:{prebuilt.root}")
    assert loads == [("serving", SPEC.id, CUBIN, {"fwd.cubin": entry.meta.files["fwd.cubin"].sha256})]
    assert f"serving {entry.key} by runtime identity (no tilelang compiler installed" in caplog.text

    # the loader, in the same situation, serves the same entry by the same rule
    match = loader_with(no_compiler).find(prebuilt, SPEC)
    assert match is not None and match.rule == "runtime identity" and match.entry.path == entry.path


def test_the_loaded_spec_is_the_entrys(roots, backend, builder, no_compiler, loads):
    prebuilt, _ = roots
    publish(prebuilt, manifest(backend, builder))
    serving.serve(*CALL, 0)
    (_, spec_id, _, _), = loads
    assert spec_id == SPEC.id


def test_the_next_ranked_backend_is_served_when_the_first_has_nothing_stored(roots, backend, builder, no_compiler,
                                                                             loads, monkeypatch, caplog):
    prebuilt, _ = roots
    publish(prebuilt, manifest(backend, builder))
    monkeypatch.setenv("DSA_AOT_BACKENDS", "cutedsl,tilelang")  # nothing of cutedsl is stored
    settings.reload()
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        kernel, _ = serving.serve(*CALL, 0)
    assert kernel == f"kernel:{SPEC.id}"
    assert "fwd-sm_90a-d576-h64-noncompact-cutedsl is not stored; using the stored " + SPEC.id in caplog.text


def test_nothing_stored_is_none_and_the_loader_decides(roots, no_compiler, loads):
    assert serving.serve(*CALL, 0) is None and serving.why_not(*CALL) == "no ranked backend has an entry stored"
    assert loads == []


# --- left to the loader ------------------------------------------------------------------------

def test_with_the_compiler_installed_the_loader_looks_the_build_key_up(roots, backend, builder, loads):
    prebuilt, _ = roots
    publish(prebuilt, manifest(backend, builder))
    serving.reset()
    assert "tilelang" in (serving.why_not(*CALL) or "")
    assert serving.serve(*CALL, 0) is None and loads == []


@pytest.mark.parametrize("field,value", [("kernel_sha256", "0" * 64), ("runtime_sha256", "1" * 64),
                                         ("host", "linux-aarch64")])
def test_another_runtime_identity_is_left_to_the_loader(roots, backend, builder, no_compiler, loads, field, value):
    prebuilt, _ = roots
    foreign = runtime_identity(backend, SPEC).model_copy(update={field: value})
    publish(prebuilt, manifest(backend, builder, runtime=foreign))
    assert "another runtime identity" in serving.why_not(*CALL)
    assert serving.serve(*CALL, 0) is None and loads == []
    assert loader_with(no_compiler).find(prebuilt, SPEC) is None  # the loader refuses it too


def test_another_nvcc_is_left_to_the_loader(roots, backend, builder, no_compiler, loads):
    prebuilt, _ = roots
    publish(prebuilt, manifest(backend, builder.model_copy(update={"nvcc_version": "12.0.76"})))
    assert "built with nvcc 12.0.76" in serving.why_not(*CALL)
    assert serving.serve(*CALL, 0) is None and loads == []


def test_a_tampered_payload_is_left_to_the_loader(roots, backend, builder, no_compiler, loads):
    prebuilt, _ = roots
    entry = publish(prebuilt, manifest(backend, builder))
    _rewrite_meta(entry, lambda m: m["payload"]["stages"][0]["record"].update(block=[1024, 1, 1]))
    assert "payload digest" in serving.why_not(*CALL)
    assert serving.serve(*CALL, 0) is None and loads == []


def test_a_corrupt_file_is_left_to_the_loader(roots, backend, builder, no_compiler, loads, caplog):
    prebuilt, _ = roots
    entry = publish(prebuilt, manifest(backend, builder))
    cubin = entry.path / "fwd.cubin"
    os.chmod(cubin, 0o644)
    cubin.write_bytes(b"\x7fELF other bytes!!!")
    assert serving.why_not(*CALL) is None  # the bytes are checked when read
    assert serving.serve(*CALL, 0) is None and loads == []
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        assert loader_with(no_compiler).try_load(SPEC, 0) is None  # the loader refuses and says why
    assert "sha256 mismatch" in caplog.text


def test_an_entry_in_the_writable_cache_only_is_left_to_the_loader(roots, backend, builder, no_compiler, loads):
    _, cache = roots
    publish(ArtifactStore(cache), manifest(backend, builder))
    assert "writable cache only" in serving.why_not(*CALL)
    assert serving.serve(*CALL, 0) is None and loads == []


@pytest.mark.parametrize("var,value,words", [
    ("DSA_AOT_REMOTE_URL", "redis://127.0.0.1:1/0", "remote tier"),
    ("DSA_AOT_TRUSTED_KEYS", "/nonexistent/key.pub", "trusted keys"),
])
def test_a_remote_tier_or_trusted_keys_leave_it_to_the_loader(roots, backend, builder, no_compiler, loads,
                                                              monkeypatch, var, value, words):
    prebuilt, _ = roots
    publish(prebuilt, manifest(backend, builder))
    monkeypatch.setenv(var, value)
    try:
        settings.reload()
    except ValueError as exc:  # a settings check refuses the value itself: nothing to serve from
        pytest.skip(str(exc))
    assert words in serving.why_not(*CALL)
    assert serving.serve(*CALL, 0) is None and loads == []


def test_a_group_writable_entry_is_left_to_the_loader(roots, backend, builder, no_compiler, loads):
    prebuilt, _ = roots
    entry = publish(prebuilt, manifest(backend, builder))
    os.chmod(entry.path, 0o775)
    assert "writable by others" in serving.why_not(*CALL)
    assert serving.serve(*CALL, 0) is None and loads == []


def test_a_newer_foreign_entry_beside_a_good_one_is_left_to_the_loader(roots, backend, builder, no_compiler,
                                                                       loads):
    """The loader skips the newer foreign entry (and logs why); the serving path does not guess."""
    prebuilt, _ = roots
    good = publish(prebuilt, manifest(backend, builder))
    foreign = runtime_identity(backend, SPEC).model_copy(update={"host": "linux-aarch64"})
    publish(prebuilt, manifest(backend, builder.model_copy(update={"host": "linux-aarch64"}), runtime=foreign))
    assert serving.serve(*CALL, 0) is None and loads == []
    match = loader_with(no_compiler).find(prebuilt, SPEC)
    assert match is not None and match.entry.path == good.path


@pytest.mark.parametrize("mode,heads,deferred", [("auto", 64, True), ("auto", 128, True), ("auto", 16, True),
                                                 ("auto", 32, True), ("fixed_point", 16, True),
                                                 ("stored_rows", 128, False), ("stored_rows", 16, False)])
def test_a_deterministic_call_served_in_fixed_point_is_left_to_the_loader(roots, no_compiler, loads, mode,
                                                                          heads, deferred):
    """Its spec carries a flavour (the backend's call flavour), which the serving path does not
    resolve: ``auto`` serves every head count in fixed point."""
    with settings.scope(deterministic_mode=mode):
        why = serving.why_not("bwd", "sm_90a", 576, heads, "noncompact", deterministic=True)
        assert (why == f"deterministic_mode={mode} at {heads} heads (a spec with a flavour)") is deferred, why
        assert serving.why_not("bwd", "sm_90a", 576, heads, "noncompact") == "no ranked backend has an entry stored"
    assert settings.deterministic_mode_for("auto", 16) == "fixed_point"
    assert settings.deterministic_mode_for("auto", 128) == "fixed_point"
    assert settings.deterministic_mode_for("stored_rows", 128) == "stored_rows"
