"""The remote store's own contract on a real server: leases, TTLs, names, a missing client."""

from __future__ import annotations

import sys
import time

import pytest

from dsa_aot.cache.remote import PREFIX, RemoteError, RemoteManifest, RemoteStore
from dsa_aot.cache.store import ArtifactStore


def _entry(tmp_path, spec_id="spec-a", payload=None):
    store = ArtifactStore(tmp_path / "local")
    return store, store.publish("k1", "sm_90a", spec_id, {"a.bin": b"a" * 3000}, payload or {"x": 1})


def test_lease_is_exclusive_renewable_and_released_only_by_its_holder(redis_server):
    remote = RemoteStore(redis_server.url, writable=True)
    first, second = (remote.lease("k1", "sm_90a", "spec-a", 0.5) for _ in range(2))
    assert first.acquire() and not second.acquire()
    assert first.holder().token == first.record.token
    assert not second.release() and first.holder() is not None  # not the holder: nothing dropped
    time.sleep(0.3)
    assert first.renew()
    time.sleep(0.3)
    assert not second.acquire()  # renewed: still held past the first 0.5 s
    assert first.release() and second.acquire() and second.release()
    crashed = remote.lease("k1", "sm_90a", "spec-b", 0.3)
    assert crashed.acquire()  # never released: it expires by itself
    time.sleep(0.45)
    late = remote.lease("k1", "sm_90a", "spec-b", 0.3)
    assert late.acquire() and not crashed.renew() and not crashed.release()
    assert late.holder().token == late.record.token


def test_pushed_keys_expire_and_a_push_refreshes_them(tmp_path, redis_server):
    store, entry = _entry(tmp_path)
    remote = RemoteStore(redis_server.url, writable=True, ttl_s=60)
    remote.push_entry(store, entry)
    client = redis_server.client()
    ttls = {k: client.pttl(k) for k in redis_server.keys(f"{PREFIX}:*")}
    assert len(ttls) == 3 and all(0 < t <= 60_000 for t in ttls.values())  # blob, manifest, spec index
    client.pexpire(f"{PREFIX}:blob:{entry.meta.files['a.bin'].sha256}", 1000)
    assert remote.push_entry(store, entry).blobs_present == 1
    assert client.pttl(f"{PREFIX}:blob:{entry.meta.files['a.bin'].sha256}") > 1000


def test_read_only_remote_refuses_writes_and_bad_manifests_miss(tmp_path, redis_server, caplog):
    store, entry = _entry(tmp_path)
    with pytest.raises(RemoteError, match="read-only"):
        RemoteStore(redis_server.url).push_entry(store, entry)
    remote = RemoteStore(redis_server.url, writable=True)
    remote.push_entry(store, entry)
    client = redis_server.client()
    name = f"{PREFIX}:entry:k1:sm_90a:spec-a"
    record = RemoteManifest.model_validate_json(client.get(name))
    client.set(f"{PREFIX}:entry:k2:sm_90a:spec-a", client.get(name))  # filed under another key
    assert remote.lookup("k2", "sm_90a", "spec-a") is None and "names k1/sm_90a/spec-a" in caplog.text
    client.set(name, record.model_copy(update={"meta": record.meta.model_copy(update={"payload": {"x": 2}})})
               .model_dump_json())
    assert remote.lookup("k1", "sm_90a", "spec-a") is None and "payload sha256 mismatch" in caplog.text
    client.set(name, b"\x80pickle?")
    assert remote.lookup("k1", "sm_90a", "spec-a") is None and "unreadable" in caplog.text


def test_without_the_redis_package_the_remote_is_a_miss(tmp_path, redis_server, monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis raises ImportError
    remote = RemoteStore(redis_server.url)
    assert remote.lookup("k1", "sm_90a", "spec-a") is None
    with pytest.raises(RemoteError, match=r"dsa-aot\[remote\]"):
        remote.ping()


@pytest.mark.parametrize("value", ["http://host:6379", "redis://", "redis://host:port/0", "host:6379"])
def test_a_bad_remote_url_names_the_variable(monkeypatch, value):
    from dsa_aot.settings import Settings, SettingsError

    monkeypatch.setenv("DSA_AOT_REMOTE_URL", value)
    with pytest.raises(SettingsError, match="DSA_AOT_REMOTE_URL"):
        Settings.from_env()


def test_remote_settings_defaults_and_values(monkeypatch):
    from dsa_aot.settings import Settings

    for name in ("DSA_AOT_REMOTE_URL", "DSA_AOT_REMOTE_WRITE", "DSA_AOT_REMOTE_CONNECT_TIMEOUT",
                 "DSA_AOT_TRUSTED_KEYS"):
        monkeypatch.delenv(name, raising=False)
    cfg = Settings.from_env()
    assert (cfg.remote_url, cfg.remote_write, cfg.trusted_keys) == (None, False, ())
    assert cfg.remote_connect_timeout_s <= 0.1 and cfg.remote_timeout_s <= 1.0
    monkeypatch.setenv("DSA_AOT_REMOTE_URL", "redis://127.0.0.1:6379/2")
    monkeypatch.setenv("DSA_AOT_REMOTE_WRITE", "1")
    monkeypatch.setenv("DSA_AOT_TRUSTED_KEYS", "/a.pub:/keys")
    cfg = Settings.from_env()
    assert cfg.remote_url.endswith("/2") and cfg.remote_write and [str(p) for p in cfg.trusted_keys] == ["/a.pub", "/keys"]
