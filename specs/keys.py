"""Per-spec cache keys, derived from what a spec's build reads, and the runtime identity.

Two identities describe an artifact (both are recorded in its manifest):

* :class:`BuildIdentity`: everything a build of one spec reads besides the spec itself: its
  backend's compiler distributions by content, the nvcc that keys the CUDA toolkit, the host,
  and the sha256 of exactly the source files the build imports. Those files come from the
  module graph (:func:`module_sources`): the backend's build modules and the spec's kernel
  modules, followed through every static ``import`` of a ``dsa_aot`` module (parent packages
  included, ``if TYPE_CHECKING:`` blocks excluded), without importing anything. Its hash is the
  entry's key, so editing a kernel file misses exactly the specs built from it.
* :class:`RuntimeIdentity`: what a process must share with the artifact to load it when no
  compiler is installed (a serving image): our runtime code for the backend (the module graph of
  its load code), the spec's kernel sources, arch, host, and the CUDA driver floor.

The spec itself is not in the key: its id (which covers every field) names the entry's folder.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from dsa_aot.specs.toolchain import Distribution

#: Bump to invalidate every cached artifact when the meaning of a key field changes.
KEY_SCHEMA = 2
#: Top-level packages whose modules are followed (the rest is a compiler or the standard library).
ROOT_PACKAGE = "dsa_aot"


def _canonical(model: BaseModel) -> str:
    return json.dumps(model.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


class BuildIdentity(BaseModel):
    """What one spec's build reads besides the spec; :meth:`key` names its cache directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: int = KEY_SCHEMA
    backend: str
    compilers: tuple[Distribution, ...] = Field(description="the backend's compiler distributions, "
                                                "by content (RECORD digest), sorted by name")
    nvcc_version: str | None = Field(description="the CUDA toolkit's nvcc, when the backend uses it")
    host: str = Field(description="OS and CPU of host code in artifacts, e.g. 'linux-x86_64'")
    sources: dict[str, str] = Field(description="module file (e.g. 'dsa_aot/kernels/tilelang_fwd.py') "
                                    "-> sha256, for every dsa_aot module the build imports")

    def key(self) -> str:
        """First 16 hex chars of the sha256 of the canonical JSON."""
        return hashlib.sha256(_canonical(self).encode()).hexdigest()[:16]


class RuntimeIdentity(BaseModel):
    """What a compiler-free process must match to load an artifact."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: int = KEY_SCHEMA
    backend: str
    arch: str
    host: str
    runtime_sha256: str = Field(description="hash of the backend's load code (its module graph)")
    kernel_sha256: str = Field(description="hash of the spec's kernel sources (its module graph)")

    def mismatch(self, other: RuntimeIdentity) -> str | None:
        """The first field that differs from ``other`` (None when they match)."""
        mine, theirs = self.model_dump(), other.model_dump()
        for name in mine:
            if mine[name] != theirs[name]:
                return name
        return None


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
    from dsa_aot.specs.toolchain import file_identity, memo_get

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
        tree = ast.parse(data, filename=str(path))
        package = path.name == "__init__.py"
        hit = (hashlib.sha256(data).hexdigest(),
               sorted(_imports_of(tree, module, package, top_level_only=False)),
               sorted(_imports_of(tree, module, package, top_level_only=True)))
        if ident is not None:
            pending[tag] = list(hit)
    _FACTS[tag] = hit
    return hit


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
    if pending:
        from dsa_aot.specs.toolchain import memo_put_many

        memo_put_many(MEMO_KIND, pending, keep=512)
    return dict(sorted(seen.items()))


def sources_sha256(sources: dict[str, str]) -> str:
    """One hash over a ``{name: sha256}`` table (order-independent)."""
    text = "\n".join(f"{name}\0{digest}" for name, digest in sorted(sources.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def clear_caches() -> None:
    """Forget parsed sources (after files were edited in this process, e.g. by a test)."""
    _module_file.cache_clear()
    _FACTS.clear()


def host_tag() -> str:
    import os

    try:
        machine = os.uname().machine
    except AttributeError:  # Windows
        import platform
        machine = platform.machine()
    return f"{sys.platform}-{machine}"
