"""The deterministic backward (``KernelSpec.deterministic``, ``deterministic=True``) on CPU.

Specs and ids, which backends and archs may build it, the build requests, a real sm_90a build
through the production path (every stage recorded as the deterministic variant, with the int64
dkv, its scale and the partial-sum tensors in its C ABI), the fixed-point scale and column order,
the loader refusing to end at the torch reference, and the API's argument and setting. The
kernels' numerics and bit-identity: tests/gpu.
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
from dsa_aot.kernels.dkv_interleave import dkv_fixed_column, fixed_vec_start, natural_order
from dsa_aot.runners import d_sink_parts, fixed_point_scale
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
    assert requests[1].compile_params["impl"] == "wgmma_ws"  # the fast mode's kernel at H128
    h16 = requests_for(KernelSpec(**{**spec.model_dump(), "heads": 16}), ("bwd_main",))
    assert h16[0].compile_params["impl"] == "wgmma_slot_major"
    fast = requests_for(spec.model_copy(update={"deterministic": False}), BACKENDS["cutedsl"].stages["bwd"])
    assert not any(r.deterministic or "deterministic" in r.compile_params for r in fast)
    for flavour in ("mma", "wgmma"):
        with pytest.raises(ValueError, match=f"impl={flavour} has no deterministic bwd_main"):
            requests_for(KernelSpec(**{**spec.model_dump(), "tile": {"flavour": flavour}}), ("bwd_main",))
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
    assert {n: tensors["bwd_preprocess"][n] for n in ("q", "kv", "dkv_max", "dkv_scale")} == \
        {"q": 3, "kv": 2, "dkv_max": 1, "dkv_scale": 1}  # the preprocess computes the scale
    assert [a.name for a in records["bwd_preprocess"].args if a.kind == "scalar"] == ["softmax_scale"]
    assert tensors["bwd_main"]["dkv_acc"] == 2 and tensors["bwd_main"]["dkv_scale"] == 1
    assert tensors["bwd_postprocess"] == {"dkv_acc": 2, "dkv_scale": 1, "dkv": 2, "d_sink_acc": 2,
                                          "d_sink": 1}
    dtypes = {a.name: a.dtype for a in records["bwd_main"].args if a.kind == "tensor"}
    assert dtypes["dkv_acc"] == "int64" and dtypes["dkv_scale"] == "float32"


def test_d_sink_partial_sums_follow_s_q():
    assert [d_sink_parts(n) for n in (0, 1, 16, 17, 4096, 100_000)] == [1, 1, 1, 2, 256, 1024]


def _pair_addends(q, kv, dout, idx, scale):
    """fp64 per-(row, slot) dkv addends of the sparse MLA backward (what the main kernel adds,
    before rounding), with ``lse`` and ``delta`` from an exact forward: [s_q, K, D]."""
    q, kv, dout = q.double(), kv.double(), dout.double()
    g = kv[idx.long()]                                            # [s_q, K, D]
    s = torch.einsum("thd,tkd->thk", q, g) * scale
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("thk,tkd->thd", p, g[..., :512])
    dp = torch.einsum("thd,tkd->thk", dout, g[..., :512])
    delta = (dout * out).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    add = torch.einsum("thk,thd->tkd", ds, q)
    add[..., :512] += torch.einsum("thk,thd->tkd", p, dout)
    return add, out


@pytest.mark.parametrize("dominant", [False, True])
def test_fixed_point_sums_are_order_free_within_the_bound_and_accurate(dominant):
    """The scheme of the deterministic kernel, in torch: every addend rounded to ``rni(v 2^k)`` in
    int64, summed per KV row in two different orders (same bits), every partial sum within the
    bound (no overflow), and the result as close to the fp64 sum as fp32 atomics would be."""
    g = torch.Generator().manual_seed(1)
    s_q, s_kv, h, d, k = 64, 96, 16, 576, 48
    q = torch.randn((s_q, h, d), generator=g).bfloat16()
    kv = torch.randn((s_kv, d), generator=g).bfloat16()
    dout = torch.randn((s_q, h, 512), generator=g).bfloat16()
    idx = torch.stack([torch.randperm(s_kv, generator=g)[:k] for _ in range(s_q)]).int()
    if dominant:  # every query attends mostly to KV row 0 (slot 0)
        u = torch.randn((d,), generator=g)
        q = (q.float() + u).bfloat16()
        kv[0] = (0.4 * u).bfloat16()
        idx[:, 0] = 0
        idx[:, 1:] = torch.where(idx[:, 1:] == 0, 1, idx[:, 1:])
    scale = d ** -0.5
    add, out = _pair_addends(q, kv, dout, idx, scale)
    mult, unit = fixed_point_scale(q, kv, out.bfloat16(), dout, scale).double().tolist()
    assert mult * unit == 1.0 and mult == 2.0 ** round(torch.log2(torch.tensor(mult)).item())
    rows = idx.long().reshape(-1)
    flat = add.reshape(-1, d)
    assert float(flat.abs().new_zeros((s_kv, d)).index_add_(0, rows, flat.abs()).max()) * mult < 2.0 ** 61
    fixed = torch.round(flat * mult).long()
    sums = []
    for order in (torch.arange(len(rows)), torch.randperm(len(rows), generator=g)):
        acc = torch.zeros((s_kv, d), dtype=torch.int64)
        for i in order.tolist():  # one add at a time, as the atomics land
            acc[rows[i]] += fixed[i]
        sums.append(acc)
    assert torch.equal(sums[0], sums[1])
    exact = torch.zeros((s_kv, d), dtype=torch.float64).index_add_(0, rows, flat)
    got = sums[0].double() * unit
    assert float((got - exact).norm() / exact.norm()) < 1e-9
    if dominant:  # the small rows keep their accuracy beside the dominant one
        assert float(exact[0].norm() / exact[1:].norm(dim=1).median()) > 100
        assert float((got[1:] - exact[1:]).norm() / exact[1:].norm()) < 1e-9


def test_fixed_point_scale_edge_cases():
    q = torch.zeros((4, 16, 576), dtype=torch.bfloat16)
    kv = torch.zeros((8, 576), dtype=torch.bfloat16)
    out = dout = torch.zeros((4, 16, 512), dtype=torch.bfloat16)
    mult, unit = fixed_point_scale(q, kv, out, dout, 0.04).tolist()  # all zero: any finite scale
    assert mult == 2.0 ** 120 and unit == 2.0 ** -120
    mult, unit = fixed_point_scale(q[:0], kv, out[:0], dout[:0], 0.04).tolist()  # no query rows
    assert mult == 2.0 ** 120
    nan_dout = dout.clone()
    nan_dout[1, 2, 3] = float("nan")
    mult, unit = fixed_point_scale(q, kv, out, nan_dout, 0.04).tolist()
    assert mult == 1.0 and unit != unit  # NaN: the fold writes NaN, never a finite guess
    ones = dout.clone().fill_(1.0)
    mult, unit = fixed_point_scale(q.clone().fill_(2.0 ** 100), kv.clone().fill_(1.0), out, ones,
                                   0.04).tolist()  # large but representable: 2^-54 or so
    assert mult * unit == 1.0 and mult < 2.0 ** -40
    huge = q.clone().fill_(2.0 ** 120)  # the bound (~2^260) is beyond what fp32 scales can hold
    mult, unit = fixed_point_scale(huge, kv.clone().fill_(2.0 ** 120), out, ones, 0.04).tolist()
    assert mult == 1.0 and unit != unit


@pytest.mark.parametrize("m_dout,k", [(1.0, 54), (1.5, 53), (0.5, 55)])
def test_fixed_point_scale_rounds_the_bound_up_to_a_power_of_two_exactly(m_dout, k):
    """``ceil(log2 B)`` comes from the bits of ``B`` (as in the preprocess kernel), exact at
    powers of two: with ``q`` and ``out`` zero, ``B = 2 s_q H max|dout|`` = 128 * max|dout|."""
    q = torch.zeros((4, 16, 576), dtype=torch.bfloat16)
    kv = torch.ones((8, 576), dtype=torch.bfloat16)
    out = torch.zeros((4, 16, 512), dtype=torch.bfloat16)
    dout = torch.full((4, 16, 512), m_dout, dtype=torch.bfloat16)
    mult, unit = fixed_point_scale(q, kv, out, dout, 0.04).tolist()
    assert (mult, unit) == (2.0 ** k, 2.0 ** -k)


def test_fixed_point_column_order():
    """The kernel stores value i of 16-byte slot s of a 32-column group at 16 (i % 2) + 8 (i // 2)
    + s (a 128-byte line per 16 lanes); the fold reads natural column 8 vec + 2 q + e at start +
    16 e + q."""
    order = natural_order(576, dkv_fixed_column)
    assert sorted(order) == list(range(576))
    for col in range(64):
        j, q, e = (col % 32) // 8, (col // 2) % 4, col % 2
        i, slot = 2 * (j % 2) + e, 4 * (j // 2) + q
        assert dkv_fixed_column(col) == (col // 32) * 32 + 16 * (i % 2) + 8 * (i // 2) + slot
    for vec in range(72):
        for q in range(4):
            for e in range(2):
                assert fixed_vec_start(vec) + 16 * e + q == dkv_fixed_column(8 * vec + 2 * q + e)
    with pytest.raises(ValueError, match="multiple of 32"):
        natural_order(100, dkv_fixed_column)


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
    assert settings.Settings.from_env().deterministic
    monkeypatch.setenv("DSA_AOT_DETERMINISTIC", "maybe")
    with pytest.raises(settings.SettingsError, match="DSA_AOT_DETERMINISTIC='maybe'"):
        settings.Settings.from_env()
