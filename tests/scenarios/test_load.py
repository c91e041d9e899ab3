"""Hot-cache load: many lookups from many threads, and the index under concurrent writers.

These tests assert what holds exactly on any machine (every read consistent, one kernel object,
no lost hit counts). Throughput is measured by ``bench/bench_store.py``, not asserted here: a
wall-clock floor fails on a loaded CI runner whatever the code does."""

from __future__ import annotations

import hashlib
import os
import threading

import torch

import _harness
from dsa_aot import ops

THREADS = 8


def _hammer(fn, per_thread: int) -> list:
    """Run ``fn()`` ``per_thread`` times in each of 8 threads released together; the set of
    results each thread saw."""
    start = threading.Barrier(THREADS + 1)
    results: list = [None] * THREADS

    def worker(i: int) -> None:
        start.wait()
        seen = set()
        for _ in range(per_thread):
            seen.add(fn())
        results[i] = seen

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a lookup thread hung"
    return results


def test_store_lookups_from_eight_threads(rig):
    store, key = rig.store(), rig.key()
    cubin = b"\x7fELF" + os.urandom(6000)  # the size of a small real cubin
    payload = {"stages": [{"name": "fwd", "grid": ["s_q", "1", "1"], "params": list(range(12))}], "x": "y" * 400}
    store.publish(key, "sm_90a", _harness.spec().id, {"fwd.cubin": cubin, "fwd.cu": os.urandom(30000)},
                  payload)
    want = hashlib.sha256(cubin).hexdigest()

    def lookup_and_read() -> tuple[str, str]:
        entry = store.lookup(key, "sm_90a", _harness.spec().id)
        return entry.meta.spec_id, hashlib.sha256(store.read_file(entry, "fwd.cubin")).hexdigest()

    results = _hammer(lookup_and_read, 1250)
    assert all(r == {(_harness.spec().id, want)} for r in results)  # every read consistent


def test_ops_memo_from_eight_threads():
    """The per-call path: 8 threads race the first call of one key (one kernel object made),
    then look it up 100 000 times."""
    ops._clear()
    cpu = torch.device("cpu")
    first = _hammer(lambda: id(ops._kernel("fwd", cpu, 576, 64, "noncompact")), 1)
    assert len(set().union(*first)) == 1  # one kernel object, whichever thread won
    results = _hammer(lambda: id(ops._kernel("fwd", cpu, 576, 64, "noncompact")), 12_500)
    assert set().union(*results) == set().union(*first)


def test_index_survives_concurrent_writers(rig):
    store, key = rig.store(), rig.key()
    sids = [_harness.spec(heads=h).id for h in (16, 32)]
    for sid in sids:
        store.publish(key, "sm_90a", sid, {"fwd.cubin": os.urandom(1000)})
    hitters = [_harness.start_child({"action": "hits", "key": key, "spec_ids": sids, "hits": 250}, rig.env())
               for _ in range(4)]
    for i in range(20):  # meanwhile this process publishes (index writes too)
        store.publish(key, "sm_90a", f"extra-{i}", {"f": os.urandom(100)})
    for proc in hitters:
        res = _harness.finish(proc, 120)
        assert res.returncode == 0, res.stderr[-2000:]
    for sid in sids:  # 4 processes x 250 hits over 2 entries: 500 each, none lost
        assert store.stats(store.lookup(key, "sm_90a", sid))["hits"] == 500
    keep = store.lookup(key, "sm_90a", sids[0])
    store.record_hit(keep)  # most recently used
    report = store.gc(key, max_bytes=keep.size)
    assert len(report.removed_entries) == 21 and report.remaining_bytes == keep.size
    assert [e.meta.spec_id for e in store.entries()] == [sids[0]]
    assert store.stats(keep)["hits"] == 501
