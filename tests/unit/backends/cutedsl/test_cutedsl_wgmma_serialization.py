"""ptxas keeps the sm_90a CuTe DSL kernels' wgmma asynchronous (CPU).

When ptxas cannot prove that the branch around a ``wgmma.mma_async`` is warp-uniform, it inserts
a warpgroup arrive before every wgmma and serialises them; it says so with warning C7520 and the
kernel runs markedly slower, with nothing else to show for it (a bound derived through warp
shuffles did this to the forward's block loop: 25% slower at H64). The kernels mark such values
with ``cute.arch.make_warp_uniform``. This test builds representative specs through
``dsa-aot prebuild`` with the DSL keeping its PTX, assembles that PTX with the local ptxas
(``-v``) and fails on C7520 or on spills.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cli_helpers import cli, needs_cute_dsl

#: A spec of each kernel whose wgmma loops are bounded by a per-row scan: the persistent forward
#: (every head count builds the same kernel; H16 and H64 differ in tiles) and the backward's
#: fast noncompact kernels (``wgmma_ws``, and ``wgmma_ws_staggered`` at H128).
SPECS = ("fwd-sm_90a-d576-h64-noncompact-cutedsl", "fwd-sm_90a-d576-h16-noncompact-cutedsl",
         "bwd-sm_90a-d576-h64-noncompact-cutedsl", "bwd-sm_90a-d576-h128-noncompact-cutedsl")

PTXAS = shutil.which("ptxas")


def ptx_isa_of_ptxas(ptxas: str) -> tuple[int, int]:
    """The newest PTX ISA ``ptxas`` reads: CUDA 12.x reads 8.x, 13.x reads 9.x."""
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
    major, minor = map(int, re.search(r"release (\d+)\.(\d+)", out).groups())
    return major - 4, minor


def assemble(ptx: Path, isa: tuple[int, int], out: Path) -> str:
    """``ptxas -v`` of ``ptx`` for sm_90a; a newer ``.version`` than the local ptxas reads is
    lowered to its own (the DSL's bundled compiler writes the newest ISA, which the kernels do not
    need). Returns ptxas's report."""
    text = ptx.read_text()
    found = re.search(r"^\.version (\d+)\.(\d+)$", text, re.MULTILINE)
    assert found, f"{ptx.name}: no .version line"
    if tuple(map(int, found.groups())) > isa:
        text = text.replace(found.group(0), f".version {isa[0]}.{isa[1]}", 1)
    src = out / "kernel.ptx"
    src.write_text(text)
    proc = subprocess.run([PTXAS, "-v", "-arch=sm_90a", str(src), "-o", str(out / "kernel.cubin")],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"ptxas failed on {ptx.name}:\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


@needs_cute_dsl
@pytest.mark.skipif(PTXAS is None, reason="needs ptxas (the CUDA toolkit) on PATH")
def test_wgmma_stays_asynchronous(tmp_path: Path) -> None:
    dump = tmp_path / "ptx"
    dump.mkdir()
    only = [arg for name in SPECS for arg in ("--only", name)]
    cli("prebuild", "--arch", "sm_90a", "-j", "2", "-q", *only, root=tmp_path / "cache",
        env={"CUTE_DSL_KEEP_PTX": "1", "CUTE_DSL_DUMP_DIR": str(dump),
             "DSA_AOT_BACKENDS": "cutedsl"})
    ptx_files = sorted(dump.glob("*.ptx"))
    with_wgmma = [p for p in ptx_files if "wgmma.mma_async" in p.read_text()]
    # two forward kernels, the two backward main kernels (pre/postprocess have no wgmma)
    assert len(with_wgmma) >= len(SPECS), [p.name for p in ptx_files]
    isa = ptx_isa_of_ptxas(PTXAS)
    for ptx in with_wgmma:
        report = assemble(ptx, isa, tmp_path)
        assert "C7520" not in report, f"{ptx.name}: ptxas serialised its wgmma:\n{report[-3000:]}"
        assert not re.search(r"[1-9]\d* bytes spill (stores|loads)", report), f"{ptx.name}: {report}"
