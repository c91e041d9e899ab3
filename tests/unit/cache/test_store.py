"""The disk store on a real filesystem: atomic publish, hashes, quarantine, gc, permissions.

The first path component is a spec's build key; to the store it is an opaque name."""

from __future__ import annotations

import os
import stat

import pytest

from dsa_aot.cache.store import (ArtifactStore, CacheError, CorruptArtifact, META, shared_writable_reason)

KEY, ARCH, SID = "0123456789abcdef", "sm_90a", "fwd-sm_90a-d576-h64-compact-tilelang"


def test_publish_lookup_read(tmp_path):
    store = ArtifactStore(tmp_path)
    assert store.lookup(KEY, ARCH, SID) is None
    entry = store.publish(KEY, ARCH, SID, {"a.cubin": b"\x01\x02", "b.cu": b"src"}, {"x": 1})
    again = store.lookup(KEY, ARCH, SID)
    assert again is not None and again.meta == entry.meta
    assert store.read_file(again, "a.cubin") == b"\x01\x02"
    assert again.meta.payload == {"x": 1}
    assert store.verify(again) == []
    assert sorted(p.name for p in entry.path.iterdir()) == ["a.cubin", "b.cu", META]
    assert not any((tmp_path / ".staging").iterdir())


def test_second_publish_keeps_first(tmp_path):
    store = ArtifactStore(tmp_path)
    first = store.publish(KEY, ARCH, SID, {"a": b"one"})
    second = store.publish(KEY, ARCH, SID, {"a": b"two"})
    assert second.meta == first.meta
    assert store.read_file(store.lookup(KEY, ARCH, SID), "a") == b"one"


@pytest.mark.parametrize("damage", ["truncate", "flip", "replace"])
def test_damaged_file_is_refused(tmp_path, damage):
    store = ArtifactStore(tmp_path)
    entry = store.publish(KEY, ARCH, SID, {"a.cubin": bytes(range(200))})
    path = entry.path / "a.cubin"
    data = path.read_bytes()
    path.write_bytes({"truncate": data[:100], "flip": bytes([data[0] ^ 1]) + data[1:],
                      "replace": b"x" * len(data)}[damage])
    with pytest.raises(CorruptArtifact, match="sha256 mismatch"):
        store.read_file(entry, "a.cubin")
    assert store.verify(entry)
    store.quarantine(entry, "test")
    assert store.lookup(KEY, ARCH, SID) is None
    assert any((tmp_path / ".quarantine").iterdir())


def test_malformed_meta_is_a_quarantined_miss(tmp_path):
    store = ArtifactStore(tmp_path)
    entry = store.publish(KEY, ARCH, SID, {"a": b"1"})
    (entry.path / META).write_text("{not json")
    assert store.lookup(KEY, ARCH, SID) is None
    assert not entry.path.exists()


def test_hostile_names_are_rejected(tmp_path):
    store = ArtifactStore(tmp_path)
    for bad in ("../x", "/abs", "a/b", "..", ""):
        with pytest.raises(CacheError):
            store.entry_dir(KEY, ARCH, bad)
        with pytest.raises(CacheError):
            store.publish(KEY, ARCH, SID + "x", {bad: b"1"})
    assert not (tmp_path.parent / "x").exists()


def test_read_only_store_never_writes(tmp_path):
    ArtifactStore(tmp_path).publish(KEY, ARCH, SID, {"a": b"1"})
    ro = ArtifactStore(tmp_path, read_only=True)
    assert ro.lookup(KEY, ARCH, SID) is not None
    with pytest.raises(CacheError, match="read-only"):
        ro.publish(KEY, ARCH, "other", {"a": b"1"})
    assert not ro.writable()


def test_gc_drops_other_keys_then_lru(tmp_path):
    store = ArtifactStore(tmp_path)
    store.publish("ffffffffffffffff", ARCH, SID, {"a": b"x" * 100})
    old = store.publish(KEY, ARCH, "old", {"a": b"x" * 100})
    new = store.publish(KEY, ARCH, "new", {"a": b"x" * 100})
    store.record_hit(new)
    report = store.gc(KEY, max_bytes=150)
    assert report.removed_fingerprints == ["ffffffffffffffff"]
    assert report.removed_entries == [old.key]
    assert store.lookup(KEY, ARCH, "new") is not None and store.lookup(KEY, ARCH, "old") is None
    assert store.stats(store.lookup(KEY, ARCH, "new"))["hits"] == 1


def test_gc_keeps_a_set_of_keys_or_none(tmp_path):
    store = ArtifactStore(tmp_path)
    keys = ["1111111111111111", "2222222222222222", "3333333333333333"]
    for key in keys:
        store.publish(key, ARCH, SID, {"a": b"x"})
    store.features_path(KEY).parent.mkdir(parents=True)
    store.features_path(KEY).write_text("{}")
    report = store.gc(iter(keys[:2]))  # any iterable of keys
    assert report.removed_fingerprints == [keys[2]] and store.keys() == keys[:2]
    report = store.gc(None)  # None keeps no key
    assert report.removed_fingerprints == keys[:2] and store.keys() == []
    assert store.features_path(KEY).read_text() == "{}"  # the store's own folders stay


def test_keys_candidates_and_quarantined(tmp_path):
    store = ArtifactStore(tmp_path)
    first = store.publish("1111111111111111", ARCH, SID, {"a": b"1"})
    second = store.publish("2222222222222222", ARCH, SID, {"a": b"2"})
    store.publish("2222222222222222", ARCH, "other-spec", {"a": b"3"})
    store.features_path(KEY).parent.mkdir(parents=True)
    assert store.features_path(KEY) == tmp_path / ".features" / f"{KEY}.json"
    assert store.keys() == ["1111111111111111", "2222222222222222"]  # dot-folders are not keys
    assert [e.key for e in store.candidates(ARCH, SID)] == [second.key, first.key]  # newest first
    assert list(store.candidates("sm_100a", SID)) == []
    store.quarantine(second, "test")
    assert [e.key for e in store.candidates(ARCH, SID)] == [first.key]
    assert [n for n in store.quarantined() if not n.endswith(".reason")] and \
        all(n.startswith(f"2222222222222222.{ARCH}.{SID}.") for n in store.quarantined())
    with pytest.raises(CacheError):
        store.features_path("../x")


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
