"""The sources of a spec's key and runtime identity: the ``dsa_aot`` module graph, read without
importing anything (and without pydantic, so the serving path can compute a runtime identity).

:func:`module_sources` follows every static ``import`` of a ``dsa_aot`` module from a set of
roots (parent packages included, ``if TYPE_CHECKING:`` blocks excluded) and returns the sha256
of each file reached; :func:`runtime_identity_fields` is what :class:`~dsa_aot.specs.keys.
RuntimeIdentity` records, as plain data.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

#: Bump to invalidate every cached artifact when the meaning of a key field changes.
KEY_SCHEMA = 3
#: Top-level packages whose modules are followed (the rest is a compiler or the standard library).
ROOT_PACKAGE = "dsa_aot"


# --- module graph --------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _module_file(module: str) -> Path | None:
    """The source file of a ``dsa_aot`` module, found without executing it."""
    parent, _, leaf = module.rpartition(".")
    if not parent:
        spec = importlib.util.find_spec(module)
        return Path(spec.origin) if spec is not None and spec.origin else None
    package = _module_file(parent)
    if package is None or package.name != "__init__.py":
        return None
    # setuptools package-dir maps subpackages anywhere (dsa_aot.kernels -> kernels/): ask the
    # import system for packages, the folder for plain modules
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin and spec.origin.endswith(".py"):
        return Path(spec.origin)
    for candidate in (package.parent / f"{leaf}.py", package.parent / leaf / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports_of(tree: ast.Module, module: str, is_package: bool, *, top_level_only: bool) -> set[str]:
    """Every ``dsa_aot`` module a file imports: anywhere (function bodies included), or only in
    statements that run when the module is imported (``top_level_only``)."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if a.name != "*")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m == ROOT_PACKAGE or m.startswith(ROOT_PACKAGE + ".")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


#: Facts per source file in this process: file identity -> (sha256, imports, import-time imports).
_FACTS: dict[str, tuple[str, list[str], list[str]]] = {}
#: Source facts are remembered across processes in the toolchain memo under this kind.
MEMO_KIND = "source"


def _facts(module: str, path: Path, pending: dict[str, object]) -> tuple[str, list[str], list[str]]:
    """sha256 and ``dsa_aot`` imports (all, import-time only) of one module's file.

    Remembered per file identity (path, inode, size, mtime, ctime) in this process and in the
    toolchain memo, so a process that computes keys parses no source it parsed before; an
    edited file has a new identity and is read again.
    """
    from dsa_aot.specs.installed import file_identity, memo_get

    ident = file_identity(path)
    tag = f"{module}|{ident}"
    hit = _FACTS.get(tag)
    if hit is None and ident is not None:
        remembered = memo_get(MEMO_KIND, tag)
        if (isinstance(remembered, list) and len(remembered) == 3 and isinstance(remembered[0], str)
                and all(isinstance(x, list) for x in remembered[1:])):
            hit = (remembered[0], remembered[1], remembered[2])
    if hit is None:
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        shipped = _shipped_facts().get(_source_name(module, path))
        if shipped is not None and shipped[0] == digest:  # this very content: imports as the build read them
            hit = (digest, list(shipped[1]), list(shipped[2]))
        else:
            hit = parse_facts(data, module, path.name == "__init__.py", str(path))
        if ident is not None:
            pending[tag] = list(hit)
    _FACTS[tag] = hit
    return hit


def parse_facts(data: bytes, module: str, is_package: bool, filename: str) -> tuple[str, list[str], list[str]]:
    """sha256 and ``dsa_aot`` imports (all, import-time only) of a module's source ``data``."""
    tree = ast.parse(data, filename=filename)
    return (hashlib.sha256(data).hexdigest(),
            sorted(_imports_of(tree, module, is_package, top_level_only=False)),
            sorted(_imports_of(tree, module, is_package, top_level_only=True)))


#: Written beside the installed package by the wheel build (``setup.py``): ``{source name:
#: [sha256, imports, import-time imports]}`` of every module, used for a file of that sha256.
SHIPPED_FACTS = "_source_facts.json"


@functools.lru_cache(maxsize=1)
def _shipped_facts() -> dict[str, list]:
    package = sys.modules.get(ROOT_PACKAGE)
    origin = getattr(package, "__file__", None)
    try:
        data = json.loads((Path(origin).parent / SHIPPED_FACTS).read_bytes()) if origin else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, list) and len(v) == 3 and isinstance(v[0], str)
            and all(isinstance(x, list) and all(isinstance(m, str) for m in x) for x in v[1:])}


def _source_name(module: str, path: Path) -> str:
    return module.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")


