"""The ``dsa-aot`` command line: prebuild, list, status, verify, gc, export, import, doctor."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dsa_aot import settings as _settings


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: use i/n, e.g. 1/4") from None
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: need 1 <= i <= n")
    return i, n


def _archs(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    out = [a for v in values for a in v.replace(",", " ").split()]
    for a in out:
        if a not in _settings.ARCHS:
            raise SystemExit(f"dsa-aot: unknown arch {a!r}; use {', '.join(_settings.ARCHS)}")
    return out


def _store(args):
    from dsa_aot.cache.store import ArtifactStore

    cfg = _settings.get()
    return ArtifactStore(args.cache_dir or cfg.cache_dir, lock_timeout_s=cfg.lock_timeout_s)


def _fingerprint(store=None) -> str:
    """This toolchain's key; for ``store``, the key its entries are looked up under (the
    builder's, in a process without a CUDA toolkit: see :func:`dsa_aot.loader.builder_fingerprint`)."""
    from dsa_aot.specs.toolchain import Toolchain

    if store is None:
        return Toolchain.current().fingerprint
    from dsa_aot.loader import builder_fingerprint

    return builder_fingerprint(store, Toolchain.current())


def cmd_prebuild(args) -> int:
    from dsa_aot.prebuild import format_summary, prebuild

    summary = prebuild(archs=_archs(args.arch), only=args.only, shard=args.shard, jobs=args.jobs,
                       catalog_path=args.catalog, root=args.cache_dir, progress=not args.quiet)
    print(format_summary(summary))
    return 0 if summary.ok else 1


def cmd_list(args) -> int:
    from dsa_aot import registry
    from dsa_aot.specs.catalog import load_catalog, select

    specs = select(load_catalog(args.catalog).specs(registry.implemented()), archs=_archs(args.arch),
                   only=args.only)
    if args.json:
        print(json.dumps([{"id": s.id, **s.model_dump(mode="json")} for s in specs], indent=1))
    else:
        for s in specs:
            print(s.id)
    return 0


def _states(args) -> dict[str, str]:
    from dsa_aot import registry
    from dsa_aot.specs.catalog import load_catalog, select

    cfg = _settings.get()
    from dsa_aot.cache.store import ArtifactStore

    stores = [ArtifactStore(r, read_only=True) for r in cfg.prebuilt_dirs] + [_store(args)]
    fps = [_fingerprint(s) for s in stores]
    quarantine = [p.name for s in stores if (s.root / ".quarantine").is_dir() for p in (s.root / ".quarantine").iterdir()]
    states = {}
    for spec in select(load_catalog(args.catalog).specs(registry.implemented()), archs=_archs(args.arch),
                       only=args.only):
        if any(s.lookup(fp, spec.arch, spec.id) is not None for s, fp in zip(stores, fps)):
            states[spec.id] = "cached"
        elif any(f"{fp}.{spec.arch}.{spec.id}." in q for fp in fps for q in quarantine):
            states[spec.id] = "failed"
        else:
            states[spec.id] = "missing"
    return states


