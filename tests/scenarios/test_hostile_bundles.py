"""``dsa-aot import`` of hostile bundles, through the real CLI in a subprocess.

Every attack must end with a non-zero exit, a one-line ``dsa-aot import: error: ...`` naming
the problem (no traceback), and not one file written inside the cache or outside it.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from dsa_aot.cache.bundle import export_bundle
from dsa_aot.cache.store import ArtifactStore

FP, ARCH = "0123456789abcdef", "sm_90a"
SIDS = ("fwd-sm_90a-d576-h64-compact-tilelang", "fwd-sm_90a-d576-h32-compact-tilelang")


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSA_AOT_")}
    return subprocess.run([sys.executable, "-m", "dsa_aot.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=cwd)


@pytest.fixture
def good(tmp_path) -> Path:
    src = ArtifactStore(tmp_path / "src")
    for sid in SIDS:
        src.publish(FP, ARCH, sid, {"fwd.cubin": b"\x7fELF" + os.urandom(5000), "fwd.cu": b"// src"}, {"k": sid})
    path = tmp_path / "good.tar"
    export_bundle(src, path)
    return path


def _members(path: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    with tarfile.open(path) as tar:
        return [(m, tar.extractfile(m).read() if m.isreg() else None) for m in tar.getmembers()]


def _write(path: Path, members) -> Path:
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _info(name: str, data: bytes = b"", kind=tarfile.REGTYPE, linkname: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, (data if kind == tarfile.REGTYPE else None)


def _replace(members, suffix: str, new):
    """Replace the first member whose name ends with ``suffix`` by ``new(info, data)``."""
    out, done = [], False
    for info, data in members:
        if not done and info.name.endswith(suffix):
            out.append(new(info, data))
            done = True
        else:
            out.append((info, data))
    return out


def _entry(index, spec_id: str) -> dict:
    return next(e for e in index["entries"] if e["spec_id"] == spec_id)


def _with_index(members, edit):
    index = json.loads(dict((m.name, d) for m, d in members)["bundle.json"])
    edit(index)
    return _replace(members, "bundle.json", lambda i, d: _info("bundle.json", json.dumps(index).encode()))


def _flip(info, data):
    return info, bytes([data[0] ^ 0xFF]) + data[1:]


def _rename_file_in_index(new_name: str):
    """One entry's ``fwd.cu`` is listed (and stored) under ``new_name``; the other is fine."""
    def attack(ms):
        def edit(index):
            files = _entry(index, SIDS[1])["files"]
            files[new_name] = files.pop("fwd.cu")
        prefix = f"entries/{FP}/{ARCH}/{SIDS[1]}/"
        ms = _replace(ms, prefix + "fwd.cu", lambda i, d: _info(prefix + new_name, d))
        return _with_index(ms, edit)
    return attack


ESCAPE = "dsa-aot-escape-test.txt"
ATTACKS = {
    # name: (mutation of the good bundle's members, expected words in the error)
    "dotdot": (lambda ms: ms + [_info(f"../{ESCAPE}", b"pwned")], "unsafe path"),
    "dotdot_inside": (lambda ms: ms + [_info(f"entries/../../{ESCAPE}", b"pwned")], "unsafe path"),
    "absolute": (lambda ms: ms + [_info(f"/tmp/{ESCAPE}", b"pwned")], "unsafe path"),
    "symlink": (lambda ms: _replace(ms, ".cubin", lambda i, d: _info(i.name, kind=tarfile.SYMTYPE,
                                                                       linkname="/etc/passwd")), "not a regular file"),
    "hardlink": (lambda ms: _replace(ms, ".cubin", lambda i, d: _info(i.name, kind=tarfile.LNKTYPE,
                                                                        linkname="bundle.json")), "not a regular file"),
    "fifo": (lambda ms: _replace(ms, ".cubin", lambda i, d: _info(i.name, kind=tarfile.FIFOTYPE)), "not a regular file"),
    "char_device": (lambda ms: _replace(ms, ".cubin", lambda i, d: _info(i.name, kind=tarfile.CHRTYPE)),
                    "not a regular file"),
    "hash_mismatch": (lambda ms: _replace(ms, ".cubin", _flip), "sha256 mismatch"),
    "short_member": (lambda ms: _replace(ms, ".cubin", lambda i, d: _info(i.name, d[:-1])), "sha256 mismatch"),
    "duplicate_member": (lambda ms: ms + [ms[-1]], "appears twice"),
    "unexpected_member": (lambda ms: ms + [_info("entries/extra.so", b"\x7fELF")], "unexpected members"),
    "index_not_json": (lambda ms: _replace(ms, "bundle.json", lambda i, d: _info(i.name, b"{oops")), "bundle.json"),
    "index_dotdot_spec_id": (lambda ms: _with_index(ms, lambda ix: ix["entries"][0].update(spec_id="../../x")),
                             "invalid spec id"),
    "index_file_name_with_slash": (_rename_file_in_index("sub/evil.cu"), "invalid file"),
    "index_file_name_meta": (_rename_file_in_index("meta.json"), "reserved"),
    "index_payload_flipped": (lambda ms: _with_index(ms, lambda ix: ix["entries"][0]["payload"].update(k="evil")),
                              "payload"),
}


