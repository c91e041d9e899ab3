"""The warpgroups-by-role CuTe DSL backward main kernel (``impl=wgmma_ws``, sm_90a, H 64 / 128) on CPU.

A ``tile.flavour = "wgmma_ws"`` bwd spec becomes the main stage's impl, names its artifact apart
from the ``wgmma`` one (the suffix goes to whichever is not the default at H64 / H128) and keys
its build on the flavour's module; a spec without a flavour gets the default (``wgmma_ws``, at
H128 ``wgmma_ws_staggered``), a deterministic one too (in its deterministic mode); the forward's
own ``wgmma_ws`` flavour is left alone. Requests, specs, catalogs and the kernel module refuse
other archs and other head counts by name, and ``compile_bwd_main`` refuses to build the flavour.
The shared-memory views the kernel reads as MN-major operands alias its K-major tiles byte for
byte, and one CTA's shared memory fits the 227 KiB of an sm_90a CTA. Four variants (both D, both
H, both layouts) compile, export and link for sm_90a through
:func:`dsa_aot.backends.cutedsl.build.build_cutedsl`: their records and C ABI equal the
``wgmma`` flavour's (same arguments, same descriptors), a fresh process opens them without
``cutlass``, and the embedded cubins spill nothing (no local memory) within 255 registers.
Numerics: ``tests/unit/backends/cutedsl/test_cutedsl_bwd_main_kernel.py -m gpu``
(``DSA_AOT_GPU_TEST_IMPLS=wgmma_ws``), not here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_helpers import (HAS_CUTE_DSL, LAYOUT_DIFFER, assert_spill_free, needs_cute_dsl,
                         open_without_cutlass, run_dsl_script)
from dsa_aot.backends import get as get_backend
from dsa_aot.backends.cutedsl.build import BuildRequest, build_cutedsl, requests_for
from dsa_aot.backends.cutedsl.records import BWD_WS_HEADS, CuteExportRecord, bwd_main_default_impl
from dsa_aot.specs.catalog import Catalog
from dsa_aot.specs.models import KernelSpec, TileConfig
from dsa_aot.specs.sources import module_sources

IMPL = "wgmma_ws"
MODULE = "dsa_aot.kernels.cutedsl_bwd_ws"
BWD_STAGES = ("bwd_preprocess", "bwd_main", "bwd_postprocess")


#: (d_qk, heads, layout) of the variants built: every D, H and layout once, not their product
#: (each build is about 20 s of a CPU)
VARIANTS = [(576, 64, "compact"), (512, 128, "noncompact"), (576, 128, "noncompact"),
            (512, 64, "compact")]
#: the wgmma build whose record the wgmma_ws one must equal
WGMMA_TWINS = [(576, 64, "compact")]
#: the persistent mode (several query rows a CTA; noncompact only), same ABI as wgmma_ws
PERSISTENT = "wgmma_ws_persistent"
PERSISTENT_VARIANTS = [(576, 128, "noncompact")]
#: H128 with a row's second head block starting mid-row, same ABI as wgmma_ws
STAGGERED = "wgmma_ws_staggered"
STAGGERED_VARIANTS = [(512, 128, "compact")]
SMEM_LIMIT = 227 * 1024


def _spec(heads: int = 64, arch: str = "sm_90a", flavour: str | None = IMPL, d_qk: int = 576,
          layout: str = "compact", op: str = "bwd", **extra: object) -> KernelSpec:
    return KernelSpec(op=op, arch=arch, d_qk=d_qk, heads=heads, layout=layout,
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
    backend = get_backend("cutedsl")
    pre, main, post = requests_for(_spec(128, d_qk=512, layout="noncompact"), BWD_STAGES)
    assert (main.impl, main.compile_params) == (IMPL, {"d_qk": 512, "heads": 128,
                                                       "layout": "noncompact", "impl": IMPL})
    assert (pre.impl, post.impl) == (None, None)
    backend.check_spec(_spec(64))
    # builds of one shape with different flavours never share a name: a flavour other than the
    # heads' default is suffixed
    for heads in BWD_WS_HEADS:
        default = bwd_main_default_impl("sm_90a", heads)
        base = f"cutedsl_bwd_main_sm_90a_d512_h{heads}_noncompact"
        impls = {IMPL, "wgmma", default}
        assert {_name(512, heads, "noncompact", impl) for impl in impls} == {
            f"{base}_static" if impl == default else f"{base}_{impl}_static" for impl in impls}
        assert len(impls) == len({_name(512, heads, "noncompact", impl) for impl in impls})
    # the build key follows the flavour's module (and the wgmma kernel it builds on)
    assert backend.kernel_sources(_spec(64)) == (
        "dsa_aot.kernels.cutedsl_bwd_preprocess", MODULE, "dsa_aot.kernels.cutedsl_bwd_postprocess")
    sources = module_sources(backend.source_modules(_spec(64)))
    assert {"dsa_aot/kernels/cutedsl_bwd_ws.py", "dsa_aot/kernels/cutedsl_bwd_main.py"} <= set(sources)
    assert "dsa_aot/kernels/cutedsl_bwd_ws.py" not in module_sources(
        backend.source_modules(_spec(64, flavour="wgmma")))


@pytest.mark.parametrize("heads", BWD_WS_HEADS)
def test_specs_without_a_flavour_at_its_heads(heads: int) -> None:
    """Without a flavour the main stage gets the arch's default at these heads (built by its own
    module), in the deterministic backward too."""
    backend = get_backend("cutedsl")
    default = bwd_main_default_impl("sm_90a", heads)
    assert default == (STAGGERED if heads == 128 else IMPL)
    spec = _spec(heads, flavour=None)
    _, main, _ = requests_for(spec, BWD_STAGES)
    assert (main.impl, main.compile_params["impl"]) == (None, default)
    assert MODULE in backend.kernel_sources(spec)
    det = _spec(heads, flavour=None, deterministic=True)
    backend.check_spec(det)
    _, main, _ = requests_for(det, BWD_STAGES)
    assert main.deterministic and main.compile_params["impl"] == default
    assert MODULE in backend.kernel_sources(det)


@pytest.mark.parametrize("kwargs,fragment", [
    ({"arch": "sm_100a"}, "impl=wgmma_ws needs sm_90a, not sm_100a"),
    ({"heads": 16}, r"impl=wgmma_ws supports heads \(64, 128\), not heads=16; "
                    r"use impl=wgmma_ws_slot_major \(or leave impl unset\)"),
    ({"heads": 32}, r"supports heads \(64, 128\), not heads=32"),
])
def test_what_the_flavour_cannot_build_is_refused(kwargs: dict, fragment: str) -> None:
    spec = _spec(**kwargs)
    with pytest.raises(ValueError, match=f"tile.flavour='{IMPL}' cannot be honoured.*{fragment}"):
        requests_for(spec, BWD_STAGES)
    with pytest.raises(ValueError, match=fragment):
        get_backend("cutedsl").check_spec(spec)
    request = dict(kernel="bwd_main", arch=kwargs.get("arch", "sm_90a"), d_qk=576,
                   heads=kwargs.get("heads", 64), layout="compact", impl=IMPL,
                   deterministic=kwargs.get("deterministic", False))
    with pytest.raises(ValueError, match=fragment):
        BuildRequest(**request)


def test_the_forward_keeps_its_own_wgmma_ws() -> None:
    """``wgmma_ws`` names a forward flavour too: a fwd spec naming it is the forward's (built by
    the forward's module, at any head count), untouched by the backward flavour's limits."""
    backend = get_backend("cutedsl")
    for heads in (16, 128):
        spec = _spec(heads, op="fwd")
        (fwd,) = requests_for(spec, ("fwd",))
        assert (fwd.kernel, fwd.impl, fwd.compile_params["impl"]) == ("fwd", IMPL, IMPL)
        assert backend.kernel_sources(spec) == ("dsa_aot.kernels.cutedsl_fwd_ws",)
        backend.check_spec(spec)


def test_catalog_expands_a_ws_block() -> None:
    block = {"ops": ["bwd"], "archs": ["sm_90a"], "d_qk": [512, 576], "heads": [64, 128],
             "layouts": ["noncompact"], "backends": ["cutedsl"], "tile": {"flavour": IMPL}}
    specs = Catalog.model_validate({"matrix": [block]}).specs()
    assert sorted((s.d_qk, s.heads, s.layout, s.tile.flavour) for s in specs) == [
        (d, h, "noncompact", IMPL) for d in (512, 576) for h in (64, 128)]
    with pytest.raises(ValueError, match="not heads=16"):
        Catalog.model_validate({"matrix": [{**block, "heads": [16]}]}).specs()


# --------------------------------------------------------------------------------------------
# Kernel module (compiler needed)
# --------------------------------------------------------------------------------------------

_KERNEL_CHECKS = """
from dsa_aot.backends.cutedsl.records import BWD_WS_HEADS
from dsa_aot.kernels import cutedsl_bwd_ws as k
from dsa_aot.kernels.cutedsl_bwd_main import compile_bwd_main
assert (k.IMPL, k.HEADS) == ('wgmma_ws', BWD_WS_HEADS), (k.IMPL, k.HEADS, BWD_WS_HEADS)
try:
    compile_bwd_main('sm_90a', 576, 64, 'compact', impl='wgmma_ws')
