"""The ``cudnn`` backend: the cuDNN frontend's DSA kernels compiled ahead of time (CPU).

Real builds through :func:`dsa_aot.build.build_and_publish` of one spec per kind (the sm_90a
backward, the sm_100a two-CTA D576 backward with its flat workspaces, the sm_100a forward): the
manifest, the stage record, the C ABI, a self-contained library holding a cubin of the arch.
``dsa-aot prebuild`` of a cudnn spec (built, then cached); a fresh process loading it with no
compiler imported, as far as CUDA. Spec checks and ids; the top-k buckets (padding, bucket choice,
fallback) on fake kernels; the loader serving a backend by bucket.
"""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import cli, embedded_cubin

from dsa_aot import settings
from dsa_aot.artifact import ArtifactManifest
from dsa_aot.backends import BACKENDS
from dsa_aot.backends.cudnn.records import CudnnStageRecord, sm90_workspace_shapes, sm100_workspace_shapes
from dsa_aot.build import build_and_publish
from dsa_aot.cache.store import ArtifactStore
from dsa_aot.identity import build_identity, can_key_builds
from dsa_aot.runners import TopkBuckets, pad_topk
from dsa_aot.specs.catalog import load_catalog, load_topk_buckets
from dsa_aot.specs.models import KernelSpec
from dsa_aot.specs.toolchain import Toolchain

SPECS = ["bwd-sm_90a-d576-h64-compact-cudnn-k512", "bwd-sm_100a-d576-h128-noncompact-cudnn-k2048",
         "fwd-sm_100a-d576-h64-compact-cudnn"]
VARIANTS = {SPECS[0]: "sm90", SPECS[1]: "h128_d576_2cta_m64", SPECS[2]: "sm100_fwd"}
PREBUILT = "bwd-sm_90a-d512-h16-noncompact-cudnn-k1024"
_CANNOT_BUILD = can_key_builds(BACKENDS["cudnn"], Toolchain.current())
needs_build = pytest.mark.skipif(_CANNOT_BUILD is not None, reason=f"cannot build: {_CANNOT_BUILD}")


def _key(spec_id: str) -> str:
    spec = KernelSpec.from_id(spec_id)
    return build_identity(BACKENDS[spec.backend], spec, Toolchain.current()).key()


# --- specs, ids, catalog ----------------------------------------------------------------------

def test_spec_ids_carry_the_bucket_and_round_trip() -> None:
    spec = KernelSpec(op="bwd", arch="sm_90a", d_qk=576, heads=64, layout="compact", backend="cudnn", topk=2048)
    assert spec.id == "bwd-sm_90a-d576-h64-compact-cudnn-k2048"
    assert KernelSpec.from_id(spec.id) == spec
    ours = KernelSpec(op="bwd", arch="sm_90a", d_qk=576, heads=64, layout="compact", backend="cutedsl")
    assert ours.id == "bwd-sm_90a-d576-h64-compact-cutedsl" and ours.topk is None  # unchanged


@pytest.mark.parametrize("kwargs, fragment", [
    ({"op": "bwd", "backend": "cudnn"}, "name its bucket"),
    ({"op": "bwd", "backend": "cudnn", "topk": 500}, "multiples of 64"),
    ({"op": "fwd", "backend": "cudnn", "topk": 512}, "takes any top-k width"),
    ({"op": "fwd", "backend": "cudnn", "arch": "sm_90a"}, "SM100-only"),
    ({"op": "fwd", "backend": "cudnn", "heads": 16}, "H64 D512, H64 D576, H128 D512 only"),
    ({"op": "bwd", "backend": "cutedsl", "topk": 512}, "takes any top-k width"),
    ({"op": "bwd", "backend": "tilelang", "topk": 512}, "takes any top-k width"),
    ({"op": "bwd", "backend": "cudnn", "topk": 512, "tile": {"num_stages": 2}}, "fixed tiles"),
])
def test_check_spec_refuses_what_cannot_drive_the_build(kwargs: dict, fragment: str) -> None:
    fields = {"op": "bwd", "arch": "sm_100a", "d_qk": 576, "heads": 64, "layout": "compact"} | kwargs
    spec = KernelSpec(**fields)
    with pytest.raises(ValueError, match=fragment):
        BACKENDS[spec.backend].check_spec(spec)


