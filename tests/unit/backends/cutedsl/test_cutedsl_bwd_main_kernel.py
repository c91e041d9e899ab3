"""CuTe DSL sparse MLA backward main kernel: AOT compile, export, link, and numerics.

CPU: a few variants (both MMA flavours, both link modes) compile, export (``export_to_c``) and
link for sm_90a and sm_100a through :func:`dsa_aot.backends.cutedsl.build.build_cutedsl`, from
the requests a spec maps to (:func:`~dsa_aot.backends.cutedsl.build.requests_for`); the
generated C ABI and the records are checked, and a fresh process opens each library through
:mod:`dsa_aot.backends.cutedsl.runtime` without ``cutlass``. The full sweep is ``-m slow``.

GPU (``-m gpu``): bwd specs (``tile.flavour`` ``mma``; on sm_90a also ``wgmma``, and
``wgmma_slot_major`` at H16/H32, ``wgmma_ws`` at H64/H128) built and published by
:func:`dsa_aot.build.build_and_publish` and loaded by the backend. The loaded main kernel runs
with ``delta`` / ``lse_sink`` from the reference around it into NaN-poisoned ``dq``, and the whole
loaded backward runs too; ``dq``, ``dkv`` (and ``d_sink``) are compared with the fp64 reference by
``||x - ref|| / ||ref||``, over both layouts, H 16/32/64/128, D 512/576, K 128/300/2048, S_kv
95/4096 (K > S_kv included) and the edge cases of the contract. The timing case (S_q 4096,
S_kv 8192, H 64, D 576, K 2048) prints the median of 20 launches of the main kernel.
"""

from __future__ import annotations

import json
import os
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from cli_helpers import (HAS_CUTE_DSL, LAYOUT_DIFFER, needs_cute_dsl, open_without_cutlass,
                         run_dsl_script)
from dsa_aot.backends.cutedsl.build import BuildRequest, build_cutedsl, requests_for
from dsa_aot.backends.cutedsl.records import CuteExportRecord, bwd_main_default_impl
from dsa_aot.kernels.dkv_interleave import natural_order
from dsa_aot.kernels.reference import sparse_mla_bwd_ref, sparse_mla_fwd_ref
from dsa_aot.specs.models import KernelSpec, TileConfig

_CUDA = torch.cuda.is_available()
_needs_cuda = pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU")

INT32_MIN = -(2**31)


def bwd_spec(arch: str, d_qk: int, heads: int, layout: str, flavour: str | None = None) -> KernelSpec:
    return KernelSpec(op="bwd", arch=arch, d_qk=d_qk, heads=heads, layout=layout, backend="cutedsl",
                      tile=TileConfig(flavour=flavour))


def main_request(arch: str, d_qk: int, heads: int, layout: str, flavour: str | None = None,
                 link: str = "static_cudart") -> BuildRequest:
    """The ``bwd_main`` request of a cutedsl bwd spec (with ``link`` in place of the backend's)."""
    (request,) = requests_for(bwd_spec(arch, d_qk, heads, layout, flavour), ("bwd_main",), link=link)
    return request


def main_name(arch: str, d_qk: int, heads: int, layout: str, flavour: str | None = None,
              link: str = "static_cudart") -> str:
    """The artifact name :func:`build_cutedsl` derives for a ``bwd_main`` request."""
    return (f"cutedsl_bwd_main_{arch}_d{d_qk}_h{heads}_{layout}"
            + (f"_{flavour}" if flavour not in (None, bwd_main_default_impl(arch, heads)) else "")
            + ("_static" if link == "static_cudart" else ""))


# --------------------------------------------------------------------------------------------
# CPU tests
# --------------------------------------------------------------------------------------------

