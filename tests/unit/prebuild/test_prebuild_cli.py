"""End to end on the CPU: `dsa-aot prebuild` compiles a small catalog for sm_90a and sm_100a
for real, then status / verify / export / import / gc work on those artifacts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import cli, sm_of_elf

from dsa_aot.artifact import ArtifactManifest
from dsa_aot.backends import get as get_backend
from dsa_aot.backends.base import STAGE_PARAMS
from dsa_aot.backends.tilelang.records import LaunchRecord
from dsa_aot.cache.store import ArtifactStore
from dsa_aot.identity import build_identity
from dsa_aot.specs.catalog import load_catalog
from dsa_aot.specs.installed import dsl_cuda_choice, dsl_cuda_majors
from dsa_aot.specs.models import KernelSpec
from dsa_aot.specs.toolchain import Toolchain

SMALL = ["fwd-sm_90a-d576-h64-noncompact-tilelang", "fwd-sm_100a-d512-h16-compact-tilelang",
         "bwd-sm_90a-d512-h128-compact-tilelang", "bwd-sm_100a-d576-h32-noncompact-tilelang"]


def _key(spec_id: str) -> str:
    """The spec's build key in this process (the first path component of its entry)."""
    spec = KernelSpec.from_id(spec_id)
    return build_identity(get_backend(spec.backend), spec, Toolchain.current()).key()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prebuilt")
    only = [a for s in SMALL for a in ("--only", s)]
    proc = cli("prebuild", "-q", "--jobs", "2", *only, root=root)
    assert f"built{'':<15}{len(SMALL):>5}" in proc.stdout, proc.stdout
    return root


def test_artifacts_are_cubins_for_their_arch(built):
    store = ArtifactStore(built)
    for spec_id in SMALL:
        arch = spec_id.split("-")[1]
        key = _key(spec_id)
        entry = store.lookup(key, arch, spec_id)
        assert entry is not None, spec_id
        manifest = ArtifactManifest.model_validate(entry.meta.payload)
        assert manifest.spec.id == spec_id and manifest.key == key
        expected = ["fwd"] if spec_id.startswith("fwd") else ["bwd_preprocess", "bwd_main", "bwd_postprocess"]
        assert [s.name for s in manifest.stages] == expected
        for stage in manifest.stages:
            assert stage.format == "cubin" and stage.file == f"{stage.name}.cubin"
            names = {p.name for p in LaunchRecord.model_validate(stage.record).params}
            assert names <= STAGE_PARAMS[stage.name]
            assert ("topk_length" in names) == (manifest.spec.layout == "compact" and stage.name in ("fwd", "bwd_main"))
            assert sm_of_elf(store.read_file(entry, stage.file)) == int(arch[3:-1])
        assert store.verify(entry) == []


def test_second_prebuild_is_all_cached(built):
    only = [a for s in SMALL for a in ("--only", s)]
    proc = cli("prebuild", "-q", *only, root=built)
    assert f"cached{'':<14}{len(SMALL):>5}" in proc.stdout and "built                   0" in proc.stdout


def test_list_and_status_json(built):
    listed = json.loads(cli("list", "--json", root=built).stdout)
    assert [s["id"] for s in listed] == [s.id for s in load_catalog().specs()]  # its shape: test_specs_catalog
    assert {"id", "op", "arch", "d_qk", "heads", "layout", "backend"} <= set(listed[0])
    states = json.loads(cli("status", "--json", root=built).stdout)
    assert {k for k, v in states.items() if v == "cached"} == set(SMALL)
    assert set(states.values()) == {"cached", "missing"}


def test_verify_detects_and_quarantines_damage(built, tmp_path):
    root = tmp_path / "copy"
    cli("export", str(tmp_path / "all.tar"), root=built)
    cli("import", str(tmp_path / "all.tar"), root=root)
    assert cli("verify", root=root).returncode == 0
    cubin = next(root.rglob("fwd.cubin"))
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0x40
    cubin.write_bytes(bytes(data))
    bad = cli("verify", "--quarantine", root=root, check=False)
    assert bad.returncode == 1 and "sha256 mismatch" in bad.stdout
    states = json.loads(cli("status", "--json", root=root).stdout)
    assert sum(v == "failed" for v in states.values()) == 1
    assert sum(v == "cached" for v in states.values()) == len(SMALL) - 1