def test_catalog_ships_the_buckets_and_ranks_cudnn_first_for_bwd() -> None:
    specs = [s for s in load_catalog().specs() if s.backend == "cudnn"]
    bwd = [s for s in specs if s.op == "bwd"]
    assert len(bwd) == 2 * 2 * 4 * 2 * 3 and {s.topk for s in bwd} == {512, 1024, 2048}
    fwd = [s for s in specs if s.op == "fwd"]
    assert {(s.arch, s.heads, s.d_qk) for s in fwd} == {("sm_100a", 64, 512), ("sm_100a", 64, 576),
                                                         ("sm_100a", 128, 512)}
    assert all(s.topk is None for s in fwd) and len(fwd) == 6
    assert load_catalog().ranking["bwd"][0] == "cudnn"  # measured first on the H200 (bench/results)
    buckets = load_topk_buckets()
    assert buckets[("cudnn", "bwd", "sm_90a")] == buckets[("cudnn", "bwd", "sm_100a")] == [512, 1024, 2048]
    assert ("cudnn", "fwd", "sm_100a") not in buckets


def test_workspace_shapes() -> None:
    assert sm90_workspace_shapes(1, 95, 576, 64) == ((1, 64, 64), (1, 1, 128 * 576))
    assert sm90_workspace_shapes(4096, 8193, 512, 16) == ((1, 4096, 16), (1, 1, 8256 * 512))
    assert sm100_workspace_shapes(62, 95, 576, 128) == ((1, 128, 64, 2), (1, 1, 96, 576))


# --- top-k buckets ----------------------------------------------------------------------------

def test_pad_topk() -> None:
    idx = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    length = torch.tensor([5, 1], dtype=torch.int32)
    padded, lengths = pad_topk(idx, length, 8)
    assert padded.shape == (2, 8) and padded.dtype == torch.int32
    assert torch.equal(padded[:, :3], idx) and (padded[:, 3:] == -1).all()
    assert lengths.tolist() == [3, 1]  # the padded slots never count
    assert pad_topk(idx, None, 8)[1] is None
    same = pad_topk(idx, length, 3)
    assert same[0] is idx and same[1] is length


class _Fake:
    def __init__(self, name: str) -> None:
        self.name, self.calls = name, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.name


def test_topk_buckets_pick_the_narrowest_stored_width_then_jit_then_fallback() -> None:
    stored = {1024: _Fake("k1024"), 2048: _Fake("k2048")}
    jitted, asked = _Fake("jit512"), []
    fallback = _Fake("next backend")

    def jit(width):
        asked.append(width)
        return jitted

    buckets = TopkBuckets("bwd", [2048, 512, 1024], stored.get, jit, lambda: fallback)
    q = kv = out = dout = lse = sink = torch.zeros(1)

    def call(k: int, compact: bool = False):
        idx = torch.zeros((4, k), dtype=torch.int32)
        length = torch.full((4,), k + 7, dtype=torch.int32) if compact else None
        return buckets(q, kv, out, dout, lse, idx, length, sink, 0.5)

    assert call(700) == "k1024"                     # the narrowest stored bucket that fits
    args = stored[1024].calls[-1]
    assert args[5].shape == (4, 1024) and (args[5][:, 700:] == -1).all() and args[6] is None
    assert args[7] is sink and args[8] == 0.5
    assert call(1024, compact=True) == "k1024"      # exactly the width: passed as is
    assert stored[1024].calls[-1][6].tolist() == [1031] * 4
    assert call(100, compact=True) == "k1024"       # 512 is not stored: a wider stored one first
    assert stored[1024].calls[-1][6].tolist() == [100] * 4  # lengths clamped to K
    assert asked == []
    assert call(2049) == "next backend" and fallback.calls[-1][5].shape == (4, 2049)
    assert buckets.kernel_for(700) == (stored[1024], 1024)
    nothing = TopkBuckets("fwd", [512, 1024], {}.get, jit, lambda: fallback)
    assert nothing.kernel_for(300) == (jitted, 512) and asked == [512]  # JIT only when none is stored


