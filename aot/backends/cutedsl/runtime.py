"""Run CuTe DSL kernels exported ahead of time, without importing ``cutlass``.

An artifact folder written by :func:`dsa_aot.backends.cutedsl.build.build_cutedsl` holds ``<name>.so``
(the DSL's host launcher with the cubin embedded, linked by us) and ``record.json``. Loading is
``ctypes`` only: the DSL runtime library the record names (``libcute_dsl_runtime.so`` for the
``dsl_runtime`` link mode, none for ``static_cudart``) is opened ``RTLD_GLOBAL`` first, then the
artifact. Nothing touches CUDA until the first call, which loads the embedded cubin
(``init``) and prepares the caller's device (``load_to_device``); each call then builds the
tensor descriptors the exported C ABI expects and launches on the given (or torch's current)
stream.

The DSL runtime library is looked up, in order, at the path in ``DSA_AOT_CUTE_DSL_RUNTIME``
(a file or a folder), in the artifact folder, then at its recorded place under each
``sys.path`` entry (an installed ``nvidia-cutlass-dsl-libs-*`` wheel; nothing is imported).
Its size and sha256 must match the record: the artifact's object code was generated against
that exact runtime.
"""

from __future__ import annotations

import ctypes
import hashlib
import numbers
import operator
import os
import struct
import sys
import threading
import tempfile
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsa_aot import settings
from dsa_aot.backends.base import CudaError
from dsa_aot.backends.cutedsl.names import RECORD_FILE, sha256_file

if TYPE_CHECKING:
    import torch

    from dsa_aot.artifact import ArtifactManifest
    from dsa_aot.backends.cutedsl.records import (CuteExportRecord, RuntimeLibRecord, ScalarArgRecord,
                                                  StreamArgRecord, TensorArgRecord)
    from dsa_aot.specs.models import KernelSpec
    from dsa_aot.specs.shapes import SpecFields

#: A file, or a folder holding it, to use as the DSL runtime library.
RUNTIME_ENV = "DSA_AOT_CUTE_DSL_RUNTIME"

_CUDA_ERRORS = {1: "cudaErrorInvalidValue", 2: "cudaErrorMemoryAllocation",
                3: "cudaErrorInitializationError", 35: "cudaErrorInsufficientDriver",
                98: "cudaErrorInvalidDeviceFunction", 100: "cudaErrorNoDevice",
                101: "cudaErrorInvalidDevice", 209: "cudaErrorNoKernelImageForDevice",
                218: "cudaErrorInvalidPtx", 222: "cudaErrorUnsupportedPtxVersion",
                400: "cudaErrorInvalidResourceHandle", 500: "cudaErrorSymbolNotFound",
                700: "cudaErrorIllegalAddress", 9: "cudaErrorInvalidConfiguration"}
_CTYPES = {"int32": ctypes.c_int32, "int64": ctypes.c_int64}
#: ctypes and ``struct`` codes of the scalar argument kinds a record may hold.
_SCALAR_CTYPES = {"float32": (ctypes.c_float, "f"), "int32": (ctypes.c_int32, "i")}
#: The Python type a scalar of each kind is passed as.
_SCALAR_PY = {"float32": float, "int32": int}
_LIMITS = {"int32": 2**31 - 1, "int64": 2**63 - 1}


class CuteRuntimeError(CudaError):
    """Loading or launching an exported CuTe DSL kernel failed; the message says why."""


def _cuda_error(code: int) -> str:
    return f"CUDA error {code} ({_CUDA_ERRORS.get(code, 'see cudaError_t')})"


# --------------------------------------------------------------------------------------------
# Runtime library
# --------------------------------------------------------------------------------------------

_RUNTIME_LOCK = threading.Lock()
_RUNTIME_LIBS: dict[str, tuple[Path, ctypes.CDLL]] = {}


