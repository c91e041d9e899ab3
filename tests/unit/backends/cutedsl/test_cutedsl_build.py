"""CuTe DSL backward pre/post-processing: AOT build, export, link, and the cutlass-free loader.

CPU: both kernels compile, export and link (``dsl_runtime``) for sm_90a and sm_100a in worker
processes (:func:`dsa_aot.backends.cutedsl.build.build_cutedsl`); the isfinite feature probe;
the forced fallback builds a different cubin; a fresh process loads the libraries through
:mod:`dsa_aot.backends.cutedsl.runtime` without importing ``cutlass``.
GPU (``-m gpu``): a bwd spec built and published by :func:`dsa_aot.build.build_and_publish`
(and a forced ``use_isfinite=False`` build), loaded by the backend; its preprocess and
postprocess stages against an fp64 reference, every sink edge case, both isfinite paths.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import embedded_cubin

from dsa_aot.backends import get as get_backend
from dsa_aot.backends.cutedsl.build import BuildRequest, build_cutedsl, probe_isfinite, read_record
from dsa_aot.backends.cutedsl.records import DSL_RUNTIME_LIB, CuteExportRecord
from dsa_aot.backends.cutedsl.runtime import CuteRuntimeError, find_runtime_library, load_kernel
from dsa_aot.kernels.dkv_interleave import natural_order

ARCHES = ("sm_90a", "sm_100a")
_CUDA = torch.cuda.is_available()
try:
    _DSL_VERSION: str | None = importlib.metadata.version("nvidia-cutlass-dsl")
except importlib.metadata.PackageNotFoundError:  # a run-time-only machine
    _DSL_VERSION = None
_needs_dsl = pytest.mark.skipif(_DSL_VERSION is None, reason="needs nvidia-cutlass-dsl")


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CuteExportRecord]:
    """Every kernel for both arches, plus the forced fallback and a renamed rebuild (sm_90a)."""
    if _DSL_VERSION is None:
        pytest.skip("needs nvidia-cutlass-dsl to build")
    out = tmp_path_factory.mktemp("cutedsl")
    reqs = [BuildRequest(kernel=k, arch=a) for a in ARCHES
            for k in ("bwd_preprocess", "bwd_postprocess")]
    reqs += [BuildRequest(kernel="bwd_preprocess", arch=a, use_isfinite=False) for a in ARCHES]
    reqs.append(BuildRequest(kernel="bwd_preprocess", arch="sm_90a", use_isfinite=True,
                             name="renamed_isfinite"))
    records = build_cutedsl(reqs, out)
    return {r.name: r for r in records} | {"_dir": out}  # type: ignore[dict-item]


def _dir(built: dict, name: str) -> Path:
    return built["_dir"] / name


@_needs_dsl
def test_probe_matches_dsl_version() -> None:
    assert _DSL_VERSION is not None
    probed = probe_isfinite()  # in a subprocess, as callers run it
    assert probed is (_version_tuple(_DSL_VERSION) >= (4, 6))
    if _DSL_VERSION == "4.8.1":
        assert probed is True


@pytest.mark.parametrize("arch", ARCHES)
def test_build_export_link(built: dict, arch: str) -> None:
    for name, kernel in ((f"cutedsl_bwd_preprocess_{arch}_isfinite", "bwd_preprocess"),
                         (f"cutedsl_bwd_preprocess_{arch}_infcmp", "bwd_preprocess"),
                         (f"cutedsl_bwd_postprocess_{arch}", "bwd_postprocess")):
        rec = built[name]
        folder = _dir(built, name)
        assert rec == read_record(folder)
        assert rec.kernel == kernel and rec.arch == arch and rec.link == "dsl_runtime"
        for f in (rec.library, rec.object_file, rec.header):
            assert (folder / f).stat().st_size > 0
        lib = (folder / rec.library).read_bytes()
        assert lib[:4] == b"\x7fELF" and DSL_RUNTIME_LIB.encode() in lib  # DT_NEEDED entry
        assert rec.symbols.entry.encode() in lib
        flags, = struct.unpack_from("<I", embedded_cubin((folder / rec.object_file).read_bytes()),
                                    0x30)
        assert int(arch[3:-1]) in (flags & 0xFF, (flags >> 8) & 0xFF)  # e_flags carry the SM
        (runtime,) = rec.runtime_libs
        assert runtime.name == DSL_RUNTIME_LIB and runtime.size > 1 << 20
    pre = built[f"cutedsl_bwd_preprocess_{arch}_isfinite"]
    assert [a.name for a in pre.args] == ["out", "dout", "lse", "attn_sink", "delta", "lse_sink",
                                          "d_sink", "stream"]
    out_arg = pre.args[0]
    assert [d.symbol for d in out_arg.shape[:2]] == ["s_q", "heads"]
    assert out_arg.shape[2].value == 512 and out_arg.stride[2].value == 1
    post = built[f"cutedsl_bwd_postprocess_{arch}"]
    assert [a.name for a in post.args] == ["dkv_acc", "dkv", "stream"]
    assert post.args[0].shape[0].symbol == "s_kv" and post.args[0].shape[1].value is None


@pytest.mark.parametrize("arch", ARCHES)
def test_isfinite_choice_changes_the_cubin(built: dict, arch: str) -> None:
    auto = built[f"cutedsl_bwd_preprocess_{arch}_isfinite"]
    forced = built[f"cutedsl_bwd_preprocess_{arch}_infcmp"]
    assert auto.use_isfinite is True and forced.use_isfinite is False
    cubin_auto = embedded_cubin((_dir(built, auto.name) / auto.object_file).read_bytes())
    cubin_forced = embedded_cubin((_dir(built, forced.name) / forced.object_file).read_bytes())
    assert cubin_auto != cubin_forced
    if arch == "sm_90a":  # same flag under another name: the identical cubin (deterministic)
        again = built["renamed_isfinite"]
        assert again.symbols.entry != auto.symbols.entry
        assert embedded_cubin((_dir(built, again.name) / again.object_file).read_bytes()) \
            == cubin_auto


_LOAD_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
from dsa_aot.backends.cutedsl.runtime import CuteRuntimeError, load_kernel
report = {}
for folder in sys.argv[1:]:
    start = time.perf_counter()
    k = load_kernel(folder)
    entry = {"load_s": time.perf_counter() - start, "tensors": k.tensor_names,
             "runtime": [str(p) for p in k.runtime_paths]}
    try:
        k.prepare(0)
        entry["prepare"] = "ok"
    except CuteRuntimeError as exc:
        entry["prepare"] = str(exc)
    report[folder] = entry
report["modules"] = sorted(m for m in ("cutlass", "torch", "cuda") if m in sys.modules)
print(json.dumps(report))
"""