def test_loader_serves_a_bucketed_backend(monkeypatch: pytest.MonkeyPatch, cache_root: Path) -> None:
    """With a cudnn bucket stored, the loader returns its buckets; a width above every bucket and
    an unstored one go to the next backend of the ranking."""
    from dsa_aot.loader import Loader

    loader = Loader()
    stored = {1024}
    monkeypatch.setattr(Loader, "find", lambda self, store, spec: spec.backend == "cudnn" and spec.topk in stored)
    monkeypatch.setattr(Loader, "try_load", lambda self, spec, device: (
        (_Fake(spec.id), "cache:x", "build key") if spec.backend != "cudnn" or spec.topk in stored else None))
    with settings.scope(backends=("cudnn", "cutedsl"), jit=False):
        kernel, res = loader.resolve("bwd", "sm_90a", 576, 64, "noncompact", 0)
        assert isinstance(kernel, TopkBuckets) and res.source == "buckets"
        assert res.spec.id == "bwd-sm_90a-d576-h64-noncompact-cudnn-k2048"  # the widest bucket
        assert kernel.kernel_for(512)[0].name == "bwd-sm_90a-d576-h64-noncompact-cudnn-k1024"
        assert kernel.kernel_for(4096)[0].name == "bwd-sm_90a-d576-h64-noncompact-cutedsl"
        stored.clear()
        _, res = loader.resolve("bwd", "sm_90a", 576, 64, "noncompact", 0)  # nothing stored: next
        assert res.spec.backend == "cutedsl"


# --- real builds ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> ArtifactStore:
    if _CANNOT_BUILD is not None:
        pytest.skip(f"cannot build: {_CANNOT_BUILD}")
    store = ArtifactStore(tmp_path_factory.mktemp("cudnn-store"))
    for spec_id in SPECS:
        done = build_and_publish(store, KernelSpec.from_id(spec_id), Toolchain.current())
        assert done.status == "built", done
    return store


def _record(store: ArtifactStore, spec_id: str) -> tuple[ArtifactManifest, CudnnStageRecord, bytes]:
    spec = KernelSpec.from_id(spec_id)
    entry = store.lookup(_key(spec_id), spec.arch, spec_id)
    assert entry is not None and store.verify(entry) == []
    manifest = ArtifactManifest.model_validate(entry.meta.payload)
    (stage,) = manifest.stages
    return manifest, CudnnStageRecord.model_validate(stage.record), store.read_file(entry, stage.file)


@needs_build
@pytest.mark.parametrize("spec_id", SPECS)
def test_published_manifest_and_record(built: ArtifactStore, spec_id: str) -> None:
    from importlib.metadata import version

    manifest, rec, data = _record(built, spec_id)
    spec = manifest.spec
    stage = manifest.stages[0]
    assert (stage.name, stage.format, stage.file) == (("fwd", "cutedsl_so", "fwd.so") if spec.op == "fwd" else
                                                     ("bwd_main", "cutedsl_so", "bwd_main.so"))
    assert (manifest.build.backend, manifest.runtime.backend) == ("cudnn", "cudnn")
    assert {d.name for d in manifest.build.compilers} >= {"nvidia-cudnn-frontend", "nvidia-cutlass-dsl"}
    assert (rec.variant, rec.topk, rec.frontend_version) == (VARIANTS[spec_id], spec.topk,
                                                             version("nvidia-cudnn-frontend"))
    export = rec.export
    assert (export.arch, export.link, export.runtime_libs, export.d_qk, export.heads, export.layout) == (
        spec.arch, "static_cudart", (), spec.d_qk, spec.heads, spec.layout)
    assert hashlib.sha256(data).hexdigest() == export.library_sha256 and export.symbols.entry.encode() in data
    assert data[:4] == b"\x7fELF" and b"libcute_dsl_runtime" not in data  # self-contained
    flags, = struct.unpack_from("<I", embedded_cubin(data), 0x30)
    assert int(spec.arch[3:-1]) in (flags & 0xFF, (flags >> 8) & 0xFF)  # e_flags carry the SM
    names = [a.name for a in export.args]
    compact = ["topk_length"] if spec.layout == "compact" else []
    if spec.op == "fwd":
        assert names == ["q", "kv", "topk_idxs", "out", "max_logits", "lse", "attn_sink", *compact,
                         "softmax_scale", "stream"]
        return
    tensors = {a.name: a for a in export.args if a.kind == "tensor"}
    assert tensors["topk_idxs"].shape[-1].value == spec.topk  # the bucket is compiled in
    if spec.arch == "sm_90a":
        assert names == ["q", "kv", "out", "dout", "lse", "attn_sink", "topk_idxs", *compact, "dq", "d_sink",
                         "dpsum", "lse_log2", "dkv_acc", "dkv", "softmax_scale", "stream"]
        assert [d.value for d in tensors["q"].shape] == [1, None, spec.heads, spec.d_qk]  # batch=1 views
    else:
        assert names == ["q", "kv", "out", "dout", "lse", "attn_sink", "topk_idxs", *compact, "dq", "dkv",
                         "d_sink", "ws_lse", "ws_dkv", "softmax_scale", "stream"]
        assert tensors["ws_lse"].shape_ctype == "int64" and len(tensors["ws_lse"].shape) == 1  # flat bytes


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if _CANNOT_BUILD is not None:
        pytest.skip(f"cannot build: {_CANNOT_BUILD}")
    root = tmp_path_factory.mktemp("cudnn-prebuilt")
    proc = cli("prebuild", "-q", "--only", PREBUILT, root=root)
    assert "built                   1" in proc.stdout, proc.stdout
    return root


