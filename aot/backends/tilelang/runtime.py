"""Load side of the TileLang backend: stored cubins + launch records -> op kernels (ctypes only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dsa_aot.backends.base import BuildError
from dsa_aot.backends.tilelang.launch import CubinKernel, LaunchRecord
from dsa_aot.runners import CubinBwd, CubinFwd

if TYPE_CHECKING:
    from dsa_aot.artifact import ArtifactManifest


def load(manifest: ArtifactManifest, read: Callable[[str], bytes], device_index: int) -> Any:
    """A :class:`CubinFwd` / :class:`CubinBwd` over the manifest's cubins on ``device_index``."""
    blobs = {}
    for st in manifest.stages:  # every file verified and every record parsed before the driver
        if st.format != "cubin":
            raise BuildError(f"{manifest.spec.id}: stage {st.name} is {st.format}, not a cubin")
        blobs[st.name] = (LaunchRecord.model_validate(st.record), read(st.file))
    kernels = {name: CubinKernel(record, cubin, device_index) for name, (record, cubin) in blobs.items()}
    if manifest.spec.op == "fwd":
        return CubinFwd(kernels["fwd"], manifest.spec)
    return CubinBwd(kernels["bwd_preprocess"], kernels["bwd_main"], kernels["bwd_postprocess"], manifest.spec)