def module_sources(roots: Iterable[str]) -> dict[str, str]:
    """``{source name: sha256}`` of every ``dsa_aot`` module a build from ``roots`` runs.

    The roots (a backend's build code and the spec's kernel modules: all of their functions
    may run in a build) are followed through every import, function bodies included. Every
    other module counts with what runs when it is imported: its import-time statements, its
    parent packages' ``__init__``. So a method that imports load code, or a validator that
    looks a name up, does not pull unrelated modules into a key. Names that are not modules
    (``from pkg import function``) are skipped.
    Raises ``FileNotFoundError`` when a root cannot be found.
    """
    roots = list(roots)
    tag = _graph_tag(roots)
    remembered = _remembered_graph(tag)
    if remembered is not None:
        return remembered
    for root in roots:
        if _module_file(root) is None:
            raise FileNotFoundError(f"module {root} has no source file")
    todo: list[tuple[str, bool]] = [(r, True) for r in roots]  # (module, followed fully)
    done: dict[str, bool] = {}
    seen: dict[str, str] = {}
    pending: dict[str, object] = {}
    while todo:
        module, full = todo.pop()
        if done.get(module) is True or (module in done and not full):
            continue
        done[module] = full
        path = _module_file(module)
        if path is None:
            continue
        digest, every, import_time = _facts(module, path, pending)
        seen[_source_name(module, path)] = digest
        parts = module.split(".")
        todo.extend((".".join(parts[:i]), False) for i in range(1, len(parts)))
        todo.extend((m, False) for m in (every if full else import_time))
    from dsa_aot.specs.installed import file_identity, memo_put_many

    if pending:
        memo_put_many(MEMO_KIND, pending, keep=512)
    paths = [os.path.realpath(_module_file(m)) for m in done if _module_file(m) is not None]
    watched = {p: file_identity(p) for p in {*paths, *(str(Path(p).parent) for p in paths)}}
    if tag is not None and None not in watched.values():
        memo_put_many(GRAPH_KIND, {tag: {"sources": seen, "watched": watched}}, keep=64)
    return dict(sorted(seen.items()))


#: Whole module graphs are remembered in the toolchain memo under this kind: the result of
#: :func:`module_sources` for its roots, with the identity of every file it read and of every
#: folder holding one (a file added to or removed from such a folder changes the folder's).
GRAPH_KIND = "graph"


def _graph_tag(roots: list[str]) -> str | None:
    """The memo key of a graph: its roots, the file each resolves to, and the installed
    ``dsa_aot`` package (another install, or a layout that maps a root elsewhere, is another key)."""
    package = sys.modules.get(ROOT_PACKAGE)
    origin = getattr(package, "__file__", None)
    files = [_module_file(r) for r in roots]
    if origin is None or None in files:
        return None
    return "|".join([os.path.realpath(origin), *roots, *map(os.path.realpath, files)])


def _remembered_graph(tag: str | None) -> dict[str, str] | None:
    """A remembered graph whose files and folders are all unchanged, else None."""
    if tag is None:
        return None
    from dsa_aot.specs.installed import memo_get

    hit = memo_get(GRAPH_KIND, tag)
    if not (isinstance(hit, dict) and isinstance(hit.get("sources"), dict) and isinstance(hit.get("watched"), dict)):
        return None
    for path, ident in hit["watched"].items():  # the stat part of file_identity (paths are real)
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not isinstance(ident, str) or ident != f"{path}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}":
            return None
    return dict(sorted(hit["sources"].items()))


def identity_key(identity: dict) -> str:
    """An identity's key: the first 16 hex chars of the sha256 of its canonical JSON (for a
    :class:`~dsa_aot.specs.keys.BuildIdentity`, its entry's key directory)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def sources_sha256(sources: dict[str, str]) -> str:
    """One hash over a ``{name: sha256}`` table (order-independent)."""
    text = "\n".join(f"{name}\0{digest}" for name, digest in sorted(sources.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def clear_caches() -> None:
    """Forget parsed sources (after files were edited in this process, e.g. by a test)."""
    _module_file.cache_clear()
    _shipped_facts.cache_clear()
    _FACTS.clear()


def host_tag() -> str:
    import os

    try:
        machine = os.uname().machine
    except AttributeError:  # Windows
        import platform
        machine = platform.machine()
    return f"{sys.platform}-{machine}"


def runtime_identity_fields(backend: str, arch: str, runtime_module: str, kernel_modules: Iterable[str]) -> dict:
    """The fields of a runtime identity (see :class:`~dsa_aot.specs.keys.RuntimeIdentity`)."""
    return {"schema_version": KEY_SCHEMA, "backend": backend, "arch": arch, "host": host_tag(),
            "runtime_sha256": sources_sha256(module_sources([runtime_module])),
            "kernel_sha256": sources_sha256(module_sources(kernel_modules))}
