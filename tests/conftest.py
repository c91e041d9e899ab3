"""Shared fixtures: GPU skipping, an isolated cache root per test, and a compiled mini-catalog."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
# Helper modules beside this file (cli_helpers) are imported by name from tests in any folder.
_HELPERS = str(Path(__file__).parent)
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)

try:
    import torch

    HAS_GPU = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_GPU = False


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch) -> Path:
    """A private writable cache root, with settings and the loader reset around the test."""
    from dsa_aot import settings

    root = tmp_path / "cache"
    monkeypatch.setenv("DSA_AOT_CACHE_DIR", str(root))
    monkeypatch.delenv("DSA_AOT_PREBUILT_DIR", raising=False)
    monkeypatch.delenv("DSA_AOT_REQUIRE_PREBUILT", raising=False)
    monkeypatch.delenv("DSA_AOT_JIT", raising=False)
    settings.reload()
    yield root
    monkeypatch.undo()
    settings.reload()
