"""The fleet tier across processes: nodes with separate local caches sharing one real Redis
server. One compile per entry across nodes (lease lock), parallel compiles across entries,
sharded builders meeting on the remote, a crashed lease holder taken over after expiry.

Each child is a node: its own ``DSA_AOT_CACHE_DIR``, the loader's real protocol (``try_load``:
local, then remote; then ``build_and_load``), ``DSA_AOT_REMOTE_WRITE=1``. Compiles are counted
by the builder itself (``_tiny_kernel.record``).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

import _harness
from dsa_aot.cache.store import ArtifactStore

N = 8


def _node_env(rig, tmp_path: Path, i: int, server, **extra: str) -> dict[str, str]:
    return rig.env(**{"DSA_AOT_CACHE_DIR": str(tmp_path / f"node{i}"), "DSA_AOT_REMOTE_URL": server.url,
                      "DSA_AOT_REMOTE_WRITE": "1", **extra})


def test_eight_nodes_one_missing_variant_compile_once(rig, tmp_path, redis_server):
    missed = tmp_path / "missed"
    missed.mkdir()
    # The lease holder compiles only once all 8 nodes have missed locally and on the remote:
    # the other 7 are then waiting on the fleet lease, not finding a finished entry.
    envs = [_node_env(rig, tmp_path, i, redis_server, REL_WAIT_FOR_MISSES=str(missed),
                      REL_WAIT_FOR_MISSES_N=str(N)) for i in range(N)]
    results = _harness.start_together([{"missed_dir": str(missed)}] * N, envs, tmp_path, timeout_s=150)

    assert all(r["missed"] for r in results)
    assert len(rig.builds()) == 1  # one compile in the fleet
    assert len(rig.loads()) == N  # 8 CPU-checked loads
    sources = sorted(r["source"].split(":", 1)[0] for r in results)
    assert sources == ["jit"] + ["remote"] * (N - 1)
    assert len({r["cubins"]["fwd"] for r in results}) == 1
    spec = _harness.spec()
    for i in range(N):  # every node holds the verified entry in its own cache
        store = ArtifactStore(tmp_path / f"node{i}")
        entry = store.lookup(rig.key(), spec.arch, spec.id)
        assert entry is not None and store.verify(entry) == []
        assert hashlib.sha256(store.read_file(entry, "fwd.cubin")).hexdigest() == results[0]["cubins"]["fwd"]
        assert _harness.staging_leftovers(tmp_path / f"node{i}") == []
    assert redis_server.keys("*:lease:*") == []  # released
    assert len(redis_server.keys("*:entry:*")) == 1


def test_eight_nodes_eight_variants_compile_at_once(rig, tmp_path, redis_server):
    barrier = tmp_path / "inside-build"
    barrier.mkdir()
    # Each builder waits inside build() (holding its own lease) until all 8 are there: a lease
    # wider than one entry would serialize them and the barrier would time out.
    envs = [_node_env(rig, tmp_path, i, redis_server, REL_BUILD_BARRIER=str(barrier),
                      REL_BUILD_BARRIER_N=str(N), REL_BARRIER_TIMEOUT="120") for i in range(N)]
    variants = [{"spec": {"heads": h, "d_qk": d}} for d in (512, 576) for h in (16, 32, 64, 128)]
    results = _harness.start_together(variants, envs, tmp_path, timeout_s=200)

    assert len(list(barrier.iterdir())) == N
    assert sorted(b[1] for b in rig.builds()) == sorted(r["spec_id"] for r in results)
    assert all(r["source"].startswith("jit:") for r in results)
    assert len({r["cubins"]["fwd"] for r in results}) == N
    assert len(redis_server.keys("*:entry:*")) == N and redis_server.keys("*:lease:*") == []


def test_sharded_builders_push_and_a_fresh_node_pulls_every_spec(rig, tmp_path, redis_server):
    specs = [{"heads": h, "d_qk": d} for d in (512, 576) for h in (16, 32, 64, 128)]
    shards = [{"action": "shard", "shard": [i + 1, 4], "specs": specs} for i in range(4)]
    envs = [_node_env(rig, tmp_path, i, redis_server) for i in range(4)]
    results = _harness.start_together(shards, envs, tmp_path, timeout_s=150)
    built = {sid: st for r in results for sid, st in r["statuses"].items()}
    assert len(built) == len(specs) and set(built.values()) == {"built"}
    assert len(rig.builds()) == len(specs)  # each spec compiled by exactly one shard
    assert len(redis_server.keys("*:entry:*")) == len(specs)

    fresh = _harness.run_child({"action": "pull_resolve", "specs": specs},
                               _node_env(rig, tmp_path, 99, redis_server, DSA_AOT_REMOTE_WRITE="0"))
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert set(fresh.result["pulled"].values()) == {"pulled"}
    assert set(fresh.result["resolved"].values()) == {"cache"}  # served from the pulled local copies
    assert len(rig.builds()) == len(specs)  # the fresh node compiled nothing
    assert len(rig.loads()) == len(specs)


def test_lease_holder_killed_while_compiling_is_taken_over(rig, tmp_path, redis_server):
    lease_s = "2"
    crashed = _harness.run_child({"fault": "kill:in_compile"},
                                 _node_env(rig, tmp_path, 0, redis_server, DSA_AOT_REMOTE_LEASE=lease_s))
    assert crashed.returncode == -9
    killed_at = time.time()
    (lease,) = redis_server.keys("*:lease:*")  # the dead holder's lease is still there ...
    ttl_ms = redis_server.client().pttl(lease)
    assert 0 < ttl_ms <= 2000

    start = time.monotonic()
    node = _harness.run_child({}, _node_env(rig, tmp_path, 1, redis_server, DSA_AOT_REMOTE_LEASE=lease_s))
    waited = time.monotonic() - start
    assert node.returncode == 0, node.stderr[-3000:]
    builds = rig.builds()
    assert len(builds) == 2 and builds[0][2] != builds[1][2] == str(node.result["pid"])
    # ... and the second node compiled only once it had expired, not before.
    assert float(builds[1][3]) >= killed_at + ttl_ms / 1000 - 0.05
    assert node.result["source"].startswith("jit:") and waited < 30
    assert len(redis_server.keys("*:entry:*")) == 1 and redis_server.keys("*:lease:*") == []
    assert rig.loads() and rig.loads()[-1][2] == str(node.result["pid"])