def _assert_refused(res, expected: str, cache: Path, tmp_path: Path, before: set[str]) -> None:
    assert res.returncode != 0
    assert res.stderr.startswith("dsa-aot import: error:") and expected in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    written = [p for p in cache.rglob("*")] if cache.exists() else []
    assert written == []  # nothing inside the cache: no entry, lock, index or staging dir
    assert {p.name for p in tmp_path.iterdir()} == before  # nothing beside it
    assert not Path("/tmp", ESCAPE).exists() and not (tmp_path.parent / ESCAPE).exists()


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_hostile_bundle_is_refused(good, tmp_path, attack):
    mutate, expected = ATTACKS[attack]
    bad = _write(tmp_path / "bad.tar", mutate(_members(good)))
    work = tmp_path / "work"
    work.mkdir()
    before = {p.name for p in tmp_path.iterdir()}
    cache = tmp_path / "cache"
    res = _cli("import", str(bad), "--cache-dir", str(cache), cwd=work)
    _assert_refused(res, expected, cache, tmp_path, before)
    assert list(work.iterdir()) == []


def _oversized(good: Path, path: Path) -> Path:
    """A bundle whose cubin member claims 1 GiB + 1 bytes (a sparse file: no real disk used)."""
    members = _members(good)
    size = (1 << 30) + 1
    name = f"entries/{FP}/{ARCH}/{SIDS[0]}/fwd.cubin"
    members = _with_index([m for m in members if m[0].name != name],
                          lambda ix: _entry(ix, SIDS[0])["files"]["fwd.cubin"].update(size=size))
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
        end = tar.offset
    with open(path, "r+b") as fh:
        fh.seek(end)
        info = tarfile.TarInfo(name)
        info.size = size
        fh.write(info.tobuf(tarfile.GNU_FORMAT))
        fh.seek(-(-size // 512) * 512, os.SEEK_CUR)
        fh.write(b"\0" * 1024)
    return path


def test_oversized_member_is_refused_without_reading_it(good, tmp_path):
    bad = _oversized(good, tmp_path / "big.tar")
    assert bad.stat().st_size > (1 << 30) and bad.stat().st_blocks * 512 < (64 << 20)  # sparse
    before = {p.name for p in tmp_path.iterdir()}
    cache = tmp_path / "cache"
    res = _cli("import", str(bad), "--cache-dir", str(cache), cwd=tmp_path)
    _assert_refused(res, "over the", cache, tmp_path, before)


BROKEN = {
    # name: (bytes of the good bundle -> broken bytes, expected words in the error)
    "truncated_in_a_header": (lambda d: d[:700], "damaged or truncated"),
    "truncated_in_a_member": (lambda d: d[: len(d) // 2], "damaged or truncated"),
    "truncated_before_the_end": (lambda d: d[:-10240 + 100] if len(d) > 10240 else d[:-1], ""),
    "gzip_truncated": (lambda d: gzip.compress(d)[:3000], "damaged or truncated"),
    "gzip_corrupt": (lambda d: (lambda z: z[:3000] + bytes(b ^ 0x5A for b in z[3000:3200]) + z[3200:])(gzip.compress(d)),
                     ""),  # refused by whichever check meets it first (zlib, tar header or sha256)
    "not_a_tar": (lambda d: os.urandom(4096), "not a readable tar bundle"),
    "empty": (lambda d: b"", "not a readable tar bundle"),
}


@pytest.mark.parametrize("kind", sorted(BROKEN) + ["missing"])
def test_broken_bundle_files_are_refused(good, tmp_path, kind):
    path = tmp_path / "broken.tar"
    breaker, expected = BROKEN.get(kind, (None, "No such file"))
    if breaker is not None:
        path.write_bytes(breaker(good.read_bytes()))
    before = {p.name for p in tmp_path.iterdir()}
    cache = tmp_path / "cache"
    res = _cli("import", str(path), "--cache-dir", str(cache), cwd=tmp_path)
    _assert_refused(res, expected, cache, tmp_path, before)


def test_good_bundle_imports_through_the_cli(good, tmp_path):
    cache = tmp_path / "cache"
    res = _cli("import", str(good), "--cache-dir", str(cache), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "imported 2 entries" in res.stdout
    store = ArtifactStore(cache)
    for sid in SIDS:
        entry = store.lookup(FP, ARCH, sid)
        assert entry is not None and store.verify(entry) == [] and entry.meta.payload == {"k": sid}
