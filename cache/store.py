"""A disk store for opaque artifact files. It knows nothing about kernels.

Layout: ``<root>/<fingerprint>/<arch>/<spec id>/`` holds the artifact files and ``meta.json``
(file table with sha256 and size, plus an opaque JSON payload). An entry becomes visible in
one ``rename`` of a fully written, fsynced staging directory on the same filesystem, with
``meta.json`` written last inside it, so a reader never sees a partial entry. Every file is
checked against its sha256 when read; a bad entry is moved to ``<root>/.quarantine``.
A diskcache (SQLite) index keeps sizes, hit counts and last use for ``gc``; it is advisory:
the directory tree is the truth, and an index failure never fails a load.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from filelock import FileLock
from pydantic import BaseModel, ConfigDict, ValidationError

log = logging.getLogger("dsa_aot.cache")

META = "meta.json"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
STAGING, QUARANTINE, LOCKS, INDEX = ".staging", ".quarantine", ".locks", ".index"


class CacheError(RuntimeError):
    """The store cannot do what was asked; the message says why and what to do."""


class CorruptArtifact(CacheError):
    """A file does not match the sha256 recorded for it."""


class FileInfo(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    sha256: str
    size: int


class EntryMeta(BaseModel):
    """``meta.json``: written last, read first."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal["dsa-aot.entry.v1"] = "dsa-aot.entry.v1"
    fingerprint: str
    arch: str
    spec_id: str
    files: dict[str, FileInfo]
    created: float
    payload: dict[str, Any] = {}


@dataclass(frozen=True)
class Entry:
    path: Path
    meta: EntryMeta

    @property
    def key(self) -> str:
        return f"{self.meta.fingerprint}/{self.meta.arch}/{self.meta.spec_id}"

    @property
    def size(self) -> int:
        return sum(f.size for f in self.meta.files.values())


@dataclass(frozen=True)
class GcReport:
    removed_fingerprints: list[str]
    removed_entries: list[str]
    freed_bytes: int
    remaining_bytes: int


def _check_name(kind: str, value: str) -> str:
    if not _NAME.match(value) or value in (".", ".."):
        raise CacheError(f"invalid {kind} {value!r}: use letters, digits, '_', '-', '.'")
    return value


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "xb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def shared_writable_reason(root: Path) -> str | None:
    """Why ``root`` is unsafe to load code from (writable by other users), or None."""
    try:
        st = root.stat()
    except FileNotFoundError:
        return None
    if st.st_mode & stat.S_IWOTH:
        return f"{root} is world-writable (mode {stat.filemode(st.st_mode)})"
    if st.st_mode & stat.S_IWGRP:
        return f"{root} is group-writable (mode {stat.filemode(st.st_mode)})"
    if hasattr(os, "getuid") and st.st_uid not in (os.getuid(), 0):
        return f"{root} is owned by uid {st.st_uid}, not by this user"
    return None


