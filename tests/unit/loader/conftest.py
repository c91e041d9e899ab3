"""Fixtures of the lookup tests: the TileLang backend and the toolchain that builds their entries."""

from __future__ import annotations

import pytest

from dsa_aot.backends import get
from dsa_aot.specs.toolchain import Toolchain
from stored_entries import builder_toolchain


@pytest.fixture
def backend():
    return get("tilelang")


@pytest.fixture
def builder(backend) -> Toolchain:
    """The toolchain that built the entries: this one, with TileLang and an nvcc."""
    return builder_toolchain(backend)
