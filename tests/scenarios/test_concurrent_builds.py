"""Concurrent cold starts: one compile per key across processes, no lock shared between keys.

Each child process runs the loader's protocol (``try_load``, then ``build_and_load`` under the
store's per-key file lock with a re-check) against one real cache root. Compiles are counted by
the builder itself (``_tiny_kernel.record``), never inferred from timings.
"""

from __future__ import annotations

import hashlib
import time

import pytest

import _harness

N = 8


def test_eight_cold_starts_of_one_variant_compile_once(rig, tmp_path):
    missed = tmp_path / "missed"
    missed.mkdir()
    # The builder holds the key lock until all 8 processes have missed in try_load and are
    # queued on that lock: the worst interleaving, forced rather than hoped for.
    env = rig.env(REL_WAIT_FOR_MISSES=str(missed), REL_WAIT_FOR_MISSES_N=str(N))
    results = _harness.start_together([{"missed_dir": str(missed)}] * N, [env] * N, tmp_path)

    assert all(r["missed"] for r in results)  # all 8 went down the cold path
    assert len(rig.builds()) == 1  # ... and exactly one compiled
    assert len(rig.loads()) == N  # every process loaded a checked artifact
    sources = sorted(r["source"].split(":", 1)[0] for r in results)
    assert sources == ["cache"] * (N - 1) + ["jit"]
    entry = rig.store().lookup(rig.key(), "sm_90a", _harness.spec().id)
    assert entry is not None and rig.store().verify(entry) == []
    published = {"fwd": hashlib.sha256(rig.store().read_file(entry, "fwd.cubin")).hexdigest()}
    assert all(r["cubins"] == published for r in results)
    assert _harness.staging_leftovers(rig.root) == []


def test_eight_different_variants_build_in_parallel(rig, tmp_path):
    barrier = tmp_path / "inside-build"
    barrier.mkdir()
    # Every builder waits inside build() (holding its own key's lock) until all 8 are there.
    # Any lock wider than one key would serialize them and this barrier would time out.
    env = rig.env(REL_BUILD_BARRIER=str(barrier), REL_BUILD_BARRIER_N=str(N), REL_BARRIER_TIMEOUT="90")
    variants = [{"spec": {"heads": h, "d_qk": d}} for d in (512, 576) for h in (16, 32, 64, 128)]
    results = _harness.start_together(variants, [env] * len(variants), tmp_path, timeout_s=180)

    assert len(list(barrier.iterdir())) == N  # 8 builders were inside build() at the same time
    builds = rig.builds()
    assert sorted(b[1] for b in builds) == sorted(r["spec_id"] for r in results)  # one compile each
    assert all(r["source"].startswith("jit:") for r in results)
    assert len({r["cubins"]["fwd"] for r in results}) == N  # 8 distinct binaries
    store = rig.store()
    specs = {s.id: s for s in (_harness.spec(**v["spec"]) for v in variants)}
    for r in results:
        entry = store.lookup(rig.key(specs[r["spec_id"]]), "sm_90a", r["spec_id"])
        assert entry is not None and store.verify(entry) == []
        assert hashlib.sha256(store.read_file(entry, "fwd.cubin")).hexdigest() == r["cubins"]["fwd"]


def _real_fwd_buildable() -> str | None:
    """Why the real forward kernel cannot be built here yet, or None."""
    import importlib

    from dsa_aot.backends.tilelang import BUILDERS, TileLangBackend

    try:
        getattr(importlib.import_module(TileLangBackend.kernel_modules["fwd"]), BUILDERS["fwd"])(_harness.spec())
    except Exception as exc:  # the kernel module is still being written
        return f"{type(exc).__name__}: {exc}"
    return None


def test_real_forward_kernel_eight_cold_starts(rig, tmp_path):
    """The real forward kernel of the smallest variant: 8 processes, 1 compile, 8 checked loads."""
    reason = _real_fwd_buildable()
    if reason:
        pytest.skip(f"the real TileLang forward kernel does not build yet ({reason})")
    missed = tmp_path / "missed"
    missed.mkdir()
    start = time.perf_counter()
    results = _harness.start_together([{"real_kernel": True, "missed_dir": str(missed)}] * N,
                                      [rig.env()] * N, tmp_path, timeout_s=580)
    wall = time.perf_counter() - start
    assert len(rig.builds()) == 1 and len(rig.loads()) == N
    sources = sorted(r["source"].split(":", 1)[0] for r in results)
    assert sources == ["cache"] * (N - 1) + ["jit"]
    assert sum(r["missed"] for r in results) >= 2  # a compile takes seconds: several raced it
    assert len({r["cubins"]["fwd"] for r in results}) == 1
    entry = rig.store().lookup(rig.key(tiny=False), "sm_90a", _harness.spec().id)
    assert entry is not None and rig.store().verify(entry) == []
    print(f"\nreal {entry.meta.spec_id}: compile {entry.meta.payload['build_seconds']} s, "
          f"{sum(r['missed'] for r in results)} of {N} missed and queued, wall {wall:.1f} s")
