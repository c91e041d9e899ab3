"""CuTe DSL sparse MLA forward: AOT build/export/link, the scalar argument, and GPU numerics.

CPU: a few (arch, d_qk, heads, layout) variants compile, export and link for sm_90a and sm_100a
(the full 32-variant sweep is ``-m slow``); the record (compile-time parameters, the float32
``softmax_scale`` argument, self-contained library, embedded cubin arch); the packed call frame
carries the scalar by value where the C wrapper puts it; bad inputs raise clear errors before
any CUDA call.
GPU (``-m gpu``): numerics against the fp64 reference from NaN-poisoned outputs over both layouts,
H 16/64/128, D 512/576, S_q {1, 62}, S_kv {95, 4096}, K {128, 300, 2048}, and every edge case of
the contract, and running maxima that move from block to block. Each variant is a cutedsl fwd
spec built and published by
:func:`dsa_aot.build.build_and_publish` and loaded by the backend; ``DSA_AOT_CUTE_FWD_IMPL``
(``flavour[:num_stages]``) sets the spec's ``tile`` to test another MMA flavour.
"""

from __future__ import annotations

import ctypes
import math
import os
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from cli_helpers import HAS_CUTE_DSL, embedded_cubin, needs_cute_dsl
from pydantic import ValidationError

from dsa_aot.backends.cutedsl.build import BuildRequest, build_cutedsl, read_record
from dsa_aot.backends.cutedsl.records import FWD_DEFAULT_IMPL, FWD_DEFAULT_KV_STAGES, CuteExportRecord
from dsa_aot.backends.cutedsl.runtime import load_kernel
from dsa_aot.kernels.reference import sparse_mla_fwd_ref

#: Optional flavour of the GPU tests: ``flavour[:num_stages]`` of the specs' tile, e.g. ``mma``
#: or ``wgmma:1`` (default: the arch's default flavour and its default number of KV buffers).
IMPL_ENV = "DSA_AOT_CUTE_FWD_IMPL"
_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU")

#: Built by the CPU tests: two variants per arch, both layouts and both head dims covered.
CPU_VARIANTS = [("sm_90a", 576, 64, "compact"), ("sm_90a", 512, 128, "noncompact"),
                ("sm_100a", 512, 16, "noncompact"), ("sm_100a", 576, 32, "compact")]
TENSORS = {"compact": ["q", "kv", "topk_idxs", "topk_length", "attn_sink", "out", "lse"],
           "noncompact": ["q", "kv", "topk_idxs", "attn_sink", "out", "lse"]}
OOR = (-1, None, -2**31, 2147480000)  # None: S_kv itself


def fwd_name(arch: str, d_qk: int, heads: int, layout: str, kv_stages: int | None = None,
             impl: str | None = None) -> str:
    """Artifact name :func:`build_cutedsl` derives for a static_cudart forward build."""
    impl = impl or FWD_DEFAULT_IMPL[arch]
    flavour = "" if impl == FWD_DEFAULT_IMPL[arch] else f"_{impl}"
    stages = "" if kv_stages in (None, FWD_DEFAULT_KV_STAGES[impl]) else f"_kv{kv_stages}"
    return f"cutedsl_fwd_{arch}_d{d_qk}_h{heads}_{layout}{flavour}{stages}_static"


def fwd_request(arch: str, d_qk: int, heads: int, layout: str, kv_stages: int | None = None,
                impl: str | None = None) -> BuildRequest:
    return BuildRequest(kernel="fwd", arch=arch, d_qk=d_qk, heads=heads, layout=layout,
                        link="static_cudart", kv_stages=kv_stages, impl=impl)


# ---------------------------------------------------------------------------------------------
# CPU: build, record, frame, errors
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    if not HAS_CUTE_DSL:
        pytest.skip("needs nvidia-cutlass-dsl to build")
    out = tmp_path_factory.mktemp("cute-fwd")
    records = build_cutedsl([fwd_request(*v) for v in CPU_VARIANTS], out)
    for rec in records:
        print(f"{rec.name}: {rec.build_seconds:.2f} s")  # compile + export + link
    return {"dir": out, "records": {r.name: r for r in records}}


