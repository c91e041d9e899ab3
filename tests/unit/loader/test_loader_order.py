"""The loader's order over backends: every backend's stored artifact before any JIT build.

``try_load`` and ``build_and_load`` are replaced by recorders here, so the order of decisions in
``Loader.resolve`` is observed without a GPU (loading a real artifact needs the CUDA driver; the
GPU suites cover that path).
"""

from __future__ import annotations

import pytest

from dsa_aot import settings
from dsa_aot.loader import Loader, MissingPrebuiltError

SHAPE = ("fwd", "sm_90a", 576, 64, "noncompact", 0)


@pytest.fixture
def loader(monkeypatch: pytest.MonkeyPatch):
    stored: set[str] = set()
    calls: list[tuple[str, str]] = []
    ld = Loader()

    def try_load(spec, device_index):
        calls.append(("lookup", spec.backend))
        return (f"kernel:{spec.id}", "prebuilt:/image", "build key") if spec.backend in stored else None

    def build_and_load(spec, device_index):
        calls.append(("jit", spec.backend))
        return f"kernel:{spec.id}", "jit:/cache"

    monkeypatch.setattr(ld, "try_load", try_load)
    monkeypatch.setattr(ld, "build_and_load", build_and_load)
    monkeypatch.setattr(ld, "_jit_blocker", lambda spec: None)
    ld.stored, ld.calls = stored, calls
    with settings.scope(backends=("cutedsl", "tilelang"), require_prebuilt=False, jit=True):
        yield ld


def test_stored_second_backend_beats_jit_of_the_first(loader):
    loader.stored.add("tilelang")
    kernel, res = loader.resolve(*SHAPE)
    assert res.spec.backend == "tilelang" and res.source == "prebuilt:/image" and res.rule == "build key"
    assert loader.calls == [("lookup", "cutedsl"), ("lookup", "tilelang")]


def test_first_backend_stored_is_used_first(loader):
    loader.stored.update({"tilelang", "cutedsl"})
    _, res = loader.resolve(*SHAPE)
    assert res.spec.backend == "cutedsl" and loader.calls == [("lookup", "cutedsl")]


def test_nothing_stored_jit_builds_in_ranking_order(loader):
    _, res = loader.resolve(*SHAPE)
    assert res.source == "jit:/cache" and res.spec.backend == "cutedsl" and res.rule == ""
    assert loader.calls == [("lookup", "cutedsl"), ("lookup", "tilelang"), ("jit", "cutedsl")]


def test_require_prebuilt_names_every_backend_it_tried(loader):
    with settings.scope(backends=("cutedsl", "tilelang"), require_prebuilt=True):
        with pytest.raises(MissingPrebuiltError) as err:
            loader.resolve(*SHAPE)
    message = str(err.value)
    assert "fwd-sm_90a-d576-h64-noncompact-cutedsl or fwd-sm_90a-d576-h64-noncompact-tilelang" in message
    assert "dsa-aot prebuild --arch sm_90a --only 'fwd-sm_90a-d576-h64-noncompact-cutedsl'" in message
    assert ("jit", "cutedsl") not in loader.calls and ("jit", "tilelang") not in loader.calls
    loader.stored.add("tilelang")
    with settings.scope(backends=("cutedsl", "tilelang"), require_prebuilt=True):
        _, res = loader.resolve(*SHAPE)
    assert res.spec.backend == "tilelang"


def test_a_matching_preference_reorders_the_lookup(loader):
    loader._ranking = ({"fwd": ["tilelang", "cutedsl"]},
                       [{"ops": ["fwd"], "heads": [64], "backends": ["cutedsl", "tilelang"]}])
    loader.stored.update({"tilelang", "cutedsl"})
    with settings.scope(backends=None):
        _, res = loader.resolve(*SHAPE)  # H64: the preference
        assert res.spec.backend == "cutedsl" and loader.calls == [("lookup", "cutedsl")]
        loader.calls.clear()
        _, res = loader.resolve("fwd", "sm_90a", 576, 16, "noncompact", 0)  # H16: the ranking
        assert res.spec.backend == "tilelang" and loader.calls == [("lookup", "tilelang")]
        assert loader.ranking("fwd") == ["tilelang", "cutedsl"]  # every backend ranked for fwd
