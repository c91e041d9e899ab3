"""Records of the TileLang backend: how to launch one cubin's ``__global__`` function (JSON)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator

from dsa_aot.backends.tilelang.launch import ParamKind, _check_expr


class ParamRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    kind: ParamKind


class LaunchRecord(BaseModel):
    """How to launch one ``__global__`` function of a cubin (JSON, stored beside it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    entry: str
    params: tuple[ParamRecord, ...]
    grid: tuple[str, str, str]
    block: tuple[int, int, int]
    dynamic_smem: int = 0

    @field_validator("grid")
    @classmethod
    def _grid_is_arithmetic(cls, grid: tuple[str, str, str]) -> tuple[str, str, str]:
        for expr in grid:
            _check_expr(expr)
        return grid
