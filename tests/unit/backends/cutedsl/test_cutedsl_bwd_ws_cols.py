"""The H128 CuTe DSL backward main kernel with a CTA pair splitting the columns
(``impl=wgmma_ws_cols``, sm_90a) on CPU.

A ``tile.flavour = "wgmma_ws_cols"`` bwd spec at 128 heads becomes the main stage's impl, built by
its own module; other head counts, other archs and the deterministic mode are refused by name.
Its shared-memory views alias the K-major tiles (the 64-byte swizzled rope tiles too), the rope
gather's hand-written swizzle is the layout's, each CTA's 64 rows of ``P`` / ``dS`` are one
contiguous 8 KiB range (what the bulk copy to the partner sends) and the shared memory fits an
sm_90a CTA. Both D compile, export and link with the ``wgmma_ws`` C ABI, spill nothing and open
without ``cutlass``. Numerics: ``tests/unit/backends/cutedsl/test_cutedsl_bwd_main_kernel.py -m
gpu`` (``DSA_AOT_GPU_TEST_IMPLS=wgmma_ws_cols``), not here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_helpers import (HAS_CUTE_DSL, LAYOUT_DIFFER, assert_spill_free, needs_cute_dsl,
                         open_without_cutlass, run_dsl_script)
from dsa_aot.backends import get as get_backend
from dsa_aot.backends.cutedsl.build import BuildRequest, build_cutedsl, requests_for
from dsa_aot.backends.cutedsl.records import CuteExportRecord
from dsa_aot.specs.models import KernelSpec, TileConfig

IMPL = "wgmma_ws_cols"
MODULE = "dsa_aot.kernels.cutedsl_bwd_ws_cols"
BWD_STAGES = ("bwd_preprocess", "bwd_main", "bwd_postprocess")
#: (d_qk, layout) of the builds, and the default H128 flavour whose ABI they share
VARIANTS = [(576, "noncompact"), (512, "compact")]
TWIN = "wgmma_ws_staggered"
SMEM_LIMIT = 227 * 1024


def _spec(heads: int = 128, flavour: str | None = IMPL, d_qk: int = 576,
          layout: str = "noncompact", **extra: object) -> KernelSpec:
    return KernelSpec(op="bwd", arch=extra.pop("arch", "sm_90a"), d_qk=d_qk, heads=heads,
                      layout=layout, backend="cutedsl", tile=TileConfig(flavour=flavour), **extra)


def _request(d_qk: int, layout: str, flavour: str = IMPL) -> BuildRequest:
    (request,) = requests_for(_spec(flavour=flavour, d_qk=d_qk, layout=layout), ("bwd_main",),
                              link="static_cudart")
    return request


def test_flavour_becomes_the_main_stage_impl_of_its_own_module() -> None:
    backend = get_backend("cutedsl")
    pre, main, post = requests_for(_spec(), BWD_STAGES)
    assert (main.impl, main.compile_params) == (IMPL, {"d_qk": 576, "heads": 128,
                                                       "layout": "noncompact", "impl": IMPL})
    assert (pre.impl, post.impl) == (None, None)
    backend.check_spec(_spec())
    assert MODULE in backend.kernel_sources(_spec())


@pytest.mark.parametrize("kwargs,fragment", [
    ({"heads": 64}, r"impl=wgmma_ws_cols supports heads \(128,\), not heads=64; use impl=wgmma_ws"),
    ({"arch": "sm_100a"}, "impl=wgmma_ws_cols needs sm_90a, not sm_100a"),
    ({"deterministic": True}, "impl=wgmma_ws_cols has no deterministic bwd_main"),
])
def test_what_the_flavour_cannot_build_is_refused(kwargs: dict, fragment: str) -> None:
    spec = _spec(**dict(kwargs))
    with pytest.raises(ValueError, match=fragment):
        get_backend("cutedsl").check_spec(spec)
    request = dict(kernel="bwd_main", arch=kwargs.get("arch", "sm_90a"), d_qk=576,
                   heads=kwargs.get("heads", 128), layout="noncompact", impl=IMPL,
                   deterministic=kwargs.get("deterministic", False))
    with pytest.raises(ValueError, match=fragment):
        BuildRequest(**request)


_VIEW_CHECK = LAYOUT_DIFFER + """
import cutlass
import cutlass.cute as cute
from dsa_aot.kernels import cutedsl_bwd_ws_cols as k

import re

def swizzled(lay, r, c):
    # the byte address (from the tile's base) of bf16 element (r, c): the swizzle <B, M, S>
    # (printed S<B,M,S>, on byte addresses) applied to the outer layout's offset in bytes,
    # x ^ ((x & (2^B - 1) << (M + S)) >> S)
    b, m, s = map(int, re.search(r"(\d+),\s*(\d+),\s*(\d+)", str(lay.inner)).groups())
    x = 2 * lay.outer((r, c))
    return x ^ ((x & (((1 << b) - 1) << (m + s))) >> s)