def _candidates(rec: RuntimeLibRecord, artifact_dir: Path, explicit: Path | None) -> list[Path]:
    found: list[Path] = []
    for base in (explicit, settings.get().cute_dsl_runtime):
        if base is not None:
            found.append(base / rec.name if base.is_dir() else base)
    found.append(artifact_dir / rec.name)
    found += [Path(entry) / rec.package_path for entry in sys.path if entry]
    return found


def find_runtime_library(rec: RuntimeLibRecord, artifact_dir: Path,
                         explicit: Path | None = None, verify: bool = True) -> Path:
    """The first candidate file with the recorded size (and sha256 when ``verify``)."""
    rejected = []
    for path in _candidates(rec, artifact_dir, explicit):
        if not path.is_file():
            continue
        size = path.stat().st_size
        if size != rec.size:
            rejected.append(f"{path} ({size} bytes, expected {rec.size})")
            continue
        if verify and sha256_file(path) != rec.sha256:
            rejected.append(f"{path} (sha256 differs)")
            continue
        return path
    detail = f"; rejected: {', '.join(rejected)}" if rejected else ""
    raise CuteRuntimeError(
        f"{rec.name} from {rec.distribution} ({rec.size} bytes) was not found{detail}. Install "
        f"the matching {rec.distribution}, copy the file into {artifact_dir}, or set "
        f"{RUNTIME_ENV} to its path")


def _open_runtime(rec: RuntimeLibRecord, artifact_dir: Path, explicit: Path | None,
                  verify: bool) -> Path:
    with _RUNTIME_LOCK:
        if rec.sha256 in _RUNTIME_LIBS:
            return _RUNTIME_LIBS[rec.sha256][0]
        path = find_runtime_library(rec, artifact_dir, explicit, verify)
        try:
            handle = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise CuteRuntimeError(f"cannot load {path}: {exc}") from exc
        _RUNTIME_LIBS[rec.sha256] = (path, handle)
        return path


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------

def dynamic_dims(dims: Sequence[Any]) -> tuple[int, ...]:
    """Positions of the run-time entries (``value`` None) of a record's shape or stride."""
    return tuple(i for i, d in enumerate(dims) if d.value is None)


def descriptor_type(arg: TensorArgRecord) -> type[ctypes.Structure]:
    """The C struct of a tensor argument: ``{void *data; shapes[n]; strides[m]}``."""
    fields: list[tuple[str, Any]] = [("data", ctypes.c_void_p)]
    shapes, strides = dynamic_dims(arg.shape), dynamic_dims(arg.stride)
    if shapes:
        fields.append(("shapes", _CTYPES[arg.shape_ctype] * len(shapes)))
    if strides:
        fields.append(("strides", _CTYPES[arg.stride_ctype] * len(strides)))
    return type(f"Descriptor_{arg.name}", (ctypes.Structure,), {"_fields_": fields})


