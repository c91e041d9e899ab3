"""The remote tier: cache entries shared by a fleet through one Redis server.

Layout under a key prefix (``dsa-aot:v1``):

* ``blob:<sha256>``: the bytes of one file, content-addressed, so identical files are stored once;
* ``entry:<key>:<arch>:<spec id>``: a :class:`RemoteManifest`, the entry's ``meta.json``
  (every file's sha256 and size, the payload with the builder's identities, the signature)
  plus who pushed it;
* ``spec:<arch>:<spec id>``: the set of keys holding an entry of that spec (for processes that
  look entries up by runtime identity);
* ``lease:<key>:<arch>:<spec id>``: a :class:`LeaseRecord` while one node compiles that entry.

A push writes the blobs first and the manifest last, so a manifest names blobs that were
there. A pull fetches every blob, checks each against the manifest's size and sha256 and only
then publishes into a local :class:`~dsa_aot.cache.store.ArtifactStore` (atomically, the
manifest unchanged). Every call is bounded by the connect and socket timeouts, never retried;
after a connection failure the server is not asked again for ``retry_after_s``, so an
unreachable server costs one timeout, not one per lookup. Read methods turn every failure into
a logged miss. The reads a first call makes go through :mod:`dsa_aot.cache.resp` (the
standard library only); the ``redis`` package is imported for writes, leases and the CLI.
A pull serves the verified bytes from memory at once and publishes them into the local cache
on a background thread (joined at exit, or by :func:`wait_for_publishes`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, ValidationError

from dsa_aot.cache.store import (ArtifactStore, CacheError, CorruptArtifact, Entry, EntryMeta, _check_name,
                                 sha256_bytes)

log = logging.getLogger("dsa_aot.cache")

PREFIX = "dsa-aot:v1"
#: Compare-and-delete / compare-and-extend of a lease: only the holder's exact record matches.
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
_RENEW = ("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) "
          "else return 0 end")


class RemoteError(CacheError):
    """The remote cannot be reached or refused an operation (a miss for readers)."""


class UntrustedEntry(CacheError):
    """An entry's signature does not verify under the trusted keys."""


class RemoteManifest(BaseModel):
    """``entry:<key>:<arch>:<spec id>``: the entry's ``meta.json`` and who pushed it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal["dsa-aot.remote.v1"] = "dsa-aot.remote.v1"
    meta: EntryMeta
    pushed: float
    pushed_by: str


class LeaseRecord(BaseModel):
    """``lease:<key>:<arch>:<spec id>``: the node compiling that entry, with a random token."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal["dsa-aot.lease.v1"] = "dsa-aot.lease.v1"
    token: str
    holder: str  # host:pid
    acquired: float


@dataclass(frozen=True)
class PushReport:
    """What one push sent: ``manifest`` is False when the same manifest was there already."""

    manifest: bool
    blobs_sent: int
    blobs_present: int
    bytes_sent: int


