"""The deterministic backward (``KernelSpec.deterministic``, ``deterministic=True``) on CPU.

Specs and ids, which backends and archs may build it, the build requests, a real sm_90a build
through the production path (every stage recorded as the deterministic variant, with the stored
dkv rows, their order and the partial-sum tensors in its C ABI), the order the postprocess sums
the rows in and how a call is chunked, the loader refusing to end at the torch reference, and the
API's argument and settings. The kernels' numerics and bit-identity: tests/gpu.
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
from dsa_aot.kernels.dkv_interleave import dkv_acc_column
from dsa_aot.runners import (DET_GROUP_ROWS, d_sink_parts, deterministic_chunk_rows,
                             dkv_row_order)
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
    assert requests[1].compile_params["impl"] == "wgmma_ws_staggered"  # the fast mode's kernel at H128
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
    assert tensors["bwd_main"]["dkv_rows"] == 3 and "dkv_acc" not in tensors["bwd_main"]
    assert tensors["bwd_postprocess"] == {"dkv_rows": 2, "row_order": 1, "row_offsets": 1,
                                          "dkv_acc": 2, "dkv": 2, "d_sink_acc": 2, "d_sink": 1}
    assert [a.name for a in records["bwd_postprocess"].args if a.kind == "scalar"] == ["row_group"]
    dtypes = {a.name: a.dtype for a in records["bwd_main"].args if a.kind == "tensor"}
    assert dtypes["dkv_rows"] == "bfloat16"
    dtypes = {a.name: a.dtype for a in records["bwd_postprocess"].args if a.kind == "tensor"}
    assert (dtypes["row_order"], dtypes["row_offsets"], dtypes["dkv_acc"]) == ("int32", "int32", "float32")


def test_d_sink_partial_sums_follow_s_q():
    assert [d_sink_parts(n) for n in (0, 1, 16, 17, 4096, 100_000)] == [1, 1, 1, 2, 256, 1024]


def _row_order_by_scan(idx, length, s_kv, head_blocks):
    """What :func:`dkv_row_order` must give, by a plain scan: per KV row, the stored rows of
    its valid slots by increasing (query row, slot, head block)."""
    s_q, topk = idx.shape
    per_row = [[] for _ in range(s_kv)]
    for t in range(s_q):
        n = topk if length is None else max(0, min(int(length[t]), topk))
        for slot in range(n):
            j = int(idx[t, slot])
            if 0 <= j < s_kv:
                per_row[j] += [(t * topk + slot) * head_blocks + h for h in range(head_blocks)]
    offsets = [0]
    for rows in per_row:
        offsets.append(offsets[-1] + len(rows))
    return [r for rows in per_row for r in rows], offsets


@pytest.mark.parametrize("s_kv", [37, 40_000])  # int16 and int32 sort keys
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("head_blocks", [1, 2])
def test_row_order_lists_every_valid_slot_by_query_row(s_kv, compact, head_blocks):
    g = torch.Generator().manual_seed(s_kv + 2 * compact + head_blocks)
    s_q, topk = 9, 12
    idx = torch.randint(-3, s_kv + 3, (s_q, topk), generator=g, dtype=torch.int32)
    idx[2] = idx[2, 0]  # one index over a whole row
    idx[:, 5] = 7  # and in every row
    length = torch.randint(-1, topk + 2, (s_q,), generator=g, dtype=torch.int32) if compact else None
    order, offsets = dkv_row_order(idx, length, s_kv, head_blocks)
    want_order, want_offsets = _row_order_by_scan(idx, length, s_kv, head_blocks)
    assert order.dtype == offsets.dtype == torch.int32
    assert offsets.tolist() == want_offsets
    assert order[:offsets[-1]].tolist() == want_order


def test_chunks_are_whole_groups_within_the_workspace():
    row_bytes = 2048 * 576 * 2  # topk 2048, one head block, D 576
    group = DET_GROUP_ROWS * row_bytes
    assert deterministic_chunk_rows(4096, 2048, 1, 576, 4 << 30) == (4 << 30) // group * DET_GROUP_ROWS
    assert deterministic_chunk_rows(4096, 2048, 1, 576, 1) == DET_GROUP_ROWS  # at least one group
    assert deterministic_chunk_rows(10, 2048, 2, 576, 4 << 30) == 10  # never more than the call
    assert deterministic_chunk_rows(0, 2048, 1, 576, 4 << 30) == 1
    assert deterministic_chunk_rows(5000, 0, 1, 576, 4 << 30) == 5000  # no slots: one chunk


def test_the_reduce_reads_the_interleaved_columns_back_in_natural_order():
    """A reducing thread loads 8 contiguous interleaved values of a stored row and writes them
    to two runs of 4 natural columns (:func:`reduce_runs`): the inverse of ``dkv_acc_column``."""
    from dsa_aot.kernels.cutedsl_bwd_postprocess import reduce_runs

    seen = set()
    for vec in range(576 // 8):
        base, first, second = reduce_runs(vec)
        for run, offs in ((0, first), (8, second)):
            for i, off in enumerate(offs):
                assert dkv_acc_column(base + run + i) == 8 * vec + off
                seen.add(base + run + i)
    assert seen == set(range(576))


@pytest.fixture
def empty_loader(tmp_path):
    with settings.scope(cache_dir=tmp_path, prebuilt_dirs=(), backends=None, jit=False,
                        require_prebuilt=False, remote_url=None):
        yield Loader()


def test_loader_never_serves_the_reference_for_a_deterministic_call(empty_loader):
    with settings.scope(deterministic_mode="stored_rows"), pytest.raises(
            DeterminismUnavailableError, match=r"no deterministic bwd kernel for sm_90a .*"
            r"bwd-sm_90a-d576-h64-noncompact-cutedsl-det: not prebuilt and DSA_AOT_JIT=0.*cutedsl"
            r".*--only '\*-det\*'"):
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
    assert settings.Settings.from_env().deterministic_workspace == 4 << 30
    monkeypatch.setenv("DSA_AOT_DETERMINISTIC_WORKSPACE", "512M")
    assert settings.Settings.from_env().deterministic_workspace == 512 << 20
    monkeypatch.setenv("DSA_AOT_DETERMINISTIC", "1")
    assert settings.Settings.from_env().deterministic
    monkeypatch.setenv("DSA_AOT_DETERMINISTIC", "maybe")
    with pytest.raises(settings.SettingsError, match="DSA_AOT_DETERMINISTIC='maybe'"):
        settings.Settings.from_env()


# ---- the fixed-point mode (DSA_AOT_DETERMINISTIC_MODE=fixed_point) ----


def test_fixed_point_mode_setting_parses(monkeypatch):
    assert settings.Settings.from_env().deterministic_mode == "auto"
    monkeypatch.setenv("DSA_AOT_DETERMINISTIC_MODE", "Fixed_Point")
    assert settings.Settings.from_env().deterministic_mode == "fixed_point"
    monkeypatch.setenv("DSA_AOT_DETERMINISTIC_MODE", "atomic")
    with pytest.raises(settings.SettingsError, match="DSA_AOT_DETERMINISTIC_MODE='atomic'.*fixed_point"):
        settings.Settings.from_env()


def test_fixed_point_mode_asks_for_the_fixed_flavours(empty_loader):
    """The loader's deterministic cutedsl spec carries the fixed-point flavour of the head count
    (a spec of its own, in the catalog); stored rows carry none; ``auto`` (the default) takes
    the fixed-point flavour at every head count."""
    with settings.scope(deterministic_mode="fixed_point"):
        with pytest.raises(DeterminismUnavailableError, match=r"-det-t[0-9a-f]{8}: not prebuilt"):
            empty_loader.resolve("bwd", "sm_90a", 576, 64, "noncompact", 0, deterministic=True)
        specs = {h: empty_loader._spec("bwd", "sm_90a", 512, h, "compact", "cutedsl", True)
                 for h in (16, 32, 64, 128)}
    assert {h: s.tile.flavour for h, s in specs.items()} == {
        16: "wgmma_ws_slot_major_fixed", 32: "wgmma_ws_slot_major_fixed", 64: "wgmma_ws_fixed",
        128: "wgmma_ws_fixed"}
    with settings.scope(deterministic_mode="stored_rows"):
        assert empty_loader._spec("bwd", "sm_90a", 512, 64, "compact", "cutedsl", True).tile.flavour is None
    with settings.scope(deterministic_mode="auto"):  # the default: fixed point at every head count
        auto = {h: empty_loader._spec("bwd", "sm_90a", 512, h, "compact", "cutedsl", True).tile.flavour
                for h in (16, 32, 64, 128)}
        assert auto == {h: s.tile.flavour for h, s in specs.items()}
        assert empty_loader._spec("bwd", "sm_90a", 512, 64, "compact", "cutedsl", False).tile.flavour is None
        with pytest.raises(DeterminismUnavailableError, match=r"-h128-noncompact-cutedsl-det-t[0-9a-f]{8}: "):
            empty_loader.resolve("bwd", "sm_90a", 576, 128, "noncompact", 0, deterministic=True)
        with pytest.raises(DeterminismUnavailableError, match=r"-h32-noncompact-cutedsl-det-t[0-9a-f]{8}: "):
            empty_loader.resolve("bwd", "sm_90a", 576, 32, "noncompact", 0, deterministic=True)
    with settings.scope(deterministic_mode="stored_rows"):
        with pytest.raises(DeterminismUnavailableError, match=r"-h32-noncompact-cutedsl-det: "):
            empty_loader.resolve("bwd", "sm_90a", 576, 32, "noncompact", 0, deterministic=True)
    from dsa_aot.specs.catalog import load_catalog

    catalog = {s.id for s in load_catalog().specs()}
    assert {s.id for s in specs.values()} <= catalog


def test_fixed_point_flavours_build_requests():
    spec = KernelSpec(**{**KernelSpec.from_id(DET).model_dump(), "tile": {"flavour": "wgmma_ws_fixed"}})
    main, post = requests_for(spec, ("bwd_main", "bwd_postprocess"))
    assert main.compile_params["impl"] == "wgmma_ws_fixed" and main.deterministic
    assert post.compile_params == {"impl": "fixed_point", "deterministic": True}
    stored_rows = requests_for(KernelSpec.from_id(DET), ("bwd_postprocess",))[0]
    assert stored_rows.compile_params == {"deterministic": True}  # the stored rows' reduction
    with pytest.raises(ValidationError, match="deterministic bwd_postprocess|deterministic=True"):
        BuildRequest(kernel="bwd_postprocess", arch="sm_90a", impl="fixed_point")
    with pytest.raises(ValidationError, match="needs deterministic=True"):
        BuildRequest(kernel="bwd_main", arch="sm_90a", d_qk=576, heads=64, layout="compact",
                     impl="wgmma_ws_fixed")
    with pytest.raises(ValueError, match="wgmma_ws_fixed"):
        requests_for(KernelSpec(**{**spec.model_dump(), "heads": 16}), ("bwd_main",))


@pytest.mark.skipif(_CANNOT_BUILD is not None, reason=f"cannot build: {_CANNOT_BUILD}")
@pytest.mark.parametrize("flavour,heads,d_qk", [("wgmma_ws_fixed", 128, 576),
                                                ("wgmma_ws_slot_major_fixed", 32, 576)])
def test_fixed_point_build_records_its_abi_and_spills_nothing(tmp_path, flavour, heads, d_qk):
    from cli_helpers import assert_spill_free

    spec = KernelSpec(op="bwd", arch="sm_90a", d_qk=d_qk, heads=heads, layout="noncompact",
                      backend="cutedsl", deterministic=True, tile={"flavour": flavour})
    done = build_and_publish(ArtifactStore(tmp_path), spec, Toolchain.current())
    assert done.status == "built", done
    records = {st.name: CuteExportRecord.model_validate(st.record) for st in done.manifest.stages}
    main = records["bwd_main"]
    assert main.name.endswith(f"_{flavour}_det_static")
    tensors = {a.name: (a.dtype, len(a.shape)) for a in main.args if a.kind == "tensor"}
    assert tensors["dkv_fixed"] == ("int32", 2)
    assert "dkv_rows" not in tensors and "dkv_acc" not in tensors
    post = records["bwd_postprocess"]  # the fixed-point postprocess: the guess and fold steps
    assert post.name.endswith("_fixed_point_det_static")
    assert [a.name for a in post.args if a.kind == "tensor"] == ["dkv_fixed", "dkv_acc", "dkv",
                                                                "d_sink_acc", "d_sink"]
    assert [(a.name, a.dtype) for a in post.args if a.kind == "scalar"] == [("fixed_step", "int32"),
                                                                          ("fixed_bound", "int32")]
    assert_spill_free(tmp_path.rglob("bwd_main.so"))  # the linked library embeds the cubin
    assert_spill_free(tmp_path.rglob("bwd_postprocess.so"))
