"""The fleet tier from this package's side: the remote store, signing and trust from the
settings; one compile per entry across the fleet; bulk push and pull of catalog entries.

Single compile (:func:`single_compile`): a node that misses everywhere takes the entry's lease
in Redis and compiles while a thread renews it; the others poll for the manifest and pull it
when it appears, or take the lease over when it expires (its holder died). A remote that fails
is a logged fallback to compiling locally, never an error.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dsa_aot import settings as _settings
from dsa_aot.cache.remote import RemoteError, RemoteStore
from dsa_aot.cache.store import ArtifactStore, CacheError, Entry, EntryMeta

log = logging.getLogger("dsa_aot")


# -- from the settings -------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _remote(url: str, writable: bool, connect_s: float, timeout_s: float, ttl_s: float) -> RemoteStore:
    return RemoteStore(url, writable=writable, connect_timeout_s=connect_s, timeout_s=timeout_s, ttl_s=ttl_s)


def remote_store(write: bool | None = None) -> RemoteStore | None:
    """The configured remote (``DSA_AOT_REMOTE_URL``), or None. ``write`` overrides
    ``DSA_AOT_REMOTE_WRITE`` (the explicit ``push`` commands write)."""
    cfg = _settings.get()
    if cfg.remote_url is None:
        return None
    return _remote(cfg.remote_url, cfg.remote_write if write is None else write, cfg.remote_connect_timeout_s,
                   cfg.remote_timeout_s, cfg.remote_ttl_s)


@functools.lru_cache(maxsize=4)
def _signer(path: Path, mtime_ns: int):
    from dsa_aot.cache.signing import Signer

    return Signer.from_file(path)


def signer():
    """The :class:`~dsa_aot.cache.signing.Signer` of ``DSA_AOT_SIGNING_KEY``, or None.
    Raises SigningError for a key file that cannot be used (nothing is published unsigned then)."""
    path = _settings.get().signing_key
    if path is None:
        return None
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        mtime = 0
    return _signer(path, mtime)


@functools.lru_cache(maxsize=4)
def _trusted(paths: tuple[Path, ...]) -> Callable[[EntryMeta], str | None]:
    from dsa_aot.cache.signing import SigningError, TrustedKeys

    try:
        keys = TrustedKeys.from_paths(paths)
    except SigningError as exc:  # fail closed: a broken trust setting loads nothing
        message = f"DSA_AOT_TRUSTED_KEYS is unusable ({exc}), so no entry is trusted"
        return lambda meta: message
    return keys.reason


def trust_check() -> Callable[[EntryMeta], str | None] | None:
    """``reason(meta) -> str | None`` under ``DSA_AOT_TRUSTED_KEYS``; None when no key is set."""
    paths = _settings.get().trusted_keys
    return _trusted(paths) if paths else None


# -- one compile per entry across the fleet ------------------------------------------------------
@contextlib.contextmanager
def single_compile(remote: RemoteStore, store: ArtifactStore, key: str, arch: str, spec_id: str, *,
                   accept: Callable[[EntryMeta], str | None] | None = None, lease_s: float | None = None,
                   wait_s: float | None = None, poll_s: float = 0.1) -> Iterator[Entry | None]:
    """Yields the entry pulled into ``store`` when another node built it, or None while this
    node may compile (holding the lease, renewed by a thread, released on exit; or without a
    lease when the remote failed). Raises TimeoutError after ``wait_s`` (default
    ``DSA_AOT_LOCK_TIMEOUT``) of waiting for a live holder."""
    cfg = _settings.get()
    lease = remote.lease(key, arch, spec_id, lease_s or cfg.remote_lease_s)
    deadline = time.monotonic() + (cfg.lock_timeout_s if wait_s is None else wait_s)
    delay, pulled = poll_s, None
    try:
        while True:
            pulled = _pull_published(remote, store, key, arch, spec_id, accept)
            if pulled is not None or not remote.available:
                break
            if lease.acquire():
                pulled = _pull_published(remote, store, key, arch, spec_id, accept)  # pushed just before
                break
            if time.monotonic() > deadline:
                holder = lease.holder()
                raise TimeoutError(f"{spec_id}: {holder.holder if holder else 'another node'} has held the "
                                   f"fleet compile lease past DSA_AOT_LOCK_TIMEOUT ({cfg.lock_timeout_s:.0f} s)")
            time.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 1.5, 1.0)
    except RemoteError as exc:
        log.warning("dsa-aot: %s: fleet lease unavailable (%s); compiling locally", spec_id, exc)
    if pulled is not None:
        if lease.held:
            _release(lease, spec_id)
        yield pulled
        return
    stop = threading.Event()
    renewer = None
    if lease.held:
        renewer = threading.Thread(target=_renew, args=(lease, stop, spec_id), daemon=True,
                                   name=f"dsa-aot-lease-{spec_id}")
        renewer.start()
    try:
        yield None
    finally:
        stop.set()
        if renewer is not None:
            renewer.join()
        if lease.held:
            _release(lease, spec_id)


def _release(lease, spec_id: str) -> None:
    try:
        lease.release()
    except RemoteError as exc:  # it expires by itself
        log.warning("dsa-aot: %s: could not release the fleet lease: %s", spec_id, exc)


def _renew(lease, stop: threading.Event, spec_id: str) -> None:
    while not stop.wait(lease.ttl_ms / 3000):
        try:
            if not lease.renew():
                log.warning("dsa-aot: %s: the fleet compile lease expired while compiling; another node "
                            "may compile it too", spec_id)
                return
        except RemoteError as exc:
            log.warning("dsa-aot: %s: could not renew the fleet lease: %s", spec_id, exc)


def _pull_published(remote: RemoteStore, store: ArtifactStore, key: str, arch: str, spec_id: str,
                    accept) -> Entry | None:
    entry = remote.lookup(key, arch, spec_id)
    if entry is None:
        return None
    try:
        into, local = remote.pull(entry, store, accept)
    except CacheError as exc:  # corrupt, untrusted, blob gone: build it again (and push over it)
        log.warning("dsa-aot: not using %s from %s: %s", entry.key, remote.root, exc)
        return None
    return local if into is store else None


# -- bulk transfer ------------------------------------------------------------------------------
@dataclass
class Transfer:
    """One spec of a push or pull: ``status`` pushed / pulled / present / missing / failed."""

    spec_id: str
    status: str
    seconds: float = 0.0
    message: str = ""
    bytes: int = 0


@dataclass
class TransferSummary:
    action: str
    remote: str
    rows: list[Transfer] = field(default_factory=list)
    wall_s: float = 0.0

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.rows)

    @property
    def ok(self) -> bool:
        return self.count("failed") == 0

    def as_dict(self) -> dict[str, object]:
        return {"action": self.action, "remote": self.remote, "wall_seconds": round(self.wall_s, 3),
                "ok": self.ok, "bytes": sum(r.bytes for r in self.rows),
                "counts": {s: self.count(s) for s in (self.action + "ed", "present", "missing", "failed")},
                "specs": [vars(r) for r in self.rows]}

    def format(self) -> str:
        lines = [f"{self.action} {self.remote}"]
        bad = [r for r in self.rows if r.status == "failed"]
        for r in bad:
            lines.append(f"  {r.spec_id}  failed  {r.message}")
        total = sum(r.bytes for r in self.rows)
        for status in (self.action + "ed", "present", "missing", "failed"):
            lines.append(f"  {status:<10}{self.count(status):>5}")
        lines.append(f"  {'total':<10}{len(self.rows):>5}   {total / 2**20:.1f} MiB in {self.wall_s:.2f} s wall")
        return "\n".join(lines)


def _bar(total: int, label: str, enabled: bool):
    if not enabled or total == 0:
        return lambda row: None
    try:
        from tqdm import tqdm
    except ImportError:
        def plain(row):
            if row is not None:
                print(f"{label}: {row.spec_id} {row.status}", file=sys.stderr, flush=True)
        return plain
    bar = tqdm(total=total, unit="spec", desc=label, file=sys.stderr, dynamic_ncols=True)

    def update(row):
        if row is None:
            bar.close()
        else:
            bar.set_postfix_str(f"{row.spec_id} {row.status}", refresh=False)
            bar.update(1)
    return update


def _transfer(kind: str, specs, remote: RemoteStore, progress: bool, one) -> TransferSummary:
    """``one(spec) -> Transfer`` for each spec, timed, with a progress bar and a summary."""
    summary = TransferSummary(kind, remote.root)
    start = time.perf_counter()
    bar = _bar(len(specs), kind, progress)
    for spec in specs:
        t0 = time.perf_counter()
        row = one(spec)
        row.seconds = time.perf_counter() - t0
        summary.rows.append(row)
        bar(row)
    bar(None)
    summary.wall_s = time.perf_counter() - start
    return summary


def push_specs(specs, loader, stores: list[ArtifactStore], remote: RemoteStore, *,
               progress: bool = False) -> TransferSummary:
    """Push the entry the loader would serve for each spec (from ``stores``) to ``remote``."""
    def push(spec) -> Transfer:
        match = next((m for m in (loader.find(s, spec) for s in stores) if m is not None), None)
        if match is None:
            return Transfer(spec.id, "missing", message="not in the local cache")
        try:
            report = remote.push_entry(match.store, match.entry)
        except CacheError as exc:
            return Transfer(spec.id, "failed", message=str(exc))
        return Transfer(spec.id, "pushed" if report.manifest or report.blobs_sent else "present",
                        bytes=report.bytes_sent)

    return _transfer("push", specs, remote, progress, push)


def pull_specs(specs, loader, stores: list[ArtifactStore], into: ArtifactStore, remote: RemoteStore, *,
               progress: bool = False) -> TransferSummary:
    """Pull each spec the local ``stores`` lack from ``remote`` into ``into`` (verified, and
    refused unless trusted when ``DSA_AOT_TRUSTED_KEYS`` is set)."""
    accept = trust_check()

    def pull(spec) -> Transfer:
        if any(loader.find(s, spec) is not None for s in stores):
            return Transfer(spec.id, "present")
        match = loader.find(remote, spec)
        if match is None:
            return Transfer(spec.id, "failed" if not remote.available else "missing",
                            message="" if remote.available else f"{remote.root} unreachable")
        try:
            got, _ = remote.pull(match.entry, into, accept)
        except CacheError as exc:
            return Transfer(spec.id, "failed", message=str(exc))
        if got is into:
            return Transfer(spec.id, "pulled", bytes=match.entry.size)
        return Transfer(spec.id, "failed", message=f"could not store it in {into.root} (see the log)")

    return _transfer("pull", specs, remote, progress, pull)
