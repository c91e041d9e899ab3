"""What the loader trusts: never pickled metadata, never a root (or subtree) others can write.

The cache holds code that will run on the GPU, so its tree must be writable only by this user;
``shared_writable_reason`` decides that. These tests make roots and sub-directories world- or
group-writable or foreign-owned (the tests run as root, so ``chown`` works) and check that the
loader then does not load from them, unless ``DSA_AOT_ALLOW_SHARED_CACHE=1``.
"""

from __future__ import annotations

import ast
import logging
import os
import stat
from pathlib import Path

import pytest

import _harness
from dsa_aot.loader import Loader

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("aot", "cache", "specs")
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
UNSAFE_CALLS = {("torch", "load"), ("numpy", "load"), ("np", "load"), ("pickle", "loads"), ("yaml", "load")}
SPEC = _harness.spec()


def test_no_pickle_or_marshal_in_product_code():
    found = []
    for package in PRODUCT:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module.split(".")[0]]
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and isinstance(node.func.value, ast.Name) \
                        and (node.func.value.id, node.func.attr) in UNSAFE_CALLS:
                    names = [f"{node.func.value.id}.{node.func.attr}()"]
                found += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names
                          if n in UNSAFE_MODULES or n.endswith("()")]
    assert found == []


class _Planted:
    """Unpickling this creates ``marker``: proof that something was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))

    def __hash__(self) -> int:
        return 1


def test_index_rows_are_never_unpickled(tmp_path):
    """diskcache pickles non-str values and keys and unpickles whatever a row says; someone who
    can write ``.index/cache.db`` must not get code run by ``record_hit``, ``stats`` or ``gc``."""
    import diskcache

    from dsa_aot.cache.store import ArtifactStore

    store = ArtifactStore(tmp_path / "cache")
    entry = store.publish("0123456789abcdef", "sm_90a", SPEC.id, {"a.cubin": b"\x7fELF"})
    value_marker, key_marker = tmp_path / "unpickled-value", tmp_path / "unpickled-key"
    with diskcache.Cache(str(tmp_path / "cache" / ".index")) as planted:  # what an attacker writes
        planted.set(entry.key, _Planted(value_marker))
        planted.set(_Planted(key_marker), "x")
    store = ArtifactStore(tmp_path / "cache")
    store.record_hit(entry)
    store.stats(entry)
    store.gc("0123456789abcdef")
    assert not value_marker.exists() and not key_marker.exists()
    assert store.lookup("0123456789abcdef", "sm_90a", SPEC.id) is not None  # the index is advisory


def _unsafe(path: Path, how: str) -> None:
    if how == "world-writable":
        path.chmod(path.stat().st_mode | stat.S_IWOTH)
    elif how == "group-writable":
        path.chmod(path.stat().st_mode | stat.S_IWGRP)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, 4242, 4242)


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "foreign-owner"])
@pytest.mark.parametrize("where", ["cache root", "prebuilt root", "key dir", "entry dir", "meta.json"])
def test_shared_writable_tree_is_not_loaded_from(inproc_cpu, scoped_settings, tmp_path, caplog, how, where):
    root = inproc_cpu.root if where != "prebuilt root" else tmp_path / "image"
    entry = inproc_cpu.publish(SPEC, root=root)
    target = {"cache root": root, "prebuilt root": root, "key dir": entry.path.parent.parent,
              "entry dir": entry.path, "meta.json": entry.path / "meta.json"}[where]
    _unsafe(target, how)
    scoped_settings(DSA_AOT_CACHE_DIR=str(inproc_cpu.root),
                    **({"DSA_AOT_PREBUILT_DIR": str(root)} if where == "prebuilt root" else {}))
    with caplog.at_level(logging.INFO, logger="dsa_aot"):
        assert Loader().try_load(SPEC, 0) is None
    assert inproc_cpu.loaded == []  # not one byte of it loaded
    assert how.split("-")[0] in caplog.text or "owned by uid 4242" in caplog.text

    scoped_settings(DSA_AOT_ALLOW_SHARED_CACHE="1")  # the documented escape hatch
    assert Loader().try_load(SPEC, 0) is not None
    assert [s for s, _ in inproc_cpu.loaded] == [SPEC.id]


def test_a_group_sharing_umask_does_not_lock_users_out(rig):
    """With umask 002 (Debian/Ubuntu's default for users), the entries a builder creates must
    still pass the permission check in the next process."""
    first = rig.run({"umask": "002"})
    assert first.returncode == 0 and first.result["source"] == f"jit:{rig.root}", first.stderr[-2000:]
    second = rig.run({"umask": "002"})
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.result["source"] == f"cache:{rig.root}", second.stderr[-2000:]
    assert len(rig.builds()) == 1
