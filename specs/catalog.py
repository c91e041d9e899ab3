"""The spec catalog: a TOML file that expands to the list of variants to prebuild."""

from __future__ import annotations

import fnmatch
import itertools
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from dsa_aot.specs.models import Arch, Backend, KernelSpec, Layout, Op, TileConfig
from dsa_aot.specs.ranking import (  # noqa: F401  (re-exported)
    DEFAULT_RANKING, PREFER_FIELDS, _read, default_catalog_path, load_preferences, load_ranking, load_topk_buckets, ranked)


class MatrixBlock(BaseModel):
    """One ``[[matrix]]`` table: the cross product of its lists."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    ops: list[Op]
    archs: list[Arch]
    d_qk: list[int]
    heads: list[int]
    layouts: list[Layout]
    backends: list[Backend] = ["tilelang"]
    tile: TileConfig = TileConfig()
    topk: list[int] | None = Field(None, description="top-k buckets, for backends whose kernels are "
                                   "specialised on the width (None: the width is a run-time value)")
    deterministic: bool = Field(False, description="the deterministic backward variants (-det ids)")




class PreferRule(BaseModel):
    """One ``[[prefer]]`` table: the backend order for the variants it matches, instead of the
    op's ``[ranking]`` (a field left out matches any value; the first matching table wins)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    ops: list[Op] | None = Field(None, min_length=1)
    archs: list[Arch] | None = Field(None, min_length=1)
    d_qk: list[StrictInt] | None = Field(None, min_length=1)
    heads: list[StrictInt] | None = Field(None, min_length=1)
    backends: list[Backend] = Field(min_length=1)


class Catalog(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    matrix: list[MatrixBlock] = Field(min_length=1)
    ranking: dict[Op, list[Backend]] = DEFAULT_RANKING
    prefer: list[PreferRule] = []

    def specs(self, implemented: set[tuple[str, str]] | None = None) -> list[KernelSpec]:
        """Every spec, deduplicated, in catalog order.

        A backend contributes the ops it implements (``implemented`` = {(backend, op)} narrows
        that further). Raises ``ValueError`` naming the spec and the field when a block asks a
        backend for a field it cannot honour (e.g. a tile knob it ignores).
        """
        from dsa_aot.backends import get

        seen: dict[str, KernelSpec] = {}
        for block in self.matrix:
            for op, arch, d, h, layout, name, topk in itertools.product(
                    block.ops, block.archs, block.d_qk, block.heads, block.layouts, block.backends,
                    block.topk or [None]):
                backend = get(name)
                if not backend.implements(op) or (implemented is not None and (name, op) not in implemented):
                    continue
                spec = KernelSpec(op=op, arch=arch, d_qk=d, heads=h, layout=layout,
                                  backend=name, tile=block.tile, topk=topk,
                                  deterministic=block.deterministic)
                backend.check_spec(spec)
                seen.setdefault(spec.id, spec)
        return list(seen.values())


def load_catalog(path: Path | str | None = None) -> Catalog:
    """Parse and validate a catalog file (the packaged default when ``path`` is None)."""
    return Catalog.model_validate(_read(path)[1])


def select(specs: list[KernelSpec], *, archs: list[str] | None = None, only: list[str] | None = None,
           shard: tuple[int, int] | None = None) -> list[KernelSpec]:
    """Filter by arch and by ``--only`` globs on the id, then keep shard ``i`` of ``n`` (1-based)."""
    out = [s for s in specs if archs is None or s.arch in archs]
    if only:
        out = [s for s in out if any(fnmatch.fnmatchcase(s.id, pat) for pat in only)]
    if shard is not None:
        i, n = shard
        out = [s for k, s in enumerate(out) if k % n == i - 1]
    return out
