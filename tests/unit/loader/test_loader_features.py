"""The loader's feature probes in a long-running process: settled results are kept for the
process, results with probes that could not answer only for ``UNSETTLED_RETRY_S``."""

from __future__ import annotations

import pytest

import dsa_aot.loader as loader_mod
import dsa_aot.specs.probes as probes
from dsa_aot import settings
from dsa_aot.specs.probes import Features


def _features(nvcc_sm90a: bool | None) -> Features:
    unsettled = ("nvcc_archs[sm_90a]",) if nvcc_sm90a is None else ()
    return Features(archs=("sm_100a", "sm_90a"), tilelang_importable=True, cutlass_dsl_importable=True,
                    cute_math_isfinite=True, tilelang_bool_fragment_ok={"sm_90a": True, "sm_100a": True},
                    nvcc_version="13.0", nvcc_archs={"sm_90a": nvcc_sm90a, "sm_100a": True},
                    errors={n: "nvcc fatal : No space left on device" for n in unsettled},
                    unsettled=unsettled)


@pytest.fixture
def probed(monkeypatch, tmp_path):
    """A loader over an empty cache whose probes answer ``answers`` in turn (the last one from
    then on); returns the loader, the answers list and the calls made."""
    answers: list[Features] = []
    calls: list[list[str]] = []

    def load_or_probe(path, archs, **_):
        calls.append(list(archs))
        return answers[min(len(calls), len(answers)) - 1]

    monkeypatch.setattr(probes, "load_or_probe", load_or_probe)
    with settings.scope(cache_dir=tmp_path / "cache", prebuilt_dirs=(), remote_url=None):
        yield loader_mod.Loader(), answers, calls


def test_settled_features_are_probed_once_per_process(probed, monkeypatch):
    loader, answers, calls = probed
    answers.append(_features(True))
    monkeypatch.setattr(loader_mod, "UNSETTLED_RETRY_S", 0.0)
    assert loader.features().nvcc_archs["sm_90a"] is True
    assert loader.features() is loader.features() and len(calls) == 1


def test_unsettled_features_are_probed_again_after_the_retry_window(probed, monkeypatch):
    loader, answers, calls = probed
    answers += [_features(None), _features(True)]
    first = loader.features()
    assert first.unsettled == ("nvcc_archs[sm_90a]",)
    assert loader.features() is first and len(calls) == 1  # within the window: no probe storm
    monkeypatch.setattr(loader_mod, "UNSETTLED_RETRY_S", 0.0)  # the window has passed
    second = loader.features()
    assert second.unsettled == () and second.nvcc_archs["sm_90a"] is True and len(calls) == 2
    assert loader.features() is second and len(calls) == 2  # settled now: kept
