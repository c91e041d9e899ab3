"""The ``dsa-aot`` command line: prebuild, list, status, verify, gc, export, import, doctor,
and the fleet tier's push, pull and keygen."""

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


def _fingerprint() -> str:
    """The installed compiler toolchain's fingerprint (for the status line)."""
    from dsa_aot.specs.toolchain import Toolchain

    return Toolchain.current().fingerprint


def _catalog_specs(args) -> list:
    from dsa_aot.specs.catalog import load_catalog, select

    return select(load_catalog(getattr(args, "catalog", None)).specs(), archs=_archs(getattr(args, "arch", None)),
                  only=getattr(args, "only", None))


def _served_keys(store, specs) -> set[str]:
    """Keys of ``store`` that this process would serve or build for ``specs`` (what gc keeps)."""
    from dsa_aot.loader import Loader

    loader, keys = Loader(), set()
    for spec in specs:
        key = loader.key_of(spec)
        if key is not None:
            keys.add(key)
        match = loader.find(store, spec)
        if match is not None:
            keys.add(match.entry.meta.fingerprint)
    return keys


def cmd_prebuild(args) -> int:
    import os

    from dsa_aot.prebuild import format_summary, prebuild

    # With --json, stdout carries the summary alone: until then, whatever the build prints
    # (this process, or the compiler workers, which inherit the descriptor) goes to stderr.
    saved = None
    if args.json:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
    try:
        summary = prebuild(archs=_archs(args.arch), only=args.only, shard=args.shard, jobs=args.jobs,
                           catalog_path=args.catalog, root=args.cache_dir, progress=not args.quiet,
                           push=args.push)
    finally:
        if saved is not None:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
    print(json.dumps(summary.as_dict(), indent=1) if args.json else format_summary(summary))
    return 0 if summary.ok else 1


def cmd_list(args) -> int:
    specs = _catalog_specs(args)
    if args.json:
        print(json.dumps([{"id": s.id, **s.model_dump(mode="json")} for s in specs], indent=1))
    else:
        for s in specs:
            print(s.id)
    return 0


def _states(args) -> dict[str, str]:
    """Per catalog spec: ``cached`` (a store would serve it here), ``stale`` (stored, but built by
    another toolchain or dsa-aot), ``failed`` (quarantined) or ``missing``."""
    from dsa_aot.cache.store import ArtifactStore
    from dsa_aot.loader import Loader

    cfg = _settings.get()
    stores = [ArtifactStore(r, read_only=True) for r in cfg.prebuilt_dirs] + [_store(args)]
    quarantine = [q for s in stores for q in s.quarantined()]
    loader, states = Loader(), {}
    for spec in _catalog_specs(args):
        if any(loader.find(s, spec) is not None for s in stores):
            states[spec.id] = "cached"
        elif any(next(s.candidates(spec.arch, spec.id), None) is not None for s in stores):
            states[spec.id] = "stale"
        elif any(f".{spec.arch}.{spec.id}." in q for q in quarantine):
            states[spec.id] = "failed"
        else:
            states[spec.id] = "missing"
    return states


def _remote_states(args, remote) -> dict[str, str]:
    """Per catalog spec on the remote: ``cached`` (this process would pull it), ``stale``
    (entries of the spec under other keys only) or ``missing``; all ``unreachable`` if it is."""
    from dsa_aot.loader import Loader

    loader, states = Loader(), {}
    for spec in _catalog_specs(args):
        if not remote.available:
            states[spec.id] = "unreachable"
        elif loader.find(remote, spec) is not None:
            states[spec.id] = "cached"
        elif next(remote.candidates(spec.arch, spec.id), None) is not None:
            states[spec.id] = "stale"
        else:
            states[spec.id] = "unreachable" if not remote.available else "missing"
    return states


