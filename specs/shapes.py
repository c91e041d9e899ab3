"""What the kernels support: head dimensions, head counts and GPU archs (plain constants).

Kept apart from :mod:`dsa_aot.specs.models` so the API's input checks and device check need
no pydantic: ``import dsa_aot`` stays cheap, the models load on the first kernel lookup.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

Op = Literal["fwd", "bwd"]
Arch = Literal["sm_90a", "sm_100a"]
Layout = Literal["compact", "noncompact"]

#: Value head dimension: V = kv[:, :D_V] for every variant (DeepSeek MLA).
D_V = 512
SUPPORTED_D_QK = (512, 576)
SUPPORTED_HEADS = (16, 32, 64, 128)
#: The arch kernels are built for, per GPU compute capability.
ARCH_OF_CAPABILITY: dict[tuple[int, int], str] = {(9, 0): "sm_90a", (10, 0): "sm_100a"}


def arch_of_capability(major: int, minor: int) -> str | None:
    """The arch of a GPU of compute capability ``major.minor`` (None: no kernels for it)."""
    return ARCH_OF_CAPABILITY.get((major, minor))


def spec_id(op: str, arch: str, d_qk: int, heads: int, layout: str, backend: str,
            topk: int | None = None, deterministic: bool = False) -> str:
    """The id of a default-tile spec, e.g. ``bwd-sm_90a-d576-h64-compact-tilelang``; a top-k
    bucket appends ``-k<topk>``, the deterministic variant ``-det`` (see ``KernelSpec.id``)."""
    base = f"{op}-{arch}-d{d_qk}-h{heads}-{layout}-{backend}"
    if topk is not None:
        base += f"-k{topk}"
    return base + "-det" if deterministic else base


class DefaultTile(NamedTuple):
    """The default tile config as plain data (every knob None: the kernel's default)."""

    block_i: None = None
    num_stages: None = None
    threads: None = None
    flavour: None = None


class SpecFields(NamedTuple):
    """A default-tile spec as plain data: what the serving path (no pydantic) knows of the
    ``KernelSpec`` it serves; a loaded kernel's ``spec`` is one of the two."""

    op: str
    arch: str
    d_qk: int
    heads: int
    layout: str
    backend: str
    topk: int | None = None
    deterministic: bool = False
    d_v: int = D_V
    dtype: str = "bfloat16"
    tile: DefaultTile = DefaultTile()

    @property
    def id(self) -> str:
        return spec_id(self.op, self.arch, self.d_qk, self.heads, self.layout, self.backend, self.topk,
                       self.deterministic)
