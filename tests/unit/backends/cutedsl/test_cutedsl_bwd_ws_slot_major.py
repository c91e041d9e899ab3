"""The slot-major CuTe DSL backward with a score and a dKV warpgroup (``impl=wgmma_ws_slot_major``,
sm_90a, H 16 / 32) on CPU.

The flavour is the fast mode's default at H16 / H32 on sm_90a (the deterministic mode's default
there is ``wgmma_slot_major``). A ``tile.flavour = "wgmma_ws_slot_major"`` bwd spec becomes the
main stage's impl, its artifact is named as the default's in the fast mode and apart from it in
the deterministic one, and its build is keyed on the flavour's module. Requests, specs, catalogs
and the kernel module refuse other archs and other head counts by name, and ``compile_bwd_main``
refuses to build the flavour. The shared-memory views the kernel reads as MN-major operands alias its K-major
tiles byte for byte, and one CTA's shared memory fits the 227 KiB of an sm_90a CTA. Four fast and
two deterministic variants (both D, both H, both layouts) compile, export and link for sm_90a
through :func:`dsa_aot.backends.cutedsl.build.build_cutedsl`: their records and C ABI equal the
slot-major flavour's (same arguments, same descriptors), a fresh process opens them without
``cutlass``, and the embedded cubins spill nothing (no local memory) within 255 registers.
Numerics: ``tests/unit/backends/cutedsl/test_cutedsl_bwd_main_kernel.py -m gpu``
(``DSA_AOT_GPU_TEST_IMPLS=wgmma_ws_slot_major``), not here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_helpers import (HAS_CUTE_DSL, LAYOUT_DIFFER, assert_spill_free, needs_cute_dsl,
                         open_without_cutlass, run_dsl_script)
from dsa_aot.backends import get as get_backend
from dsa_aot.backends.cutedsl.build import BuildRequest, build_cutedsl, requests_for
from dsa_aot.backends.cutedsl.records import (BWD_SLOT_MAJOR_HEADS, CuteExportRecord,
                                              bwd_main_default_impl)
from dsa_aot.specs.catalog import Catalog
from dsa_aot.specs.models import KernelSpec, TileConfig
from dsa_aot.specs.sources import module_sources

IMPL = "wgmma_ws_slot_major"
MODULE = "dsa_aot.kernels.cutedsl_bwd_ws_slot_major"
BWD_STAGES = ("bwd_preprocess", "bwd_main", "bwd_postprocess")


#: (d_qk, heads, layout, deterministic) of the variants built: every D, H and layout once, and
#: the deterministic mode at the largest and the smallest register footprint
VARIANTS = [(576, 32, "compact", False), (512, 16, "noncompact", False),
            (576, 16, "noncompact", False), (512, 32, "compact", False),
            (576, 32, "noncompact", True), (512, 16, "compact", True)]
#: the slot-major builds whose records (C ABI) the new ones must equal
TWINS = [(576, 32, "compact", False), (576, 32, "noncompact", True)]
SMEM_LIMIT = 227 * 1024


def _spec(heads: int = 32, arch: str = "sm_90a", flavour: str | None = IMPL, d_qk: int = 576,
          layout: str = "compact", op: str = "bwd", **extra: object) -> KernelSpec:
    return KernelSpec(op=op, arch=arch, d_qk=d_qk, heads=heads, layout=layout,
                      backend="cutedsl", tile=TileConfig(flavour=flavour), **extra)


def _request(d_qk: int, heads: int, layout: str, deterministic: bool,
             flavour: str | None = IMPL) -> BuildRequest:
    (request,) = requests_for(_spec(heads, flavour=flavour, d_qk=d_qk, layout=layout,
                                    deterministic=deterministic), ("bwd_main",),
                              link="static_cudart")
    return request


# --------------------------------------------------------------------------------------------
# Requests and specs (no compiler needed)
# --------------------------------------------------------------------------------------------

def test_flavour_becomes_the_main_stage_impl_and_names_the_artifact() -> None:
    pre, main, post = requests_for(_spec(32), BWD_STAGES)
    assert (main.impl, main.compile_params) == (IMPL, {"d_qk": 576, "heads": 32,
                                                       "layout": "compact", "impl": IMPL})
    assert (pre.impl, post.impl) == (None, None)
    det = _request(512, 16, "noncompact", True)
    assert det.impl == IMPL and det.compile_params["deterministic"] is True
    get_backend("cutedsl").check_spec(_spec(16))
    get_backend("cutedsl").check_spec(_spec(32, deterministic=True))


def test_the_build_is_keyed_on_the_flavours_module() -> None:
    backend = get_backend("cutedsl")
    assert backend.kernel_sources(_spec(32)) == (
        "dsa_aot.kernels.cutedsl_bwd_preprocess", MODULE, "dsa_aot.kernels.cutedsl_bwd_postprocess")
    sources = module_sources(backend.source_modules(_spec(32)))
    # the module and what it builds on: a change in either changes this flavour's key
    assert {"dsa_aot/kernels/cutedsl_bwd_ws_slot_major.py",
            "dsa_aot/kernels/cutedsl_bwd_slot_major.py",
            "dsa_aot/kernels/cutedsl_bwd_main.py"} <= set(sources)
    # the fast mode's default at H32; the deterministic mode's default is the slot-major kernel
    assert backend.kernel_sources(_spec(32, flavour=None)) == backend.kernel_sources(_spec(32))
    for other in (_spec(32, flavour="wgmma_slot_major"),
                  _spec(32, flavour=None, deterministic=True)):
        assert "dsa_aot/kernels/cutedsl_bwd_ws_slot_major.py" not in module_sources(
            backend.source_modules(other))


@pytest.mark.parametrize("heads", BWD_SLOT_MAJOR_HEADS)
def test_only_the_fast_mode_defaults_to_the_flavour(heads: int) -> None:
    """A spec naming no flavour builds this kernel in the fast mode and the slot-major one in the
    deterministic mode (faster without atomics), on sm_90a; sm_100a keeps mma."""
    fast, det = (_request(576, heads, "noncompact", d, flavour=None) for d in (False, True))
    assert (fast.compile_params["impl"], det.compile_params["impl"]) == (IMPL, "wgmma_slot_major")
    assert (fast.impl, det.impl) == (None, None)  # the default: no flavour in the artifact name
    assert (bwd_main_default_impl("sm_100a", heads)
            == bwd_main_default_impl("sm_100a", heads, True) == "mma")


@pytest.mark.parametrize("kwargs,fragment", [
    ({"arch": "sm_100a"}, f"impl={IMPL} needs sm_90a, not sm_100a"),
    ({"heads": 64}, rf"impl={IMPL} supports heads \(16, 32\), not heads=64; use impl=wgmma_ws"),
    ({"heads": 128}, r"supports heads \(16, 32\), not heads=128"),
])
def test_what_the_flavour_cannot_build_is_refused(kwargs: dict, fragment: str) -> None:
    spec = _spec(**kwargs)
    with pytest.raises(ValueError, match=f"tile.flavour='{IMPL}' cannot be honoured.*{fragment}"):
        requests_for(spec, BWD_STAGES)
    with pytest.raises(ValueError, match=fragment):
        get_backend("cutedsl").check_spec(spec)
    request = dict(kernel="bwd_main", arch=kwargs.get("arch", "sm_90a"), d_qk=576,
                   heads=kwargs.get("heads", 16), layout="compact", impl=IMPL)
    with pytest.raises(ValueError, match=fragment):
        BuildRequest(**request)


def test_not_a_forward_flavour() -> None:
    with pytest.raises(ValueError, match=f"{IMPL} is a bwd_main flavour"):
        BuildRequest(kernel="fwd", arch="sm_90a", d_qk=576, heads=16, layout="compact", impl=IMPL)
    with pytest.raises(ValueError, match=f"tile.flavour='{IMPL}' is not a cutedsl fwd flavour"):
        requests_for(KernelSpec(op="fwd", arch="sm_90a", d_qk=576, heads=16, layout="compact",
                                backend="cutedsl", tile=TileConfig(flavour=IMPL)), ("fwd",))


def test_catalog_expands_a_block_of_the_flavour() -> None:
    block = {"ops": ["bwd"], "archs": ["sm_90a"], "d_qk": [512, 576], "heads": [16, 32],
             "layouts": ["compact"], "backends": ["cutedsl"], "tile": {"flavour": IMPL}}
    specs = Catalog.model_validate({"matrix": [block]}).specs()
    assert sorted((s.d_qk, s.heads, s.tile.flavour) for s in specs) == [
        (d, h, IMPL) for d in (512, 576) for h in (16, 32)]
    with pytest.raises(ValueError, match="not heads=64"):
        Catalog.model_validate({"matrix": [{**block, "heads": [64]}]}).specs()


# --------------------------------------------------------------------------------------------
# Kernel module (compiler needed)
# --------------------------------------------------------------------------------------------

_KERNEL_CHECKS = """
from dsa_aot.backends.cutedsl.records import BWD_MAIN_HEADS
from dsa_aot.kernels import cutedsl_bwd_ws_slot_major as k
from dsa_aot.kernels.cutedsl_bwd_main import compile_bwd_main
assert k.HEADS == BWD_MAIN_HEADS[k.IMPL], (k.HEADS, BWD_MAIN_HEADS)
try:
    compile_bwd_main('sm_90a', 576, 16, 'compact', impl=k.IMPL)
