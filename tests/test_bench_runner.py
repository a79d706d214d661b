"""The benchmark runner (quick sweep, CPU, one process) and its report: JSON, Markdown, PNG."""
from __future__ import annotations

import json

import pytest

from benchmarks import report, runner
from benchmarks.__main__ import main as benchmarks_main
from benchmarks.cases import REDUCE_METHODS, SMALL_COUNT
from benchmarks.suites import QUICK

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COMMAND = "python -m benchmarks run --device CPU --nproc 1 --quick (test)"


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    returned = runner.run(runner.RunOptions(device="CPU", nproc=1, out=out, quick=True,
                                            progress=False, command=COMMAND))
    return out, returned


def test_json_structure(quick_results):
    out, returned = quick_results
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(returned))
    assert data["schema"] == runner.SCHEMA and data["command"] == COMMAND
    machine = data["machine"]
    for key in ("cpu_model", "cores", "mindspore", "numpy", "python", "device"):
        assert machine[key], key
    assert machine["device"] == "CPU" and machine["world_size"] == 1
    assert data["options"]["quick"] is True and data["options"]["nproc"] == 1

    cases = data["copy"]["cases"]
    assert {c["nbytes"] for c in cases if c["count"] == 1} == set(QUICK.copy_sizes)
    assert {c["method"] for c in cases} == {"pool", "zero_copy", "fresh_alloc", "memcpy"}
    assert any(c["count"] == SMALL_COUNT for c in cases)
    for case in cases:
        assert 0 < case["min_s"] <= case["median_s"] <= case["max_s"]
        assert case["repeats"] >= QUICK.copy_budget.min_repeats
    assert data["copy"]["small_op"]["median_s"] > 0

    reduce = data["reduce"]
    assert {(r["method"], r["comm_fusion"]) for r in reduce} == {
        (m, f) for m in REDUCE_METHODS for f in (False, True)}
    for row in reduce:
        assert row["world_size"] == 1 and row["communicator"] == "SingleProcessCommunicator"
        assert row["new_allocations_first_step"] > 0
        assert row["new_allocations_after_first"] == 0, row
        assert row["high_water_bytes"] > 0 and row["live_leases_after"] == 0
        assert row["repeats"] == QUICK.reduce_repeats
    borrowed = {(r["method"], r["comm_fusion"]): r["borrows_per_step"] for r in reduce}
    assert borrowed[("zero_copy", False)] == reduce[0]["gradients"]   # world 1: all borrowed
    assert borrowed[("pool", False)] == borrowed[("pool", True)] == 0

    summary = data["summary"]
    assert {(r["world_size"], r["comm_fusion"]) for r in summary["reduce_ratios"]} == {
        (1, False), (1, True)}
    f32 = summary["copy_by_pair"]["float32->float32"]
    assert set(f32["pool_vs_memcpy_bandwidth_from_1MiB"]) == {"1 MiB"}
    assert f32["fused_pack_gradients"] == SMALL_COUNT
    assert f32["fused_pack_per_gradient_op_units"] > 0


def test_report_writes_markdown_and_png(quick_results, tmp_path):
    out, _ = quick_results
    written = report.write_report(out, tmp_path / "report")
    md, png = written
    assert md.name == "quick.md" and png.suffix == ".png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    text = md.read_text()
    assert COMMAND in text and "MindSpore 2.10" in text and "cores" in text
    assert f"]({png.name})" in text
    for heading in ("## Copy-in of one gradient", "## Many small gradients",
                    "## Reduce step"):
        assert heading in text
    assert "| float32 -> float32 | 1 MiB |" in text


def test_report_command_line(quick_results, tmp_path, capsys):
    out, _ = quick_results
    assert benchmarks_main(["report", str(out), "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "quick.md").is_file()
    assert benchmarks_main(["report", str(tmp_path / "missing.json")]) == 1
    assert benchmarks_main([]) == 2
    assert "usage" in capsys.readouterr().err


def test_bad_options_are_refused():
    with pytest.raises(runner.BenchmarkError, match="suites"):
        runner.RunOptions(suites=("copy", "nope"))
    with pytest.raises(runner.BenchmarkError, match="nproc"):
        runner.RunOptions(nproc=0)
