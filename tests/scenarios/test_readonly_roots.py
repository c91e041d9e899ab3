"""A read-only prebuilt root (an image layer) is only ever read; misses JIT into the overlay.

These tests run as root, which ignores permission bits, so ``chmod a-w`` alone proves nothing.
Two ways are used: the loader's own contract (every ``DSA_AOT_PREBUILT_DIR`` root is opened
``read_only``), checked by digesting the whole tree before and after; and, where the test may
mount (CAP_SYS_ADMIN), a real read-only bind mount on which any write fails with EROFS.
"""

from __future__ import annotations

import logging
import subprocess
import warnings
from pathlib import Path

import pytest

import _harness
from dsa_aot.loader import Loader

HIT, MISS, BAD = (_harness.spec(heads=h) for h in (16, 32, 64))


def _image_layer(rig, src: Path) -> None:
    """Build the prebuilt root like an image build would, with one damaged entry, then chmod a-w."""
    for spec in (HIT, BAD):
        rig.publish(spec, root=src)
    bad = rig.store(src).lookup(rig.key(BAD), BAD.arch, BAD.id)
    cubin = bad.path / "fwd.cubin"
    data = cubin.read_bytes()
    cubin.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    subprocess.run(["chmod", "-R", "a-w", str(src)], check=True)


def _check_overlay_behaviour(rig, prebuilt: Path, caplog) -> None:
    before = _harness.tree_digest(prebuilt)
    loader = Loader()
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        kernel, source, rule = loader.try_load(HIT, 0)
        assert source == f"prebuilt:{prebuilt}" and kernel.spec_id == HIT.id  # a hit loads
        assert rule == "build key"

        assert loader.try_load(MISS, 0) is None  # a miss JIT-compiles into the writable overlay
        kernel, source = loader.build_and_load(MISS, 0)
        assert source == f"jit:{rig.root}"

        assert loader.try_load(BAD, 0) is None  # a damaged prebuilt entry is refused ...
        assert "sha256 mismatch" in caplog.text
        kernel, source = loader.build_and_load(BAD, 0)  # ... and replaced in the overlay
        assert source == f"jit:{rig.root}"
        kernel, source, rule = Loader().try_load(BAD, 0)
        assert source == f"cache:{rig.root}"

    assert [s for s, _ in rig.loaded] == [HIT.id, MISS.id, BAD.id, BAD.id]
    assert _harness.tree_digest(prebuilt) == before  # not one byte written, moved or created
    for spec in (MISS, BAD):
        entry = rig.store().lookup(rig.key(spec), spec.arch, spec.id)
        assert entry is not None and rig.store().verify(entry) == []


def test_prebuilt_root_is_read_only_by_contract(inproc_cpu, scoped_settings, tmp_path, caplog):
    prebuilt = tmp_path / "image"
    _image_layer(inproc_cpu, prebuilt)
    scoped_settings(DSA_AOT_CACHE_DIR=str(inproc_cpu.root), DSA_AOT_PREBUILT_DIR=str(prebuilt))
    _check_overlay_behaviour(inproc_cpu, prebuilt, caplog)


def test_prebuilt_root_on_a_read_only_mount(inproc_cpu, scoped_settings, mounts, tmp_path, caplog):
    src = tmp_path / "image-src"
    _image_layer(inproc_cpu, src)
    prebuilt = mounts.read_only_bind(src, tmp_path / "image")
    assert subprocess.run(["touch", str(prebuilt / "probe")], capture_output=True).returncode != 0  # EROFS
    scoped_settings(DSA_AOT_CACHE_DIR=str(inproc_cpu.root), DSA_AOT_PREBUILT_DIR=str(prebuilt))
    _check_overlay_behaviour(inproc_cpu, prebuilt, caplog)


@pytest.fixture
def unwritable_cache(inproc_cpu, mounts, tmp_path) -> Path:
    """A cache root nobody can write: a read-only mount where possible, else a path under a file."""
    try:
        src = tmp_path / "ro-src"
        src.mkdir()
        return mounts.read_only_bind(src, tmp_path / "ro")
    except pytest.skip.Exception:
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        return blocker / "cache"  # mkdir fails with ENOTDIR, even for root


def test_no_writable_location_falls_back_without_crashing(inproc_cpu, scoped_settings, unwritable_cache,
                                                          tmp_path, caplog):
    prebuilt = tmp_path / "image"
    _image_layer(inproc_cpu, prebuilt)
    scoped_settings(DSA_AOT_CACHE_DIR=str(unwritable_cache), DSA_AOT_PREBUILT_DIR=str(prebuilt))
    loader = Loader()
    assert loader.writable_store() is None
    with caplog.at_level(logging.INFO, logger="dsa_aot"), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        kernel, res = loader.resolve("fwd", HIT.arch, HIT.d_qk, HIT.heads, HIT.layout, 0)
        assert res.source == f"prebuilt:{prebuilt}"  # hits still load
        kernel, res = loader.resolve("fwd", MISS.arch, MISS.d_qk, MISS.heads, MISS.layout, 0)
        assert res.source == "jit:memory", res.reasons  # a miss compiles, in memory only
        assert "in memory only" in caplog.text
    assert not (unwritable_cache / ".staging").exists()

    scoped_settings(DSA_AOT_JIT="0")
    with pytest.warns(RuntimeWarning, match="torch reference"):
        kernel, res = Loader().resolve("fwd", BAD.arch, BAD.d_qk, BAD.heads, BAD.layout, 0)
    assert res.source == "reference" and "DSA_AOT_JIT=0" in res.reasons[0]
