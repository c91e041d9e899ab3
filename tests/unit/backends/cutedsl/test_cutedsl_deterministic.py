"""The deterministic backward (``KernelSpec.deterministic``, ``deterministic=True``) on CPU.

Specs and ids, which backends and archs may build it, the build requests, a real sm_90a build
through the production path (every stage recorded as the deterministic variant, with the shard
and partial-sum tensors in its C ABI), the shard split, the loader refusing to end at the torch
reference, and the API's argument and setting. Numerics and bit-identity: tests/gpu.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from dsa_aot import settings
from dsa_aot.backends import BACKENDS
from dsa_aot.backends.cutedsl.build import BuildRequest, requests_for
from dsa_aot.backends.cutedsl.records import CuteExportRecord
from dsa_aot.build import build_and_publish
from dsa_aot.cache.store import ArtifactStore
from dsa_aot.identity import can_key_builds
from dsa_aot.loader import DeterminismUnavailableError, Loader
from dsa_aot.runners import deterministic_split
from dsa_aot.specs.models import KernelSpec
from dsa_aot.specs.toolchain import Toolchain
from dsa_aot.validate import InputError

DET = "bwd-sm_90a-d576-h128-compact-cutedsl-det"
_CANNOT_BUILD = can_key_builds(BACKENDS["cutedsl"], Toolchain.current())


def test_spec_id_round_trip_apart_from_the_fast_variant():
    """The id (the artifact's folder under its key) and the canonical JSON tell the two apart."""
    spec = KernelSpec.from_id(DET)
    assert spec.deterministic and spec.id == DET
    fast = spec.model_copy(update={"deterministic": False})
    assert fast.id == DET.removesuffix("-det") and KernelSpec.from_id(fast.id) == fast
    assert spec.canonical_json() != fast.canonical_json()


def test_only_the_backward_can_be_deterministic():
    with pytest.raises(ValidationError, match="applies to op='bwd' only"):
        KernelSpec(op="fwd", arch="sm_90a", d_qk=576, heads=64, layout="compact", backend="cutedsl",
                   deterministic=True)


@pytest.mark.parametrize("spec_id,fragment", [
    ("bwd-sm_90a-d576-h64-compact-tilelang-det", "backend tilelang has no deterministic bwd kernel for sm_90a"),
    ("bwd-sm_90a-d576-h64-compact-cudnn-k2048-det", "backend cudnn has no deterministic bwd kernel"),
    ("bwd-sm_100a-d576-h64-compact-cutedsl-det", "no deterministic bwd kernel for sm_100a .it has for sm_90a."),
])
def test_backends_refuse_what_they_cannot_build(spec_id, fragment):
    spec = KernelSpec.from_id(spec_id)
    with pytest.raises(ValueError, match=fragment):
        BACKENDS[spec.backend].check_spec(spec)
    assert BACKENDS[spec.backend].unsupported_reason(spec, None)


def test_requests_carry_the_variant_to_every_stage():
    spec = KernelSpec.from_id(DET)
    requests = requests_for(spec, BACKENDS["cutedsl"].stages["bwd"])
    assert [r.kernel for r in requests] == ["bwd_preprocess", "bwd_main", "bwd_postprocess"]
    assert all(r.deterministic and r.compile_params["deterministic"] for r in requests)
    assert requests[1].compile_params["impl"] == "wgmma"
    fast = requests_for(spec.model_copy(update={"deterministic": False}), BACKENDS["cutedsl"].stages["bwd"])
    assert not any(r.deterministic or "deterministic" in r.compile_params for r in fast)
    with pytest.raises(ValueError, match="deterministic bwd_main is the wgmma flavour"):
        requests_for(KernelSpec(**{**spec.model_dump(), "tile": {"flavour": "mma"}}), ("bwd_main",))
    with pytest.raises(ValidationError, match="backward stages only"):
        BuildRequest(kernel="fwd", arch="sm_90a", d_qk=576, heads=64, layout="compact", deterministic=True)
    with pytest.raises(ValidationError, match="built for sm_90a, not sm_100a"):
        BuildRequest(kernel="bwd_postprocess", arch="sm_100a", deterministic=True)


@pytest.mark.skipif(_CANNOT_BUILD is not None, reason=f"cannot build: {_CANNOT_BUILD}")
def test_build_records_the_deterministic_abi(tmp_path):
    store = ArtifactStore(tmp_path)
    done = build_and_publish(store, KernelSpec.from_id(DET), Toolchain.current())
    assert done.status == "built", done
    records = {st.name: CuteExportRecord.model_validate(st.record) for st in done.manifest.stages}
    assert all(r.deterministic and r.name.endswith("_det_static") for r in records.values())
    tensors = {name: {a.name: len(a.shape) for a in r.args if a.kind == "tensor"} for name, r in records.items()}
    assert tensors["bwd_preprocess"]["d_sink_acc"] == 2 and "d_sink" not in tensors["bwd_preprocess"]
    assert tensors["bwd_main"]["dkv_acc"] == 3  # [shards, s_kv, D]
    assert tensors["bwd_postprocess"] == {"dkv_acc": 3, "dkv": 2, "d_sink_acc": 2, "d_sink": 1}


def test_shard_split():
    # one shard per SM, rounded to whole head-block groups (H128: two CTAs per query row)
    assert deterministic_split(132, 4096, 8192, 64, 576, 8 << 30) == (132, 256)
    assert deterministic_split(132, 4096, 8192, 128, 576, 8 << 30) == (132, 256)
    assert deterministic_split(78, 4096, 8192, 128, 576, 8 << 30) == (78, 256)
    # no more CTAs than query rows; at least one group; the partial sums follow S_q
    assert deterministic_split(132, 5, 8192, 128, 576, 8 << 30) == (10, 1)
    assert deterministic_split(132, 100_000, 10, 16, 512, 8 << 30) == (132, 1024)
    # the workspace cap: 65536 rows x 576 x 4 B = 144 MiB a shard, 1 GiB -> 7 shards
    assert deterministic_split(132, 4096, 65536, 64, 576, 1 << 30) == (7, 256)
    assert deterministic_split(132, 4096, 65536, 128, 576, 1) == (2, 256)


@pytest.fixture
def empty_loader(tmp_path):
    with settings.scope(cache_dir=tmp_path, prebuilt_dirs=(), backends=None, jit=False,
                        require_prebuilt=False, remote_url=None):
        yield Loader()


def test_loader_never_serves_the_reference_for_a_deterministic_call(empty_loader):
    with pytest.raises(DeterminismUnavailableError, match=r"no deterministic bwd kernel for sm_90a .*"
                       r"bwd-sm_90a-d576-h64-noncompact-cutedsl-det: not prebuilt and DSA_AOT_JIT=0.*cutedsl"):
        empty_loader.resolve("bwd", "sm_90a", 576, 64, "noncompact", 0, deterministic=True)
    with pytest.raises(DeterminismUnavailableError, match="no backend builds one for sm_100a"):
        empty_loader.resolve("bwd", "sm_100a", 576, 64, "noncompact", 0, deterministic=True)
    with pytest.warns(RuntimeWarning, match="torch reference"):  # the fast mode may fall back
        _, res = empty_loader.resolve("bwd", "sm_90a", 576, 64, "noncompact", 0)
    assert res.source == "reference"


def _cpu_inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn((3, 16, 512), generator=g).bfloat16()
    kv = torch.randn((40, 512), generator=g).bfloat16()
    idx = torch.randint(0, 40, (3, 8), generator=g, dtype=torch.int32)
    dout = torch.randn((3, 16, 512), generator=g).bfloat16()
    return q, kv, idx, dout


def test_api_argument_and_setting():
    import dsa_aot

    q, kv, idx, dout = _cpu_inputs()
    out, lse = dsa_aot.sparse_mla_fwd(q, kv, idx)
    fast = dsa_aot.sparse_mla_bwd(q, kv, out, dout, lse, idx)
    det = dsa_aot.sparse_mla_bwd(q, kv, out, dout, lse, idx, deterministic=True)  # CPU: the reference
    assert all(torch.equal(a, b) for a, b in zip(fast[:2], det[:2]))
    with pytest.raises(InputError, match="deterministic='yes'"):
        dsa_aot.sparse_mla_bwd(q, kv, out, dout, lse, idx, deterministic="yes")
    with settings.scope(deterministic=True):
        assert settings.get().deterministic
    leaf = q.clone().requires_grad_(True)
    o, _ = dsa_aot.sparse_mla(leaf, kv, idx, deterministic=True)
    o.backward(dout)
    assert torch.equal(leaf.grad, fast[0])


def test_settings_parse(monkeypatch):
    monkeypatch.setenv("DSA_AOT_DETERMINISTIC", "1")
    monkeypatch.setenv("DSA_AOT_DETERMINISTIC_WORKSPACE", "2G")
    parsed = settings.Settings.from_env()
    assert parsed.deterministic and parsed.deterministic_workspace_bytes == 2 << 30
    monkeypatch.setenv("DSA_AOT_DETERMINISTIC", "maybe")
    with pytest.raises(settings.SettingsError, match="DSA_AOT_DETERMINISTIC='maybe'"):
        settings.Settings.from_env()