def test_fresh_process_loads_without_cutlass(built: dict) -> None:
    folders = [str(_dir(built, n)) for n in ("cutedsl_bwd_preprocess_sm_90a_isfinite",
                                             "cutedsl_bwd_preprocess_sm_100a_infcmp",
                                             "cutedsl_bwd_postprocess_sm_90a")]
    proc = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, *folders], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["modules"] == []  # neither cutlass nor torch nor cuda-python was imported
    for folder in folders:
        entry = report[folder]
        assert entry["runtime"] and entry["runtime"][0].endswith(DSL_RUNTIME_LIB)
        if not _CUDA:  # the call path reaches CUDA and reports its error cleanly
            assert "loading the cubin failed with CUDA error" in entry["prepare"]
    assert report[folders[0]]["tensors"] == ["out", "dout", "lse", "attn_sink", "delta",
                                             "lse_sink", "d_sink"]


def test_runtime_library_must_match_record(built: dict, tmp_path: Path) -> None:
    rec = built["cutedsl_bwd_postprocess_sm_90a"].runtime_libs[0]
    impostor = tmp_path / rec.name
    impostor.write_bytes(b"\0" * 16)
    bogus = rec.model_copy(update={"size": rec.size + 1, "package_path": "nowhere/" + rec.name})
    with pytest.raises(CuteRuntimeError, match="was not found; rejected"):
        find_runtime_library(bogus, tmp_path, explicit=impostor)
    same_size = tmp_path / "sized" / rec.name
    same_size.parent.mkdir()
    same_size.write_bytes(b"\0" * rec.size)
    with pytest.raises(CuteRuntimeError, match="sha256 differs"):
        find_runtime_library(rec.model_copy(update={"package_path": "nowhere/x"}), tmp_path,
                             explicit=same_size)
    assert find_runtime_library(rec, tmp_path).name == rec.name  # the installed wheel's copy


@pytest.mark.parametrize("name", ["cutedsl_bwd_preprocess_sm_90a_isfinite",
                                  "cutedsl_bwd_postprocess_sm_100a"])
