"""The torch reference as the last step of every fallback chain: always there, slow, nothing to build."""

from __future__ import annotations

from typing import Any


class ReferenceBackend:
    name = "reference"

    @staticmethod
    def kernel(op: str) -> Any:
        """A kernel object running the plain-torch contract for ``op`` (``fwd`` or ``bwd``)."""
        from dsa_aot.runners import ReferenceBwd, ReferenceFwd

        return ReferenceFwd() if op == "fwd" else ReferenceBwd()
