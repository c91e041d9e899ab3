"""Launch prebuilt cubins through the CUDA driver API, with no compiler in the process.

A :class:`~.records.LaunchRecord` (written at build time, JSON) says everything a launch needs: the
entry symbol, the parameter list in order, the grid as expressions of the run-time sizes,
the block shape and the dynamic shared memory. :class:`CubinKernel` loads the cubin with
``cuLibraryLoadData`` (context-independent, CUDA >= 12.0) and launches it with
``cuLaunchKernel`` on the caller's stream. Only ``ctypes`` and ``libcuda`` are involved.
"""

from __future__ import annotations

import ast
import ctypes
import threading
from typing import TYPE_CHECKING, Literal

from dsa_aot.backends.base import CudaError

if TYPE_CHECKING:
    from dsa_aot.backends.tilelang.records import LaunchRecord

ParamKind = Literal["ptr", "i32", "i64", "f32"]
_CTYPE = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float}
_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Name, ast.Load, ast.Constant,
                  ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.RShift, ast.LShift,
                  ast.USub, ast.Call)
_ALLOWED_CALLS = {"min": min, "max": max}


def _check_expr(expr: str) -> ast.Expression:
    tree = ast.parse(expr, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise ValueError(f"grid expression {expr!r}: {type(node).__name__} is not allowed")
        if isinstance(node, ast.Call) and not (
                isinstance(node.func, ast.Name) and node.func.id in _ALLOWED_CALLS):
            raise ValueError(f"grid expression {expr!r}: only min()/max() calls are allowed")
    return tree


class _ArgsLookup(ast.NodeTransformer):
    """Rewrite each size name ``n`` of a grid expression into ``a["n"]``."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _ALLOWED_CALLS:
            return node
        return ast.copy_location(ast.Subscript(value=ast.Name("a", ast.Load()), slice=ast.Constant(node.id),
                                               ctx=ast.Load()), node)


def _grid_function(grid: tuple[str, str, str]):
    """One compiled ``f(args) -> (gx, gy, gz)`` from the record's AST-checked expressions."""
    dims = [_ArgsLookup().visit(_check_expr(g)).body for g in grid]
    lam = ast.Expression(ast.Lambda(
        args=ast.arguments(posonlyargs=[], args=[ast.arg("a")], kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=ast.Tuple([ast.Call(ast.Name("int", ast.Load()), [d], []) for d in dims], ast.Load())))
    ast.fix_missing_locations(lam)
    return eval(compile(lam, "<grid>", "eval"), {"__builtins__": {}, "int": int, **_ALLOWED_CALLS})  # noqa: S307


_LIB: ctypes.CDLL | None = None
_LIB_LOCK = threading.Lock()


def _libcuda() -> ctypes.CDLL:
    global _LIB
    with _LIB_LOCK:
        if _LIB is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise CudaError(f"cannot load libcuda.so.1 ({exc}); is an NVIDIA driver installed?") from exc
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            lib.cuLibraryLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p,
                                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint,
                                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
            lib.cuLibraryGetKernel.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
            lib.cuKernelSetAttribute.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
            lib.cuLibraryUnload.argtypes = [ctypes.c_void_p]
            lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [
                ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            _check(lib, lib.cuInit(0), "cuInit")
            _LIB = lib
        return _LIB


def _check(lib: ctypes.CDLL, status: int, what: str) -> None:
    if status != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(status, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else "unknown error"
        raise CudaError(f"{what} failed with CUDA error {status}: {text}")


_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CubinKernel:
    """One loaded ``__global__`` function. Thread-safe; launches are asynchronous."""

    def __init__(self, record: LaunchRecord, cubin: bytes, device_index: int) -> None:
        lib = _libcuda()
        self.record = record
        self._lib = lib
        self._library = ctypes.c_void_p()
        self._image = ctypes.create_string_buffer(bytes(cubin), len(cubin))
        _check(lib, lib.cuLibraryLoadData(ctypes.byref(self._library), self._image, None, None, 0,
                                          None, None, 0), f"cuLibraryLoadData({record.entry})")
        self._kernel = ctypes.c_void_p()
        _check(lib, lib.cuLibraryGetKernel(ctypes.byref(self._kernel), self._library,
                                           record.entry.encode()), f"cuLibraryGetKernel({record.entry})")
        if record.dynamic_smem > 48 * 1024:
            _check(lib, lib.cuKernelSetAttribute(_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                 record.dynamic_smem, self._kernel, device_index),
                   f"cuKernelSetAttribute({record.entry}, dynamic smem {record.dynamic_smem})")
        self._holders = [_CTYPE[p.kind]() for p in record.params]
        self._argv = (ctypes.c_void_p * len(self._holders))(
            *[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in self._holders])
        self._bind = tuple(zip(self._holders, [p.name for p in record.params]))
        self._grid = _grid_function(record.grid)
        self._lock = threading.Lock()

    def grid(self, args: dict[str, object]) -> tuple[int, int, int]:
        """Grid dims for run-time sizes ``args`` (e.g. ``{"s_q": 4096, ...}``)."""
        return self._grid(args)

    def launch(self, stream: int, args: dict[str, object]) -> None:
        """Launch with ``args`` mapping every parameter name to an int (pointer or size) or float."""
        gx, gy, gz = self.grid(args)
        if gx <= 0 or gy <= 0 or gz <= 0:
            return  # an empty problem: nothing to launch
        bx, by, bz = self.record.block
        with self._lock:
            for holder, name in self._bind:
                holder.value = args[name]
            status = self._lib.cuLaunchKernel(self._kernel, gx, gy, gz, bx, by, bz,
                                              self.record.dynamic_smem, stream, self._argv, None)
        if status != 0:
            _check(self._lib, status, f"cuLaunchKernel({self.record.entry}, grid={gx, gy, gz})")
