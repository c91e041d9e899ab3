"""The store's on-disk names and checks that need no pydantic: entry paths, the payload seal,
the permission check on roots, ``mkdir`` at 0755, and the store's errors.

Layout: ``<root>/<key>/<arch>/<spec id>/`` holds an entry's files and ``meta.json`` (see
:mod:`dsa_aot.cache.store`). The serving path (:mod:`dsa_aot.serving`) reads entries with these
alone; the store adds the models, publishing, quarantine and the index.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

META = "meta.json"
#: ``format`` of every ``meta.json``.
ENTRY_FORMAT = "dsa-aot.entry.v1"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
STAGING, QUARANTINE, LOCKS, INDEX, FEATURES = ".staging", ".quarantine", ".locks", ".index", ".features"


class CacheError(RuntimeError):
    """The store cannot do what was asked; the message says why and what to do."""


class CorruptArtifact(CacheError):
    """A file does not match the sha256 recorded for it."""


def _check_name(kind: str, value: str) -> str:
    if not _NAME.match(value) or value in (".", ".."):
        raise CacheError(f"invalid {kind} {value!r}: use letters, digits, '_', '-', '.'")
    return value


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def payload_sha256(payload: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of an entry's payload."""
    return sha256_bytes(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode())


def mkdirs(path: Path) -> None:
    """``mkdir -p`` that creates every missing level with mode 0755, so a umask such as 002
    never makes the tree group-writable (which the loader would then refuse to load from)."""
    missing = []
    while not path.is_dir() and path != path.parent:
        missing.append(path)
        path = path.parent
    for level in reversed(missing):
        try:
            level.mkdir(mode=0o755)
        except FileExistsError:
            pass


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
