"""The spec catalog: a TOML file that expands to the list of variants to prebuild."""

from __future__ import annotations

import fnmatch
import itertools
import tomllib
from pathlib import Path
from typing import get_args

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from dsa_aot.specs.models import Arch, Backend, KernelSpec, Layout, Op, TileConfig


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


DEFAULT_RANKING: dict[str, list[str]] = {"fwd": ["tilelang"], "bwd": ["tilelang"]}
#: The variant fields a ``[[prefer]]`` table may narrow, with the call's value each is matched on.
PREFER_FIELDS = ("ops", "archs", "d_qk", "heads")


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


def default_catalog_path() -> Path:
    return Path(__file__).with_name("catalog.toml")


def _read(path: Path | str | None) -> tuple[Path, dict]:
    path = Path(path) if path is not None else default_catalog_path()
    try:
        return path, tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"catalog {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"catalog {path} is not valid TOML: {exc}") from None


def load_catalog(path: Path | str | None = None) -> Catalog:
    """Parse and validate a catalog file (the packaged default when ``path`` is None)."""
    return Catalog.model_validate(_read(path)[1])


def load_ranking(path: Path | str | None = None) -> dict[str, list[str]]:
    """The ``[ranking]`` table alone, checked as :class:`Catalog` would check it.

    The runtime loader's path: it skips building the matrix models (a few ms per process).
    """
    path, data = _read(path)
    ranking = data.get("ranking", DEFAULT_RANKING)
    from dsa_aot.backends import names

    ops, backends = set(get_args(Op)), set(names())
    if not isinstance(ranking, dict):
        raise ValueError(f"catalog {path}: [ranking] must be a table of op = [backends]")
    for op, names in ranking.items():
        if op not in ops or not isinstance(names, list) or not set(names) <= backends:
            raise ValueError(f"catalog {path}: ranking {op} = {names!r}; ops are {sorted(ops)}, "
                             f"backends {sorted(backends)}")
    return {op: list(names) for op, names in ranking.items()}


def load_preferences(path: Path | str | None = None) -> list[dict[str, list]]:
    """The ``[[prefer]]`` tables alone, checked as :class:`PreferRule` would check them (the
    runtime loader's path, like :func:`load_ranking`)."""
    path, data = _read(path)
    rules = data.get("prefer", [])
    from dsa_aot.backends import names

    allowed = {"ops": set(get_args(Op)), "archs": set(get_args(Arch)), "backends": set(names())}
    if not isinstance(rules, list):
        raise ValueError(f"catalog {path}: prefer must be an array of tables ([[prefer]])")
    for n, rule in enumerate(rules):
        where = f"catalog {path}: [[prefer]] #{n + 1}"
        if not isinstance(rule, dict) or "backends" not in rule:
            raise ValueError(f"{where} needs backends = [...]")
        for field, values in rule.items():
            if field not in (*PREFER_FIELDS, "backends"):
                raise ValueError(f"{where}: unknown field {field!r}; use {PREFER_FIELDS + ('backends',)}")
            ok = isinstance(values, list) and bool(values) and all(
                (v in allowed[field]) if field in allowed else (isinstance(v, int) and not isinstance(v, bool))
                for v in values)
            if not ok:
                raise ValueError(f"{where}: {field} = {values!r} is not a non-empty list of "
                                 + (f"{sorted(allowed[field])}" if field in allowed else "ints"))
    return [{k: list(v) for k, v in rule.items()} for rule in rules]


def ranked(ranking: dict[str, list[str]], preferences: list[dict[str, list]], op: str, arch: str,
           d_qk: int, heads: int) -> list[str]:
    """The backend order for one variant: the first ``[[prefer]]`` table matching it, else the
    op's ``[ranking]``."""
    call = dict(zip(PREFER_FIELDS, (op, arch, d_qk, heads)))
    for rule in preferences:
        if all(field not in rule or call[field] in rule[field] for field in PREFER_FIELDS):
            return list(rule["backends"])
    return list(ranking.get(op, DEFAULT_RANKING.get(op, ["tilelang"])))


def load_topk_buckets(path: Path | str | None = None) -> dict[tuple[str, str, str], list[int]]:
    """``{(backend, op, arch): sorted top-k buckets}`` of the catalog's ``topk`` lists.

    The runtime loader's path, read from the raw TOML like :func:`load_ranking`: a backend whose
    kernels are specialised on the width is looked up by the narrowest bucket that fits a call.
    """
    _, data = _read(path)
    found: dict[tuple[str, str, str], set[int]] = {}
    for block in data.get("matrix", []):
        widths = block.get("topk") if isinstance(block, dict) else None
        if not widths:
            continue
        for backend, op, arch in itertools.product(block.get("backends", ["tilelang"]), block.get("ops", []),
                                                   block.get("archs", [])):
            found.setdefault((backend, op, arch), set()).update(int(w) for w in widths)
    return {k: sorted(v) for k, v in found.items()}


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