except ValueError as e:
    print('refused', e)
else:
    raise SystemExit('compile_bwd_main built the flavour')
assert k.can_implement(576, 16, 'compact') and k.can_implement(512, 32, 'noncompact')
assert not k.can_implement(576, 64, 'compact') and not k.can_implement(448, 16, 'compact')
for args, kw in [(('sm_100a', 576, 16, 'compact'), {}), (('sm_90a', 576, 64, 'compact'), {}),
                 (('sm_90a', 576, 32, 'compact'), {'impl': 'wgmma_slot_major'}),
                 (('sm_90a', 576, 16, 'compact'), {'deterministic': True, 'atomic_width': 2})]:
    try:
        k.compile_bwd_ws_slot_major(*args, **kw)
    except ValueError as e:
        print('refused', e)
    else:
        raise SystemExit('compiled %r %r' % (args, kw))
"""


@needs_cute_dsl
def test_kernel_refuses_what_it_cannot_build(tmp_path: Path) -> None:
    proc = run_dsl_script(_KERNEL_CHECKS, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    lines = proc.stdout.splitlines()
    assert len(lines) == 5, proc.stdout
    assert "impl='wgmma_ws_slot_major'" in lines[0] or "wgmma_ws_slot_major" in lines[0]
    assert "needs sm_90a, not sm_100a" in lines[1]
    assert "heads=64" in lines[2] and "supports heads (16, 32)" in lines[2]
    assert "this module builds impl='wgmma_ws_slot_major'" in lines[3]
    assert "atomic_width=2: the deterministic mode stores dKV rows" in lines[4]


_VIEW_CHECK = LAYOUT_DIFFER + """
import cutlass.cute as cute
from dsa_aot.kernels import cutedsl_bwd_ws_slot_major as k

