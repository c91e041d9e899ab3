"""CuTe DSL backward postprocess of sparse MLA: ``dkv_acc`` [s_kv, D] fp32 -> ``dkv`` bf16.

Round-to-nearest-even conversion, 8 columns per thread (two 16-byte loads, one 16-byte store).
``s_kv`` and ``D`` are run-time sizes (``D`` a multiple of 64, e.g. 512 or 576); columns are
contiguous, row strides are run-time multiples of 8 elements with 16-byte aligned bases.

This module imports ``cutlass``: use it in a build process only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

#: Columns converted by one thread.
VEC = 8
THREADS = 128


class SparseMlaBwdPostprocess:
    """fp32 accumulator -> bf16 gradient, elementwise."""

    @cute.jit
    def __call__(self, dkv_acc: cute.Tensor, dkv: cute.Tensor, stream: cuda.CUstream) -> None:
        s_kv = cute.size(dkv_acc, mode=[0])
        col_vecs = cute.size(dkv_acc, mode=[1]) // VEC
        items = s_kv * col_vecs
        if items > 0:
            self.kernel(dkv_acc, dkv, items, col_vecs).launch(
                grid=[(items + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1],
                stream=stream)

    @cute.kernel
    def kernel(self, dkv_acc: cute.Tensor, dkv: cute.Tensor, items: Int32,
               col_vecs: Int32) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        item = bidx * THREADS + tidx
        if item < items:
            row = item // col_vecs
            col = item - row * col_vecs
            src = cute.local_tile(dkv_acc[row, None], (VEC,), (col,))
            dst = cute.local_tile(dkv[row, None], (VEC,), (col,))
            dst.store(src.load().to(BFloat16))


def fake_arguments() -> dict[str, object]:
    """Dynamic-shape stand-ins for every argument, in call order (``s_kv``, ``D`` run-time)."""
    s_kv = cute.sym_int32(symbol="s_kv")
    d = cute.sym_int32(divisibility=64, symbol="d")

    def matrix(dtype: type) -> object:
        return cute.runtime.make_fake_tensor(dtype, (s_kv, d), (cute.sym_int64(divisibility=VEC), 1),
                                             assumed_align=16)

    return {"dkv_acc": matrix(Float32), "dkv": matrix(BFloat16), "stream": cuda.CUstream(0)}


def compile_bwd_postprocess(arch: str, extra_options: str = "") -> tuple[object, dict[str, object]]:
    """``cute.compile`` the kernel for ``arch`` (``CUTE_DSL_ARCH=<arch>`` set before import)."""
    fakes = fake_arguments()
    compiled = cute.compile(SparseMlaBwdPostprocess(), *fakes.values(),
                            options=f"--gpu-arch {arch} {extra_options}".strip())
    return compiled, fakes
