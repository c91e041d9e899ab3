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

from dsa_aot import settings as _settings
from dsa_aot.backends import get as get_backend
from dsa_aot.backends.base import BuildError, first_error_line
from dsa_aot.cache.store import ArtifactStore
from dsa_aot.specs.catalog import Catalog, load_catalog, select
from dsa_aot.specs.models import KernelSpec, arch_of_capability

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

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (``dsa-aot prebuild --json``): the key fields, counts and one row per spec."""
        from dataclasses import fields

        out: dict[str, object] = {"schema_version": 1}
        for f in fields(self):  # fingerprint, root and any other key field the summary carries
            if f.name not in ("outcomes", "wall_s"):
                value = getattr(self, f.name)
                out[f.name] = str(value) if isinstance(value, Path) else value
        out["wall_seconds"] = round(self.wall_s, 3)
        out["ok"] = self.ok
        out["counts"] = {s: self.count(s) for s in ("built", "cached", "failed", "skipped-by-feature")}
        out["specs"] = [{"id": o.spec_id, "status": o.status, "seconds": round(o.seconds, 3),
                         "message": o.message} for o in self.outcomes]
        return out


def detect_gpu_archs() -> list[str]:
    """Archs of the visible GPUs, via the driver API (no torch import); empty without a GPU."""
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


def build_one(spec_json: str, root: str, fingerprint: str, lock_timeout_s: float, push: bool = False) -> Outcome:
    """Worker: build one spec and publish it (runs in a worker process of one arch); with
    ``push``, once across the fleet and pushed to the remote tier."""
    from dsa_aot.build import build_and_publish
    from dsa_aot.specs.toolchain import Toolchain

    spec = KernelSpec.model_validate_json(spec_json)
    start = time.perf_counter()
    toolchain = Toolchain.current()
    if toolchain.fingerprint != fingerprint:
        return Outcome(spec.id, "failed", 0.0,
                       f"worker toolchain {toolchain.fingerprint} differs from parent {fingerprint}")
    remote = None
    if push:
        from dsa_aot.fleet import remote_store

        remote = remote_store(write=True)
    try:
        done = build_and_publish(ArtifactStore(root, lock_timeout_s=lock_timeout_s), spec, toolchain, remote=remote)
    except BuildError as exc:
        return Outcome(spec.id, "failed", time.perf_counter() - start, str(exc))
    except Exception as exc:
        return Outcome(spec.id, "failed", time.perf_counter() - start,
                       f"{type(exc).__name__}: {first_error_line(exc)}")
    if done.status == "memory":
        return Outcome(spec.id, "failed", time.perf_counter() - start, f"built but not stored: {done.error}")
    return Outcome(spec.id, done.status, time.perf_counter() - start)


def plan(catalog: Catalog, archs: list[str], only: list[str] | None,
         shard: tuple[int, int] | None) -> list[KernelSpec]:
    return select(catalog.specs(), archs=archs, only=only, shard=shard)


def prebuild(*, archs: list[str] | None = None, only: list[str] | None = None,
             shard: tuple[int, int] | None = None, jobs: int | None = None,
             catalog_path: Path | None = None, root: Path | None = None,
             progress: bool = True, push: bool = False) -> Summary:
    """Build every selected spec that is not cached yet; never raises for a single spec. With
    ``push`` (a remote configured), missing specs are compiled once across the builders sharing
    the remote, and every built or cached entry ends up on the remote."""
    from dsa_aot.build import build_blocker
    from dsa_aot.identity import build_identity, can_key_builds
    from dsa_aot.specs.probes import load_or_probe
    from dsa_aot.specs.toolchain import Toolchain

    start = time.perf_counter()
    cfg = _settings.get()
    toolchain = Toolchain.current()
    store = ArtifactStore(root or cfg.cache_dir, lock_timeout_s=cfg.lock_timeout_s)
    if not store.writable():
        raise RuntimeError(f"cache root {store.root} is not writable; set DSA_AOT_CACHE_DIR or --cache-dir")
    store.sweep_staging()
    remote = None
    if push:
        from dsa_aot.fleet import remote_store

        remote = remote_store(write=True)
        if remote is None:
            raise RuntimeError("--push needs DSA_AOT_REMOTE_URL (redis://host:port/db)")
    summary = Summary(fingerprint=toolchain.fingerprint, root=store.root)
    specs = plan(load_catalog(catalog_path), archs or default_archs(), only, shard)
    todo, features = [], None
    for spec in specs:
        backend = get_backend(spec.backend)
        reason = can_key_builds(backend, toolchain)
        if reason is None and store.lookup(build_identity(backend, spec, toolchain).key(), spec.arch,
                                           spec.id) is not None:
            summary.outcomes.append(Outcome(spec.id, "cached"))
            continue
        if reason is None:
            if features is None:
                features = load_or_probe(store.features_path(toolchain.fingerprint),
                                         sorted({s.arch for s in specs}))
            reason = build_blocker(backend, spec, toolchain, features)
        if reason and features is not None and features.unsettled:
            # A probe that could not answer (a timeout, a full disk) says nothing about the
            # toolchain: fail the spec, so an image build stops instead of shipping without it.
            summary.outcomes.append(Outcome(spec.id, "failed", message=(
                f"{reason}; probe {', '.join(features.unsettled)} could not answer: "
                "fix that and run prebuild again")))
        elif reason:
            summary.outcomes.append(Outcome(spec.id, "skipped-by-feature", message=reason))
        else:
            todo.append(spec)
    _build_all(todo, store, toolchain.fingerprint, jobs or 1, cfg.lock_timeout_s, summary, progress, push)
    if remote is not None:
        _push_done(specs, summary, store, remote, toolchain)
    order = {s.id: i for i, s in enumerate(specs)}
    summary.outcomes.sort(key=lambda o: order.get(o.spec_id, 0))
    summary.wall_s = time.perf_counter() - start
    return summary


def _push_done(specs: list[KernelSpec], summary: Summary, store: ArtifactStore, remote, toolchain) -> None:
    """Push every built or cached entry of ``specs`` (a build pushes its own; this covers the
    rest, and an entry already on the remote costs one round trip). A failed push fails the spec."""
    from dsa_aot.identity import build_identity

    by_id = {s.id: s for s in specs}
    for outcome in summary.outcomes:
        spec = by_id.get(outcome.spec_id)
        if spec is None or outcome.status not in ("built", "cached"):
            continue
        entry = store.lookup(build_identity(get_backend(spec.backend), spec, toolchain).key(), spec.arch, spec.id)
        try:
            if entry is None:
                raise RuntimeError("its entry is gone from the cache")
            remote.push_entry(store, entry)
        except Exception as exc:
            outcome.status, outcome.message = "failed", f"built but not pushed: {exc}"


def _build_all(specs: list[KernelSpec], store: ArtifactStore, fingerprint: str, jobs: int,
               lock_timeout_s: float, summary: Summary, progress: bool, push: bool = False) -> None:
    bar = _progress(len(specs), progress)
    by_arch: dict[str, list[KernelSpec]] = {}
    for spec in specs:
        by_arch.setdefault(spec.arch, []).append(spec)
    ctx = multiprocessing.get_context("spawn")
    for arch, group in by_arch.items():
        with ProcessPoolExecutor(max_workers=min(jobs, len(group)), mp_context=ctx,
                                 initializer=_init_worker, initargs=(arch,)) as pool:
            futures = {pool.submit(build_one, s.model_dump_json(), str(store.root), fingerprint,
                                   lock_timeout_s, push): s for s in group}
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