def test_export_import_round_trip(built, tmp_path):
    bundle = tmp_path / "k.tar"
    assert "exported 4 entries" in cli("export", str(bundle), root=built).stdout
    dst = tmp_path / "dst"
    assert "imported 4 entries" in cli("import", str(bundle), root=dst).stdout
    assert json.loads(cli("status", "--json", root=dst).stdout) == json.loads(cli("status", "--json", root=built).stdout)


def test_gc_removes_other_keys(built, tmp_path):
    root = tmp_path / "gc"
    cli("export", str(tmp_path / "b.tar"), root=built)
    cli("import", str(tmp_path / "b.tar"), root=root)
    stale = root / "0000000000000000" / "sm_90a" / "x"
    stale.mkdir(parents=True)
    (stale / "meta.json").write_text("{}")
    out = cli("gc", root=root).stdout
    assert "removed 1 other toolchains" in out and not stale.exists()
    assert sum(v == "cached" for v in json.loads(cli("status", "--json", root=root).stdout).values()) == len(SMALL)


def test_runtime_image_without_cuda_toolkit_serves_the_prebuilt_root(built, tmp_path):
    """The container recipe: artifacts imported into a read-only root, a runtime with no nvcc
    serves them by runtime identity (it cannot compute the builder's key without nvcc)."""
    image = tmp_path / "image-layer"
    cli("export", str(tmp_path / "k.tar"), root=built)
    cli("import", str(tmp_path / "k.tar"), root=image)
    no_toolkit = {"CUDA_HOME": str(tmp_path / "no-cuda"), "DSA_AOT_PREBUILT_DIR": str(image)}
    only = [a for s in SMALL for a in ("--only", s)]
    doctor = json.loads(cli("doctor", *only, root=tmp_path / "rw", env=no_toolkit).stdout)
    assert doctor["toolchain"]["nvcc_version"] is None
    assert doctor["fingerprint"] != Toolchain.current().fingerprint
    dsl_builds = dsl_cuda_majors(d["name"] for d in doctor["toolchain"]["cutlass_dsl"])
    assert doctor["toolchain"]["cutlass_dsl_cuda"] == dsl_cuda_choice(dsl_builds, doctor["driver_cuda_version"])
    assert doctor["backends"]["tilelang"]["lookup_rule"] == "runtime identity"
    assert "nvcc" in doctor["backends"]["tilelang"]["why"]
    served = doctor["loader_would_serve"]
    assert set(served) == {f"{s.split('-')[0]}-{s.split('-')[1]}-tilelang" for s in SMALL}
    for spec_id in SMALL:
        label = "-".join(spec_id.split("-")[:2]) + "-tilelang"
        arch = spec_id.split("-")[1]
        serving_path = served[label].pop("serving_path")
        assert served[label] == {"spec": spec_id, "rule": "runtime identity",
                                 "entry": f"{image}/{_key(spec_id)}/{arch}/{spec_id}"}, served[label]
        assert "tilelang is installed; the loader decides" in serving_path  # TileLang without nvcc
    states = json.loads(cli("status", "--json", root=tmp_path / "rw", env=no_toolkit).stdout)
    assert {k for k, v in states.items() if v == "cached"} == set(SMALL)
    spec = KernelSpec.from_id(SMALL[0])
    entry = ArtifactStore(image).lookup(_key(SMALL[0]), "sm_90a", SMALL[0])
    manifest = ArtifactManifest.model_validate(entry.meta.payload)
    assert manifest.build == build_identity(get_backend("tilelang"), spec, Toolchain.current())
    assert manifest.build.nvcc_version == Toolchain.current().nvcc_version  # the builder's, recorded


def test_bad_arguments_exit_nonzero(tmp_path):
    proc = cli("prebuild", "--arch", "sm_80", root=tmp_path, check=False)
    assert proc.returncode != 0 and "sm_80" in (proc.stdout + proc.stderr)
    proc = cli("prebuild", "--shard", "5/2", root=tmp_path, check=False)
    assert proc.returncode != 0
