"""bench/bench_host_time.py's CPU-side parts: the segments between the host-clock marks, their
medians over calls, the marks its patch sets around a fixed-point call's launches (and removes),
and the result's Markdown."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import dsa_aot.runners as runners
from dsa_aot import fixed_point

BENCH = Path(__file__).resolve().parents[3] / "bench"


@pytest.fixture(scope="module")
def host():
    spec = importlib.util.spec_from_file_location("_bench_host_time", BENCH / "bench_host_time.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_segments_and_their_medians(host):
    marks = [("start", 0), ("runner", 20_000), ("launch 1>", 120_500), ("launch 1<", 150_500),
             ("end", 400_000)]
    assert host.segments(marks) == {"start..runner": 20.0, "runner..launch 1>": 100.5,
                                    "launch 1>..launch 1<": 30.0, "launch 1<..end": 249.5}
    runs = [{"a..b": 1.0, "b..c": 5.0}, {"a..b": 3.0}, {"a..b": 2.04, "b..c": 7.0}]
    assert host.medians(runs) == {"a..b": 2.0, "b..c": 6.0}
    assert list(host.medians(runs)) == ["a..b", "b..c"]


def test_marks_number_each_launch_of_a_fixed_point_call_and_restore_the_runner(host):
    call, dkv = runners.StagedBwd.__call__, runners.fixed_point_dkv
    out = torch.full((6, 64), float("nan"))
    with host.Marks() as m:
        assert runners.StagedBwd.__call__ is not call and runners.fixed_point_dkv is not dkv
        m.mark("start")
        runners.fixed_point_dkv(lambda rows, fixed, measure: None, fixed_point.post_reference, out,
                                torch.zeros(2, 3), torch.empty(3), 20, 1)
        m.mark("end")
    assert runners.StagedBwd.__call__ is call and runners.fixed_point_dkv is dkv
    assert torch.equal(out, torch.zeros(6, 64))  # nothing added: the folded zero sums
    names = [n for n, _ in m.marks]
    assert names == ["start", "launch 1>", "launch 1<", "post 1>", "post 1<", "launch 2>", "launch 2<",
                     "post 2>", "post 2<", "launch 3>", "launch 3<", "post 3>", "post 3<", "end"]
    # the sample, the guess, the group, the check, its (skipped) re-launch, the fold
    times = [t for _, t in m.marks]
    assert times == sorted(times)


def test_markdown_names_the_command_and_every_segment(host):
    doc = {"command": "python bench/bench_host_time.py --rows 6", "environment": {
        "gpu": "NVIDIA H200", "date": "2026-12-06", "torch": "2.11.0+cu130", "cuda": "13.0",
        "nvidia-cutlass-dsl": "4.8.1"},
        "records": [{"heads": 16, "d_qk": 512, "topk": 512, "mode": "fixed_point", "host_us": 804.7,
                     "segments_us": {"start..runner": 31.2, "launch 1<..launch 2>": 116.3}}]}
    text = host.markdown(doc)
    assert text.startswith("# Host time of a backward call, NVIDIA H200, 2026-12-06")
    assert "`python bench/bench_host_time.py --rows 6`" in text
    assert "| 16 | 512 | 512 | fixed_point | 804.7 | start..runner 31.2, launch 1<..launch 2> 116.3 |" in text


def test_write_results_puts_the_json_and_its_markdown_side_by_side(tmp_path):
    common = importlib.util.module_from_spec(spec := importlib.util.spec_from_file_location(
        "_bench_common", BENCH / "common.py"))
    spec.loader.exec_module(common)
    out = tmp_path / "results" / "h200_x.json"
    common.write_results(out, {"records": [1, 2]}, "# table\n")
    assert out.read_text() == '{\n "records": [\n  1,\n  2\n ]\n}\n'
    assert (tmp_path / "results" / "h200_x.md").read_text() == "# table\n"
    common.write_results(tmp_path / "only.json", [])
    assert not (tmp_path / "only.md").exists()