def _holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def redacted(url: str) -> str:
    """``url`` without its password (for logs and sources)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class _Fetched:
    """Verified files of a pulled entry kept in memory (no writable local cache to publish to)."""

    read_only = True

    def __init__(self, root: str, files: dict[str, bytes]) -> None:
        self.root, self._files = root, files

    def read_file(self, entry: Entry, name: str) -> bytes:
        try:
            return self._files[name]
        except KeyError:
            raise CorruptArtifact(f"{entry.key}: no file {name!r}") from None

    def quarantine(self, entry: Entry, reason: str) -> None:
        log.warning("dsa-aot: refused remote entry %s: %s", entry.key, reason)

    def record_hit(self, entry: Entry, *, later: bool = False) -> None:
        pass


class RemoteStore:
    """One Redis server as a store: read like :class:`ArtifactStore` (``lookup``,
    ``candidates``), copied into the local cache by :meth:`pull`, written by :meth:`push`.

    ``read_only`` is True for the loader (it never publishes here directly); ``writable`` says
    whether this process may push and take leases.
    """

    read_only = True
    remote = True

    def __init__(self, url: str, *, writable: bool = False, connect_timeout_s: float = 0.1,
                 timeout_s: float = 0.5, ttl_s: float = 0.0, retry_after_s: float = 30.0,
                 prefix: str = PREFIX) -> None:
        self.url = url
        self.root = redacted(url)
        self.writable = writable
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self.ttl_ms = int(ttl_s * 1000) or None
        self.retry_after_s = retry_after_s
        self.prefix = prefix
        self._client_obj: Any = None
        self._reader_obj: Any = None
        self._down_until = 0.0
        self._lock = threading.Lock()

    # -- connection -----------------------------------------------------------------------
    def _client(self):
        if self._client_obj is None:
            try:
                import redis
                from redis.backoff import NoBackoff
                from redis.retry import Retry
            except ImportError:
                why = "the redis package is not installed; pip install 'dsa-aot[remote]'"
                if self._down_until != float("inf"):
                    log.warning("dsa-aot: remote cache %s not used: %s", self.root, why)
                self._down_until = float("inf")
                raise RemoteError(f"{self.root}: {why}") from None
            self._client_obj = redis.Redis.from_url(
                self.url, socket_connect_timeout=self.connect_timeout_s, socket_timeout=self.timeout_s,
                retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0)
        return self._client_obj

    @property
    def available(self) -> bool:
        """False for ``retry_after_s`` after a connection failure."""
        return time.monotonic() >= self._down_until

    def _reader(self):
        """The read client: :class:`~dsa_aot.cache.resp.RespClient` where it reads the URL,
        else the ``redis`` client."""
        if self._reader_obj is None:
            from dsa_aot.cache import resp

            if not resp.supported(self.url):
                return self._client()
            self._reader_obj = resp.RespClient(self.url, connect_timeout_s=self.connect_timeout_s,
                                               timeout_s=self.timeout_s)
        return self._reader_obj

    def _call(self, what: str, fn: Callable[[Any], Any], *, read: bool = False) -> Any:
        """``fn(client)`` (the read client when ``read``); any failure raises RemoteError (a
        connection failure also starts the back-off during which the server is not asked)."""
        client = self._reader() if read else self._client()
        if not self.available:
            raise RemoteError(f"{self.root} is unavailable (retrying in "
                              f"{self._down_until - time.monotonic():.0f} s)")
        from dsa_aot.cache import resp

        if isinstance(client, resp.RespClient):
            lost, refused = (resp.RespConnectionError,), (resp.RespError,)
        else:
            import redis

            lost, refused = (redis.ConnectionError, redis.TimeoutError, OSError), (redis.RedisError,)
        try:
            return fn(client)
        except lost as exc:
            with self._lock:
                first = self.available
                self._down_until = time.monotonic() + self.retry_after_s
            if first:
                log.warning("dsa-aot: remote cache %s unreachable during %s (%s: %s); not asking it "
                            "again for %.0f s", self.root, what, type(exc).__name__, exc, self.retry_after_s)
            try:  # never reuse a connection left mid-reply
                client.close() if isinstance(client, resp.RespClient) else client.connection_pool.disconnect()
            except Exception:
                pass
            raise RemoteError(f"{self.root}: {what}: {type(exc).__name__}: {exc}") from None
        except refused as exc:
            raise RemoteError(f"{self.root}: {what}: {type(exc).__name__}: {exc}") from None

    def ping(self) -> float:
        """Round-trip milliseconds (raises RemoteError)."""
        start = time.perf_counter()
        self._call("ping", lambda c: c.ping())
        return (time.perf_counter() - start) * 1e3

    # -- names ----------------------------------------------------------------------------
    def _entry_key(self, fingerprint: str, arch: str, spec_id: str) -> str:
        return (f"{self.prefix}:entry:{_check_name('fingerprint', fingerprint)}:{_check_name('arch', arch)}:"
                f"{_check_name('spec id', spec_id)}")

    def _spec_key(self, arch: str, spec_id: str) -> str:
        return f"{self.prefix}:spec:{_check_name('arch', arch)}:{_check_name('spec id', spec_id)}"

    def _blob_key(self, sha256: str) -> str:
        return f"{self.prefix}:blob:{sha256}"

    def _lease_key(self, fingerprint: str, arch: str, spec_id: str) -> str:
        return f"{self.prefix}:lease:{fingerprint}:{arch}:{spec_id}"

    # -- reading --------------------------------------------------------------------------
    def _parse(self, raw: bytes | None, fingerprint: str, arch: str, spec_id: str) -> Entry | None:
        if raw is None:
            return None
        where = f"{fingerprint}/{arch}/{spec_id}"
        try:
            meta = RemoteManifest.model_validate_json(raw).meta
        except ValidationError as exc:
            log.warning("dsa-aot: remote manifest %s on %s is unreadable: %s", where, self.root,
                        exc.errors()[0]["msg"])
            return None
        if (meta.fingerprint, meta.arch, meta.spec_id) != (fingerprint, arch, spec_id):
            log.warning("dsa-aot: remote manifest %s on %s names %s/%s/%s; not used", where, self.root,
                        meta.fingerprint, meta.arch, meta.spec_id)
            return None
        if not meta.payload_intact():
            log.warning("dsa-aot: remote manifest %s on %s: payload sha256 mismatch; not used", where, self.root)
            return None
        return Entry(path=Path(f"<{self.root}>", fingerprint, arch, spec_id), meta=meta)

    def lookup(self, fingerprint: str, arch: str, spec_id: str) -> Entry | None:
        """The entry's manifest, or None (missing, unreadable or the server unreachable: logged)."""
        name = self._entry_key(fingerprint, arch, spec_id)
        try:
            raw = self._call("lookup", lambda c: c.get(name), read=True)
        except RemoteError as exc:
            log.debug("dsa-aot: remote lookup of %s missed: %s", name, exc)
            return None
        return self._parse(raw, fingerprint, arch, spec_id)

    def candidates(self, arch: str, spec_id: str) -> Iterator[Entry]:
        """Every entry of ``spec_id`` for ``arch`` under any key, newest first."""
        try:
            keys = sorted(k.decode() for k in self._call("candidates", lambda c: c.smembers(
                self._spec_key(arch, spec_id)), read=True))
            keys = [k for k in keys if _valid_name(k)]
            names = [self._entry_key(k, arch, spec_id) for k in keys]
            raws = self._call("candidates", lambda c: c.mget(names), read=True) if names else []
        except RemoteError as exc:
            log.debug("dsa-aot: remote candidates of %s missed: %s", spec_id, exc)
            return
        found = [e for e in (self._parse(r, k, arch, spec_id) for k, r in zip(keys, raws)) if e is not None]
        yield from sorted(found, key=lambda e: e.meta.created, reverse=True)

    def fetch(self, entry: Entry) -> dict[str, bytes]:
        """Every file of ``entry``, each checked against the manifest's size and sha256.
        Raises RemoteError (unreachable, a blob missing) or CorruptArtifact (a byte differs)."""
        names = list(entry.meta.files)
        blobs = self._call("fetch", lambda c: c.mget([self._blob_key(entry.meta.files[n].sha256) for n in names]),
                           read=True)
        files = {}
        for name, data in zip(names, blobs):
            info = entry.meta.files[name]
            if data is None:
                raise RemoteError(f"{entry.key}/{name}: blob {info.sha256[:12]} is missing on {self.root}")
            if len(data) != info.size or sha256_bytes(data) != info.sha256:
                raise CorruptArtifact(f"{entry.key}/{name}: remote blob fails its sha256 check (expected "
                                      f"{info.sha256[:12]}, {len(data)} of {info.size} bytes)")
            files[name] = data
        return files

    def pull(self, entry: Entry, into: ArtifactStore | None,
             accept: Callable[[EntryMeta], str | None] | None = None, *,
             background: bool = False) -> tuple[Any, Entry]:
        """Fetch and verify ``entry`` and publish it into ``into`` (atomically, its meta
        unchanged); returns ``(store, entry)`` to load it from. Without a usable ``into`` the
        verified files are served from memory; with ``background`` they are served from memory
        at once while a thread publishes them (a first call does not wait for the disk).
        ``accept`` (the trust check) runs before any blob is fetched. Raises CacheError
        (RemoteError, CorruptArtifact, UntrustedEntry)."""
        why = accept(entry.meta) if accept is not None else None
        if why:
            raise UntrustedEntry(why)
        files = self.fetch(entry)
        if into is not None and background:
            _publish_later(self.root, into, entry, files)
        elif into is not None:
            published = _publish(self.root, into, entry, files)
            if published is not None:
                return into, published
        return _Fetched(self.root, files), entry

    def read_file(self, entry: Entry, name: str) -> bytes:
        raise CorruptArtifact(f"{entry.key}: remote entries are pulled into a local cache, never read in place")

    def quarantine(self, entry: Entry, reason: str) -> None:
        log.warning("dsa-aot: remote entry %s on %s is bad: %s", entry.key, self.root, reason)

    def record_hit(self, entry: Entry, *, later: bool = False) -> None:
        pass

    # -- writing --------------------------------------------------------------------------
    def push(self, meta: EntryMeta, read: Callable[[str], bytes]) -> PushReport:
        """Upload one entry: the blobs the server lacks, then its manifest (unless the same one
        is there; either way the TTL is refreshed). ``read(name)`` gives a file's verified
        bytes. Raises RemoteError."""
        if not self.writable:
            raise RemoteError(f"{self.root} is read-only for this process (DSA_AOT_REMOTE_WRITE=0)")
        name = self._entry_key(meta.fingerprint, meta.arch, meta.spec_id)
        shas = sorted({info.sha256 for info in meta.files.values()})
        present = self._call("push", lambda c: self._exists_many(c, shas))
        sent = sent_bytes = 0
        by_sha = {info.sha256: n for n, info in meta.files.items()}
        for sha, there in zip(shas, present):
            key = self._blob_key(sha)
            if there:
                if self.ttl_ms:
                    self._call("push", lambda c, k=key: c.pexpire(k, self.ttl_ms))
                continue
            data = read(by_sha[sha])
            if sha256_bytes(data) != sha:
                raise CorruptArtifact(f"{meta.spec_id}/{by_sha[sha]}: local bytes fail their sha256 check")
            self._call("push", lambda c, k=key, d=data: c.set(k, d, px=self.ttl_ms))
            sent += 1
            sent_bytes += len(data)
        existing = self._call("push", lambda c: c.get(name))
        same = False
        if existing is not None:
            try:
                same = RemoteManifest.model_validate_json(existing).meta == meta
            except ValidationError:
                same = False
        record = RemoteManifest(meta=meta, pushed=time.time(), pushed_by=_holder())

        def write(c):
            pipe = c.pipeline(transaction=True)
            if same:
                if self.ttl_ms:
                    pipe.pexpire(name, self.ttl_ms)
            else:
                pipe.set(name, record.model_dump_json(), px=self.ttl_ms)
            spec_key = self._spec_key(meta.arch, meta.spec_id)
            pipe.sadd(spec_key, meta.fingerprint)
            if self.ttl_ms:
                pipe.pexpire(spec_key, self.ttl_ms)
            pipe.execute()
        self._call("push", write)
        return PushReport(not same, sent, len(shas) - sent, sent_bytes)

    def _exists_many(self, client, shas: list[str]) -> list[bool]:
        pipe = client.pipeline(transaction=False)
        for sha in shas:
            pipe.exists(self._blob_key(sha))
        return [bool(x) for x in pipe.execute()]

    def push_entry(self, store: ArtifactStore, entry: Entry) -> PushReport:
        """Upload a local entry, its files read (and sha256-checked) from ``store``."""
        return self.push(entry.meta, lambda name: store.read_file(entry, name))

    def lease(self, fingerprint: str, arch: str, spec_id: str, ttl_s: float) -> Lease:
        """The fleet-wide compile lease of one entry (not yet acquired)."""
        return Lease(self, self._lease_key(fingerprint, arch, spec_id), ttl_s)