#: (arch, d_qk, heads, layout, flavour, link): the arch defaults and each flavour named
_CPU_VARIANTS: list[tuple[Any, ...]] = [
    ("sm_90a", 576, 64, "compact", None, "static_cudart"),
    ("sm_90a", 512, 16, "noncompact", "mma", "static_cudart"),
    ("sm_100a", 576, 128, "noncompact", None, "static_cudart"),
    ("sm_90a", 576, 16, "noncompact", "wgmma", "static_cudart"),
    ("sm_100a", 512, 16, "noncompact", "mma", "dsl_runtime"),
    ("sm_90a", 512, 64, "noncompact", "mma", "dsl_runtime")]


@pytest.fixture(scope="module")
def cpu_built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[CuteExportRecord]]:
    if not HAS_CUTE_DSL:
        pytest.skip("needs nvidia-cutlass-dsl to compile")
    out = tmp_path_factory.mktemp("bwd_main")
    return out, build_cutedsl([main_request(*v) for v in _CPU_VARIANTS], out)


def _tensors(layout: str) -> list[str]:
    return (["q", "kv", "dout", "topk_idxs"] + (["topk_length"] if layout == "compact" else [])
            + ["lse_sink", "delta", "dq", "dkv_acc"])


@needs_cute_dsl
def test_export_abi_records_and_link(cpu_built: tuple[Path, list[CuteExportRecord]]) -> None:
    """Records name what each request asked for; the header packs what the loader passes; the
    object embeds the arch's cubin; ``static_cudart`` links the CUDA runtime in."""
    out, records = cpu_built
    by_name = {r.name: r for r in records}
    assert sorted(by_name) == sorted(main_name(*v) for v in _CPU_VARIANTS)
    for arch, d_qk, heads, layout, flavour, link in _CPU_VARIANTS:
        rec = by_name[main_name(arch, d_qk, heads, layout, flavour, link)]
        assert (rec.kernel, rec.arch, rec.d_qk, rec.heads, rec.layout, rec.impl, rec.link) == (
            "bwd_main", arch, d_qk, heads, layout, flavour or bwd_main_default_impl(arch, heads), link)
        assert rec.kv_stages is None and rec.use_isfinite is None
        assert [a.name for a in rec.args] == _tensors(layout) + ["softmax_scale", "stream"]
        assert rec.args[-2].kind == "scalar" and rec.args[-2].dtype == "float32"
        folder = out / rec.name
        header = (folder / rec.header).read_text()
        packed = header.split(f"void *args[{len(rec.args) + 1}] = {{", 1)[1].split("};", 1)[0]
        assert [t.strip() for t in packed.split(",") if t.strip()] == (
            _tensors(layout) + ["&softmax_scale", "&stream", "&ret"])
        assert "float softmax_scale" in header
        # q is [s_q, H, D] with only s_q at run time; strides of the two outer dims
        q_arg = rec.args[0]
        assert q_arg.dynamic_shape_dims == (0,) and q_arg.dynamic_stride_dims == (0, 1)
        assert (q_arg.shape[1].value, q_arg.shape[2].value) == (heads, d_qk)
        dkv = rec.args[len(_tensors(layout)) - 1]
        assert dkv.name == "dkv_acc" and dkv.align == 16 and dkv.stride[0].divisibility == 4
        obj = (folder / rec.object_file).read_bytes()
        assert rec.symbols.entry.encode() in obj
        arch_tag = arch.encode()
        assert arch_tag in obj or arch_tag.replace(b"_", b"") in obj
        lib = (folder / rec.library).read_bytes()
        if link == "static_cudart":  # the CUDA runtime linked in, nothing else needed
            assert len(lib) > 100_000 and b"libcute_dsl_runtime" not in lib
            assert rec.runtime_libs == () and rec.cudart_version
        else:
            assert b"libcute_dsl_runtime" in lib and len(rec.runtime_libs) == 1


