"""Export and import verified bundles of cache entries (copy a cache between machines/stages).

A bundle is a tar file: ``bundle.json`` (every entry's meta: file names, sizes, sha256) and
the files at ``entries/<fingerprint>/<arch>/<spec id>/<file>``. Import never extracts the
tar: it reads each expected member by its exact name, refuses anything else (links, devices,
``..`` or absolute names, unexpected or oversized members), checks every sha256 (and, given a trust check, every signature), then publishes each entry
through the store's atomic path with its ``meta.json`` unchanged, so signatures travel with it.
"""

from __future__ import annotations

import io
import lzma
import os
import tarfile
import time
import zlib
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from dsa_aot.cache.store import ArtifactStore, CacheError, EntryMeta, check_file_names, sha256_bytes

MAX_MEMBER_BYTES = 1 << 30
MAX_META_BYTES = 64 << 20
#: What reading a truncated or corrupt (possibly compressed) tar raises.
_DAMAGED = (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError)


class BundleError(CacheError):
    """A bundle is malformed or hostile; nothing from it was written."""


class BundleIndex(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal["dsa-aot.bundle.v1"] = "dsa-aot.bundle.v1"
    created: float
    entries: list[EntryMeta]


@dataclass(frozen=True)
class ImportReport:
    imported: list[str]
    already_present: list[str]


def _member_name(meta: EntryMeta, name: str) -> str:
    return f"entries/{meta.fingerprint}/{meta.arch}/{meta.spec_id}/{name}"


def export_bundle(store: ArtifactStore, path: Path, *, fingerprint: str | None = None,
                  archs: list[str] | None = None, spec_ids: set[str] | None = None,
                  keys: set[str] | None = None) -> list[str]:
    """Write a bundle of every verified entry matching the filters (one key directory, a set of
    them, archs, spec ids); returns the entry keys written."""
    entries = []
    for entry in store.entries():
        m = entry.meta
        if (fingerprint and m.fingerprint != fingerprint) or (keys is not None and m.fingerprint not in keys) \
                or (archs and m.arch not in archs) \
                or (spec_ids is not None and m.spec_id not in spec_ids):
            continue
        problems = store.verify(entry)
        if problems:
            raise BundleError(f"refusing to export a damaged entry: {problems[0]}")
        entries.append(entry)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tarfile.open(tmp, "w") as tar:
            index = BundleIndex(created=time.time(), entries=[e.meta for e in entries])
            _add(tar, "bundle.json", index.model_dump_json(indent=1).encode())
            for entry in entries:
                for name in entry.meta.files:
                    _add(tar, _member_name(entry.meta, name), store.read_file(entry, name))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return [e.key for e in entries]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def _read_member(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], name: str, limit: int) -> bytes:
    info = members.get(name)
    if info is None:
        raise BundleError(f"bundle lacks member {name!r}")
    if not info.isreg():
        raise BundleError(f"bundle member {name!r} is not a regular file (links and devices are refused)")
    if info.size > limit:
        raise BundleError(f"bundle member {name!r} is {info.size} bytes, over the {limit}-byte limit")
    fh = tar.extractfile(info)
    if fh is None:
        raise BundleError(f"cannot read bundle member {name!r}")
    data = fh.read(limit + 1)
    if len(data) != info.size:
        raise BundleError(f"bundle member {name!r} is truncated")
    return data


def _verified_entries(tar: tarfile.TarFile, store: ArtifactStore,
                      max_member_bytes: int) -> list[tuple[EntryMeta, dict[str, bytes]]]:
    """Every entry of the bundle with its files, all checked; raises BundleError on anything else."""
    members: dict[str, tarfile.TarInfo] = {}
    for info in tar.getmembers():
        name = info.name
        if name.startswith("/") or ".." in Path(name).parts or "\\" in name:
            raise BundleError(f"bundle member {name!r} has an unsafe path")
        if name in members:
            raise BundleError(f"bundle member {name!r} appears twice")
        members[name] = info
    try:
        index = BundleIndex.model_validate_json(_read_member(tar, members, "bundle.json", MAX_META_BYTES))
    except BundleError:
        raise
    except ValueError as exc:
        raise BundleError(f"bundle.json is invalid: {exc}") from None
    expected = {"bundle.json"}
    staged: list[tuple[EntryMeta, dict[str, bytes]]] = []
    for meta in index.entries:
        store.entry_dir(meta.fingerprint, meta.arch, meta.spec_id)  # validates the names
        check_file_names(meta.files)  # before anything is written, not at publish time
        if not meta.payload_intact():
            raise BundleError(f"bundle entry {meta.spec_id}: payload sha256 mismatch")
        files = {}
        for name, info in meta.files.items():
            member = _member_name(meta, name)
            expected.add(member)
            data = _read_member(tar, members, member, max_member_bytes)
            if len(data) != info.size or sha256_bytes(data) != info.sha256:
                raise BundleError(f"bundle member {member!r}: sha256 mismatch")
            files[name] = data
        staged.append((meta, files))
    unexpected = sorted(set(members) - expected - {n for n in members if members[n].isdir()})
    if unexpected:
        raise BundleError(f"bundle has unexpected members: {unexpected[:5]}")
    return staged


def import_bundle(store: ArtifactStore, path: Path, *, max_member_bytes: int = MAX_MEMBER_BYTES,
                  accept: Callable[[EntryMeta], str | None] | None = None) -> ImportReport:
    """Verify a whole bundle, then publish its entries. Raises BundleError before writing anything
    if any member is hostile, any hash is wrong or ``accept`` (the trust check) refuses an entry."""
    try:
        tar = tarfile.open(path, "r:*")
    except (tarfile.TarError, OSError) as exc:
        raise BundleError(f"{path} is not a readable tar bundle: {exc}") from None
    try:
        with tar:
            staged = _verified_entries(tar, store, max_member_bytes)
    except _DAMAGED as exc:  # a truncated or corrupt archive or compressed stream
        raise BundleError(f"{path} is damaged or truncated: {type(exc).__name__}: {exc}") from None
    for meta, _ in staged if accept is not None else ():
        refused = accept(meta)
        if refused:
            raise BundleError(f"bundle entry {meta.spec_id} is not trusted: {refused}")
    imported, present = [], []
    for meta, files in staged:
        key = f"{meta.fingerprint}/{meta.arch}/{meta.spec_id}"
        if store.lookup(meta.fingerprint, meta.arch, meta.spec_id) is not None:
            present.append(key)
            continue
        with store.lock(meta.fingerprint, meta.arch, meta.spec_id):
            store.publish_entry(meta, files)
        imported.append(key)
    return ImportReport(imported, present)