@needs_build
def test_prebuild_then_cached(prebuilt: Path) -> None:
    proc = cli("prebuild", "-q", "--only", PREBUILT, root=prebuilt)
    assert "cached                  1" in proc.stdout and "built                   0" in proc.stdout
    states = json.loads(cli("status", "--json", root=prebuilt).stdout)
    assert states[PREBUILT] == "cached"


_LOAD_SCRIPT = r"""
import json, sys
from dsa_aot import backends
from dsa_aot.artifact import ArtifactManifest
from dsa_aot.cache.store import ArtifactStore

root, key, arch, spec_id = sys.argv[1:]
store = ArtifactStore(root, read_only=True)
entry = store.lookup(key, arch, spec_id)
manifest = ArtifactManifest.model_validate(entry.meta.payload)
report = {}
try:
    backends.get("cudnn").load(manifest, lambda name: store.read_file(entry, name), 0)
    report["load"] = "ok"
except Exception as exc:
    report["load"] = f"{type(exc).__name__}: {exc}"
    report["load_is_cuda_error"] = isinstance(exc, backends.CudaError)
with open("/proc/self/maps") as maps:
    report["memfd_mapped"] = sorted({line.split("memfd:", 1)[1].split()[0] for line in maps
                                     if "memfd:dsa-aot" in line})
report["modules"] = sorted(m for m in ("cutlass", "cudnn", "tilelang", "tvm", "tvm_ffi") if m in sys.modules)
print(json.dumps(report))
"""


@needs_build
def test_fresh_process_loads_without_compilers(prebuilt: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, str(prebuilt), _key(PREBUILT), "sm_90a", PREBUILT],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["modules"] == []  # neither the frontend nor the DSL
    assert report["memfd_mapped"] == ["dsa-aot-cudnn_bwd_sm_90a_d512_h16_noncompact_k1024_static"]
    if torch.cuda.is_available():
        assert report["load"] == "ok"
    else:  # the first CUDA call fails, and says so
        assert report["load_is_cuda_error"] is True and report["load"].startswith("CuteRuntimeError: "), report


def test_a_frontend_without_a_kernel_family_skips_its_specs(tmp_path: Path) -> None:
    """A release that lacks the module of an (op, arch) (1.28 has no SM100 forward) makes those
    specs skipped-by-feature with the module named, not a failed build; read from its files."""
    import subprocess
    import sys
    import textwrap

    from dsa_aot.backends.cudnn import FRONTEND_MODULES, missing_frontend_module

    assert all(missing_frontend_module(op, arch) is None for op, arch in FRONTEND_MODULES)  # 1.32.0
    pkg = tmp_path / "cudnn"
    for rel in ("__init__.py", FRONTEND_MODULES[("bwd", "sm_90a")], FRONTEND_MODULES[("bwd", "sm_100a")]):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("raise ImportError('never imported')\n")
    code = textwrap.dedent("""
        import json, sys
        from dsa_aot.backends.cudnn import BACKEND, missing_frontend_module
        from dsa_aot.specs.models import KernelSpec
        fwd = KernelSpec.from_id("fwd-sm_100a-d576-h64-noncompact-cudnn")
        bwd = KernelSpec.from_id("bwd-sm_90a-d576-h64-noncompact-cudnn-k2048")
        print(json.dumps([BACKEND.unsupported_reason(fwd, None), BACKEND.unsupported_reason(bwd, None),
                          "cudnn" in sys.modules]))
    """)
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import json

    fwd_reason, bwd_reason, imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "has no cudnn.deepseek_sparse_attention.sparse_attention_forward._interface_sm100" in fwd_reason
    assert bwd_reason is None and imported is False
