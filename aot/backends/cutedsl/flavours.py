"""The CuTe DSL backend's kernel flavours: which kernel module and compile function build each
stage, and the MMA flavour a stage gets when a spec names none (plain data, no pydantic; the
serving path reads it to find a spec's kernel sources)."""

from __future__ import annotations

from typing import Literal, get_args

Arch = Literal["sm_90a", "sm_100a"]
CuteKernel = Literal["bwd_preprocess", "bwd_postprocess", "fwd", "bwd_main"]
FwdLayout = Literal["compact", "noncompact"]
FwdImpl = Literal["mma", "wgmma", "wgmma_pipe", "wgmma_ws", "wgmma_split"]
#: The backward main stage's MMA flavours: mma.sync (any arch), wgmma (sm_90a), the
#: slot-major wgmma kernel for few heads (sm_90a, heads in :data:`BWD_SLOT_MAJOR_HEADS`) and the
#: wgmma kernel with a score and a dKV warpgroup (sm_90a, heads in :data:`BWD_WS_HEADS`), and the
#: slot-major kernel with the same two roles (sm_90a, heads in :data:`BWD_SLOT_MAJOR_HEADS`).
#: ``wgmma_ws_fixed`` / ``wgmma_ws_slot_major_fixed``: those two kernels in the fixed-point
#: deterministic mode (int32 adds, ``dsa_aot.fixed_point``; deterministic specs only).
#: ``wgmma_ws_persistent``: the ``wgmma_ws`` fast mode taking several query rows a CTA, the next
#: row's loads under the last block's dKV adds (noncompact layout). ``wgmma_ws_staggered``: the
#: ``wgmma_ws`` order at H128 with a row's second head block starting mid-row (both modes).
#: ``wgmma_ws_cols``: H128 fast mode, a row's two CTAs as a cluster splitting the columns (each
#: dKV value added once; the score partials exchanged over distributed shared memory).
#: ``wgmma_ws_dq_lines``: the fast mode's default of each head count (``wgmma_ws_slot_major`` at
#: H16/H32, ``wgmma_ws`` at H64, staggered at H128) with dQ stored through shared memory in
#: whole 128-byte lines.
BwdMainImpl = Literal["mma", "wgmma", "wgmma_slot_major", "wgmma_ws", "wgmma_ws_slot_major",
                      "wgmma_ws_fixed", "wgmma_ws_slot_major_fixed", "wgmma_ws_persistent",
                      "wgmma_ws_staggered", "wgmma_ws_cols", "wgmma_ws_dq_lines"]
#: Every backward main flavour, in the order of :data:`BwdMainImpl`.
BWD_MAIN_IMPLS: tuple[str, ...] = get_args(BwdMainImpl)
#: Head counts of ``impl=wgmma_slot_major`` (``dsa_aot.kernels.cutedsl_bwd_slot_major.HEADS``).
BWD_SLOT_MAJOR_HEADS: tuple[int, ...] = (16, 32)
#: Head counts of ``impl=wgmma_ws`` (``dsa_aot.kernels.cutedsl_bwd_ws.HEADS``).
BWD_WS_HEADS: tuple[int, ...] = (64, 128)
#: Flavours of the backward main stage that take only some head counts.
BWD_MAIN_HEADS: dict[str, tuple[int, ...]] = {"wgmma_slot_major": BWD_SLOT_MAJOR_HEADS,
                                              "wgmma_ws": BWD_WS_HEADS,
                                              "wgmma_ws_slot_major": BWD_SLOT_MAJOR_HEADS,
                                              "wgmma_ws_fixed": BWD_WS_HEADS,
                                              "wgmma_ws_slot_major_fixed": BWD_SLOT_MAJOR_HEADS,
                                              "wgmma_ws_persistent": BWD_WS_HEADS,
                                              "wgmma_ws_staggered": (128,),
                                              "wgmma_ws_cols": (128,)}