except ValueError as e:
    print('main', e)
else:
    raise SystemExit('compile_bwd_main built the wgmma_ws flavour')
assert k.can_implement(576, 64, 'compact') and k.can_implement(512, 128, 'noncompact')
assert not k.can_implement(576, 16, 'compact') and not k.can_implement(576, 32, 'compact')
assert not k.can_implement(448, 64, 'compact') and not k.can_implement(576, 64, 'paged')
for args, kw in [(('sm_100a', 576, 64, 'compact'), {}), (('sm_90a', 576, 16, 'compact'), {}),
                 (('sm_90a', 512, 32, 'noncompact'), {}),
                 (('sm_90a', 576, 64, 'compact'), {'deterministic': True, 'atomic_width': 2}),
                 (('sm_90a', 576, 64, 'compact'), {'impl': 'wgmma'})]:
    try:
        k.compile_bwd_ws(*args, **kw)
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
    assert len(lines) == 6, proc.stdout
    # compile_bwd_main builds mma / wgmma only and names the module that builds this flavour
    assert lines[0].startswith("main ") and "impl='wgmma_ws'" in lines[0], lines[0]
    assert "this module builds ('mma', 'wgmma')" in lines[0], lines[0]
    assert "dsa_aot.kernels.cutedsl_bwd_ws.compile_bwd_ws" in lines[0], lines[0]
    assert "needs sm_90a, not sm_100a" in lines[1]
    assert "heads=16" in lines[2] and "supports heads (64, 128)" in lines[2]
    assert "impl='wgmma_ws_slot_major'" in lines[2]
    assert "heads=32" in lines[3]
    assert "atomic_width=2: the deterministic mode stores dKV rows" in lines[4]
    assert "this module builds impl='wgmma_ws'" in lines[5]


