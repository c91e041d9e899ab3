"""Child of test_keys.py: for each source file of the installed dsa_aot, append a comment and
report which catalog specs' build keys and runtime identities change (JSON on stdout)."""

import json
import sys
from pathlib import Path

import dsa_aot
from dsa_aot.backends import get
from dsa_aot.identity import build_identity, runtime_identity
from dsa_aot.specs import keys
from dsa_aot.specs.catalog import load_catalog
from dsa_aot.specs.toolchain import Toolchain

root = Path(dsa_aot.__file__).parent
specs = load_catalog().specs()
toolchain = Toolchain.current()


def identities() -> dict[str, tuple[str, str]]:
    """Every catalog spec's (build key, runtime identity), computed once per distinct source set."""
    keys.clear_caches()
    out, memo = {}, {}
    for spec in specs:
        backend = get(spec.backend)
        group = (backend.name, backend.source_modules(spec), spec.arch)
        if group not in memo:
            memo[group] = (build_identity(backend, spec, toolchain).key(),
                           runtime_identity(backend, spec).model_dump_json())
        out[spec.id] = memo[group]
    return out


base = identities()
report = {"package": str(root), "specs": sorted(base), "edits": {}}
for path in sorted(root.rglob("*.py")):
    if "__pycache__" in path.parts:
        continue
    name = "dsa_aot/" + path.relative_to(root).as_posix()
    original = path.read_bytes()
    try:
        path.write_bytes(original + b"\n# an edit that changes no behaviour\n")
        now = identities()
    finally:
        path.write_bytes(original)
    report["edits"][name] = {
        "build": sorted(s for s in base if now[s][0] != base[s][0]),
        "runtime": sorted(s for s in base if now[s][1] != base[s][1]),
    }
assert identities() == base  # restored
json.dump(report, sys.stdout)
