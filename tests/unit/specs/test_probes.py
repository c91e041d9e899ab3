"""The real feature probes on this machine (CPU only: TileLang and nvcc compile, nothing runs).

The probes are run once for the module through ``load_or_probe`` with a counting hook, and
that one result is checked against what is known about the installed toolchain.
"""

from __future__ import annotations

import importlib.metadata as md
import json

import pytest

from dsa_aot.specs.probes import Features, _nvcc_arch_probe, load_or_probe, run_probes
from dsa_aot.specs.toolchain import Toolchain, resolve_nvcc

ARCHS = ["sm_90a", "sm_100a"]
#: TileLang releases measured to break on a vectorized bool fragment for sm_100a.
BOOLX8_BROKEN = ("0.1.11", "0.1.15")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:3] if p.isdigit())


class CountingProbe:
    """Calls the real ``run_probes`` and counts the calls."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, archs, timeout_s):
        self.calls.append(list(archs))
        return run_probes(archs, timeout_s)


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    path = tmp_path_factory.mktemp("features") / "features.json"
    counter = CountingProbe()
    features = load_or_probe(path, ARCHS, probe=counter)
    return path, counter, features


@pytest.fixture(scope="module")
def features(probed) -> Features:
    return probed[2]


def test_probe_results_are_recorded_for_this_toolchain(features):
    assert features.archs == tuple(sorted(ARCHS))
    assert features.toolchain == Toolchain.current().fingerprint


@pytest.mark.skipif(_version("nvidia-cutlass-dsl") is None, reason="nvidia-cutlass-dsl not installed")
def test_cute_math_isfinite_matches_release(features):
    assert features.cutlass_dsl_importable, features.errors
    # cute.math.isfinite first shipped in 4.6.0 (absent in 4.5.3, present in 4.8.1).
    expected = _release(_version("nvidia-cutlass-dsl")) >= (4, 6, 0)
    assert features.cute_math_isfinite is expected, features.errors


def test_tilelang_bool_fragment_regression(features):
    version = _version("tilelang")
    if version not in BOOLX8_BROKEN:
        pytest.skip(f"tilelang {version}: boolx8 behaviour not measured; update BOOLX8_BROKEN")
    assert features.tilelang_importable, features.errors
    assert features.tilelang_bool_fragment_ok == {"sm_90a": True, "sm_100a": False}, features.errors
    assert "boolx8" in features.errors["tilelang_bool_fragment_ok[sm_100a]"]


@pytest.mark.skipif(resolve_nvcc() is None, reason="no nvcc on this machine")
def test_nvcc_accepts_both_archs(features):
    assert features.nvcc_archs == {"sm_90a": True, "sm_100a": True}, features.errors
    assert features.nvcc_version is not None
    # The toolchain reads the version without spawning nvcc where it can; they must agree.
    assert features.nvcc_version == Toolchain.current().nvcc_version


def test_load_or_probe_rereads_without_probing(probed):
    path, counter, features = probed
    assert counter.calls == [sorted(ARCHS)]
    assert Features.model_validate_json(path.read_text()) == features
    assert not list(path.parent.glob(".*tmp*")), "temporary file left behind"
    assert load_or_probe(path, ARCHS, probe=counter) == features
    assert load_or_probe(path, ["sm_90a"], probe=counter) == features  # a subset is covered
    assert len(counter.calls) == 1


class ProbeAsked(Exception):
    pass


def test_load_or_probe_probes_again_for_corrupt_file(tmp_path):
    path = tmp_path / "features.json"
    torn = json.dumps({"schema_version": 1, "archs": ["sm_90a"]})[:20]
    path.write_text(torn)
    asked = []

    def probe(archs, timeout_s):  # only records that a probe was asked for; re-probing is
        asked.append(list(archs))  # exercised for real in the next test
        raise ProbeAsked

    with pytest.raises(ProbeAsked):
        load_or_probe(path, ["sm_90a"], probe=probe)
    assert asked == [["sm_90a"]]
    assert path.read_text() == torn  # nothing is written when probing fails


def test_load_or_probe_ignores_file_of_other_toolchain(probed, tmp_path):
    path, _, features = probed
    other = Toolchain.current().model_copy(update={"nvcc_version": "0.0.0"})
    copy = tmp_path / "features.json"
    copy.write_bytes(path.read_bytes())
    counter = CountingProbe()
    again = load_or_probe(copy, ["sm_90a"], toolchain=other, probe=counter)
    assert counter.calls == [["sm_90a"]]  # stale file: probed for the requested archs only
    assert again.toolchain == other.fingerprint != features.toolchain
    assert again.tilelang_bool_fragment_ok == {"sm_90a": features.tilelang_bool_fragment_ok["sm_90a"]}
    assert Features.model_validate_json(copy.read_text()) == again  # replaced atomically
    assert load_or_probe(copy, ["sm_90a"], toolchain=other, probe=counter) == again
    assert len(counter.calls) == 1


def test_bad_arch_name_is_refused():
    with pytest.raises(ValueError, match="sm_90a"):
        run_probes(["90a"])


def test_incomplete_toolchain_probes_every_time_and_writes_nothing(probed, tmp_path):
    path, _, features = probed
    incomplete = Toolchain.current().model_copy(update={"complete": False, "incomplete_reasons": ("test",)})
    target = tmp_path / "features.json"
    calls = []

    def probe(archs, timeout_s):  # counts, and answers with this module's real probe result
        calls.append(list(archs))
        return features

    for _ in range(2):
        got = load_or_probe(target, ARCHS, toolchain=incomplete, probe=probe)
        assert got.toolchain is None and got.key_dict() == features.key_dict()
    assert len(calls) == 2 and not target.exists()


def test_probe_timeout_is_recorded_not_raised():
    got = run_probes(["sm_90a"], timeout_s=0.05)  # far too short to import TileLang or cutlass
    assert got.tilelang_importable is False and got.cutlass_dsl_importable is False
    assert got.cute_math_isfinite is None and got.tilelang_bool_fragment_ok == {"sm_90a": None}
    for name in ("tilelang_importable", "cute_math_isfinite", "tilelang_bool_fragment_ok[sm_90a]"):
        assert "timed out" in got.errors[name]
        assert name in got.unsettled  # a timeout may pass: never saved, a prebuild fails on it


def _fake_nvcc(tmp_path, stderr: str):
    """An nvcc that fails every compile with ``stderr`` (and answers ``--version``)."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\n"
                    'case "$*" in *--version*) echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0;; esac\n'
                    f"echo \"{stderr}\" >&2; exit 1\n")
    nvcc.chmod(0o755)
    return nvcc


