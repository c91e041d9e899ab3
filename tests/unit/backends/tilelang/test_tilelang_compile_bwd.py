"""The TileLang sparse MLA backward stages compile for sm_90a and sm_100a (no GPU needed).

Each stage is lowered and compiled to a cubin for real; the launch record must name the entry,
carry exactly the contract's parameter names, and size its grid from the run-time lengths.
The full (arch, d_qk, heads, layout) matrix is marked slow; a few variants per arch run always.
"""

from __future__ import annotations

import itertools
import re

import pytest

pytest.importorskip("tilelang")

from dsa_aot.backends.tilelang.build import compile_stage  # noqa: E402
from dsa_aot.backends.tilelang.records import LaunchRecord  # noqa: E402
from dsa_aot.kernels.tilelang_bwd import build_bwd_main  # noqa: E402
from dsa_aot.kernels.tilelang_bwd_postprocess import build_bwd_postprocess  # noqa: E402
from dsa_aot.kernels.tilelang_bwd_preprocess import build_bwd_preprocess  # noqa: E402
from dsa_aot.specs.models import KernelSpec, TileConfig  # noqa: E402

#: Largest opt-in dynamic shared memory per block on H100/H200 and B200 (227 KiB).
MAX_SMEM = 232448

MAIN_PTRS = {"q", "kv", "dout", "topk_idxs", "lse_sink", "delta", "dq", "dkv_acc"}
PRE_PTRS = {"out", "dout", "lse", "attn_sink", "delta", "lse_sink", "d_sink"}
POST_PTRS = {"dkv_acc", "dkv"}

FAST = [("sm_90a", 576, 64, "noncompact"), ("sm_90a", 512, 16, "compact"),
        ("sm_100a", 576, 128, "compact"), ("sm_100a", 512, 32, "noncompact")]
FULL = [v for v in itertools.product(("sm_90a", "sm_100a"), (512, 576), (16, 32, 64, 128),
                                      ("compact", "noncompact")) if v not in FAST]


def _spec(arch: str, d_qk: int, heads: int, layout: str, **tile: int) -> KernelSpec:
    return KernelSpec(op="bwd", arch=arch, d_qk=d_qk, heads=heads, layout=layout, tile=TileConfig(**tile))


def _compile(builder, spec: KernelSpec):
    prim_func, pass_configs = builder(spec)
    return compile_stage(prim_func, spec.arch, pass_configs)


def _grid(record: LaunchRecord, **sizes: int) -> tuple[int, ...]:
    env = {"__builtins__": {}, "min": min, "max": max, **sizes}
    return tuple(int(eval(expr, env)) for expr in record.grid)  # noqa: S307 - validated arithmetic


def _params(record: LaunchRecord) -> dict[str, str]:
    names = [p.name for p in record.params]
    assert len(names) == len(set(names)), names
    return {p.name: p.kind for p in record.params}


def _check_common(stage) -> None:
    assert stage.cubin[:4] == b"\x7fELF"
    # validity masks are int32 0/1 values: a bool array would vectorize to boolx8 on sm_100a
    assert not re.search(r"\bbool\s+\w+\[", stage.cuda_source)
    assert 0 <= stage.record.dynamic_smem <= MAX_SMEM
    # the record is what gets stored: it must survive a JSON round trip unchanged
    assert LaunchRecord.model_validate_json(stage.record.model_dump_json()) == stage.record


def _check_main(arch: str, d_qk: int, heads: int, layout: str) -> None:
    stage = _compile(build_bwd_main, _spec(arch, d_qk, heads, layout))
    _check_common(stage)
    rec = stage.record
    assert rec.entry == "sparse_mla_bwd_kernel"
    ptrs = MAIN_PTRS | ({"topk_length"} if layout == "compact" else set())
    expected = {**{n: "ptr" for n in ptrs}, "s_q": "i32", "s_kv": "i32", "topk": "i32", "softmax_scale": "f32"}
    assert _params(rec) == expected
    assert rec.block == (256, 1, 1)
    hblk = max(1, heads // 64)
    for s_q in (1, 37, 4096):
        assert _grid(rec, s_q=s_q, s_kv=95, topk=100) == (s_q, hblk, 1)
    assert "cp_async" in stage.cuda_source  # the KV gather is asynchronous
    if arch == "sm_90a":
        assert "wgmma" in stage.cuda_source


def _check_pre(arch: str, heads: int) -> None:
    stage = _compile(build_bwd_preprocess, _spec(arch, 576, heads, "compact"))
    _check_common(stage)
    rec = stage.record
    assert rec.entry == "sparse_mla_bwd_preprocess_kernel"
    assert _params(rec) == {**{n: "ptr" for n in PRE_PTRS}, "s_q": "i32"}
    assert [_grid(rec, s_q=s)[0] for s in (1, 8, 9, 4096)] == [1, 1, 2, 512]


def _check_post(arch: str, d_qk: int) -> None:
    stage = _compile(build_bwd_postprocess, _spec(arch, d_qk, 64, "compact"))
    _check_common(stage)
    rec = stage.record
    assert rec.entry == "sparse_mla_bwd_postprocess_kernel"
    assert _params(rec) == {"dkv_acc": "ptr", "dkv": "ptr", "s_kv": "i32"}
    assert [_grid(rec, s_kv=s)[0] for s in (1, 64, 65, 8192)] == [1, 1, 2, 128]


@pytest.mark.parametrize("arch,d_qk,heads,layout", FAST)
def test_main_compiles(arch, d_qk, heads, layout):
    _check_main(arch, d_qk, heads, layout)


@pytest.mark.slow
@pytest.mark.parametrize("arch,d_qk,heads,layout", FULL)
def test_main_compiles_full_matrix(arch, d_qk, heads, layout):
    _check_main(arch, d_qk, heads, layout)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_pre_and_postprocess_compile(arch):
    _check_pre(arch, 64)
    _check_post(arch, 576)


@pytest.mark.slow
@pytest.mark.parametrize("arch,heads", list(itertools.product(("sm_90a", "sm_100a"), (16, 32, 128))))
def test_preprocess_compiles_full_matrix(arch, heads):
    _check_pre(arch, heads)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_postprocess_compiles_d512(arch):
    _check_post(arch, 512)


@pytest.mark.parametrize("field,value", [("block_i", 32), ("threads", 384), ("num_stages", 1)])
def test_main_refuses_unsupported_tile(field, value):
    with pytest.raises(ValueError, match=field):
        build_bwd_main(_spec("sm_90a", 576, 64, "compact", **{field: value}))


def test_main_accepts_explicit_defaults():
    fn, configs = build_bwd_main(_spec("sm_100a", 512, 64, "noncompact", block_i=64, num_stages=2, threads=256))
    assert fn is not None and isinstance(configs, dict)
