"""The slot-major CuTe DSL backward main kernel (``impl=wgmma_slot_major``, sm_90a, H 16 / 32) on CPU.

Every (D 512 / 576) x (H 16 / 32) x (compact / noncompact) variant compiles, exports and links
for sm_90a through :func:`dsa_aot.backends.cutedsl.build.build_cutedsl`; its record and C ABI
equal the ``wgmma`` flavour's (same arguments, same descriptors), a fresh process opens it
without ``cutlass``, and the embedded cubin spills nothing (no local memory) within 255
registers. The shared-memory views the kernel reads as MN-major operands alias its K-major
tiles byte for byte, and one CTA's shared memory fits the 227 KiB of an sm_90a CTA. Requests,
specs and the kernel refuse other archs and other head counts by name;
a ``tile.flavour = "wgmma_slot_major"`` bwd spec builds through the production path. Numerics:
``tests/test_cutedsl_bwd_main.py -m gpu`` style GPU runs (not here).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_helpers import (HAS_CUTE_DSL, LAYOUT_DIFFER, assert_spill_free, needs_cute_dsl,
                         open_without_cutlass, run_dsl_script)
from dsa_aot.backends import get as get_backend
from dsa_aot.backends.cutedsl.build import BuildRequest, build_cutedsl, requests_for
from dsa_aot.backends.cutedsl.records import BWD_SLOT_MAJOR_HEADS, CuteExportRecord, bwd_main_default_impl
from dsa_aot.identity import can_key_builds
from dsa_aot.specs.catalog import Catalog
from dsa_aot.specs.models import KernelSpec, TileConfig
from dsa_aot.specs.toolchain import Toolchain

IMPL = "wgmma_slot_major"
BWD_STAGES = ("bwd_preprocess", "bwd_main", "bwd_postprocess")


#: (d_qk, heads, layout) of every slot-major variant
VARIANTS = [(d, h, lay) for d in (512, 576) for h in BWD_SLOT_MAJOR_HEADS
            for lay in ("compact", "noncompact")]
#: wgmma builds whose records the slot-major ones must equal
WGMMA_TWINS = [(576, 32, "compact"), (512, 16, "noncompact")]
SMEM_LIMIT = 227 * 1024


def _spec(heads: int = 16, arch: str = "sm_90a", flavour: str | None = IMPL, d_qk: int = 576,
          layout: str = "compact", **extra: object) -> KernelSpec:
    return KernelSpec(op="bwd", arch=arch, d_qk=d_qk, heads=heads, layout=layout,
                      backend="cutedsl", tile=TileConfig(flavour=flavour), **extra)


def _request(d_qk: int, heads: int, layout: str, flavour: str = IMPL) -> BuildRequest:
    (request,) = requests_for(_spec(heads, flavour=flavour, d_qk=d_qk, layout=layout),
                              ("bwd_main",), link="static_cudart")
    return request


def _name(d_qk: int, heads: int, layout: str, impl: str = IMPL) -> str:
    """The artifact name of a bwd_main request (the impl is named unless it is the default)."""
    suffix = "" if impl == bwd_main_default_impl("sm_90a", heads) else f"_{impl}"
    return f"cutedsl_bwd_main_sm_90a_d{d_qk}_h{heads}_{layout}{suffix}_static"


# --------------------------------------------------------------------------------------------
# Requests and specs (no compiler needed)
# --------------------------------------------------------------------------------------------

def test_flavour_becomes_the_main_stage_impl_and_names_the_artifact() -> None:
    pre, main, post = requests_for(_spec(32), BWD_STAGES)
    assert (main.impl, main.compile_params) == (IMPL, {"d_qk": 576, "heads": 32,
                                                       "layout": "compact", "impl": IMPL})
    assert (pre.impl, post.impl) == (None, None)
    get_backend("cutedsl").check_spec(_spec(16))


@pytest.mark.parametrize("kwargs,fragment", [
    ({"arch": "sm_100a"}, "impl=wgmma_slot_major needs sm_90a, not sm_100a"),
    ({"heads": 64}, r"impl=wgmma_slot_major supports heads \(16, 32\), not heads=64; use impl=wgmma"),
    ({"heads": 128}, r"supports heads \(16, 32\), not heads=128"),
])
def test_what_the_flavour_cannot_build_is_refused(kwargs: dict, fragment: str) -> None:
    spec = _spec(**kwargs)
    with pytest.raises(ValueError, match=f"tile.flavour='{IMPL}' cannot be honoured.*{fragment}"):
        requests_for(spec, BWD_STAGES)
    with pytest.raises(ValueError, match=fragment):
        get_backend("cutedsl").check_spec(spec)
    request = dict(kernel="bwd_main", arch=kwargs.get("arch", "sm_90a"), d_qk=576,
                   heads=kwargs.get("heads", 16), layout="compact", impl=IMPL,
                   deterministic=kwargs.get("deterministic", False))
    with pytest.raises(ValueError, match=fragment):
        BuildRequest(**request)


def test_not_a_forward_flavour() -> None:
    with pytest.raises(ValueError, match="wgmma_slot_major is a bwd_main flavour"):
        BuildRequest(kernel="fwd", arch="sm_90a", d_qk=576, heads=16, layout="compact", impl=IMPL)
    with pytest.raises(ValueError, match=f"tile.flavour='{IMPL}' is not a cutedsl fwd flavour"):
        requests_for(KernelSpec(op="fwd", arch="sm_90a", d_qk=576, heads=16, layout="compact",
                                backend="cutedsl", tile=TileConfig(flavour=IMPL)), ("fwd",))


def test_catalog_expands_a_slot_major_block() -> None:
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
from dsa_aot.backends.cutedsl.records import BWD_SLOT_MAJOR_HEADS
from dsa_aot.kernels import cutedsl_bwd_slot_major as k
from dsa_aot.kernels.cutedsl_bwd_main import compile_bwd_main
assert k.HEADS == BWD_SLOT_MAJOR_HEADS, (k.HEADS, BWD_SLOT_MAJOR_HEADS)
try:
    compile_bwd_main('sm_90a', 576, 16, 'compact', impl='wgmma_slot_major')
except ValueError as e:
    assert 'cutedsl_bwd_slot_major' in str(e), e
else:
    raise SystemExit('compile_bwd_main built the slot-major flavour')
assert k.can_implement(576, 16, 'compact') and k.can_implement(512, 32, 'noncompact')
assert not k.can_implement(576, 64, 'compact') and not k.can_implement(448, 16, 'compact')
for args, kw in [(('sm_100a', 576, 16, 'compact'), {}), (('sm_90a', 576, 64, 'compact'), {}),
                 (('sm_90a', 576, 128, 'noncompact'), {}),
                 (('sm_90a', 576, 16, 'compact'), {'deterministic': True, 'atomic_width': 2})]:
    try:
        k.compile_bwd_slot_major(*args, **kw)
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
    assert len(lines) == 4, proc.stdout
    assert "needs sm_90a, not sm_100a" in lines[0]
    assert "heads=64" in lines[1] and "supports heads (16, 32)" in lines[1]
    assert "heads=128" in lines[2]
    assert "atomic_width=2: the deterministic mode stores dKV rows" in lines[3]


_VIEW_CHECK = LAYOUT_DIFFER + """
import cutlass.cute as cute
from dsa_aot.kernels import cutedsl_bwd_slot_major as k

