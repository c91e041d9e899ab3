"""The public errors of a kernel lookup, importable without the loader (and so without pydantic)."""

from __future__ import annotations


class MissingPrebuiltError(RuntimeError):
    """``DSA_AOT_REQUIRE_PREBUILT=1`` and no prebuilt artifact matches the call."""


class UnsupportedDeviceError(RuntimeError):
    """The GPU's architecture has no kernels (only sm_90a and sm_100a are built)."""


class DeterminismUnavailableError(RuntimeError):
    """``deterministic=True`` and no deterministic kernel can be served for the call (the torch
    reference is no substitute on a GPU: its scatter-add order varies too)."""
