"""A builder SIGKILLed at every step of a publish never leaves a visible partial entry.

The child runs the loader's JIT path (real compile, real store, real lock) and kills itself
at one point, patched in from outside (see ``_child.install_kill``). Afterwards a lookup
must give None or a complete entry whose every file matches its sha256, the dead builder's
lock must not block anyone, and the next run must rebuild (or load the complete entry) and
leave no staging directory behind.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest

import _harness

BEFORE_RENAME = ["in_compile", "first_file_half_written", "before_meta", "meta_half_written",
                 "before_fsync_staging", "before_rename"]
AFTER_RENAME = ["after_rename", "before_index_update", "in_index_transaction"]


@pytest.mark.parametrize("point", BEFORE_RENAME + AFTER_RENAME)
def test_sigkill_during_publish(rig, point):
    sid = _harness.spec().id
    killed = rig.run({"fault": f"kill:{point}"}, timeout_s=90)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert len(rig.builds()) == 1

    store = rig.store()
    entry = store.lookup(rig.key(), "sm_90a", sid)
    if point in BEFORE_RENAME:
        assert entry is None  # nothing half-published is visible
        if point != "in_compile":
            assert _harness.staging_leftovers(rig.root)  # the dead builder's debris is there...
    else:
        assert entry is not None and store.verify(entry) == []  # complete, every sha256 matches
    assert not (rig.root / ".quarantine").exists()

    # The next process is not blocked by the dead builder's lock, and ends up with a good entry.
    nxt = rig.run({}, timeout_s=90)
    assert nxt.returncode == 0, nxt.stderr[-2000:]
    if point in BEFORE_RENAME:
        assert nxt.result["source"].startswith("jit:") and len(rig.builds()) == 2  # rebuilt
    else:
        assert nxt.result["source"].startswith("cache:") and len(rig.builds()) == 1  # reused
    entry = store.lookup(rig.key(), "sm_90a", sid)
    assert entry is not None and store.verify(entry) == []
    assert nxt.result["cubins"]["fwd"] == hashlib.sha256(store.read_file(entry, "fwd.cubin")).hexdigest()
    assert _harness.staging_leftovers(rig.root) == []  # ...and is swept
    # The advisory index still works after a kill inside its transaction.
    store.record_hit(entry)
    assert store.stats(entry).get("hits", 0) >= 1


def test_gc_killed_mid_delete_does_not_wedge_the_key(rig):
    """gc dies after deleting meta.json but before the rest: the key must still be rebuildable."""
    sid = _harness.spec().id
    assert rig.run({}).returncode == 0
    killed = rig.run({"action": "gc", "max_bytes": 0, "fault": "kill:gc_rmtree_after_meta"})
    assert killed.returncode == -signal.SIGKILL
    store = rig.store()
    assert store.lookup(rig.key(), "sm_90a", sid) is None  # metaless debris is not an entry
    nxt = rig.run({})
    assert nxt.returncode == 0, nxt.stderr[-2000:]
    assert nxt.result["source"] == f"jit:{rig.root}", nxt.stderr[-2000:]  # published, not memory-only
    entry = store.lookup(rig.key(), "sm_90a", sid)
    assert entry is not None and store.verify(entry) == []


def test_sweep_spares_a_live_builder(rig, tmp_path):
    """A JIT run sweeps staging while another builder is alive mid-publish: that one survives."""
    paused, resume = tmp_path / "paused", tmp_path / "resume"
    slow = _harness.start_child({"fault": "pause:before_rename", "paused": str(paused), "resume": str(resume)},
                                rig.env())
    try:
        deadline = time.monotonic() + 90
        while not paused.exists():
            assert slow.poll() is None and time.monotonic() < deadline, "builder never reached the rename"
            time.sleep(0.05)
        assert len(_harness.staging_leftovers(rig.root)) == 1
        other = rig.run({"spec": {"heads": 32}})  # JIT of another key: sweeps .staging
        assert other.returncode == 0 and other.result["source"].startswith("jit:")
        assert len(_harness.staging_leftovers(rig.root)) == 1  # the live builder's dir was spared
    finally:
        resume.touch()
    done = _harness.finish(slow)
    assert done.returncode == 0 and done.result["source"] == f"jit:{rig.root}", done.stderr[-2000:]
    store = rig.store()
    for heads in (16, 32):
        entry = store.lookup(rig.key(_harness.spec(heads=heads)), "sm_90a", _harness.spec(heads=heads).id)
        assert entry is not None and store.verify(entry) == []
    assert _harness.staging_leftovers(rig.root) == []


def test_sweep_judges_other_hosts_by_age_only(rig):
    """A pid from another host or PID namespace says nothing here: such a dir goes only when old."""
    from dsa_aot.cache.store import _host_tag

    store = rig.store()
    staging = rig.root / ".staging"
    staging.mkdir(parents=True)
    foreign = staging / "999999999-0badc0de-0123"  # dead pid here, maybe alive over there
    local_dead = staging / f"999999999-{_host_tag()}-4567"
    old_foreign = staging / "999999998-0badc0de-89ab"
    for path in (foreign, local_dead, old_foreign):
        path.mkdir()
        (path / "fwd.cubin").write_bytes(b"partial")
    os.utime(old_foreign, (time.time() - 7200, time.time() - 7200))
    assert store.sweep_staging() == 2
    assert _harness.staging_leftovers(rig.root) == [foreign.name]
