"""Build side of the CuTe DSL backend: spec -> worker requests -> exported, linked libraries.

Each build runs in a worker process (:mod:`dsa_aot.backends.cutedsl.worker`) whose environment
has ``CUTE_DSL_ARCH=<arch>`` before ``cutlass`` is imported: the DSL reads it once at import
and otherwise assumes sm_100, so an sm_90a export on a machine without that GPU fails. The
worker ``cute.compile``s with ``--gpu-arch <arch>`` over dynamic-shape fake tensors and calls
``export_to_c`` (a ``.h`` and a ``.o`` holding the host launcher plus the embedded cubin). This
process then links the ``.o`` into ``<name>.so`` and writes ``record.json``
(:class:`~dsa_aot.backends.cutedsl.records.CuteExportRecord`), which is everything
:mod:`dsa_aot.backends.cutedsl.runtime` needs.

Link modes:

* ``dsl_runtime``: ``cc -shared <name>.o -L<libdir> -lcute_dsl_runtime`` with the library
  directory from ``cutlass.cute.export.aot_config``. At run time the ``.so`` needs the DSL's
  ``libcute_dsl_runtime.so`` (about 42 MiB); the record names it with size and sha256.
* ``static_cudart`` (what the backend ships): the ``.o`` plus the DSL's
  ``libcuda_dialect_runtime_static.a`` plus the CUDA toolkit's ``libcudart_static.a`` (the
  toolkit whose nvcc keys the cache, :func:`dsa_aot.toolkit.toolkit_root`): a self-contained
  ``.so`` of about 1 MiB that needs a driver new enough for that CUDA runtime.

:func:`requests_for` maps a :class:`~dsa_aot.specs.models.KernelSpec` onto requests: ``d_qk``,
``heads``, ``layout`` and the tile (``flavour``: the MMA flavour, ``num_stages``: the forward's
KV tiles in flight) become compile-time parameters, or the spec is refused with the reason.
Artifacts are named ``cutedsl_<stage>_<arch>[_d<d_qk>_h<heads>_<layout>][_<flavour>][_kv<n>]
[_isfinite|_infcmp][_static]``, optional parts present only where they differ from the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dsa_aot import settings
from dsa_aot.backends.cutedsl.records import (
    BWD_MAIN_HEADS, BWD_MAIN_IMPLS, DETERMINISTIC_BWD_MAIN_IMPLS, FIXED_POINT_IMPLS, FIXED_POINT_POST, bwd_main_default_impl, DSL_RUNTIME_LIB, FWD_DEFAULT_IMPL, FWD_DEFAULT_KV_STAGES, RECORD_FILE, WORKER_MODULE, _DSL_STATIC_SHIMS,
    Arch, BwdMainImpl, CuteBuildError, CuteExportRecord, CuteKernel, CuteSymbols, FwdImpl, FwdLayout, LinkMode,
    RuntimeLibRecord, ScalarArgRecord, StreamArgRecord, TensorArgRecord, kernel_entry, sha256_file,
    stage_impl)
from dsa_aot.toolkit import toolkit_root

if TYPE_CHECKING:
    from dsa_aot.specs.models import KernelSpec


class BuildRequest(BaseModel):
    """One artifact to build. ``use_isfinite=None`` follows the DSL feature probe.

    ``fwd`` needs ``d_qk``, ``heads`` and ``layout`` (``impl`` defaults to
    :data:`FWD_DEFAULT_IMPL` of the arch, ``kv_stages`` to :data:`FWD_DEFAULT_KV_STAGES` of the
    impl); the other kernels take none of them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    kernel: CuteKernel
    arch: Arch
    use_isfinite: bool | None = None
    link: LinkMode = "dsl_runtime"
    name: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                             description="artifact (and C prefix) name; derived when None")
    d_qk: Literal[512, 576] | None = None
    heads: Literal[16, 32, 64, 128] | None = None
    layout: FwdLayout | None = None
    kv_stages: Literal[1, 2] | None = None
    impl: FwdImpl | BwdMainImpl | Literal["fixed_point"] | None = None
    deterministic: bool = Field(False, description="backward stages: the deterministic variant "
                                "(per-slot dkv rows summed in a fixed order, d_sink partial sums "
                                "folded in order)")

    @model_validator(mode="after")
    def _fwd_params(self) -> "BuildRequest":
        fwd = (self.d_qk, self.heads, self.layout)
        if self.deterministic and self.kernel == "fwd":
            raise ValueError("deterministic applies to the backward stages only")
        if (self.deterministic and self.kernel == "bwd_main"
                and self.impl not in (None, *DETERMINISTIC_BWD_MAIN_IMPLS)):
            raise ValueError(f"impl={self.impl} has no deterministic bwd_main; use one of "
                             f"{DETERMINISTIC_BWD_MAIN_IMPLS} or leave it unset")
        if self.deterministic and self.arch != "sm_90a":
            raise ValueError(f"the deterministic backward is built for sm_90a, not {self.arch}")
        if self.kernel == "fwd":
            if None in fwd:
                raise ValueError("kernel=fwd needs d_qk, heads and layout, got "
                                 f"d_qk={self.d_qk}, heads={self.heads}, layout={self.layout}")
            if self.use_isfinite is not None:
                raise ValueError("use_isfinite applies to bwd_preprocess only")
            if self.impl in ("wgmma_slot_major", "wgmma_ws_slot_major"):
                raise ValueError(f"impl={self.impl} is a bwd_main flavour, not a fwd one")
            if self.impl in ("wgmma", "wgmma_pipe", "wgmma_ws", "wgmma_split") and self.arch != "sm_90a":
                raise ValueError(f"impl={self.impl} needs sm_90a, not {self.arch}; use impl=mma")
            if self.impl in ("wgmma_pipe", "wgmma_ws", "wgmma_split") and self.kv_stages == 1:
                raise ValueError(f"impl={self.impl} needs kv_stages=2")
        elif self.kernel == "bwd_main":
            if None in fwd:
                raise ValueError("kernel=bwd_main needs d_qk, heads and layout, got "
                                 f"d_qk={self.d_qk}, heads={self.heads}, layout={self.layout}")
            if (self.use_isfinite, self.kv_stages) != (None, None):
                raise ValueError("use_isfinite/kv_stages do not apply to kernel=bwd_main")
            if self.impl in FIXED_POINT_IMPLS and not self.deterministic:
                raise ValueError(f"impl={self.impl} is the fixed-point deterministic mode: "
                                 "it needs deterministic=True")
            if self.impl not in (None, *BWD_MAIN_IMPLS):
                raise ValueError(f"kernel=bwd_main has impl {', '.join(BWD_MAIN_IMPLS)}, "
                                 f"not {self.impl}")
            if self.impl not in (None, "mma") and self.arch != "sm_90a":
                raise ValueError(f"impl={self.impl} needs sm_90a, not {self.arch}; use impl=mma")
            if self.impl == "wgmma_ws_persistent" and self.layout != "noncompact":
                # (its deterministic refusal is the check above)
                raise ValueError(f"impl={self.impl} is a fast mode of the noncompact layout, not "
                                 f"layout={self.layout}; use impl=wgmma_ws")
            if self.impl in BWD_MAIN_HEADS and self.heads not in BWD_MAIN_HEADS[self.impl]:
                other = {"wgmma_ws": "wgmma_ws_slot_major",
                         "wgmma_ws_persistent": "wgmma_ws_slot_major",
                         "wgmma_ws_staggered": "wgmma_ws",
                         "wgmma_ws_cols": "wgmma_ws",
                         "wgmma_ws_slot_major": "wgmma_ws"}.get(self.impl, "wgmma")
                raise ValueError(f"impl={self.impl} supports heads {BWD_MAIN_HEADS[self.impl]}, "
                                 f"not heads={self.heads}; use impl={other} (or leave impl unset)")
        elif self.impl == FIXED_POINT_POST:
            if self.kernel != "bwd_postprocess" or not self.deterministic:
                raise ValueError(f"impl={FIXED_POINT_POST} is the fixed-point deterministic "
                                 "postprocess: kernel=bwd_postprocess with deterministic=True")
            if fwd != (None, None, None) or self.kv_stages is not None:
                raise ValueError("d_qk/heads/layout/kv_stages do not apply to kernel=bwd_postprocess")
        elif fwd != (None, None, None) or self.kv_stages is not None or self.impl is not None:
            raise ValueError(f"d_qk/heads/layout/kv_stages/impl apply to kernel=fwd or bwd_main "
                             f"(and impl={FIXED_POINT_POST} to a deterministic bwd_postprocess), "
                             f"not {self.kernel}")
        return self

    @property
    def fwd_params(self) -> dict[str, object] | None:
        """The forward's compile-time parameters with defaults filled in (None for others)."""
        if self.kernel != "fwd":
            return None
        impl = self.impl or FWD_DEFAULT_IMPL[self.arch]
        return {"d_qk": self.d_qk, "heads": self.heads, "layout": self.layout,
                "kv_stages": self.kv_stages or FWD_DEFAULT_KV_STAGES[impl], "impl": impl}

    @property
    def compile_params(self) -> dict[str, object]:
        """Keyword arguments of the stage's compile function (after the arch)."""
        if self.kernel == "fwd":
            params = dict(self.fwd_params or {})
            return params
        det = {"deterministic": True} if self.deterministic else {}
        if self.kernel == "bwd_main":
            return {"d_qk": self.d_qk, "heads": self.heads, "layout": self.layout,
                    "impl": self.impl or bwd_main_default_impl(self.arch, self.heads, self.deterministic),
                    **det}
        if self.kernel == "bwd_preprocess":
            return {"use_isfinite": self.use_isfinite, **det}
        if self.impl is not None:  # the fixed-point postprocess
            return {"impl": self.impl, **det}
        return det


