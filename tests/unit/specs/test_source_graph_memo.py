"""The module graph of a key or runtime identity, remembered across processes in the toolchain
memo (:mod:`dsa_aot.specs.sources`): reused only while every file it read and every folder
holding one are unchanged, and equal to the graph computed from scratch."""

from __future__ import annotations

import os
import time

import pytest

from dsa_aot import settings
from dsa_aot.specs import installed, sources

ROOTS = ["dsa_aot.backends.cutedsl.runtime"]


@pytest.fixture
def memo_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DSA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    settings.reload()
    installed._memo_cache = None
    sources.clear_caches()
    yield tmp_path / "cache"
    monkeypatch.undo()
    settings.reload()
    installed._memo_cache = None
    sources.clear_caches()


def test_a_remembered_graph_equals_the_computed_one_and_is_reused(memo_dir, monkeypatch):
    computed = sources.module_sources(ROOTS)
    tag = sources._graph_tag(ROOTS)
    assert tag is not None and sources._remembered_graph(tag) == computed
    installed._memo_cache = None  # as a fresh process: read back from the file
    sources.clear_caches()
    read = []
    monkeypatch.setattr(sources, "_facts", lambda *a: read.append(a) or pytest.fail(f"read {a[0]}"))
    assert sources.module_sources(ROOTS) == computed and read == []


def test_an_edited_file_or_a_new_file_beside_one_invalidates_it(memo_dir, tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    module = package / "mod.py"
    module.write_text("X = 1\n")
    real = os.path.realpath(module)
    watched = {p: installed.file_identity(p) for p in (real, os.path.dirname(real))}
    installed.memo_put_many(sources.GRAPH_KIND, {"t": {"sources": {"pkg/mod.py": "a" * 64}, "watched": watched}})
    assert sources._remembered_graph("t") == {"pkg/mod.py": "a" * 64}

    time.sleep(0.01)
    (package / "new.py").write_text("")  # the folder changes: an import may now resolve elsewhere
    assert sources._remembered_graph("t") is None

    watched = {p: installed.file_identity(p) for p in (real, os.path.dirname(real))}
    installed.memo_put_many(sources.GRAPH_KIND, {"t": {"sources": {"pkg/mod.py": "a" * 64}, "watched": watched}})
    assert sources._remembered_graph("t") is not None
    module.write_text("X = 2\n")
    assert sources._remembered_graph("t") is None
    module.unlink()
    assert sources._remembered_graph("t") is None


def test_a_graph_is_remembered_per_install(memo_dir):
    tag = sources._graph_tag(ROOTS)
    assert os.path.realpath(sources.sys.modules["dsa_aot"].__file__) in tag
    assert sources._graph_tag(["dsa_aot.no_such_module"]) is None  # nothing to remember it under
