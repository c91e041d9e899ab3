"""File names and digests shared by the CuTe DSL build and load sides (no pydantic, no compiler)."""

from __future__ import annotations

import hashlib
from pathlib import Path

#: The record written beside an exported library (:class:`~.records.CuteExportRecord`, JSON).
RECORD_FILE = "record.json"
#: The DSL runtime library the ``dsl_runtime`` link mode needs at run time.
DSL_RUNTIME_LIB = "libcute_dsl_runtime.so"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