#: MMA flavours a spec's ``tile.flavour`` may name, per stage that has them.
FLAVOURS: dict[str, tuple[str, ...]] = {"fwd": ("mma", "wgmma", "wgmma_pipe", "wgmma_ws", "wgmma_split"),
                                        "bwd_main": BWD_MAIN_IMPLS}


def requests_for(spec: "KernelSpec", stages: tuple[str, ...], *, link: LinkMode = "static_cudart",
                 use_isfinite: bool | None = None) -> list[BuildRequest]:
    """The worker requests that build ``spec``'s ``stages``, every spec field applied.

    ``tile.flavour`` picks the MMA flavour of the forward or of the backward main stage,
    ``tile.num_stages`` the forward's gathered KV tiles in flight; the CuTe DSL kernels have
    fixed block shapes, so ``tile.block_i`` / ``tile.threads`` are refused. Raises ValueError
    naming the field and what is accepted.
    """
    tile = spec.tile
    for field in ("block_i", "threads"):
        if getattr(tile, field) is not None:
            raise ValueError(f"{spec.id}: the cutedsl kernels have fixed block shapes; tile.{field}="
                             f"{getattr(tile, field)} cannot be honoured (leave it unset)")
    main = "fwd" if spec.op == "fwd" else "bwd_main"
    if tile.flavour is not None and tile.flavour not in FLAVOURS[main]:
        raise ValueError(f"{spec.id}: tile.flavour={tile.flavour!r} is not a cutedsl {main} flavour; "
                         f"use one of {FLAVOURS[main]}")
    if tile.num_stages is not None and (main != "fwd" or tile.num_stages not in (1, 2)):
        raise ValueError(f"{spec.id}: tile.num_stages={tile.num_stages} is not supported by the "
                         f"cutedsl {main} stage" + (" (use 1 or 2)" if main == "fwd" else " (leave it unset)"))
    requests = []
    det = {"deterministic": True} if spec.deterministic else {}
    for stage in stages:
        if stage == main:
            extra = {"kv_stages": tile.num_stages} if main == "fwd" else det
            try:
                requests.append(BuildRequest(kernel=stage, arch=spec.arch, link=link, d_qk=spec.d_qk,
                                             heads=spec.heads, layout=spec.layout, impl=tile.flavour,
                                             **extra))
            except ValidationError as exc:  # a flavour / depth the arch or flavour cannot take
                fields = ", ".join(f"tile.{f}={getattr(tile, f)!r}" for f in ("flavour", "num_stages")
                                   if getattr(tile, f) is not None)
                why = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
                raise ValueError(f"{spec.id}: {fields} cannot be honoured by the cutedsl {main} stage "
                                 f"({why})") from None
        elif stage == "bwd_preprocess":
            requests.append(BuildRequest(kernel=stage, arch=spec.arch, link=link, use_isfinite=use_isfinite,
                                         **det))
        else:
            impl = stage_impl(stage, spec.arch, spec.heads, tile.flavour, spec.deterministic)
            requests.append(BuildRequest(kernel=stage, arch=spec.arch, link=link, impl=impl, **det))
    return requests