class CallFrame:
    """Byte layout of one call's arguments, packed with one ``struct.pack_into``.

    The frame is a C struct of every argument's value (tensor descriptors, scalars by value,
    ``cudaStream_t``) plus the ``int32`` result, laid out by ``ctypes``; the ``void *args[]``
    array the entry takes follows it, pointing at each value and at the result.
    """

    #: Idle buffers kept for reuse per frame (more only while that many calls run at once).
    POOL = 16

    def __init__(self, args: tuple[TensorArgRecord | StreamArgRecord | ScalarArgRecord, ...]
                 ) -> None:
        def ctype_of(a: TensorArgRecord | StreamArgRecord | ScalarArgRecord) -> Any:
            if a.kind == "tensor":
                return descriptor_type(a)
            if a.kind == "scalar":
                return _SCALAR_CTYPES[a.dtype][0]
            return ctypes.c_void_p

        fields: list[tuple[str, Any]] = [
            (f"a{i}", ctype_of(a)) for i, a in enumerate(args)] + [("ret", ctypes.c_int32)]
        frame = type("Frame", (ctypes.Structure,), {"_fields_": fields})
        self.frame_type = frame
        self.offsets = [getattr(frame, name).offset for name, _ in fields]
        scalars: list[tuple[int, str]] = []
        for (_, ctype), offset in zip(fields, self.offsets):
            if ctype is ctypes.c_void_p:
                scalars.append((offset, "Q"))
            elif ctype is ctypes.c_int32:
                scalars.append((offset, "i"))
            elif ctype is ctypes.c_float:
                scalars.append((offset, "f"))
            else:
                for fname, ftype in ctype._fields_:
                    base = offset + getattr(ctype, fname).offset
                    if fname == "data":
                        scalars.append((base, "Q"))
                        continue
                    code = "i" if ftype._type_ is ctypes.c_int32 else "q"
                    step = ctypes.sizeof(ftype._type_)
                    scalars += [(base + k * step, code) for k in range(ftype._length_)]
        fmt, pos = "=", 0
        for offset, code in scalars:
            fmt += f"{offset - pos}x{code}" if offset > pos else code
            pos = offset + struct.calcsize("=" + code)
        self.format = fmt
        self.argv_offset = (ctypes.sizeof(frame) + 7) // 8 * 8
        self.argv_format = f"={len(self.offsets)}Q"
        self.ret_offset = self.offsets[-1]
        self.size = self.argv_offset + 8 * len(self.offsets)
        self._values = struct.Struct(fmt)
        self._argv = struct.Struct(self.argv_format)
        self._count = ctypes.c_int32(len(self.offsets))
        self._free: list[tuple[ctypes.Array[ctypes.c_char], ctypes.c_void_p, ctypes.c_int32]] = []

    def _buffer(self) -> tuple[ctypes.Array[ctypes.c_char], int]:
        """A zeroed buffer with its argv array filled in, and the argv's address."""
        buf = ctypes.create_string_buffer(self.size)
        base = ctypes.addressof(buf)
        self._argv.pack_into(buf, self.argv_offset, *[base + off for off in self.offsets])
        return buf, base + self.argv_offset

    def pack(self, values: list[int]) -> tuple[ctypes.Array[ctypes.c_char], int]:
        """A buffer holding ``values`` (then the result, 0) and the argv array; its argv address."""
        buf, argv = self._buffer()
        self._values.pack_into(buf, 0, *values, 0)
        return buf, argv

    def result(self, buf: ctypes.Array[ctypes.c_char]) -> int:
        return struct.unpack_from("=i", buf, self.ret_offset)[0]

    def call(self, entry: Any, values: tuple[Any, ...]) -> int:
        """Run ``entry(argv, n)`` on ``values`` (the result's 0 last) and return the result.

        The buffer comes from a pool (its argv array is written once): the entry reads it
        during the call only, and a concurrent or nested call takes another buffer.
        """
        try:
            slot = self._free.pop()
        except IndexError:
            buf, argv = self._buffer()
            slot = (buf, ctypes.c_void_p(argv), ctypes.c_int32.from_buffer(buf, self.ret_offset))
        buf, argv, ret = slot
        self._values.pack_into(buf, 0, *values)
        entry(argv, self._count)
        result = ret.value
        if len(self._free) < self.POOL:
            self._free.append(slot)
        return result


class _TensorPlan:
    """What a tensor argument must look like, precomputed for a cheap per-call check."""

    def __init__(self, arg: TensorArgRecord) -> None:
        self.name = arg.name
        self.dtype_name = arg.dtype
        self.dtype: Any = None  # the torch dtype, resolved on the first call
        self.rank = len(arg.shape)
        self.static_shape = [(i, d.value) for i, d in enumerate(arg.shape) if d.value is not None]
        self.static_stride = [(i, d.value) for i, d in enumerate(arg.stride)
                              if d.value is not None]
        self.div_shape = [(i, d.divisibility) for i, d in enumerate(arg.shape)
                          if d.value is None and d.divisibility > 1]
        self.div_stride = [(i, d.divisibility) for i, d in enumerate(arg.stride)
                           if d.value is None and d.divisibility > 1]
        self.symbols = [(i, d.symbol) for i, d in enumerate(arg.shape) if d.symbol is not None]
        self.dyn_shape = dynamic_dims(arg.shape)
        self.dyn_stride = dynamic_dims(arg.stride)
        self.shape_limit = _LIMITS[arg.shape_ctype]
        self.align = arg.align


