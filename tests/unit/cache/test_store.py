"""The disk store on a real filesystem: atomic publish, hashes, quarantine, gc, permissions."""

from __future__ import annotations

import os
import stat

import pytest

from dsa_aot.cache.store import (ArtifactStore, CacheError, CorruptArtifact, META, shared_writable_reason)

FP, ARCH, SID = "0123456789abcdef", "sm_90a", "fwd-sm_90a-d576-h64-compact-tilelang"


def test_publish_lookup_read(tmp_path):
    store = ArtifactStore(tmp_path)
    assert store.lookup(FP, ARCH, SID) is None
    entry = store.publish(FP, ARCH, SID, {"a.cubin": b"\x01\x02", "b.cu": b"src"}, {"x": 1})
    again = store.lookup(FP, ARCH, SID)
    assert again is not None and again.meta == entry.meta
    assert store.read_file(again, "a.cubin") == b"\x01\x02"
    assert again.meta.payload == {"x": 1}
    assert store.verify(again) == []
    assert sorted(p.name for p in entry.path.iterdir()) == ["a.cubin", "b.cu", META]
    assert not any((tmp_path / ".staging").iterdir())


def test_second_publish_keeps_first(tmp_path):
    store = ArtifactStore(tmp_path)
    first = store.publish(FP, ARCH, SID, {"a": b"one"})
    second = store.publish(FP, ARCH, SID, {"a": b"two"})
    assert second.meta == first.meta
    assert store.read_file(store.lookup(FP, ARCH, SID), "a") == b"one"


@pytest.mark.parametrize("damage", ["truncate", "flip", "replace"])
def test_damaged_file_is_refused(tmp_path, damage):
    store = ArtifactStore(tmp_path)
    entry = store.publish(FP, ARCH, SID, {"a.cubin": bytes(range(200))})
    path = entry.path / "a.cubin"
    data = path.read_bytes()
    path.write_bytes({"truncate": data[:100], "flip": bytes([data[0] ^ 1]) + data[1:],
                      "replace": b"x" * len(data)}[damage])
    with pytest.raises(CorruptArtifact, match="sha256 mismatch"):
        store.read_file(entry, "a.cubin")
    assert store.verify(entry)
    store.quarantine(entry, "test")
    assert store.lookup(FP, ARCH, SID) is None
    assert any((tmp_path / ".quarantine").iterdir())


def test_malformed_meta_is_a_quarantined_miss(tmp_path):
    store = ArtifactStore(tmp_path)
    entry = store.publish(FP, ARCH, SID, {"a": b"1"})
    (entry.path / META).write_text("{not json")
    assert store.lookup(FP, ARCH, SID) is None
    assert not entry.path.exists()


def test_hostile_names_are_rejected(tmp_path):
    store = ArtifactStore(tmp_path)
    for bad in ("../x", "/abs", "a/b", "..", ""):
        with pytest.raises(CacheError):
            store.entry_dir(FP, ARCH, bad)
        with pytest.raises(CacheError):
            store.publish(FP, ARCH, SID + "x", {bad: b"1"})
    assert not (tmp_path.parent / "x").exists()


def test_read_only_store_never_writes(tmp_path):
    ArtifactStore(tmp_path).publish(FP, ARCH, SID, {"a": b"1"})
    ro = ArtifactStore(tmp_path, read_only=True)
    assert ro.lookup(FP, ARCH, SID) is not None
    with pytest.raises(CacheError, match="read-only"):
        ro.publish(FP, ARCH, "other", {"a": b"1"})
    assert not ro.writable()


def test_gc_drops_other_fingerprints_then_lru(tmp_path):
    store = ArtifactStore(tmp_path)
    store.publish("ffffffffffffffff", ARCH, SID, {"a": b"x" * 100})
    old = store.publish(FP, ARCH, "old", {"a": b"x" * 100})
    new = store.publish(FP, ARCH, "new", {"a": b"x" * 100})
    store.record_hit(new)
    report = store.gc(FP, max_bytes=150)
    assert report.removed_fingerprints == ["ffffffffffffffff"]
    assert report.removed_entries == [old.key]
    assert store.lookup(FP, ARCH, "new") is not None and store.lookup(FP, ARCH, "old") is None
    assert store.stats(store.lookup(FP, ARCH, "new"))["hits"] == 1


def test_sweep_staging_removes_dead_builders(tmp_path):
    store = ArtifactStore(tmp_path)
    dead = tmp_path / ".staging" / "999999999-deadbeef"
    dead.mkdir(parents=True)
    (dead / "half.cubin").write_bytes(b"partial")
    live = tmp_path / ".staging" / f"{os.getpid()}-live"
    live.mkdir()
    assert store.sweep_staging() == 1
    assert not dead.exists() and live.exists()


def test_shared_writable_root_is_flagged(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    assert shared_writable_reason(root) is None
    root.chmod(root.stat().st_mode | stat.S_IWOTH)
    assert "world-writable" in shared_writable_reason(root)