_VIEW_CHECK = LAYOUT_DIFFER + """
import cutlass.cute as cute
from dsa_aot.kernels import cutedsl_bwd_ws as k

@cute.jit
def check():
    for d in (512, 576):
        lay = k.ws_smem_layouts(d)
        assert len({str(v.inner) for v in lay.values()}) == 1
        print("q", d, differ(lay["q"].outer, lay["q_t"].outer, 64, d))
        print("dout", d, differ(lay["dout"].outer, lay["dout_t"].outer, 64, 512))
        print("kv", d, differ(lay["kv"].outer, lay["kv_t"].outer, 64, d))
        print("p", d, differ(lay["p"].outer, lay["p_t"].outer, 64, 64))
        _, storage = k.shared_storage(d)
        print("smem", d, storage.size_in_bytes())

check()
"""


@needs_cute_dsl
def test_operand_views_alias_the_tiles_and_shared_memory_fits(tmp_path: Path) -> None:
    """The MN-major views (``q_t``, ``dout_t``, ``kv_t``, ``p_t``) address exactly the K-major
    tiles' elements, under one swizzle; one CTA's shared memory (plus the 1 KiB the compiler
    reserves) holds the five bf16 tiles and fits an sm_90a CTA."""
    proc = run_dsl_script(_VIEW_CHECK, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines()]
    counts = [line for line in lines if line[0] in ("q", "dout", "kv", "p")]
    assert len(counts) == 8 and all(line[-1] == "0" for line in counts), proc.stdout
    smem = {int(line[1]): int(line[2]) for line in lines if line[0] == "smem"}
    assert sorted(smem) == [512, 576], proc.stdout
    for d, size in smem.items():
        tiles = 2 * (64 * d + 64 * 512 + 64 * d + 2 * 64 * 64)  # q, dout, kv, P, dS (bf16)
        assert tiles <= size and size + 1024 <= SMEM_LIMIT, (d, size)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, CuteExportRecord]]:
    if not HAS_CUTE_DSL:
        pytest.skip("needs nvidia-cutlass-dsl to compile")
    out = tmp_path_factory.mktemp("bwd_ws")
    requests = ([_request(*v) for v in VARIANTS]
                + [_request(*v, flavour="wgmma") for v in WGMMA_TWINS]
                + [_request(*v, flavour=PERSISTENT) for v in PERSISTENT_VARIANTS]
                + [_request(*v, flavour=STAGGERED) for v in STAGGERED_VARIANTS])
    return out, {r.name: r for r in build_cutedsl(requests, out)}