def cmd_status(args) -> int:
    states = _states(args)
    if args.json:
        print(json.dumps(states, indent=1))
    else:
        for spec_id, state in states.items():
            print(f"{state:<8} {spec_id}")
        counts = {s: list(states.values()).count(s) for s in ("cached", "missing", "failed")}
        print(f"toolchain {_fingerprint()}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return 0


def cmd_verify(args) -> int:
    store = _store(args)
    bad = 0
    total = 0
    for entry in store.entries():
        total += 1
        problems = store.verify(entry)
        if problems:
            bad += 1
            for p in problems:
                print(f"BAD  {p}")
            if args.quarantine:
                store.quarantine(entry, "; ".join(problems))
    print(f"{total} entries checked, {bad} damaged")
    return 1 if bad else 0


def cmd_gc(args) -> int:
    store = _store(args)
    keep = None if args.all else _fingerprint(store)
    report = store.gc(keep, args.max_bytes if args.max_bytes is not None else _settings.get().cache_max_bytes)
    print(f"removed {len(report.removed_fingerprints)} other toolchains, {len(report.removed_entries)} LRU entries; "
          f"freed {report.freed_bytes / 2**20:.1f} MiB, {report.remaining_bytes / 2**20:.1f} MiB remain")
    return 0


def cmd_export(args) -> int:
    from dsa_aot.cache.bundle import export_bundle

    store = _store(args)
    keys = export_bundle(store, Path(args.file), fingerprint=None if args.all_toolchains else _fingerprint(store),
                         archs=_archs(args.arch))
    print(f"exported {len(keys)} entries to {args.file}")
    return 0


def cmd_import(args) -> int:
    from dsa_aot.cache.bundle import import_bundle

    report = import_bundle(_store(args), Path(args.file))
    print(f"imported {len(report.imported)} entries, {len(report.already_present)} already present")
    return 0


def cmd_doctor(args) -> int:
    from dsa_aot.cache.store import ArtifactStore, shared_writable_reason
    from dsa_aot.loader import get_loader
    from dsa_aot.prebuild import default_archs, detect_gpu_archs
    from dsa_aot.specs.toolchain import Toolchain

    cfg = _settings.get()
    tc = Toolchain.current()
    report = {"toolchain": tc.model_dump(mode="json"), "fingerprint": tc.fingerprint,
              "gpu_archs": detect_gpu_archs(), "prebuild_archs": default_archs(),
              "settings": {k: str(v) for k, v in vars(cfg).items()},
              "cache_roots": [{"root": str(r), "read_only": r != cfg.cache_dir, "exists": Path(r).is_dir(),
                               "unsafe": shared_writable_reason(Path(r)),
                               "looked_up_under": _fingerprint(ArtifactStore(r, read_only=True))}
                              for r in (*cfg.prebuilt_dirs, cfg.cache_dir)]}
    if args.probes:
        report["features"] = get_loader().features().model_dump(mode="json")
    states = _states(args)
    report["catalog"] = {s: list(states.values()).count(s) for s in ("cached", "missing", "failed")}
    report["loader_would_pick"] = {
        arch: ("prebuilt/cache artifact" if states.get(f"fwd-{arch}-d576-h64-noncompact-tilelang") == "cached"
               else "JIT" if cfg.jit and not cfg.require_prebuilt else
               "error (DSA_AOT_REQUIRE_PREBUILT=1)" if cfg.require_prebuilt else "torch reference")
        for arch in ("sm_90a", "sm_100a")}
    print(json.dumps(report, indent=1, default=str))
    return 0


def cmd_compat(args) -> int:
    from dsa_aot import compat

    if args.merge:
        report = compat.merge_reports(args.merge)
    else:
        report = compat.run_compat(args.matrix, envs_dir=args.envs_dir, slice_name=args.slice,
                                   toolchains=args.toolchain, shard=args.shard, only=args.only, jobs=args.jobs)
    paths = compat.write_report(report, args.out)
    print(compat.format_summary(report))
    print("wrote " + " and ".join(str(p) for p in paths))
    return 1 if report.problems else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsa-aot", description="Ahead-of-time sparse MLA kernel cache")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, select=True):
        sp.add_argument("--cache-dir", type=Path, default=None, help="cache root (default: DSA_AOT_CACHE_DIR)")
        sp.add_argument("--catalog", type=Path, default=None, help="catalog TOML (default: packaged)")
        if select:
            sp.add_argument("--arch", action="append", help="sm_90a / sm_100a (repeatable, or comma-separated)")
            sp.add_argument("--only", action="append", metavar="GLOB", help="spec id glob (repeatable)")

    sp = sub.add_parser("prebuild", help="compile the catalog into the cache")
    common(sp)
    sp.add_argument("--jobs", "-j", type=int, default=1, help="parallel compiler processes")
    sp.add_argument("--shard", type=_shard, default=None, help="build shard i of n (1-based), e.g. 2/4")
    sp.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    sp.set_defaults(func=cmd_prebuild)
    sp = sub.add_parser("list", help="list catalog specs")
    common(sp)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_list)
    sp = sub.add_parser("status", help="cached / missing / failed per spec for this toolchain")
    common(sp)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_status)
    sp = sub.add_parser("verify", help="re-hash every artifact")
    common(sp, select=False)
    sp.add_argument("--quarantine", action="store_true", help="move damaged entries aside")
    sp.set_defaults(func=cmd_verify)
    sp = sub.add_parser("gc", help="drop other toolchains' entries, trim to a size (LRU)")
    common(sp, select=False)
    sp.add_argument("--max-bytes", type=int, default=None)
    sp.add_argument("--all", action="store_true", help="also drop this toolchain's entries")
    sp.set_defaults(func=cmd_gc)
    sp = sub.add_parser("export", help="write a verified bundle of the cache")
    common(sp, select=False)
    sp.add_argument("file")
    sp.add_argument("--arch", action="append")
    sp.add_argument("--all-toolchains", action="store_true")
    sp.set_defaults(func=cmd_export)
    sp = sub.add_parser("import", help="verify and add a bundle to the cache")
    common(sp, select=False)
    sp.add_argument("file")
    sp.set_defaults(func=cmd_import)
    sp = sub.add_parser("doctor", help="toolchain, probes, GPU, cache roots, loader choice")
    common(sp)
    sp.add_argument("--probes", action="store_true", help="also run/read the feature probes")
    sp.set_defaults(func=cmd_doctor)
    sp = sub.add_parser("compat", help="per toolchain of a matrix: own venv, probes, prebuild; report")
    sp.add_argument("--matrix", type=Path, default=None, help="matrix TOML (default: packaged compat_matrix.toml)")
    sp.add_argument("--slice", default=None, help="run a [slices.NAME] of the matrix, e.g. ci")
    sp.add_argument("--toolchain", action="append", metavar="GLOB", help="toolchain name glob (repeatable)")
    sp.add_argument("--shard", type=_shard, default=None, help="run toolchain shard i of n (1-based), e.g. 1/3")
    sp.add_argument("--only", action="append", metavar="GLOB", help="spec id glob (repeatable; default: the matrix's)")
    sp.add_argument("--envs-dir", type=Path, default=Path(".compat-envs"), help="cached virtualenvs (reused)")
    sp.add_argument("--out", type=Path, default=Path("docs/compat"), help="writes OUT.json and OUT.md")
    sp.add_argument("--jobs", "-j", type=int, default=None, help="prebuild jobs (default: the matrix's)")
    sp.add_argument("--merge", nargs="+", type=Path, metavar="JSON", help="merge shard reports, run nothing")
    sp.set_defaults(func=cmd_compat)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (_settings.SettingsError, FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"dsa-aot {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
