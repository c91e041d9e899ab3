"""Key coverage: editing one source file makes exactly the specs built from it miss.

A wheel-like copy of the package (``dsa_aot/`` with ``kernels/``, ``specs/``, ``cache/`` inside,
as the wheel installs it) is put first on ``PYTHONPATH`` of a child process, which appends a
comment to each source file in turn and reports whose build keys and runtime identities
changed. The expectations below are written out by hand from what each file is for, so a key
that forgets a file its build reads (or covers one it does not) fails here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CHILD = Path(__file__).with_name("_key_edits_child.py")


def _ids(specs: list[str], op: str | None = None, backend: str | None = None,
         arch: str | None = None) -> list[str]:
    """Spec ids of ``op``, ``backend`` (an id's sixth field, before any ``-k<topk>`` bucket) and
    ``arch`` (its second)."""
    return sorted(s for s in specs if (op is None or s.startswith(op + "-"))
                  and (backend is None or s.split("-")[5] == backend)
                  and (arch is None or s.split("-")[1] == arch))


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    site = tmp_path_factory.mktemp("site")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "aot", site / "dsa_aot", ignore=ignore)
    for sub in ("kernels", "specs", "cache"):
        shutil.copytree(REPO / sub, site / "dsa_aot" / sub, ignore=ignore)
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, str(CHILD)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert Path(data["package"]).is_relative_to(site)  # the copy, not the editable install
    return data


# file -> (op, backend[, arch]) groups whose BUILD KEYS must change; every other spec must keep its key
BUILD = {
    "dsa_aot/kernels/tilelang_fwd.py": [("fwd", "tilelang")],
    "dsa_aot/kernels/tilelang_bwd.py": [("bwd", "tilelang")],
    "dsa_aot/kernels/tilelang_bwd_preprocess.py": [("bwd", "tilelang")],
    "dsa_aot/kernels/tilelang_bwd_postprocess.py": [("bwd", "tilelang")],
    "dsa_aot/kernels/cutedsl_fwd.py": [("fwd", "cutedsl")],  # every flavour's module imports it
    "dsa_aot/kernels/cutedsl_fwd_split.py": [("fwd", "cutedsl", "sm_90a")],  # sm_90a's default flavour
    "dsa_aot/kernels/cutedsl_fwd_mma.py": [("fwd", "cutedsl", "sm_100a")],  # sm_100a's
    "dsa_aot/kernels/cutedsl_bwd_main.py": [("bwd", "cutedsl")],
    "dsa_aot/kernels/cutedsl_bwd_preprocess.py": [("bwd", "cutedsl")],
    "dsa_aot/kernels/cutedsl_bwd_postprocess.py": [("bwd", "cutedsl")],
    "dsa_aot/kernels/cutedsl_common.py": [("fwd", "cutedsl"), ("bwd", "cutedsl")],
    "dsa_aot/backends/tilelang/build.py": [(None, "tilelang")],
    "dsa_aot/backends/tilelang/launch.py": [(None, "tilelang")],  # grid expressions are checked with it
    "dsa_aot/backends/tilelang/records.py": [(None, "tilelang")],  # its LaunchRecord is built
    "dsa_aot/backends/stage.py": [(None, "tilelang")],  # build_stage makes the StageArtifact
    "dsa_aot/backends/tilelang/__init__.py": [(None, "tilelang")],
    # the cudnn backend builds through the CuTe DSL backend's worker, header checks and link
    "dsa_aot/backends/cutedsl/build.py": [(None, "cutedsl"), (None, "cudnn")],
    "dsa_aot/backends/cutedsl/worker.py": [(None, "cutedsl"), (None, "cudnn")],
    "dsa_aot/backends/cutedsl/records.py": [(None, "cutedsl"), (None, "cudnn")],
    "dsa_aot/backends/cutedsl/flavours.py": [(None, "cutedsl"), (None, "cudnn")],  # kernel module per flavour
    "dsa_aot/backends/cutedsl/names.py": [(None, "cutedsl"), (None, "cudnn")],  # record file, sha256
    "dsa_aot/backends/cutedsl/__init__.py": [(None, "cutedsl"), (None, "cudnn")],
    "dsa_aot/backends/cudnn/kernels.py": [(None, "cudnn")],  # every cudnn stage's compile function
    "dsa_aot/backends/cudnn/build.py": [(None, "cudnn")],
    "dsa_aot/backends/cudnn/records.py": [(None, "cudnn")],
    "dsa_aot/backends/cudnn/__init__.py": [(None, "cudnn")],
    "dsa_aot/toolkit.py": [(None, "cutedsl"), (None, "cudnn")],  # the toolkit whose static runtime is linked in
    "dsa_aot/settings.py": [(None, "cutedsl"), (None, "cudnn")],  # CC, the toolkit root
    "dsa_aot/specs/models.py": [(None, "tilelang")],  # TileLang kernels read the KernelSpec
    "dsa_aot/backends/base.py": [(None, None)],
}
#: Files no build reads: editing them changes no key at all.
NO_BUILD = ["dsa_aot/loader.py", "dsa_aot/ops.py", "dsa_aot/cli.py", "dsa_aot/build.py", "dsa_aot/prebuild.py",
            "dsa_aot/identity.py", "dsa_aot/runners.py", "dsa_aot/validate.py", "dsa_aot/kernels/reference.py",
            "dsa_aot/backends/tilelang/runtime.py", "dsa_aot/backends/cutedsl/runtime.py",
            "dsa_aot/backends/cudnn/runtime.py",
            "dsa_aot/cache/store.py", "dsa_aot/cache/bundle.py", "dsa_aot/specs/catalog.py",
            "dsa_aot/specs/keys.py", "dsa_aot/specs/probes.py", "dsa_aot/specs/toolchain.py",
            "dsa_aot/serving.py", "dsa_aot/cache/layout.py", "dsa_aot/specs/installed.py",
            "dsa_aot/specs/sources.py", "dsa_aot/specs/ranking.py"]
#: Kernel modules of flavours no catalog spec names (only a ``tile.flavour`` does): editing one
#: keeps every catalog key (``test_cutedsl_tile`` checks that their specs' keys cover them).
FLAVOUR_ONLY = ["dsa_aot/kernels/cutedsl_fwd_wgmma.py", "dsa_aot/kernels/cutedsl_fwd_ws.py"]
#: file -> backends whose RUNTIME identity must change (load code and kernel sources).
RUNTIME = {
    "dsa_aot/backends/tilelang/runtime.py": ["tilelang"],
    "dsa_aot/backends/cutedsl/runtime.py": ["cutedsl", "cudnn"],  # cudnn loads through it
    "dsa_aot/backends/cudnn/runtime.py": ["cudnn"],
    "dsa_aot/backends/cudnn/records.py": ["cudnn"],
    "dsa_aot/runners.py": ["tilelang", "cutedsl", "cudnn"],
    "dsa_aot/kernels/tilelang_fwd.py": ["tilelang"],
    "dsa_aot/kernels/cutedsl_bwd_main.py": ["cutedsl"],
    "dsa_aot/loader.py": [],
    "dsa_aot/cli.py": [],
    "dsa_aot/backends/tilelang/build.py": [],
    "dsa_aot/backends/cutedsl/worker.py": [],
    "dsa_aot/backends/cudnn/kernels.py": ["cudnn"],
    "dsa_aot/backends/cudnn/build.py": [],
    "dsa_aot/cache/layout.py": ["cutedsl"],  # CorruptArtifact, raised by the library check
    "dsa_aot/backends/cutedsl/names.py": ["cutedsl", "cudnn"],
    "dsa_aot/serving.py": [],
    "dsa_aot/specs/sources.py": [],
    "dsa_aot/specs/ranking.py": [],
}


@pytest.mark.parametrize("name", sorted(BUILD))
def test_editing_a_build_source_misses_exactly_its_specs(report, name):
    specs = report["specs"]
    want = sorted({s for group in BUILD[name] for s in _ids(specs, *group)})
    assert want, name
    assert report["edits"][name]["build"] == want


@pytest.mark.parametrize("name", NO_BUILD)
def test_editing_code_no_build_reads_keeps_every_key(report, name):
    assert report["edits"][name]["build"] == []


@pytest.mark.parametrize("name", FLAVOUR_ONLY)
def test_editing_a_flavour_no_catalog_spec_names_keeps_every_key(report, name):
    assert report["edits"][name] == {"build": [], "runtime": []}


@pytest.mark.parametrize("name", sorted(RUNTIME))
def test_runtime_identity_follows_load_code_and_kernel_sources(report, name):
    specs = report["specs"]
    want = sorted(s for backend in RUNTIME[name] for s in _ids(specs, backend=backend))
    if name.startswith("dsa_aot/kernels/") or name.endswith("/kernels.py"):  # a kernel file: its specs only
        want = report["edits"][name]["build"]
    assert report["edits"][name]["runtime"] == want


def test_every_source_file_was_edited_once(report):
    for name in [*BUILD, *NO_BUILD, *FLAVOUR_ONLY, *RUNTIME]:
        assert name in report["edits"], name