def test_requests_are_validated() -> None:
    with pytest.raises(ValueError, match="bwd_main needs d_qk"):
        BuildRequest(kernel="bwd_main", arch="sm_90a", d_qk=576, heads=64)
    with pytest.raises(ValueError, match="impl=wgmma needs sm_90a"):
        BuildRequest(kernel="bwd_main", arch="sm_100a", d_qk=576, heads=64, layout="compact",
                     impl="wgmma")
    with pytest.raises(ValueError, match="bwd_main has impl mma, wgmma, wgmma_slot_major, "
                                         "wgmma_ws, wgmma_ws_slot_major, wgmma_ws_fixed, "
                                         "wgmma_ws_slot_major_fixed, wgmma_ws_persistent, "
                                         "wgmma_ws_staggered, wgmma_ws_cols, wgmma_ws_dq_lines, "
                                         "not wgmma_split"):
        BuildRequest(kernel="bwd_main", arch="sm_90a", d_qk=576, heads=64, layout="compact",
                     impl="wgmma_split")
    with pytest.raises(ValueError, match="do not apply to kernel=bwd_main"):
        BuildRequest(kernel="bwd_main", arch="sm_90a", d_qk=576, heads=64, layout="compact",
                     kv_stages=2)


@needs_cute_dsl
def test_libraries_open_without_cutlass(cpu_built: tuple[Path, list[CuteExportRecord]]) -> None:
    """A fresh process opens every built library through the runtime (ctypes only)."""
    out, records = cpu_built
    assert open_without_cutlass(out / r.name for r in records) == [
        ",".join(_tensors(r.layout) + ["softmax_scale"]) for r in records]


