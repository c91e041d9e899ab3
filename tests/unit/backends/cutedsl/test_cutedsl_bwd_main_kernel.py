"""CuTe DSL sparse MLA backward main kernel: AOT compile, export, link, and numerics.

CPU: a few variants compile, export (``export_to_c``) and link (``static_cudart``) for sm_90a
and sm_100a in worker processes (``CUTE_DSL_ARCH`` set before ``cutlass`` is imported); the
generated C ABI is checked and a fresh process opens the library with ``ctypes`` only; the
``bwd_main`` kind of ``dsa_aot.cutedsl_backend`` builds records that ``dsa_aot.cutedsl_runtime``
loads without ``cutlass``. The full sweep is ``-m slow``.

GPU (``-m gpu``): the exported library (built here, or on the CPU machine into the folder named
by ``DSA_AOT_CUTE_BWD_ARTIFACTS`` with ``python tests/test_cutedsl_bwd_main.py build <dir>``)
runs with ``delta`` / ``lse_sink`` from the reference around it; ``dq`` and ``dkv`` are compared
with the fp64 reference by ``||x - ref|| / ||ref||``, over both layouts, H 16/64/128, D 512/576,
K 128/300/2048, S_kv 95/4096 (K > S_kv included) and the edge cases of the contract, for each
MMA flavour whose artifacts exist (``mma``; ``wgmma`` on sm_90a). The timing case (S_q 4096,
S_kv 8192, H 64, D 576, K 2048) prints the median of 20 launches. One case also goes through
``dsa_aot.cutedsl_runtime`` (backend-built record, tensors by name, ``softmax_scale=``).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dsa_aot.kernels.reference import sparse_mla_bwd_ref, sparse_mla_fwd_ref

ARTIFACTS_ENV = "DSA_AOT_CUTE_BWD_ARTIFACTS"
META_FILE = "meta.json"
_CUDA = torch.cuda.is_available()
try:
    import importlib.util

    _HAS_DSL = importlib.util.find_spec("cutlass") is not None
except (ImportError, ValueError):  # pragma: no cover
    _HAS_DSL = False
_needs_dsl = pytest.mark.skipif(not _HAS_DSL, reason="needs nvidia-cutlass-dsl to compile")
_needs_cuda = pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU")

INT32_MIN = -(2**31)


def artifact_name(arch: str, d_qk: int, heads: int, layout: str) -> str:
    return f"cutedsl_bwd_main_{arch}_d{d_qk}_h{heads}_{layout}"


def _backend_has_bwd_main() -> bool:
    """Whether ``dsa_aot.cutedsl_backend`` knows the ``bwd_main`` kernel kind."""
    from typing import get_args

    from dsa_aot.cutedsl_backend import CuteKernel

    return "bwd_main" in get_args(CuteKernel)


#: Sub-folder of the GPU artifact folder holding backend-built (``record.json``) artifacts.
RECORDS_DIR = "records"


# --------------------------------------------------------------------------------------------
# Build: one worker process per arch (CUTE_DSL_ARCH before ``import cutlass``), link here
# --------------------------------------------------------------------------------------------

def _worker(request_path: str) -> None:
    """Compile and export every job of the request (run with CUTE_DSL_ARCH set)."""
    request = json.loads(Path(request_path).read_text())
    import cutlass
    from cutlass.cute.export import aot_config

    from dsa_aot.kernels.cutedsl_bwd_main import compile_bwd_main

    results = []
    for job in request["jobs"]:
        start = time.perf_counter()
        compiled, fakes = compile_bwd_main(request["arch"], job["d_qk"], job["heads"],
                                           job["layout"], **job["options"])
        compiled_at = time.perf_counter()
        compiled.export_to_c(job["dir"], job["name"], job["name"])
        args = []
        for name, fake in fakes.items():
            if name == "stream":
                args.append({"kind": "stream", "name": name})
            elif name == "softmax_scale":
                args.append({"kind": "float32", "name": name})
            else:
                args.append({"kind": "tensor", "name": name,
                             "dtype": fake.element_type.__name__,
                             "dyn_shape": [i for i, e in enumerate(fake.shape)
                                           if not isinstance(e, int)],
                             "dyn_stride": [i for i, e in enumerate(fake.stride)
                                            if not isinstance(e, int)],
                             "align": int(fake._assumed_align or 1)})
        results.append({"name": job["name"], "args": args,
                        "compile_seconds": round(compiled_at - start, 3),
                        "export_seconds": round(time.perf_counter() - compiled_at, 3)})
    Path(request["reply"]).write_text(json.dumps({"results": results,
                                                  "libdir": aot_config.get_libdir(),
                                                  "dsl_version": cutlass.__version__}))


_RE_INIT = re.compile(r"void (_mlir_\w+_cuda_init)\(void \*\*\);")
_RE_LOAD = re.compile(r"void (_mlir_\w+_cuda_load_to_device)\(void \*\*\);")
_RE_ENTRY = re.compile(r"void (_mlir_\w+__mlir_ciface_\w+)\(void \*\*args, int32_t num_args\);")
_RE_PACKED = re.compile(r"void \*args\[(\d+)\] = \{(?P<body>[^}]*)\};")


def build_variants(out_dir: Path, variants: list[tuple[Any, ...]], link: str = "static_cudart",
                   timeout: float = 1200.0) -> list[dict[str, Any]]:
    """Compile, export and link ``(arch, d_qk, heads, layout[, options])`` variants into
    ``out_dir/<name>/`` (``options``: keyword arguments of ``compile_bwd_main``).

    Each folder gets ``<name>.h``, ``.o``, ``.so`` and ``meta.json`` (arguments, entry symbols,
    seconds). Raises ``RuntimeError`` with the worker's stderr when a build fails.
    """
    from dsa_aot.cutedsl_backend import _link

    out_dir.mkdir(parents=True, exist_ok=True)
    by_arch: dict[str, list[dict[str, Any]]] = {}
    for arch, d_qk, heads, layout, *rest in variants:
        options = dict(rest[0]) if rest else {}
        name = artifact_name(arch, d_qk, heads, layout)
        if options:
            name += "_" + "_".join(f"{k}{int(v) if isinstance(v, bool) else v}"
                                   for k, v in sorted(options.items()))
        folder = out_dir / name
        folder.mkdir(exist_ok=True)
        by_arch.setdefault(arch, []).append({"name": name, "d_qk": d_qk, "heads": heads,
                                             "layout": layout, "dir": str(folder), "arch": arch,
                                             "options": options})
    procs = {}
    for arch, jobs in by_arch.items():
        request = out_dir / f".request-{arch}.json"
        request.write_text(json.dumps({"arch": arch, "jobs": jobs,
                                       "reply": str(out_dir / f".reply-{arch}.json")}))
        env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_DISABLE_FILE_CACHING="1")
        code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import test_cutedsl_bwd_main as m; m._worker({str(request)!r})")
        procs[arch] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=env)
    metas = []
    for arch, proc in procs.items():
        _, stderr = proc.communicate(timeout=timeout)
        reply_path = out_dir / f".reply-{arch}.json"
        if proc.returncode != 0 or not reply_path.is_file():
            raise RuntimeError(f"bwd_main build for {arch} failed ({proc.returncode}):\n"
                               f"{stderr[-4000:]}")
        reply = json.loads(reply_path.read_text())
        for job, result in zip(by_arch[arch], reply["results"]):
            folder = Path(job["dir"])
            name = job["name"]
            header = (folder / f"{name}.h").read_text()
            symbols = {k: r.search(header) for k, r in (("init", _RE_INIT), ("load", _RE_LOAD),
                                                        ("entry", _RE_ENTRY))}
            if any(m is None for m in symbols.values()):
                raise RuntimeError(f"{name}.h: entry points not found")
            start = time.perf_counter()
            _link(folder / f"{name}.o", folder / f"{name}.so", link, Path(reply["libdir"]))
            meta = {"name": name, "arch": arch, "d_qk": job["d_qk"], "heads": job["heads"],
                    "layout": job["layout"], "options": job["options"],
                    "library": f"{name}.so", "link": link,
                    "symbols": {k: m.group(1) for k, m in symbols.items()},
                    "args": result["args"], "dsl_version": reply["dsl_version"],
                    "compile_seconds": result["compile_seconds"],
                    "export_seconds": result["export_seconds"],
                    "link_seconds": round(time.perf_counter() - start, 3)}
            (folder / META_FILE).write_text(json.dumps(meta, indent=1))
            metas.append(meta)
    return metas


# --------------------------------------------------------------------------------------------
# ctypes launcher of the exported library (no cutlass)
# --------------------------------------------------------------------------------------------

_TORCH_DTYPES = {"BFloat16": torch.bfloat16, "Float32": torch.float32, "Int32": torch.int32}


class BwdMainLibrary:
    """An exported ``bwd_main`` library loaded with ``ctypes``; call with tensors + scale."""

    def __init__(self, folder: Path) -> None:
        self.meta = json.loads((folder / META_FILE).read_text())
        self.lib = ctypes.CDLL(str(folder / self.meta["library"]))
        sym = self.meta["symbols"]
        self._init = getattr(self.lib, sym["init"])
        self._load = getattr(self.lib, sym["load"])
        self._entry = getattr(self.lib, sym["entry"])
        for fn in (self._init, self._load):
            fn.argtypes, fn.restype = [ctypes.c_void_p], None
        self._entry.argtypes, self._entry.restype = [ctypes.c_void_p, ctypes.c_int32], None
        self.tensor_args = [a for a in self.meta["args"] if a["kind"] == "tensor"]
        self._library = ctypes.c_void_p()
        self._library_ptr = ctypes.c_void_p(ctypes.addressof(self._library))
        self._ready = False

    def prepare(self, device: int) -> None:
        if self._ready:
            return
        err = ctypes.c_int32(0)
        init_args = (ctypes.c_void_p * 2)(ctypes.addressof(self._library_ptr),
                                          ctypes.addressof(err))
        self._init(init_args)
        if err.value:
            raise RuntimeError(f"{self.meta['name']}: init failed with CUDA error {err.value}")
        dev = ctypes.c_int32(device)
        load_args = (ctypes.c_void_p * 3)(ctypes.addressof(self._library_ptr),
                                          ctypes.addressof(dev), ctypes.addressof(err))
        self._load(load_args)
        if err.value:
            raise RuntimeError(f"{self.meta['name']}: load failed with CUDA error {err.value}")
        self._ready = True

    def __call__(self, tensors: dict[str, torch.Tensor], softmax_scale: float,
                 stream: int | None = None) -> None:
        keep: list[Any] = []
        pointers = []
        device = None
        for arg in self.meta["args"]:
            if arg["kind"] == "tensor":
                t = tensors[arg["name"]]
                if t.dtype != _TORCH_DTYPES[arg["dtype"]] or t.stride(-1) != 1:
                    raise ValueError(f"{arg['name']}: dtype {t.dtype} / stride {t.stride()}")
                if t.data_ptr() % arg["align"]:
                    raise ValueError(f"{arg['name']}: pointer not {arg['align']}-byte aligned")
                device = t.get_device()
                fields: list[tuple[str, Any]] = [("data", ctypes.c_void_p)]
                if arg["dyn_shape"]:
                    fields.append(("shapes", ctypes.c_int32 * len(arg["dyn_shape"])))
                if arg["dyn_stride"]:
                    fields.append(("strides", ctypes.c_int64 * len(arg["dyn_stride"])))
                desc = type("Desc", (ctypes.Structure,), {"_fields_": fields})()
                desc.data = t.data_ptr()
                for k, i in enumerate(arg["dyn_shape"]):
                    desc.shapes[k] = t.shape[i]
                for k, i in enumerate(arg["dyn_stride"]):
                    desc.strides[k] = t.stride(i)
                keep.append(desc)
            elif arg["kind"] == "float32":
                keep.append(ctypes.c_float(softmax_scale))
            else:
                if stream is None:
                    stream = torch.cuda.current_stream().cuda_stream
                keep.append(ctypes.c_void_p(stream))
            pointers.append(ctypes.addressof(keep[-1]))
        ret = ctypes.c_int32(0)
        pointers.append(ctypes.addressof(ret))
        self.prepare(device if device is not None else 0)
        argv = (ctypes.c_void_p * len(pointers))(*pointers)
        self._entry(argv, len(pointers))
        if ret.value:
            raise RuntimeError(f"{self.meta['name']}: launch failed with CUDA error {ret.value}")


# --------------------------------------------------------------------------------------------
# CPU tests
# --------------------------------------------------------------------------------------------

_CPU_VARIANTS: list[tuple[Any, ...]] = [
    ("sm_90a", 576, 64, "compact"), ("sm_90a", 512, 16, "noncompact"),
    ("sm_100a", 576, 128, "noncompact"), ("sm_90a", 576, 16, "noncompact", {"impl": "wgmma"})]


@pytest.fixture(scope="module")
def cpu_built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    if not _HAS_DSL:
        pytest.skip("needs nvidia-cutlass-dsl to compile")
    out = tmp_path_factory.mktemp("bwd_main")
    return out, build_variants(out, _CPU_VARIANTS)


@_needs_dsl
def test_export_abi_and_link(cpu_built: tuple[Path, list[dict[str, Any]]]) -> None:
    out, metas = cpu_built
    assert sorted((m["arch"], m["d_qk"], m["heads"], m["layout"]) for m in metas) == sorted(
        v[:4] for v in _CPU_VARIANTS)
    assert [m["name"] for m in metas if m["options"]] == [
        "cutedsl_bwd_main_sm_90a_d576_h16_noncompact_implwgmma"]
    for meta in metas:
        folder = out / meta["name"]
        header = (folder / f"{meta['name']}.h").read_text()
        packed = _RE_PACKED.search(header)
        assert packed is not None
        got = [t.strip() for t in packed["body"].split(",") if t.strip()]
        names = ["q", "kv", "dout", "topk_idxs"]
        names += ["topk_length"] if meta["layout"] == "compact" else []
        names += ["lse_sink", "delta", "dq", "dkv_acc"]
        assert got == names + ["&softmax_scale", "&stream", "&ret"]
        assert "float softmax_scale" in header
        # sizes: q is [s_q, H, D] with only s_q at run time; strides of the two outer dims
        q_arg = meta["args"][0]
        assert q_arg["dyn_shape"] == [0] and q_arg["dyn_stride"] == [0, 1]
        obj = (folder / f"{meta['name']}.o").read_bytes()
        assert meta["symbols"]["entry"].encode() in obj
        arch_tag = meta["arch"].encode()
        assert arch_tag in obj or arch_tag.replace(b"_", b"") in obj
        assert (folder / meta["library"]).stat().st_size > 100_000  # cudart linked in


@_needs_dsl
def test_library_opens_without_cutlass(cpu_built: tuple[Path, list[dict[str, Any]]]) -> None:
    out, metas = cpu_built
    code = ("import ctypes, json, sys; from pathlib import Path\n"
            "d = Path(sys.argv[1]); m = json.loads((d / 'meta.json').read_text())\n"
            "lib = ctypes.CDLL(str(d / m['library']))\n"
            "[getattr(lib, s) for s in m['symbols'].values()]\n"
            "assert 'cutlass' not in sys.modules; print('OK')\n")
    for meta in metas:
        proc = subprocess.run([sys.executable, "-c", code, str(out / meta["name"])],
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr


@_needs_dsl
def test_bad_params_are_refused() -> None:
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
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.count("refused") == 4


_VIEW_CHECK = """
import cutlass.cute as cute
from dsa_aot.kernels import cutedsl_bwd_main as k

