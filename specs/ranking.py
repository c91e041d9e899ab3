"""The catalog's ranking tables, read from its TOML without pydantic: the backend order the
loader (and the serving path) tries for a variant, and the top-k buckets of width-specialised
backends. :mod:`dsa_aot.specs.catalog` validates the whole file with its models.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import get_args

from dsa_aot.specs.shapes import Arch, Op

DEFAULT_RANKING: dict[str, list[str]] = {"fwd": ["tilelang"], "bwd": ["tilelang"]}
#: The variant fields a ``[[prefer]]`` table may narrow, with the call's value each is matched on.
PREFER_FIELDS = ("ops", "archs", "d_qk", "heads")


def default_catalog_path() -> Path:
    return Path(__file__).with_name("catalog.toml")


#: The last catalog parsed in this process, by (path, inode, size, mtime): the tables read it once.
_PARSED: dict[tuple, dict] = {}


def _read(path: Path | str | None) -> tuple[Path, dict]:
    import tomllib  # here: the remembered tables (ranking_tables) need no parser

    path = Path(path) if path is not None else default_catalog_path()
    try:
        st = path.stat()
        key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in _PARSED:
            data = tomllib.loads(path.read_text())
            _PARSED.clear()
            _PARSED[key] = data
        return path, _PARSED[key]
    except FileNotFoundError:
        raise FileNotFoundError(f"catalog {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"catalog {path} is not valid TOML: {exc}") from None


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


#: The packaged catalog's checked tables are remembered in the toolchain memo under this kind,
#: keyed by the catalog file's identity and the installed backends (which the checks read).
MEMO_KIND = "ranking"


def ranking_tables() -> tuple[dict[str, list[str]], list[dict[str, list]], dict[tuple[str, str, str], list[int]]]:
    """``(ranking, preferences, topk buckets)`` of the packaged catalog, as :func:`load_ranking`,
    :func:`load_preferences` and :func:`load_topk_buckets` return them; remembered across
    processes while the file is unchanged (a process then neither imports nor runs the TOML parser)."""
    from dsa_aot.backends import names
    from dsa_aot.specs.installed import file_identity, memo_get, memo_put_many

    path = default_catalog_path()
    ident = file_identity(path)
    tag = f"{ident}|{','.join(names())}" if ident is not None else None
    hit = memo_get(MEMO_KIND, tag)
    if isinstance(hit, list) and len(hit) == 3 and isinstance(hit[0], dict) and isinstance(hit[1], list):
        buckets = {tuple(k.split("|")): v for k, v in hit[2].items()}
        return hit[0], hit[1], buckets
    ranking, preferences, buckets = load_ranking(path), load_preferences(path), load_topk_buckets(path)
    if tag is not None:
        memo_put_many(MEMO_KIND, {tag: [ranking, preferences, {"|".join(k): v for k, v in buckets.items()}]}, keep=8)
    return ranking, preferences, buckets