@needs_cute_dsl
def test_bad_params_are_refused(tmp_path: Path) -> None:
    code = ("from dsa_aot.kernels.cutedsl_bwd_main import can_implement, check_params\n"
            "assert can_implement(576, 64, 'compact') and can_implement(512, 16, 'noncompact')\n"
            "for bad in [(448, 64, 'compact'), (576, 24, 'compact'), (512, 64, 'paged')]:\n"
            "    assert not can_implement(*bad)\n"
            "    try:\n        check_params(*bad)\n    except ValueError as e:\n"
            "        print('refused', e)\n    else:\n"
            "        raise SystemExit('accepted %r' % (bad,))\n")
    code += ("from dsa_aot.kernels.cutedsl_bwd_main import compile_bwd_main\n"
             "try:\n    compile_bwd_main('sm_100a', 576, 64, 'compact', impl='wgmma')\n"
             "except ValueError as e:\n    print('refused', e)\n")
    proc = run_dsl_script(code, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.count("refused") == 4


_VIEW_CHECK = LAYOUT_DIFFER + """
import cutlass.cute as cute
from dsa_aot.kernels import cutedsl_bwd_main as k

def run_checks():
    for d in (512, 576):
        lay = k.wgmma_smem_layouts(d)
        d_pad = cute.size(lay["q_t"].outer, mode=[0])
        assert d_pad % k.WG_CHUNK == 0 and d <= d_pad < d + k.WG_CHUNK
        assert str(lay["q"].inner) == str(lay["q_t"].inner) == str(lay["p_t"].inner)
        print("q", d, differ(lay["q"].outer, lay["q_t"].outer, 64, d))
        assert str(lay["kv"]) == str(lay["q"]) and str(lay["kv_t"]) == str(lay["q_t"])
        size = cute.cosize(lay["q"].outer)
        pad = [lay["q_t"].outer((c, r)) for r in range(64) for c in range(d, d_pad)]
        print("pad", d, sum(1 for o in pad if not size <= o < size + 64 * 64))
    print("dout", differ(lay["dout"].outer, lay["dout_t"].outer, 64, 512))
    print("p", differ(lay["p"].outer, lay["p_t"].outer, 64, 64))

@cute.jit
def check():
    run_checks()

check()
"""


@needs_cute_dsl
def test_wgmma_transposed_views_alias_the_tiles(tmp_path: Path) -> None:
    """The MN-major operand views of the wgmma flavour address exactly the K-major tiles' bytes
    (element by element), and the padding columns stay inside the next 64 x 64 buffer."""
    proc = run_dsl_script(_VIEW_CHECK, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    counts = [line for line in lines if line.split(" ")[0] in ("q", "pad", "dout", "p")]
    assert len(counts) == 6 and all(line.endswith(" 0") for line in counts), proc.stdout


@pytest.mark.slow
@needs_cute_dsl
def test_full_sweep_builds(tmp_path: Path) -> None:
    variants = [(a, d, h, lay) for a in ("sm_90a", "sm_100a") for d in (512, 576)
                for h in (16, 32, 64, 128) for lay in ("compact", "noncompact")]
    records = build_cutedsl([main_request(*v) for v in variants], tmp_path)
    assert sorted(r.name for r in records) == sorted(main_name(*v) for v in variants)
    for rec in records:
        assert (tmp_path / rec.name / rec.library).is_file()


# --------------------------------------------------------------------------------------------
# GPU tests
# --------------------------------------------------------------------------------------------

#: MMA flavours checked on the GPU (the specs' ``tile.flavour``); wgmma needs sm_90a.
IMPLS = ("mma", "wgmma", "wgmma_slot_major", "wgmma_ws", "wgmma_ws_slot_major", "wgmma_ws_cols",
         "wgmma_ws_dq_lines")
#: Head counts of the flavours that take only some (the others take every H).
SLOT_MAJOR_HEADS = (16, 32)
FLAVOUR_HEADS = {"wgmma_slot_major": SLOT_MAJOR_HEADS, "wgmma_ws": (64, 128),
                 "wgmma_ws_slot_major": SLOT_MAJOR_HEADS, "wgmma_ws_cols": (128,)}
#: ``DSA_AOT_GPU_TEST_IMPLS=wgmma_ws,...`` builds (and tests) only those flavours: each build
#: costs GPU-machine time, and ``-k`` cannot narrow a module fixture.
_GPU_IMPLS = tuple(i for i in os.environ.get("DSA_AOT_GPU_TEST_IMPLS", ",".join(IMPLS)).split(",")
                   if i)
_RESULTS: list[dict[str, Any]] = []


def _logaddexp_safe(lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``logaddexp(lse, sink)`` without ``inf - inf`` (what the preprocess writes)."""
    sink = sink[None, :].expand_as(lse)
    top = torch.maximum(lse, sink)
    finite = torch.isfinite(top)
    safe_top = torch.where(finite, top, torch.zeros_like(top))
    merged = safe_top + torch.log(torch.exp(lse - safe_top) + torch.exp(sink - safe_top))
    return torch.where(finite, merged, top)


def _case_inputs(s_q: int, s_kv: int, heads: int, d_qk: int, topk: int, layout: str,
                 seed: int, sinks: str = "finite", bad_idx: bool = True, all_invalid_rows: int = 0,
                 low_scores: bool = False, dev: str = "cuda") -> dict[str, Any]:
    g = torch.Generator(device=dev).manual_seed(seed)
    if low_scores:  # q.k ~ -100 * sqrt(d): lse < -80, padded columns must be masked first
        q = torch.full((s_q, heads, d_qk), -4.0, device=dev).to(torch.bfloat16)
        kv = (torch.rand(s_kv, d_qk, device=dev, generator=g) + 0.5).to(torch.bfloat16)
    else:
        q = torch.randn(s_q, heads, d_qk, device=dev, generator=g).to(torch.bfloat16)
        kv = torch.randn(s_kv, d_qk, device=dev, generator=g).to(torch.bfloat16)
    dout = torch.randn(s_q, heads, 512, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, topk), device=dev, generator=g, dtype=torch.int32)
    if bad_idx:
        bad = torch.tensor([-1, s_kv, INT32_MIN, 2147480000], device=dev, dtype=torch.int32)
        where = torch.rand(s_q, topk, device=dev, generator=g) < 0.1
        pick = torch.randint(0, 4, (s_q, topk), device=dev, generator=g)
        idx = torch.where(where, bad[pick], idx)
    if layout == "noncompact":  # a padded tail per row
        keep = torch.randint(0, topk + 1, (s_q,), device=dev, generator=g)
        cols = torch.arange(topk, device=dev)
        idx = torch.where(cols[None, :] < keep[:, None], idx, torch.full_like(idx, -1))
        length = None
    else:
        length = torch.randint(-3, topk + 5, (s_q,), device=dev, generator=g, dtype=torch.int32)
        length[0] = topk + 100   # > K
        length[1 % s_q] = 0      # empty
        length[2 % s_q] = -7     # negative
        length[3 % s_q] = topk   # full
    if all_invalid_rows:
        idx[:all_invalid_rows] = torch.tensor([-1, s_kv, INT32_MIN, 2147480000], device=dev,
                                              dtype=torch.int32).repeat(topk)[:topk]
    if sinks == "none":
        sink = torch.full((heads,), float("-inf"), device=dev)
    elif sinks == "edge":
        pattern = torch.tensor([float("inf"), float("-inf"), 2.4e38, -2.4e38, 0.5, -3.0],
                               device=dev)
        sink = pattern.repeat(heads)[:heads].float()
    else:
        sink = torch.randn(heads, device=dev, generator=g)
    scale = d_qk ** -0.5
    out, lse = sparse_mla_fwd_ref(q, kv, idx, length, sink, scale)
    out = out.to(torch.bfloat16)
    lse = lse.float()
    delta = (out.float() * dout.float()).sum(-1)
    lse_sink = _logaddexp_safe(lse.double(), sink.double()).float()
    return {"q": q, "kv": kv, "dout": dout, "topk_idxs": idx, "topk_length": length, "sink": sink,
            "scale": scale, "out": out, "lse": lse, "delta": delta, "lse_sink": lse_sink}


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    den = ref.norm().item()
    num = (x.double() - ref).norm().item()
    return num / den if den > 0 else num


def _log(entry: dict[str, Any]) -> None:
    _RESULTS.append(entry)
    out = os.environ.get("OUT")
    if out:
        Path(out, "bwd_main_results.json").write_text(json.dumps(_RESULTS, indent=1))
    print(json.dumps(entry), flush=True)


# (layout, heads, d_qk, topk, s_kv, s_q, extra)
_CASES = [
    ("compact", 64, 576, 128, 4096, 32, {}),
    ("noncompact", 64, 576, 128, 4096, 32, {}),
    ("compact", 16, 512, 300, 95, 24, {}),
    ("noncompact", 16, 576, 300, 95, 24, {}),
    ("compact", 128, 576, 2048, 4096, 16, {}),
    ("noncompact", 128, 512, 2048, 95, 16, {}),
    ("compact", 64, 512, 300, 4096, 20, {"sinks": "edge"}),
    ("noncompact", 16, 576, 128, 95, 20, {"sinks": "edge", "all_invalid_rows": 3}),
    ("compact", 128, 512, 128, 95, 12, {"sinks": "none", "all_invalid_rows": 2}),
    ("noncompact", 64, 576, 300, 4096, 16, {"low_scores": True, "sinks": "none"}),
    ("compact", 16, 576, 2048, 4096, 8, {"low_scores": True, "sinks": "edge"}),
    ("noncompact", 64, 512, 2048, 4096, 8, {"bad_idx": False, "sinks": "none"}),
    ("compact", 32, 576, 2048, 4096, 12, {}),
    ("noncompact", 32, 512, 300, 95, 12, {"sinks": "edge", "all_invalid_rows": 2}),
    ("noncompact", 128, 576, 300, 4096, 9, {"sinks": "edge", "all_invalid_rows": 2}),
]


@pytest.fixture(scope="module")
def gpu_backward(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int, str, str], Any]:
    """The loaded backward of every ``(d_qk, heads, layout, flavour)`` the GPU tests use: each a
    cutedsl bwd spec built and published by the production build path, loaded by the backend."""
    from dsa_aot.backends import get as get_backend
    from dsa_aot.build import build_and_publish
    from dsa_aot.cache.store import ArtifactStore
    from dsa_aot.identity import can_key_builds
    from dsa_aot.runners import StagedBwd
    from dsa_aot.specs.toolchain import Toolchain

    if not _CUDA:
        pytest.skip("needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10):
        pytest.skip(f"no kernels for compute capability {major}.{minor}")
    arch = "sm_100a" if major == 10 else "sm_90a"
    backend, toolchain = get_backend("cutedsl"), Toolchain.current()
    why = can_key_builds(backend, toolchain)
    if why:
        pytest.skip(f"cannot build: {why}")
    shapes = {(d_qk, heads, layout) for layout, heads, d_qk, *_ in _CASES}
    shapes |= {(576, 64, "compact"), (576, 64, "noncompact"), (576, 16, "compact"),
               (512, 32, "compact")}
    wanted = [(*shape, impl) for shape in sorted(shapes) for impl in _GPU_IMPLS
              if (impl == "mma" or arch == "sm_90a")
              and shape[1] in FLAVOUR_HEADS.get(impl, (shape[1],))]
    store = ArtifactStore(tmp_path_factory.mktemp("bwd_main_gpu"))

    def build(variant: tuple[int, int, str, str]):
        d_qk, heads, layout, impl = variant
        return build_and_publish(store, bwd_spec(arch, d_qk, heads, layout, impl), toolchain)

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # a worker process each
        done = dict(zip(wanted, pool.map(build, wanted)))
    loaded = {}
    for variant, published in done.items():
        assert CuteExportRecord.model_validate(published.manifest.stage("bwd_main").record).impl == variant[3]
        loaded[variant] = backend.load(published.manifest, published.read(store), 0)
        assert isinstance(loaded[variant], StagedBwd)
    return loaded


def _loaded(gpu_backward: dict, d_qk: int, heads: int, layout: str, impl: str) -> Any:
    kernel = gpu_backward.get((d_qk, heads, layout, impl))
    if kernel is None:
        pytest.skip(f"no {impl} flavour of d{d_qk} h{heads} {layout} on this arch")
    return kernel


def _run_main(main: Any, inp: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The loaded main kernel alone (tensors by name) into a NaN-poisoned ``dq``."""
    q = inp["q"]
    dq = torch.full_like(q, float("nan"))
    dkv_acc = torch.zeros(inp["kv"].shape, device="cuda", dtype=torch.float32)
    tensors = {"q": q, "kv": inp["kv"], "dout": inp["dout"], "topk_idxs": inp["topk_idxs"],
               "lse_sink": inp["lse_sink"], "delta": inp["delta"], "dq": dq, "dkv_acc": dkv_acc}
    if inp["topk_length"] is not None:
        tensors["topk_length"] = inp["topk_length"]
    main(**tensors, softmax_scale=inp["scale"])
    torch.cuda.synchronize()
    natural = dkv_acc[:, natural_order(dkv_acc.shape[1])]  # the accumulator's interleaved columns
    return dq, natural.to(torch.bfloat16)


def _run_backward(kernel: Any, inp: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole loaded backward (preprocess, main, postprocess) as the runtime calls it."""
    dq, dkv, d_sink = kernel(inp["q"], inp["kv"], inp["out"], inp["dout"], inp["lse"], inp["topk_idxs"],
                             inp["topk_length"], inp["sink"], inp["scale"])
    torch.cuda.synchronize()
    return dq, dkv, d_sink


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(_CASES)))
def test_gpu_matches_reference(gpu_backward: dict, case: int, impl: str) -> None:
    layout, heads, d_qk, topk, s_kv, s_q, extra = _CASES[case]
    kernel = _loaded(gpu_backward, d_qk, heads, layout, impl)
    inp = _case_inputs(s_q, s_kv, heads, d_qk, topk, layout, seed=case, **extra)
    dq, dkv = _run_main(kernel.main, inp)
    dq_ref, dkv_ref, dsink_ref = sparse_mla_bwd_ref(inp["q"], inp["kv"], inp["out"], inp["dout"],
                                                    inp["lse"], inp["topk_idxs"], inp["topk_length"],
                                                    inp["sink"], inp["scale"])
    full_dq, full_dkv, full_dsink = _run_backward(kernel, inp)
    if dsink_ref is None:  # no sink: the runtime returns zeros
        dsink_ref = torch.zeros_like(full_dsink)
    entry = {"case": case, "impl": impl, "layout": layout, "heads": heads, "d_qk": d_qk,
             "topk": topk, "s_kv": s_kv, "s_q": s_q, **extra,
             "dq_rel": _rel(dq, dq_ref), "dkv_rel": _rel(dkv, dkv_ref),
             "dq_nan": int(dq.isnan().sum().item()), "dkv_nan": int(dkv.isnan().sum().item()),
             "dq_ref_norm": dq_ref.norm().item(), "dkv_ref_norm": dkv_ref.norm().item(),
             "full_dq_rel": _rel(full_dq, dq_ref), "full_dkv_rel": _rel(full_dkv, dkv_ref),
             "full_dsink_rel": _rel(full_dsink, dsink_ref)}
    _log(entry)
    assert entry["dq_nan"] == 0 and entry["dkv_nan"] == 0
    assert entry["dq_rel"] < 2e-2, entry
    assert entry["dkv_rel"] < 2e-2, entry
    assert torch.isfinite(full_dq).all() and torch.isfinite(full_dkv).all() and torch.isfinite(full_dsink).all()
    assert entry["full_dq_rel"] < 2e-2 and entry["full_dkv_rel"] < 2e-2, entry
    assert entry["full_dsink_rel"] < 2e-2, entry
    if extra.get("all_invalid_rows"):
        rows = extra["all_invalid_rows"]
        assert torch.count_nonzero(dq[:rows]).item() == 0
        assert torch.count_nonzero(full_dq[:rows]).item() == 0


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_sink_plus_inf_gives_zero(gpu_backward: dict, impl: str) -> None:
    heads = FLAVOUR_HEADS.get(impl, (64,))[0]
    kernel = _loaded(gpu_backward, 576, heads, "compact", impl)
    inp = _case_inputs(8, 256, heads, 576, 128, "compact", seed=99, sinks="none")
    inp["lse_sink"] = torch.full_like(inp["lse_sink"], float("inf"))
    dq, dkv = _run_main(kernel.main, inp)
    _log({"case": "sink=+inf", "impl": impl, "dq_absmax": dq.abs().max().item(),
          "dkv_absmax": dkv.float().abs().max().item()})
    assert torch.count_nonzero(dq).item() == 0 and torch.count_nonzero(dkv).item() == 0
    inp["sink"] = torch.full_like(inp["sink"], float("inf"))  # the whole backward: lse_sink = +inf
    full_dq, full_dkv, d_sink = _run_backward(kernel, inp)
    assert torch.count_nonzero(full_dq).item() == 0 and torch.count_nonzero(full_dkv).item() == 0
    assert torch.isfinite(d_sink).all()


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("layout", ("compact", "noncompact"))
@pytest.mark.parametrize(("heads", "d_qk", "default_impl"), ((64, 576, "wgmma_ws"),
                                                            (16, 576, "wgmma_ws_slot_major"),
                                                            (32, 512, "wgmma_ws_slot_major")))
def test_gpu_dq_lines_gives_the_default_dq_bit_for_bit(gpu_backward: dict, layout: str, heads: int,
                                                       d_qk: int, default_impl: str) -> None:
    """``wgmma_ws_dq_lines`` changes only how dQ leaves the CTA: where its block order is the
    default's (H16/H32: ``wgmma_ws_slot_major``, H64: ``wgmma_ws``) its dq equals the default's
    bit for bit, on rows with padding and rows without a valid slot too."""
    lines = _loaded(gpu_backward, d_qk, heads, layout, "wgmma_ws_dq_lines")
    default = _loaded(gpu_backward, d_qk, heads, layout, default_impl)
    inp = _case_inputs(33, 4096, heads, d_qk, 320, layout, seed=5, all_invalid_rows=2)
    dq_lines, _ = _run_main(lines.main, inp)
    dq_default, _ = _run_main(default.main, inp)
    assert not dq_lines.isnan().any()
    assert torch.equal(dq_lines, dq_default)


@pytest.mark.gpu
@_needs_cuda
def test_gpu_backward_with_edge_sinks(gpu_backward: dict) -> None:
    """The loaded backward (runner interface, contract order) with the edge sinks on a
    noncompact layout: dq, dkv and d_sink against the reference."""
    kernel = _loaded(gpu_backward, 576, 64, "noncompact", "mma")
    inp = _case_inputs(16, 4096, 64, 576, 300, "noncompact", seed=21, sinks="edge")
    dq, dkv, d_sink = _run_backward(kernel, inp)
    dq_ref, dkv_ref, dsink_ref = sparse_mla_bwd_ref(inp["q"], inp["kv"], inp["out"], inp["dout"],
                                                    inp["lse"], inp["topk_idxs"], None, inp["sink"],
                                                    inp["scale"])
    entry = {"case": "runner", "dq_rel": _rel(dq, dq_ref), "dkv_rel": _rel(dkv, dkv_ref),
             "dsink_rel": _rel(d_sink, dsink_ref)}
    _log(entry)
    assert entry["dq_rel"] < 2e-2 and entry["dkv_rel"] < 2e-2 and entry["dsink_rel"] < 2e-2, entry


def time_kernel(main: Any, s_q: int, s_kv: int, heads: int, d_qk: int, topk: int,
                iters: int = 20) -> dict[str, Any]:
    """Median / min ms of ``iters`` launches of a loaded main kernel (CUDA events, after 3
    warm-up launches)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(s_q, heads, d_qk, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(s_kv, d_qk, device="cuda", generator=g).to(torch.bfloat16)
    dout = torch.randn(s_q, heads, 512, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.argsort(torch.rand(s_q, s_kv, device="cuda", generator=g), dim=1)[:, :topk]
    idx = idx.to(torch.int32).contiguous()
    tensors = {"q": q, "kv": kv, "dout": dout, "topk_idxs": idx,
               "lse_sink": torch.full((s_q, heads), 8.0, device="cuda"),
               "delta": torch.randn(s_q, heads, device="cuda", generator=g),
               "dq": torch.empty_like(q), "dkv_acc": torch.zeros(s_kv, d_qk, device="cuda")}
    if main.record.layout == "compact":
        tensors["topk_length"] = torch.full((s_q,), topk, device="cuda", dtype=torch.int32)
    for _ in range(3):
        main(**tensors, softmax_scale=d_qk ** -0.5)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        main(**tensors, softmax_scale=d_qk ** -0.5)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    flops = 2 * s_q * heads * topk * (d_qk + 512 + d_qk + d_qk + 512)
    return {"kernel": main.record.name, "s_q": s_q, "s_kv": s_kv, "heads": heads, "d_qk": d_qk,
            "topk": topk, "ms_median": ms, "ms_min": min(times), "tflops": flops / ms / 1e9,
            "dq_finite": bool(torch.isfinite(tensors["dq"]).all().item())}


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("impl", ("mma", "wgmma", "wgmma_ws"))  # the timing case is H64
def test_gpu_timing(gpu_backward: dict, impl: str) -> None:
    """S_q 4096, S_kv 8192, H 64, D 576, K 2048 (compact, all slots valid)."""
    kernel = _loaded(gpu_backward, 576, 64, "compact", impl)
    result = time_kernel(kernel.main, 4096, 8192, 64, 576, 2048)
    _log({"case": "timing", **result})
    assert result["ms_median"] > 0 and result["dq_finite"]
