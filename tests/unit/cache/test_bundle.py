"""Bundles: a round trip, and hostile bundles refused without writing anything."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from dsa_aot.cache.bundle import BundleError, export_bundle, import_bundle
from dsa_aot.cache.store import ArtifactStore

KEY, ARCH, SID = "0123456789abcdef", "sm_90a", "fwd-sm_90a-d576-h64-compact-tilelang"


def _source(tmp_path):
    src = ArtifactStore(tmp_path / "src")
    src.publish(KEY, ARCH, SID, {"fwd.cubin": b"\x7fELF" + bytes(100)}, {"k": "v"})
    return src


def test_round_trip(tmp_path):
    bundle = tmp_path / "b.tar"
    assert export_bundle(_source(tmp_path), bundle) == [f"{KEY}/{ARCH}/{SID}"]
    dst = ArtifactStore(tmp_path / "dst")
    report = import_bundle(dst, bundle)
    assert report.imported == [f"{KEY}/{ARCH}/{SID}"]
    entry = dst.lookup(KEY, ARCH, SID)
    assert dst.read_file(entry, "fwd.cubin").startswith(b"\x7fELF") and entry.meta.payload == {"k": "v"}
    assert import_bundle(dst, bundle).already_present == [f"{KEY}/{ARCH}/{SID}"]


def test_export_filters_by_keys(tmp_path):
    src = _source(tmp_path)
    src.publish("fedcba9876543210", ARCH, SID, {"fwd.cubin": b"\x7fELF" + bytes(10)}, {"k": "other"})
    bundle = tmp_path / "b.tar"
    assert export_bundle(src, bundle, keys={KEY}) == [f"{KEY}/{ARCH}/{SID}"]
    assert export_bundle(src, bundle, keys=set()) == []
    assert sorted(export_bundle(src, bundle)) == sorted([f"{KEY}/{ARCH}/{SID}", f"fedcba9876543210/{ARCH}/{SID}"])


def _rewrite(src_tar, dst_tar, mutate):
    with tarfile.open(src_tar) as tin, tarfile.open(dst_tar, "w") as tout:
        members = [(m, tin.extractfile(m).read() if m.isreg() else None) for m in tin.getmembers()]
        for m, data in mutate(members):
            tout.addfile(m, io.BytesIO(data) if data is not None else None)


def _member(name, data=b"", kind=tarfile.REGTYPE, linkname=""):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, (data if kind == tarfile.REGTYPE else None)


def _flip_payload(members):
    out = []
    for m, data in members:
        if m.name.endswith(".cubin"):
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        out.append((m, data))
    return out


HOSTILE = {
    "dotdot": lambda ms: ms + [_member("../escape.txt", b"pwned")],
    "absolute": lambda ms: ms + [_member("/tmp/dsa-aot-abs-escape.txt", b"pwned")],
    "symlink": lambda ms: [(_member(m.name, kind=tarfile.SYMTYPE, linkname="/etc/passwd") if m.name.endswith(".cubin")
                            else (m, d)) for m, d in ms],
    "hash_mismatch": _flip_payload,
    "unexpected_member": lambda ms: ms + [_member("entries/extra.so", b"\x7fELF")],
    "bad_index": lambda ms: [(_member("bundle.json", b"{}") if m.name == "bundle.json" else (m, d)) for m, d in ms],
}


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_hostile_bundle_is_refused_and_writes_nothing(tmp_path, attack):
    good = tmp_path / "good.tar"
    export_bundle(_source(tmp_path), good)
    bad = tmp_path / "bad.tar"
    _rewrite(good, bad, HOSTILE[attack])
    dst_root = tmp_path / "dst"
    with pytest.raises(BundleError):
        import_bundle(ArtifactStore(dst_root), bad)
    written = [p for p in dst_root.rglob("*") if p.is_file()] if dst_root.exists() else []
    assert written == []
    assert not (tmp_path / "escape.txt").exists()


def test_hostile_entry_names_in_index(tmp_path):
    good = tmp_path / "good.tar"
    export_bundle(_source(tmp_path), good)
    with tarfile.open(good) as t:
        index = json.loads(t.extractfile("bundle.json").read())
    index["entries"][0]["spec_id"] = "../../outside"
    bad = tmp_path / "bad.tar"
    _rewrite(good, bad, lambda ms: [(_member("bundle.json", json.dumps(index).encode()) if m.name == "bundle.json"
                                     else (m, d)) for m, d in ms])
    with pytest.raises(Exception, match="invalid spec id|unsafe|lacks"):
        import_bundle(ArtifactStore(tmp_path / "dst"), bad)
    assert not (tmp_path / "outside").exists()


def test_oversized_member_is_refused(tmp_path):
    good = tmp_path / "good.tar"
    export_bundle(_source(tmp_path), good)
    with pytest.raises(BundleError, match="over the"):
        import_bundle(ArtifactStore(tmp_path / "dst"), good, max_member_bytes=10)
