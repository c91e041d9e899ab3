"""Signed artifacts: a builder with ``DSA_AOT_SIGNING_KEY`` signs every ``meta.json`` it
publishes; a process with ``DSA_AOT_TRUSTED_KEYS`` loads nothing (prebuilt root, local cache,
remote, bundle import) whose signature does not verify, and says why. Refusals happen before
any byte reaches the (spied) driver; refused remote entries never land in the local cache.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
from cli_helpers import cli

import _harness
from dsa_aot.cache.remote import PREFIX, RemoteManifest, RemoteStore, wait_for_publishes
from dsa_aot.cache.signing import Signer
from dsa_aot.cache.store import META, ArtifactStore


@pytest.fixture
def keys(tmp_path):
    """(builder's private key, its public key, another key pair's private key)."""
    (tmp_path / "keys").mkdir()
    priv, pub = Signer.generate().write(tmp_path / "keys" / "builder.key")
    other, _ = Signer.generate().write(tmp_path / "keys" / "other.key")
    return priv, pub, other


def _publish(rig, scoped_settings, key: Path | None, spec=None, root: Path | None = None):
    scoped_settings(DSA_AOT_CACHE_DIR=str(rig.root), **({"DSA_AOT_SIGNING_KEY": str(key)} if key else {}))
    entry = rig.publish(spec or _harness.spec(), root=root)
    scoped_settings(DSA_AOT_SIGNING_KEY="")
    return entry


def _rewrite_meta(entry, **update) -> None:
    path = entry.path / META
    path.write_text(entry.meta.model_copy(update=update).model_dump_json(indent=1))


def _loader(scoped_settings, rig, pub: Path, **env: str):
    from dsa_aot.loader import Loader

    scoped_settings(DSA_AOT_CACHE_DIR=str(rig.root), DSA_AOT_TRUSTED_KEYS=str(pub), **env)
    return Loader()


def test_keygen_writes_a_private_key_only_its_owner_reads(tmp_path):
    proc = cli("keygen", str(tmp_path / "k"), root=tmp_path / "cache")
    assert "DSA_AOT_SIGNING_KEY" in proc.stdout
    assert stat.S_IMODE(os.stat(tmp_path / "k").st_mode) == 0o600
    signer = Signer.from_file(tmp_path / "k")
    assert signer.public_pem == (tmp_path / "k.pub").read_bytes()
    again = cli("keygen", str(tmp_path / "k"), root=tmp_path / "cache", check=False)
    assert again.returncode == 2 and "exists" in again.stderr  # never overwrites a key


def test_signed_entry_loads_under_trusted_keys(inproc_cpu, scoped_settings, keys):
    priv, pub, _ = keys
    entry = _publish(inproc_cpu, scoped_settings, priv)
    assert entry.meta.signature is not None and entry.meta.signature.key_id == Signer.from_file(priv).key_id
    kernel, source, _ = _loader(scoped_settings, inproc_cpu, pub).try_load(_harness.spec(), 0)
    assert source == f"cache:{inproc_cpu.root}" and kernel.cubins["fwd"] == entry.meta.files["fwd.cubin"].sha256


@pytest.mark.parametrize("attack", ["unsigned", "untrusted key", "another spec's file", "signature of another entry"])
def test_untrusted_local_entry_is_refused_before_the_driver(inproc, scoped_settings, keys, caplog, attack):
    priv, pub, other = keys
    spec = _harness.spec()
    entry = _publish(inproc, scoped_settings, {"unsigned": None, "untrusted key": other}.get(attack, priv))
    if attack in ("another spec's file", "signature of another entry"):
        donor = _publish(inproc, scoped_settings, priv, _harness.spec(heads=32))
        if attack == "another spec's file":  # bytes and table consistent, the signature is not
            (entry.path / "fwd.cubin").write_bytes((donor.path / "fwd.cubin").read_bytes())
            _rewrite_meta(entry, files=donor.meta.files)
        else:
            _rewrite_meta(entry, signature=donor.meta.signature)
    with caplog.at_level(logging.WARNING, logger="dsa_aot"):
        assert _loader(scoped_settings, inproc, pub, DSA_AOT_JIT="0").try_load(spec, 0) is None
    why = {"unsigned": "is not signed", "untrusted key": "not among the trusted keys"}.get(attack, "does not verify")
    assert why in caplog.text
    assert inproc.driver_calls == []
    assert inproc.store().lookup(entry.meta.fingerprint, spec.arch, spec.id) is None  # quarantined
    assert any(q.startswith(entry.meta.fingerprint) for q in inproc.store().quarantined())


def test_unsigned_prebuilt_root_is_refused_and_left_untouched(inproc, tmp_path, scoped_settings, keys, caplog):
    _, pub, _ = keys
    prebuilt = tmp_path / "prebuilt"
    _publish(inproc, scoped_settings, None, root=prebuilt)
    before = _harness.tree_digest(prebuilt)
    with caplog.at_level(logging.WARNING, logger="dsa_aot"):
        loader = _loader(scoped_settings, inproc, pub, DSA_AOT_PREBUILT_DIR=str(prebuilt), DSA_AOT_JIT="0")
        assert loader.try_load(_harness.spec(), 0) is None
    assert f"from {prebuilt}" in caplog.text and "is not signed" in caplog.text
    assert inproc.driver_calls == [] and _harness.tree_digest(prebuilt) == before


def _push(entry, root: Path, server) -> None:
    RemoteStore(server.url, writable=True).push_entry(ArtifactStore(root), entry)


def _rewrite_manifest(server, entry, **update) -> None:
    name = f"{PREFIX}:entry:{entry.meta.fingerprint}:{entry.meta.arch}:{entry.meta.spec_id}"
    client = server.client()
    record = RemoteManifest.model_validate_json(client.get(name))
    client.set(name, record.model_copy(update={"meta": record.meta.model_copy(update=update)}).model_dump_json())


@pytest.mark.parametrize("attack", [None, "unsigned", "untrusted key", "manifest names another spec's blob",
                                    "signature of another entry"])
def test_untrusted_remote_entry_is_refused_and_never_lands(inproc, tmp_path, redis_server, scoped_settings, keys,
                                                           caplog, attack):
    priv, pub, other = keys
    builder = tmp_path / "builder"
    entry = _publish(inproc, scoped_settings, {"unsigned": None, "untrusted key": other}.get(attack, priv),
                     root=builder)
    _push(entry, builder, redis_server)
    if attack in ("manifest names another spec's blob", "signature of another entry"):
        donor = _publish(inproc, scoped_settings, priv, _harness.spec(heads=32), root=builder)
        _push(donor, builder, redis_server)  # the donor's blob is on the server, intact
        _rewrite_manifest(redis_server, entry, **({"files": donor.meta.files}
                                                  if attack.startswith("manifest") else {"signature": donor.meta.signature}))
    loader = _loader(scoped_settings, inproc, pub, DSA_AOT_REMOTE_URL=redis_server.url, DSA_AOT_JIT="0")
    with caplog.at_level(logging.WARNING, logger="dsa_aot"):
        assert loader.try_load(_harness.spec(), 0) is None  # a good entry too: no GPU to load it on
    assert wait_for_publishes(30)  # a pulled entry's local copy is written off the call's path
    if attack is None:  # control: a trusted signature gets pulled and handed to the driver
        assert inproc.driver_calls and list(inproc.store().entries())
        return
    why = {"unsigned": "is not signed", "untrusted key": "not among the trusted keys"}.get(attack, "does not verify")
    assert why in caplog.text and "remote miss" in caplog.text
    assert inproc.driver_calls == []
    assert list(inproc.store().entries()) == [] and _harness.staging_leftovers(inproc.root) == []


def test_bundles_carry_signatures_and_import_refuses_untrusted(inproc, tmp_path, scoped_settings, keys):
    priv, pub, _ = keys
    signed_root, unsigned_root = tmp_path / "signed", tmp_path / "unsigned"
    entry = _publish(inproc, scoped_settings, priv, root=signed_root)
    _publish(inproc, scoped_settings, None, root=unsigned_root)
    trusted = {"DSA_AOT_TRUSTED_KEYS": str(pub)}
    cli("export", "--all-toolchains", str(tmp_path / "signed.tar"), root=signed_root)
    cli("export", "--all-toolchains", str(tmp_path / "unsigned.tar"), root=unsigned_root)

    fresh = tmp_path / "fresh"
    proc = cli("import", str(tmp_path / "unsigned.tar"), root=fresh, check=False, env=trusted)
    assert proc.returncode == 2 and "not trusted" in proc.stderr and "is not signed" in proc.stderr
    assert list(ArtifactStore(fresh).entries()) == []
    cli("import", str(tmp_path / "signed.tar"), root=fresh, env=trusted)
    (copy,) = ArtifactStore(fresh).entries()
    assert copy.meta == entry.meta and copy.meta.signature is not None  # the same signed meta.json
