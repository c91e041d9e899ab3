"""The TileLang forward compiles for sm_90a and sm_100a, and its launch record binds by name."""

from __future__ import annotations

import functools
import itertools

import pytest

pytest.importorskip("tilelang")

from dsa_aot.backends import get as get_backend  # noqa: E402
from dsa_aot.backends.tilelang.build import compile_stage  # noqa: E402
from dsa_aot.kernels import tilelang_fwd  # noqa: E402
from dsa_aot.kernels.tilelang_fwd import build_fwd, resolve_tile  # noqa: E402
from dsa_aot.specs.models import KernelSpec, TileConfig  # noqa: E402

ARCHS = ("sm_90a", "sm_100a")
MATRIX = list(itertools.product(ARCHS, (512, 576), (16, 32, 64, 128), ("noncompact", "compact")))
# A few variants per arch stay in the default run: main perf path, padded heads, compact, H=128.
QUICK = [
    ("sm_90a", 576, 64, "noncompact"),
    ("sm_90a", 512, 16, "compact"),
    ("sm_100a", 576, 128, "compact"),
    ("sm_100a", 512, 32, "noncompact"),
]
PTR = {"q", "kv", "topk_idxs", "attn_sink", "out", "lse"}
SIZES = {"s_q", "s_kv", "topk"}


@functools.lru_cache(maxsize=None)
def _compiled(arch: str, d_qk: int, heads: int, layout: str, tile: TileConfig = TileConfig()):
    spec = KernelSpec(op="fwd", arch=arch, d_qk=d_qk, heads=heads, layout=layout, tile=tile)
    func, configs = build_fwd(spec)
    return spec, compile_stage(func, arch, configs)


def _grid(expr: str, s_q: int) -> int:
    return int(eval(expr, {"__builtins__": {}, "min": min, "max": max, "s_q": s_q}))  # noqa: S307


def _check_record(spec: KernelSpec, stage) -> None:
    rec = stage.record
    assert rec.entry == "sparse_mla_fwd_kernel"
    kinds = {p.name: p.kind for p in rec.params}
    expected = PTR | SIZES | {"softmax_scale"} | ({"topk_length"} if spec.layout == "compact" else set())
    assert set(kinds) == expected and len(rec.params) == len(expected)
    assert all(kinds[n] == "ptr" for n in PTR) and all(kinds[n] == "i32" for n in SIZES)
    assert kinds["softmax_scale"] == "f32"
    if spec.layout == "compact":
        assert kinds["topk_length"] == "ptr"
    # One CTA per token (two for H=128); nothing else in the grid depends on a size.
    ctas_per_token = 2 if spec.heads == 128 else 1
    for s_q in (1, 7, 4096):
        assert _grid(rec.grid[0], s_q) == ctas_per_token * s_q
    assert rec.grid[1:] == ("1", "1")
    impl, _, _, threads = resolve_tile(spec)
    assert rec.block == (threads, 1, 1)
    assert 0 < rec.dynamic_smem <= tilelang_fwd.SMEM_LIMIT - 1024
    assert stage.cubin[:4] == b"\x7fELF"
    src = stage.cuda_source
    if impl == "ws":
        # wgmma, predicated (zero-fill) cp.async gather, register rebalancing.
        assert "wgmma_ss" in src and "cp_async_gs_conditional" in src
        assert f"warpgroup_reg_alloc<{tilelang_fwd.WG0_REGS}>" in src
        assert f"warpgroup_reg_dealloc<{tilelang_fwd.PRODUCER_REGS}>" in src


@pytest.mark.parametrize("arch,d_qk,heads,layout", QUICK)
def test_compiles_quick(arch, d_qk, heads, layout):
    spec, stage = _compiled(arch, d_qk, heads, layout)
    _check_record(spec, stage)


@pytest.mark.slow
@pytest.mark.parametrize("arch,d_qk,heads,layout", [m for m in MATRIX if m not in QUICK])
def test_compiles_full_matrix(arch, d_qk, heads, layout):
    spec, stage = _compiled(arch, d_qk, heads, layout)
    _check_record(spec, stage)


@pytest.mark.slow
def test_pipelined_kernel_on_sm90():
    spec, stage = _compiled("sm_90a", 576, 64, "noncompact", TileConfig(threads=256))
    _check_record(spec, stage)


def test_arch_defaults():
    hopper = KernelSpec(op="fwd", arch="sm_90a", d_qk=576, heads=64, layout="compact")
    blackwell = KernelSpec(op="fwd", arch="sm_100a", d_qk=576, heads=64, layout="compact")
    assert resolve_tile(hopper) == ("ws", 64, 2, 384)
    assert resolve_tile(blackwell) == ("pipelined", 64, 2, 256)


def test_register_budget_cannot_deadlock():
    # setmaxnreg.inc is served only from registers released by .dec within the CTA: the three
    # warpgroups must fit the launch allocation (65536 / 384 threads -> 168 each) or WG0 hangs.
    per_thread = 65536 // 384 // 8 * 8
    regs = (tilelang_fwd.WG0_REGS, tilelang_fwd.WG1_REGS, tilelang_fwd.PRODUCER_REGS)
    assert tilelang_fwd.WG1_REGS == per_thread
    assert sum(regs) <= 3 * per_thread


@pytest.mark.parametrize("arch,tile,match", [
    ("sm_100a", TileConfig(threads=384), "needs sm_90a"),
    ("sm_90a", TileConfig(block_i=64, num_stages=3), "shared memory"),
    ("sm_90a", TileConfig(block_i=128), "supports 32 or 64"),
    ("sm_100a", TileConfig(threads=512), "128 or 256"),
])
def test_rejects_unsupported_tiles(arch, tile, match):
    spec = KernelSpec(op="fwd", arch=arch, d_qk=576, heads=64, layout="noncompact", tile=tile)
    with pytest.raises(ValueError, match=match):
        build_fwd(spec)


def test_rejects_backward_spec():
    spec = KernelSpec(op="bwd", arch="sm_90a", d_qk=576, heads=64, layout="noncompact")
    with pytest.raises(ValueError, match="bwd"):
        build_fwd(spec)


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_backend_refuses_an_mma_flavour(op):
    """``tile.flavour`` selects a CuTe DSL MMA flavour; the TileLang backend refuses it by name."""
    spec = KernelSpec(op=op, arch="sm_90a", d_qk=576, heads=64, layout="compact",
                      tile=TileConfig(flavour="wgmma"))
    with pytest.raises(ValueError, match="tile.flavour='wgmma'"):
        get_backend("tilelang").check_spec(spec)
    get_backend("tilelang").check_spec(spec.model_copy(update={"tile": TileConfig(threads=256)}))
