"""Pydantic models for kernel variants: what is compiled, and under which name."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from dsa_aot.specs.shapes import (ARCH_OF_CAPABILITY, D_V, SUPPORTED_D_QK,  # noqa: F401  (re-exported)
                                  SUPPORTED_HEADS, Arch, Layout, Op, arch_of_capability, spec_id)
#: A backend name: a subpackage of ``dsa_aot.backends`` (checked when a spec is made).
Backend = Annotated[str, AfterValidator(lambda name: _known_backend(name))]


def _known_backend(name: str) -> str:
    from dsa_aot.backends import names

    known = names()
    if name not in known:
        raise ValueError(f"backend {name!r} is not installed; use one of {', '.join(known)}")
    return name


class TileConfig(BaseModel):
    """Tuning knobs of one kernel; ``None`` means "the kernel's default for this arch"."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_i: int | None = Field(None, gt=0, le=256, description="top-k slots per main-loop step")
    num_stages: int | None = Field(None, ge=0, le=4, description="software-pipeline depth")
    threads: int | None = Field(None, ge=128, le=512, multiple_of=128, description="threads per CTA")
    flavour: str | None = Field(None, pattern=r"^[a-z][a-z0-9_]{0,31}$",
                                description="the backend's MMA flavour of the main stage, e.g. cutedsl "
                                "'wgmma_ws' (forward) or 'wgmma_ws_slot_major' (backward main)")


class KernelSpec(BaseModel):
    """One compiled variant: an op for one (arch, D_qk, heads, layout, backend).

    The sequence lengths are run-time values of every variant, so one artifact serves any batch;
    so is the top-k width unless ``topk`` names the width a kernel is specialised on (a bucket:
    narrower calls are padded to it). ``softmax_scale`` and ``attn_sink`` are run-time arguments.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: Op
    arch: Arch
    d_qk: int = Field(description="query/key head dim; V uses the first d_v columns of kv")
    d_v: int = D_V
    heads: int = Field(description="query heads sharing the single latent KV head")
    layout: Layout = Field(description="compact: topk_length gives each row's valid prefix; "
                           "noncompact: out-of-range indices (-1) mark padding anywhere")
    dtype: Literal["bfloat16"] = "bfloat16"
    backend: Backend = "tilelang"
    tile: TileConfig = TileConfig()
    topk: int | None = Field(None, gt=0, le=1 << 16,
                             description="the top-k width a backend's kernel is specialised on (its "
                             "bucket: calls pad to it); None for kernels taking any width at run time")
    deterministic: bool = Field(False, description="bwd: every gradient bit-identical across calls "
                                "and processes for the same inputs (no order-dependent atomics)")

    @model_validator(mode="after")
    def _check_supported(self) -> KernelSpec:
        if self.d_qk not in SUPPORTED_D_QK:
            raise ValueError(f"d_qk={self.d_qk} is not supported; use one of {SUPPORTED_D_QK}")
        if self.d_v != D_V:
            raise ValueError(f"d_v={self.d_v} is not supported; MLA kernels use d_v={D_V}")
        if self.heads not in SUPPORTED_HEADS:
            raise ValueError(f"heads={self.heads} is not supported; use one of {SUPPORTED_HEADS}")
        if self.deterministic and self.op != "bwd":
            raise ValueError("deterministic=True applies to op='bwd' only (the forward has no "
                             "order-dependent sums)")
        return self

    @property
    def id(self) -> str:
        """Stable readable id, e.g. ``bwd-sm_90a-d576-h64-compact-tilelang``.

        A top-k bucket appends ``-k<topk>``, the deterministic variant ``-det``, a non-default
        tile config a short hash of it, so tuned variants never collide.
        """
        base = spec_id(self.op, self.arch, self.d_qk, self.heads, self.layout, self.backend, self.topk,
                       self.deterministic)
        tile = self.tile.model_dump(exclude_none=True)
        if not tile:
            return base
        digest = hashlib.sha256(json.dumps(tile, sort_keys=True).encode()).hexdigest()[:8]
        return f"{base}-t{digest}"

    def canonical_json(self) -> str:
        """Canonical JSON of every field: the spec's part of a cache key."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_id(cls, spec_id: str) -> KernelSpec:
        """Parse a default-tile id such as ``fwd-sm_90a-d576-h64-noncompact-tilelang`` (or
        ``bwd-sm_90a-d576-h64-noncompact-cudnn-k2048`` with a top-k bucket, ``...-det`` for the
        deterministic variant)."""
        parts = spec_id.split("-")
        deterministic = len(parts) > 6 and parts[-1] == "det"
        if deterministic:
            parts.pop()
        topk = None
        if len(parts) == 7 and parts[6][:1] == "k" and parts[6][1:].isdigit():
            topk = int(parts.pop()[1:])
        if len(parts) != 6 or not parts[2].startswith("d") or not parts[3].startswith("h"):
            raise ValueError(f"{spec_id!r} is not a spec id; expected "
                             "<op>-<arch>-d<d_qk>-h<heads>-<layout>-<backend>[-k<topk>][-det]")
        op, arch, d, h, layout, backend = parts
        return cls(op=op, arch=arch, d_qk=int(d[1:]), heads=int(h[1:]), layout=layout, backend=backend,
                   topk=topk, deterministic=deterministic)