@cute.jit
def check():
    for d in (512, 576):
        for h in k.HEADS:
            lay = k.slot_major_smem_layouts(d, h)
            assert len({str(v.inner) for v in lay.values()}) == 1
            print("q", d, h, differ(lay["q"].outer, lay["q_t"].outer, h, d))
            print("ds", d, h, differ(lay["ds"].outer, lay["ds_t"].outer, h, k.SLOTS))
            print("kv", d, h, differ(lay["kv"].outer, lay["kv_t"].outer, k.SLOTS, d))
            print("dout", d, h, differ(lay["dout"].outer, lay["dout_t"].outer, h, 512))
            _, storage = k.shared_storage(d, h)
            print("smem", d, h, storage.size_in_bytes())

check()
"""


@needs_cute_dsl
def test_operand_views_alias_the_tiles_and_shared_memory_fits(tmp_path: Path) -> None:
    """The MN-major views (``q_t``, ``dout_t``, ``kv_t``, ``ds_t``) address exactly the K-major
    tiles' elements, under one swizzle; one CTA's shared memory (plus the 1 KiB the compiler
    reserves) fits an sm_90a CTA."""
    proc = run_dsl_script(_VIEW_CHECK, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines()]
    counts = [line for line in lines if line[0] in ("q", "ds", "kv", "dout")]
    assert len(counts) == 16 and all(line[-1] == "0" for line in counts), proc.stdout
    smem = {(int(line[1]), int(line[2])): int(line[3]) for line in lines if line[0] == "smem"}
    assert len(smem) == 4 and max(smem.values()) + 1024 <= SMEM_LIMIT, smem
    assert smem[(576, 32)] == max(smem.values())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, CuteExportRecord]]:
    if not HAS_CUTE_DSL:
        pytest.skip("needs nvidia-cutlass-dsl to compile")
    out = tmp_path_factory.mktemp("slot_major")
    requests = ([_request(*v) for v in VARIANTS]
                + [_request(*v, flavour="wgmma") for v in WGMMA_TWINS])
    return out, {r.name: r for r in build_cutedsl(requests, out)}


@needs_cute_dsl
def test_every_variant_builds_with_the_wgmma_abi(built: tuple[Path, dict[str, CuteExportRecord]]) -> None:
    out, records = built
    for d_qk, heads, layout in VARIANTS:
        rec = records[_name(d_qk, heads, layout)]
        assert (rec.kernel, rec.arch, rec.d_qk, rec.heads, rec.layout, rec.impl) == (
            "bwd_main", "sm_90a", d_qk, heads, layout, IMPL)
        assert not rec.deterministic and rec.kv_stages is None
        tensors = (["q", "kv", "dout", "topk_idxs"] + (["topk_length"] if layout == "compact" else [])
                   + ["lse_sink", "delta", "dq", "dkv_acc"])
        assert [a.name for a in rec.args] == tensors + ["softmax_scale", "stream"]
        header = (out / rec.name / rec.header).read_text()
        assert f"void *args[{len(rec.args) + 1}] = {{" in header
    for d_qk, heads, layout in WGMMA_TWINS:
        twin = records[_name(d_qk, heads, layout, "wgmma")]
        assert twin.impl == "wgmma"
        assert records[_name(d_qk, heads, layout)].args == twin.args


@needs_cute_dsl
def test_cubins_spill_nothing(built: tuple[Path, dict[str, CuteExportRecord]]) -> None:
    """No local memory (spills) and at most 255 registers a thread (256 threads a CTA)."""
    out, records = built
    assert_spill_free(out / rec.name / rec.object_file
                      for rec in (records[_name(*v)] for v in VARIANTS))


@needs_cute_dsl
def test_libraries_open_without_cutlass(built: tuple[Path, dict[str, CuteExportRecord]]) -> None:
    out, _ = built
    assert len(open_without_cutlass(out / _name(*v) for v in VARIANTS)) == len(VARIANTS)


_CANNOT_BUILD = can_key_builds(get_backend("cutedsl"), Toolchain.current())


@pytest.mark.skipif(_CANNOT_BUILD is not None, reason=f"cannot build: {_CANNOT_BUILD}")
def test_flavoured_bwd_spec_builds_through_the_backend(tmp_path: Path) -> None:
    """A real sm_90a build of a cutedsl backward whose tile names the slot-major flavour: the
    published manifest's main-stage record shows it; the other stages are the usual ones."""
    from dsa_aot.artifact import ArtifactManifest
    from dsa_aot.build import build_and_publish
    from dsa_aot.cache.store import ArtifactStore

    spec = _spec(16, layout="noncompact")
    store = ArtifactStore(tmp_path / "store")
    done = build_and_publish(store, spec, Toolchain.current())
    assert done.status == "built", done
    entry = store.lookup(done.manifest.key, spec.arch, spec.id)
    assert entry is not None and store.verify(entry) == []
    manifest = ArtifactManifest.model_validate(entry.meta.payload)
    assert manifest.spec == spec and manifest.spec.tile.flavour == IMPL
    records = {st.name: CuteExportRecord.model_validate(st.record) for st in manifest.stages}
    assert sorted(records) == sorted(BWD_STAGES)
    main = records["bwd_main"]
    assert (main.impl, main.heads, main.layout) == (IMPL, 16, "noncompact")
    assert main.name == _name(576, 16, "noncompact")  # the default flavour at H16: no suffix
    assert records["bwd_preprocess"].impl is None and records["bwd_postprocess"].impl is None
