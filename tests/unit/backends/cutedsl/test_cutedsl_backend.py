"""The ``cutedsl`` backend: the CuTe DSL forward, and the backward's three CuTe DSL stages.

CPU: real builds for sm_90a and sm_100a through :func:`dsa_aot.build.build_and_publish`; the
published manifest (formats, records, the isfinite choice); a forced ``use_isfinite=False``
build; the backend's load refusing stages it cannot run; ``dsa-aot prebuild`` of a cutedsl spec
(built, then cached; skipped when the DSL is probed missing); a fresh process loading the stored
artifact without ``cutlass``, as far as CUDA.
GPU (``-m gpu``): the public API with ``DSA_AOT_BACKENDS=cutedsl,tilelang`` against the reference.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import cli
from pydantic import ValidationError

from dsa_aot import settings
from dsa_aot.artifact import ArtifactManifest
from dsa_aot.backends import BACKENDS, BuildError
from dsa_aot.backends.base import STAGE_PARAMS, Built
from dsa_aot.backends.cutedsl.records import FWD_DEFAULT_IMPL, CuteExportRecord, bwd_main_default_impl
from dsa_aot.build import Published, build_and_publish, manifest_for
from dsa_aot.cache.store import ArtifactStore, CorruptArtifact
from dsa_aot.identity import build_identity, can_key_builds
from dsa_aot.specs.catalog import load_catalog
from dsa_aot.specs.models import KernelSpec
from dsa_aot.specs.probes import Features
from dsa_aot.specs.toolchain import Toolchain

SPECS = {"sm_90a": "bwd-sm_90a-d576-h64-compact-cutedsl",
         "sm_100a": "bwd-sm_100a-d512-h16-noncompact-cutedsl"}
PREBUILT = "bwd-sm_90a-d576-h64-compact-cutedsl"
STAGES = [("bwd_preprocess", "cutedsl_so"), ("bwd_main", "cutedsl_so"), ("bwd_postprocess", "cutedsl_so")]
#: A cubin stage as the TileLang backend writes it (a manifest may mix formats).
CUBIN_STAGE = {"format": "cubin", "name": "bwd_main", "file": "bwd_main.cubin",
               "record": {"entry": "k", "params": [], "grid": ["1", "1", "1"], "block": [128, 1, 1]}}
_CUDA = torch.cuda.is_available()
_CANNOT_BUILD = can_key_builds(BACKENDS["cutedsl"], Toolchain.current())
needs_build = pytest.mark.skipif(_CANNOT_BUILD is not None, reason=f"cannot build: {_CANNOT_BUILD}")


def _key(spec_id: str) -> str:
    """The spec's build key in this process (its entry's first path component)."""
    spec = KernelSpec.from_id(spec_id)
    return build_identity(BACKENDS[spec.backend], spec, Toolchain.current()).key()


def _record(stage) -> CuteExportRecord:
    assert stage.format == "cutedsl_so"
    return CuteExportRecord.model_validate(stage.record)


def _needed(lib: bytes) -> bool:
    """Whether the shared library names the CuTe DSL runtime it must not need."""
    return b"libcute_dsl_runtime" in lib


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Both specs built and published by the production build path; plus a forced
    ``use_isfinite=False`` build of the sm_90a spec by the backend."""
    if _CANNOT_BUILD is not None:
        pytest.skip(f"cannot build: {_CANNOT_BUILD}")
    toolchain = Toolchain.current()
    store = ArtifactStore(tmp_path_factory.mktemp("cutedsl-store"))
    done: dict[str, Published] = {}
    for spec_id in SPECS.values():
        done[spec_id] = build_and_publish(store, KernelSpec.from_id(spec_id), toolchain)
        assert done[spec_id].status == "built", done[spec_id]
    spec = KernelSpec.from_id(SPECS["sm_90a"])
    forced = BACKENDS["cutedsl"].build(spec, use_isfinite=False)
    return {"store": store, "done": done, "forced": forced,
            "forced_manifest": manifest_for(BACKENDS["cutedsl"], spec, toolchain, forced)}