# --------------------------------------------------------------------------------------------
# Probe
# --------------------------------------------------------------------------------------------

def _worker_env(arch: str) -> dict[str, str]:
    env = dict(os.environ)
    env["CUTE_DSL_ARCH"] = arch
    env["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"  # artifacts are cached by us, keyed by content
    return env


def probe_isfinite(python: str | None = None, timeout: float = 300.0) -> bool:
    """Whether the DSL installed for ``python`` has ``cute.math.isfinite`` (subprocess, no GPU)."""
    code = ("from dsa_aot.kernels.cutedsl_bwd_preprocess import probe_cute_isfinite as p; "
            "print('ISFINITE=%d' % p())")
    proc = subprocess.run([python or sys.executable, "-c", code], capture_output=True, text=True,
                          env=_worker_env("sm_90a"), timeout=timeout, check=False)
    match = re.search(r"^ISFINITE=([01])$", proc.stdout, re.M)
    if proc.returncode != 0 or match is None:
        raise CuteBuildError(f"the isfinite probe failed (exit {proc.returncode}): "
                             f"{proc.stderr.strip()[-2000:]}")
    return match.group(1) == "1"


# --------------------------------------------------------------------------------------------
# Worker (runs with CUTE_DSL_ARCH set; the only code here that imports cutlass)
# --------------------------------------------------------------------------------------------

_RE_INIT = re.compile(r"void (_mlir_\w+_cuda_init)\(void \*\*\);")
_RE_LOAD = re.compile(r"void (_mlir_\w+_cuda_load_to_device)\(void \*\*\);")
_RE_ENTRY = re.compile(r"void (_mlir_\w+__mlir_ciface_\w+)\(void \*\*args, int32_t num_args\);")
_RE_STRUCT = re.compile(r"typedef struct \{\s*void \*data;(?P<body>[^}]*)\}\s*(?P<type>\w+_Tensor_"
                        r"(?P<name>\w+)_t);")
_RE_FIELD = re.compile(r"(int32_t|int64_t) dynamic_(shapes|strides)\[(\d+)\];")
_RE_PACKED = re.compile(r"void \*args\[(\d+)\] = \{(?P<body>[^}]*)\};")


def _check_header(header: str, prefix: str,
                  args: list[TensorArgRecord | StreamArgRecord | ScalarArgRecord]) -> CuteSymbols:
    """Parse the generated header and require the C ABI the runtime loader implements."""
    found = {k: r.search(header) for k, r in (("init", _RE_INIT), ("load_to_device", _RE_LOAD),
                                              ("entry", _RE_ENTRY))}
    missing = [k for k, m in found.items() if m is None]
    if missing:
        raise CuteBuildError(f"{prefix}.h: no declaration for {missing}; has the DSL's export "
                             "format changed?")
    structs = {m["name"]: m for m in _RE_STRUCT.finditer(header)}
    packed = _RE_PACKED.search(header)
    if packed is None:
        raise CuteBuildError(f"{prefix}.h: no packed argument array found")
    expected_packed = [a.name if a.kind == "tensor" else f"&{a.name}" for a in args] + ["&ret"]
    got_packed = [t.strip() for t in packed["body"].split(",") if t.strip()]
    if got_packed != expected_packed:
        raise CuteBuildError(f"{prefix}.h packs {got_packed}, the loader would pass "
                             f"{expected_packed}")
    for arg in args:
        if arg.kind != "tensor":
            continue
        struct = structs.get(arg.name)
        if struct is None:
            raise CuteBuildError(f"{prefix}.h: no descriptor struct for tensor {arg.name}")
        fields = {kind: (ctype, int(n)) for ctype, kind, n in _RE_FIELD.findall(struct["body"])}
        want = {}
        if arg.dynamic_shape_dims:
            want["shapes"] = (f"{arg.shape_ctype}_t", len(arg.dynamic_shape_dims))
        if arg.dynamic_stride_dims:
            want["strides"] = (f"{arg.stride_ctype}_t", len(arg.dynamic_stride_dims))
        if fields != want:
            raise CuteBuildError(f"{prefix}.h: descriptor of {arg.name} is {fields}, "
                                 f"expected {want}")
    return CuteSymbols(**{k: m.group(1) for k, m in found.items()})


def _runtime_lib_record(path: Path) -> RuntimeLibRecord:
    resolved = path.resolve()
    package_path = path.name
    roots = sorted((Path(e).resolve() for e in sys.path if e), key=lambda p: len(p.parts), reverse=True)
    for root in roots:  # relative to the import root holding it (site-packages, a --target dir, ...)
        if resolved.is_relative_to(root) and resolved != root:
            package_path = resolved.relative_to(root).as_posix()
            break
    flavor = re.search(r"nvidia_cutlass_dsl/(cu\d+)/", package_path)
    distribution = f"nvidia-cutlass-dsl-libs-{flavor.group(1)}" if flavor else "nvidia-cutlass-dsl"
    return RuntimeLibRecord(name=path.name, distribution=distribution, package_path=package_path,
                            size=path.stat().st_size, sha256=sha256_file(path))


def cuda_home() -> Path:
    """The CUDA toolkit whose static runtime is linked in: the one whose nvcc keys the cache."""
    root = toolkit_root()
    if root is not None and (root / "lib64" / "libcudart_static.a").is_file():
        return root
    raise CuteBuildError(f"link=static_cudart needs a CUDA toolkit with lib64/libcudart_static.a "
                         f"(found {root or 'no toolkit'}); set CUDA_HOME or DSA_AOT_NVCC, or use "
                         "link=dsl_runtime")


def _cudart_version(cuda_home: Path) -> int | None:
    header = cuda_home / "include" / "cuda_runtime_api.h"
    if header.is_file():
        match = re.search(r"#define CUDART_VERSION\s+(\d+)", header.read_text(errors="replace"))
        if match:
            return int(match.group(1))
    return None


def _link(obj: Path, lib: Path, mode: LinkMode, libdir: Path) -> int | None:
    """Link ``obj`` into ``lib``; returns the static CUDA runtime version for static_cudart."""
    cc = settings.get().cc
    cmd = [cc, "-shared", "-o", str(lib), str(obj), f"-Wl,-soname,{lib.name}",
           "-Wl,--no-undefined"]
    cudart = None
    if mode == "dsl_runtime":
        cmd += [f"-L{libdir}", "-lcute_dsl_runtime", "-Wl,-rpath,$ORIGIN"]
    else:
        home = cuda_home()
        cudart = _cudart_version(home)
        cmd += [str(libdir / _DSL_STATIC_SHIMS), str(home / "lib64" / "libcudart_static.a"),
                "-lpthread", "-ldl", "-lrt"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CuteBuildError(f"linking {lib.name} failed: {' '.join(cmd)}\n{proc.stderr.strip()}")
    return cudart


_RE_SCALAR = re.compile(r"\b(float|double|int32_t|int64_t) (\w+)\b")
_C_SCALAR = {"float32": "float", "int32": "int32_t"}


def _check_scalar_params(header: str, prefix: str, args: list[object]) -> None:
    """Scalars must be declared with the C type the loader packs (the wrapper's parameters)."""
    wrapper = re.search(r"cute_dsl_\w+_wrapper\((?P<params>[^)]*)\)", header)
    if wrapper is None:
        raise CuteBuildError(f"{prefix}.h: no wrapper function found")
    declared = {name: ctype for ctype, name in _RE_SCALAR.findall(wrapper["params"])}
    for arg in args:
        if getattr(arg, "kind", None) == "scalar":
            want = _C_SCALAR[arg.dtype]
            if declared.get(arg.name) != want:
                raise CuteBuildError(f"{prefix}.h declares scalar {arg.name} as "
                                     f"{declared.get(arg.name)!r}, the loader packs {want}")


def _default_name(kernel: str, arch: str, link: str, use_isfinite: bool | None,
                  fwd: dict[str, object] | None = None) -> str:
    name = f"cutedsl_{kernel}_{arch}"
    if kernel == "fwd" and fwd is not None:
        name += f"_d{fwd['d_qk']}_h{fwd['heads']}_{fwd['layout']}"
        if fwd["impl"] != FWD_DEFAULT_IMPL[arch]:
            name += f"_{fwd['impl']}"
        if fwd["kv_stages"] != FWD_DEFAULT_KV_STAGES[str(fwd["impl"])]:
            name += f"_kv{fwd['kv_stages']}"
    if kernel == "bwd_main" and fwd is not None:
        name += f"_d{fwd['d_qk']}_h{fwd['heads']}_{fwd['layout']}"
        if fwd["impl"] != bwd_main_default_impl(arch, int(fwd["heads"]), bool(fwd.get("deterministic"))):
            name += f"_{fwd['impl']}"
    if kernel == "bwd_postprocess" and fwd is not None and fwd.get("impl"):
        name += f"_{fwd['impl']}"
    if kernel == "bwd_preprocess":  # the worker fills in what its probe decides when None
        name += "_{isfinite}" if use_isfinite is None else "_isfinite" if use_isfinite else "_infcmp"
    if (fwd or {}).get("deterministic"):
        name += "_det"
    if link == "static_cudart":
        name += "_static"
    return name


def build_cutedsl(requests: list[BuildRequest], out_dir: str | os.PathLike[str], *,
                  python: str | None = None, timeout: float = 900.0) -> list[CuteExportRecord]:
    """Build, export and link every request; one worker process per arch, run concurrently.

    Each artifact lands in ``out_dir/<name>/`` (``<name>.h``, ``.o``, ``.so``, ``record.json``),
    staged in a sibling folder and renamed into place, so a crash never leaves a torn entry.
    Raises :class:`CuteBuildError` naming the failing step.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    python = python or sys.executable
    scratch = out / f".build-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    scratch.mkdir()
    try:
        plan: dict[str, list[tuple[BuildRequest, dict[str, object]]]] = {}
        for i, req in enumerate(requests):
            stage = scratch / f"job{i}"
            stage.mkdir()
            module, function = kernel_entry(req.kernel, req.compile_params.get("impl"))
            job = {"kernel": req.kernel, "module": module, "function": function,
                   "params": req.compile_params, "link": req.link, "dir": str(stage),
                   "name": req.name or _default_name(req.kernel, req.arch, req.link,
                                                     req.use_isfinite, req.compile_params)}
            plan.setdefault(req.arch, []).append((req, job))
        started = time.perf_counter()
        procs = {arch: _spawn_worker(arch, [j for _, j in items], scratch, python)
                 for arch, items in plan.items()}
        replies = {arch: _collect_worker(arch, proc, scratch, timeout - (time.perf_counter() - started))
                   for arch, proc in procs.items()}
        records = []
        for arch, items in plan.items():
            reply = replies[arch]
            for (req, job), result in zip(items, reply["results"]):
                records.append(_finish(req, job, result, reply, out))
        return records
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _spawn_worker(arch: str, jobs: list[dict[str, object]], scratch: Path,
                  python: str) -> subprocess.Popen[str]:
    request = scratch / f"request-{arch}.json"
    request.write_text(json.dumps({"arch": arch, "jobs": jobs,
                                   "reply": str(scratch / f"reply-{arch}.json")}))
    return subprocess.Popen([python, "-m", WORKER_MODULE, str(request)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_worker_env(arch))


def _collect_worker(arch: str, proc: subprocess.Popen[str], scratch: Path,
                    timeout: float) -> dict[str, object]:
    try:
        _, stderr = proc.communicate(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise CuteBuildError(f"the CuTe DSL worker for {arch} timed out") from None
    reply = scratch / f"reply-{arch}.json"
    if not reply.is_file():
        raise CuteBuildError(f"the CuTe DSL worker for {arch} exited {proc.returncode} without "
                             f"a reply:\n{stderr.strip()[-4000:]}")
    data = json.loads(reply.read_text())
    if "error" in data:
        raise CuteBuildError(f"the CuTe DSL worker for {arch} failed:\n{data['error']}")
    return data


def checked_export(result: dict[str, object], folder: Path) -> tuple[tuple, CuteSymbols, Path]:
    """A worker's exported function in ``folder``: its argument records, the symbols of its
    header (checked against those arguments) and the object file, which must define the entry."""
    name = str(result["name"])
    kinds = {"stream": StreamArgRecord, "tensor": TensorArgRecord, "scalar": ScalarArgRecord}
    args = tuple(kinds[a["kind"]](**a) for a in result["args"])
    header = (folder / f"{name}.h").read_text()
    symbols = _check_header(header, name, args)
    _check_scalar_params(header, name, args)
    obj = folder / f"{name}.o"
    if symbols.entry.encode() not in obj.read_bytes():
        raise CuteBuildError(f"{obj.name} does not define {symbols.entry}")
    return args, symbols, obj


def _finish(req: BuildRequest, job: dict[str, object], result: dict[str, object],
            reply: dict[str, object], out: Path) -> CuteExportRecord:
    name = str(result["name"])
    stage = Path(str(job["dir"]))
    start = time.perf_counter()
    arg_models, symbols, obj = checked_export(result, stage)
    libdir = Path(str(reply["libdir"]))
    lib = stage / f"{name}.so"
    cudart = _link(obj, lib, req.link, libdir)
    runtime_libs: tuple[RuntimeLibRecord, ...] = ()
    if req.link == "dsl_runtime":
        if not reply.get("runtime_lib"):
            raise CuteBuildError(f"the DSL reports no {DSL_RUNTIME_LIB} (aot_config)")
        runtime_libs = (_runtime_lib_record(Path(str(reply["runtime_lib"]))),)
    record = CuteExportRecord(
        name=name, kernel=req.kernel, arch=req.arch, prefix=name, library=lib.name,
        object_file=obj.name, header=f"{name}.h", symbols=symbols, args=tuple(arg_models),
        link=req.link, runtime_libs=runtime_libs, cudart_version=cudart,
        use_isfinite=result["use_isfinite"], d_qk=req.d_qk, heads=req.heads, layout=req.layout,
        kv_stages=req.fwd_params["kv_stages"] if req.kernel == "fwd" else None,
        impl=(req.fwd_params["impl"] if req.kernel == "fwd"
              else req.compile_params["impl"] if req.kernel == "bwd_main" else None),
        deterministic=req.deterministic,
        dsl_version=str(reply["dsl_version"]),
        library_sha256=sha256_file(lib),
        build_seconds=round(float(result["compile_seconds"]) + float(result["export_seconds"])
                            + time.perf_counter() - start, 3))
    (stage / RECORD_FILE).write_text(record.model_dump_json(indent=2))
    final = out / name
    if final.exists():
        trash = out / f".old-{name}-{uuid.uuid4().hex[:8]}"
        final.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    stage.rename(final)
    return record


def read_record(artifact_dir: str | os.PathLike[str]) -> CuteExportRecord:
    """The record of an artifact folder written by :func:`build_cutedsl`."""
    return CuteExportRecord.model_validate_json((Path(artifact_dir) / RECORD_FILE).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsa_aot.backends.cutedsl.build",
                                     description="Build CuTe DSL kernels ahead of time (a development tool; "
                                     "`dsa-aot prebuild` builds the catalog).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build", help="build, export and link kernels")
    build.add_argument("out_dir")
    build.add_argument("--arch", action="append", choices=["sm_90a", "sm_100a"])
    build.add_argument("--kernel", action="append", choices=["bwd_preprocess", "bwd_postprocess",
                                                             "fwd", "bwd_main"])
    build.add_argument("--d-qk", type=int, action="append", choices=[512, 576],
                       help="fwd, bwd_main: head dims to build (default both)")
    build.add_argument("--heads", type=int, action="append", choices=[16, 32, 64, 128],
                       help="fwd, bwd_main: head counts to build (default all)")
    build.add_argument("--layout", action="append", choices=["compact", "noncompact"],
                       help="fwd, bwd_main: layouts to build (default both)")
    build.add_argument("--impl", choices=["mma", "wgmma", "wgmma_pipe", "wgmma_ws", "wgmma_split"],
                       help="fwd: MMA flavour (default: wgmma_ws on sm_90a, mma on sm_100a)")
    build.add_argument("--kv-stages", type=int, choices=[1, 2],
                       help="fwd: gathered KV tiles in flight (default: 1 for mma, else 2)")
    build.add_argument("--link", default="dsl_runtime", choices=["dsl_runtime", "static_cudart"])
    build.add_argument("--use-isfinite", choices=["auto", "yes", "no"], default="auto")
    args = parser.parse_args(argv)
    flag = {"auto": None, "yes": True, "no": False}[args.use_isfinite]
    try:
        reqs = _cli_requests(args, flag)
    except ValueError as exc:  # pydantic's ValidationError is one
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        for rec in build_cutedsl(reqs, args.out_dir):
            print(f"{rec.name}: {rec.library} ({rec.build_seconds:.2f} s)")
    except CuteBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _cli_requests(args: argparse.Namespace, flag: bool | None) -> list[BuildRequest]:
    reqs = []
    for a in args.arch or ["sm_90a", "sm_100a"]:
        for k in args.kernel or ["bwd_preprocess", "bwd_postprocess"]:
            if k == "bwd_main":
                reqs += [BuildRequest(kernel=k, arch=a, link=args.link, d_qk=d, heads=h,
                                      layout=lay)
                         for d in args.d_qk or [512, 576] for h in args.heads or [16, 32, 64, 128]
                         for lay in args.layout or ["compact", "noncompact"]]
                continue
            if k != "fwd":
                reqs.append(BuildRequest(kernel=k, arch=a, link=args.link, use_isfinite=flag))
                continue
            reqs += [BuildRequest(kernel="fwd", arch=a, link=args.link, d_qk=d, heads=h,
                                  layout=lay, impl=args.impl, kv_stages=args.kv_stages)
                     for d in args.d_qk or [512, 576] for h in args.heads or [16, 32, 64, 128]
                     for lay in args.layout or ["compact", "noncompact"]]
    return reqs


if __name__ == "__main__":
    sys.exit(main())