@needs_cute_dsl
@pytest.mark.parametrize("variant", CPU_VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_fwd_builds_for_every_arch(cpu_built: dict, variant: tuple) -> None:
    arch, d_qk, heads, layout = variant
    name = fwd_name(*variant)
    rec: CuteExportRecord = cpu_built["records"][name]
    folder = cpu_built["dir"] / name
    assert rec == read_record(folder)
    impl = FWD_DEFAULT_IMPL[arch]
    assert (rec.kernel, rec.arch, rec.d_qk, rec.heads, rec.layout, rec.kv_stages, rec.impl) == (
        "fwd", arch, d_qk, heads, layout, FWD_DEFAULT_KV_STAGES[impl], impl)
    assert rec.link == "static_cudart" and rec.runtime_libs == () and rec.use_isfinite is None
    assert 0 < rec.build_seconds < 600
    lib = (folder / rec.library).read_bytes()
    assert lib[:4] == b"\x7fELF" and b"libcute_dsl_runtime" not in lib  # self-contained
    assert rec.symbols.entry.encode() in lib
    flags, = struct.unpack_from("<I", embedded_cubin((folder / rec.object_file).read_bytes()),
                                0x30)
    assert int(arch[3:-1]) in (flags & 0xFF, (flags >> 8) & 0xFF)
    # the persistent flavour's grid is sized by the GPU's SM count, given at run time
    scalars = [("softmax_scale", "float32")] + ([("num_sms", "int32")] if impl == "wgmma_split" else [])
    assert [a.name for a in rec.args] == TENSORS[layout] + [n for n, _ in scalars] + ["stream"]
    assert [(a.name, a.dtype) for a in rec.args if a.kind == "scalar"] == scalars
    assert rec.args[-1].kind == "stream"
    q, kv, idx = rec.args[0], rec.args[1], rec.args[2]
    assert [d.symbol for d in q.shape[:1]] == ["s_q"]
    assert (q.shape[1].value, q.shape[2].value, q.stride[2].value) == (heads, d_qk, 1)
    assert kv.shape[0].symbol == "s_kv" and kv.shape[1].value == d_qk
    assert [d.symbol for d in idx.shape] == ["s_q", "topk"] and idx.dtype == "int32"
    out = rec.args[TENSORS[layout].index("out")]
    assert (out.shape[1].value, out.shape[2].value) == (heads, 512)
    header = (folder / rec.header).read_text()
    assert "float softmax_scale" in header
    assert ("int32_t num_sms" in header) == (impl == "wgmma_split")


@needs_cute_dsl
def test_call_frame_carries_the_scale(cpu_built: dict) -> None:
    """The frame holds ``softmax_scale`` as a C float and ``num_sms`` as a C int32 at their
    struct offsets, ``&value`` in argv."""
    kernel = load_kernel(cpu_built["dir"] / fwd_name("sm_90a", 576, 64, "compact"))
    assert kernel.scalar_names == ["softmax_scale", "num_sms"]
    frame = kernel.frame
    values: list[object] = []
    for i, arg in enumerate(kernel.record.args):
        if arg.kind == "tensor":
            values += [0x1000 * (i + 1)] + [7 + i] * len(arg.dynamic_shape_dims) \
                + [64 * (i + 1)] * len(arg.dynamic_stride_dims)
        elif arg.kind == "scalar":
            values.append(0.041666668 if arg.dtype == "float32" else -132)
        else:
            values.append(0xABCDEF)
    buf, argv = frame.pack(values)
    view = frame.frame_type.from_buffer_copy(buf.raw[:ctypes.sizeof(frame.frame_type)])
    scale_index = [a.kind for a in kernel.record.args].index("scalar")
    assert getattr(view, f"a{scale_index}") == pytest.approx(0.041666668, rel=1e-7)
    assert getattr(view, f"a{scale_index + 1}") == -132  # int32, sign kept
    assert getattr(view, f"a{scale_index + 2}") == 0xABCDEF
    assert view.a0.data == 0x1000 and list(view.a0.shapes) == [7]
    pointers = struct.unpack_from(frame.argv_format, buf, frame.argv_offset)
    base = ctypes.addressof(buf)
    assert pointers[scale_index] == base + getattr(frame.frame_type, f"a{scale_index}").offset
    assert len(pointers) == len(kernel.record.args) + 1 and argv == base + frame.argv_offset
    raw = struct.unpack_from("=f", buf, getattr(frame.frame_type, f"a{scale_index}").offset)[0]
    assert raw == pytest.approx(0.041666668, rel=1e-7)


@needs_cute_dsl
def test_bad_inputs_raise_before_cuda(cpu_built: dict) -> None:
    kernel = load_kernel(cpu_built["dir"] / fwd_name("sm_90a", 576, 64, "compact"))
    s_q, s_kv, k, h = 3, 10, 5, 64
    good = dict(q=torch.zeros(s_q, h, 576, dtype=torch.bfloat16),
                kv=torch.zeros(s_kv, 576, dtype=torch.bfloat16),
                topk_idxs=torch.zeros(s_q, k, dtype=torch.int32),
                topk_length=torch.zeros(s_q, dtype=torch.int32),
                attn_sink=torch.zeros(h), out=torch.zeros(s_q, h, 512, dtype=torch.bfloat16),
                lse=torch.zeros(s_q, h))
    with pytest.raises(TypeError, match="missing scalar arguments \\['softmax_scale', 'num_sms'\\]"):
        kernel(**good)
    with pytest.raises(TypeError, match="softmax_scale must be a real number"):
        kernel(**good, softmax_scale="0.1", num_sms=132)
    with pytest.raises(TypeError, match="num_sms must be an integer, got float"):
        kernel(**good, softmax_scale=0.1, num_sms=132.0)
    with pytest.raises(ValueError, match="num_sms=2147483648 does not fit an int32"):
        kernel(**good, softmax_scale=0.1, num_sms=2**31)
    sc = dict(softmax_scale=0.1, num_sms=132)
    with pytest.raises(ValueError, match="q: size\\[1\\] must be 64, got 16"):
        kernel(**(good | {"q": torch.zeros(s_q, 16, 576, dtype=torch.bfloat16)}), **sc)
    with pytest.raises(ValueError, match="kv: size\\[1\\] must be 576, got 512"):
        kernel(**(good | {"kv": torch.zeros(s_kv, 512, dtype=torch.bfloat16)}), **sc)
    with pytest.raises(ValueError, match="topk_idxs must be int32"):
        kernel(**(good | {"topk_idxs": torch.zeros(s_q, k, dtype=torch.int64)}), **sc)
    with pytest.raises(ValueError, match="has s_q=3"):
        kernel(**(good | {"lse": torch.zeros(s_q + 1, h)}), **sc)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        kernel(**good, **sc)


def test_build_request_validation() -> None:
    with pytest.raises(ValidationError, match="needs d_qk, heads and layout"):
        BuildRequest(kernel="fwd", arch="sm_90a", d_qk=576, heads=64)
    with pytest.raises(ValidationError, match="apply to kernel=fwd or bwd_main .* not bwd_postprocess"):
        BuildRequest(kernel="bwd_postprocess", arch="sm_90a", heads=64)
    with pytest.raises(ValidationError):
        BuildRequest(kernel="fwd", arch="sm_90a", d_qk=128, heads=64, layout="compact")
    with pytest.raises(ValidationError):
        BuildRequest(kernel="fwd", arch="sm_90a", d_qk=576, heads=48, layout="compact")
    with pytest.raises(ValidationError, match="impl=wgmma needs sm_90a, not sm_100a"):
        BuildRequest(kernel="fwd", arch="sm_100a", d_qk=576, heads=64, layout="compact",
                     impl="wgmma")
    with pytest.raises(ValidationError, match="impl=wgmma_ws needs sm_90a, not sm_100a"):
        BuildRequest(kernel="fwd", arch="sm_100a", d_qk=576, heads=64, layout="compact",
                     impl="wgmma_ws")
    with pytest.raises(ValidationError, match="impl=wgmma_ws needs kv_stages=2"):
        BuildRequest(kernel="fwd", arch="sm_90a", d_qk=576, heads=64, layout="compact",
                     impl="wgmma_ws", kv_stages=1)
    with pytest.raises(ValidationError, match="impl=wgmma_split needs sm_90a, not sm_100a"):
        BuildRequest(kernel="fwd", arch="sm_100a", d_qk=576, heads=64, layout="compact",
                     impl="wgmma_split")
    with pytest.raises(ValidationError, match="impl=wgmma_split needs kv_stages=2"):
        BuildRequest(kernel="fwd", arch="sm_90a", d_qk=576, heads=64, layout="compact",
                     impl="wgmma_split", kv_stages=1)
    with pytest.raises(ValidationError, match="use_isfinite applies to bwd_preprocess only"):
        BuildRequest(kernel="fwd", arch="sm_90a", d_qk=576, heads=64, layout="compact",
                     use_isfinite=True)
    req = BuildRequest(kernel="fwd", arch="sm_100a", d_qk=512, heads=16, layout="noncompact")
    assert req.kv_stages is None and req.link == "dsl_runtime"


def test_cli_rejects_bad_combinations(tmp_path: Path) -> None:
    """A request that cannot be built is an error naming the problem (exit 2), no traceback."""
    proc = subprocess.run([sys.executable, "-m", "dsa_aot.backends.cutedsl.build", "build",
                           str(tmp_path), "--kernel", "fwd", "--arch", "sm_100a",
                           "--impl", "wgmma"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "impl=wgmma needs sm_90a, not sm_100a" in proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())


@needs_cute_dsl
@pytest.mark.slow
def test_full_sweep_builds(tmp_path: Path) -> None:
    """Every (arch, d_qk, heads, layout) with the arch default, plus every sm_90a variant of
    the warp-specialised ``wgmma_ws`` and ``wgmma_split``: 64 variants (about 1-10 s each, two
    workers)."""
    variants = [(a, d, h, lay) for a in ("sm_90a", "sm_100a") for d in (512, 576)
                for h in (16, 32, 64, 128) for lay in ("compact", "noncompact")]
    ws = [("sm_90a", d, h, lay, None, impl) for impl in ("wgmma_ws", "wgmma_split")
          for d in (512, 576) for h in (16, 32, 64, 128) for lay in ("compact", "noncompact")]
    records = build_cutedsl([fwd_request(*v) for v in variants + ws], tmp_path)
    assert sorted(r.name for r in records) == sorted(fwd_name(*v) for v in variants + ws)
    for rec in records:
        print(f"{rec.name}: {rec.build_seconds:.2f} s")


#: The warp-specialised flavours (sm_90a, not the default): a padded head block and a two-CTA
#: head count, both head dims and both layouts (``wgmma_split`` keeps warpgroup 0's P in the
#: RoPE columns at D_qk 576 and in a tile of its own at 512).
WS_VARIANTS = [(576, 64, "compact"), (512, 16, "noncompact")]
SPLIT_VARIANTS = [(576, 128, "noncompact"), (512, 32, "compact")]


@needs_cute_dsl
@pytest.mark.parametrize("impl,variants,kernel", [("wgmma_ws", WS_VARIANTS, b"kernel_ws"),
                                                  ("wgmma_split", SPLIT_VARIANTS,
                                                   b"kernel_split")])
def test_warp_specialised_flavours_build(tmp_path: Path, impl: str, variants: list,
                                         kernel: bytes) -> None:
    """A warp-specialised flavour compiles, exports and links; its record names it, and its
    kernel (384 threads: three warpgroups) is in the sm_90a cubin."""
    records = build_cutedsl([fwd_request("sm_90a", *v, None, impl) for v in variants], tmp_path)
    assert sorted(r.name for r in records) == sorted(
        fwd_name("sm_90a", *v, None, impl) for v in variants)
    for rec, (d_qk, heads, layout) in zip(records, variants):
        assert (rec.impl, rec.kv_stages, rec.d_qk, rec.heads, rec.layout) == (
            impl, 2, d_qk, heads, layout)
        assert rec.name == fwd_name("sm_90a", d_qk, heads, layout, None, impl)
        scalars = ["softmax_scale", "num_sms"] if impl == "wgmma_split" else ["softmax_scale"]
        assert [a.name for a in rec.args] == TENSORS[layout] + scalars + ["stream"]
        if impl == "wgmma_split":  # the persistent grid's size, an int32 by value
            assert rec.args[-2].dtype == "int32"
        cubin = embedded_cubin((tmp_path / rec.name / rec.object_file).read_bytes())
        flags, = struct.unpack_from("<I", cubin, 0x30)
        assert 90 in (flags & 0xFF, (flags >> 8) & 0xFF)
        assert kernel in cubin


# ---------------------------------------------------------------------------------------------
# GPU: numerics
# ---------------------------------------------------------------------------------------------

def _gpu_arch() -> str:
    major, _ = torch.cuda.get_device_capability()
    return {9: "sm_90a", 10: "sm_100a"}.get(major, f"sm_{major}x")


def _gpu_flavour() -> tuple[str | None, int | None]:
    impl, _, stages = (os.environ.get(IMPL_ENV) or "").partition(":")
    return impl or None, int(stages) if stages else None


GPU_VARIANTS = [(d, h, lay) for d in (512, 576) for h in (16, 32, 64, 128)
                for lay in ("compact", "noncompact")]


@pytest.fixture(scope="module")
def gpu_kernels(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int, str], object]:
    """This GPU's arch: every variant as a cutedsl fwd spec (tile from ``DSA_AOT_CUTE_FWD_IMPL``),
    built and published by the production build path, loaded by the backend; keyed by
    ``(d_qk, heads, layout)``."""
    from dsa_aot.backends import get as get_backend
    from dsa_aot.build import build_and_publish
    from dsa_aot.cache.store import ArtifactStore
    from dsa_aot.identity import can_key_builds
    from dsa_aot.runners import CuteFwd
    from dsa_aot.specs.models import KernelSpec, TileConfig
    from dsa_aot.specs.toolchain import Toolchain

    if not _CUDA:
        pytest.skip("needs a CUDA GPU")
    backend, toolchain = get_backend("cutedsl"), Toolchain.current()
    why = can_key_builds(backend, toolchain)
    if why:
        pytest.skip(f"cannot build: {why}")
    arch = _gpu_arch()
    impl, stages = _gpu_flavour()
    store = ArtifactStore(tmp_path_factory.mktemp("cute-fwd-gpu"))
    specs = {v: KernelSpec(op="fwd", arch=arch, d_qk=v[0], heads=v[1], layout=v[2], backend="cutedsl",
                           tile=TileConfig(flavour=impl, num_stages=stages)) for v in GPU_VARIANTS}
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # one worker process each
        done = dict(zip(specs, pool.map(lambda s: build_and_publish(store, s, toolchain), specs.values())))
    kernels = {}
    for variant, published in done.items():
        record = CuteExportRecord.model_validate(published.manifest.stage("fwd").record)
        assert (record.impl, record.kv_stages) == (
            impl or FWD_DEFAULT_IMPL[arch], stages or FWD_DEFAULT_KV_STAGES[impl or FWD_DEFAULT_IMPL[arch]])
        kernels[variant] = backend.load(published.manifest, published.read(store), 0)
        assert isinstance(kernels[variant], CuteFwd)
    return kernels


def run_fwd(kernels: dict, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor,
            length: torch.Tensor | None, sink: torch.Tensor | None,
            scale: float, num_sms: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of the matching loaded kernel into NaN-poisoned outputs (a persistent kernel
    gets ``num_sms`` CTAs at most: the GPU's SM count by default)."""
    s_q, heads, d_qk = q.shape
    layout = "compact" if length is not None else "noncompact"
    kernel = kernels[(d_qk, heads, layout)].kernel  # the loaded library (tensors by name)
    out = torch.full((s_q, heads, 512), float("nan"), dtype=torch.bfloat16, device=q.device)
    lse = torch.full((s_q, heads), float("nan"), dtype=torch.float32, device=q.device)
    if sink is None:
        sink = torch.full((heads,), float("-inf"), dtype=torch.float32, device=q.device)
    tensors = dict(q=q, kv=kv, topk_idxs=idx, attn_sink=sink, out=out, lse=lse)
    if length is not None:
        tensors["topk_length"] = length
    if "num_sms" in kernel.scalar_names:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        kernel(**tensors, softmax_scale=scale, num_sms=num_sms or sms)
    else:
        kernel(**tensors, softmax_scale=scale)
    torch.cuda.synchronize()
    return out, lse


def make_inputs(s_q: int, s_kv: int, k: int, heads: int, d_qk: int, layout: str, seed: int,
                oor: bool = True) -> dict[str, object]:
    """Random bf16 q/kv (kv inside a NaN-filled buffer), indices with out-of-range entries."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = torch.randn(s_q, heads, d_qk, generator=g, device=dev).to(torch.bfloat16)
    big = torch.full((s_kv + 128, d_qk), float("nan"), dtype=torch.bfloat16, device=dev)
    kv = big[64:64 + s_kv]  # a read outside [0, s_kv) would bring NaN into the output
    kv.copy_(torch.randn(s_kv, d_qk, generator=g, device=dev))
    idx = torch.randint(0, s_kv, (s_q, k), generator=g, device=dev, dtype=torch.int32)
    length = None
    if oor:
        pick = torch.rand(s_q, k, generator=g, device=dev) < 0.15
        bad = torch.tensor([v if v is not None else s_kv for v in OOR], dtype=torch.int32,
                           device=dev)
        which = torch.randint(0, len(OOR), (s_q, k), generator=g, device=dev)
        idx = torch.where(pick, bad[which], idx)
    if layout == "compact":
        length = torch.randint(-3, k + 4, (s_q,), generator=g, device=dev, dtype=torch.int32)
        if s_q > 1:
            length[0] = k  # at least one full row
        # slots past the length hold garbage that must be ignored
        cols = torch.arange(k, device=dev)[None, :]
        tail = cols >= length.clamp(0, k)[:, None]
        idx = torch.where(tail, torch.full_like(idx, 2147480000), idx)
    sink = torch.randn(heads, generator=g, device=dev) * 2
    return dict(q=q, kv=kv, idx=idx, length=length, sink=sink)


def check_against_reference(kernels: dict, inp: dict, scale: float, out_tol: float = 1e-2,
                            lse_tol: float = 1e-3, num_sms: int | None = None) -> dict[str, float]:
    out, lse = run_fwd(kernels, inp["q"], inp["kv"], inp["idx"], inp["length"], inp["sink"], scale,
                       num_sms)
    ref_out, ref_lse = sparse_mla_fwd_ref(inp["q"], inp["kv"], inp["idx"], inp["length"],
                                          inp["sink"], scale)
    assert not torch.isnan(out).any(), "NaN in out (a poisoned element was not written)"
    assert not torch.isnan(lse).any(), "NaN in lse"
    ref_out32 = ref_out.float()
    err = (out.float() - ref_out32).norm().item()
    norm = ref_out32.norm().item()
    rel = err / norm if norm > 0 else err
    assert rel < out_tol, f"out rel err {rel:.3e}"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isposinf(lse), empty), "lse=+inf must mark exactly the empty rows"
    assert torch.all(out[empty[:, :, None].expand_as(out)] == 0), "an empty row must give out=0"
    lse_err = (lse.double() - ref_lse).abs()[~empty].max().item() if (~empty).any() else 0.0
    assert lse_err < lse_tol, f"lse abs err {lse_err:.3e}"
    return {"out_rel": rel, "lse_abs": lse_err}


SHAPES = [(s_q, s_kv, k) for s_q in (1, 62) for s_kv in (95, 4096) for k in (128, 300, 2048)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", GPU_VARIANTS, ids=lambda v: "d%d-h%d-%s" % v)
def test_gpu_variants(gpu_kernels: dict, variant: tuple) -> None:
    """Every compiled variant on two shapes (rotating through the shape list)."""
    d_qk, heads, layout = variant
    i = GPU_VARIANTS.index(variant)
    for j, (s_q, s_kv, k) in enumerate((SHAPES[i % len(SHAPES)],
                                        SHAPES[(i + 5) % len(SHAPES)])):
        inp = make_inputs(s_q, s_kv, k, heads, d_qk, layout, seed=100 * i + j)
        check_against_reference(gpu_kernels, inp, d_qk ** -0.5)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "sq%d-skv%d-k%d" % s)
@pytest.mark.parametrize("layout", ["compact", "noncompact"])
def test_gpu_shapes(gpu_kernels: dict, shape: tuple, layout: str) -> None:
    s_q, s_kv, k = shape
    inp = make_inputs(s_q, s_kv, k, 64, 576, layout, seed=s_q * 7 + s_kv + k)
    check_against_reference(gpu_kernels, inp, 576 ** -0.5)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["compact", "noncompact"])
def test_gpu_sink_edges(gpu_kernels: dict, layout: str) -> None:
    inp = make_inputs(8, 300, 200, 64, 576, layout, seed=11)
    edges = [math.inf, -math.inf, 2.4e38, -2.4e38]
    inp["sink"][:4] = torch.tensor(edges, device="cuda")
    inp["sink"][4:8] = torch.tensor([30.0, -30.0, 0.0, 5.0], device="cuda")
    if inp["length"] is not None:
        inp["length"][0] = 0  # an empty row: out 0, lse +inf whatever the sink
    check_against_reference(gpu_kernels, inp, 576 ** -0.5)
    out, lse = run_fwd(gpu_kernels, inp["q"], inp["kv"], inp["idx"], inp["length"],
                       inp["sink"], 576 ** -0.5)
    assert torch.all(out[:, 0] == 0) and torch.all(out[:, 2] == 0)  # sink +inf / 2.4e38
    assert torch.isfinite(out.float()).all()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["compact", "noncompact"])
def test_gpu_invalid_rows(gpu_kernels: dict, layout: str) -> None:
    """All-invalid rows (every index out of range; lengths <= 0) and lengths > K."""
    inp = make_inputs(6, 95, 300, 16, 512, layout, seed=5)
    idx = inp["idx"]
    idx[0] = -1
    idx[1] = torch.tensor([v if v is not None else 95 for v in OOR] * 75, dtype=torch.int32,
                          device="cuda")
    if inp["length"] is not None:
        inp["length"][:] = torch.tensor([300, 300, 0, -5, 301, 10**9], dtype=torch.int32,
                                        device="cuda")
    out, lse = run_fwd(gpu_kernels, inp["q"], inp["kv"], idx, inp["length"], inp["sink"],
                       512 ** -0.5)
    empty_rows = [0, 1] + ([2, 3] if layout == "compact" else [])
    assert torch.all(torch.isposinf(lse[empty_rows]))
    assert torch.all(out[empty_rows] == 0)
    check_against_reference(gpu_kernels, inp, 512 ** -0.5)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["compact", "noncompact"])
def test_gpu_very_negative_scores(gpu_kernels: dict, layout: str) -> None:
    """Scores around -100 (lse < -80) with masked tail columns: no exp2(-lse)=inf, no NaN."""
    s_q, s_kv, k, h, d = 4, 500, 300, 64, 576
    inp = make_inputs(s_q, s_kv, k, h, d, layout, seed=3, oor=False)
    scale = d ** -0.5
    lengths = [37, 300, 1, 65]
    if inp["length"] is None:  # noncompact: the same tails padded with -1
        for row, n in enumerate(lengths):
            inp["idx"][row, n:] = -1
    inp["kv"].copy_((1 + 0.01 * torch.randn(s_kv, d, device="cuda")).to(torch.bfloat16))
    inp["q"].copy_((-100.0 / (scale * d) + 0.001 * torch.randn(s_q, h, d, device="cuda"))
                   .to(torch.bfloat16))
    if inp["length"] is not None:
        inp["length"][:] = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = run_fwd(gpu_kernels, inp["q"], inp["kv"], inp["idx"], inp["length"],
                       inp["sink"], scale)
    assert torch.isfinite(lse).all() and (lse < -80).all()
    check_against_reference(gpu_kernels, inp, scale, lse_tol=2e-2)  # |lse| ~ 95: fp32 ulps


def ramped_inputs(pattern: str, layout: str, seed: int, s_q: int = 3, k: int = 677,
                  heads: int = 64, d_qk: int = 576) -> dict[str, object]:
    """Scores whose level moves from one block of 64 slots to the next (about +-1.5 per block,
    or +3 on every odd block), on top of unit noise: every block changes the running max, and
    several blocks still carry weight. ``k = 677`` leaves a partial last block (11 blocks)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    v = torch.randn(d_qk, generator=g, device=dev)
    q = v + 0.5 * torch.randn(s_q, heads, d_qk, generator=g, device=dev)
    block = torch.arange(k, device=dev) // 64
    level = {"rising": 1.5 * block, "falling": -1.5 * block,
             "odd_blocks_higher": 3.0 * (block % 2)}[pattern].float()
    coef = level / (d_qk ** -0.5 * v.dot(v))
    kv = coef[:, None] * v[None, :] + torch.randn(k, d_qk, generator=g, device=dev)
    idx = torch.arange(k, dtype=torch.int32, device=dev)[None, :].repeat(s_q, 1)  # slot j: row j
    length = torch.full((s_q,), k, dtype=torch.int32, device=dev) if layout == "compact" else None
    sink = torch.randn(heads, generator=g, device=dev)
    return dict(q=q.to(torch.bfloat16), kv=kv.to(torch.bfloat16), idx=idx, length=length,
                sink=sink)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pattern", ["rising", "falling", "odd_blocks_higher"])
@pytest.mark.parametrize("layout", ["compact", "noncompact"])
def test_gpu_running_max_moves_between_blocks(gpu_kernels: dict, pattern: str,
                                              layout: str) -> None:
    """The online softmax's rescaling when the max rises or falls block after block (and, for
    ``wgmma_split``, between the two blocks of a pair the two consumer warpgroups share)."""
    inp = ramped_inputs(pattern, layout, seed=len(pattern))
    check_against_reference(gpu_kernels, inp, 576 ** -0.5)


@pytest.mark.gpu
@gpu
def test_gpu_scale_is_a_runtime_value(gpu_kernels: dict) -> None:
    inp = make_inputs(5, 700, 333, 128, 512, "noncompact", seed=9)
    for scale in (0.3, 0.01):
        check_against_reference(gpu_kernels, inp, scale)


@pytest.mark.gpu
@gpu
def test_gpu_k_one_and_empty_batch(gpu_kernels: dict) -> None:
    inp = make_inputs(3, 50, 1, 64, 512, "compact", seed=1, oor=False)
    inp["length"][:] = torch.tensor([1, 0, 7], dtype=torch.int32, device="cuda")
    check_against_reference(gpu_kernels, inp, 0.05)
    empty = make_inputs(1, 50, 4, 64, 512, "compact", seed=2)
    q0 = empty["q"][:0]
    out, lse = run_fwd(gpu_kernels, q0, empty["kv"], empty["idx"][:0], empty["length"][:0],
                       empty["sink"], 0.05)
    assert out.shape == (0, 64, 512) and lse.shape == (0, 64)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", [(576, 128, "compact"), (512, 16, "noncompact"),
                                     (576, 64, "noncompact")], ids=lambda v: "d%d-h%d-%s" % v)
def test_gpu_persistent_grid_of_any_size(gpu_kernels: dict, variant: tuple) -> None:
    """A persistent kernel's CTAs run every tile whatever the grid: one CTA for all tiles, odd
    counts (H128 rounds them down to whole rows), fewer tiles than CTAs; compact rows of varied
    lengths (zero included) carry the mbarrier phases from tile to tile."""
    d_qk, heads, layout = variant
    if "num_sms" not in gpu_kernels[variant].kernel.scalar_names:
        pytest.skip("not a persistent flavour")
    inp = make_inputs(37, 900, 300, heads, d_qk, layout, seed=11)
    for num_sms in (1, 2, 3, 7, 64, 1000):
        check_against_reference(gpu_kernels, inp, d_qk ** -0.5, num_sms=num_sms)