def _publish(source: str, into: ArtifactStore, entry: Entry, files: dict[str, bytes]) -> Entry | None:
    """Publish pulled, verified files into ``into``; None when that failed (logged: the files
    are served from memory). A CorruptArtifact propagates."""
    try:
        return into.publish_entry(entry.meta, files, index_later=True)
    except CorruptArtifact:
        raise
    except (OSError, CacheError) as exc:
        log.warning("dsa-aot: could not store %s pulled from %s in %s: %s; using it from memory",
                    entry.key, source, into.root, exc)
        return None


_PUBLISHING: list[threading.Thread] = []
_PUBLISHING_LOCK = threading.Lock()


def _publish_later(source: str, into: ArtifactStore, entry: Entry, files: dict[str, bytes]) -> None:
    def run() -> None:
        try:
            _publish(source, into, entry, files)
        except CorruptArtifact as exc:  # never raised into a user's call
            log.warning("dsa-aot: not storing %s pulled from %s: %s", entry.key, source, exc)

    # not a daemon: the interpreter joins it at exit, so a short-lived process still publishes
    thread = threading.Thread(target=run, name=f"dsa-aot-publish-{entry.meta.spec_id}")
    with _PUBLISHING_LOCK:
        _PUBLISHING[:] = [t for t in _PUBLISHING if t.is_alive()]
        _PUBLISHING.append(thread)
    thread.start()


