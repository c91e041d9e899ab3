"""A disk store for opaque artifact files. It knows nothing about kernels.

Layout: ``<root>/<key>/<arch>/<spec id>/`` holds the artifact files and ``meta.json``
(file table with sha256 and size, plus an opaque JSON payload). An entry becomes visible in
one ``rename`` of a fully written, fsynced staging directory on the same filesystem, with
``meta.json`` written last inside it, so a reader never sees a partial entry. Every file is
checked against its sha256 when read; a bad entry is moved to ``<root>/.quarantine``.
A diskcache (SQLite) index keeps sizes, hit counts and last use for ``gc``; it is advisory:
the directory tree is the truth, and an index failure never fails a load.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

if TYPE_CHECKING:
    from filelock import FileLock

from dsa_aot.cache.layout import (  # noqa: F401  (re-exported)
    ENTRY_FORMAT, FEATURES, INDEX, LOCKS, META, QUARANTINE, STAGING, CacheError, CorruptArtifact, _check_name, mkdirs,
    payload_sha256, sha256_bytes, shared_writable_reason)

log = logging.getLogger("dsa_aot.cache")





class FileInfo(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    sha256: str
    size: int


class EntrySignature(BaseModel):
    """An Ed25519 signature over the rest of ``meta.json`` (see :mod:`dsa_aot.cache.signing`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    algorithm: Literal["ed25519"] = "ed25519"
    key_id: str
    value: str  # base64 of the 64 signature bytes


class EntryMeta(BaseModel):
    """``meta.json``: written last, read first. ``payload_sha256`` guards the payload (e.g. a
    launch record) the way each file's sha256 guards its bytes; ``signature``, when present,
    vouches for all the rest (so for every byte of the entry)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal[ENTRY_FORMAT] = ENTRY_FORMAT
    fingerprint: str
    arch: str
    spec_id: str
    files: dict[str, FileInfo]
    created: float
    payload: dict[str, Any] = {}
    payload_sha256: str
    signature: EntrySignature | None = None

    def payload_intact(self) -> bool:
        return payload_sha256(self.payload) == self.payload_sha256


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


def check_file_names(names: Iterable[str]) -> None:
    """Raise CacheError unless every name can be an entry's file (one safe component, not META)."""
    for name in names:
        if name == META:
            raise CacheError(f"{META} is reserved")
        _check_name("file", name)


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=1)
def _host_tag() -> str:
    """Names this boot and PID namespace: only there can a staging dir's pid be checked."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:  # not Linux: the host name alone
        pass
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:8]


def _create_0644(path: str, flags: int) -> int:
    return os.open(path, flags, 0o644)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "xb", opener=_create_0644) as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


class ArtifactStore:
    """Files under one root. ``read_only`` roots (image layers) are never written."""

    def __init__(self, root: Path | str, *, read_only: bool = False, lock_timeout_s: float = 900.0) -> None:
        self.root = Path(root)
        self.read_only = read_only
        self.lock_timeout_s = lock_timeout_s
        self._index = None
        self._index_lock = threading.Lock()

    # -- paths ---------------------------------------------------------------------------
    def entry_dir(self, fingerprint: str, arch: str, spec_id: str) -> Path:
        return (self.root / _check_name("fingerprint", fingerprint) / _check_name("arch", arch)
                / _check_name("spec id", spec_id))

    def features_path(self, toolchain_fingerprint: str) -> Path:
        """Where the feature probes of one installed toolchain are kept in this root."""
        return self.root / FEATURES / f"{_check_name('fingerprint', toolchain_fingerprint)}.json"

    def keys(self) -> list[str]:
        """The key directories under the root, sorted (dot-folders are the store's own)."""
        try:
            return sorted(p.name for p in self.root.iterdir() if not p.name.startswith(".") and p.is_dir())
        except OSError:
            return []

    def candidates(self, arch: str, spec_id: str) -> Iterator[Entry]:
        """Every published entry of ``spec_id`` for ``arch``, under any key, newest first.

        For a process that cannot compute the key (no compiler installed): it picks among
        these by the identity each manifest records.
        """
        found = []
        for key in self.keys():
            entry = self.lookup(key, arch, spec_id)
            if entry is not None:
                found.append(entry)
        yield from sorted(found, key=lambda e: e.meta.created, reverse=True)

    def quarantined(self) -> list[str]:
        """Names of the quarantined entries (``<key>.<arch>.<spec id>.<reason tag>...``)."""
        try:
            return sorted(p.name for p in (self.root / QUARANTINE).iterdir())
        except OSError:
            return []

    def writable(self) -> bool:
        """True if entries can be published here (creating the root if needed)."""
        if self.read_only:
            return False
        try:
            mkdirs(self.root)
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
        if not meta.payload_intact():
            self._quarantine_path(path, f"{META}: payload sha256 mismatch")
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
    def lock(self, fingerprint: str, arch: str, spec_id: str) -> "FileLock":
        """An inter-process lock for building one key (bounded wait: ``lock_timeout_s``)."""
        locks = self.root / LOCKS
        mkdirs(locks)
        name = f"{_check_name('fingerprint', fingerprint)}.{_check_name('arch', arch)}.{_check_name('spec id', spec_id)}.lock"
        from filelock import FileLock  # only builders lock; a cache hit never imports it

        return FileLock(str(locks / name), timeout=self.lock_timeout_s)

    def publish(self, fingerprint: str, arch: str, spec_id: str, files: dict[str, bytes],
                payload: dict[str, Any] | None = None, *, signer: Any = None) -> Entry:
        """Atomically publish ``files`` as one entry; an entry already there wins and is returned.
        ``signer`` (a :class:`~dsa_aot.cache.signing.Signer`) signs its ``meta.json``."""
        meta = EntryMeta(fingerprint=fingerprint, arch=arch, spec_id=spec_id, created=time.time(),
                         files={n: FileInfo(sha256=sha256_bytes(d), size=len(d)) for n, d in files.items()},
                         payload=payload or {}, payload_sha256=payload_sha256(payload or {}))
        return self._publish(meta if signer is None else signer.sign(meta), files)

    def publish_entry(self, meta: EntryMeta, files: dict[str, bytes], *, index_later: bool = False) -> Entry:
        """Publish a copy of an entry from elsewhere (a bundle, the remote tier) with its
        ``meta.json`` unchanged, signature included. Raises CorruptArtifact unless ``files`` are
        exactly the meta's files, byte for byte. ``index_later``: the advisory index is updated
        off the caller's path (see :meth:`record_hit`)."""
        if set(files) != set(meta.files):
            raise CorruptArtifact(f"{meta.spec_id}: files {sorted(files)} are not those of its meta "
                                  f"{sorted(meta.files)}")
        for name, data in files.items():
            info = meta.files[name]
            if len(data) != info.size or sha256_bytes(data) != info.sha256:
                raise CorruptArtifact(f"{meta.spec_id}/{name}: sha256 mismatch")
        if not meta.payload_intact():
            raise CorruptArtifact(f"{meta.spec_id}: payload sha256 mismatch")
        return self._publish(meta, files, index_later)

    def _publish(self, meta: EntryMeta, files: dict[str, bytes], index_later: bool = False) -> Entry:
        if self.read_only:
            raise CacheError(f"{self.root} is a read-only cache root")
        fingerprint, arch, spec_id = meta.fingerprint, meta.arch, meta.spec_id
        final = self.entry_dir(fingerprint, arch, spec_id)
        check_file_names(files)
        staging_root = self.root / STAGING
        mkdirs(staging_root)
        staging = staging_root / f"{os.getpid()}-{_host_tag()}-{uuid.uuid4().hex}"
        staging.mkdir(mode=0o755)
        try:
            for name, data in files.items():
                _write_file(staging / name, data)
            _write_file(staging / META, meta.model_dump_json(indent=1).encode())
            _fsync_dir(staging)
            mkdirs(final.parent)
            try:
                os.rename(staging, final)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                existing = self.lookup(fingerprint, arch, spec_id)
                if existing is not None:
                    return existing
                # Debris without meta.json (e.g. a delete that was killed) is never an entry:
                # move it aside and publish, so one crash cannot block the key for good.
                self._quarantine_path(final, f"incomplete directory without {META} in the way")
                os.rename(staging, final)
            _fsync_dir(final.parent)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        entry = Entry(path=final, meta=meta)
        self._index_update(entry, created=True, later=index_later)
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
            mkdirs(dest_root)
            rel = path.relative_to(self.root)
            dest = dest_root / f"{'.'.join(rel.parts)}.{int(time.time())}.{uuid.uuid4().hex[:8]}"
            os.rename(path, dest)
            (dest_root / f"{dest.name}.reason").write_text(reason + "\n")
        except FileNotFoundError:
            pass  # another process moved it first
        except OSError as exc:
            log.warning("dsa-aot: could not quarantine %s: %s", path, exc)

    def sweep_staging(self, max_age_s: float = 3600.0) -> int:
        """Remove staging dirs of dead builders (or older than ``max_age_s``); returns the count.

        A builder counts as dead only when its pid is gone from this boot and PID namespace;
        staging dirs of other hosts or containers sharing the root are removed by age alone.
        """
        staging_root = self.root / STAGING
        if self.read_only or not staging_root.is_dir():
            return 0
        removed = 0
        now = time.time()
        for path in staging_root.iterdir():
            pid_text, _, rest = path.name.partition("-")
            host = rest.split("-", 1)[0] if "-" in rest else _host_tag()  # "<pid>-<uuid>": local
            alive = pid_text.isdigit() and (host != _host_tag() or _pid_alive(int(pid_text)))
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
        with self._index_lock:
            if self._index is None and not self.read_only:
                import diskcache

                self._index = diskcache.Cache(str(self.root / INDEX), timeout=5, disk=_json_only_disk())
        return self._index

    def _index_record(self, key: str) -> dict[str, Any] | None:
        """The JSON record of ``key``; None when missing or not a JSON object."""
        try:
            rec = json.loads(self._open_index().get(key) or "null")
        except ValueError:  # not JSON, or a row _json_only_disk refused
            return None
        return rec if isinstance(rec, dict) else None

    def _index_update(self, entry: Entry, *, created: bool = False, hit: bool = False, later: bool = False) -> None:
        if self.read_only:
            return
        if later:  # one writer thread per process, drained before the interpreter exits
            _index_writer().submit(self._index_update, entry, created=created, hit=hit)
            return
        try:
            index = self._open_index()
            with index.transact():
                rec = self._index_record(entry.key) or {"hits": 0, "created": entry.meta.created}
                rec = dict(rec, size=entry.size, last_used=time.time())
                if hit:
                    rec["hits"] = int(rec.get("hits", 0)) + 1
                index.set(entry.key, json.dumps(rec))
        except Exception as exc:  # advisory index: never fail a load or a publish
            log.debug("dsa-aot: cache index update failed for %s: %s", entry.key, exc)

    def record_hit(self, entry: Entry, *, later: bool = False) -> None:
        """Count a use of ``entry`` in the index; ``later``: in the background (the loader's
        first call does not wait for SQLite, e.g. creating the index of an empty cache)."""
        self._index_update(entry, hit=True, later=later)

    def stats(self, entry: Entry) -> dict[str, Any]:
        """Index record of an entry: size, hits, created, last_used (empty if unknown)."""
        if self.read_only:
            return {}
        try:
            return self._index_record(entry.key) or {}
        except Exception:
            return {}

    def gc(self, keep: str | Iterable[str] | None, max_bytes: int | None = None) -> GcReport:
        """Drop every key directory not in ``keep`` (None: drop all), then least-recently-used
        entries above ``max_bytes``."""
        keep_keys = set() if keep is None else {keep} if isinstance(keep, str) else set(keep)
        if self.read_only:
            raise CacheError(f"{self.root} is a read-only cache root")
        self.sweep_staging()
        removed_fps, removed, freed = [], [], 0
        if self.root.is_dir():
            for fp_dir in sorted(self.root.iterdir()):
                if fp_dir.name.startswith(".") or not fp_dir.is_dir() or fp_dir.name in keep_keys:
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


_WRITER: tuple[int, Any] | None = None
_WRITER_LOCK = threading.Lock()


def _index_writer():
    """The process's index-writer thread pool (one thread; recreated after a fork). Its pending
    updates run before the interpreter exits (``concurrent.futures`` joins its threads)."""
    global _WRITER
    with _WRITER_LOCK:
        if _WRITER is None or _WRITER[0] != os.getpid():
            from concurrent.futures import ThreadPoolExecutor

            _WRITER = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsa-aot-index"))
        return _WRITER[1]


def _json_only_disk():
    """A diskcache ``Disk`` for rows that are str keys and inline JSON text. Whatever a row in
    ``cache.db`` says, it never unpickles (diskcache would, for non-str keys and values) and never
    reads or deletes a file the row names: the index is advisory and nothing in it runs."""
    import diskcache
    from diskcache.core import MODE_RAW

    class JsonOnlyDisk(diskcache.Disk):
        def get(self, key, raw):
            if not raw:
                raise ValueError("refusing a pickled cache index key")
            return super().get(key, raw)

        def store(self, value, read, key=diskcache.core.UNKNOWN):
            if not isinstance(value, str) or len(value) >= self.min_file_size:
                raise ValueError("the cache index holds short JSON text only")
            return super().store(value, read, key=key)

        def fetch(self, mode, filename, value, read):
            if mode != MODE_RAW or filename is not None:
                raise ValueError("refusing a cache index row that is not inline text")
            return super().fetch(mode, filename, value, read)

        def remove(self, file_path):
            pass  # rows here never own files: never delete a path that a row names

    return JsonOnlyDisk


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
