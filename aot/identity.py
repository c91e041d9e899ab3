"""The identities of one spec in this process: its build key, and its runtime identity.

:func:`build_identity` needs the spec's compilers installed (their content is part of the key);
:func:`runtime_identity` needs only our own installed sources. The loader looks artifacts up
by the first when this process can build the spec, and by the second when it cannot (a serving
image without compilers). Nothing here imports a compiler.
"""

from __future__ import annotations

from dsa_aot.backends.base import KernelBackend
from dsa_aot.specs.keys import BuildIdentity, RuntimeIdentity, module_sources
from dsa_aot.specs.sources import runtime_identity_fields
from dsa_aot.specs.installed import matches_compiler
from dsa_aot.specs.models import KernelSpec
from dsa_aot.specs.toolchain import CUTLASS_DSL_PREFIX, Distribution, Toolchain


def installed_compilers(backend: KernelBackend, toolchain: Toolchain) -> tuple[Distribution, ...]:
    """The installed distributions matching the backend's ``compilers`` patterns, by name."""
    dists = [d for d in (toolchain.tilelang, toolchain.tvm_ffi, *toolchain.cutlass_dsl) if d is not None]
    dists += list(toolchain.other_compilers)
    chosen = {d.name: d for d in dists if any(matches_compiler(d.name, p) for p in backend.compilers)}
    return tuple(chosen[n] for n in sorted(chosen))


def incomplete_reasons(backend: KernelBackend, toolchain: Toolchain) -> list[str]:
    """Why the installed toolchain cannot key this backend's builds (empty: it can)."""
    names = [p.rstrip("*") for p in backend.compilers]
    reasons = [r for r in toolchain.incomplete_reasons
               if any(r.startswith(n) for n in names) or (backend.uses_cuda_toolkit and "nvcc" in r)]
    reasons += [f"{d.name}: installed content unknown" for d in installed_compilers(backend, toolchain)
                if d.content_sha256 is None and not any(r.startswith(d.name) for r in reasons)]
    return reasons


def missing_build_tools(backend: KernelBackend, toolchain: Toolchain) -> str | None:
    """Why this process cannot compile for ``backend`` at all (compiler or toolkit absent)."""
    missing = backend.missing_compiler()
    if missing:
        return missing
    if backend.uses_cuda_toolkit and toolchain.nvcc_version is None:
        return "no CUDA toolkit (nvcc) found"
    return None


def can_key_builds(backend: KernelBackend, toolchain: Toolchain) -> str | None:
    """Why this process cannot compute the spec's build key (None: it can, and may build and
    publish). A process that has the tools but not a readable key may still compile in memory."""
    missing = missing_build_tools(backend, toolchain)
    if missing:
        return missing
    reasons = incomplete_reasons(backend, toolchain)
    return "; ".join(reasons) if reasons else None


def build_identity(backend: KernelBackend, spec: KernelSpec, toolchain: Toolchain) -> BuildIdentity:
    """The spec's build identity under the installed ``toolchain`` (check :func:`can_key_builds`)."""
    compilers = installed_compilers(backend, toolchain)
    return BuildIdentity(backend=backend.name, compilers=compilers,
                         nvcc_version=toolchain.nvcc_version if backend.uses_cuda_toolkit else None,
                         cutlass_dsl_cuda=toolchain.cutlass_dsl_cuda if _uses_cutlass_dsl(compilers) else None,
                         host=toolchain.host, sources=module_sources(backend.source_modules(spec)))


def _uses_cutlass_dsl(compilers: tuple[Distribution, ...]) -> bool:
    return any(d.name.startswith(CUTLASS_DSL_PREFIX) for d in compilers)


def runtime_identity(backend: KernelBackend, spec: KernelSpec) -> RuntimeIdentity:
    """What a process must match to load ``spec``'s artifact without compilers."""
    return RuntimeIdentity(**runtime_identity_fields(backend.name, spec.arch, backend.runtime_module,
                                                     backend.kernel_sources(spec)))


def recorded_compilers_agree(backend: KernelBackend, recorded: BuildIdentity,
                             toolchain: Toolchain) -> str | None:
    """Whether every compiler installed here equals the one that built ``recorded`` (None: yes).

    A process that can build compares whole keys; this is for one that cannot (a compiler or
    the toolkit is absent): whatever part of the toolchain it does have must be the builder's.
    """
    theirs = {d.name: d for d in recorded.compilers}
    unknown = incomplete_reasons(backend, toolchain)
    for mine in installed_compilers(backend, toolchain):
        why = next((r for r in unknown if r.startswith(mine.name)), None)
        if why is not None:  # its recorded content cannot vouch for what is installed here
            return f"{mine.name} installed here cannot be identified ({why})"
        other = theirs.get(mine.name)
        if other is None:
            return f"built without {mine.name}, {mine.name} {mine.version} is installed here"
        if (mine.version, mine.content_sha256) != (other.version, other.content_sha256):
            content = " of other content" if other.version == mine.version else ""
            return f"built with {other.name} {other.version}{content}, {mine.name} {mine.version} is installed here"
    if (backend.uses_cuda_toolkit and toolchain.nvcc_version is not None
            and toolchain.nvcc_version != recorded.nvcc_version):
        return f"built with nvcc {recorded.nvcc_version}, nvcc {toolchain.nvcc_version} is installed here"
    mine_cuda = toolchain.cutlass_dsl_cuda if _uses_cutlass_dsl(installed_compilers(backend, toolchain)) else None
    if mine_cuda is not None and recorded.cutlass_dsl_cuda is not None and mine_cuda != recorded.cutlass_dsl_cuda:
        return (f"built with the CuTe DSL's cu{recorded.cutlass_dsl_cuda} build, the DSL here loads its "
                f"cu{mine_cuda} build (it picks the newest the driver supports)")
    return None