@needs_cute_dsl
def test_every_variant_builds_with_the_wgmma_abi(built: tuple[Path, dict[str, CuteExportRecord]]) -> None:
    out, records = built
    assert sorted(records) == sorted([_name(*v) for v in VARIANTS]
                                     + [_name(*v, impl="wgmma") for v in WGMMA_TWINS]
                                     + [_name(*v, impl=PERSISTENT) for v in PERSISTENT_VARIANTS]
                                     + [_name(*v, impl=STAGGERED) for v in STAGGERED_VARIANTS])
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
        assert b"kernel_ws" in (out / rec.name / rec.object_file).read_bytes()  # this module's kernel
    for d_qk, heads, layout in WGMMA_TWINS:
        twin = records[_name(d_qk, heads, layout, "wgmma")]
        assert twin.impl == "wgmma"
        assert b"kernel_ws" not in (out / twin.name / twin.object_file).read_bytes()
        assert records[_name(d_qk, heads, layout)].args == twin.args
    for d_qk, heads, layout in PERSISTENT_VARIANTS:  # same arguments, its own kernel
        rec = records[_name(d_qk, heads, layout, PERSISTENT)]
        assert (rec.impl, rec.deterministic) == (PERSISTENT, False)
        assert rec.args == records[_name(d_qk, heads, layout)].args
        obj = (out / rec.name / rec.object_file).read_bytes()
        assert b"kernel_persistent" in obj and b"kernel_ws" not in obj
    for d_qk, heads, layout in STAGGERED_VARIANTS:  # same arguments, the same entry kernel
        rec = records[_name(d_qk, heads, layout, STAGGERED)]
        assert (rec.impl, rec.deterministic) == (STAGGERED, False)
        twin = next(records[_name(*v)] for v in VARIANTS if v[2] == layout)
        assert [a.name for a in rec.args] == [a.name for a in twin.args]
        assert b"kernel_ws" in (out / rec.name / rec.object_file).read_bytes()


@needs_cute_dsl
def test_cubins_spill_nothing(built: tuple[Path, dict[str, CuteExportRecord]]) -> None:
    """No local memory (spills) and at most 255 registers a thread (256 threads a CTA)."""
    out, records = built
    assert_spill_free(out / rec.name / rec.object_file
                      for rec in ([records[_name(*v)] for v in VARIANTS]
                                  + [records[_name(*v, impl=PERSISTENT)]
                                     for v in PERSISTENT_VARIANTS]
                                  + [records[_name(*v, impl=STAGGERED)]
                                     for v in STAGGERED_VARIANTS]))


@needs_cute_dsl
def test_libraries_open_without_cutlass(built: tuple[Path, dict[str, CuteExportRecord]]) -> None:
    out, _ = built
    assert len(open_without_cutlass(out / _name(*v) for v in VARIANTS)) == len(VARIANTS)


