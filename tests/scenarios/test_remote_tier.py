"""The loader's remote tier against a real Redis server, in process: a hit is pulled, verified
and published locally; every remote failure (refused, stopped, a listener that never answers,
the server killed mid-transfer, a corrupted or missing blob) is a bounded, logged miss that
falls through, with nothing partial in the local cache and no byte handed to the driver.

``inproc`` keeps the real TileLang ``load`` (it reaches the CUDA driver, spied on: absent on
this machine); ``inproc_cpu`` checks the cubins on the CPU instead, so a load succeeds.
"""

from __future__ import annotations

import logging
import time

import pytest

import _harness
import _redis
from dsa_aot.cache.remote import PREFIX, RemoteStore, wait_for_publishes
from dsa_aot.cache.store import ArtifactStore

#: connect 0.1 s + one socket timeout 0.5 s (the defaults), plus slack for a loaded 2-core machine.
BOUND_S = 2.0


def _seed(rig, tmp_path, server, spec=None):
    """Build ``spec`` for real in a builder's cache and push it to ``server``; returns the entry."""
    spec = spec or _harness.spec()
    builder = tmp_path / "builder"
    entry = rig.publish(spec, root=builder)
    RemoteStore(server.url, writable=True).push_entry(ArtifactStore(builder), entry)
    return entry


def _loader(scoped_settings, rig, url: str, **env: str):
    from dsa_aot.loader import Loader

    scoped_settings(DSA_AOT_CACHE_DIR=str(rig.root), DSA_AOT_REMOTE_URL=url, **env)
    return Loader()


def _nothing_local(root) -> None:
    store = ArtifactStore(root)
    assert list(store.entries()) == []
    assert _harness.staging_leftovers(root) == []


def test_remote_hit_is_verified_published_locally_then_served_from_cache(inproc_cpu, tmp_path, redis_server,
                                                                         scoped_settings):
    seeded = _seed(inproc_cpu, tmp_path, redis_server)
    builds = len(inproc_cpu.builds())
    loader = _loader(scoped_settings, inproc_cpu, redis_server.url)
    kernel, source, rule = loader.try_load(_harness.spec(), 0)
    assert source == f"remote:{redis_server.url}" and rule == "build key"
    assert wait_for_publishes(30)  # the local copy is written off the call's path
    local = inproc_cpu.store().lookup(seeded.meta.fingerprint, seeded.meta.arch, seeded.meta.spec_id)
    assert local is not None and inproc_cpu.store().verify(local) == []
    assert local.meta == seeded.meta  # the builder's meta.json, unchanged (identities, created)
    assert kernel.cubins["fwd"] == seeded.meta.files["fwd.cubin"].sha256
    assert len(inproc_cpu.builds()) == builds  # pulled, not compiled
    again = _loader(scoped_settings, inproc_cpu, redis_server.url).try_load(_harness.spec(), 0)
    assert again[1] == f"cache:{inproc_cpu.root}"


def test_remote_pull_reaches_the_driver(inproc, tmp_path, redis_server, scoped_settings):
    """Control for the refusals below: a good remote entry does get to the (spied) driver."""
    _seed(inproc, tmp_path, redis_server)
    _loader(scoped_settings, inproc, redis_server.url).try_load(_harness.spec(), 0)
    assert inproc.driver_calls  # the real load got as far as libcuda (absent here: a miss)


def _timed_miss(loader, spec=None) -> float:
    start = time.perf_counter()
    assert loader.try_load(spec or _harness.spec(), 0) is None
    return time.perf_counter() - start


def test_refused_connection_falls_through_to_jit_within_the_bound(inproc_cpu, scoped_settings):
    url = f"redis://127.0.0.1:{_redis.free_port()}/0"  # nothing listens there
    loader = _loader(scoped_settings, inproc_cpu, url, DSA_AOT_BACKENDS="tilelang")
    inproc_cpu.seed_features()
    assert _timed_miss(loader) < BOUND_S
    kernel, res = loader.resolve("fwd", "sm_90a", 512, 16, "noncompact", 0)
    assert res.source == f"jit:{inproc_cpu.root}" and kernel.spec_id == _harness.spec().id
    assert len(inproc_cpu.builds()) == 1


def test_stopped_server_is_a_bounded_miss(inproc, tmp_path, redis_server, scoped_settings, caplog):
    _seed(inproc, tmp_path, redis_server)
    redis_server.stop()
    loader = _loader(scoped_settings, inproc, redis_server.url, DSA_AOT_JIT="0", DSA_AOT_BACKENDS="tilelang")
    with caplog.at_level(logging.WARNING, logger="dsa_aot"):
        assert _timed_miss(loader) < BOUND_S
        start = time.perf_counter()
        with pytest.warns(RuntimeWarning, match="torch reference"):
            _, res = loader.resolve("fwd", "sm_90a", 512, 16, "noncompact", 0)
        assert time.perf_counter() - start < 0.5  # the back-off: no second connection attempt
    assert res.source == "reference"
    assert "unreachable" in caplog.text
    assert inproc.driver_calls == []
    _nothing_local(inproc.root)


def test_listener_that_never_answers_is_a_bounded_miss(inproc, scoped_settings, caplog):
    silent = _redis.SilentListener()
    try:
        loader = _loader(scoped_settings, inproc, silent.url)
        with caplog.at_level(logging.WARNING, logger="dsa_aot"):
            elapsed = _timed_miss(loader)
            assert elapsed < BOUND_S, elapsed
            assert _timed_miss(loader, _harness.spec(heads=32)) < 0.2  # later lookups skip the server
        assert silent.accepted and "TimeoutError" in caplog.text
    finally:
        silent.close()
    assert inproc.driver_calls == []
    _nothing_local(inproc.root)


def test_server_killed_mid_transfer_leaves_nothing_partial(inproc, tmp_path, redis_server, scoped_settings,
                                                           caplog):
    seeded = _seed(inproc, tmp_path, redis_server)
    proxy = _redis.CuttingProxy(redis_server, cut_after=seeded.meta.files["fwd.cubin"].size // 2)
    try:
        loader = _loader(scoped_settings, inproc, proxy.url)
        with caplog.at_level(logging.WARNING, logger="dsa_aot"):
            assert _timed_miss(loader) < BOUND_S
    finally:
        proxy.close()
    assert proxy.cut.is_set() and redis_server.proc.poll() is not None  # killed inside the blob reply
    assert "remote miss" in caplog.text
    assert inproc.driver_calls == []
    _nothing_local(inproc.root)


@pytest.mark.parametrize("damage", ["bit flip", "truncated", "missing"])
def test_damaged_blob_is_refused_before_the_driver(inproc, tmp_path, redis_server, scoped_settings, caplog,
                                                   damage):
    seeded = _seed(inproc, tmp_path, redis_server)
    client = redis_server.client()
    blob = f"{PREFIX}:blob:{seeded.meta.files['fwd.cubin'].sha256}"
    data = bytearray(client.get(blob))
    if damage == "bit flip":
        data[len(data) // 2] ^= 0x01
        client.set(blob, bytes(data))
    elif damage == "truncated":
        client.set(blob, bytes(data[:-100]))
    else:
        client.delete(blob)
    loader = _loader(scoped_settings, inproc, redis_server.url)
    with caplog.at_level(logging.WARNING, logger="dsa_aot"):
        assert _timed_miss(loader) < BOUND_S
    assert ("is missing" if damage == "missing" else "fails its sha256 check") in caplog.text
    assert inproc.driver_calls == []
    _nothing_local(inproc.root)
