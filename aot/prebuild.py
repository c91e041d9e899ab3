"""``dsa-aot prebuild``: compile the catalog into the cache, in parallel worker processes.

Each worker process builds for one arch only and has ``CUTE_DSL_ARCH`` set before anything
imports cutlass (CuTe DSL reads it once, at import). Cached entries are skipped without
starting a compiler, so a fully cached prebuild costs a directory walk.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dsa_aot import registry
from dsa_aot import settings as _settings
from dsa_aot.backends import BACKENDS, BuildError, first_error_line
from dsa_aot.cache.store import ArtifactStore
from dsa_aot.specs.catalog import Catalog, load_catalog, select
from dsa_aot.specs.models import KernelSpec

Status = Literal["built", "cached", "failed", "skipped-by-feature"]


@dataclass
class Outcome:
    spec_id: str
    status: Status
    seconds: float = 0.0
    message: str = ""


@dataclass
class Summary:
    fingerprint: str
    root: Path
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0

    def count(self, status: Status) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def ok(self) -> bool:
        return self.count("failed") == 0


def detect_gpu_archs() -> list[str]:
    """Archs of the visible GPUs, via the driver API (no torch import); empty without a GPU."""
    from dsa_aot.loader import arch_of_capability

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return []
    if lib.cuInit(0) != 0:
        return []
    count = ctypes.c_int()
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return []
    archs = []
    for i in range(count.value):
        major, minor = ctypes.c_int(), ctypes.c_int()
        lib.cuDeviceGetAttribute(ctypes.byref(major), 75, i)  # COMPUTE_CAPABILITY_MAJOR
        lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, i)  # COMPUTE_CAPABILITY_MINOR
        arch = arch_of_capability(major.value, minor.value)
        if arch and arch not in archs:
            archs.append(arch)
    return archs


def default_archs() -> list[str]:
    """``DSA_AOT_ARCH_LIST``, else the GPU's arch, else sm_90a and sm_100a."""
    cfg = _settings.get()
    if cfg.arch_list:
        return list(cfg.arch_list)
    return detect_gpu_archs() or ["sm_90a", "sm_100a"]


def _init_worker(arch: str) -> None:
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")


def build_one(spec_json: str, root: str, fingerprint: str, lock_timeout_s: float) -> Outcome:
    """Worker: build one spec and publish it (runs in a worker process)."""
    from dsa_aot.specs.toolchain import Toolchain

    spec = KernelSpec.model_validate_json(spec_json)
    start = time.perf_counter()
    toolchain = Toolchain.current()
    here = toolchain.fingerprint
    if here != fingerprint:
        return Outcome(spec.id, "failed", 0.0, f"worker toolchain {here} differs from parent {fingerprint}")
    store = ArtifactStore(root, lock_timeout_s=lock_timeout_s)
    try:
        with store.lock(fingerprint, spec.arch, spec.id):
            if store.lookup(fingerprint, spec.arch, spec.id) is not None:
                return Outcome(spec.id, "cached", time.perf_counter() - start)
            built = BACKENDS[spec.backend].build(spec, fingerprint)
            store.publish(fingerprint, spec.arch, spec.id, built.files,
                          built.manifest.stamped(toolchain).model_dump(mode="json"))
    except BuildError as exc:
        return Outcome(spec.id, "failed", time.perf_counter() - start, str(exc))
    except Exception as exc:
        return Outcome(spec.id, "failed", time.perf_counter() - start,
                       f"{type(exc).__name__}: {first_error_line(exc)}")
    return Outcome(spec.id, "built", time.perf_counter() - start)


def plan(catalog: Catalog, archs: list[str], only: list[str] | None,
         shard: tuple[int, int] | None) -> list[KernelSpec]:
    specs = catalog.specs(implemented=registry.implemented())
    return select(specs, archs=archs, only=only, shard=shard)


