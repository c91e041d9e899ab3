"""A spec's ``tile`` drives the CuTe DSL build: ``requests_for`` maps ``tile.flavour`` and
``tile.num_stages`` onto the worker requests and refuses what the kernels cannot honour, the
catalog refuses such a block when it expands, and a non-default flavour compiles into the
manifest (a real sm_90a build, no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsa_aot.backends import BuildError
from dsa_aot.backends import get as get_backend
from dsa_aot.backends.cutedsl.build import requests_for
from dsa_aot.backends.cutedsl.records import (bwd_main_default_impl, FWD_DEFAULT_IMPL, FWD_DEFAULT_KV_STAGES,
                                              CuteExportRecord)
from dsa_aot.cache.store import ArtifactStore
from dsa_aot.identity import can_key_builds
from dsa_aot.specs.catalog import Catalog, load_catalog
from dsa_aot.specs.models import KernelSpec, TileConfig
from dsa_aot.specs.toolchain import Toolchain

BWD_STAGES = ("bwd_preprocess", "bwd_main", "bwd_postprocess")


def _spec(op: str, arch: str = "sm_90a", layout: str = "compact", **tile: object) -> KernelSpec:
    return KernelSpec(op=op, arch=arch, d_qk=576, heads=64, layout=layout, backend="cutedsl",
                      tile=TileConfig(**tile))


def test_default_tile_leaves_the_kernel_defaults() -> None:
    (fwd,) = requests_for(_spec("fwd"), ("fwd",))
    assert (fwd.kernel, fwd.arch, fwd.d_qk, fwd.heads, fwd.layout) == ("fwd", "sm_90a", 576, 64, "compact")
    assert (fwd.impl, fwd.kv_stages, fwd.link) == (None, None, "static_cudart")
    impl = FWD_DEFAULT_IMPL["sm_90a"]
    assert fwd.compile_params == {"d_qk": 576, "heads": 64, "layout": "compact", "impl": impl,
                                  "kv_stages": FWD_DEFAULT_KV_STAGES[impl]}
    pre, main, post = requests_for(_spec("bwd"), BWD_STAGES, use_isfinite=False)
    assert [r.kernel for r in (pre, main, post)] == list(BWD_STAGES)
    assert (main.impl, main.compile_params["impl"]) == (None, bwd_main_default_impl("sm_90a", 64))
    assert pre.use_isfinite is False and pre.impl is None and post.impl is None
    assert post.compile_params == {}


@pytest.mark.parametrize("flavour,num_stages", [("mma", 1), ("mma", 2), ("wgmma", 1), ("wgmma", 2),
                                                ("wgmma_pipe", None), ("wgmma_ws", 2),
                                                ("wgmma_split", None)])
def test_fwd_flavour_and_num_stages_become_impl_and_kv_stages(flavour: str, num_stages: int | None) -> None:
    (req,) = requests_for(_spec("fwd", flavour=flavour, num_stages=num_stages), ("fwd",))
    assert (req.impl, req.kv_stages) == (flavour, num_stages)
    assert req.compile_params["impl"] == flavour
    assert req.compile_params["kv_stages"] == (num_stages or FWD_DEFAULT_KV_STAGES[flavour])


#: The forward's kernel module per flavour: one kernel class each, over the shared module.
FWD_MODULES = {"mma": "cutedsl_fwd_mma", "wgmma": "cutedsl_fwd_wgmma",
               "wgmma_pipe": "cutedsl_fwd_wgmma", "wgmma_ws": "cutedsl_fwd_ws",
               "wgmma_split": "cutedsl_fwd_split"}


@pytest.mark.parametrize("flavour", [*FWD_MODULES, None])
def test_fwd_flavour_keys_its_own_module(flavour: str | None) -> None:
    """A forward spec's key and runtime identity cover its flavour's module and what that
    imports (the shared forward module, the common helpers), not the other flavours'."""
    from dsa_aot.specs.sources import module_sources

    backend = get_backend("cutedsl")
    spec = _spec("fwd", flavour=flavour)
    module = FWD_MODULES[flavour or FWD_DEFAULT_IMPL["sm_90a"]]
    assert backend.kernel_sources(spec) == (f"dsa_aot.kernels.{module}",)
    kernels = {name for name in module_sources(backend.source_modules(spec))
               if name.startswith("dsa_aot/kernels/cutedsl_")}
    assert kernels == {f"dsa_aot/kernels/{module}.py", "dsa_aot/kernels/cutedsl_fwd.py",
                       "dsa_aot/kernels/cutedsl_common.py"}


@pytest.mark.parametrize("flavour", ["mma", "wgmma", "wgmma_ws"])
def test_bwd_flavour_becomes_the_main_stage_impl(flavour: str) -> None:
    pre, main, post = requests_for(_spec("bwd", flavour=flavour), BWD_STAGES)
    assert main.impl == flavour and main.compile_params["impl"] == flavour
    assert (pre.impl, post.impl) == (None, None)  # the flavour is the main stage's alone


