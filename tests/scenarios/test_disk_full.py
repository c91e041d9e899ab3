"""Disk full while publishing: a clear error, no entry (partial or otherwise), nothing else hurt.

ENOSPC is injected in a child process by shadowing ``open`` (or ``os.fsync``) inside the store
module, so the store's own writer meets the error where a full disk would raise it; where the
test may mount, a real 4 MiB tmpfs is filled up as well.
"""

from __future__ import annotations

import errno
import os

import pytest

import _harness

POINTS = ["first_byte", "mid_artifact", "in_meta", "fsync"]


def _existing_entry(rig) -> None:
    """Another entry already in the cache (its content does not matter to the store)."""
    rig.store().publish(rig.key(_harness.spec(heads=32)), "sm_90a", _harness.spec(heads=32).id,
                        {"fwd.cubin": b"\x7fELF" + os.urandom(6000), "fwd.cu": b"// source"}, {"k": "v"})


def _entry_digest(rig, heads):
    store = rig.store()
    entry = store.lookup(rig.key(_harness.spec(heads=heads)), "sm_90a", _harness.spec(heads=heads).id)
    assert entry is not None and store.verify(entry) == []
    return _harness.tree_digest(entry.path)


def _check_full_disk_run(rig, res, before):
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.result["source"] == "jit:memory"  # the kernel still runs, from memory
    assert "No space left on device" in res.stderr and "could not store" in res.stderr  # says why
    assert rig.store().lookup(rig.key(), "sm_90a", _harness.spec().id) is None  # no entry at all
    assert _harness.staging_leftovers(rig.root) == []  # the half-written staging dir is gone
    assert not (rig.root / ".quarantine").exists()
    assert _entry_digest(rig, 32) == before  # the existing entry is intact


@pytest.mark.parametrize("point", POINTS)
def test_enospc_while_publishing(rig, point):
    _existing_entry(rig)
    before = _entry_digest(rig, 32)
    _check_full_disk_run(rig, rig.run({"fault": f"enospc:{point}"}), before)
    again = rig.run({})  # space is back: the next run builds and publishes
    assert again.returncode == 0 and again.result["source"] == f"jit:{rig.root}"
    assert len(rig.builds()) == 2
    _entry_digest(rig, 16)


def test_enospc_in_prebuild_worker_is_a_clear_failure(rig):
    res = rig.run({"action": "build_one", "fault": "enospc:mid_artifact"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.result["status"] == "failed" and "No space left on device" in res.result["message"]
    assert rig.store().lookup(res.result["key"], "sm_90a", _harness.spec().id) is None
    assert _harness.staging_leftovers(rig.root) == []


def test_real_full_tmpfs(rig, mounts, tmp_path):
    fs = mounts.tmpfs(tmp_path / "fs", "4m")
    rig.root = fs / "cache"
    _existing_entry(rig)
    before = _entry_digest(rig, 32)
    filler = fs / "filler"
    with open(filler, "wb") as fh:  # fill the filesystem to the last block
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    os.truncate(filler, max(0, filler.stat().st_size - 4096))  # one page left: less than a cubin
    _check_full_disk_run(rig, rig.run({}), before)
    filler.unlink()
    again = rig.run({})
    assert again.returncode == 0 and again.result["source"] == f"jit:{rig.root}"
    _entry_digest(rig, 16)