def _files(built: dict, spec_id: str) -> dict[str, bytes]:
    """The stored (sha256-checked) files of a published spec."""
    store: ArtifactStore = built["store"]
    done: Published = built["done"][spec_id]
    return {name: store.read_file(done.entry, name) for name in done.entry.meta.files}


@needs_build
@pytest.mark.parametrize("arch", sorted(SPECS))
def test_published_manifest(built: dict, arch: str) -> None:
    from dsa_aot.backends.cutedsl.build import probe_isfinite

    store: ArtifactStore = built["store"]
    spec_id = SPECS[arch]
    entry = store.lookup(_key(spec_id), arch, spec_id)
    assert entry is not None and store.verify(entry) == []
    manifest = ArtifactManifest.model_validate(entry.meta.payload)
    assert manifest == built["done"][spec_id].manifest
    assert manifest.spec.id == spec_id and manifest.spec.backend == "cutedsl"
    assert manifest.key == _key(spec_id) == manifest.build.key()
    assert (manifest.build.backend, manifest.runtime.backend, manifest.runtime.arch) == ("cutedsl", "cutedsl", arch)
    assert [(s.name, s.format) for s in manifest.stages] == STAGES
    isfinite = probe_isfinite()  # what this DSL has: 4.8.1 does
    assert manifest.features == {"cute_math_isfinite": isfinite}
    assert sorted(entry.meta.files) == ["bwd_main.so", "bwd_postprocess.so", "bwd_preprocess.so"]
    for stage in manifest.stages:
        data = store.read_file(entry, stage.file)
        rec = _record(stage)
        assert stage.file == f"{stage.name}.so"
        assert (rec.kernel, rec.arch, rec.link) == (stage.name, arch, "static_cudart")
        assert rec.runtime_libs == () and rec.cudart_version and rec.cudart_version >= 12000
        assert hashlib.sha256(data).hexdigest() == rec.library_sha256
        assert data[:4] == b"\x7fELF" and not _needed(data)  # self-contained
        assert rec.symbols.entry.encode() in data
        tensors = [a.name for a in rec.args if a.kind == "tensor"]
        assert set(tensors) <= STAGE_PARAMS[stage.name]
        assert rec.use_isfinite == (isfinite if stage.name == "bwd_preprocess" else None)
    assert [a.name for a in _record(manifest.stage("bwd_preprocess")).args] == [
        "out", "dout", "lse", "attn_sink", "delta", "lse_sink", "d_sink", "stream"]
    assert [a.name for a in _record(manifest.stage("bwd_postprocess")).args] == ["dkv_acc", "dkv", "stream"]
    main = _record(manifest.stage("bwd_main"))
    assert [a.name for a in main.args] == [
        "q", "kv", "dout", "topk_idxs", *(["topk_length"] if manifest.spec.layout == "compact" else []),
        "lse_sink", "delta", "dq", "dkv_acc", "softmax_scale", "stream"]
    assert (main.d_qk, main.heads, main.layout, main.impl) == (
        manifest.spec.d_qk, manifest.spec.heads, manifest.spec.layout,
        bwd_main_default_impl(arch, manifest.spec.heads))


@needs_build
def test_forced_infcmp_build_differs(built: dict) -> None:
    auto = _files(built, SPECS["sm_90a"])
    forced: Built = built["forced"]
    assert forced.features == {"cute_math_isfinite": False}
    assert built["forced_manifest"].features == {"cute_math_isfinite": False}
    pre = next(s for s in forced.stages if s.name == "bwd_preprocess")
    assert _record(pre).use_isfinite is False
    assert forced.files["bwd_preprocess.so"] != auto["bwd_preprocess.so"]
    # the choice touches the preprocess only
    assert forced.files["bwd_postprocess.so"] == auto["bwd_postprocess.so"]
    assert forced.files["bwd_main.so"] == auto["bwd_main.so"]