def wait_for_publishes(timeout_s: float | None = None) -> bool:
    """Join the local publishes that pulls left running; True when none is left."""
    with _PUBLISHING_LOCK:
        threads = list(_PUBLISHING)
    for thread in threads:
        thread.join(timeout_s)
    return not any(t.is_alive() for t in threads)


def _valid_name(value: str) -> bool:
    try:
        _check_name("fingerprint", value)
    except CacheError:
        return False
    return True


class Lease:
    """A lease lock in Redis: ``SET NX PX`` of a record holding a random token; renewed and
    released only by its holder (compare-and-set scripts), expiring by itself otherwise."""

    def __init__(self, remote: RemoteStore, name: str, ttl_s: float) -> None:
        self.remote, self.name = remote, name
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.record = LeaseRecord(token=uuid.uuid4().hex, holder=_holder(), acquired=0.0)
        self._value: str | None = None

    @property
    def held(self) -> bool:
        return self._value is not None

    def acquire(self) -> bool:
        """Take the lease if nobody holds it (raises RemoteError)."""
        record = self.record.model_copy(update={"acquired": time.time()})
        value = record.model_dump_json()
        if self.remote._call("lease", lambda c: c.set(self.name, value, nx=True, px=self.ttl_ms)):
            self._value, self.record = value, record
            return True
        return False

    def renew(self) -> bool:
        """Extend the lease by its TTL; False if it expired and someone else may hold it."""
        if self._value is None:
            return False
        return bool(self.remote._call("lease renewal", lambda c: c.eval(_RENEW, 1, self.name, self._value,
                                                                         self.ttl_ms)))

    def release(self) -> bool:
        """Drop the lease if it is still ours (never another holder's)."""
        if self._value is None:
            return False
        value, self._value = self._value, None
        return bool(self.remote._call("lease release", lambda c: c.eval(_RELEASE, 1, self.name, value)))

    def holder(self) -> LeaseRecord | None:
        """Who holds the lease now, or None."""
        raw = self.remote._call("lease", lambda c: c.get(self.name))
        try:
            return LeaseRecord.model_validate_json(raw) if raw else None
        except ValidationError:
            return None