def cmd_status(args) -> int:
    states = _states(args)
    remote_states = _remote_states(args, _need_remote()) if args.remote else None
    if args.json:
        print(json.dumps(states if remote_states is None else
                         {s: {"local": st, "remote": remote_states[s]} for s, st in states.items()}, indent=1))
    else:
        for spec_id, state in states.items():
            print(f"{state:<8} {spec_id}" if remote_states is None else
                  f"{state:<8} remote:{remote_states[spec_id]:<11} {spec_id}")
        counts = {s: list(states.values()).count(s) for s in ("cached", "stale", "missing", "failed")}
        print(f"toolchain {_fingerprint()}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
        if remote_states is not None:
            rc = {s: list(remote_states.values()).count(s) for s in ("cached", "stale", "missing", "unreachable")}
            print(f"remote {_need_remote().root}: " + ", ".join(f"{n} {s}" for s, n in rc.items() if n or s != "unreachable"))
    return 0


def _need_remote(write: bool | None = None):
    from dsa_aot.fleet import remote_store

    remote = remote_store(write=write)
    if remote is None:
        raise RuntimeError("no remote configured: set DSA_AOT_REMOTE_URL=redis://host:port/db")
    return remote


def _local_stores(args):
    from dsa_aot.cache.store import ArtifactStore

    cfg = _settings.get()
    return [ArtifactStore(r, read_only=True) for r in cfg.prebuilt_dirs] + [_store(args)]


def cmd_push(args) -> int:
    from dsa_aot.fleet import push_specs
    from dsa_aot.loader import Loader

    remote = _need_remote(write=True)
    remote.ping()
    summary = push_specs(_catalog_specs(args), Loader(), _local_stores(args), remote, progress=not args.quiet)
    print(json.dumps(summary.as_dict(), indent=1) if args.json else summary.format())
    return 0 if summary.ok else 1


def cmd_pull(args) -> int:
    from dsa_aot.fleet import pull_specs
    from dsa_aot.loader import Loader

    remote = _need_remote()
    remote.ping()
    stores = _local_stores(args)
    if not stores[-1].writable():
        raise RuntimeError(f"cache root {stores[-1].root} is not writable; set DSA_AOT_CACHE_DIR or --cache-dir")
    summary = pull_specs(_catalog_specs(args), Loader(), stores, stores[-1], remote, progress=not args.quiet)
    print(json.dumps(summary.as_dict(), indent=1) if args.json else summary.format())
    return 0 if summary.ok else 1


def cmd_keygen(args) -> int:
    from dsa_aot.cache.signing import Signer

    signer = Signer.generate()
    private, public = signer.write(Path(args.file))
    print(f"key {signer.key_id}: private {private} (DSA_AOT_SIGNING_KEY, keep it on builders), "
          f"public {public} (DSA_AOT_TRUSTED_KEYS)")
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
    keep = set() if args.all else _served_keys(store, _catalog_specs(args))
    report = store.gc(keep, args.max_bytes if args.max_bytes is not None else _settings.get().cache_max_bytes)
    print(f"removed {len(report.removed_fingerprints)} other toolchains, {len(report.removed_entries)} LRU entries; "
          f"freed {report.freed_bytes / 2**20:.1f} MiB, {report.remaining_bytes / 2**20:.1f} MiB remain")
    return 0


def cmd_export(args) -> int:
    from dsa_aot.cache.bundle import export_bundle

    store = _store(args)
    keys = export_bundle(store, Path(args.file), keys=None if args.all_toolchains else
                         _served_keys(store, _catalog_specs(args)), archs=_archs(args.arch))
    print(f"exported {len(keys)} entries to {args.file}")
    return 0


def cmd_import(args) -> int:
    from dsa_aot.cache.bundle import import_bundle

    from dsa_aot.fleet import trust_check

    report = import_bundle(_store(args), Path(args.file), accept=trust_check())
    print(f"imported {len(report.imported)} entries, {len(report.already_present)} already present")
    return 0


def _backend_report(tc) -> dict[str, object]:
    """Per backend: whether this process can build (and so key by build key) or serves by
    runtime identity, and the compilers its keys cover."""
    from dsa_aot.backends import BACKENDS
    from dsa_aot.identity import can_key_builds, installed_compilers

    out = {}
    for name, backend in BACKENDS.items():
        why = can_key_builds(backend, tc)
        out[name] = {"lookup_rule": "build key" if why is None else "runtime identity",
                     "why": why, "compilers": [d.model_dump(mode="json") for d in installed_compilers(backend, tc)]}
    return out


def _would_serve(args, cfg) -> dict[str, object]:
    """For the first catalog spec of each arch and op: the stored entry the loader would serve."""
    from dsa_aot import serving
    from dsa_aot.cache.store import ArtifactStore
    from dsa_aot.loader import Loader

    stores = [ArtifactStore(r, read_only=True) for r in (*cfg.prebuilt_dirs, cfg.cache_dir)]
    loader, out = Loader(), {}
    for spec in _catalog_specs(args):
        label = f"{spec.op}-{spec.arch}-{spec.backend}"
        if label in out:
            continue
        match = next((m for m in (loader.find(s, spec) for s in stores) if m is not None), None)
        out[label] = ({"spec": spec.id, "entry": f"{match.store.root}/{match.entry.key}", "rule": match.rule,
                       "serving_path": serving.why_not(spec.op, spec.arch, spec.d_qk, spec.heads, spec.layout,
                                                       spec.deterministic) or "serves it without pydantic"}
                      if match else {"spec": spec.id, "entry": None,
                                     "then": "JIT" if cfg.jit and not cfg.require_prebuilt else
                                     "error (DSA_AOT_REQUIRE_PREBUILT=1)" if cfg.require_prebuilt
                                     else "next backend or the torch reference"})
    return out


def _remote_report(cfg) -> dict[str, object]:
    """The remote tier and signing as this process sees them."""
    from dsa_aot.cache.remote import RemoteError
    from dsa_aot.cache.signing import SigningError
    from dsa_aot.fleet import remote_store, signer

    out: dict[str, object] = {"url": None, "signing_key": None, "trusted_keys": [str(p) for p in cfg.trusted_keys]}
    remote = remote_store()
    if remote is not None:
        out.update(url=remote.root, write=remote.writable, connect_timeout_s=cfg.remote_connect_timeout_s,
                   timeout_s=cfg.remote_timeout_s, ttl_s=cfg.remote_ttl_s, lease_s=cfg.remote_lease_s)
        try:
            out["connect_and_ping_ms"] = round(remote.ping(), 3)
            out["ping_ms"] = round(remote.ping(), 3)
        except RemoteError as exc:
            out["unreachable"] = str(exc)
    try:
        key = signer()
        out["signing_key"] = None if key is None else {"path": str(cfg.signing_key), "key_id": key.key_id}
    except SigningError as exc:
        out["signing_key"] = {"path": str(cfg.signing_key), "error": str(exc)}
    if cfg.trusted_keys:
        from dsa_aot.cache.signing import TrustedKeys

        try:
            out["trusted_key_ids"] = TrustedKeys.from_paths(cfg.trusted_keys).key_ids
        except SigningError as exc:
            out["trusted_key_ids"] = f"unusable, nothing will load: {exc}"
    return out


def cmd_doctor(args) -> int:
    from dsa_aot.cache.store import shared_writable_reason
    from dsa_aot.loader import get_loader
    from dsa_aot.prebuild import default_archs, detect_gpu_archs
    from dsa_aot.specs.installed import driver_cuda_version
    from dsa_aot.specs.toolchain import Toolchain

    cfg = _settings.get()
    tc = Toolchain.current()
    report = {"toolchain": tc.model_dump(mode="json"), "fingerprint": tc.fingerprint,
              "driver_cuda_version": driver_cuda_version(),  # picks the CuTe DSL's CUDA build
              "backends": _backend_report(tc),
              "gpu_archs": detect_gpu_archs(), "prebuild_archs": default_archs(),
              "settings": {k: str(v) for k, v in vars(cfg).items()},
              "cache_roots": [{"root": str(r), "read_only": r != cfg.cache_dir, "exists": Path(r).is_dir(),
                               "unsafe": shared_writable_reason(Path(r))}
                              for r in (*cfg.prebuilt_dirs, cfg.cache_dir)]}
    if args.probes:
        report["features"] = get_loader().features().model_dump(mode="json")
    states = _states(args)
    report["catalog"] = {s: list(states.values()).count(s) for s in ("cached", "stale", "missing", "failed")}
    report["loader_would_serve"] = _would_serve(args, cfg)
    report["remote"] = _remote_report(cfg)
    print(json.dumps(report, indent=1, default=str))
    return 0


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
    sp.add_argument("--json", action="store_true",
                    help="print the summary as JSON on stdout (key, root, wall time, per spec: "
                         "id, status, seconds, message); progress and build output go to stderr")
    sp.add_argument("--push", action="store_true",
                    help="compile once across builders sharing DSA_AOT_REMOTE_URL and push every entry there")
    sp.set_defaults(func=cmd_prebuild)
    sp = sub.add_parser("list", help="list catalog specs")
    common(sp)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_list)
    sp = sub.add_parser("status", help="cached / missing / failed per spec for this toolchain")
    common(sp)
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--remote", action="store_true", help="also the state of each spec on DSA_AOT_REMOTE_URL")
    sp.set_defaults(func=cmd_status)
    for name, func, text in (("push", cmd_push, "upload this toolchain's cached entries to DSA_AOT_REMOTE_URL"),
                             ("pull", cmd_pull, "download the entries this process would serve from "
                                                "DSA_AOT_REMOTE_URL into the cache (verified)")):
        sp = sub.add_parser(name, help=text)
        common(sp)
        sp.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
        sp.add_argument("--json", action="store_true", help="the summary as JSON on stdout")
        sp.set_defaults(func=func)
    sp = sub.add_parser("keygen", help="create an Ed25519 signing key FILE and its public key FILE.pub")
    sp.add_argument("file")
    sp.set_defaults(func=cmd_keygen)
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (_settings.SettingsError, FileNotFoundError, FileExistsError, ValueError, RuntimeError) as exc:
        print(f"dsa-aot {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
