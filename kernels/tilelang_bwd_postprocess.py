"""Sparse MLA backward, final stage (TileLang): the fp32 dkv accumulator to bf16.

``spec.tile`` tunes the main stage only and is ignored here; only ``d_qk`` matters.
"""

from typing import Any

from dsa_aot.specs.models import KernelSpec

#: KV rows per CTA.
_BLOCK_N = 64
_THREADS = 128


def build_bwd_postprocess(spec: KernelSpec) -> tuple[Any, dict[str, Any]]:
    """Return the postprocess ``PrimFunc`` (``dkv = bf16(dkv_acc)``) and its pass configs."""
    import tilelang.language as T

    d_qk = spec.d_qk
    block_n = _BLOCK_N
    threads = _THREADS
    s_kv = T.dynamic("s_kv")

    @T.prim_func
    def sparse_mla_bwd_postprocess(
        dkv_acc: T.Tensor([s_kv, d_qk], T.float32),
        dkv: T.Tensor([s_kv, d_qk], T.bfloat16),
    ):
        with T.Kernel(T.ceildiv(s_kv, block_n), threads=threads) as bx:
            for i, d in T.Parallel(block_n, d_qk):
                if bx * block_n + i < s_kv:
                    dkv[bx * block_n + i, d] = T.cast(dkv_acc[bx * block_n + i, d], T.bfloat16)

    return sparse_mla_bwd_postprocess, {}