@cute.jit
def check():
    for d in (512, 576):
        for h in k.HEADS:
            lay = k.ws_slot_major_smem_layouts(d, h)
            assert len({str(v.inner) for v in lay.values()}) == 1
            print("q", d, h, differ(lay["q"].outer, lay["q_t"].outer, h, d))
            print("p", d, h, differ(lay["p"].outer, lay["p_t"].outer, h, k.BLOCK_N))
            print("kv", d, h, differ(lay["kv"].outer, lay["kv_t"].outer, k.BLOCK_N, d))
            print("dout", d, h, differ(lay["dout"].outer, lay["dout_t"].outer, h, 512))
            _, storage = k.shared_storage(d, h)
            print("smem", d, h, storage.size_in_bytes())

check()
"""


@needs_cute_dsl
def test_operand_views_alias_the_tiles_and_shared_memory_fits(tmp_path: Path) -> None:
    """The MN-major views (``q_t``, ``dout_t``, ``kv_t``, ``p_t``) address exactly the K-major
    tiles' elements, under one swizzle; one CTA's shared memory (plus the 1 KiB the compiler
    reserves) fits an sm_90a CTA."""
    proc = run_dsl_script(_VIEW_CHECK, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines()]
    counts = [line for line in lines if line[0] in ("q", "p", "kv", "dout")]
    assert len(counts) == 16 and all(line[-1] == "0" for line in counts), proc.stdout
    smem = {(int(line[1]), int(line[2])): int(line[3]) for line in lines if line[0] == "smem"}
    assert len(smem) == 4 and max(smem.values()) + 1024 <= SMEM_LIMIT, smem
    # tiles: q, dout, one 64-slot KV tile, P and dS (bf16), plus indices, lse and delta
    tiles = 2 * (32 * 576 + 32 * 512 + 64 * 576 + 2 * 32 * 64)
    assert tiles <= smem[(576, 32)] <= tiles + 2048, smem


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[tuple, CuteExportRecord]]:
    if not HAS_CUTE_DSL:
        pytest.skip("needs nvidia-cutlass-dsl to compile")
    out = tmp_path_factory.mktemp("ws_slot_major")
    requests = [_request(*v) for v in VARIANTS]
    requests += [_request(*v, flavour="wgmma_slot_major") for v in TWINS]
    return out, {(r.d_qk, r.heads, r.layout, r.deterministic, r.impl): r
                 for r in build_cutedsl(requests, out)}


@needs_cute_dsl
def test_every_variant_builds_with_the_slot_major_abi(
        built: tuple[Path, dict[tuple, CuteExportRecord]]) -> None:
    out, records = built
    for d_qk, heads, layout, det in VARIANTS:
        rec = records[d_qk, heads, layout, det, IMPL]
        assert (rec.kernel, rec.arch) == ("bwd_main", "sm_90a")
        # the default's name in the fast mode, named apart in the deterministic mode
        suffix = f"_{IMPL}" if det else ""
        assert rec.name == (f"cutedsl_bwd_main_sm_90a_d{d_qk}_h{heads}_{layout}{suffix}"
                            + ("_det" if det else "") + "_static")
        header = (out / rec.name / rec.header).read_text()
        assert f"void *args[{len(rec.args) + 1}] = {{" in header
    for v in TWINS:
        twin = records[(*v, "wgmma_slot_major")]
        assert twin.name != records[(*v, IMPL)].name
        assert records[(*v, IMPL)].args == twin.args


@needs_cute_dsl
def test_cubins_spill_nothing(built: tuple[Path, dict[tuple, CuteExportRecord]]) -> None:
    """No local memory (spills) and at most 255 registers a thread (256 threads a CTA)."""
    out, records = built
    assert_spill_free(out / rec.name / rec.object_file
                      for rec in (records[(*v, IMPL)] for v in VARIANTS))


@needs_cute_dsl
def test_libraries_open_without_cutlass(built: tuple[Path, dict[tuple, CuteExportRecord]]) -> None:
    out, records = built
    names = open_without_cutlass(out / records[(*v, IMPL)].name for v in VARIANTS)
    assert len(names) == len(VARIANTS)
