"""One compiled kernel of an entry: its file and the backend's launch record (a pydantic model,
written by the build side; kept apart so a backend's build code reads nothing else of the manifest)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StageArtifact(BaseModel):
    """One compiled kernel: its file and the backend's record of how to run it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    format: str = Field(description="the backend's file format, e.g. 'cubin' or 'cutedsl_so'")
    file: str
    record: dict[str, Any] = Field(description="the backend's launch record (JSON)")