@pytest.mark.parametrize("impl,kwargs,fragment", [
    (PERSISTENT, {"layout": "compact"}, "fast mode of the noncompact layout, not layout=compact"),
    (PERSISTENT, {"deterministic": True}, "impl=wgmma_ws_persistent has no deterministic bwd_main"),
    (PERSISTENT, {"heads": 32},
     r"supports heads \(64, 128\), not heads=32; use impl=wgmma_ws_slot_major"),
    (STAGGERED, {"heads": 64}, r"supports heads \(128,\), not heads=64; use impl=wgmma_ws"),
])
def test_what_the_fast_variants_cannot_build_is_refused(impl: str, kwargs: dict,
                                                       fragment: str) -> None:
    """The persistent mode is the noncompact layout's fast mode at H64/H128, the staggered order
    is built at H128 only: anything else is refused by name, by the build request and by the
    spec check."""
    request = dict(kernel="bwd_main", arch="sm_90a", d_qk=576, heads=128, layout="noncompact",
                   impl=impl) | kwargs
    with pytest.raises(ValueError, match=fragment):
        BuildRequest(**request)
    spec = _spec(flavour=impl, **({"layout": "noncompact", "heads": 128} | kwargs))
    with pytest.raises(ValueError, match=fragment):
        get_backend("cutedsl").check_spec(spec)


# --------------------------------------------------------------------------------------------
# GPU: the persistent mode against wgmma_ws and the reference
# --------------------------------------------------------------------------------------------

def _loaded_bwd(d_qk: int, heads: int, flavour: str | None):
    """A noncompact cutedsl bwd through the production loader (a prebuilt or cached artifact),
    else built and published into the loader's writable cache."""
    from dsa_aot.build import build_and_publish
    from dsa_aot.loader import get_loader

    spec = _spec(heads, flavour=flavour, d_qk=d_qk, layout="noncompact")
    loader = get_loader()
    hit = loader.try_load(spec, 0)
    if hit is not None:
        return hit[0]
    store = loader.writable_store()
    done = build_and_publish(store, spec, loader.toolchain())
    return get_backend("cutedsl").load(done.manifest, done.read(store), 0)