@needs_build
def test_manifest_stage_validation(built: dict) -> None:
    """The manifest checks stage shape and uniqueness; a stage's record is the backend's."""
    payload = built["done"][SPECS["sm_90a"]].manifest.model_dump(mode="json")
    assert ArtifactManifest.model_validate(payload).stages[0].format == "cutedsl_so"

    def broken(index: int, **change: object) -> dict:
        data = json.loads(json.dumps(payload))
        data["stages"][index].update(change)
        return data

    def replaced(index: int, stage: dict) -> dict:
        data = json.loads(json.dumps(payload))
        data["stages"][index] = stage
        return data

    mixed = ArtifactManifest.model_validate(replaced(1, CUBIN_STAGE))  # a cubin among libraries
    assert [s.format for s in mixed.stages] == ["cutedsl_so", "cubin", "cutedsl_so"]
    pre = payload["stages"][0]
    for bad, fragment in [
            (broken(0, launch=CUBIN_STAGE["record"]), "launch"),   # a field a stage does not have
            (broken(2, file=pre["file"]), "unique"),
            (broken(2, name=pre["name"]), "unique")]:
        with pytest.raises(ValidationError, match=fragment):
            ArtifactManifest.model_validate(bad)


@needs_build
def test_load_refuses_stages_it_cannot_run(built: dict) -> None:
    """The backend's load validates each stage's format and record before opening anything
    that could reach CUDA."""
    manifest: ArtifactManifest = built["done"][SPECS["sm_90a"]].manifest
    files = _files(built, SPECS["sm_90a"])
    payload = manifest.model_dump(mode="json")

    def variant(index: int, **change: object) -> ArtifactManifest:
        data = json.loads(json.dumps(payload))
        data["stages"][index].update(change)
        return ArtifactManifest.model_validate(data)

    load = BACKENDS["cutedsl"].load
    with pytest.raises(BuildError, match="stage bwd_main is cubin, not a CuTe DSL library"):
        load(variant(1, format="cubin", file="bwd_main.cubin"), files.__getitem__, 0)
    main_record = payload["stages"][1]["record"]
    with pytest.raises(BuildError, match="stage bwd_preprocess holds a record of bwd_main"):
        load(variant(0, record=main_record), files.__getitem__, 0)
    with pytest.raises(ValidationError):
        load(variant(0, record=CUBIN_STAGE["record"]), files.__getitem__, 0)  # a LaunchRecord


@needs_build
def test_library_must_match_its_record(built: dict) -> None:
    manifest: ArtifactManifest = built["done"][SPECS["sm_100a"]].manifest
    files = _files(built, SPECS["sm_100a"])
    pre = manifest.stage("bwd_preprocess")
    lying = manifest.model_copy(update={"stages": (
        pre.model_copy(update={"record": {**pre.record, "library_sha256": "0" * 64}}),
        *manifest.stages[1:])})
    with pytest.raises(CorruptArtifact, match="differs from its record"):
        BACKENDS["cutedsl"].load(lying, files.__getitem__, 0)


FWD_SPECS = {"sm_90a": "fwd-sm_90a-d576-h64-compact-cutedsl",
             "sm_100a": "fwd-sm_100a-d512-h16-noncompact-cutedsl"}


@pytest.fixture(scope="module")
def built_fwd(tmp_path_factory: pytest.TempPathFactory) -> ArtifactStore:
    """The CuTe DSL forward of both archs, built and published by the production build path."""
    if _CANNOT_BUILD is not None:
        pytest.skip(f"cannot build: {_CANNOT_BUILD}")
    store = ArtifactStore(tmp_path_factory.mktemp("cutedsl-fwd-store"))
    for spec_id in FWD_SPECS.values():
        assert build_and_publish(store, KernelSpec.from_id(spec_id), Toolchain.current()).status == "built"
    return store