@cute.jit
def check():
    for d in (512, 576):
        lay = k.cols_smem_layouts(d)
        print("q", d, differ(lay["q"].outer, lay["q_t"].outer, 128, 256))
        print("dout", d, differ(lay["dout"].outer, lay["dout_t"].outer, 128, 256))
        print("kv", d, differ(lay["kv"].outer, lay["kv_t"].outer, 64, 256))
        print("p", d, differ(lay["p"].outer, lay["p_t"].outer, 128, 64))
        # the rows of head block hb of P: elements [64 * 64 hb, 64 * 64 (hb + 1))
        rows = [lay["p"].outer((r, c)) for r in (0, 63, 64, 127) for c in (0, 63)]
        print("prows", d, *rows)
        if cutlass.const_expr(d == 576):
            print("q_rope", d, differ(lay["q_rope"].outer, lay["q_rope_t"].outer, 128, 32))
            print("kv_rope", d, differ(lay["kv_rope"].outer, lay["kv_rope_t"].outer, 64, 32))
            # 16-byte chunk j of row r at the gather's hand-written address
            bad = sum(1 for r in range(64) for j in range(4) if swizzled(lay["kv_rope"], r, 8 * j)
                      != r * 64 + ((j ^ ((r // 2) % 4)) * 16))
            print("rope_swizzle", d, bad, lay["kv_rope"].inner)
            bad = sum(1 for r in range(64) for j in range(8) if swizzled(lay["kv"], r, 8 * j)
                      != r * 128 + ((j ^ (r % 8)) * 16))
            print("main_swizzle", d, bad, lay["kv"].inner)
        _, storage = k.shared_storage(d)
        print("smem", d, storage.size_in_bytes())

check()
"""


@needs_cute_dsl
def test_views_swizzles_and_shared_memory(tmp_path: Path) -> None:
    """The MN-major views address exactly the K-major tiles' elements; the gather's hand-written
    addresses (128-byte swizzle for the nope tiles, 64-byte for the rope tile) are the layouts';
    a head block's 64 rows of ``P`` are one contiguous range; the CTA fits sm_90a."""
    proc = run_dsl_script(_VIEW_CHECK, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines()]
    counts = [line for line in lines if line[0] in ("q", "dout", "kv", "p", "q_rope", "kv_rope")]
    assert len(counts) == 10 and all(line[-1] == "0" for line in counts), proc.stdout
    swizzles = [line for line in lines if line[0] in ("rope_swizzle", "main_swizzle")]
    assert len(swizzles) == 2 and all(line[2] == "0" for line in swizzles), proc.stdout
    for line in lines:
        if line[0] == "prows":  # rows 0-63 below 4096 elements, rows 64-127 from 4096 on
            lo, hi = [int(v) for v in line[2:6]], [int(v) for v in line[6:10]]
            assert max(lo) < 4096 <= min(hi) and max(hi) < 8192, line
    smem = {int(line[1]): int(line[2]) for line in lines if line[0] == "smem"}
    assert sorted(smem) == [512, 576], proc.stdout
    for d, size in smem.items():
        half = 256 + (d - 512) // 2
        tiles = 2 * (128 * half + 128 * 256 + 64 * half + 2 * 128 * 64) + 4 * 64 * 64
        assert tiles <= size and size + 1024 <= SMEM_LIMIT, (d, size)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, CuteExportRecord]]:
    if not HAS_CUTE_DSL:
        pytest.skip("needs nvidia-cutlass-dsl to compile")
    out = tmp_path_factory.mktemp("bwd_ws_cols")
    requests = [_request(*v) for v in VARIANTS] + [_request(576, "noncompact", TWIN)]
    return out, {r.impl + r.name: r for r in build_cutedsl(requests, out)}


@needs_cute_dsl
def test_builds_with_the_ws_abi_spill_nothing_and_open_without_cutlass(
        built: tuple[Path, dict[str, CuteExportRecord]]) -> None:
    out, records = built
    ours = [r for r in records.values() if r.impl == IMPL]
    twin = next(r for r in records.values() if r.impl == TWIN)
    assert sorted((r.d_qk, r.layout) for r in ours) == sorted(VARIANTS)
    for rec in ours:
        assert (rec.kernel, rec.arch, rec.heads, rec.deterministic) == ("bwd_main", "sm_90a", 128,
                                                                        False)
        tensors = (["q", "kv", "dout", "topk_idxs"]
                   + (["topk_length"] if rec.layout == "compact" else [])
                   + ["lse_sink", "delta", "dq", "dkv_acc"])
        assert [a.name for a in rec.args] == tensors + ["softmax_scale", "stream"]
        assert b"kernel_cols" in (out / rec.name / rec.object_file).read_bytes()
        if (rec.d_qk, rec.layout) == (twin.d_qk, twin.layout):
            assert rec.args == twin.args
    assert_spill_free(out / rec.name / rec.object_file for rec in ours)
    assert len(open_without_cutlass(out / rec.name for rec in ours)) == len(ours)