def same_bytes(tile, view, rows, cols):
    return sum(1 for r in range(rows) for c in range(cols) if tile((r, c)) != view((c, r)))

def run_checks():
    for d in (512, 576):
        lay = k.wgmma_smem_layouts(d)
        d_pad = cute.size(lay["q_t"].outer, mode=[0])
        assert d_pad % k.WG_CHUNK == 0 and d <= d_pad < d + k.WG_CHUNK
        assert str(lay["q"].inner) == str(lay["q_t"].inner) == str(lay["p_t"].inner)
        print("q", d, same_bytes(lay["q"].outer, lay["q_t"].outer, 64, d))
        assert str(lay["kv"]) == str(lay["q"]) and str(lay["kv_t"]) == str(lay["q_t"])
        size = cute.cosize(lay["q"].outer)
        pad = [lay["q_t"].outer((c, r)) for r in range(64) for c in range(d, d_pad)]
        print("pad", d, sum(1 for o in pad if not size <= o < size + 64 * 64))
    print("dout", same_bytes(lay["dout"].outer, lay["dout_t"].outer, 64, 512))
    print("p", same_bytes(lay["p"].outer, lay["p_t"].outer, 64, 64))

@cute.jit
def check():
    run_checks()

check()
"""


@_needs_dsl
def test_wgmma_transposed_views_alias_the_tiles(tmp_path: Path) -> None:
    """The MN-major operand views of the wgmma flavour address exactly the K-major tiles' bytes
    (element by element), and the padding columns stay inside the next 64 x 64 buffer."""
    script = tmp_path / "views.py"
    script.write_text(_VIEW_CHECK)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    counts = [line for line in lines if line.split(" ")[0] in ("q", "pad", "dout", "p")]
    assert len(counts) == 6 and all(line.endswith(" 0") for line in counts), proc.stdout


@_needs_dsl
def test_backend_kind_builds_and_loads(tmp_path: Path) -> None:
    """``build_cutedsl`` builds ``bwd_main``; a fresh process loads it without ``cutlass``."""
    if not _backend_has_bwd_main():
        pytest.skip("dsa_aot.cutedsl_backend has no bwd_main kind")
    from dsa_aot.cutedsl_backend import BuildRequest, build_cutedsl

    with pytest.raises(ValueError, match="bwd_main needs d_qk"):
        BuildRequest(kernel="bwd_main", arch="sm_90a", d_qk=576, heads=64)
    with pytest.raises(ValueError, match="impl=wgmma needs sm_90a"):
        BuildRequest(kernel="bwd_main", arch="sm_100a", d_qk=576, heads=64, layout="compact",
                     impl="wgmma")
    with pytest.raises(ValueError):
        BuildRequest(kernel="bwd_main", arch="sm_90a", d_qk=576, heads=64, layout="compact",
                     kv_stages=2)
    reqs = [BuildRequest(kernel="bwd_main", arch="sm_90a", d_qk=576, heads=64, layout="compact",
                         link="static_cudart"),
            BuildRequest(kernel="bwd_main", arch="sm_100a", d_qk=512, heads=16,
                         layout="noncompact"),
            BuildRequest(kernel="bwd_main", arch="sm_90a", d_qk=512, heads=64,
                         layout="noncompact", impl="wgmma")]
    records = build_cutedsl(reqs, tmp_path)
    assert sorted(r.name for r in records) == sorted([
        "cutedsl_bwd_main_sm_90a_d576_h64_compact_static",
        "cutedsl_bwd_main_sm_100a_d512_h16_noncompact",
        "cutedsl_bwd_main_sm_90a_d512_h64_noncompact_wgmma"])
    by_name = {r.name: r for r in records}
    records = [by_name[n] for n in ("cutedsl_bwd_main_sm_90a_d576_h64_compact_static",
                                    "cutedsl_bwd_main_sm_100a_d512_h16_noncompact",
                                    "cutedsl_bwd_main_sm_90a_d512_h64_noncompact_wgmma")]
    for rec, req in zip(records, reqs):
        assert (rec.kernel, rec.d_qk, rec.heads, rec.layout, rec.impl) == (
            "bwd_main", req.d_qk, req.heads, req.layout, req.impl or "mma")
        names = [a.name for a in rec.args]
        tensors = ["q", "kv", "dout", "topk_idxs"]
        tensors += ["topk_length"] if req.layout == "compact" else []
        tensors += ["lse_sink", "delta", "dq", "dkv_acc"]
        assert names == tensors + ["softmax_scale", "stream"]
        assert rec.args[-2].kind == "scalar" and rec.args[-2].dtype == "float32"
        dkv = rec.args[len(tensors) - 1]
        assert dkv.align == 16 and dkv.stride[0].divisibility == 4
    code = ("import sys\nfrom dsa_aot.cutedsl_runtime import load_kernel\n"
            "k = load_kernel(sys.argv[1])\nprint(','.join(k.tensor_names))\n"
            "assert 'cutlass' not in sys.modules\n")
    for rec in records:
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / rec.name)],
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip().split(",")[-1] == "dkv_acc"


@pytest.mark.slow
@_needs_dsl
def test_full_sweep_builds(tmp_path: Path) -> None:
    variants = [(a, d, h, lay) for a in ("sm_90a", "sm_100a") for d in (512, 576)
                for h in (16, 32, 64, 128) for lay in ("compact", "noncompact")]
    metas = build_variants(tmp_path, variants)
    assert len(metas) == len(variants)
    for meta in metas:
        assert (tmp_path / meta["name"] / meta["library"]).is_file()


# --------------------------------------------------------------------------------------------
# GPU tests
# --------------------------------------------------------------------------------------------

GPU_VARIANTS = [("sm_90a", d, h, lay) for d in (512, 576) for h in (16, 64, 128)
                for lay in ("compact", "noncompact")]
#: MMA flavours checked on the GPU; "wgmma" (sm_90a) only where its artifacts were built.
IMPLS = ("mma", "wgmma")
_RESULTS: list[dict[str, Any]] = []


def gpu_build_list(arch: str) -> list[tuple[Any, ...]]:
    """The variants the GPU tests load for ``arch`` (both MMA flavours on sm_90a)."""
    out: list[tuple[Any, ...]] = [(arch, d, h, lay) for _, d, h, lay in GPU_VARIANTS]
    if arch == "sm_90a":
        out += [(arch, d, h, lay, {"impl": "wgmma"}) for _, d, h, lay in GPU_VARIANTS]
    return out


def _variant_name(variant: tuple[Any, ...]) -> str:
    arch, d, h, lay, *rest = variant
    name = artifact_name(arch, d, h, lay)
    return name + ("_implwgmma" if rest and rest[0].get("impl") == "wgmma" else "")


@pytest.fixture(scope="module")
def gpu_libs(tmp_path_factory: pytest.TempPathFactory,
             ) -> dict[tuple[int, int, str, str], BwdMainLibrary]:
    """Loaded artifacts keyed by ``(d_qk, heads, layout, impl)``."""
    if not _CUDA:
        pytest.skip("needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    arch = "sm_100a" if major == 10 else "sm_90a"
    if major not in (9, 10):
        pytest.skip(f"no artifact for compute capability {major}.{minor}")
    folder = os.environ.get(ARTIFACTS_ENV)
    if folder:
        root = Path(folder)
    elif _HAS_DSL:
        root = tmp_path_factory.mktemp("bwd_main_gpu")
        build_variants(root, gpu_build_list(arch))
    else:
        pytest.skip(f"set {ARTIFACTS_ENV} to prebuilt artifacts (no CuTe DSL here)")
    libs = {}
    for variant in gpu_build_list(arch):
        path = root / _variant_name(variant)
        if (path / META_FILE).is_file():
            impl = variant[4]["impl"] if len(variant) > 4 else "mma"
            libs[(variant[1], variant[2], variant[3], impl)] = BwdMainLibrary(path)
    return libs


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


def _run(lib: BwdMainLibrary, inp: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    q = inp["q"]
    dq = torch.full_like(q, float("nan"))
    dkv_acc = torch.zeros(inp["kv"].shape, device="cuda", dtype=torch.float32)
    tensors = {"q": q, "kv": inp["kv"], "dout": inp["dout"], "topk_idxs": inp["topk_idxs"],
               "lse_sink": inp["lse_sink"], "delta": inp["delta"], "dq": dq, "dkv_acc": dkv_acc}
    if inp["topk_length"] is not None:
        tensors["topk_length"] = inp["topk_length"]
    lib(tensors, inp["scale"])
    torch.cuda.synchronize()
    return dq, dkv_acc.to(torch.bfloat16)


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
]


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(_CASES)))
def test_gpu_matches_reference(gpu_libs: dict, case: int, impl: str) -> None:
    layout, heads, d_qk, topk, s_kv, s_q, extra = _CASES[case]
    lib = gpu_libs.get((d_qk, heads, layout, impl))
    if lib is None:
        pytest.skip(f"no {impl} artifact for d{d_qk} h{heads} {layout}")
    inp = _case_inputs(s_q, s_kv, heads, d_qk, topk, layout, seed=case, **extra)
    dq, dkv = _run(lib, inp)
    dq_ref, dkv_ref, _ = sparse_mla_bwd_ref(inp["q"], inp["kv"], inp["out"], inp["dout"],
                                            inp["lse"], inp["topk_idxs"], inp["topk_length"],
                                            inp["sink"], inp["scale"])
    entry = {"case": case, "impl": impl, "layout": layout, "heads": heads, "d_qk": d_qk,
             "topk": topk,
             "s_kv": s_kv, "s_q": s_q, **extra,
             "dq_rel": _rel(dq, dq_ref), "dkv_rel": _rel(dkv, dkv_ref),
             "dq_nan": int(dq.isnan().sum().item()), "dkv_nan": int(dkv.isnan().sum().item()),
             "dq_ref_norm": dq_ref.norm().item(), "dkv_ref_norm": dkv_ref.norm().item()}
    _log(entry)
    assert entry["dq_nan"] == 0 and entry["dkv_nan"] == 0
    assert entry["dq_rel"] < 2e-2, entry
    assert entry["dkv_rel"] < 2e-2, entry
    if extra.get("all_invalid_rows"):
        rows = extra["all_invalid_rows"]
        assert torch.count_nonzero(dq[:rows]).item() == 0


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_sink_plus_inf_gives_zero(gpu_libs: dict, impl: str) -> None:
    lib = gpu_libs.get((576, 64, "compact", impl))
    if lib is None:
        pytest.skip(f"no {impl} artifact for d576 h64 compact")
    inp = _case_inputs(8, 256, 64, 576, 128, "compact", seed=99, sinks="none")
    inp["lse_sink"] = torch.full_like(inp["lse_sink"], float("inf"))
    dq, dkv = _run(lib, inp)
    _log({"case": "sink=+inf", "impl": impl, "dq_absmax": dq.abs().max().item(),
          "dkv_absmax": dkv.float().abs().max().item()})
    assert torch.count_nonzero(dq).item() == 0 and torch.count_nonzero(dkv).item() == 0


@pytest.mark.gpu
@_needs_cuda
def test_gpu_through_runtime(tmp_path: Path) -> None:
    """The backend-built artifact through ``dsa_aot.cutedsl_runtime`` (tensors by name)."""
    major, _ = torch.cuda.get_device_capability()
    arch = "sm_100a" if major == 10 else "sm_90a"
    name = f"cutedsl_bwd_main_{arch}_d576_h64_noncompact_static"
    folder = os.environ.get(ARTIFACTS_ENV)
    if folder and (Path(folder) / RECORDS_DIR / name).is_dir():
        path = Path(folder) / RECORDS_DIR / name
    elif _HAS_DSL and _backend_has_bwd_main():
        from dsa_aot.cutedsl_backend import BuildRequest, build_cutedsl

        build_cutedsl([BuildRequest(kernel="bwd_main", arch=arch, d_qk=576, heads=64,
                                    layout="noncompact", link="static_cudart")], tmp_path)
        path = tmp_path / name
    else:
        pytest.skip(f"no backend-built {name} (build with: python {__file__} build <dir>)")
    from dsa_aot.cutedsl_runtime import load_kernel

    kernel = load_kernel(path)
    inp = _case_inputs(16, 4096, 64, 576, 300, "noncompact", seed=21, sinks="edge")
    dq = torch.full_like(inp["q"], float("nan"))
    dkv_acc = torch.zeros(inp["kv"].shape, device="cuda", dtype=torch.float32)
    kernel(q=inp["q"], kv=inp["kv"], dout=inp["dout"], topk_idxs=inp["topk_idxs"],
           lse_sink=inp["lse_sink"], delta=inp["delta"], dq=dq, dkv_acc=dkv_acc,
           softmax_scale=inp["scale"])
    torch.cuda.synchronize()
    dq_ref, dkv_ref, _ = sparse_mla_bwd_ref(inp["q"], inp["kv"], inp["out"], inp["dout"],
                                            inp["lse"], inp["topk_idxs"], None, inp["sink"],
                                            inp["scale"])
    entry = {"case": "runtime", "dq_rel": _rel(dq, dq_ref),
             "dkv_rel": _rel(dkv_acc.to(torch.bfloat16), dkv_ref)}
    _log(entry)
    assert entry["dq_rel"] < 2e-2 and entry["dkv_rel"] < 2e-2, entry


def time_kernel(lib: BwdMainLibrary, s_q: int, s_kv: int, heads: int, d_qk: int, topk: int,
                iters: int = 20) -> dict[str, Any]:
    """Median / min ms of ``iters`` launches (CUDA events, after 3 warm-up launches)."""
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
    if lib.meta["layout"] == "compact":
        tensors["topk_length"] = torch.full((s_q,), topk, device="cuda", dtype=torch.int32)
    for _ in range(3):
        lib(tensors, d_qk ** -0.5)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        lib(tensors, d_qk ** -0.5)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    flops = 2 * s_q * heads * topk * (d_qk + 512 + d_qk + d_qk + 512)
    return {"kernel": lib.meta["name"], "s_q": s_q, "s_kv": s_kv, "heads": heads, "d_qk": d_qk,
            "topk": topk, "ms_median": ms, "ms_min": min(times), "tflops": flops / ms / 1e9,
            "dq_finite": bool(torch.isfinite(tensors["dq"]).all().item())}


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_timing(gpu_libs: dict, impl: str) -> None:
    """S_q 4096, S_kv 8192, H 64, D 576, K 2048 (compact, all slots valid)."""
    lib = gpu_libs.get((576, 64, "compact", impl))
    if lib is None:
        pytest.skip(f"no {impl} artifact for d576 h64 compact")
    result = time_kernel(lib, 4096, 8192, 64, 576, 2048)
    _log({"case": "timing", **result})
    assert result["ms_median"] > 0 and result["dq_finite"]


if __name__ == "__main__":
    # python tests/test_cutedsl_bwd_main.py build <dir> [arch ...]: the GPU artifacts
    if len(sys.argv) >= 3 and sys.argv[1] == "build":
        arches = sys.argv[3:] or ["sm_90a"]
        t0 = time.perf_counter()
        built = build_variants(Path(sys.argv[2]), [v for a in arches for v in gpu_build_list(a)])
        for m in built:
            print(f"{m['name']}: compile {m['compile_seconds']} s, export {m['export_seconds']} s, "
                  f"link {m['link_seconds']} s")
        print(f"total {time.perf_counter() - t0:.1f} s")
        if _backend_has_bwd_main():  # the runtime-path artifact (record.json)
            from dsa_aot.cutedsl_backend import BuildRequest, build_cutedsl

            for rec in build_cutedsl([BuildRequest(kernel="bwd_main", arch=a, d_qk=576, heads=64,
                                                   layout="noncompact", link="static_cudart")
                                      for a in arches], Path(sys.argv[2]) / RECORDS_DIR):
                print(f"{rec.name}: {rec.build_seconds} s (backend)")
