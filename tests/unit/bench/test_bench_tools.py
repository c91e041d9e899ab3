"""The benchmark's CPU-side parts: loading the FlashMLA peer (optional), the result file's
Markdown, and the chart's series (bench/bench_sparse_mla.py, bench/plot_results.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _module("bench_sparse_mla")


@pytest.fixture(scope="module")
def plot():
    return _module("plot_results")


def _rec(op="fwd", backend="dsa-aot/cutedsl", s_kv=8192, heads=64, d_qk=576, topk=2048, ms=2.0,
         peer_ms=None, paired=None) -> dict:
    flops = 2.0 * 4096 * heads * topk * (d_qk + 512) if op == "fwd" else \
        2.0 * 4096 * heads * topk * (3 * d_qk + 2 * 512)
    rec = {"op": op, "backend": backend, "s_q": 4096, "s_kv": s_kv, "heads": heads, "d_qk": d_qk,
           "topk": topk, "ms": ms, "tflops": round(flops / ms / 1e9, 1), "peer_ms": peer_ms,
           "ratio": round(peer_ms / ms, 3) if peer_ms else None}
    if paired:
        rec.update(paired_ratio=paired, paired_ratio_q1=round(paired - 0.01, 3),
                   paired_ratio_q3=round(paired + 0.01, 3))
    return rec


def test_flashmla_peer_is_optional(bench, monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("FLASHMLA_SO", raising=False)
    assert bench.peer_fwd(None) is None                       # not asked for: no column, no noise
    assert capsys.readouterr().err == ""
    missing = tmp_path / "_flashmla_C.abi3.so"
    monkeypatch.setenv("FLASHMLA_SO", str(missing))
    assert bench.peer_fwd(None) is None                       # asked for, absent: said, not raised
    assert str(missing) in capsys.readouterr().err
    not_a_library = tmp_path / "broken.so"
    not_a_library.write_bytes(b"not an ELF file")
    assert bench.peer_fwd(str(not_a_library)) is None         # the argument wins over the variable
    assert str(not_a_library) in capsys.readouterr().err


def test_markdown_names_the_run_and_leaves_absent_peers_empty(bench):
    env = {"gpu": "NVIDIA H200", "torch": "2.11.0", "date": "2026-12-03"}
    records = [_rec(peer_ms=2.1, paired=1.05), _rec(backend="dsa-aot/tilelang", ms=2.5),
               _rec(op="bwd", ms=8.0, peer_ms=7.6)]
    lines = bench.markdown(records, env, "python bench/bench_sparse_mla.py --ops fwd")
    text = "\n".join(lines)
    assert "# Sparse MLA on NVIDIA H200" in text and "`python bench/bench_sparse_mla.py --ops fwd`" in text
    assert "Date: 2026-12-03" in text and "torch 2.11.0" in text
    rows = [line for line in lines if line.startswith("| fwd") or line.startswith("| bwd")]
    assert len(rows) == 3
    with_peer, without_peer, bwd = ([c.strip() for c in row.strip("|").split("|")] for row in rows)
    assert with_peer[1] == "cutedsl" and with_peer[9] == "2.1" and with_peer[12] == "1.05 [1.04, 1.06]"
    fwd_flops = 2.0 * 4096 * 64 * 2048 * (576 + 512)
    assert with_peer[10] == f"{fwd_flops / 2.1 / 1e9:.0f}"     # the peer's TFLOPS from its own ms
    assert without_peer[1] == "tilelang" and without_peer[9:] == ["-", "-", "-", "-"]
    bwd_flops = 2.0 * 4096 * 64 * 2048 * (3 * 576 + 2 * 512)
    assert bwd[10] == f"{bwd_flops / 7.6 / 1e9:.0f}" and bwd[12] == "-"
    assert "Causal" not in text


def test_markdown_says_when_the_inputs_were_causal(bench):
    env = {"gpu": "NVIDIA H200", "date": "2026-12-07"}
    lines = bench.markdown([{**_rec(op="bwd", ms=5.0, peer_ms=6.0), "causal": True}], env,
                           "python bench/bench_sparse_mla.py --ops bwd --causal")
    note = lines.index("Causal prefill inputs (`--causal`): the early rows' trailing slots are -1; "
                       "TFLOPS count every slot.")
    assert lines[note - 1] == "" and lines[note + 1] == "" and lines[note + 2].startswith("| op |")
    assert bench.parser().parse_args(["--causal"]).causal and not bench.parser().parse_args([]).causal


def test_chart_series_per_shape_with_the_peer_beside_our_fastest_row(plot):
    records = [
        _rec(backend="dsa-aot/tilelang", ms=2.6, peer_ms=2.2),
        _rec(backend="dsa-aot/cutedsl", ms=2.0, peer_ms=2.3, paired=1.05),   # fastest: paired
        _rec(backend="dsa-aot/cutedsl", heads=128, ms=4.0, peer_ms=4.4),      # fastest: unpaired
        _rec(op="bwd", ms=8.0, peer_ms=7.6),
    ]
    labels, bars = plot.series(records, "fwd")
    assert labels == ["H64 D576 K2048\nS_q 4k S_kv 8k", "H128 D576 K2048\nS_q 4k S_kv 8k"]
    assert list(bars) == ["tilelang", "cutedsl", "FlashMLA"]
    assert bars["tilelang"] == [records[0]["tflops"], None]          # not run at H128
    assert bars["cutedsl"] == [records[1]["tflops"], records[2]["tflops"]]
    # paired row: the peer at our clocks (our TFLOPS over the paired ratio); else its own ms
    assert bars["FlashMLA"][0] == pytest.approx(records[1]["tflops"] / 1.05)
    assert bars["FlashMLA"][1] == pytest.approx(2.0 * 4096 * 128 * 2048 * 1088 / 4.4 / 1e9)
    _, bwd = plot.series(records, "bwd")
    assert list(bwd) == ["cutedsl", "cuDNN frontend"]


def test_chart_without_any_peer_has_no_peer_series(plot):
    _, bars = plot.series([_rec(), _rec(backend="dsa-aot/tilelang", ms=2.4)], "fwd")
    assert list(bars) == ["cutedsl", "tilelang"]


def test_forward_rows_from_the_table_or_the_command_line(bench):
    table = bench.FWD_SHAPES
    assert bench.fwd_rows(bench.parser().parse_args([])) == table
    assert bench.fwd_rows(bench.parser().parse_args(["--shapes", "0", "5"])) == [table[0], table[5]]
    args = bench.parser().parse_args(["--fwd-shape", "4224", "8192", "64", "576", "2048",
                                      "--fwd-shape", "4158", "8192", "128", "512", "1024",
                                      "--shapes", "0"])
    assert bench.fwd_rows(args) == [(4224, 8192, 64, 576, 2048), (4158, 8192, 128, 512, 1024)]
    with pytest.raises(SystemExit):
        bench.parser().parse_args(["--fwd-shape", "4224", "8192"])


def test_backward_rows_from_the_table_or_the_command_line(bench):
    table = bench.BWD_SHAPES
    assert bench.bwd_rows(bench.parser().parse_args([])) == table
    assert bench.bwd_rows(bench.parser().parse_args(["--shapes", "1", "4"])) == [table[1], table[4]]
    args = bench.parser().parse_args(["--bwd-shape", "2048", "8192", "64", "576", "4096", "--shapes", "0"])
    assert bench.bwd_rows(args) == [(2048, 8192, 64, 576, 4096)]
    assert bench.fwd_rows(args) == [bench.FWD_SHAPES[0]]  # the forward keeps its table


@pytest.mark.parametrize("s_q,s_kv,topk", [(64, 64, 16), (32, 96, 48), (8, 8, 32)])
def test_causal_inputs_pick_only_earlier_positions_and_pad_the_rest(s_q, s_kv, topk):
    make_inputs = _module("common").make_inputs
    idx = make_inputs(s_q, s_kv, 2, 64, topk, device="cpu", causal=True)["topk_idxs"]
    assert idx.shape == (s_q, topk)
    for t in range(s_q):
        pos = s_kv - s_q + t
        row = idx[t].tolist()
        n = min(topk, pos + 1, s_kv)
        assert row[n:] == [-1] * (topk - n)  # padding after the valid slots
        assert len(set(row[:n])) == n and all(0 <= j <= pos for j in row[:n])
    plain = make_inputs(s_q, s_kv, 2, 64, topk, device="cpu")["topk_idxs"]
    assert (plain[:, :min(topk, s_kv)] >= 0).all()


def _flavour_dir(tmp_path: Path, *majors: int) -> Path:
    libs = tmp_path / "_mlir_libs"
    libs.mkdir()
    for n in majors:
        (libs / f"_cutlass_ir.cu{n}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (libs / "_cutlass_ir_version_cu12.py").write_text("")  # not an extension: ignored
    return libs


def test_cutlass_dsl_flavour_follows_the_dsls_rule(tmp_path):
    common = _module("common")
    libs = _flavour_dir(tmp_path, 12, 13)
    assert common.cutlass_dsl_flavour(libs, 13000) == "cu13 (installed cu12, cu13; driver CUDA 13.0)"
    assert common.cutlass_dsl_flavour(libs, 12090) == "cu12 (installed cu12, cu13; driver CUDA 12.9)"
    assert common.cutlass_dsl_flavour(libs, None) == "cu13 (installed cu12, cu13; no driver: the newest)"
    assert common.cutlass_dsl_flavour(libs, 11080) == "none usable (installed cu12, cu13; driver CUDA 11.8)"
    assert common.cutlass_dsl_flavour(tmp_path / "missing", 13000) == "absent"


def test_environment_names_the_installed_dsl_flavour():
    common = _module("common")
    env = common.environment()
    if importlib.util.find_spec("cutlass") is None:
        assert env["cutlass-dsl flavour"] == "absent"
    else:
        assert env["cutlass-dsl flavour"].startswith("cu1"), env["cutlass-dsl flavour"]


def test_variant_rows_only_where_the_flavour_takes_the_shape(bench, capsys):
    """``--variant`` (bench_sparse_mla.py, profile_pair.py): no row for another op, and none,
    said on stderr, at a head count the flavour cannot build (before anything loads or builds)."""
    text = "bwd:cutedsl:flavour=wgmma_ws_cols"  # H128 only
    assert bench.variant_kernel(text, "fwd", 128, 576, 0) is None
    assert capsys.readouterr().err == ""
    assert bench.variant_kernel(text, "bwd", 64, 576, 0) is None
    err = capsys.readouterr().err
    assert "no row at h64 d576" in err and "wgmma_ws_cols" in err
