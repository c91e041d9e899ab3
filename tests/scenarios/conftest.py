"""Fixtures of the scenario tests: an isolated cache, a pinned toolchain, child processes."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

import _harness


@pytest.fixture(scope="session")
def toolchain_json() -> str:
    """The toolchain of this run, pinned for every child process (see _child.py)."""
    from dsa_aot.specs.toolchain import Toolchain

    return Toolchain.current().model_dump_json()


@dataclass
class Rig:
    """One test's cache root, events file and child-process environment."""

    root: Path
    events_path: Path
    toolchain_json: str

    def key(self, spec=None, tiny: bool = True) -> str:
        """The build key the children file ``spec`` (default ``_harness.spec()``) under: the
        counting backend's (tiny fwd kernel unless ``tiny=False``) under the pinned toolchain."""
        from dsa_aot.identity import build_identity
        from dsa_aot.specs.toolchain import Toolchain

        toolchain = Toolchain.model_validate_json(self.toolchain_json)
        return build_identity(_harness.make_backend(tiny=tiny), spec or _harness.spec(), toolchain).key()

    def env(self, **extra: str) -> dict[str, str]:
        return _harness.child_env(self.root, self.events_path, self.toolchain_json, **extra)

    def run(self, config: dict | None = None, timeout_s: float = 120.0, **env: str) -> _harness.ChildResult:
        return _harness.run_child(config or {}, self.env(**env), timeout_s)

    def builds(self) -> list[list[str]]:
        return _harness.events(self.events_path, "build")

    def loads(self) -> list[list[str]]:
        return _harness.events(self.events_path, "load")

    def store(self, **kw):
        from dsa_aot.cache.store import ArtifactStore

        return ArtifactStore(self.root, **kw)


@pytest.fixture
def rig(tmp_path, toolchain_json) -> Rig:
    return Rig(tmp_path / "cache", tmp_path / "events.log", toolchain_json)


@pytest.fixture(scope="session")
def features_json(tmp_path_factory) -> bytes:
    """This toolchain's probed features (probed once per session: ~10 s of TileLang/nvcc)."""
    from dsa_aot.specs.probes import load_or_probe

    path = tmp_path_factory.mktemp("features") / "features.json"
    load_or_probe(path, ["sm_90a", "sm_100a"])
    return path.read_bytes()


@dataclass
class InProcess:
    """An in-process loader rig: tiny kernel builds (counted), the real ``load``, a driver spy."""

    root: Path
    events_path: Path
    driver_calls: list
    features_json: bytes | None = None
    loaded: list | None = None  # CPU-checked loads (inproc_cpu)

    def builds(self) -> list[list[str]]:
        return _harness.events(self.events_path, "build")

    def store(self, root: Path | None = None, **kw):
        from dsa_aot.cache.store import ArtifactStore

        return ArtifactStore(root or self.root, **kw)

    def key(self, spec) -> str:
        """The build key of ``spec`` in this process (the installed counting backend)."""
        return _harness.key_of(spec)

    def publish(self, spec, root: Path | None = None):
        """Build ``spec`` for real and publish it through the loader's JIT path
        (:func:`dsa_aot.build.build_and_publish`); returns the entry."""
        from dsa_aot.build import build_and_publish
        from dsa_aot.specs.toolchain import Toolchain

        store = self.store(root)
        try:
            done = build_and_publish(store, spec, Toolchain.current())
        finally:
            if store._index is not None:  # close the index now, not whenever GC gets to it
                store._index.close()
        assert done.status == "built", (done.status, done.error)
        return done.entry

    def seed_features(self, root: Path | None = None) -> None:
        """Put the session's probe results where the loader looks for them."""
        from dsa_aot.specs.toolchain import Toolchain

        path = self.store(root).features_path(Toolchain.current().fingerprint)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.features_json)


def _in_process(tmp_path, monkeypatch) -> InProcess:
    from dsa_aot.backends.tilelang import launch

    events = tmp_path / "events.log"
    monkeypatch.setenv("REL_EVENTS", str(events))
    driver: list = []
    real_libcuda = launch._libcuda

    def libcuda_spy():
        driver.append("libcuda")  # CubinKernel is about to hand bytes to the driver
        return real_libcuda()

    monkeypatch.setattr(launch, "_libcuda", libcuda_spy)
    return InProcess(tmp_path / "cache", events, driver)


@pytest.fixture
def inproc(tmp_path, monkeypatch, scoped_settings, features_json):
    """Real ``TileLangBackend.load`` (reaches the driver); cache root set in the settings."""
    rig = _in_process(tmp_path, monkeypatch)
    rig.features_json = features_json
    scoped_settings(DSA_AOT_CACHE_DIR=str(rig.root))
    undo = _harness.install(tiny=True, cpu_load=False)
    yield rig
    undo()


@pytest.fixture
def inproc_cpu(tmp_path, monkeypatch, scoped_settings, features_json):
    """Like ``inproc`` but loads are the CPU check (recorded in ``rig.loaded``)."""
    rig = _in_process(tmp_path, monkeypatch)
    rig.features_json = features_json
    rig.loaded = []
    scoped_settings(DSA_AOT_CACHE_DIR=str(rig.root))
    undo = _harness.install(rig.loaded, tiny=True, cpu_load=True)
    yield rig
    undo()


@pytest.fixture
def scoped_settings(monkeypatch):
    """Set DSA_AOT_* variables for one test (settings re-read; restored afterwards)."""
    from dsa_aot import settings

    for name in ("DSA_AOT_CACHE_DIR", "DSA_AOT_PREBUILT_DIR", "DSA_AOT_REQUIRE_PREBUILT", "DSA_AOT_JIT",
                 "DSA_AOT_ALLOW_SHARED_CACHE", "DSA_AOT_REMOTE_URL", "DSA_AOT_REMOTE_WRITE", "DSA_AOT_SIGNING_KEY",
                 "DSA_AOT_TRUSTED_KEYS", "DSA_AOT_BACKENDS"):
        monkeypatch.delenv(name, raising=False)

    def apply(**env: str):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return settings.reload()

    yield apply
    monkeypatch.undo()
    settings.reload()


@pytest.fixture
def redis_server(tmp_path):
    """A real ``redis-server`` on a free loopback port (killed afterwards)."""
    import _redis

    server = _redis.RedisServer(tmp_path / "redis")
    yield server
    server.kill()


def _try(cmd: list[str]) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


@pytest.fixture
def mounts():
    """Mount helpers (tmpfs, read-only bind); skips where mounting is not permitted."""
    done: list[Path] = []

    class M:
        @staticmethod
        def tmpfs(path: Path, size: str) -> Path:
            path.mkdir(parents=True, exist_ok=True)
            if shutil.which("mount") is None or not _try(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]):
                pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN)")
            done.append(path)
            return path

        @staticmethod
        def read_only_bind(src: Path, dst: Path) -> Path:
            dst.mkdir(parents=True, exist_ok=True)
            if shutil.which("mount") is None or not _try(["mount", "--bind", str(src), str(dst)]):
                pytest.skip("cannot bind-mount here (needs CAP_SYS_ADMIN)")
            done.append(dst)
            if not _try(["mount", "-o", "remount,bind,ro", str(dst)]):
                pytest.skip("cannot remount read-only here")
            return dst

    yield M
    for path in reversed(done):
        if not _try(["umount", str(path)]):
            _try(["umount", "-l", str(path)])
