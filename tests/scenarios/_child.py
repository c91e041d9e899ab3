"""One loader (or store) run in a fresh process, for the multi-process scenario tests.

Usage: ``python _child.py '<json config>'``; prints one JSON line with the outcome. The
cache root comes from ``DSA_AOT_CACHE_DIR``; the toolchain is pinned to ``REL_TOOLCHAIN`` (the
parent's, so that a kernel file edited mid-run cannot split the key between processes).

Faults are injected by patching the store's module from the outside, never by hooks in the
product code: ``kill:<point>`` SIGKILLs the process at that point of a publish,
``enospc:<point>`` makes the disk "full" there.
"""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill(point: str) -> None:
    """SIGKILL this process at ``point`` of ``ArtifactStore.publish``."""
    from dsa_aot.cache import store as S

    write, fsync_dir, rename = S._write_file, S._fsync_dir, os.rename
    if point == "in_compile":
        os.environ["REL_KILL_IN_BUILD"] = "1"
    elif point == "first_file_half_written":
        def half(path, data):
            with open(path, "xb") as fh:
                fh.write(data[: len(data) // 2])
                fh.flush()
                os.fsync(fh.fileno())
            _die()
        S._write_file = half
    elif point in ("before_meta", "meta_half_written"):
        def before_meta(path, data):
            if path.name == S.META:
                if point == "meta_half_written":
                    with open(path, "xb") as fh:
                        fh.write(data[: len(data) // 2])
                        fh.flush()
                _die()
            write(path, data)
        S._write_file = before_meta
    elif point == "before_fsync_staging":
        S._fsync_dir = lambda path: _die()
    elif point in ("before_rename", "after_rename"):
        def rename_then(src, dst):
            if ".staging" in str(src):
                if point == "before_rename":
                    _die()
                rename(src, dst)
                _die()
            rename(src, dst)
        os.rename = rename_then
    elif point == "before_index_update":
        def die(self, entry, **kw):
            _die()
        S.ArtifactStore._index_update = die
    elif point == "in_index_transaction":
        import diskcache

        real_set = diskcache.Cache.set

        def set_and_die(self, *args, **kwargs):
            real_set(self, *args, **kwargs)
            _die()  # inside index.transact(): the row is written but not committed
        diskcache.Cache.set = set_and_die
    elif point == "gc_rmtree_after_meta":  # gc's delete got as far as meta.json
        def rmtree(path, ignore_errors=False):
            if (Path(path) / S.META).exists():
                os.unlink(Path(path) / S.META)
                _die()
            return real_rmtree(path, ignore_errors=ignore_errors)
        real_rmtree = S.shutil.rmtree
        S.shutil.rmtree = rmtree
    else:
        raise SystemExit(f"unknown kill point {point!r}")


class _FullDiskFile:
    """A writable file that accepts ``budget[0]`` more bytes, then fails with ENOSPC."""

    def __init__(self, fh, budget: list[int]) -> None:
        self._fh, self._budget = fh, budget

    def write(self, data: bytes) -> int:
        n = min(len(data), self._budget[0])
        self._fh.write(data[:n])
        self._budget[0] -= n
        if n < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._fh.name)
        return n

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._fh.close()


def install_enospc(point: str) -> None:
    """Make the store's writes fail with ENOSPC: at the first byte of the first file, 1000 bytes
    into the artifacts, 100 bytes into ``meta.json``, or in fsync."""
    from dsa_aot.cache import store as S

    if point == "fsync":
        def fsync(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.fsync = fsync
        return
    budget = [{"first_byte": 0, "mid_artifact": 1000, "in_meta": 100}[point]]
    real_open = builtins.open

    def open_(path, mode="r", *args, **kwargs):
        fh = real_open(path, mode, *args, **kwargs)
        if not any(c in mode for c in "wxa") or (point == "in_meta" and Path(path).name != S.META):
            return fh
        return _FullDiskFile(fh, budget)
    S.open = open_  # shadows the builtin inside the store module only


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if "umask" in cfg:
        os.umask(int(cfg["umask"], 8))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    import _harness
    from dsa_aot.loader import Loader
    from dsa_aot.specs.toolchain import Toolchain

    _harness.install(tiny=not cfg.get("real_kernel"))
    loader = Loader()
    loader._toolchain = Toolchain.model_validate_json(os.environ["REL_TOOLCHAIN"])
    spec = _harness.spec(**cfg.get("spec", {}))
    fault = cfg.get("fault")
    if fault and fault.startswith("kill:"):
        install_kill(fault.split(":", 1)[1])
    elif fault == "pause:before_rename":  # a live builder, stopped with its staging dir written
        rename = os.rename

        def paused_rename(src, dst):
            if ".staging" in str(src):
                Path(cfg["paused"]).touch()
                deadline = time.monotonic() + 120
                while not Path(cfg["resume"]).exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
            rename(src, dst)
        os.rename = paused_rename
    elif fault and fault.startswith("enospc:"):
        install_enospc(fault.split(":", 1)[1])

    if cfg.get("ready_dir"):  # start line: announce, then wait for the gate
        Path(cfg["ready_dir"], str(os.getpid())).touch()
        deadline = time.monotonic() + 120
        while not Path(cfg["gate"]).exists():
            if time.monotonic() > deadline:
                raise SystemExit("gate never opened")
            time.sleep(0.01)

    action = cfg.get("action", "acquire")
    out: dict = {"spec_id": spec.id, "pid": os.getpid()}
    if action == "acquire":  # Loader.resolve's steps for one backend: try_load, then JIT
        hit = loader.try_load(spec, 0)
        out["missed"] = hit is None
        if hit is None:
            if cfg.get("missed_dir"):
                Path(cfg["missed_dir"], str(os.getpid())).touch()
            kernel, source = loader.build_and_load(spec, 0)
            rule = None
        else:
            kernel, source, rule = hit
        out.update(source=source, rule=rule, cubins=kernel.cubins)
    elif action == "build_one":  # the prebuild worker
        from dsa_aot.prebuild import build_one

        fingerprint = Toolchain.current().fingerprint  # what the worker will check against
        outcome = build_one(spec.model_dump_json(), os.environ["DSA_AOT_CACHE_DIR"], fingerprint, 60.0)
        out.update(status=outcome.status, message=outcome.message, key=loader.key_of(spec))
    elif action == "shard":  # a prebuild worker of one shard, sharing the remote with the others
        from dsa_aot.build import build_and_publish
        from dsa_aot.cache.store import ArtifactStore
        from dsa_aot.fleet import remote_store
        from dsa_aot.specs.catalog import select

        specs = select([_harness.spec(**s) for s in cfg["specs"]], shard=tuple(cfg["shard"]))
        store, remote = ArtifactStore(os.environ["DSA_AOT_CACHE_DIR"]), remote_store(write=True)
        out["statuses"] = {s.id: build_and_publish(store, s, loader.toolchain(), remote=remote).status
                           for s in specs}
    elif action == "pull_resolve":  # `dsa-aot pull` of the specs, then the loader's lookup of each
        from dsa_aot.fleet import pull_specs, remote_store

        specs = [_harness.spec(**s) for s in cfg["specs"]]
        stores = [s for s in loader.stores() if not getattr(s, "remote", False)]
        summary = pull_specs(specs, loader, stores, loader.writable_store(), remote_store())
        out["pulled"] = {r.spec_id: r.status for r in summary.rows}
        resolved = {}
        for s in specs:
            hit = loader.try_load(s, 0)
            resolved[s.id] = None if hit is None else hit[1].split(":", 1)[0]
        out["resolved"] = resolved
    elif action == "gc":  # keep only this spec's key, trimmed to max_bytes
        from dsa_aot.cache.store import ArtifactStore

        report = ArtifactStore(os.environ["DSA_AOT_CACHE_DIR"]).gc(loader.key_of(spec), int(cfg["max_bytes"]))
        out["removed"] = report.removed_entries
    elif action == "hits":  # hammer the advisory index (entries under cfg["key"])
        from dsa_aot.cache.store import ArtifactStore

        store = ArtifactStore(os.environ["DSA_AOT_CACHE_DIR"])
        entries = [store.lookup(cfg["key"], spec.arch, sid) for sid in cfg["spec_ids"]]
        for i in range(int(cfg["hits"])):
            store.record_hit(entries[i % len(entries)])
        out["hits"] = int(cfg["hits"])
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