class _InitArgs(ctypes.Structure):
    _fields_ = [("library", ctypes.c_void_p), ("err", ctypes.c_void_p)]


class _LoadArgs(ctypes.Structure):
    _fields_ = [("library", ctypes.c_void_p), ("device", ctypes.c_void_p), ("err", ctypes.c_void_p)]


class CuteDslKernel:
    """One exported kernel, loaded. Calls are thread-safe and asynchronous on the stream.

    Construct through :func:`load_kernel` (one instance per library file per process: the
    library's loaded-cubin state is process-global).

    Each validated layout is remembered: a call whose tensors have the dtypes, shapes, strides
    and devices of an earlier good call skips the per-dimension checks and reads only the data
    pointers (their alignment is checked on every call). At most :attr:`LAYOUTS` layouts are
    kept, the oldest dropped first.
    """

    #: Validated layouts kept per kernel.
    LAYOUTS = 64

    def __init__(self, artifact_dir: Path, record: CuteExportRecord, *,
                 runtime_lib: Path | None = None, verify_runtime: bool = True,
                 library: str | None = None) -> None:
        self.record = record
        self.directory = artifact_dir
        self.runtime_paths = [_open_runtime(r, artifact_dir, runtime_lib, verify_runtime)
                              for r in record.runtime_libs]
        lib_path = artifact_dir / (library or record.library)
        try:
            self._lib = ctypes.CDLL(str(lib_path))
        except OSError as exc:
            raise CuteRuntimeError(f"cannot load {lib_path}: {exc}") from exc
        try:
            self._init = getattr(self._lib, record.symbols.init)
            self._load = getattr(self._lib, record.symbols.load_to_device)
            self._entry = getattr(self._lib, record.symbols.entry)
        except AttributeError as exc:
            raise CuteRuntimeError(f"{lib_path} lacks an exported symbol: {exc}") from exc
        for fn in (self._init, self._load):
            fn.argtypes, fn.restype = [ctypes.c_void_p], None
        # called with a c_void_p and a c_int32 (CallFrame.call): no per-call conversion
        self._entry.argtypes, self._entry.restype = None, None
        self._plans = [_TensorPlan(a) for a in record.args if a.kind == "tensor"]
        self._names = [p.name for p in self._plans]
        self._scalar_names = [a.name for a in record.args if a.kind == "scalar"]
        self._scalar_set = frozenset(self._scalar_names)
        self._scalar_types = [_SCALAR_PY[a.dtype] for a in record.args if a.kind == "scalar"]
        # the frame's values come from [*pointers, stream, *scalars, *layout values, 0]
        n_tensors, n_scalars = len(self._plans), len(self._scalar_names)
        order: list[int] = []
        layout_index = n_tensors + 1 + n_scalars
        for a in record.args:
            if a.kind == "tensor":
                order.append(self._names.index(a.name))
                dims = len(dynamic_dims(a.shape)) + len(dynamic_dims(a.stride))
                order += range(layout_index, layout_index + dims)
                layout_index += dims
            elif a.kind == "scalar":
                order.append(n_tensors + 1 + self._scalar_names.index(a.name))
            else:
                order.append(n_tensors)
        order.append(layout_index)  # the result slot
        self._order = _picker(order)
        self._aligns = [p.align for p in self._plans]
        self._layouts: dict[tuple[Any, ...], tuple[int, tuple[int, ...]]] = {}
        self._layouts_lock = threading.Lock()
        self.frame = CallFrame(record.args)
        self._library = ctypes.c_void_p()  # cudaLibrary_t, written by init
        self._library_ptr = ctypes.c_void_p(ctypes.addressof(self._library))
        self._initialized = False
        self._devices: set[int] = set()
        self._lock = threading.Lock()

    @property
    def tensor_names(self) -> list[str]:
        return list(self._names)

    @property
    def scalar_names(self) -> list[str]:
        """Run-time scalar arguments (e.g. ``softmax_scale``), passed by keyword."""
        return list(self._scalar_names)

    def prepare(self, device_index: int) -> None:
        """Load the embedded cubin (once) and prepare ``device_index`` (once per device)."""
        if device_index in self._devices:
            return
        with self._lock:
            if not self._initialized:
                err = ctypes.c_int32(0)
                args = _InitArgs(ctypes.addressof(self._library_ptr), ctypes.addressof(err))
                self._init(ctypes.byref(args))
                if err.value:
                    raise CuteRuntimeError(f"{self.record.name}: loading the cubin failed with "
                                           f"{_cuda_error(err.value)}")
                self._initialized = True
            if device_index not in self._devices:
                err = ctypes.c_int32(0)
                device = ctypes.c_int32(device_index)
                args = _LoadArgs(ctypes.addressof(self._library_ptr), ctypes.addressof(device),
                                 ctypes.addressof(err))
                self._load(ctypes.byref(args))
                if err.value:
                    raise CuteRuntimeError(f"{self.record.name}: preparing device {device_index} "
                                           f"failed with {_cuda_error(err.value)}")
                self._devices.add(device_index)

    def __call__(self, *args: torch.Tensor, stream: int | None = None,
                 **kwargs: Any) -> None:
        """Launch with tensors in record order (positional) or by name, and every run-time
        scalar by name (``softmax_scale=...``); ``stream`` is a ``cudaStream_t`` as an int
        (default: torch's current stream on the tensors' device)."""
        scalars = None
        if kwargs.keys() == self._scalar_set:  # the usual call: every scalar of its exact type
            scalars = [kwargs[n] for n in self._scalar_names]
            for value, kind in zip(scalars, self._scalar_types):
                if type(value) is not kind or (kind is int and not -2**31 <= value < 2**31):
                    scalars = None
                    break
        if scalars is None:
            values = self.scalar_values({k: kwargs.pop(k) for k in list(kwargs)
                                         if k in self._scalar_set})
            scalars = [values[n] for n in self._scalar_names]
            tensors = self._bind(args, kwargs)
        else:
            tensors = args if len(args) == len(self._names) else self._bind(args, {})
        device, layout = self._layout(tensors)
        pointers = self._pointers(tensors)
        if device not in self._devices:
            self.prepare(device)
        if stream is None:
            import torch

            stream = torch.cuda.current_stream(device).cuda_stream
        ret = self.frame.call(self._entry, self._order([*pointers, stream, *scalars, *layout]))
        if ret:
            raise CuteRuntimeError(f"{self.record.name}: launch failed with {_cuda_error(ret)}")

    def scalar_values(self, given: dict[str, Any]) -> dict[str, float | int]:
        """Check that every scalar argument is given exactly once and is a real number (an
        integer in the int32 range for an ``int32`` scalar)."""
        missing = [n for n in self._scalar_names if n not in given]
        if missing:
            raise TypeError(f"{self.record.name}: missing scalar arguments {missing} "
                            "(pass them by keyword)")
        kinds = dict(zip(self._scalar_names, self._scalar_types))
        values: dict[str, float | int] = {}
        for name, value in given.items():
            if kinds[name] is int:
                if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                    raise TypeError(f"{self.record.name}: scalar {name} must be an integer, "
                                    f"got {type(value).__name__}")
                if not -2**31 <= value < 2**31:
                    raise ValueError(f"{self.record.name}: scalar {name}={value} does not fit "
                                     "an int32")
                values[name] = int(value)
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{self.record.name}: scalar {name} must be a real number, "
                                f"got {type(value).__name__}")
            values[name] = float(value)
        return values

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        names = self._names
        if not kwargs and len(args) == len(names):
            return list(args)
        if len(args) > len(names):
            raise TypeError(f"{self.record.name} takes {len(names)} tensors ({names}), "
                            f"got {len(args)} positional")
        bound = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names or key in bound:
                raise TypeError(f"{self.record.name}: unexpected or repeated argument {key!r}")
            bound[key] = value
        missing = [n for n in names if n not in bound]
        if missing:
            raise TypeError(f"{self.record.name}: missing tensors {missing}")
        return [bound[n] for n in names]

    def marshal(self, tensors: Sequence[Any]) -> tuple[int, list[int]]:
        """Validate the tensors (record order) against the record and flatten them.

        Returns their common CUDA device and the frame's tensor scalars (per tensor: pointer,
        run-time sizes, run-time strides). Layout is checked before placement, so a wrong
        layout is reported without a GPU too.
        """
        device, layout = self._layout(tensors)
        pointers = self._pointers(tensors)
        scalars: list[int] = []
        start = 0
        for plan, ptr in zip(self._plans, pointers):
            end = start + len(plan.dyn_shape) + len(plan.dyn_stride)
            scalars.append(ptr)
            scalars += layout[start:end]
            start = end
        return device, scalars

    def _layout(self, tensors: Sequence[Any]) -> tuple[int, tuple[int, ...]]:
        """The tensors' device and run-time sizes and strides (frame order, then the result's
        0): remembered per (dtype, shape, stride, device) of every tensor, else checked in full
        by :meth:`_validate`. ``device`` rather than ``get_device()``: a non-CUDA tensor of the
        same index never matches."""
        key = tuple([(t.dtype, t.shape, t.stride(), t.device) for t in tensors])
        try:
            hit = self._layouts.get(key)
        except TypeError:  # not hashable (not a torch tensor): check every call
            return self._validate(tensors)
        if hit is not None:
            return hit
        hit = self._validate(tensors)
        with self._layouts_lock:
            while len(self._layouts) >= self.LAYOUTS:
                del self._layouts[next(iter(self._layouts))]
            self._layouts[key] = hit
        return hit

    def _pointers(self, tensors: Sequence[Any]) -> list[int]:
        """The data pointers, each checked against its argument's alignment."""
        pointers = [t.data_ptr() for t in tensors]
        if any(map(operator.mod, pointers, self._aligns)):
            for plan, ptr in zip(self._plans, pointers):
                if ptr % plan.align:
                    raise ValueError(f"{self.record.name}: {plan.name}: data pointer must be "
                                     f"{plan.align}-byte aligned")
        return pointers

    def _validate(self, tensors: Sequence[Any]) -> tuple[int, tuple[int, ...]]:
        """Check every tensor's dtype, shape, strides, device and pointer alignment against the
        record; returns what :meth:`_layout` does."""
        name = self.record.name
        sizes: dict[str, tuple[int, str]] = {}
        layouts = []
        for plan, t in zip(self._plans, tensors):
            if plan.dtype is None:
                import torch

                plan.dtype = getattr(torch, plan.dtype_name)
            if t.dtype is not plan.dtype:
                raise ValueError(f"{name}: {plan.name} must be {plan.dtype_name}, got {t.dtype}")
            shape, stride = t.shape, t.stride()
            if len(shape) != plan.rank:
                raise ValueError(f"{name}: {plan.name} must have {plan.rank} dims, got "
                                 f"{tuple(shape)}")
            for i, v in plan.static_shape:
                if shape[i] != v:
                    raise ValueError(f"{name}: {plan.name}: size[{i}] must be {v}, got {shape[i]}")
            for i, v in plan.static_stride:
                if stride[i] != v and shape[i] > 1:
                    raise ValueError(f"{name}: {plan.name}: stride[{i}] must be {v}, got "
                                     f"{stride[i]}")
            for i, div in plan.div_shape:
                if shape[i] % div:
                    raise ValueError(f"{name}: {plan.name}: size[{i}]={shape[i]} must be a "
                                     f"multiple of {div}")
            for i, div in plan.div_stride:
                if stride[i] % div:
                    raise ValueError(f"{name}: {plan.name}: stride[{i}]={stride[i]} must be a "
                                     f"multiple of {div}")
            for i, symbol in plan.symbols:
                seen = sizes.setdefault(symbol, (shape[i], plan.name))
                if seen[0] != shape[i]:
                    raise ValueError(f"{name}: {plan.name}: size[{i}]={shape[i]} but {seen[1]} "
                                     f"has {symbol}={seen[0]}")
            for d in plan.dyn_shape:
                if shape[d] > plan.shape_limit:
                    raise ValueError(f"{name}: {plan.name}: size[{d}]={shape[d]} does not fit "
                                     "the kernel's 32-bit sizes")
            layouts.append((shape, stride))
        device = -1
        values: list[int] = []
        for plan, t, (shape, stride) in zip(self._plans, tensors, layouts):
            if not t.is_cuda:
                raise ValueError(f"{name}: {plan.name} must be a CUDA tensor, got {t.device}")
            index = t.get_device()
            if device not in (-1, index):
                raise ValueError(f"{name}: tensors are on devices {device} and {index}")
            device = index
            if t.data_ptr() % plan.align:
                raise ValueError(f"{name}: {plan.name}: data pointer must be {plan.align}-byte "
                                 "aligned")
            values += [shape[d] for d in plan.dyn_shape]
            values += [stride[d] for d in plan.dyn_stride]
        values.append(0)
        return device, tuple(values)


