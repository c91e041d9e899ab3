"""``dsa-aot push``, ``pull``, ``status --remote`` and ``prebuild --push`` against a real server.

The entries are filed under the build keys the CLI computes for real catalog specs; their
files are stand-ins (these commands copy and verify bytes, they never load them), so no
compile is needed.
"""

from __future__ import annotations

import json

from cli_helpers import cli

from dsa_aot.backends import get as get_backend
from dsa_aot.cache.store import ArtifactStore
from dsa_aot.identity import build_identity
from dsa_aot.specs.models import KernelSpec
from dsa_aot.specs.toolchain import Toolchain

SPECS = ["fwd-sm_90a-d512-h16-noncompact-tilelang", "fwd-sm_90a-d512-h16-noncompact-cutedsl",
         "bwd-sm_90a-d512-h16-noncompact-tilelang"]
ONLY = [a for s in SPECS for a in ("--only", s)]
SHARED = b"\x7fELF identical in every entry" * 100


def _fill(root) -> ArtifactStore:
    store = ArtifactStore(root)
    toolchain = Toolchain.current()
    for spec_id in SPECS:
        spec = KernelSpec.from_id(spec_id)
        key = build_identity(get_backend(spec.backend), spec, toolchain).key()
        store.publish(key, spec.arch, spec.id, {"shared.bin": SHARED, "own.bin": spec_id.encode() * 500})
    return store


def test_push_pull_status(tmp_path, redis_server):
    env = {"DSA_AOT_REMOTE_URL": redis_server.url}
    source, dest = tmp_path / "a", tmp_path / "b"
    store = _fill(source)

    pushed = json.loads(cli("push", "-q", "--json", *ONLY, root=source, env=env).stdout)
    assert pushed["counts"] == {"pushed": 3, "present": 0, "missing": 0, "failed": 0}
    assert len(redis_server.keys("*:blob:*")) == len(SPECS) + 1  # the shared file is stored once
    again = json.loads(cli("push", "-q", "--json", *ONLY, root=source, env=env).stdout)
    assert again["counts"]["present"] == 3 and again["bytes"] == 0

    status = json.loads(cli("status", "--remote", "--json", *ONLY, root=dest, env=env).stdout)
    assert status == {s: {"local": "missing", "remote": "cached"} for s in SPECS}
    proc = cli("pull", *ONLY, root=dest, env=env)
    assert "pulled        3" in proc.stdout and "pull:" in proc.stderr  # summary, progress on stderr
    for entry in store.entries():
        copy = ArtifactStore(dest).lookup(entry.meta.fingerprint, entry.meta.arch, entry.meta.spec_id)
        assert copy is not None and copy.meta == entry.meta and ArtifactStore(dest).verify(copy) == []
    status = json.loads(cli("status", "--remote", "--json", *ONLY, root=dest, env=env).stdout)
    assert {v["local"] for v in status.values()} == {"cached"}
    assert "present       3" in cli("pull", "-q", *ONLY, root=dest, env=env).stdout
    doctor = json.loads(cli("doctor", *ONLY, root=dest, env=env).stdout)["remote"]
    assert doctor["url"] == redis_server.url and doctor["write"] is False and doctor["ping_ms"] > 0


def test_prebuild_push_sends_cached_entries(tmp_path, redis_server):
    env = {"DSA_AOT_REMOTE_URL": redis_server.url}
    _fill(tmp_path / "a")
    proc = cli("prebuild", "-q", "--push", "--shard", "1/1", *ONLY, root=tmp_path / "a", env=env)
    assert f"cached{'':<14}{len(SPECS):>5}" in proc.stdout and "failed                  0" in proc.stdout
    assert len(redis_server.keys("*:entry:*")) == len(SPECS)


def test_unreachable_remote_is_a_clear_error(tmp_path):
    from _redis import free_port

    env = {"DSA_AOT_REMOTE_URL": f"redis://127.0.0.1:{free_port()}/0"}
    proc = cli("pull", "-q", *ONLY, root=tmp_path / "b", env=env, check=False)
    assert proc.returncode == 2 and "unreachable" not in proc.stdout and "ConnectionError" in proc.stderr
    proc = cli("push", "-q", *ONLY, root=tmp_path / "b", check=False)
    assert proc.returncode == 2 and "DSA_AOT_REMOTE_URL" in proc.stderr