class ArtifactStore:
    """Files under one root. ``read_only`` roots (image layers) are never written."""

    def __init__(self, root: Path | str, *, read_only: bool = False, lock_timeout_s: float = 900.0) -> None:
        self.root = Path(root)
        self.read_only = read_only
        self.lock_timeout_s = lock_timeout_s
        self._index = None

    # -- paths ---------------------------------------------------------------------------
    def entry_dir(self, fingerprint: str, arch: str, spec_id: str) -> Path:
        return (self.root / _check_name("fingerprint", fingerprint) / _check_name("arch", arch)
                / _check_name("spec id", spec_id))

    def writable(self) -> bool:
        """True if entries can be published here (creating the root if needed)."""
        if self.read_only:
            return False
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError:
            return False
        return os.access(self.root, os.W_OK | os.X_OK)

    # -- reading -------------------------------------------------------------------------
    def lookup(self, fingerprint: str, arch: str, spec_id: str) -> Entry | None:
        """The published entry, or None. A malformed ``meta.json`` is quarantined (logged)."""
        path = self.entry_dir(fingerprint, arch, spec_id)
        try:
            raw = (path / META).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            meta = EntryMeta.model_validate_json(raw)
        except ValidationError as exc:
            self._quarantine_path(path, f"unreadable {META}: {exc.errors()[0]['msg']}")
            return None
        if (meta.fingerprint, meta.arch, meta.spec_id) != (fingerprint, arch, spec_id):
            self._quarantine_path(path, f"{META} names {meta.fingerprint}/{meta.arch}/{meta.spec_id}")
            return None
        return Entry(path=path, meta=meta)

    def read_file(self, entry: Entry, name: str) -> bytes:
        """The bytes of one file, after checking size and sha256 (raises CorruptArtifact)."""
        info = entry.meta.files.get(name)
        if info is None:
            raise CorruptArtifact(f"{entry.key}: no file {name!r} in {META}")
        try:
            data = (entry.path / _check_name("file", name)).read_bytes()
        except OSError as exc:
            raise CorruptArtifact(f"{entry.key}/{name}: {exc}") from exc
        if len(data) != info.size or sha256_bytes(data) != info.sha256:
            raise CorruptArtifact(f"{entry.key}/{name}: sha256 mismatch (expected {info.sha256[:12]}, "
                                  f"{len(data)} of {info.size} bytes)")
        return data

    def verify(self, entry: Entry) -> list[str]:
        """Problems found re-hashing every file of ``entry`` (empty when intact)."""
        problems = []
        for name in entry.meta.files:
            try:
                self.read_file(entry, name)
            except CorruptArtifact as exc:
                problems.append(str(exc))
        extra = {p.name for p in entry.path.iterdir()} - set(entry.meta.files) - {META}
        problems += [f"{entry.key}: unexpected file {name!r}" for name in sorted(extra)]
        return problems

    def entries(self) -> Iterator[Entry]:
        """Every published entry under the root, in a stable order."""
        if not self.root.is_dir():
            return
        for fp_dir in sorted(self.root.iterdir()):
            if fp_dir.name.startswith(".") or not fp_dir.is_dir():
                continue
            for arch_dir in sorted(p for p in fp_dir.iterdir() if p.is_dir()):
                for spec_dir in sorted(p for p in arch_dir.iterdir() if p.is_dir()):
                    entry = self.lookup(fp_dir.name, arch_dir.name, spec_dir.name)
                    if entry is not None:
                        yield entry

    # -- writing -------------------------------------------------------------------------
    def lock(self, fingerprint: str, arch: str, spec_id: str) -> FileLock:
        """An inter-process lock for building one key (bounded wait: ``lock_timeout_s``)."""
        locks = self.root / LOCKS
        locks.mkdir(parents=True, exist_ok=True)
        name = f"{_check_name('fingerprint', fingerprint)}.{_check_name('arch', arch)}.{_check_name('spec id', spec_id)}.lock"
        return FileLock(str(locks / name), timeout=self.lock_timeout_s)

    def publish(self, fingerprint: str, arch: str, spec_id: str, files: dict[str, bytes],
                payload: dict[str, Any] | None = None) -> Entry:
        """Atomically publish ``files`` as one entry; an entry already there wins and is returned."""
        if self.read_only:
            raise CacheError(f"{self.root} is a read-only cache root")
        final = self.entry_dir(fingerprint, arch, spec_id)
        for name in files:
            if name == META:
                raise CacheError(f"{META} is reserved")
            _check_name("file", name)
        staging_root = self.root / STAGING
        staging_root.mkdir(parents=True, exist_ok=True)
        staging = staging_root / f"{os.getpid()}-{uuid.uuid4().hex}"
        staging.mkdir()
        try:
            for name, data in files.items():
                _write_file(staging / name, data)
            meta = EntryMeta(fingerprint=fingerprint, arch=arch, spec_id=spec_id, created=time.time(),
                             files={n: FileInfo(sha256=sha256_bytes(d), size=len(d)) for n, d in files.items()},
                             payload=payload or {})
            _write_file(staging / META, meta.model_dump_json(indent=1).encode())
            _fsync_dir(staging)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(staging, final)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                existing = self.lookup(fingerprint, arch, spec_id)
                if existing is not None:
                    return existing
                raise
            _fsync_dir(final.parent)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        entry = Entry(path=final, meta=meta)
        self._index_update(entry, created=True)
        return entry

    def quarantine(self, entry: Entry, reason: str) -> None:
        """Move a bad entry aside (kept for inspection) so the next lookup misses."""
        self._quarantine_path(entry.path, reason)

    def _quarantine_path(self, path: Path, reason: str) -> None:
        log.warning("dsa-aot: quarantining cache entry %s: %s", path, reason)
        if self.read_only:
            return
        dest_root = self.root / QUARANTINE
        try:
            dest_root.mkdir(parents=True, exist_ok=True)
            rel = path.relative_to(self.root)
            dest = dest_root / f"{'.'.join(rel.parts)}.{int(time.time())}.{uuid.uuid4().hex[:8]}"
            os.rename(path, dest)
            (dest_root / f"{dest.name}.reason").write_text(reason + "\n")
        except FileNotFoundError:
            pass  # another process moved it first
        except OSError as exc:
            log.warning("dsa-aot: could not quarantine %s: %s", path, exc)

    def sweep_staging(self, max_age_s: float = 3600.0) -> int:
        """Remove staging dirs of dead builders (or older than ``max_age_s``); returns the count."""
        staging_root = self.root / STAGING
        if self.read_only or not staging_root.is_dir():
            return 0
        removed = 0
        now = time.time()
        for path in staging_root.iterdir():
            pid_text = path.name.split("-", 1)[0]
            alive = pid_text.isdigit() and _pid_alive(int(pid_text))
            try:
                old = now - path.stat().st_mtime > max_age_s
            except FileNotFoundError:
                continue
            if not alive or old:
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
        return removed

    # -- index and gc --------------------------------------------------------------------
    def _open_index(self):
        if self._index is None and not self.read_only:
            import diskcache

            self._index = diskcache.Cache(str(self.root / INDEX), timeout=5)
        return self._index

    def _index_update(self, entry: Entry, *, created: bool = False, hit: bool = False) -> None:
        if self.read_only:
            return
        try:
            index = self._open_index()
            with index.transact():
                rec = index.get(entry.key) or {"hits": 0, "created": entry.meta.created}
                rec = dict(rec, size=entry.size, last_used=time.time())
                if hit:
                    rec["hits"] = int(rec.get("hits", 0)) + 1
                index.set(entry.key, rec)
        except Exception as exc:  # advisory index: never fail a load or a publish
            log.debug("dsa-aot: cache index update failed for %s: %s", entry.key, exc)

    def record_hit(self, entry: Entry) -> None:
        self._index_update(entry, hit=True)

    def stats(self, entry: Entry) -> dict[str, Any]:
        """Index record of an entry: size, hits, created, last_used (empty if unknown)."""
        if self.read_only:
            return {}
        try:
            return dict(self._open_index().get(entry.key) or {})
        except Exception:
            return {}

    def gc(self, keep_fingerprint: str | None, max_bytes: int | None = None) -> GcReport:
        """Drop other fingerprints' trees, then least-recently-used entries above ``max_bytes``."""
        if self.read_only:
            raise CacheError(f"{self.root} is a read-only cache root")
        removed_fps, removed, freed = [], [], 0
        if self.root.is_dir():
            for fp_dir in sorted(self.root.iterdir()):
                if fp_dir.name.startswith(".") or not fp_dir.is_dir() or fp_dir.name == keep_fingerprint:
                    continue
                freed += _tree_size(fp_dir)
                shutil.rmtree(fp_dir, ignore_errors=True)
                removed_fps.append(fp_dir.name)
        live = list(self.entries())
        total = sum(e.size for e in live)
        if max_bytes is not None and total > max_bytes:
            def last_used(e: Entry) -> float:
                return float(self.stats(e).get("last_used", e.meta.created))
            for entry in sorted(live, key=last_used):
                if total <= max_bytes:
                    break
                with self.lock(entry.meta.fingerprint, entry.meta.arch, entry.meta.spec_id):
                    shutil.rmtree(entry.path, ignore_errors=True)
                total -= entry.size
                freed += entry.size
                removed.append(entry.key)
        try:
            index = self._open_index()
            keys = {e.key for e in self.entries()}
            for key in list(index.iterkeys()):
                if key not in keys:
                    index.delete(key)
        except Exception as exc:
            log.debug("dsa-aot: cache index cleanup failed: %s", exc)
        shutil.rmtree(self.root / QUARANTINE, ignore_errors=True)
        return GcReport(removed_fps, removed, freed, total)


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