@needs_build
@pytest.mark.parametrize("arch", sorted(FWD_SPECS))
def test_forward_manifest(built_fwd: ArtifactStore, arch: str) -> None:
    store = built_fwd
    entry = store.lookup(_key(FWD_SPECS[arch]), arch, FWD_SPECS[arch])
    assert entry is not None and store.verify(entry) == []
    manifest = ArtifactManifest.model_validate(entry.meta.payload)
    spec = manifest.spec
    assert [(s.name, s.format) for s in manifest.stages] == [("fwd", "cutedsl_so")]
    assert sorted(entry.meta.files) == ["fwd.so"]
    rec = _record(manifest.stage("fwd"))
    assert (rec.kernel, rec.arch, rec.d_qk, rec.heads, rec.layout) == ("fwd", arch, spec.d_qk, spec.heads, spec.layout)
    assert rec.impl == FWD_DEFAULT_IMPL[arch] and rec.link == "static_cudart"
    tensors = [a.name for a in rec.args if a.kind == "tensor"]
    assert tensors == ["q", "kv", "topk_idxs", *(["topk_length"] if spec.layout == "compact" else []),
                       "attn_sink", "out", "lse"]
    scalars = [("softmax_scale", "float32")]
    if rec.impl == "wgmma_split":  # persistent: its grid is sized by the GPU's SM count
        scalars.append(("num_sms", "int32"))
    assert [(a.name, a.dtype) for a in rec.args if a.kind == "scalar"] == scalars
    data = store.read_file(entry, "fwd.so")
    assert data[:4] == b"\x7fELF" and not _needed(data) and hashlib.sha256(data).hexdigest() == rec.library_sha256


def _features(**change: object) -> Features:
    base = dict(archs=("sm_100a", "sm_90a"), tilelang_importable=True, cutlass_dsl_importable=True,
                cute_math_isfinite=True, tilelang_bool_fragment_ok={"sm_90a": True, "sm_100a": False},
                nvcc_version="13.0.88", nvcc_archs={"sm_90a": True, "sm_100a": True})
    return Features(**(base | change))


def test_unsupported_reasons() -> None:
    backend = BACKENDS["cutedsl"]
    spec = KernelSpec.from_id("bwd-sm_100a-d512-h16-compact-cutedsl")
    assert backend.implements("bwd") and backend.implements("fwd")
    assert backend.unsupported_reason(spec, _features()) is None
    assert backend.unsupported_reason(spec, None) is None
    fwd = KernelSpec(op="fwd", arch="sm_100a", d_qk=576, heads=64, layout="compact", backend="cutedsl")
    # the forward is CuTe DSL only: neither tilelang nor nvcc is involved
    assert backend.unsupported_reason(fwd, _features(tilelang_importable=False,
                                                     nvcc_archs={"sm_90a": True, "sm_100a": False})) is None
    missing = _features(cutlass_dsl_importable=False, cute_math_isfinite=None,
                        errors={"cutlass_dsl_importable": "ModuleNotFoundError: No module named 'cutlass'"})
    assert backend.unsupported_reason(spec, missing) == (
        "the CuTe DSL is not importable (ModuleNotFoundError: No module named 'cutlass')")
    # every stage is CuTe DSL: TileLang and nvcc are not involved
    assert backend.unsupported_reason(spec, _features(tilelang_importable=False)) is None
    old_nvcc = _features(nvcc_archs={"sm_90a": True, "sm_100a": False})
    assert backend.unsupported_reason(spec, old_nvcc) is None
    tl_spec = spec.model_copy(update={"backend": "tilelang"})
    assert BACKENDS["tilelang"].unsupported_reason(tl_spec, old_nvcc) == (
        "nvcc does not accept sm_100a (accepts sm_90a)")