def _rel(x, ref) -> float:
    ref = ref.double()
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("impl,s_q,heads,d_qk,topk", [
    (PERSISTENT, 531, 64, 576, 256),    # two rows a CTA, the last CTA one
    (PERSISTENT, 800, 128, 512, 128),   # three rows a CTA (two head blocks), the last CTA two
    (PERSISTENT, 1057, 64, 512, 192),   # four rows a CTA (topk not 64k), the last CTA one
    (PERSISTENT, 1100, 128, 576, 64),   # four rows a CTA, one block a row
    (PERSISTENT, 40, 64, 576, 320),     # one row a CTA
    (STAGGERED, 300, 128, 576, 320),    # five blocks: head block 1 starts at block 2
    (STAGGERED, 64, 128, 512, 100),     # two blocks, the second partly padding
])
def test_gpu_fast_variants_match_wgmma_ws(impl: str, s_q: int, heads: int, d_qk: int,
                                          topk: int) -> None:
    """The persistent mode (several query rows a CTA) gives wgmma_ws's dq bit for bit (each
    row's dQ is a register sum in the same order), the staggered one (blocks in another order)
    up to rounding; both give its dkv and d_sink up to the atomics' order, and match the fp64
    reference. Random inputs, padded rows (-1, out-of-range indices), a row without a valid
    slot; the outputs are the runtime's own (NaN fails the checks)."""
    import torch

    from dsa_aot.kernels.reference import sparse_mla_bwd_ref, sparse_mla_fwd_ref

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    g = torch.Generator(device="cuda").manual_seed(s_q)
    s_kv = 3000
    q = torch.randn(s_q, heads, d_qk, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(s_kv, d_qk, device="cuda", generator=g).to(torch.bfloat16)
    dout = torch.randn(s_q, heads, 512, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, topk), device="cuda", generator=g, dtype=torch.int32)
    bad = torch.tensor([-1, s_kv, -(2**31)], device="cuda", dtype=torch.int32)
    where = torch.rand(s_q, topk, device="cuda", generator=g) < 0.1
    idx = torch.where(where, bad[torch.randint(0, 3, (s_q, topk), device="cuda", generator=g)], idx)
    keep = torch.randint(0, topk + 1, (s_q,), device="cuda", generator=g)  # padded tails
    idx = torch.where(torch.arange(topk, device="cuda")[None, :] < keep[:, None], idx, -1)
    idx[s_q // 2] = -1  # a row without a valid slot, mid-CTA
    sink = torch.randn(heads, device="cuda", generator=g)
    scale = d_qk ** -0.5
    out, lse = sparse_mla_fwd_ref(q, kv, idx, None, sink, scale)
    out, lse = out.to(torch.bfloat16), lse.float()
    args = (q, kv, out, dout, lse, idx, None, sink, scale)
    dq_ref, dkv_ref, dsink_ref = sparse_mla_bwd_ref(*args)
    base = _loaded_bwd(d_qk, heads, IMPL)(*args)  # named: the H128 default is the staggered one
    got = _loaded_bwd(d_qk, heads, impl)(*args)
    torch.cuda.synchronize()
    for x in (*base, *got):
        assert torch.isfinite(x).all()
    if impl == PERSISTENT:
        assert torch.equal(got[0], base[0])
    assert _rel(got[0], base[0]) < 1e-2
    assert _rel(got[1], base[1]) < 1e-3 and _rel(got[2], base[2]) < 1e-3
    for x, ref in zip(got, (dq_ref, dkv_ref, dsink_ref)):
        assert _rel(x, ref) < 2e-2
    assert torch.count_nonzero(got[0][s_q // 2]).item() == 0


_L2_POLICY_BUILD = """
import glob, os, sys
from dsa_aot.kernels import cutedsl_bwd_main as main, cutedsl_bwd_ws as k
main.SparseMlaBwdMain.KV_EVICT_LAST = sys.argv[1] == "on"
k.SparseMlaBwdWs.STREAM_EVICT_FIRST = sys.argv[1] == "on"
k.compile_bwd_ws("sm_90a", 512, 64, "noncompact")
ptx = [p for p in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx")) if "bwd_ws" in p]
text = open(ptx[0]).read()
print(text.count("createpolicy.fractional.L2::evict_first"), text.count("createpolicy.fractional.L2::evict_last"),
      text.count("cp.async.cg.shared.global.L2::cache_hint"), text.count("st.global.L2::cache_hint.b32"),
      text.count("cp.async.cg.shared.global ["))
"""


@needs_cute_dsl
@pytest.mark.parametrize("switch", ["on", "off"])
def test_l2_policies_reach_the_ptx_only_when_switched_on(tmp_path: Path, monkeypatch, switch: str) -> None:
    """``STREAM_EVICT_FIRST`` puts an evict-first policy on every q / dout row copy and dQ store,
    ``KV_EVICT_LAST`` an evict-last one on every KV gather copy; off (the default), the copies
    and stores carry none."""
    monkeypatch.setenv("CUTE_DSL_KEEP_PTX", "1")
    monkeypatch.setenv("CUTE_DSL_DUMP_DIR", str(tmp_path))
    script = tmp_path / "l2.py"
    script.write_text(_L2_POLICY_BUILD)
    import os
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, str(script), switch], capture_output=True, text=True,
                          env=dict(os.environ, CUTE_DSL_ARCH="sm_90a"), timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last, hinted_copies, hinted_stores, plain_copies = map(int, proc.stdout.split())
    if switch == "off":
        assert (first, last, hinted_copies, hinted_stores) == (0, 0, 0, 0) and plain_copies > 0
        return
    # D512: q and dout, 8 column tiles each, 2 rows a thread, and the gather's 8 tiles x 2 rows in
    # each place it is issued; dQ: each warpgroup's code stores 64 x 256 values / 128 threads,
    # two a store
    assert first >= 1 and last >= 1 and plain_copies == 0, proc.stdout
    assert hinted_copies >= 2 * 16 + 16 and hinted_stores == 2 * (64 * 256 // 128 // 2), proc.stdout


_DQ_STAGED_BUILD = """
import glob, os, sys
from dsa_aot.kernels import cutedsl_bwd_ws as ws, cutedsl_bwd_ws_slot_major as sm
heads = int(sys.argv[2])
if sys.argv[1] == "on":
    sm.compile_bwd_dq_lines("sm_90a", 576, heads, "noncompact")
elif heads in ws.HEADS:
    ws.compile_bwd_ws("sm_90a", 576, heads, "noncompact")
else:
    sm.compile_bwd_ws_slot_major("sm_90a", 576, heads, "noncompact")
ptx = [p for p in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx")) if "bwd_ws" in p]
text = open(ptx[0]).read()
print(text.count("ld.shared.v4.b32"), text.count("st.global.v4.b32"),
      text.count("st.global.b32") + text.count("st.global.b16"))
"""


@needs_cute_dsl
@pytest.mark.parametrize(("switch", "heads"), [("on", 64), ("off", 64), ("on", 128), ("on", 16),
                                               ("off", 16), ("on", 32)])
def test_dq_lines_flavour_stores_whole_lines(tmp_path: Path, monkeypatch, switch: str,
                                             heads: int) -> None:
    """``impl=wgmma_ws_dq_lines`` (``DQ_STAGED``) stores dQ 16 bytes a lane after a round through
    shared memory (D576: 9 column tiles, 16 rows of 8 lanes a pass, 4 passes at H64/H128, one per
    16 heads at H16/H32); the defaults store 4 bytes per column pair (``wgmma_ws``) or 2 bytes
    an element (``wgmma_ws_slot_major``, ``dQ^T`` in the accumulators)."""
    monkeypatch.setenv("CUTE_DSL_KEEP_PTX", "1")
    monkeypatch.setenv("CUTE_DSL_DUMP_DIR", str(tmp_path))
    script = tmp_path / "dq.py"
    script.write_text(_DQ_STAGED_BUILD)
    import os
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, str(script), switch, str(heads)], capture_output=True,
                          text=True, env=dict(os.environ, CUTE_DSL_ARCH="sm_90a"), timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loads, wide_stores, narrow_stores = map(int, proc.stdout.split())
    tiles = 576 // 64
    cta_heads = min(heads, 64)
    if switch == "off":
        values_a_thread = 64 * cta_heads // 128  # a 64-column tile of the CTA's heads
        per_store = 2 if heads >= 64 else 1
        assert (loads, wide_stores, narrow_stores) == (0, 0, tiles * values_a_thread // per_store)
    else:
        passes = 4 if heads >= 64 else cta_heads // 16
        assert (loads, wide_stores, narrow_stores) == (tiles * passes, tiles * passes, 0)


_SW128_CHECK = """
import cutlass.cute as cute
from dsa_aot.kernels import cutedsl_bwd_ws as k
from dsa_aot.kernels.cutedsl_common import sw128_offset

def run_checks():  # plain Python loops, called while tracing (a jit body's loops are the kernel's)
    for d in (512, 576):
        lay = k.ws_smem_layouts(d, 16)["kv"]
        print("swizzle", str(lay.inner))
        bad = 0
        for r in range(k.BLOCK_N):
            for tile in range(d // 64):
                for c in range(8):
                    linear = 2 * lay.outer((r, tile * 64 + c * 8))  # bytes, before the swizzle
                    swizzled = linear ^ (((linear >> 7) & 7) << 4)  # S<3,4,3> on byte addresses
                    bad += swizzled != tile * k.BLOCK_N * 128 + sw128_offset(r, c)
        print("bad", d, bad)

@cute.jit
def check():
    run_checks()

check()
"""


@needs_cute_dsl
def test_staged_dq_addresses_are_the_kv_tiles_swizzled_rows(tmp_path: Path) -> None:
    """The staged dQ read-back (``sw128_offset`` + 8 KiB a column tile) addresses exactly the KV
    tile's element ``[row, tile * 64 + chunk * 8]`` under its 128-byte swizzle, the one the
    ``dQ`` tiles are written through (the tile is 1 KiB aligned, so the byte address's bits 7-9
    are the row's)."""
    proc = run_dsl_script(_SW128_CHECK, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert [line[1] for line in lines if line[0] == "swizzle"] == ["S<3,4,3>"] * 2, proc.stdout
    assert [line[2] for line in lines if line[0] == "bad"] == ["0", "0"], proc.stdout
