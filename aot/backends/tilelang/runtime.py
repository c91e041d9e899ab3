"""Load side of the TileLang backend: stored cubins + launch records -> op kernels (ctypes only)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dsa_aot.backends.base import BuildError, record_view
from dsa_aot.backends.tilelang.launch import CubinKernel
from dsa_aot.runners import CubinBwd, CubinFwd

if TYPE_CHECKING:
    from dsa_aot.artifact import ArtifactManifest
    from dsa_aot.specs.models import KernelSpec
    from dsa_aot.specs.shapes import SpecFields


def load(manifest: ArtifactManifest, read: Callable[[str], bytes], device_index: int) -> Any:
    """The loader's entry point: every stage record validated as a
    :class:`~.records.LaunchRecord`, then :func:`load_sealed`."""
    from dsa_aot.backends.tilelang.records import LaunchRecord

    for st in manifest.stages:
        if st.format == "cubin":
            LaunchRecord.model_validate(st.record)
    return load_sealed(manifest.spec, manifest.stages, read, device_index)


def load_sealed(spec: KernelSpec | SpecFields, stages: Sequence[Any], read: Callable[[str], bytes],
                device_index: int) -> Any:
    """A :class:`CubinFwd` / :class:`CubinBwd` over the stages' cubins on ``device_index``; the
    records (validated when written, sealed by the entry's payload digest) read as attribute views."""
    blobs = {}
    for st in stages:  # every file verified and every record read before the driver
        if st.format != "cubin":
            raise BuildError(f"{spec.id}: stage {st.name} is {st.format}, not a cubin")
        blobs[st.name] = (record_view(st.record), read(st.file))
    kernels = {name: CubinKernel(record, cubin, device_index) for name, (record, cubin) in blobs.items()}
    if spec.op == "fwd":
        return CubinFwd(kernels["fwd"], spec)
    return CubinBwd(kernels["bwd_preprocess"], kernels["bwd_main"], kernels["bwd_postprocess"], spec)