def test_backends_setting_overrides_the_ranking(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsa_aot.loader import Loader

    monkeypatch.delenv("DSA_AOT_BACKENDS", raising=False)
    with settings.scope(backends=None):
        assert Loader().ranking("bwd") == ["cudnn", "cutedsl", "tilelang"]  # the catalog's
        assert Loader().ranking("fwd") == ["cutedsl", "tilelang"]
    monkeypatch.setenv("DSA_AOT_BACKENDS", "tilelang, cutedsl")
    cfg = settings.Settings.from_env()
    assert cfg.backends == ("tilelang", "cutedsl")
    with settings.scope(backends=cfg.backends):
        assert Loader().ranking("bwd") == ["tilelang", "cutedsl"]
    monkeypatch.setenv("DSA_AOT_BACKENDS", "cutedsl,triton")
    with pytest.raises(settings.SettingsError, match="DSA_AOT_BACKENDS=.*unknown backend 'triton'"):
        settings.Settings.from_env()


# ---------------------------------------------------------------------------------------------
# prebuild and a fresh runtime process
# ---------------------------------------------------------------------------------------------

def _count(stdout: str, status: str) -> int:
    for line in stdout.splitlines():
        parts = line.split()
        if parts[:1] == [status] and len(parts) >= 2:
            return int(parts[1])
    raise AssertionError(f"no {status!r} line in\n{stdout}")


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if _CANNOT_BUILD is not None:
        pytest.skip(f"cannot build: {_CANNOT_BUILD}")
    root = tmp_path_factory.mktemp("cutedsl-prebuilt")
    proc = cli("prebuild", "-q", "--only", PREBUILT, root=root)
    assert (_count(proc.stdout, "built"), _count(proc.stdout, "total")) == (1, 1), proc.stdout
    return root


@needs_build
def test_prebuild_then_cached(prebuilt: Path) -> None:
    entry = ArtifactStore(prebuilt).lookup(_key(PREBUILT), "sm_90a", PREBUILT)
    assert entry is not None
    manifest = ArtifactManifest.model_validate(entry.meta.payload)
    assert [(s.name, s.format) for s in manifest.stages] == STAGES
    proc = cli("prebuild", "-q", "--only", PREBUILT, root=prebuilt)
    assert (_count(proc.stdout, "cached"), _count(proc.stdout, "built")) == (1, 0), proc.stdout
    states = json.loads(cli("status", "--json", root=prebuilt).stdout)
    assert states[PREBUILT] == "cached" and len(states) == len(load_catalog().specs())


def test_prebuild_skips_when_the_dsl_is_probed_missing(tmp_path: Path) -> None:
    """A features file saying the DSL cannot be imported turns the spec into skipped-by-feature."""
    fp = Toolchain.current().fingerprint
    missing = _features(toolchain=fp, cutlass_dsl_importable=False, cute_math_isfinite=None,
                        errors={"cutlass_dsl_importable": "ModuleNotFoundError: No module named 'cutlass'"})
    path = ArtifactStore(tmp_path).features_path(fp)
    path.parent.mkdir(parents=True)
    path.write_text(missing.model_dump_json())
    proc = cli("prebuild", "-q", "--only", "bwd-sm_90a-d512-h16-compact-cutedsl", root=tmp_path)
    assert _count(proc.stdout, "skipped-by-feature") == 1 and _count(proc.stdout, "built") == 0
    assert "the CuTe DSL is not importable" in proc.stdout


_LOAD_SCRIPT = r"""
import json, sys
from dsa_aot import backends
from dsa_aot.artifact import ArtifactManifest
from dsa_aot.backends.cutedsl import runtime
from dsa_aot.cache.store import ArtifactStore

root, key, arch, spec_id = sys.argv[1:]
store = ArtifactStore(root, read_only=True)
entry = store.lookup(key, arch, spec_id)
manifest = ArtifactManifest.model_validate(entry.meta.payload)
report = {}
try:
    backends.get("cutedsl").load(manifest, lambda name: store.read_file(entry, name), 0)
    report["load"] = "ok"
except Exception as exc:
    report["load"] = f"{type(exc).__name__}: {exc}"
    report["load_is_cuda_error"] = isinstance(exc, backends.CudaError)
report["libraries"] = sorted(runtime._CUTE_LIBS)
with open("/proc/self/maps") as maps:
    report["memfd_mapped"] = sorted({line.split("memfd:", 1)[1].split()[0] for line in maps
                                     if "memfd:dsa-aot" in line})
report["prepare"] = []
for kernel in runtime._CUTE_LIBS.values():
    try:
        kernel.prepare(0)
        report["prepare"].append("ok")
    except Exception as exc:
        report["prepare"].append(f"{type(exc).__name__}: {exc}")
report["modules"] = sorted(m for m in ("cutlass", "tilelang", "tvm", "tvm_ffi") if m in sys.modules)
print(json.dumps(report))
"""


@needs_build
def test_fresh_process_loads_stored_artifact_without_cutlass(prebuilt: Path) -> None:
    key = _key(PREBUILT)
    manifest = ArtifactManifest.model_validate(ArtifactStore(prebuilt).lookup(key, "sm_90a", PREBUILT).meta.payload)
    proc = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, str(prebuilt), key, "sm_90a", PREBUILT],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["modules"] == []  # no compiler, no DSL
    cute = [_record(s) for s in manifest.stages]
    # every library was opened from the verified bytes, through sealed memfds
    assert report["libraries"] == sorted(r.library_sha256 for r in cute), report
    assert report["memfd_mapped"] == sorted(f"dsa-aot-{r.name}" for r in cute)
    if _CUDA:
        assert report["load"] == "ok" and report["prepare"] == ["ok"] * len(cute)
        return
    # then the first CUDA call fails, and says so (the static CUDA runtime finds no driver)
    assert report["load_is_cuda_error"] is True, report["load"]
    assert report["load"].startswith("CuteRuntimeError: ") and (
        "libcuda.so.1" in report["load"] or "CUDA error" in report["load"]), report["load"]
    for message in report["prepare"]:
        assert message.startswith("CuteRuntimeError: ") and "loading the cubin failed with CUDA error" in message