@pytest.mark.parametrize("stderr, value, settled", [
    ("nvcc fatal   : Unsupported gpu architecture 'compute_90a'", False, True),
    ("nvcc fatal   : Value 'sm_90a' is not defined for option 'gpu-architecture'", False, True),
    ("nvcc fatal   : Could not write file 'probe.cubin': No space left on device", None, False),
    ("gcc: fatal error: cannot execute 'cc1plus': execvp: No such file or directory", None, False),
])
def test_nvcc_failure_is_a_refusal_only_when_nvcc_names_the_arch(tmp_path, stderr, value, settled):
    got = _nvcc_arch_probe(_fake_nvcc(tmp_path, stderr), "sm_90a", 60)
    assert (got.value, got.settled) == (value, settled)
    assert got.error is not None and stderr.split(":")[-1].strip() in got.error


def test_unsettled_probes_are_not_saved_and_are_asked_again(probed, tmp_path):
    _, _, features = probed
    target = tmp_path / "features.json"
    broken = features.model_copy(update={
        "nvcc_archs": {**features.nvcc_archs, "sm_90a": None}, "unsettled": ("nvcc_archs[sm_90a]",),
        "errors": {**features.errors, "nvcc_archs[sm_90a]": "No space left on device"}})
    answers = [broken, features]
    calls = []

    def probe(archs, timeout_s):  # the first run cannot answer, the second can
        calls.append(list(archs))
        return answers[len(calls) - 1]

    first = load_or_probe(target, ARCHS, probe=probe)
    assert first.unsettled == ("nvcc_archs[sm_90a]",) and first.why("nvcc_archs[sm_90a]") == "No space left on device"
    assert not target.exists()
    second = load_or_probe(target, ARCHS, probe=probe)
    assert second.unsettled == () and target.exists() and len(calls) == 2
    assert load_or_probe(target, ARCHS, probe=probe) == second and len(calls) == 2
    assert "unsettled" not in json.loads(target.read_text())  # readable by releases without it
    assert broken.key_dict().keys() == features.key_dict().keys()  # never part of a key
