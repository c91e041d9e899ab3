"""What the kernels support: head dimensions, head counts and GPU archs (plain constants).

Kept apart from :mod:`dsa_aot.specs.models` so the API's input checks and device check need
no pydantic: ``import dsa_aot`` stays cheap, the models load on the first kernel lookup.
"""

from __future__ import annotations

#: Value head dimension: V = kv[:, :D_V] for every variant (DeepSeek MLA).
D_V = 512
SUPPORTED_D_QK = (512, 576)
SUPPORTED_HEADS = (16, 32, 64, 128)
#: The arch kernels are built for, per GPU compute capability.
ARCH_OF_CAPABILITY: dict[tuple[int, int], str] = {(9, 0): "sm_90a", (10, 0): "sm_100a"}


def arch_of_capability(major: int, minor: int) -> str | None:
    """The arch of a GPU of compute capability ``major.minor`` (None: no kernels for it)."""
    return ARCH_OF_CAPABILITY.get((major, minor))
