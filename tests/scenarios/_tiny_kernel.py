"""A small real TileLang kernel standing in for the sparse MLA stages in the scenario tests.

It compiles through the real build path (``TileLangBackend.build`` -> ``build_stage`` ->
``compile_stage`` -> nvcc) in about a second, so many concurrent builds stay affordable on two
cores. Its output depends on the spec, so different variants give different cubins. The
builder also records its arrival and can be told to wait for other processes or to die, to
stage races and crashes from the outside.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from dsa_aot.specs.models import KernelSpec


def record(event: str, *fields: object) -> None:
    """Append one line to ``$REL_EVENTS`` (O_APPEND: atomic for short lines)."""
    path = os.environ.get("REL_EVENTS")
    if path:
        line = " ".join([event, *map(str, fields), str(os.getpid()), f"{time.time():.6f}"]) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def wait_for_files(directory: str, count: int, timeout_s: float) -> None:
    """Block until ``directory`` holds ``count`` entries (a cross-process barrier)."""
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(directory)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {directory}: {len(os.listdir(directory))} of {count} arrived "
                               f"in {timeout_s:.0f} s")
        time.sleep(0.02)


def build_fwd(spec: KernelSpec) -> tuple[Any, dict[str, Any]]:
    """``(prim_func, pass_configs)`` of a small elementwise kernel named like the fwd stage."""
    barrier = os.environ.get("REL_BUILD_BARRIER")
    if barrier:  # every builder must be inside build() at once, or this times out
        Path(barrier, f"{spec.id}.{os.getpid()}").touch()
        wait_for_files(barrier, int(os.environ["REL_BUILD_BARRIER_N"]),
                       float(os.environ.get("REL_BARRIER_TIMEOUT", "60")))
    waiters = os.environ.get("REL_WAIT_FOR_MISSES")
    if waiters:  # hold the key lock until every contender has missed and is queued on it
        wait_for_files(waiters, int(os.environ["REL_WAIT_FOR_MISSES_N"]),
                       float(os.environ.get("REL_BARRIER_TIMEOUT", "60")))
    if os.environ.get("REL_KILL_IN_BUILD") == "1":
        os.kill(os.getpid(), signal.SIGKILL)

    import tilelang.language as T

    heads, bias = spec.heads, float(spec.d_qk + (1 if spec.layout == "compact" else 0))
    s_q = T.dynamic("s_q")

    @T.prim_func
    def sparse_mla_fwd(q: T.Tensor((s_q, heads), "float32"), out: T.Tensor((s_q, heads), "float32"),
                       softmax_scale: T.float32):
        with T.Kernel(s_q, threads=128) as bx:
            for i in T.Parallel(heads):
                out[bx, i] = q[bx, i] * softmax_scale + bias

    return sparse_mla_fwd, {}