def test_call_frame_matches_c_layout(built: dict, name: str) -> None:
    """The packed argument frame equals the C structs the exported entry reads."""
    kernel = load_kernel(_dir(built, name))
    frame = kernel.frame
    ref = frame.frame_type()
    scalars: list[int] = []
    value = 0x1000
    for i, arg in enumerate(kernel.record.args):
        value += 0x10001
        scalars.append(value)
        if arg.kind == "stream":
            setattr(ref, f"a{i}", value)
            continue
        desc = getattr(ref, f"a{i}")
        desc.data = value
        for field, dims in (("shapes", arg.dynamic_shape_dims), ("strides", arg.dynamic_stride_dims)):
            for k in range(len(dims)):
                value += 3
                getattr(desc, field)[k] = value
                scalars.append(value)
    buf, argv = frame.pack(scalars)
    assert buf.raw[:ctypes.sizeof(ref)] == bytes(ref)
    base = ctypes.addressof(buf)
    assert argv == base + frame.argv_offset
    pointers = struct.unpack_from(frame.argv_format, buf, frame.argv_offset)
    assert [p - base for p in pointers] == [getattr(type(ref), f).offset for f, _ in ref._fields_]
    assert frame.result(buf) == 0


def test_arguments_are_validated_before_cuda(built: dict) -> None:
    post = load_kernel(_dir(built, "cutedsl_bwd_postprocess_sm_90a"))
    acc = torch.zeros(4, 576)
    with pytest.raises(ValueError, match="dkv must be bfloat16"):
        post(acc, torch.zeros(4, 576))
    with pytest.raises(ValueError, match="dkv: size.0.=5 but dkv_acc has s_kv=4"):
        post(acc, torch.zeros(5, 576, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dkv_acc: size.1.=100 must be a multiple of 64"):
        post(torch.zeros(4, 100), torch.zeros(4, 100, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dkv_acc: stride.1. must be 1"):
        post(torch.zeros(4, 1152)[:, ::2], torch.zeros(4, 576, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        post(acc, torch.zeros(4, 576, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="missing tensors"):
        post(dkv_acc=acc)
    pre = load_kernel(_dir(built, "cutedsl_bwd_preprocess_sm_90a_isfinite"))
    out = torch.zeros(3, 16, 512, dtype=torch.bfloat16)
    rows = torch.zeros(3, 16)
    with pytest.raises(ValueError, match="out: size.2. must be 512"):
        pre(torch.zeros(3, 16, 576, dtype=torch.bfloat16), out, rows, rows[0], rows, rows, rows[0])
    with pytest.raises(ValueError, match="attn_sink: size.0.=8 but out has heads=16"):
        pre(out, out, rows, torch.zeros(8), rows, rows, rows[0])


# ---------------------------------------------------------------------------------------------
# GPU: numerics
# ---------------------------------------------------------------------------------------------

SINKS = [math.inf, -math.inf, 2.4e38, -2.4e38, 0.0, 1.5, -3.0, 7.25]


def preprocess_ref(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 delta, lse_sink, d_sink with the contract's edge values, and d_sink's scale
    (``sum_t |p_sink * delta|``, what its rounding error is relative to)."""
    delta = (out.double() * dout.double()).sum(-1)
    lse64, sink64 = lse.double(), sink.double()[None, :].expand_as(lse)
    lse_sink = torch.logaddexp(lse64, sink64)
    finite = torch.isfinite(lse_sink) & torch.isfinite(sink64)
    p = torch.where(finite, torch.exp(torch.where(finite, sink64 - lse_sink, 0.0)), 0.0)
    p = torch.where(torch.isposinf(sink64), 1.0, p)
    return delta, lse_sink, -(p * delta).sum(0), (p * delta).abs().sum(0)


GPU_SPEC = "bwd-{arch}-d576-h64-compact-cutedsl"


@pytest.fixture(scope="module")
def gpu_stages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The loaded backward of this GPU's arch, keyed by isfinite variant: the spec built and
    published by the production build path (the DSL probe picks isfinite), and a forced
    ``use_isfinite=False`` build; both loaded by the backend."""
    from dsa_aot.build import build_and_publish, manifest_for
    from dsa_aot.cache.store import ArtifactStore
    from dsa_aot.identity import can_key_builds
    from dsa_aot.runners import StagedBwd
    from dsa_aot.specs.models import KernelSpec
    from dsa_aot.specs.toolchain import Toolchain

    if not _CUDA:
        pytest.skip("needs a CUDA GPU")
    backend, toolchain = get_backend("cutedsl"), Toolchain.current()
    why = can_key_builds(backend, toolchain)
    if why:
        pytest.skip(f"cannot build: {why}")
    arch = "sm_100a" if torch.cuda.get_device_capability()[0] >= 10 else "sm_90a"
    spec = KernelSpec.from_id(GPU_SPEC.format(arch=arch))
    store = ArtifactStore(tmp_path_factory.mktemp("cutedsl-pre-post"))
    done = build_and_publish(store, spec, toolchain)
    assert done.manifest.features == {"cute_math_isfinite": True}, "this DSL has no cute.math.isfinite"
    forced = backend.build(spec, use_isfinite=False)
    loaded = {"isfinite": backend.load(done.manifest, done.read(store), 0),
              "infcmp": backend.load(manifest_for(backend, spec, toolchain, forced), forced.files.__getitem__, 0)}
    for variant, kernel in loaded.items():
        assert isinstance(kernel, StagedBwd)
        assert kernel.pre.record.use_isfinite is (variant == "isfinite")
    return loaded


def _run_preprocess(kernel, s_q: int, heads: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.randn(s_q, heads, 512, device="cuda", generator=g).bfloat16()
    dout = torch.randn(s_q, heads, 512, device="cuda", generator=g).bfloat16()
    lse = torch.randn(s_q, heads, device="cuda", generator=g) * 4
    lse[::5] = math.inf                      # empty rows
    lse[1::7] = -100.0                       # very negative lse
    sink = torch.tensor([SINKS[i % len(SINKS)] for i in range(heads)], device="cuda")
    delta = torch.full((s_q, heads), math.nan, device="cuda")
    lse_sink = torch.full((s_q, heads), math.nan, device="cuda")
    d_sink = torch.zeros(heads, device="cuda")
    kernel(out, dout, lse, sink, delta, lse_sink, d_sink)
    torch.cuda.synchronize()
    return {"out": out, "dout": dout, "lse": lse, "sink": sink, "delta": delta,
            "lse_sink": lse_sink, "d_sink": d_sink}


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("s_q,heads", [(1, 16), (37, 64), (300, 128)])
def test_preprocess_matches_fp64(gpu_stages: dict, s_q: int, heads: int) -> None:
    results = []
    for variant in ("isfinite", "infcmp"):
        r = _run_preprocess(gpu_stages[variant].pre, s_q, heads, seed=s_q)
        delta, lse_sink, d_sink, scale = preprocess_ref(r["out"], r["dout"], r["lse"], r["sink"])
        assert not r["delta"].isnan().any() and not r["lse_sink"].isnan().any()
        assert torch.isfinite(r["d_sink"]).all()
        assert ((r["delta"].double() - delta).norm() / delta.norm()).item() < 1e-5
        inf = torch.isinf(lse_sink)
        assert torch.equal(torch.isinf(r["lse_sink"]), inf)
        assert torch.equal(r["lse_sink"][inf], lse_sink[inf].float())
        fin = lse_sink[~inf]
        if fin.numel():
            assert ((r["lse_sink"][~inf].double() - fin).norm() / fin.norm()).item() < 1e-6
        assert ((r["d_sink"].double() - d_sink).abs() <= 1e-5 * scale + 1e-6).all()
        results.append(r)
    assert torch.equal(results[0]["delta"], results[1]["delta"])
    assert torch.equal(results[0]["lse_sink"], results[1]["lse_sink"])
    # d_sink: same terms, atomics in another order
    assert ((results[0]["d_sink"] - results[1]["d_sink"]).double().abs() <= 1e-5 * scale + 1e-6).all()


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("s_kv,d", [(1, 512), (777, 576), (4096, 576)])
def test_postprocess_rounds_like_torch(gpu_stages: dict, s_kv: int, d: int) -> None:
    kernel = gpu_stages["isfinite"].post
    acc = torch.randn(s_kv, d, device="cuda") * 1e3
    acc.view(-1)[::97] = 3.4e38              # rounds to +inf in bf16, like torch
    dkv = torch.full((s_kv, d), math.nan, device="cuda", dtype=torch.bfloat16)
    kernel(acc, dkv)
    torch.cuda.synchronize()
    # the accumulator's columns are interleaved (kernels/dkv_interleave.py): dkv is the natural order
    order = torch.tensor(natural_order(d), device="cuda")
    assert torch.equal(dkv, acc[:, order].bfloat16())