def prebuild(*, archs: list[str] | None = None, only: list[str] | None = None,
             shard: tuple[int, int] | None = None, jobs: int | None = None,
             catalog_path: Path | None = None, root: Path | None = None,
             progress: bool = True) -> Summary:
    """Build every selected spec that is not cached yet; never raises for a single spec."""
    from dsa_aot.specs.toolchain import Toolchain

    start = time.perf_counter()
    cfg = _settings.get()
    toolchain = Toolchain.current()
    if not getattr(toolchain, "complete", True):
        raise RuntimeError("cannot key the cache: " + "; ".join(toolchain.incomplete_reasons))
    fingerprint = toolchain.fingerprint
    store = ArtifactStore(root or cfg.cache_dir, lock_timeout_s=cfg.lock_timeout_s)
    if not store.writable():
        raise RuntimeError(f"cache root {store.root} is not writable; set DSA_AOT_CACHE_DIR or --cache-dir")
    store.sweep_staging()
    summary = Summary(fingerprint=fingerprint, root=store.root)
    specs = plan(load_catalog(catalog_path), archs or default_archs(), only, shard)
    todo = []
    for spec in specs:
        if store.lookup(fingerprint, spec.arch, spec.id) is not None:
            summary.outcomes.append(Outcome(spec.id, "cached"))
        else:
            todo.append(spec)
    if todo:
        from dsa_aot.specs.probes import load_or_probe

        features = load_or_probe(store.root / fingerprint / "features.json", sorted({s.arch for s in todo}))
        buildable = []
        for spec in todo:
            backend = BACKENDS[spec.backend]
            reason = backend.can_build() or backend.unsupported_reason(spec, features)
            if reason:
                summary.outcomes.append(Outcome(spec.id, "skipped-by-feature", message=reason))
            else:
                buildable.append(spec)
        _build_all(buildable, store, fingerprint, jobs or 1, cfg.lock_timeout_s, summary, progress)
    order = {s.id: i for i, s in enumerate(specs)}
    summary.outcomes.sort(key=lambda o: order.get(o.spec_id, 0))
    summary.wall_s = time.perf_counter() - start
    return summary


def _build_all(specs: list[KernelSpec], store: ArtifactStore, fingerprint: str, jobs: int,
               lock_timeout_s: float, summary: Summary, progress: bool) -> None:
    bar = _progress(len(specs), progress)
    by_arch: dict[str, list[KernelSpec]] = {}
    for spec in specs:
        by_arch.setdefault(spec.arch, []).append(spec)
    ctx = multiprocessing.get_context("spawn")
    for arch, group in by_arch.items():
        with ProcessPoolExecutor(max_workers=min(jobs, len(group)), mp_context=ctx,
                                 initializer=_init_worker, initargs=(arch,)) as pool:
            futures = {pool.submit(build_one, s.model_dump_json(), str(store.root), fingerprint,
                                   lock_timeout_s): s for s in group}
            for fut in as_completed(futures):
                spec = futures[fut]
                try:
                    outcome = fut.result()
                except Exception as exc:  # a worker died (e.g. killed by the OOM killer)
                    outcome = Outcome(spec.id, "failed", 0.0, f"worker crashed: {exc}")
                summary.outcomes.append(outcome)
                bar(outcome)
    bar(None)


def _progress(total: int, enabled: bool):
    if not enabled or total == 0:
        return lambda outcome: None
    try:
        from tqdm import tqdm

        pbar = tqdm(total=total, unit="spec", desc="prebuild", file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        pbar = None
    done = 0

    def update(outcome: Outcome | None) -> None:
        nonlocal done
        if outcome is None:
            if pbar is not None:
                pbar.close()
            return
        done += 1
        if pbar is not None:
            pbar.set_postfix_str(f"{outcome.spec_id} {outcome.status}", refresh=False)
            pbar.update(1)
        else:
            print(f"[{done}/{total}] {outcome.spec_id}: {outcome.status} ({outcome.seconds:.1f}s)",
                  file=sys.stderr, flush=True)

    return update


def format_summary(summary: Summary) -> str:
    lines = [f"toolchain {summary.fingerprint}  cache {summary.root}"]
    problems = [o for o in summary.outcomes if o.status in ("failed", "skipped-by-feature")]
    if problems:
        width = max(len(o.spec_id) for o in problems)
        lines.append("")
        for o in problems:
            lines.append(f"  {o.spec_id:<{width}}  {o.status:<18}  {o.message}")
    built = [o.seconds for o in summary.outcomes if o.status == "built"]
    lines += ["", f"  {'built':<20}{summary.count('built'):>5}"
                  + (f"   ({sum(built):.1f} s compile, {max(built):.1f} s slowest)" if built else ""),
              f"  {'cached':<20}{summary.count('cached'):>5}",
              f"  {'failed':<20}{summary.count('failed'):>5}",
              f"  {'skipped-by-feature':<20}{summary.count('skipped-by-feature'):>5}",
              f"  {'total':<20}{len(summary.outcomes):>5}   in {summary.wall_s:.1f} s wall"]
    return "\n".join(lines)
