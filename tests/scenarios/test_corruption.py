"""Damaged, foreign or stale artifacts are refused before the driver sees a byte.

In-process, with the real ``TileLangBackend.load``: it reads each stage through the store's
sha256-checked reader and hands the bytes to ``CubinKernel``, which calls the CUDA driver
(``launch._libcuda``, spied on). This machine has no driver, so a good artifact fails there
(a logged miss, not quarantined); a bad one must fail earlier, in the hash check, be
quarantined with its reason, and never reach the driver.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil

import pytest
import torch

import _harness
from dsa_aot.loader import Loader

SPEC = _harness.spec()
DAMAGE = {
    "truncated": lambda data, other: data[: len(data) // 2],
    "bit_flipped": lambda data, other: data[:100] + bytes([data[100] ^ 0x04]) + data[101:],
    "zero_length": lambda data, other: b"",
    "replaced_by_another_variant": lambda data, other: other,  # a valid cubin, the wrong one
}


def _quarantined(root) -> dict[str, str]:
    q = root / ".quarantine"
    return {p.name: p.read_text() for p in q.glob("*.reason")} if q.is_dir() else {}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_cubin_is_refused_quarantined_and_rebuilt(inproc, damage, caplog):
    entry = inproc.publish(SPEC)
    other = inproc.publish(_harness.spec(heads=32))
    cubin = entry.path / "fwd.cubin"
    cubin.write_bytes(DAMAGE[damage](cubin.read_bytes(), (other.path / "fwd.cubin").read_bytes()))

    loader = Loader()
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        assert loader.try_load(SPEC, 0) is None
    assert inproc.driver_calls == []  # refused before any load attempt
    assert "sha256 mismatch" in caplog.text and f"refused {entry.key}" in caplog.text
    reasons = _quarantined(inproc.root)
    assert len(reasons) == 1 and "sha256 mismatch" in next(iter(reasons.values()))
    assert inproc.store().lookup(inproc.key(SPEC), SPEC.arch, SPEC.id) is None

    # The full chain: miss -> JIT rebuild (published, verified) -> load of the good bytes.
    inproc.seed_features()
    caplog.clear()
    expect_fallback = pytest.warns(RuntimeWarning, match="torch reference") if not torch.cuda.is_available() \
        else contextlib.nullcontext()
    with caplog.at_level(logging.INFO, logger="dsa_aot"), expect_fallback:
        kernel, res = loader.resolve("fwd", SPEC.arch, SPEC.d_qk, SPEC.heads, SPEC.layout, 0)
    assert len(inproc.builds()) == 3  # the two originals, then one rebuild
    rebuilt = inproc.store().lookup(inproc.key(SPEC), SPEC.arch, SPEC.id)
    assert rebuilt is not None and inproc.store().verify(rebuilt) == []
    assert inproc.driver_calls  # the rebuilt, intact artifact did reach the driver
    if not torch.cuda.is_available():  # no driver here: a logged fallback, not a crash
        assert res.source == "reference" and "libcuda" in " ".join(res.reasons)
    else:
        assert res.source.startswith("jit:")


def test_bit_flip_in_launch_record_is_refused(inproc, caplog):
    """meta.json's payload (grid, block, params) drives the launch: a flipped digit there must
    not be launched either, although every file hash still matches."""
    entry = inproc.publish(SPEC)
    meta_path = entry.path / "meta.json"
    text = meta_path.read_text()
    meta = json.loads(text)
    block = meta["payload"]["stages"][0]["record"]["block"]
    meta["payload"]["stages"][0]["record"]["block"] = [block[0] ^ 1, *block[1:]]  # 128 -> 129
    meta_path.write_text(json.dumps(meta, indent=1))

    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        assert Loader().try_load(SPEC, 0) is None
    assert inproc.driver_calls == []
    assert _quarantined(inproc.root)


def test_entry_copied_under_another_key_is_quarantined(inproc):
    a = inproc.publish(SPEC)
    h32 = _harness.spec(heads=32)
    b_dir = inproc.store().entry_dir(inproc.key(h32), h32.arch, h32.id)
    b_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(a.path, b_dir)
    assert Loader().try_load(_harness.spec(heads=32), 0) is None
    assert inproc.driver_calls == []
    assert any("names" in r for r in _quarantined(inproc.root).values())


def test_payload_of_another_spec_is_refused(inproc, caplog):
    """An entry filed under h32 whose payload and files are h16's (a buggy or hostile bundle can
    carry exactly this, with correct hashes) must not be served for h32."""
    h16 = inproc.publish(SPEC)
    store = inproc.store()
    files = {name: store.read_file(h16, name) for name in h16.meta.files}
    h32 = _harness.spec(heads=32)
    with store.lock(inproc.key(h32), h32.arch, h32.id):
        store.publish(inproc.key(h32), h32.arch, h32.id, files, h16.meta.payload)
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        assert Loader().try_load(h32, 0) is None
    assert inproc.driver_calls == []
    assert store.lookup(inproc.key(h32), h32.arch, h32.id) is None  # quarantined
    assert h16.key in caplog.text or SPEC.id in caplog.text


def test_other_toolchains_entries_are_never_used(inproc, caplog):
    """With the compilers installed only the exact build key is looked up: an entry of the same
    spec built by another TileLang (a self-consistent manifest under its own key), or filed under
    a key that is not its own, is stale: logged, not loaded, not quarantined."""
    from dsa_aot.artifact import ArtifactManifest
    from dsa_aot.backends import get
    from dsa_aot.identity import build_identity
    from dsa_aot.specs.toolchain import Distribution, Toolchain

    store = inproc.store()
    built = inproc.publish(SPEC)
    files = {name: store.read_file(built, name) for name in built.meta.files}
    shutil.rmtree(built.path)
    mine = Toolchain.current()
    other = mine.model_copy(update={"tilelang": Distribution(name="tilelang", version=mine.tilelang.version,
                                                             content_sha256="0" * 64)})
    theirs = build_identity(get("tilelang"), SPEC, other)
    assert theirs.key() != inproc.key(SPEC)
    manifest = ArtifactManifest.model_validate({**built.meta.payload, "key": theirs.key(),
                                                "build": theirs.model_dump(mode="json")})
    store.publish(theirs.key(), SPEC.arch, SPEC.id, files, manifest.model_dump(mode="json"))
    store.publish("0" * 16, SPEC.arch, SPEC.id, files, built.meta.payload)
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        assert Loader().try_load(SPEC, 0) is None
    assert inproc.driver_calls == [] and not _quarantined(inproc.root)
    assert "stale" in caplog.text


def test_incomplete_toolchain_neither_reads_nor_writes_the_disk_cache(inproc_cpu, caplog):
    """With a weakened key (an input could not be hashed) the disk cache is skipped both ways:
    an entry already filed under that key is not loaded (nor served by runtime identity, since
    the installed TileLang cannot be identified), and the fresh build stays in memory."""
    from dsa_aot.backends import get
    from dsa_aot.build import manifest_for
    from dsa_aot.specs.toolchain import Toolchain

    weak = Toolchain.current().model_copy(update={"complete": False, "incomplete_reasons": ("tilelang: editable install",)})
    store = inproc_cpu.store()
    backend = get("tilelang")
    built = backend.build(SPEC)
    manifest = manifest_for(backend, SPEC, weak, built)
    with store.lock(manifest.key, SPEC.arch, SPEC.id):
        store.publish(manifest.key, SPEC.arch, SPEC.id, built.files, manifest.model_dump(mode="json"))
    loader = Loader()
    loader._toolchain = weak
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        assert loader.try_load(SPEC, 0) is None
        kernel, source = loader.build_and_load(SPEC, 0)
    assert "editable install" in caplog.text
    assert source == "jit:memory" and len(inproc_cpu.builds()) == 2  # compiled again, not read back
    assert [s for s, _ in inproc_cpu.loaded] == [SPEC.id]
    assert [e.key for e in store.entries()] == [f"{manifest.key}/{SPEC.arch}/{SPEC.id}"]  # nothing new written