#: The postprocess flavour of the fixed-point main flavours: their guess, check and fold steps.
FIXED_POINT_POST = "fixed_point"
#: Kernel module and compile function of each stage (``f(arch, **params)`` returns ``(compiled,
#: fake_arguments)``); :data:`FLAVOUR_KERNELS` overrides it for a flavour with a module of its own.
#: A spec's key and runtime identity cover exactly the module its build imports (and what that
#: imports), so every forward flavour is built by its own module: ``compile_fwd`` builds any of
#: them, and a key rooted there would cover them all.
KERNELS: dict[str, tuple[str, str]] = {
    "fwd": ("dsa_aot.kernels.cutedsl_fwd", "compile_fwd"),
    "bwd_preprocess": ("dsa_aot.kernels.cutedsl_bwd_preprocess", "compile_bwd_preprocess"),
    "bwd_main": ("dsa_aot.kernels.cutedsl_bwd_main", "compile_bwd_main"),
    "bwd_postprocess": ("dsa_aot.kernels.cutedsl_bwd_postprocess", "compile_bwd_postprocess"),
}
FLAVOUR_KERNELS: dict[tuple[str, str], tuple[str, str]] = {
    ("fwd", "mma"): ("dsa_aot.kernels.cutedsl_fwd_mma", "compile_fwd_mma"),
    ("fwd", "wgmma"): ("dsa_aot.kernels.cutedsl_fwd_wgmma", "compile_fwd_wgmma"),
    ("fwd", "wgmma_pipe"): ("dsa_aot.kernels.cutedsl_fwd_wgmma", "compile_fwd_wgmma"),
    ("fwd", "wgmma_ws"): ("dsa_aot.kernels.cutedsl_fwd_ws", "compile_fwd_ws"),
    ("fwd", "wgmma_split"): ("dsa_aot.kernels.cutedsl_fwd_split", "compile_fwd_split"),
    ("bwd_main", "wgmma_slot_major"): ("dsa_aot.kernels.cutedsl_bwd_slot_major",
                                       "compile_bwd_slot_major"),
    ("bwd_main", "wgmma_ws"): ("dsa_aot.kernels.cutedsl_bwd_ws", "compile_bwd_ws"),
    ("bwd_main", "wgmma_ws_slot_major"): ("dsa_aot.kernels.cutedsl_bwd_ws_slot_major",
                                          "compile_bwd_ws_slot_major"),
    ("bwd_main", "wgmma_ws_fixed"): ("dsa_aot.kernels.cutedsl_bwd_ws", "compile_bwd_ws"),
    ("bwd_main", "wgmma_ws_persistent"): ("dsa_aot.kernels.cutedsl_bwd_ws", "compile_bwd_ws"),
    ("bwd_main", "wgmma_ws_staggered"): ("dsa_aot.kernels.cutedsl_bwd_ws", "compile_bwd_ws"),
    ("bwd_main", "wgmma_ws_dq_lines"): ("dsa_aot.kernels.cutedsl_bwd_ws_slot_major",
                                        "compile_bwd_dq_lines"),
    ("bwd_main", "wgmma_ws_cols"): ("dsa_aot.kernels.cutedsl_bwd_ws_cols", "compile_bwd_ws_cols"),
    ("bwd_main", "wgmma_ws_slot_major_fixed"): ("dsa_aot.kernels.cutedsl_bwd_ws_slot_major",
                                                "compile_bwd_ws_slot_major"),
    ("bwd_postprocess", FIXED_POINT_POST): ("dsa_aot.kernels.cutedsl_bwd_fixed_point_post",
                                            "compile_bwd_fixed_point_post"),
}
#: The forward's MMA flavour per arch when a request names none (wgmma needs sm_90a).
FWD_DEFAULT_IMPL: dict[str, str] = {"sm_90a": "wgmma_split", "sm_100a": "mma"}
#: The backward main stage's MMA flavour per arch when a request names none: wgmma on sm_90a
#: (faster than mma on every benchmark row on the H200, bench/results/h200.md).
BWD_MAIN_DEFAULT_IMPL: dict[str, str] = {"sm_90a": "wgmma", "sm_100a": "mma"}
#: ... except at these (arch, heads): the slot-major kernel with a score and a dKV warpgroup at
#: H16/H32 (its MMAs multiply no padded heads and its atomics run beside the next block's score
#: GEMMs: 1.05 -> 1.15x the cuDNN frontend at H32 D576) and the head-major kernel with the same
#: two roles at H64/H128 (0.83 -> 0.99x at H64 D576; bench/results/h200_bwd_versions.md), at
#: H128 with the row's second head block starting mid-row (paired against the frontend on an
#: H100, three runs: 0.988-0.999 against 0.972-0.984 at D576; bench/results/h100_bwd_staggered.md).
BWD_MAIN_DEFAULT_IMPL_BY_HEADS: dict[tuple[str, int], str] = {
    ("sm_90a", 16): "wgmma_ws_slot_major", ("sm_90a", 32): "wgmma_ws_slot_major",
    ("sm_90a", 64): "wgmma_ws", ("sm_90a", 128): "wgmma_ws_staggered"}