def _picker(order: list[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``items -> tuple(items[i] for i in order)`` in one C call."""
    if len(order) == 1:
        return lambda items: (items[order[0]],)
    return operator.itemgetter(*order)


_KERNELS: dict[str, CuteDslKernel] = {}
_KERNELS_LOCK = threading.Lock()


def load_kernel(artifact_dir: str | os.PathLike[str], *, runtime_lib: str | os.PathLike[str] |
                None = None, verify_runtime: bool = True) -> CuteDslKernel:
    """Open an artifact folder (``record.json`` + library); cached per library path.

    Only ``ctypes``: no ``cutlass``, no ``torch`` and no CUDA call happens here.
    """
    directory = Path(artifact_dir).resolve()
    key = str(directory)
    with _KERNELS_LOCK:
        kernel = _KERNELS.get(key)
        if kernel is None:
            from dsa_aot.backends.cutedsl.records import CuteExportRecord

            try:
                record = CuteExportRecord.model_validate_json((directory / RECORD_FILE).read_text())
            except (OSError, ValueError) as exc:
                raise CuteRuntimeError(f"{directory}: unreadable {RECORD_FILE}: {exc}") from exc
            kernel = CuteDslKernel(directory, record,
                                   runtime_lib=Path(runtime_lib) if runtime_lib else None,
                                   verify_runtime=verify_runtime)
            _KERNELS[key] = kernel
        return kernel


# --- opening a verified library, once per process ----------------------------------------

_CUTE_LIBS: dict[str, CuteDslKernel] = {}
_CUTE_FDS: dict[str, int] = {}  # memfds stay open: their /proc/self/fd name must never be reused
_CUTE_LOCK = threading.Lock()
_SEALS = ("F_SEAL_SEAL", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE")


def open_cute_library(record: CuteExportRecord, data: bytes, sha256: str | None = None) -> CuteDslKernel:
    """A CuTe DSL kernel ``dlopen``-ed from exactly ``data`` (already sha256-checked by the store).

    The bytes go into a sealed anonymous file (``memfd_create``; no path another process can
    write, no write after sealing, nothing left on disk, unaffected by a ``noexec`` /tmp) and
    ``/proc/self/fd/<n>`` is opened. Without memfd or /proc, a private temporary folder (mode
    0700) holds the file until it is opened. One instance per distinct library per process:
    identical pre/post-processing libraries of many specs load once. Raises
    :class:`~dsa_aot.cache.layout.CorruptArtifact` when ``data`` is not the recorded library.
    ``sha256``: the digest of ``data``, when the caller already checked it (not hashed again).
    """
    from dsa_aot.cache.layout import CorruptArtifact

    digest = sha256 or hashlib.sha256(data).hexdigest()
    if digest != record.library_sha256:
        raise CorruptArtifact(f"{record.name}: library sha256 {digest[:12]} differs from its record "
                              f"({record.library_sha256[:12]})")
    with _CUTE_LOCK:
        kernel = _CUTE_LIBS.get(digest)
        if kernel is None:
            kernel = _open_memfd(record, data, digest)
            if kernel is None:
                kernel = _open_tempfile(record, data)
            _CUTE_LIBS[digest] = kernel
        return kernel


def _open_memfd(record: CuteExportRecord, data: bytes, digest: str) -> CuteDslKernel | None:
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return None
    create = getattr(os, "memfd_create", None)
    if create is None or not all(hasattr(fcntl, s) for s in ("F_ADD_SEALS", *_SEALS)):
        return None
    try:
        fd = create(f"dsa-aot-{record.name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        seals = 0
        for name in _SEALS:
            seals |= getattr(fcntl, name)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        folder = Path("/proc/self/fd")
        if not (folder / str(fd)).exists():
            os.close(fd)
            return None
        kernel = CuteDslKernel(folder, record, library=str(fd))
    except BaseException:
        os.close(fd)
        raise
    _CUTE_FDS[digest] = fd
    return kernel


def _open_tempfile(record: CuteExportRecord, data: bytes) -> CuteDslKernel:
    folder = Path(tempfile.mkdtemp(prefix="dsa-aot-so-"))  # mode 0700, a unique name per load
    try:
        (folder / record.library).write_bytes(data)
        return CuteDslKernel(folder, record)  # dlopen maps it; the file can go right after
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --- the backend's load entry point ---------------------------------------------------------

def load(manifest: ArtifactManifest, read: Callable[[str], bytes], device_index: int) -> Any:
    """The loader's entry point: every stage record validated as a :class:`CuteExportRecord`,
    then :func:`load_sealed`."""
    from dsa_aot.backends.cutedsl.records import CuteExportRecord

    for st in manifest.stages:
        if st.format == "cutedsl_so":
            CuteExportRecord.model_validate(st.record)
    return load_sealed(manifest.spec, manifest.stages, read, device_index)


def load_sealed(spec: KernelSpec | SpecFields, stages: Sequence[Any], read: Callable[[str], bytes],
                device_index: int, digests: Mapping[str, str] | None = None) -> Any:
    """Open every stage's library from its verified bytes (ctypes only), then prepare them on
    ``device_index``: a CUDA problem surfaces here, as a :class:`CuteRuntimeError` (a miss).

    ``stages`` hold records as written by the build (validated there or by :func:`load`, and
    sealed by the entry's payload digest); they are read as attribute views, without pydantic.
    ``digests``: the sha256 ``read`` checked each file against (not computed again).
    """
    from dsa_aot.backends.base import BuildError, record_view
    from dsa_aot.runners import CuteFwd, StagedBwd

    kernels: dict[str, CuteDslKernel] = {}
    for st in stages:
        if st.format != "cutedsl_so":
            raise BuildError(f"{spec.id}: stage {st.name} is {st.format}, not a CuTe DSL library")
        record = record_view(st.record)
        if record.kernel != st.name:
            raise BuildError(f"{spec.id}: stage {st.name} holds a record of {record.kernel}")
        kernels[st.name] = open_cute_library(record, read(st.file), (digests or {}).get(st.file))
    for kernel in kernels.values():
        kernel.prepare(device_index)
    if spec.op == "fwd":
        return CuteFwd(kernels["fwd"], spec)
    return StagedBwd(kernels["bwd_preprocess"], kernels["bwd_main"], kernels["bwd_postprocess"], spec)