# ---------------------------------------------------------------------------------------------
# GPU: the public API on the cutedsl backend
# ---------------------------------------------------------------------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the kernel output"
    denom = b.norm()
    return float((a - b).norm() / denom) if denom > 0 else float((a - b).norm())


@pytest.fixture
def cutedsl_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``DSA_AOT_BACKENDS=cutedsl,tilelang``; prebuilt roots kept, JIT into a private cache."""
    monkeypatch.setenv("DSA_AOT_BACKENDS", "cutedsl,tilelang")
    monkeypatch.setenv("DSA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("DSA_AOT_REQUIRE_PREBUILT", raising=False)
    settings.reload()
    yield
    monkeypatch.undo()
    settings.reload()


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d_qk,heads,layout", [(576, 64, "compact"), (512, 128, "noncompact"),
                                               (576, 16, "noncompact")])
def test_public_fwd_on_cutedsl_matches_reference(cutedsl_first, d_qk: int, heads: int, layout: str) -> None:
    """The loader picks the CuTe DSL forward (prebuilt or JIT) and the public API matches the
    reference, edge cases included, from NaN-poisoned memory."""
    import dsa_aot
    from dsa_aot.kernels.reference import sparse_mla_fwd_ref
    from dsa_aot.loader import arch_of_capability, get_loader

    arch = arch_of_capability(*torch.cuda.get_device_capability())
    _, resolution = get_loader().resolve("fwd", arch, d_qk, heads, layout, torch.cuda.current_device())
    assert resolution.spec.backend == "cutedsl" and resolution.source != "reference", resolution
    sinks = [math.inf, -math.inf, 2.4e38, -2.4e38, 0.5, -1.0, 3.0, 0.0]
    for s_q, s_kv, k in [(1, 95, 128), (62, 300, 333), (256, 4096, 2048)]:
        g = torch.Generator(device="cuda").manual_seed(s_q + heads)
        q = torch.randn((s_q, heads, d_qk), generator=g, device="cuda").bfloat16()
        kv = torch.randn((s_kv, d_qk), generator=g, device="cuda").bfloat16()
        idx = torch.randint(0, s_kv, (s_q, k), generator=g, device="cuda", dtype=torch.int32)
        idx[torch.rand((s_q, k), generator=g, device="cuda") < 0.1] = -1
        idx[:, -1] = s_kv                                          # out of range
        idx[:, 0] = -2**31
        if s_q > 4:
            idx[2] = -1                                            # a row with no valid slot
            q[3] *= -40.0 / d_qk ** 0.5                            # very negative scores
        length = (torch.randint(-2, k + 3, (s_q,), generator=g, device="cuda", dtype=torch.int32)
                  if layout == "compact" else None)
        sink = torch.tensor([sinks[h % len(sinks)] for h in range(heads)], device="cuda")
        poison = torch.full((s_q * heads * 1024,), math.nan, device="cuda")
        del poison                                                 # outputs land on NaN-filled blocks
        out, lse = dsa_aot.sparse_mla_fwd(q, kv, idx, topk_length=length, attn_sink=sink)
        torch.cuda.synchronize()
        ref_out, ref_lse = sparse_mla_fwd_ref(q, kv, idx, length, sink, compute_dtype=torch.float64)
        assert _rel(out, ref_out) <= 1e-2
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite) and finite.any()
        assert float((lse[finite].double() - ref_lse[finite]).abs().max()) <= 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d_qk,heads,layout", [(576, 64, "compact"), (512, 16, "noncompact")])
def test_public_bwd_on_cutedsl_matches_reference(cutedsl_first, d_qk: int, heads: int, layout: str) -> None:
    import dsa_aot
    from dsa_aot.kernels.reference import sparse_mla_bwd_ref, sparse_mla_fwd_ref
    from dsa_aot.loader import arch_of_capability, get_loader

    arch = arch_of_capability(*torch.cuda.get_device_capability())
    _, resolution = get_loader().resolve("bwd", arch, d_qk, heads, layout, torch.cuda.current_device())
    assert resolution.spec.backend == "cutedsl" and resolution.source != "reference", resolution
    sinks = [math.inf, -math.inf, 2.4e38, -2.4e38, 0.5, -1.0, 3.0, 0.0]
    for s_q, s_kv, k in [(1, 95, 128), (61, 300, 200), (512, 4096, 2048)]:
        g = torch.Generator(device="cuda").manual_seed(s_q)
        q = torch.randn((s_q, heads, d_qk), generator=g, device="cuda").bfloat16()
        kv = torch.randn((s_kv, d_qk), generator=g, device="cuda").bfloat16()
        idx = torch.randint(0, s_kv, (s_q, k), generator=g, device="cuda", dtype=torch.int32)
        idx[torch.rand((s_q, k), generator=g, device="cuda") < 0.1] = -1
        idx[:, -1] = s_kv                                          # out of range
        if s_q > 4:
            idx[2] = -1                                            # a row with no valid slot
        length = (torch.randint(-2, k + 3, (s_q,), generator=g, device="cuda", dtype=torch.int32)
                  if layout == "compact" else None)
        sink = torch.tensor([sinks[h % len(sinks)] for h in range(heads)], device="cuda")
        dout = torch.randn((s_q, heads, 512), generator=g, device="cuda").bfloat16()
        out, lse = sparse_mla_fwd_ref(q, kv, idx, length, sink, compute_dtype=torch.float32)
        out = out.bfloat16()
        blocks = [torch.full(tuple(q.shape), math.nan, device="cuda"),
                  torch.full(tuple(kv.shape), math.nan, device="cuda")]  # poison freed blocks
        del blocks
        dq, dkv, d_sink = dsa_aot.sparse_mla_bwd(q, kv, out, dout, lse, idx, topk_length=length,
                                                 attn_sink=sink)
        torch.cuda.synchronize()
        rq, rkv, rsink = sparse_mla_bwd_ref(q, kv, out, dout, lse, idx, length, sink,
                                            compute_dtype=torch.float32)
        assert _rel(dq, rq) <= 1e-2 and _rel(dkv, rkv) <= 1e-2
        assert _rel(d_sink, rsink) <= 1e-2