#: ... and in the deterministic mode, where no atomics are left to hide: the slot-major kernel
#: at H16/H32, whose two warpgroups share every phase (main kernel 4.59 vs 5.29 ms at H32 D576,
#: bench/results/h200_bwd_versions.md).
BWD_MAIN_DETERMINISTIC_DEFAULT_IMPL_BY_HEADS: dict[tuple[str, int], str] = {
    ("sm_90a", 16): "wgmma_slot_major", ("sm_90a", 32): "wgmma_slot_major"}
#: The fixed-point deterministic flavour per head count (``DSA_AOT_DETERMINISTIC_MODE=fixed_point``).
FIXED_POINT_IMPL_BY_HEADS: dict[int, str] = {16: "wgmma_ws_slot_major_fixed",
                                             32: "wgmma_ws_slot_major_fixed",
                                             64: "wgmma_ws_fixed", 128: "wgmma_ws_fixed"}
#: Flavours that are a deterministic mode only.
FIXED_POINT_IMPLS: tuple[str, ...] = ("wgmma_ws_fixed", "wgmma_ws_slot_major_fixed")


#: The backward main flavours with a deterministic mode, sm_90a only: stored per-slot dkv rows
#: (all but the ``_fixed`` ones) or fixed-point adds (the ``_fixed`` ones; ``wgmma_ws_fixed``
#: walks H128's head blocks in the staggered order, as the fast mode's default there).
DETERMINISTIC_BWD_MAIN_IMPLS: tuple[str, ...] = ("wgmma_ws", "wgmma_slot_major",
                                                 "wgmma_ws_slot_major", "wgmma_ws_staggered",
                                                 *FIXED_POINT_IMPLS)


def bwd_main_default_impl(arch: str, heads: int | None, deterministic: bool = False) -> str:
    """The backward main stage's flavour when a request names none: per arch and heads, and
    for the deterministic mode the flavour measured fastest without atomics."""
    key = (arch, heads or 0)
    if deterministic and key in BWD_MAIN_DETERMINISTIC_DEFAULT_IMPL_BY_HEADS:
        return BWD_MAIN_DETERMINISTIC_DEFAULT_IMPL_BY_HEADS[key]
    return BWD_MAIN_DEFAULT_IMPL_BY_HEADS.get(key, BWD_MAIN_DEFAULT_IMPL[arch])


def kernel_entry(stage: str, impl: str | None) -> tuple[str, str]:
    """Module and compile function that build ``stage`` with MMA flavour ``impl``."""
    return FLAVOUR_KERNELS.get((stage, impl or ""), KERNELS[stage])


def stage_impl(stage: str, arch: str, heads: int, flavour: str | None,
               deterministic: bool = False) -> str | None:
    """The MMA flavour a stage is built with: the spec's ``tile.flavour`` or the default for
    its arch and heads (None for stages without flavours); the deterministic postprocess of a
    fixed-point main flavour is :data:`FIXED_POINT_POST`."""
    if stage == "fwd":
        return flavour or FWD_DEFAULT_IMPL[arch]
    if stage == "bwd_main":
        return flavour or bwd_main_default_impl(arch, heads, deterministic)
    if stage == "bwd_postprocess" and deterministic and (
            flavour or bwd_main_default_impl(arch, heads, deterministic)) in FIXED_POINT_IMPLS:
        return FIXED_POINT_POST
    return None


#: Gathered KV tiles in flight per flavour when a request names none (measured on the H200:
#: mma 241 vs 208 TFLOPS with one vs two, wgmma 376 vs 353 with two vs one).
FWD_DEFAULT_KV_STAGES: dict[str, int] = {"mma": 1, "wgmma": 2, "wgmma_pipe": 2,
                                         "wgmma_ws": 2, "wgmma_split": 2}