@pytest.mark.parametrize("op,tile,fragment", [
    ("fwd", {"block_i": 32}, "tile.block_i=32"),
    ("bwd", {"block_i": 64}, "tile.block_i=64"),
    ("fwd", {"threads": 256}, "tile.threads=256"),
    ("bwd", {"threads": 384}, "tile.threads=384"),
    ("fwd", {"flavour": "tiled"}, "tile.flavour='tiled'"),
    ("bwd", {"flavour": "wgmma_pipe"}, "tile.flavour='wgmma_pipe'"),  # a forward flavour
    ("bwd", {"num_stages": 2}, "tile.num_stages=2"),
    ("fwd", {"num_stages": 3}, "tile.num_stages=3"),
])
def test_fields_the_kernels_cannot_honour_are_refused(op: str, tile: dict, fragment: str) -> None:
    spec = _spec(op, **tile)
    stages = ("fwd",) if op == "fwd" else BWD_STAGES
    with pytest.raises(ValueError, match=fragment):
        requests_for(spec, stages)
    backend = get_backend("cutedsl")
    with pytest.raises(ValueError, match=fragment):
        backend.check_spec(spec)
    assert fragment in backend.unsupported_reason(spec, None)
    with pytest.raises(BuildError, match=fragment):  # refused before any worker starts
        backend.build(spec)


@pytest.mark.parametrize("op,flavour", [("fwd", "wgmma"), ("fwd", "wgmma_ws"), ("fwd", "wgmma_split"),
                                        ("bwd", "wgmma")])
def test_a_hopper_flavour_is_refused_for_sm_100a(op: str, flavour: str) -> None:
    spec = _spec(op, arch="sm_100a", flavour=flavour)
    with pytest.raises(ValueError, match=f"{spec.id}: tile.flavour='{flavour}' cannot be honoured.*"
                                         f"impl={flavour} needs sm_90a, not sm_100a"):
        get_backend("cutedsl").check_spec(spec)


def test_fwd_flavour_needing_two_kv_stages_is_refused_with_one() -> None:
    spec = _spec("fwd", flavour="wgmma_ws", num_stages=1)
    with pytest.raises(ValueError, match="tile.flavour='wgmma_ws', tile.num_stages=1 cannot be honoured.*"
                                         "impl=wgmma_ws needs kv_stages=2"):
        requests_for(spec, ("fwd",))


def _block(tile: dict, ops: tuple[str, ...] = ("fwd",), backends: tuple[str, ...] = ("cutedsl",)) -> dict:
    return {"ops": list(ops), "archs": ["sm_90a"], "d_qk": [576], "heads": [64], "layouts": ["compact"],
            "backends": list(backends), "tile": tile}


@pytest.mark.parametrize("tile,ops,fragment", [
    ({"block_i": 32}, ("fwd",), "tile.block_i=32"),
    ({"threads": 256}, ("bwd",), "tile.threads=256"),
    ({"flavour": "tiled"}, ("fwd",), "tile.flavour='tiled'"),
    ({"num_stages": 2}, ("bwd",), "tile.num_stages=2"),
])
def test_catalog_expansion_refuses_the_block(tile: dict, ops: tuple[str, ...], fragment: str,
                                             tmp_path: Path) -> None:
    catalog = Catalog.model_validate({"matrix": [_block(tile, ops)]})
    with pytest.raises(ValueError, match=fragment):
        catalog.specs()
    path = tmp_path / "mine.toml"
    lists = "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in _block(tile, ops).items() if k != "tile")
    path.write_text(f"[[matrix]]\n{lists}\n[matrix.tile]\n"
                    + "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in tile.items()) + "\n")
    with pytest.raises(ValueError, match=fragment):
        load_catalog(path).specs()


def test_catalog_expands_a_flavoured_block() -> None:
    """A flavour the cutedsl kernels have expands to tuned specs; TileLang refuses it by name."""
    specs = Catalog.model_validate({"matrix": [_block({"flavour": "wgmma", "num_stages": 1})]}).specs()
    assert [(s.backend, s.tile.flavour, s.tile.num_stages) for s in specs] == [("cutedsl", "wgmma", 1)]
    assert specs[0].id.startswith("fwd-sm_90a-d576-h64-compact-cutedsl-t")
    with pytest.raises(ValueError, match="tile.flavour='wgmma'"):
        Catalog.model_validate({"matrix": [_block({"flavour": "wgmma"}, backends=("tilelang",))]}).specs()


_CANNOT_BUILD = can_key_builds(get_backend("cutedsl"), Toolchain.current())


@pytest.mark.skipif(_CANNOT_BUILD is not None, reason=f"cannot build: {_CANNOT_BUILD}")
def test_flavoured_fwd_spec_compiles_with_that_impl(tmp_path: Path) -> None:
    """A real sm_90a build of a cutedsl forward whose tile names a non-default flavour and KV
    depth: the published manifest's record shows them."""
    from dsa_aot.artifact import ArtifactManifest
    from dsa_aot.build import build_and_publish

    spec = _spec("fwd", layout="noncompact", flavour="wgmma", num_stages=1)
    assert spec.tile.flavour != FWD_DEFAULT_IMPL[spec.arch]
    store = ArtifactStore(tmp_path / "store")
    done = build_and_publish(store, spec, Toolchain.current())
    assert done.status == "built"
    entry = store.lookup(done.manifest.key, spec.arch, spec.id)
    assert entry is not None and store.verify(entry) == []
    manifest = ArtifactManifest.model_validate(entry.meta.payload)
    assert manifest.spec == spec and manifest.spec.tile.flavour == "wgmma"
    (stage,) = manifest.stages
    assert (stage.name, stage.format, stage.file) == ("fwd", "cutedsl_so", "fwd.so")
    record = CuteExportRecord.model_validate(stage.record)
    assert (record.impl, record.kv_stages, record.arch, record.layout) == ("wgmma", 1, "sm_90a", "noncompact")
    assert record.name == "cutedsl_fwd_sm_90a_d576_h64_noncompact_wgmma_kv1_static"
    assert [a.name for a in record.args] == ["q", "kv", "topk_idxs", "attn_sink", "out", "lse",
                                             "softmax_scale", "stream"]
